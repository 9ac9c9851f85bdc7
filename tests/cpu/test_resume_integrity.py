"""What a resume may trust, round two (issue 27): nothing an output folder or a model folder
says is taken on its word.

- a resume refuses a model whose files changed since the first run (same path or hub id);
- a part damaged since its commit (same size, other bytes) is found by its checksum and its
  rows run again;
- overwrite never deletes files of a folder that holds no prefixflow job, and `prefixflow plan
  --out` never replaces the input, the output or a file that is not a plan table;
- names read from commit records never lead outside the output folder;
- a commit record or `_job.json` that is not valid JSON is named, not a bare JSON error;
- a job whose lock was taken over (its driver died, a resume started) commits nothing more,
  and what it still committed after the takeover is dropped by the new job.

The whole-job cases run on the session's real local Ray.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.commit import COMMITS, JobFenced, OutputLock, drop_fenced, load_committed
from prefixflow.operators.results.write import WriteOptions, prepare_output, read_output, write_part
from prefixflow.storage import StorageOptions

TEMPLATE = "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"


def _rows(n: int = 12) -> list[dict]:
    return [{"id": i, "document": f"doc {i % 3} tells a story", "question": f"why {i}?"} for i in range(n)]


def _spec(root: Path, model: Path, rows: list[dict], **output) -> dict:
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": str(model),
        "input": {"path": str(root / "in.jsonl")},
        "prompt": {"template": TEMPLATE},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
        "output": {"path": str(root / "out"), "format": "jsonl", "rows_per_part": 4, **output},
    }


def _resume(spec: dict) -> object:
    return parse_spec({**spec, "output": {**spec["output"], "resume": True}})


def _as_if_killed(out: Path, keep: int) -> list[str]:
    """Leave `out` as a driver killed mid-job leaves it: the first `keep` parts committed, the
    others never written, no end markers. Returns the kept parts' names."""
    parts = sorted(p.name for p in out.glob("part-*"))
    for name in parts[keep:]:
        (out / name).unlink()
        (out / COMMITS / f"{name}.json").unlink()
    for name in ("_SUCCESS", "metrics.json", "_manifest.json", "plot.png"):
        (out / name).unlink(missing_ok=True)
    return parts[:keep]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_changed_model_is_refused_and_a_damaged_part_runs_its_rows_again(ray_local, tiny_model, tmp_path):
    """One finished job, then as if killed after 3 parts, one of them damaged after its commit:
    a resume under retrained weights is refused and touches nothing; with the first run's
    weights it runs the damaged part's rows again; a planted record is refused by name."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    spec = _spec(tmp_path, model, _rows())
    run_job(parse_spec(spec), quiet=True)
    out = tmp_path / "out"
    kept = _as_if_killed(out, keep=3)
    damaged = sorted(out.glob("part-*"))[1]
    size = damaged.stat().st_size
    damaged.write_bytes(bytes((i * 37 + 11) % 256 for i in range(size)))  # same size, junk
    junk = damaged.read_bytes()
    _flip_last_byte(model / "model.safetensors")  # retrained weights at the same path
    with pytest.raises(
        ValueError,
        match=r"model's files changed since the first run "
        r"\(model.safetensors\)",
    ):
        run_job(_resume(spec), quiet=True)
    assert sorted(p.name for p in out.glob("part-*")) == kept and damaged.read_bytes() == junk  # nothing touched
    _flip_last_byte(model / "model.safetensors")  # the first run's weights again: it resumes
    metrics = run_job(_resume(spec), quiet=True)
    rows = read_output(str(out))  # every part parses again
    assert sorted(r["id"] for r in rows) == list(range(12))
    assert metrics["fault_tolerance"]["rows_committed_before"] == 8  # the damaged part's 4 ran again
    assert f"{COMMITS}/{damaged.name}.json" in metrics["fault_tolerance"]["orphans_removed"]
    # A commit record planted to name a file outside the folder: the resume refuses by name,
    # and the file it names (and every part) is left alone.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    _as_if_killed(out, keep=3)
    part = sorted(out.glob("part-*"))[0].name
    record = out / COMMITS / f"{part}.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "part": "../victim.txt"}))
    with pytest.raises(ValueError, match=r"names part '../victim.txt'"):
        run_job(_resume(spec), quiet=True)
    assert victim.read_text() == "keep me" and (out / part).exists()


def test_overwrite_refuses_a_folder_without_a_prefixflow_job(tmp_path):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"someone else's")
    (out / "_SUCCESS").write_bytes(b"")
    with pytest.raises(ValueError, match="output.overwrite=True but .* holds no prefixflow job"):
        prepare_output(WriteOptions(path=str(out), format="parquet"), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["_SUCCESS", "part-00000.parquet"]


def _record(out: Path, part: str, record: dict | bytes) -> None:
    (out / COMMITS).mkdir(parents=True, exist_ok=True)
    data = record if isinstance(record, bytes) else json.dumps(record).encode()
    (out / COMMITS / f"{part}.json").write_bytes(data)


def test_names_in_commit_records_stay_inside_the_output_folder(tmp_path):
    out, victim = tmp_path / "job" / "out", tmp_path / "victim"
    victim.write_text("keep me")
    out.mkdir(parents=True)
    # A record that names a path outside, under a plain part name, and one whose own file name
    # carries the path: neither deletes anything, both are refused by name.
    _record(out, "part-r000-000000000.jsonl", {"part": "../../victim", "row_ids": [0], "bytes": 1})
    with pytest.raises(ValueError, match=r"names part '../../victim', not 'part-r000-000000000.jsonl'"):
        load_committed(str(out), StorageOptions())
    (out / COMMITS / "part-r000-000000000.jsonl.json").unlink()
    _record(out, "part-..%2F..%2Fvictim", {"part": "part-..%2F..%2Fvictim", "row_ids": [0]})
    with pytest.raises(ValueError, match="not a commit record this job writes"):
        load_committed(str(out), StorageOptions())
    assert victim.read_text() == "keep me"


def test_damaged_json_in_the_output_folder_is_named(tmp_path):
    from prefixflow.operators.results.commit import check_job_file

    out = tmp_path / "out"
    out.mkdir()
    (out / "part-r000-000000000.jsonl").write_bytes(b'{"id": 0}\n')
    _record(out, "part-r000-000000000.jsonl", b'{"part": "part-r000-0000')  # cut short
    seen = load_committed(str(out), StorageOptions())
    # A record that does not parse is as good as missing: its part goes, its rows run again.
    assert seen.num_rows == 0 and "part-r000-000000000.jsonl" in seen.removed
    (out / "_job.json").write_text("{fingerprint: x")
    with pytest.raises(ValueError, match=r"its _job.json is not valid JSON \(Expecting property name"):
        check_job_file(str(out), {"fingerprint": "y"}, StorageOptions(), resume=True)


def _table(row_ids: list[int], replica: int = 0) -> pa.Table:
    n = len(row_ids)
    return pa.table(
        {
            "row_id": row_ids,
            "replica": [replica] * n,
            "_pf_rank": row_ids,
            "error": pa.nulls(n, pa.string()),
            "num_input_tokens": [3] * n,
            "_pf_computed": [3.0] * n,
            "num_generated_tokens": [1] * n,
            "generated_text": ["x"] * n,
        }
    )


def test_a_job_whose_lock_was_taken_over_commits_nothing_more(ray_local, tmp_path):
    """The dead driver's engine actor (a real Ray task here) writes after a resume took the
    path over: it is fenced before it writes a byte. A record it signed just before the
    takeover is dropped by the new job, whose own run covers those rows."""
    out = str(tmp_path / "out")
    storage = StorageOptions()
    old = OutputLock(out, storage).acquire()
    old_opts = WriteOptions(path=out, format="jsonl", fence=old.holder["token"])
    write_part(_table([0, 1]), old_opts)  # committed before the driver died
    old._stop.set()  # the driver dies: no more heartbeats
    old.holder["pid"] = 2**22 + 7  # ... and its pid is gone
    (tmp_path / "out" / "_lock.json").write_text(json.dumps(old.holder))
    new = OutputLock(out, storage).acquire()  # the resume takes the lock at once
    before = load_committed(out, storage)
    # An actor of the dead job that checked the lock just before the takeover commits rows 2-3.
    late = WriteOptions(path=out, format="jsonl", fence=None)
    write_part(_table([2, 3]), late)
    record = tmp_path / "out" / COMMITS / "part-r000-000000002.jsonl.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "writer": old.holder["token"]}))

    import ray

    @ray.remote(num_cpus=0)
    def old_actor_writes() -> str:
        try:
            write_part(_table([4, 5]), old_opts)
        except JobFenced as e:
            return str(e)
        return "written"

    assert "taken over by another job" in ray.get(old_actor_writes.remote())
    assert not (tmp_path / "out" / "part-r000-000000004.jsonl").exists()
    # The new job writes rows 2-5 itself, then drops what the dead job signed after `before`.
    new_opts = WriteOptions(path=out, format="jsonl", fence=new.holder["token"])
    write_part(_table([4, 5]), new_opts)
    final, dropped = drop_fenced(out, storage, new.holder["token"], before, load_committed(out, storage))
    assert dropped == ["part-r000-000000002.jsonl"] and final.row_ids.tolist() == [0, 1, 4, 5]
    write_part(_table([2, 3]), new_opts)
    assert load_committed(out, storage).row_ids.tolist() == [0, 1, 2, 3, 4, 5]
    new.release()


def test_plan_out_never_replaces_the_input_or_a_stranger_file(ray_local, tiny_model, tmp_path, capsys):
    from prefixflow.cli import main as cli

    spec = _spec(tmp_path, tiny_model, _rows(6))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    original = (tmp_path / "in.jsonl").read_bytes()
    (tmp_path / "notes.parquet").write_bytes(b"my own notes")
    for target, why in [
        (tmp_path / "in.jsonl", "is inside the input"),
        (tmp_path / "out" / "plan.parquet", "inside the job's output.path"),
        (tmp_path / "notes.parquet", "is not a plan table"),
    ]:
        assert cli(["plan", str(tmp_path / "job.yaml"), "--out", str(target)]) == 2
        err = capsys.readouterr().err
        assert f"--out: '{target}' " in err and why in err, err
    assert (tmp_path / "in.jsonl").read_bytes() == original
    assert (tmp_path / "notes.parquet").read_bytes() == b"my own notes"
    plan = tmp_path / "plan.parquet"
    assert cli(["plan", str(tmp_path / "job.yaml"), "--out", str(plan)]) == 0
    assert cli(["plan", str(tmp_path / "job.yaml"), "--out", str(plan)]) == 0  # its own table: replaced
