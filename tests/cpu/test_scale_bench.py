"""scale_bench's workload and figures are what issues 28 and 38 ask for (the bench itself needs a
quiet machine and a multi-node cluster: it is run by hand, `python -m prefixflow.bench.scale_bench`)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from prefixflow.bench.scale_bench import _ray_kept, _with_blocks, acceptance, cell_summary, figures
from prefixflow.bench.scale_merge import merge, read_file_arg
from prefixflow.bench.scale_systems import _ray_record, locality_order, pool_view, record_dispatch, task_handouts
from prefixflow.bench.scale_workload import choose_eos, length_summary, make_rows, prompt_token_floors, zipf_counts
from prefixflow.bench.sim_dispatch_check import extract


def test_question_counts_follow_a_zipf_law():
    counts = zipf_counts(2048, 614, 1.3)
    assert sum(counts) == 2048 and counts == sorted(counts, reverse=True)
    assert counts[0] >= 300 and counts[2] >= 100  # a few documents asked hundreds of times
    assert sum(1 <= c <= 5 for c in counts) > len(counts) / 2  # most asked one to five


def test_rows_have_long_documents_varied_outputs_and_arrive_shuffled(tiny_model):
    from prefixflow.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    rows = make_rows(tok, 300, seed=1)
    assert [r["id"] for r in rows] == list(range(300))
    per_doc = Counter(r["doc_id"] for r in rows)
    docs = {r["doc_id"]: r["document"] for r in rows}
    assert all(200 <= len(tok.encode(d)) <= 2400 for d in docs.values())
    assert {r["max_tokens"] for r in rows} <= set(range(8, 129)) and len({r["max_tokens"] for r in rows}) > 50
    assert max(per_doc.values()) >= 60
    hot = per_doc.most_common(1)[0][0]  # shuffled: the hot document's rows do not come together
    positions = [i for i, r in enumerate(rows) if r["doc_id"] == hot]
    assert positions[-1] - positions[0] > len(positions)
    assert len({(r["doc_id"], r["question"]) for r in rows}) == 300


def test_prompt_token_floors_count_distinct_tokens_and_whole_blocks():
    # Sorted: abcd, abcd (shares 3 of its 4: one whole block of 2), abce (the same), z.
    prompts = [[1, 2, 3, 5], [9], [1, 2, 3, 4], [1, 2, 3, 4]]
    assert prompt_token_floors(prompts, block=2) == {
        "prompt_tokens": 13,
        "distinct_prompt_tokens": 6,
        "whole_block_floor": 4 + 2 + 2 + 1,
    }
    # One token per block: every shared token is reused, but a prompt met whole recomputes its last.
    assert prompt_token_floors(prompts, block=1)["whole_block_floor"] == 4 + 1 + 1 + 1


def test_the_eos_is_the_token_that_spreads_the_lengths_most():
    cap = 40
    # Token 7 first appears at 2, 5, 9, ..., 38 (wide spread); token 3 at 10 in every row
    # (no spread); token 5 never before the cap in most rows.
    outputs = []
    for k in range(10):
        at = [2, 5, 9, 12, 15, 18, 24, 30, 35, 38][k]
        out = [1] * cap
        out[at - 1] = 7
        out[9] = 3 if at != 10 else 4
        outputs.append(out)
    eos, lengths = choose_eos(outputs, cap)
    assert eos == 7 and lengths == [2, 5, 9, 12, 15, 18, 24, 30, 35, 38]
    summary = length_summary(lengths, cap)
    assert summary["min"] == 2 and summary["max"] == 38 and summary["at_cap"] == 0.0
    assert sum(summary["histogram"]) == 10


def test_ray_blocks_are_equal_stretches_of_the_sorted_rows():
    record = _with_blocks({"num_blocks": 4}, sorted_ids=[5, 2, 7, 1, 0, 3, 6, 4])
    assert record["block_rows"] == [2, 2, 2, 2]
    assert record["block_row_ids"] == [[5, 2], [7, 1], [0, 3], [6, 4]]
    assert record["row_block"][3] == 2
    assert _with_blocks({"wall_s": 1.0}, [0, 1]) == {"wall_s": 1.0}  # prefixflow: no blocks


def test_a_ray_run_records_when_each_task_began_on_its_engine_and_the_extract_keeps_it():
    from types import SimpleNamespace

    # Two engines (pids 7, 9), three tasks: "a" and "c" on engine 7, "b" on engine 9, each task's
    # rows reaching vLLM a little apart; t0 = 100.
    def row(i, pid, task, arrival):
        return dict(
            id=i, pid=pid, batch_uuid=task, arrival_time=arrival, finished_at=arrival + 5, num_input_tokens=10,
            num_cached_tokens=4, node_id="n", omp_threads="1", engine_ready_at=99.0, generated_tokens=[1],
        )  # fmt: skip

    rows = [row(0, 7, "a", 101.0), row(1, 7, "a", 101.2), row(2, 9, "b", 101.5), row(3, 7, "c", 103.0)]
    config = SimpleNamespace(batch_size=2, max_concurrent_batches=8)
    rec = _ray_record("ray_llm_sorted_default", 2, rows, config, {}, 2, 64, t0=100.0)
    assert rec["row_batch"] == {0: 0, 1: 0, 2: 1, 3: 2} and rec["batch_rows"] == [2, 1, 1]
    assert rec["batch_first_request_s"] == pytest.approx([1.0, 1.5, 3.0])
    assert rec["batch_finished_s"] == pytest.approx([6.2, 6.5, 8.0])  # each task's last row, 5 s after it came
    assert rec["row_engine"] == {0: 0, 1: 0, 2: 1, 3: 0} and rec["rows_per_engine"] == [3, 1]
    rec["workload"] = "model_decided"
    kept = extract({"runs": {"ray_llm_sorted_default/model_decided/2": {"repeats": [rec]}}})
    (only,) = kept["runs"]["ray_llm_sorted_default/model_decided/2"]["repeats"]
    assert only["batch_first_request_s"] == rec["batch_first_request_s"] and "outputs" not in only
    assert only["batch_finished_s"] == rec["batch_finished_s"]


def test_each_ray_task_is_matched_to_its_hand_out_by_the_order_tasks_started_on_its_actor():
    """The driver's log names actors, not tasks: actor "A" was handed two tasks (at 1.0 and
    2.0 s, their blocks there at 0.5 and 1.5 s), "B" one. On A the task with rows 2-3 started
    first, so it is the one handed out at 1.0 s, whatever the tasks' numbering (t0 = 100)."""

    def row(i, actor, started):
        return {"id": i, "actor_id": actor, "task_started_at": started}

    rows = [row(0, "A", 103.0), row(1, "A", 103.0), row(2, "A", 101.5), row(3, "A", 101.5), row(4, "B", 101.2)]
    row_batch = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    log = [
        {"at": 101.0, "actor": "A", "rows": 2, "arrived_at": 100.5, "data_nodes": ["n1", "n2"]},
        {"at": 101.1, "actor": "B", "rows": 1, "arrived_at": 100.4, "data_nodes": ["n2"]},
        {"at": 102.0, "actor": "A", "rows": 2, "arrived_at": 101.5, "data_nodes": ["n2", "n3", "n1"]},
    ]
    got = task_handouts(rows, row_batch, [2, 2, 1], log, t0=100.0)
    assert got["dispatch_log_matched"]
    assert got["batch_handout_s"] == pytest.approx([2.0, 1.0, 1.1])
    assert got["batch_arrive_s"] == pytest.approx([1.5, 0.5, 0.4]) and got["batch_data_node"] == ["n2", "n1", "n2"]
    assert got["batch_data_nodes"] == [["n2", "n3", "n1"], ["n1", "n2"], ["n2"]]
    # A log that does not fit the tasks (a hand-out missing, or of other sizes) is not used,
    # ... nor one that hands a task out after it started (two tasks on one actor swapped)
    for bad in (log[:2], [{**e, "rows": 3} for e in log], [{**log[0], "at": 101.8}, *log[1:]]):
        assert task_handouts(rows, row_batch, [2, 2, 1], bad, 100.0) == {
            "dispatch_log_matched": False,
            "batch_handout_s": None,
            "batch_arrive_s": None,
            "batch_data_node": None,
            "batch_data_nodes": None,
        }
    assert not task_handouts([{**r, "actor_id": None} for r in rows], row_batch, [2, 2, 1], log, 100.0)[
        "dispatch_log_matched"
    ]
    kept = extract({"runs": {"k": {"repeats": [{"system": "ray_llm_sorted_ours", **got}]}}})
    assert kept["runs"]["k"]["repeats"][0]["batch_arrive_s"] == got["batch_arrive_s"]


