"""A job planned in windows (window_rows): the window sizes, the work queue that takes windows
as they come, the windows' plans seen whole, plan_windows over a real Ray dataset, and a
windowed job killed between windows and resumed (every row once) on the session's local Ray."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from prefixflow.bench.fault_bench import local_records
from prefixflow.jobs.demo import demo_rows
from prefixflow.operators.results.write import read_output
from prefixflow.operators.stages.work_queue import DONE, UNIT, WAIT, WorkQueue
from prefixflow.pipeline import build_plan
from prefixflow.pipeline.windows import continued_table, merge_summaries, window_sizes

JOB_TIMEOUT_S = 300


def test_windows_start_small_and_double_up_to_the_cap():
    sizes = window_sizes(160)
    assert [next(sizes) for _ in range(7)] == [10, 20, 40, 80, 160, 160, 160]
    assert next(window_sizes(8)) == 1
    with pytest.raises(ValueError, match="window_rows=0"):
        next(window_sizes(0))


def test_the_queue_says_wait_until_it_is_closed_and_takes_windows_as_they_come():
    queue = WorkQueue([0], [1.0], 2, payloads=["ref0"], closed=False)
    first = queue.take(0, "a")
    assert (first.kind, first.unit, first.payload) == (UNIT, 0, "ref0")
    # Nothing left to take or steal, but the next window may bring work: WAIT, not DONE.
    assert queue.take(1, "b").kind == WAIT and queue.take(0, "a").kind == WAIT
    assert not queue.counts()["all_done"]
    # The next window: units numbered on, one of them committed whole by an earlier run.
    assert queue.add([1, 0, 1], [1.0, 1.0, 1.0], ["ref1", "ref2", "ref3"], {3: [7]}, done_units=[2]) == 1
    assert queue.counts()["queued"] == [0, 2]
    got = queue.take(1, "b")
    assert (got.unit, got.payload, got.rows) == (1, "ref1", None)
    got = queue.take(1, "b")
    assert (got.unit, got.payload, got.rows) == (3, "ref3", (7,))
    queue.close()
    for unit in (0, 1, 3):
        queue.finished(unit, "a" if unit == 0 else "b")
    assert queue.take(0, "a").kind == DONE and queue.counts()["all_done"]
    # The static plan too waits for the next window rather than ending its replica.
    static = WorkQueue([0], [1.0], 2, steal=False, closed=False)
    assert static.take(1, "b").kind == WAIT


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    return [docs[i % 3] + rng.integers(0, 50, 5).tolist() for i in range(n)]


def test_the_windows_summaries_add_up_and_their_tables_continue_the_numbering():
    a = build_plan(_prompts(1, 9), num_replicas=2, output_lens=[8] * 9, min_prefix_len=4)
    b = build_plan(_prompts(2, 6), row_ids=range(9, 15), num_replicas=2, output_lens=[8] * 6, min_prefix_len=4)
    merged = merge_summaries([a.summary, b.summary])
    for key in ("num_rows", "num_groups", "prompt_tokens", "computed_prompt_tokens", "num_units"):
        assert merged[key] == a.summary[key] + b.summary[key]
    assert merged["token_saving_ratio"] == pytest.approx(1 - merged["computed_prompt_tokens"] / merged["prompt_tokens"])
    assert merged["num_windows"] == 2 and merged["window_rows"] == [9, 6]
    for r in range(2):
        rep = merged["replicas"][r]
        assert rep["num_rows"] == a.summary["replicas"][r]["num_rows"] + b.summary["replicas"][r]["num_rows"]
    ranks = [rep["num_rows"] for rep in a.summary["replicas"]]
    groups = len(a.run_starts) - 1
    table = continued_table(b.table, groups, ranks)
    for r in range(2):
        mine = table.filter(pa.compute.equal(table.column("replica"), r))
        assert sorted(mine.column("rank").to_pylist()) == list(range(ranks[r], ranks[r] + mine.num_rows))
    assert min(table.column("group_id").to_pylist()) == groups


def test_a_resume_names_a_window_planned_otherwise_apart_from_a_changed_input(tmp_path):
    from prefixflow.operators.results.commit import check_window
    from prefixflow.operators.stages.plan import PlannedJob, RowIndex
    from prefixflow.storage import StorageOptions

    plan = build_plan(_prompts(1, 9), num_replicas=2, min_prefix_len=4)
    window = PlannedJob(plan, RowIndex((None,), np.array([0, 9])), np.zeros(0, np.int64), content_digest="c", window=0)
    recorded: list[dict] = []
    check_window(str(tmp_path), {}, recorded, window, 2, StorageOptions())
    first = dict(recorded[0])
    recorded[0] = {**first, "plan": "another"}  # as another version's planner would have planned it
    with pytest.raises(ValueError, match="another plan of this input: window 0 is not planned as the first run"):
        check_window(str(tmp_path), {}, recorded, window, 2, StorageOptions())
    recorded[0] = {**first, "input_content": "other"}
    with pytest.raises(ValueError, match=r"different input: window 0 .* \(its content changed\)"):
        check_window(str(tmp_path), {}, recorded, window, 2, StorageOptions())


def test_a_resume_planned_whole_first_and_in_windows_now_says_how_to_plan_it_as_before(tmp_path, tiny_model):
    """A job of more than 4M rows started whole (before an unset window_rows meant windows for
    it) and resumed now: refused by name, with the setting that plans it as it was; window_rows
    0 and unset are one spec (the plan's own identity tells whole from windows)."""
    from prefixflow.jobs.spec import load_spec
    from prefixflow.operators.results.commit import check_job_file, job_identity
    from prefixflow.storage import StorageOptions

    rows = demo_rows(num_docs=2, questions_per_doc=2, seed=9)
    path = _job(tmp_path, tiny_model, rows, files=1, window_rows=None)
    unset = load_spec(path)
    spec = yaml.safe_load(path.read_text())
    (tmp_path / "zero.yaml").write_text(yaml.safe_dump({**spec, "window_rows": 0}))
    assert unset.to_job().identity_key == load_spec(tmp_path / "zero.yaml").to_job().identity_key

    class Whole:  # what job_identity reads of a plan
        content_digest = "c" * 64

    out = tmp_path / "out"
    out.mkdir()
    inputs = [["in/part-00.jsonl", 10]]
    whole = job_identity(None, 2, unset.to_job().identity_key, inputs) | {"fingerprint": "a" * 64}
    whole |= {"input_content": Whole.content_digest, "plan": "p" * 64}
    windows = job_identity(None, 2, unset.to_job().identity_key, inputs)
    check_job_file(str(out), whole, StorageOptions(), resume=False)
    with pytest.raises(ValueError, match="planned the job whole and this run plans it in windows: set window_rows: 0"):
        check_job_file(str(out), windows, StorageOptions(), resume=True)


def test_the_progress_line_grows_with_the_windows():
    from prefixflow.jobs.report import Progress

    progress = Progress(total_rows=0, quiet=True)
    progress.add_rows(5, 1, window=True)
    assert "rows 0/4" in progress.line() and "1 window planned" in progress.line()
    progress.add_rows(10, 0, window=True)
    assert "rows 0/14" in progress.line() and "2 windows planned" in progress.line()


def test_a_window_that_fails_to_plan_fails_the_job_at_once():
    from prefixflow.operators.stages.windows import WindowFeed

    def windows():
        raise OSError("input part-07.jsonl vanished")
        yield  # a generator, as plan_windows

    feed = WindowFeed(windows(), 2)
    feed.start()
    feed.thread.join(timeout=10)
    with pytest.raises(OSError, match="vanished"):
        feed.poll()
    assert feed.ended


def _tokenized_blocks(prompts: list[list[int]], errors: dict[int, str], per_block: int) -> list[pa.Table]:
    err = [errors.get(i) for i in range(len(prompts))]
    return [
        pa.table(
            {
                "_pf_tokens": pa.array(prompts[lo : lo + per_block], pa.list_(pa.int32())),
                "_pf_error": pa.array(err[lo : lo + per_block], pa.string()),
            }
        )
        for lo in range(0, len(prompts), per_block)
    ]


def test_plan_windows_plans_every_row_once_in_windows_numbered_on(ray_local):
    import ray

    from prefixflow.operators.stages.plan import unit_payload_refs
    from prefixflow.operators.stages.window_plans import joined_windows, plan_windows, window_summary

    prompts = _prompts(3, 40)
    prompts[13] = []
    blocks = _tokenized_blocks(prompts, {13: "bad row"}, per_block=5)
    ds = ray_local.data.from_arrow(blocks)
    ds.context.execution_options.preserve_order = True
    windows = list(plan_windows(ds, 32, order="batchllm", num_replicas=2, block_size=4))
    # Sizes 2, 4, 8, 16, 32 rows, each cut at the first block boundary past it: 5, 5, 10, 20 rows.
    assert [w.rows.num_rows for w in windows] == [5, 5, 10, 20]
    assert [w.window for w in windows] == [0, 1, 2, 3]
    assert [w.rows.first_row for w in windows] == [0, 5, 10, 20]
    assert np.concatenate([w.error_row_ids for w in windows]).tolist() == [13]
    units, groups = 0, 0
    for w in windows:
        assert (w.first_unit, w.first_group) == (units, groups)
        good = [i for i in range(w.rows.first_row, w.rows.first_row + w.rows.num_rows) if i != 13]
        assert sorted(w.plan.table.column("row_id").to_pylist()) == good
        units, groups = units + w.plan.num_units, groups + len(w.plan.run_starts) - 1
    # Payloads carry the job's numbering: unit ids on from the windows before, group ids too,
    # and each replica's ranks continued (part names never repeat across windows).
    seen_units, seen_groups, ranks = [], set(), {0: [], 1: []}
    for w in windows:
        for refs in unit_payload_refs(w, 2):
            for payload in ray.get(refs):
                seen_units.append(payload.unit.unit_id)
                seen_groups.update(g.group_id for g in payload.unit.groups)
                ranks[payload.unit.replica] += payload.ranks.tolist()
                assert payload.rows.num_rows == len(payload.unit.row_ids)
    assert sorted(seen_units) == list(range(units)) and max(seen_groups) < groups
    for r in (0, 1):
        assert sorted(ranks[r]) == list(range(len(ranks[r])))
    whole = joined_windows([window_summary(w) for w in windows])  # as a running job keeps them: no tables
    assert whole.rows.num_rows == 40 and whole.plan.summary["num_rows"] == 39 and whole.plan.table is None
    assert whole.plan.summary["num_windows"] == 4 and whole.plan.group_sizes.sum() == 39
    assert len(whole.plan.group_sizes) == groups
    table = joined_windows([window_summary(w, keep_table=True) for w in windows]).plan.table  # `prefixflow plan`
    assert sorted(table.column("row_id").to_pylist()) == [i for i in range(40) if i != 13]
    assert sorted(table.column("group_id").to_pylist()) == sorted(
        g for g, n in enumerate(whole.plan.group_sizes) for _ in range(n)
    )
    for r in (0, 1):  # each replica's ranks continue across windows: part names never repeat
        ranks_r = table.filter(pa.compute.equal(table.column("replica"), r)).column("rank").to_pylist()
        assert sorted(ranks_r) == list(range(len(ranks_r)))
    _windows_planned_at_once_see_the_homes_of_the_windows_planners_before(ds, windows)


def _windows_planned_at_once_see_the_homes_of_the_windows_planners_before(ds, one: list) -> None:
    """The same dataset planned with 3 windows at once (twice), against `one` planner's windows."""
    from prefixflow.operators.stages.window_plans import plan_windows

    three, again = (list(plan_windows(ds, 32, 3, order="batchllm", num_replicas=2, block_size=4)) for _ in "ab")
    assert [w.rows.num_rows for w in three] == [w.rows.num_rows for w in one] == [5, 5, 10, 20]
    # Three documents repeat in every window. One planner: each window after the first finds
    # them where the windows before ran. Three at once: windows 1 and 2 were planned before
    # window 0 was merged (no homes), window 3 against the homes after window 0.
    hits = [[w.plan.summary["home_hit_tokens"] > 0 for w in ws] for ws in (one, three)]
    assert hits == [[False, True, True, True], [False, False, False, True]]
    units, groups = 0, 0
    for w, w2 in zip(three, again, strict=True):  # the same plan in every run, numbered on
        assert (w.window, w.first_unit, w.first_group) == (w2.window, units, groups)
        assert w.plan.table.equals(w2.plan.table) and w.home_entries is not None
        assert w.planned_on and w.timings["plan_task_s"] > 0  # planned by a task, on a node
        units, groups = units + w.plan.num_units, groups + len(w.plan.run_starts) - 1
    rows = sorted(r for w in three for r in w.plan.table.column("row_id").to_pylist())
    assert rows == [i for i in range(40) if i != 13]


def _block_held_until(batch: dict, flag: str, blocks: list) -> pa.Table:
    """Block batch["id"][0] of `blocks`; block 1 only once the file `flag` exists."""
    b = int(batch["id"][0])
    while b == 1 and not Path(flag).exists():
        time.sleep(0.05)
    return blocks[b]


def test_a_window_is_handed_out_while_the_next_block_is_still_being_read(ray_local, tmp_path):
    import threading

    from prefixflow.operators.stages.window_plans import plan_windows

    blocks = _tokenized_blocks(_prompts(4, 15), {}, per_block=5)
    flag = tmp_path / "read-on"
    ds = ray_local.data.range(3, override_num_blocks=3).map_batches(
        _block_held_until, batch_size=1, fn_kwargs={"flag": str(flag), "blocks": blocks}, batch_format="numpy"
    )
    windows = plan_windows(ds, 32, 2, order="batchllm", num_replicas=2, block_size=4)
    first: list = []
    taker = threading.Thread(target=lambda: first.append(next(windows)), daemon=True)
    taker.start()
    taker.join(timeout=120)  # block 1 is held back until window 0 is out: no clock decides
    flag.touch()
    assert first and first[0].window == 0 and first[0].rows.num_rows == 5
    rest = list(windows)
    assert [w.rows.first_row for w in rest] == [5, 10]
    # A consumer done early (a dry run's sample, a stopped job) closes the windows: the reader
    # thread, waiting for block 1, ends once that comes, and takes no more.
    held = tmp_path / "read-on-again"
    again = ray_local.data.range(3, override_num_blocks=3).map_batches(
        _block_held_until, batch_size=1, fn_kwargs={"flag": str(held), "blocks": blocks}, batch_format="numpy"
    )
    before = set(threading.enumerate())
    early = plan_windows(again, 32, 2, order="batchllm", num_replicas=2, block_size=4)
    assert next(early).window == 0
    (reader,) = [t for t in set(threading.enumerate()) - before if t.name == "prefixflow-window-reader"]
    early.close()
    held.touch()
    reader.join(timeout=60)
    assert not reader.is_alive()


def _block_or_vanished(batch: dict, blocks: list) -> pa.Table:
    if int(batch["id"][0]) == 1:
        raise OSError("input part-01.jsonl vanished")
    return blocks[int(batch["id"][0])]


def test_a_block_that_fails_to_read_fails_the_windows(ray_local):
    from prefixflow.operators.stages.window_plans import plan_windows

    blocks = _tokenized_blocks(_prompts(5, 15), {}, per_block=5)
    ds = ray_local.data.range(3, override_num_blocks=3).map_batches(
        _block_or_vanished, batch_size=1, fn_kwargs={"blocks": blocks}, batch_format="numpy"
    )
    ds.context.execution_options.preserve_order = True
    windows = plan_windows(ds, 32, 2, order="batchllm", num_replicas=2, block_size=4)
    with pytest.raises(Exception, match="vanished"):  # read on the reader's thread, raised here
        list(windows)


@pytest.mark.slow
def test_the_python_api_runs_a_job_in_windows_with_the_answers_of_one_plan(ray_local, tiny_model):
    # Imported here: Ray's workers unpickle this module's functions (_block_held_until) by
    # importing it, and the tests' `support` package is not on their path.
    from support.native import native_tokens

    import prefixflow

    rows = demo_rows(num_docs=6, questions_per_doc=4, sentences_per_doc=3, seed=2)  # 24 rows
    # Bad rows in two windows: error records, each once (the error records' actor runs again
    # for the second window's, and must not write the first's again).
    rows[5]["document"] = rows[20]["document"] = None

    spec = {
        "model": str(tiny_model),
        "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_tokens": 6},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
    }
    config = prefixflow.ProcessorConfig(**spec, replicas=2, tokenize_batch_size=4, window_rows=16)
    processor = prefixflow.build_processor(config)
    out = processor(ray_local.data.from_items(rows, override_num_blocks=6)).take_all()
    windowed, summary = sorted(out, key=lambda r: r["id"]), processor.plan_summary()
    assert [r["id"] for r in windowed] == sorted(r["id"] for r in rows)  # every row once
    assert summary["num_windows"] >= 3 and sum(summary["window_rows"]) == 22
    bad = {rows[5]["id"], rows[20]["id"]}
    assert [r["error"] is not None for r in windowed] == [r["id"] in bad for r in windowed]
    # The answers of one plan: greedy outputs as the same engine gives them for the whole job at
    # once (the replica runner in this process: cheaper than a second whole job).
    whole = native_tokens(spec, [r for r in rows if r["id"] not in bad])
    assert {r["id"]: list(r["generated_tokens"]) for r in windowed if r["id"] not in bad} == whole