def test_a_tasks_data_nodes_are_logged_in_the_order_rays_actor_locality_visits_them():
    """Most bytes first, ties by node id (Ray Data 2.60's _find_actor_with_locality), the order
    in which an actor with room is looked for before the least busy anywhere."""
    assert locality_order({"b": 10, "a": 10, "c": 30}) == ["c", "a", "b"] and locality_order({}) == []


def test_the_ray_data_methods_the_dispatch_log_wraps_take_what_it_passes():
    """record_dispatch wraps these two of Ray Data's executor by their parameters: a Ray that
    changed them would leave the log empty (the run recorded as unmatched), so say so here."""
    import inspect

    from ray.data._internal.execution.operators.map_operator import MapOperator
    from ray.data._internal.execution.streaming_executor_state import OpState

    from ray.data._internal.execution.operators.actor_pool_map_operator import _ActorPool

    submit = ["self", "gen", "inputs", "task_done_callback"]
    assert list(inspect.signature(MapOperator._submit_data_task).parameters) == submit
    assert list(inspect.signature(OpState.add_output).parameters) == ["self", "ref"]
    # ... and these two of its actor pool (an actor made pickable, a task's slot freed)
    assert list(inspect.signature(_ActorPool.pending_to_running).parameters) == ["self", "ready_ref"]
    assert list(inspect.signature(_ActorPool.on_task_completed).parameters) == ["self", "actor"]


def test_the_dispatch_log_puts_ray_datas_methods_back_when_its_block_ends():
    """A second run in one driver logs each task once: the wrappers go when the block ends,
    also when it raises."""
    from ray.data._internal.execution.operators.map_operator import MapOperator
    from ray.data._internal.execution.streaming_executor_state import OpState

    from ray.data._internal.execution.operators.actor_pool_map_operator import _ActorPool

    def methods():
        return (OpState.add_output, MapOperator._submit_data_task, _ActorPool.pending_to_running)

    originals = (*methods(), _ActorPool.on_task_completed)
    with pytest.raises(RuntimeError), record_dispatch():
        assert all(now != was for now, was in zip((*methods(), _ActorPool.on_task_completed), originals))
        raise RuntimeError("the run failed")
    assert (*methods(), _ActorPool.on_task_completed) == originals
    with record_dispatch() as log:
        wrapped = MapOperator._submit_data_task
        assert wrapped.__closure__ is not None and originals[1] in [c.cell_contents for c in wrapped.__closure__]
    assert (*methods(), _ActorPool.on_task_completed) == originals and log == []


def test_the_pool_view_matches_an_actors_freed_slots_to_its_tasks_by_their_ends():
    """Ray's pool frees a slot without naming the task: an actor's k-th slot freed is its task
    whose last row finished k-th. Engines in the record's order get when the pool made their
    actor pickable; a log that misses a freed slot is not used."""
    rows = [{"id": i, "actor_id": a} for i, a in enumerate("AAAAC")]  # A ran tasks 0 and 1, C task 2
    record = {
        "row_engine": {0: 1, 1: 1, 2: 1, 3: 1, 4: 0},
        "row_batch": {0: 0, 1: 0, 2: 1, 3: 1, 4: 2},
        "batch_finished_s": [5.0, 3.0, 4.0],
    }
    events = [
        {"event": "running", "at": 101.0, "actor": "C"},
        {"event": "running", "at": 101.5, "actor": "A"},
        {"event": "freed", "at": 105.2, "actor": "A"},
        {"event": "freed", "at": 104.1, "actor": "C"},
        {"event": "freed", "at": 103.3, "actor": "A"},
    ]
    got = pool_view(rows, record, events, t0=100.0)
    assert got["engine_running_s"] == [1.0, 1.5]  # engine 0 is C's, engine 1 A's
    assert got["batch_freed_s"] == pytest.approx([5.2, 3.3, 4.1])  # task 1 ended first on A
    assert pool_view(rows, record, events[:-1], 100.0) == {"engine_running_s": None, "batch_freed_s": None}


def _run(wall, first, computed, busy, ends, outputs):
    return figures(
        {
            "wall_s": wall,
            "wall_from_first_request_s": wall - first,
            "wall_from_last_engine_start_s": wall - first,
            "computed_prompt_tokens": computed,
            "engine_busy_s": busy,
            "engine_end_s": ends,
            "load_average": (1.0, 1.0, 1.0),
            "outputs": outputs,
        }
    )