def _job(root: Path, model: Path, rows: list[dict], files: int, window_rows: int | None = 32) -> Path:
    """A folder of `files` JSONL files (a block each, tokenized in batches smaller than a file)."""
    data = root / "in"
    data.mkdir()
    per = -(-len(rows) // files)
    for f in range(files):
        with open(data / f"part-{f:02d}.jsonl", "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in rows[f * per : (f + 1) * per])
    spec = {
        "model": str(model),
        "input": {"path": str(data), "format": "jsonl"},
        "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_tokens": 24},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_num_seqs": 2},
        "replicas": 2,
        "window_rows": window_rows,
        "tokenize": {"batch_size": 4},
        "output": {"path": str(root / "out"), "format": "jsonl", "rows_per_part": 2, "resume": True},
    }
    if window_rows is None:  # unset: the job's size decides (jobs/run.sized_windows)
        del spec["window_rows"]
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    return root / "job.yaml"


def _windows_recorded(out: Path) -> int:
    try:
        return len(json.loads((out / "_job.json").read_text()).get("windows", []))
    except (FileNotFoundError, ValueError):
        return 0


def _wait(cond, proc, what: str) -> None:
    deadline = time.time() + JOB_TIMEOUT_S
    while not cond():
        assert proc.poll() is None, f"the driver ended before {what}:\n{proc.log_path.read_text()[-4000:]}"
        assert time.time() < deadline, f"no {what} within {JOB_TIMEOUT_S} s"
        time.sleep(0.02)


def _finish(proc, ok: bool = True) -> str:
    rc = proc.wait(timeout=JOB_TIMEOUT_S)
    log = proc.log_path.read_text(errors="replace")
    assert (rc == 0) == ok, f"exit {rc}:\n{log[-4000:]}"
    return log


def test_a_dry_run_of_a_windowed_job_plans_its_first_windows(ray_local, tiny_model, tmp_path):
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import load_spec

    rows = demo_rows(num_docs=8, questions_per_doc=5, sentences_per_doc=4, seed=9)
    result = run_job(load_spec(_job(tmp_path, tiny_model, rows, files=8)), dry_run=True, quiet=True)
    plan = result["plan"]
    assert result["num_rows"] == 40 and plan["num_rows"] == 40
    assert plan["num_windows"] == 4 and plan["window_rows"] == [5, 5, 10, 20]
    assert "sample" not in result  # four windows: every one planned
    assert not (tmp_path / "out").exists()
    # A longer input: the dry run plans its first DRY_RUN_WINDOWS windows (window_rows 16: 5, 5,
    # 5, 10 and 20 rows, cut at the 5-row files), counts the input's rows and scales the rest.
    rows = demo_rows(num_docs=16, questions_per_doc=5, sentences_per_doc=4, seed=9)  # 80 rows, 16 files
    (tmp_path / "long").mkdir()
    result = run_job(load_spec(_job(tmp_path / "long", tiny_model, rows, files=16, window_rows=16)), dry_run=True)
    plan, sample = result["plan"], result["sample"]
    assert plan["num_windows"] == 5 and plan["window_rows"] == [5, 5, 5, 10, 20] and result["num_rows"] == 45
    assert sample["rows"] == 45 and sample["input_rows"] == 80 and sample["windows"] == 5
    assert sample["computed_prompt_tokens"] == round(plan["computed_prompt_tokens"] * 80 / 45)
    assert sample["prompt_tokens"] > plan["prompt_tokens"]


def test_the_input_is_counted_before_it_is_read(tmp_path):
    """Parquet's rows exactly, from the footers; JSONL's from the files' sizes and the lines at
    the start of the first; limit caps them; a table's are not counted here."""
    import pyarrow.parquet as pq

    from prefixflow.operators.stages.read import ReadOptions, estimated_rows
    from prefixflow.operators.stages.read_table import TableInput

    rows = demo_rows(num_docs=8, questions_per_doc=5, sentences_per_doc=4, seed=9)
    (tmp_path / "pq").mkdir()
    for k in range(3):
        pq.write_table(pa.Table.from_pylist(rows[k::3]), tmp_path / "pq" / f"part-{k}.parquet")
    assert estimated_rows(ReadOptions(str(tmp_path / "pq"), "parquet")) == 40
    assert estimated_rows(ReadOptions(str(tmp_path / "pq"), "parquet", limit=7)) == 7
    (tmp_path / "jsonl").mkdir()
    for k in range(4):
        with open(tmp_path / "jsonl" / f"part-{k}.jsonl", "w") as out:
            out.writelines(json.dumps(r) + "\n" for r in rows[k * 10 : (k + 1) * 10])
    assert abs(estimated_rows(ReadOptions(str(tmp_path / "jsonl"), "jsonl")) - 40) <= 4
    table = TableInput("delta", str(tmp_path / "t"))
    assert estimated_rows(ReadOptions(str(tmp_path / "t"), "parquet", table=table)) is None


def test_a_job_that_leaves_window_rows_unset_is_windowed_by_its_size(ray_local, tiny_model, tmp_path, monkeypatch):
    """Above AUTO_WINDOW_ABOVE input rows a job planned whole would keep every engine waiting
    for all of it (and hold ~250 bytes a row on the driver): unset, window_rows becomes
    AUTO_WINDOW_ROWS; at or below, one plan; set, as set (0: one plan). (Dry runs: the plans,
    no engine.)"""
    from prefixflow.jobs import run
    from prefixflow.jobs.spec import load_spec

    rows = demo_rows(num_docs=8, questions_per_doc=5, sentences_per_doc=4, seed=9)  # 40 rows
    spec = load_spec(_job(tmp_path, tiny_model, rows, files=8, window_rows=None))
    monkeypatch.setattr(run, "AUTO_WINDOW_ROWS", 16)  # the sizes of a job 250,000 times this one's
    monkeypatch.setattr(run, "AUTO_WINDOW_ABOVE", 80)  # about 40 rows, from the JSONL files' sizes
    assert run.sized_windows(spec.to_job()).config.window_rows is None
    assert "num_windows" not in run.run_job(spec, dry_run=True, quiet=True)["plan"]
    monkeypatch.setattr(run, "AUTO_WINDOW_ABOVE", 20)
    assert run.sized_windows(spec.to_job()).config.window_rows == 16
    plan = run.run_job(spec, dry_run=True, quiet=True)["plan"]
    assert plan["num_rows"] == 40 and plan["num_windows"] > 1
    (tmp_path / "set").mkdir()
    spec = load_spec(_job(tmp_path / "set", tiny_model, rows, files=8, window_rows=64))
    assert run.sized_windows(spec.to_job()).config.window_rows == 64
    (tmp_path / "whole").mkdir()  # 0: one plan, whatever the size
    spec = load_spec(_job(tmp_path / "whole", tiny_model, rows, files=8, window_rows=0))
    assert run.sized_windows(spec.to_job()).config.window_rows == 0
    assert "num_windows" not in run.run_job(spec, dry_run=True, quiet=True)["plan"]


@pytest.mark.slow
def test_a_windowed_job_killed_between_windows_resumes_with_every_row_once(start_driver, tiny_model, tmp_path):
    rows = demo_rows(num_docs=8, questions_per_doc=5, sentences_per_doc=4, seed=9)  # 40 rows, 8 files of 5
    job = _job(tmp_path, tiny_model, rows, files=8)
    out = tmp_path / "out"
    proc = start_driver(job)
    # Rows ran before the job was planned whole: parts are committed while windows are still
    # to come (windows of 2, 4, 8, 16, 32 rows, cut at the files' 5-row blocks: 5, 5, 10, 20).
    _wait(lambda: local_records(out) and 1 <= _windows_recorded(out) < 4, proc, "a part before the last window")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    windows_then = _windows_recorded(out)
    committed = {r for rec in local_records(out) for r in rec["row_ids"]}
    assert windows_then < 4 and 0 < len(committed) < len(rows)
    # The same input with one letter changed in the first file (same size, so the listing of
    # the files cannot tell): the resume refuses the window the first run planned from it, by
    # name, before any of its rows run. (A window the first run never planned may change.)
    first = sorted((tmp_path / "in").iterdir())[0]
    text = first.read_text()
    at = text.index('"question": "') + len('"question": "')
    first.write_text(text[:at] + text[at].swapcase() + text[at + 1 :])
    # In this process (the session's Ray), as the CLI runs it: a driver process would only add
    # its start-up to the same refusal.
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import load_spec

    with pytest.raises(
        ValueError, match=r"window 0 of the input is not the one the first run planned \(its content changed\)"
    ):
        run_job(load_spec(job), quiet=True)
    assert not (out / "_SUCCESS").exists()
    first.write_text(text)
    log = _finish(start_driver(job))
    assert "4 windows planned" in log  # the live line counts the windows as they are queued
    got = read_output(str(out))
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)  # every row once: 0 lost, 0 twice
    assert sorted(r["row_id"] for r in got) == list(range(len(rows)))
    assert all(r["error"] is None and r["generated_text"] for r in got)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["plan"]["num_windows"] == 4 and metrics["plan"]["window_rows"] == [5, 5, 10, 20]
    assert metrics["fault_tolerance"]["rows_committed_before"] >= len(committed)
    assert _windows_recorded(out) == 4
    for rep in metrics["per_replica"]:  # when each engine finished its first row (stream_job_bench)
        if rep["num_rows"]:
            assert rep["engine_ready_s"] <= rep["first_output_s"] <= rep["end_s"], rep


def test_stream_bench_counts_what_windows_cost_against_one_plan():
    from prefixflow.bench.stream_bench import run

    result = run(rows=120, replicas=2)
    for name, w in result["workloads"].items():
        whole = w["global_plan"]
        assert 0 < whole["computed_if_cached"] <= whole["computed"] <= w["prompt_tokens"], name
        for label, cell in w["windows"].items():
            assert sum(cell["windows"]) == 120 and cell["num_windows"] >= 2, label
            if label.endswith("no affinity"):
                # A cache that keeps every prefix computes no more than one that keeps none.
                assert cell["computed_if_cached"] <= cell["computed"], label
            else:
                # Sent where their prefixes are, the windows compute less than planned alone
                # (sorted rows have few prefixes in earlier windows: no more, there).
                alone = w["windows"][label + ", no affinity"]["computed"]
                assert cell["computed"] <= alone if "sorted" in label else cell["computed"] < alone, label
        # Planned whole in windows of 1/16, a shuffled job computes more than its one plan.
        assert w["windows"]["1/16"]["ratio_to_global"] > 1.0