def test_cells_give_medians_spreads_and_goals_as_met_or_not():
    out = {1: [3, 4], 2: [5]}
    ours = [_run(w, 10, 1000, [40, 42], [50, 50], out) for w in (60, 62, 70)]
    ray = [_run(w, 5, 1100, [30, 60], [45, 70], {1: [3, 4], 2: [6]}) for w in (80, 85, 90)]
    runs = {
        "prefixflow_vllm/model_decided/4": cell_summary(ours, out),
        "ray_llm_sorted_default/model_decided/4": cell_summary(ray, out),
    }
    cell = runs["prefixflow_vllm/model_decided/4"]
    assert cell["median"]["wall_s"] == 62 and cell["spread"]["wall_s"] == [60, 70]
    assert (
        cell["outputs_equal"] == [2, 2, 2]
        and runs["ray_llm_sorted_default/model_decided/4"]["outputs_equal"] == [1] * 3
    )
    floors = {w: {"whole_block_floor": 990} for w in ("fixed", "model_decided")}
    row = acceptance(runs, 4, floors)["prefixflow_vllm/model_decided/4"]
    assert row["ray_best"] == "ray_llm_sorted_default"
    assert row["speedup_vs_ray_best"] == pytest.approx(80 / 52)
    goals = row["goals"]
    assert goals["speedup_vs_ray_best"]["met"] and goals["busy_max_over_mean"]["met"]
    assert goals["computed_vs_whole_block_floor"]["value"] == pytest.approx(1000 / 990)
    assert goals["computed_vs_whole_block_floor"]["met"]


def test_the_tokenizers_own_eos_ends_rows_too():
    # Token 2 (the tokenizer's EOS) ends row 1 at 3 before any candidate does.
    outputs = [[1, 1, 7, 1, 1, 1], [1, 1, 2, 1, 7, 1], [1, 1, 1, 1, 7, 1], [7, 1, 1, 1, 1, 1]]
    eos, lengths = choose_eos(outputs, 8, also=(2,))
    assert eos == 7 and lengths == [3, 3, 5, 1]


def test_ray_keeps_the_faster_configuration_and_both_when_one_run_cannot_tell_them_apart():
    def found(default_s: float, ours_s: float) -> dict:
        return {
            "ray_llm_sorted_default/model_decided/4": [{"wall_from_first_request_s": default_s}],
            "ray_llm_sorted_ours/model_decided/4": [{"wall_from_first_request_s": ours_s}],
        }

    assert _ray_kept(found(256.1, 253.3), "model_decided", 4) == ["ray_llm_sorted_default", "ray_llm_sorted_ours"]
    assert _ray_kept(found(300.0, 253.3), "model_decided", 4) == ["ray_llm_sorted_ours"]
    assert _ray_kept({}, "model_decided", 4) == []


def _result(n: int, ours_s: float, ray_s: float, documents: int = 245) -> dict:
    """A scale_bench result holding one N's model-decided cells, as its run writes it."""
    out = {1: [3, 4]}
    runs = {
        f"prefixflow_vllm/model_decided/{n}": cell_summary(
            [_run(w, 10, 1000, [40, 42], [50, 50], out) for w in ours_s], out
        ),
        f"ray_llm_sorted_default/model_decided/{n}": cell_summary(
            [_run(w, 5, 1100, [30, 60], [45, 70], out) for w in ray_s], out
        ),
    }
    settings = {"rows": 2048, "workers": 3, "kv_cache_bytes": 1, "block_size": 32, "model": {}, "model_config": {}}
    return {
        "args": {**settings, "replicas": [n], "repeats": 3},
        "workload": {"documents": documents, "floors": {"whole_block_floor": 990}},
        "machine": {"cpus": 2},
        "runs": runs,
    }


def test_cells_measured_apart_join_with_their_goals_per_n_and_no_per_row_detail():
    joined = merge(
        {"n2.json": _result(2, (60, 62, 70), (80, 85, 90)), "n4.json": _result(4, (40, 41, 42), (50, 51, 52))}
    )
    assert joined["args"]["replicas"] == [2, 4] and joined["args"]["workloads"] == ["model_decided"]
    assert joined["cell_source"]["prefixflow_vllm/model_decided/4"] == "n4.json"
    # Each N against Ray's cell of the same N, from the same file: 80/52 at N = 2, 46/31 at N = 4.
    assert joined["acceptance"]["prefixflow_vllm/model_decided/2"]["speedup_vs_ray_best"] == pytest.approx(80 / 52)
    assert joined["acceptance"]["prefixflow_vllm/model_decided/4"]["speedup_vs_ray_best"] == pytest.approx(46 / 31)
    assert all("outputs" not in r for cell in joined["runs"].values() for r in cell["repeats"])
    assert joined["runs"]["prefixflow_vllm/model_decided/2"]["outputs_equal"] == [1, 1, 1]
    # A joined file joins again, each cell still naming the sitting it was measured in.
    again = merge({"joined.json": joined, "n1.json": _result(1, (90, 91, 92), (99, 99, 99))})
    assert sorted(again["merged_from"]) == ["n1.json", "n2.json", "n4.json"]
    assert again["cell_source"]["prefixflow_vllm/model_decided/4"] == "n4.json"
    assert again["args"]["replicas"] == [1, 2, 4]


def test_some_n_of_a_sitting_are_taken_where_a_later_sitting_measured_the_others_again(tmp_path):
    old = _result(1, (90, 91, 92), (99, 99, 99))
    old["runs"].update(_result(2, (60, 62, 70), (80, 85, 90))["runs"])
    no_error = {"rows_per_engine": 0.0, "computed_prompt_tokens": 0.0}
    old["dispatch_check"] = {
        "max_abs_error": 0.25,
        "within_goal": False,
        "goal": 0.05,
        "runs": {
            "ray_llm_sorted_default/model_decided/1#0": {**no_error, "placement": 0.0},
            "ray_llm_sorted_default/model_decided/2#0": {**no_error, "placement": 0.25},
        },
    }
    (tmp_path / "n12.json").write_text(json.dumps(old))
    name, n1 = read_file_arg(f"{tmp_path / 'n12.json'}:1")
    assert name == "n12.json" and sorted(n1["runs"]) == [
        f"{s}/model_decided/1" for s in ("prefixflow_vllm", "ray_llm_sorted_default")
    ]
    # its dispatch check keeps only the N = 1 runs, and the sitting says what was taken
    assert n1["dispatch_check"]["runs"] == {"ray_llm_sorted_default/model_decided/1#0": {**no_error, "placement": 0.0}}
    assert n1["dispatch_check"]["within_goal"] and n1["note"] == "only its N = 1 cells taken"
    joined = merge({name: n1, "n2.json": _result(2, (50, 51, 52), (70, 71, 72))})
    assert joined["cell_source"]["prefixflow_vllm/model_decided/1"] == "n12.json"
    assert joined["cell_source"]["prefixflow_vllm/model_decided/2"] == "n2.json"
    assert joined["merged_from"]["n12.json"]["cells"] == sorted(n1["runs"])
    # the repository keeps a sitting as scale_merge wrote it (joined form): the same cells taken
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "n12.json").write_text(json.dumps(merge({"n12.json": old})))
    _, kept = read_file_arg(f"{tmp_path / 'kept' / 'n12.json'}:1")
    again = merge({"n12.json": kept, "n2.json": _result(2, (50, 51, 52), (70, 71, 72))})
    assert again["cell_source"] == joined["cell_source"] and again["merged_from"]["n12.json"]["cells"] == sorted(
        n1["runs"]
    )
    assert again["merged_from"]["n12.json"]["dispatch_check"]["runs"] == n1["dispatch_check"]["runs"]
    # without the selector the same cell would be in both files
    with pytest.raises(ValueError, match="is in n12.json and in n2.json"):
        merge({"n12.json": read_file_arg(str(tmp_path / "n12.json"))[1], "n2.json": _result(2, (1, 2, 3), (4, 5, 6))})
    with pytest.raises(ValueError, match="no cell with N in \\[4\\]"):
        read_file_arg(f"{tmp_path / 'n12.json'}:4")


def test_files_of_another_workload_or_the_same_cell_twice_are_refused():
    with pytest.raises(ValueError, match="other.json: its workload differs"):
        merge(
            {"n2.json": _result(2, (1, 2, 3), (4, 5, 6)), "other.json": _result(4, (1, 2, 3), (4, 5, 6), documents=9)}
        )
    with pytest.raises(ValueError, match="is in a.json and in b.json"):
        merge({"a.json": _result(2, (1, 2, 3), (4, 5, 6)), "b.json": _result(2, (1, 2, 3), (4, 5, 6))})
