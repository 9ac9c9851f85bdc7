"""The dispatch model against measured ray.data.llm runs: `validate_dispatch` replays each run
that scale_bench.json records (its blocks in dispatch order, batch_size, tasks in flight,
engines, each row's measured output length and prompt) through sim_run.py's Ray hand-out and
compares rows per engine, which engine each row ran on, computed prompt tokens and engine
busy-time shares with the measured ones (issue 38: goal within 5%).

What it reads (scale_bench.json): top-level "rows" [{"id", "prompt_tokens", "max_tokens",
"output_tokens": {workload: length}}], "token_rows" (each prompt's token ids, in row id order),
"args": {"block_size", "model" or "model_config": the checkpoint's config with "vocab_size"},
optionally "hardware_profile" {"peak_flops", "mem_bandwidth"} (else CPU_PROFILE); per run under
"runs" -> key -> "repeats": "system", "replicas", "workload", "block_rows", "batch_size",
"max_tasks_in_flight_per_actor", "max_num_seqs", "num_gpu_blocks", "rows_per_engine",
"engine_busy_s", "first_request_s", "computed_prompt_tokens", "row_engine", "row_block", and
optionally "block_row_ids" (each block's row ids in the order the block holds them; without it: row
id order, or token order for a sorted run), "startup": {"engine_ready_s"} (each engine's vLLM
engine built; engines that ran no row are listed last without one) and "row_batch",
"batch_handout_s", "batch_arrive_s" (each row's task, and per task when Ray handed it out and
when its blocks had reached the engine stage: the bench driver's dispatch log).

What the model is given and what it decides: when each engine's actor can take work: when Ray's
actor pool made it pickable (engine_running_s, the driver's log: 0.02-8 s after its engine was
built), in runs before that log its engine's ready time (startup.engine_ready_s: the actor's
constructor done), in files before that its first request (0.2-1.4 s later, and not always in
the same order), less the earliest; the data, all there at 0, or where the run records them its
tasks as Ray handed them out, each from when its blocks reached the engine stage, and where it
records them the nodes that held each task's blocks (by bytes; the first only in runs before
batch_data_nodes) and each engine's node. Times enter
the model's clock scaled by its total busy time over the measured one (the cost model's seconds
are a GPU-like engine's, the bench's are 4 engines sharing 2 cores). The model decides which
task each actor gets, so row placement, computed tokens and busy shares are its predictions.
It hands tasks out at once, each to the least busy actor up on the first node holding its data
where one there has room, else to the least busy actor up (Ray 2.60's select_actors, with the actor
locality Ray Data turns on by default), among actors as busy the one Ray's actor heap puts first
(the one whose tasks in flight changed last): where the sorted data is ready before the engines come
up one by one, as on the bench's cluster, it predicts that the first engine up fills its 16 task
slots first, one contiguous quarter of the sorted rows per engine, and a run whose data arrives
after every engine is up is dealt by where its blocks are, else in the heap's order. Ray's executor
takes 13-17 ms a task on the bench's machine and sees engines come up only between its
scheduling steps (measured: jobs/README.md). Where a run records each task's end, `rule_check`
replays Ray's pick alone over its measured hand-outs and task ends: what the rule gets right
without the model's clock (and again with what Ray's actor pool saw, where the run records it:
when each engine's actor became pickable and each task's slot was freed); `speed_noise`
(--speed-noise) how far the replays move when each engine's pace is a few percent off, which
the bench's shared cores make it; `paced_replays` (--measured-pace) the replays at each engine's
measured pace, where the run records it."""

from __future__ import annotations

import argparse
import gzip
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from prefixflow.bench import sim_dispatch as dispatch
from prefixflow.bench.sim_items import plain_items
from prefixflow.bench.sim_run import Cluster, RayData, Tasks, node_numbers, ray_tasks, simulate
from prefixflow.bench.sim_workloads import Workload, workload_from_tokens
from prefixflow.pipeline.cost_model import GIB, CostModel, HardwareProfile, ModelShape

GOAL = 0.05
# Used when the file records no hardware profile: cost_model.measure_cpu_profile on this
# project's 2-core machine, loaded, 2026-11-28, gave 10-19 GFLOP/s (fp32 matmul) and 1.7-4.8
# GB/s (copy). Only the busy-time shares depend on it, through the balance of compute and
# memory time; the bench should record its own ("hardware_profile").
CPU_PROFILE = HardwareProfile("scale_bench_cpu", 16e9, 3.5e9, 16 * GIB)
# What validate_dispatch reads of a Ray run's record (module doc), when each task began on its
# engine and when its last row finished there (batch_first_request_s: recorded since commit
# 262c84a; batch_finished_s, since 0ffc176: neither read by the model), when Ray
# handed it out (batch_handout_s: the driver's log, not read by the model) and where its data
# was (batch_data_nodes, every node holding some by bytes, or batch_data_node, the first: the
# log's too, and `nodes`: each engine's; read for Ray's actor locality); `extract` keeps only
# these.
RUN_FIELDS = (
    "system",
    "replicas",
    "workload",
    "block_rows",
    "batch_size",
    "max_tasks_in_flight_per_actor",
    "max_num_seqs",
    "num_gpu_blocks",
    "rows_per_engine",
    "engine_busy_s",
    "engine_active_s",
    "computed_per_engine",
    "first_request_s",
    "startup",
    "computed_prompt_tokens",
    "row_engine",
    "row_block",
    "block_row_ids",
    "row_batch",
    "batch_first_request_s",
    "batch_finished_s",
    "batch_freed_s",
    "engine_running_s",
    "batch_handout_s",
    "batch_arrive_s",
    "batch_data_node",
    "batch_data_nodes",
    "nodes",
)


def load_bench(path: Path) -> dict[str, Any]:
    """A scale_bench file: JSON, or gzip-compressed JSON (.gz, what `extract` writes)."""
    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(raw)


def extract(data: dict[str, Any]) -> dict[str, Any]:
    """The part of a scale_bench result that validate_dispatch reads (the workload's rows and
    token ids, the model and hardware, the Ray runs' RUN_FIELDS): 0.5 MB gzipped for the
    2,048-row bench, against 17 MB for the whole file, so the validation can be rerun from
    the repository."""
    runs = {
        key: {
            "repeats": [
                {f: rec[f] for f in RUN_FIELDS if f in rec}
                for rec in cell.get("repeats", [])
                if str(rec.get("system", key)).startswith("ray_llm")
            ]
        }
        for key, cell in data.get("runs", {}).items()
    }
    return {
        "bench": "scale_bench (dispatch_check extract)",
        "args": data.get("args", {}),
        "hardware_profile": data.get("hardware_profile"),
        "rows": data.get("rows"),
        "token_rows": data.get("token_rows"),
        "runs": {k: v for k, v in runs.items() if v["repeats"]},
    }


def validate_dispatch(scale_bench_json: Path, cost_model: CostModel | None = None) -> dict[str, Any]:
    """Per ray.data.llm run of the file (module doc): predicted and measured rows per engine, row
    placement, computed prompt tokens and busy-time shares; the dispatch model's errors (rows,
    placement: the share of rows on another engine, computed tokens) and the worst of them.
    Busy shares are reported apart (`busy_share_error`): they test the cost model on the bench's
    machine, where 4 engines share 2 cores and one that finishes early speeds up the others."""
    path = Path(scale_bench_json)
    data = load_bench(path)
    cm = cost_model or bench_cost_model(data, path)
    runs = {key: replay(None) for key, _, replay in _ray_replays(path, data, cm)}
    cells = cell_errors(runs)
    return {
        "runs": runs,
        **goal_summary([r["errors"] for r in runs.values()]),
        "cells": cells,
        **cell_goal(list(cells.values())),
        "rule_with_measured_ends": rule_summary(list(runs.values())),
        "rule_with_pool_view": rule_summary(list(runs.values()), "rule_with_pool_view"),
        "cost_model": {
            "hardware": cm.hardware.name,
            "peak_flops": cm.hardware.peak_flops,
            "mem_bandwidth": cm.hardware.mem_bandwidth,
        },
    }


def _ray_replays(path: Path, data: dict[str, Any], cm: CostModel) -> Any:
    """Each ray.data.llm run of a loaded file: its key ("cell#k"), its record, and replay_run on
    it as a function of the engines' speeds (None: all 1)."""
    rows, tokens = _rows(data, path)
    block_size = int(_field(data.get("args", {}), "block_size", f"{path}: args"))
    w = workload_from_tokens(tokens, np.array([int(r["max_tokens"]) for r in rows], np.int64))
    for key, cell in data.get("runs", {}).items():
        for k, rec in enumerate(cell.get("repeats", [])):
            if str(rec.get("system", key)).startswith("ray_llm"):
                where = f"{path}: runs[{key}][{k}]"
                yield (
                    f"{key}#{k}",
                    rec,
                    lambda speed, rec=rec, where=where: replay_run(w, rows, tokens, rec, block_size, cm, where, speed),
                )


def speed_noise(paths: Sequence[Path], noise: float, draws: int, seed: int = 0) -> dict[str, Any]:
    """How much each replay hangs on the engines' paces: every ray.data.llm run of the files
    replayed `draws` more times, each engine's speed drawn uniformly in 1 +- noise
    (sim_run.Tasks.speed); per run, how many draws put rows per engine more than the goal from
    the replay at equal speeds (`moved`), and how many within the goal of the measured rows
    (`within_goal`). The model gives a run's engines one pace; on the bench's machine, where 4
    engines share 2 cores, an engine's busy time per row (waits included) was up to 2.2x
    another's in one run."""
    rng = np.random.default_rng(seed)
    runs: dict[str, Any] = {}
    for path in paths:
        data = load_bench(Path(path))
        for key, _, replay in _ray_replays(Path(path), data, bench_cost_model(data, Path(path))):
            base = replay(None)
            even, measured = (np.array(base[side]["rows_per_engine"], float) for side in ("predicted", "measured"))
            moved = within = 0
            for _ in range(draws):
                rows = np.array(replay(rng.uniform(1 - noise, 1 + noise, len(even)))["predicted"]["rows_per_engine"])
                moved += bool(np.abs(rows - even).max() / even.mean() > GOAL)
                within += bool(np.abs(rows - measured).max() / measured.mean() <= GOAL)
            runs[f"{os.path.relpath(path)}: {key}"] = {"moved": moved, "within_goal": within}
    return {
        "noise": noise,
        "draws": draws,
        "runs": runs,
        "moved": f"{sum(r['moved'] for r in runs.values())} of {draws * len(runs)} draws",
        "within_goal": f"{sum(r['within_goal'] for r in runs.values())} of {draws * len(runs)} draws",
    }


def measured_pace(rec: dict[str, Any], rows: list[dict[str, Any]], where: str) -> np.ndarray | None:
    """Each engine's pace in a run, as measured (None where the run does not record it): the
    tokens it computed (prompt tokens not cached, and generated) per second it had requests in
    vLLM (engine_active_s, which leaves out its waits for data, unlike engine_busy_s), over the
    engines' mean. A token is taken as a token's work whether prefilled or decoded (the bench's
    engines are CPU-bound in their matmuls), and an engine's pace as one figure for its whole run,
    where on shared cores it is faster while others idle."""
    if rec.get("engine_active_s") is None or rec.get("computed_per_engine") is None:
        return None
    outs, _, row_engine = _run_rows(rec, rows, where)
    R = int(_field(rec, "replicas", where))
    generated = np.bincount(list(row_engine.values()), weights=outs[list(row_engine)], minlength=R)
    computed = np.zeros(R)
    computed[: len(rec["computed_per_engine"])] = rec["computed_per_engine"]
    active = np.zeros(R)
    active[: len(rec["engine_active_s"])] = rec["engine_active_s"]
    pace = np.divide(computed + generated, active, out=np.zeros(R), where=active > 0)
    ran = pace > 0
    return np.where(ran, pace / pace[ran].mean(), 1.0)  # an engine that ran nothing: never up anyway


def paced_replays(paths: Sequence[Path]) -> dict[str, Any]:
    """Every ray.data.llm run of the files that records its engines' paces (measured_pace)
    replayed at those paces and at even ones: rows per engine against the measured, both ways."""
    runs: dict[str, Any] = {}
    for path in paths:
        data = load_bench(Path(path))
        rows, _ = _rows(data, Path(path))
        for key, rec, replay in _ray_replays(Path(path), data, bench_cost_model(data, Path(path))):
            pace = measured_pace(rec, rows, f"{path}: {key}")
            if pace is None:
                continue
            even, paced = replay(None), replay(pace)
            runs[f"{os.path.relpath(path)}: {key}"] = {
                "replicas": int(rec["replicas"]),
                "pace": np.round(pace, 3).tolist(),
                "measured": even["measured"]["rows_per_engine"],
                "even": {"rows_per_engine": even["predicted"]["rows_per_engine"], "errors": even["errors"]},
                "paced": {"rows_per_engine": paced["predicted"]["rows_per_engine"], "errors": paced["errors"]},
            }

    def within(side: str, replicas: int) -> str:
        mine = [r for r in runs.values() if r["replicas"] == replicas]
        return f"{sum(r[side]['errors']['rows_per_engine'] <= GOAL for r in mine)} of {len(mine)}"

    return {
        "runs": runs,
        "rows_per_engine_within_goal": {
            f"N = {n}": {"even": within("even", n), "paced": within("paced", n)}
            for n in sorted({r["replicas"] for r in runs.values()})
        },
    }


def validate_files(paths: Sequence[Path]) -> dict[str, Any]:
    """validate_dispatch on each file (by its path relative to here) and the goal held over all
    their runs (goal_summary)."""
    files = {os.path.relpath(path): validate_dispatch(Path(path)) for path in paths}
    return {
        **goal_summary([run["errors"] for report in files.values() for run in report["runs"].values()]),
        **cell_goal([cell for report in files.values() for cell in report["cells"].values()]),
        **{
            field: rule_summary([run for report in files.values() for run in report["runs"].values()], field)
            for field in ("rule_with_measured_ends", "rule_with_pool_view")
        },
        "measured_pace": paced_replays(paths)["rows_per_engine_within_goal"],
        "files": files,
    }


def worst_error(errors: dict[str, float]) -> float:
    """A replayed run's largest error (rows per engine, placement, computed tokens): what the
    goal is held to."""
    return max(abs(e) for e in errors.values())


def goal_summary(errors: list[dict[str, float]], goal: float = GOAL) -> dict[str, Any]:
    """The goal held over runs (each run's errors): the worst run's error, whether it is within
    the goal (not when there is no run), and how many runs are, in all three errors and in rows
    per engine alone (what issue 38 names)."""
    per_run = [worst_error(e) for e in errors]
    worst = max(per_run, default=None)
    rows = [abs(e["rows_per_engine"]) for e in errors]
    return {
        "max_abs_error": worst,
        "goal": goal,
        "within_goal": worst is not None and worst <= goal,
        "runs_within_goal": f"{sum(e <= goal for e in per_run)} of {len(per_run)}",
        "rows_per_engine_within_goal": f"{sum(e <= goal for e in rows)} of {len(rows)}",
    }


def cell_errors(runs: dict[str, Any]) -> dict[str, Any]:
    """Each cell's replayed runs (keys "cell#k") taken together, as the bench reports a cell: the
    medians over its repeats, predicted and measured, of the rows per engine ranked from the most
    (which engine is which is not comparable between runs: each numbers its engines by their
    first request, on other nodes) and of the computed prompt tokens; their errors, and the
    measured spread (the most one rank's rows differ between repeats, over the mean), which is
    how far Ray's own runs of one cell are from each other: the noise no replay of a run's
    recorded inputs can follow (which engine ends a task first, on the bench's shared cores)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for key, run in runs.items():
        grouped.setdefault(key.rsplit("#", 1)[0], []).append(run)
    cells = {}
    for cell, reps in grouped.items():
        ranked = {
            side: np.array([sorted(r[side]["rows_per_engine"], reverse=True) for r in reps], float)
            for side in ("predicted", "measured")
        }
        tokens = {side: float(np.median([r[side]["computed_prompt_tokens"] for r in reps])) for side in ranked}
        pred, meas = np.median(ranked["predicted"], 0), np.median(ranked["measured"], 0)
        mean = ranked["measured"].mean()
        cells[cell] = {
            "repeats": len(reps),
            "predicted": {"rows_per_engine": pred.tolist(), "computed_prompt_tokens": tokens["predicted"]},
            "measured": {"rows_per_engine": meas.tolist(), "computed_prompt_tokens": tokens["measured"]},
            "measured_spread": round(float(np.ptp(ranked["measured"], 0).max() / mean), 5),
            "errors": {
                "rows_per_engine": round(float(np.abs(pred - meas).max() / mean), 5),
                "computed_prompt_tokens": round(tokens["predicted"] / tokens["measured"] - 1, 5),
            },
        }
    return cells


def cell_goal(cells: list[dict[str, Any]], goal: float = GOAL) -> dict[str, Any]:
    """The goal held over cells (cell_errors): the worst cell's error and how many cells are
    within the goal in both of their errors."""
    per_cell = [worst_error(c["errors"]) for c in cells]
    return {
        "max_abs_cell_error": max(per_cell, default=None),
        "cells_within_goal": f"{sum(e <= goal for e in per_cell)} of {len(per_cell)}",
    }


def rule_summary(runs: list[dict[str, Any]], field: str = "rule_with_measured_ends") -> str | None:
    """How many of Ray's hand-outs the rule alone gives (`rule_check`), over the runs that
    record their task ends (None: none does); field "rule_with_pool_view": over the runs that
    record what Ray's actor pool saw."""
    checks = [run[field] for run in runs if run.get(field)]
    if not checks:
        return None
    contested = [c["contested"] for c in checks]
    rows_within = sum(c["rows_per_engine_error"] <= GOAL for c in checks)
    return (
        f"{sum(c['as_ray'] for c in checks)} of {sum(c['handouts'] for c in checks)} hand-outs; "
        f"{sum(c['as_ray'] for c in contested)} of the {sum(c['handouts'] for c in contested)} "
        f"where two or more engines up had room; rows per engine within {GOAL:.0%} in {rows_within} "
        f"of {len(checks)} runs"
    )


def bench_cost_model(data: dict[str, Any], path: Path) -> CostModel:
    """The bench model's shape (args.model_config, else args.model; needs vocab_size; fp32 unless
    it says) on the recorded hardware profile, else CPU_PROFILE."""
    args = data.get("args", {})
    cfg = args.get("model_config") or args.get("model")
    if not cfg or "vocab_size" not in cfg:
        raise ValueError(
            f"{path}: args.model_config (or args.model) must give the bench model's config with "
            "vocab_size, for the busy-time model; or pass cost_model"
        )
    shape = ModelShape.from_hf_config({"torch_dtype": "float32", **cfg})
    hw = data.get("hardware_profile")
    profile = (
        HardwareProfile("recorded", float(hw["peak_flops"]), float(hw["mem_bandwidth"]), 16 * GIB)
        if hw
        else CPU_PROFILE
    )
    return CostModel(shape, profile)


def _field(rec: dict[str, Any], name: str, where: str) -> Any:
    if name not in rec:
        raise ValueError(f"{where} has no {name!r}: scale_bench must record it for validate_dispatch")
    return rec[name]


def _rows(data: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], list[list[int]]]:
    rows, tokens = _field(data, "rows", str(path)), _field(data, "token_rows", str(path))
    if len(rows) != len(tokens) or [int(r["id"]) for r in rows] != list(range(len(rows))):
        raise ValueError(
            f"{path}: rows must hold ids 0..{len(tokens) - 1} in order, one per token_rows entry "
            f"(got {len(rows)} rows for {len(tokens)} token rows)"
        )
    for r, t in zip(rows, tokens):
        if int(r["prompt_tokens"]) != len(t):
            raise ValueError(
                f"{path}: row {r['id']} says prompt_tokens={r['prompt_tokens']} but its token_rows "
                f"entry holds {len(t)} tokens"
            )
    return rows, tokens


def _dispatch_order(
    rec: dict[str, Any], row_block: dict[int, int], tokens: list[list[int]], where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(row ids in the order the blocks hand them out, rows per block)."""
    block_rows = np.asarray(_field(rec, "block_rows", where), np.int64)
    if "block_row_ids" in rec:
        blocks = [[int(r) for r in b] for b in rec["block_row_ids"]]
    else:
        blocks = [[] for _ in block_rows]
        for r in sorted(row_block):
            blocks[row_block[r]].append(r)
        if "sorted" in str(rec.get("system", "")):
            blocks = [sorted(b, key=lambda r: tokens[r]) for b in blocks]
    order = [r for b in blocks for r in b]
    if [len(b) for b in blocks] != block_rows.tolist() or sorted(order) != list(range(len(tokens))):
        raise ValueError(f"{where}: block_rows, row_block (or block_row_ids) must place every row once, block by block")
    return np.asarray(order, np.int64), block_rows


def _int_map(rec: dict[str, Any], name: str, where: str) -> dict[int, int]:
    return {int(k): int(v) for k, v in _field(rec, name, where).items()}  # JSON keys are strings


def _engines_up(rec: dict[str, Any], R: int, where: str) -> tuple[np.ndarray, str]:
    """When each engine's actor could take work (module doc: engine_running_s, else
    startup.engine_ready_s, else first_request_s), and the field it came from. The
    engines that ran no row have no time there (the record lists them last, with 0 rows): they
    are never up in the model (inf), as Ray handed them nothing before the work ran out."""
    startup = rec.get("startup") or {}
    if rec.get("engine_running_s") and None not in rec["engine_running_s"]:
        ready_from = "engine_running_s"  # when Ray's actor pool made it pickable (pool_view)
        up = np.asarray(rec["engine_running_s"], float)
    else:
        ready_from = "engine_ready_s" if "engine_ready_s" in startup else "first_request_s"
        up = np.asarray(startup[ready_from] if ready_from in startup else _field(rec, ready_from, where), float)
    idle = list(rec.get("rows_per_engine", []))[len(up) :]
    if up.ndim != 1 or len(up) + len(idle) != R or any(idle) or not len(up):
        raise ValueError(f"{where}: {ready_from} must give each of the {R} engines that ran rows its time")
    return np.r_[up, [np.inf] * len(idle)], ready_from


def _replay_tasks(
    rec: dict[str, Any], row_block: dict[int, int], tokens: list[list[int]], R: int, where: str
) -> tuple[np.ndarray, Tasks, np.ndarray | None, np.ndarray | None]:
    """The rows in dispatch order, the run's tasks over them (without times), each task's
    arrival at the engine stage in seconds of the run (None where the run does not record them:
    the blocks, bundled as Ray does, all there at 0) and when its last row finished
    (batch_finished_s; None where not recorded)."""
    order, block_rows = _dispatch_order(rec, row_block, tokens, where)
    ray = RayData(
        len(block_rows), int(_field(rec, "batch_size", where)), int(_field(rec, "max_tasks_in_flight_per_actor", where))
    )
    arrived = _arrived_tasks(rec, order, where)
    if arrived is None:
        return order, ray_tasks(len(order), ray, R, block_rows), None, None
    rows, starts, arrive, rank = arrived
    data_node, actor_node = _data_nodes(rec, rank, R, where)
    finished = rec.get("batch_finished_s")
    finished = None if finished is None or len(finished) != len(rank) else np.asarray(finished, float)[rank]
    tasks = Tasks(starts, ray.max_tasks_in_flight_per_actor, data_node=data_node, actor_node=actor_node)
    return rows, tasks, arrive, finished


def _arrived_tasks(
    rec: dict[str, Any], order: np.ndarray, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The run's tasks as Ray handed them out (row_batch, batch_handout_s: the driver's log) and
    when each one's blocks reached the engine stage (batch_arrive_s), for a run that records them
    (else None: the blocks are bundled into tasks and all there at 0). Returns (row ids task by
    task, each task's rows in block order; task boundaries; arrivals in seconds of the run; the
    recorded task numbers in hand-out order)."""
    handout, arrive = rec.get("batch_handout_s"), rec.get("batch_arrive_s")
    if handout is None or arrive is None or None in handout or None in arrive:
        return None
    row_batch = _int_map(rec, "row_batch", where)
    if len(handout) != len(arrive) or set(row_batch.values()) != set(range(len(handout))):
        raise ValueError(f"{where}: batch_handout_s and batch_arrive_s must give each task of row_batch its time")
    rank = np.argsort(handout, kind="stable")  # tasks in the order Ray handed them out
    rows_of: list[list[int]] = [[] for _ in handout]
    for r in order:  # block order within each task
        rows_of[row_batch[int(r)]].append(int(r))
    by_task = [rows_of[t] for t in rank]
    starts = np.r_[0, np.cumsum([len(rows) for rows in by_task])].astype(np.int64)
    rows = np.asarray([r for rows in by_task for r in rows], np.int64)
    return rows, starts, np.asarray(arrive, float)[rank], rank


def _locality_field(rec: dict[str, Any]) -> str:
    """Where a run records the nodes holding each task's blocks: all of them, most bytes first
    (batch_data_nodes), or in runs before that field the first only (batch_data_node)."""
    return "batch_data_nodes" if rec.get("batch_data_nodes") is not None else "batch_data_node"


def _data_nodes(
    rec: dict[str, Any], rank: np.ndarray, R: int, where: str
) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """Tasks' data_node ([num_tasks, K] in hand-out order: the nodes that held each one's blocks
    when Ray handed it out, most bytes first, -1 after the last; _locality_field) and actor_node
    (each engine's: `nodes`), numbered, which Ray's actor locality reads; None where the run does
    not record them."""
    field, nodes = _locality_field(rec), rec.get("nodes")
    if rec.get(field) is None or nodes is None:
        return None, None
    listed = [[] if ns is None else [ns] if field == "batch_data_node" else ns for ns in rec[field]]
    if len(listed) != len(rank) or len(nodes) > R:
        raise ValueError(f"{where}: {field} must give each task its nodes, and nodes each engine's")
    known = (n for n in [*nodes, *(n for ns in listed for n in ns)] if n is not None)
    number = {node: i for i, node in enumerate(dict.fromkeys(known))}
    data_node = np.full((len(rank), max([1, *map(len, listed)])), -1, np.int64)
    for i, t in enumerate(rank):
        data_node[i, : len(listed[t])] = [number[n] for n in listed[t]]
    return data_node, np.asarray([number.get(n, -1) for n in nodes] + [-1] * (R - len(nodes)), np.int64)


def replay_run(
    w: Workload,
    rows: list[dict[str, Any]],
    tokens: list[list[int]],
    rec: dict[str, Any],
    block_size: int,
    cm: CostModel,
    where: str,
    speed: np.ndarray | None = None,
) -> dict[str, Any]:
    """One measured run replayed through the dispatch model (speed: each engine's pace,
    sim_run.Tasks.speed; None: all 1); its predictions, measurements, errors."""
    outs, row_block, row_engine = _run_rows(rec, rows, where)
    R = int(_field(rec, "replicas", where))
    order, tasks, arrived, finished = _replay_tasks(rec, row_block, tokens, R, where)
    cluster = Cluster(
        R,
        (int(_field(rec, "num_gpu_blocks", where)) - 1) * block_size,
        block_size,
        int(_field(rec, "max_num_seqs", where)),
    )  # vLLM keeps one block as its null block
    up, ready_from = _engines_up(rec, R, where)
    measured_busy = np.asarray(_field(rec, "engine_busy_s", where), float)
    items = plain_items(w, order, outs)
    # The cost model's seconds are not the bench machine's (its engines share 2 cores): the ready
    # times enter the model's clock scaled by its total busy time over the measured one.
    probe = simulate(w, items, cluster, cm, tasks)
    clock_scale = float(probe.busy_s.sum() / measured_busy.sum())
    # ... and so do each task's arrival at the engine stage, where the run records them
    arrive = None if arrived is None else np.maximum(arrived - up.min(), 0.0) * clock_scale
    tasks = replace(tasks, ready_s=(up - up.min()) * clock_scale, arrive_s=arrive, speed=speed)
    run = simulate(w, items, cluster, cm, tasks)
    measured_rows = np.asarray(_field(rec, "rows_per_engine", where), float)
    measured_computed = int(_field(rec, "computed_prompt_tokens", where))
    # simulated actor e stands for engine e: it was given engine e's ready time
    pred_rows = np.bincount(run.item_replica, minlength=R).astype(float)
    pred_computed = int(run.computed_tokens(w).sum())
    measured_share, pred_share = measured_busy / measured_busy.sum(), run.busy_s / run.busy_s.sum()
    agree = float(np.mean([row_engine[int(r)] == int(e) for r, e in zip(order, run.item_replica)]))
    rows_error = np.abs(pred_rows - measured_rows).max() / measured_rows.mean()
    return {
        "ready_s": [round(float(t), 2) if np.isfinite(t) else None for t in up - up.min()],
        "ready_from": ready_from,
        "tasks_from": "blocks, all at 0" if arrived is None else "batch_arrive_s",
        "locality_from": _locality_field(rec) if tasks.data_node is not None else None,
        "clock_scale": round(clock_scale, 6),
        "num_tasks": int(len(run.grain_replica)),
        "row_engine_agreement": round(agree, 4),
        "predicted": {
            "rows_per_engine": pred_rows.astype(int).tolist(),
            "computed_prompt_tokens": pred_computed,
            "busy_share": np.round(pred_share, 4).tolist(),
        },
        "measured": {
            "rows_per_engine": measured_rows.astype(int).tolist(),
            "computed_prompt_tokens": measured_computed,
            "busy_share": np.round(measured_share, 4).tolist(),
        },
        "errors": {
            "rows_per_engine": round(float(rows_error), 5),
            "placement": round(1 - agree, 5),
            "computed_prompt_tokens": round(pred_computed / measured_computed - 1, 5),
        },
        "busy_share_error": round(float(np.abs(pred_share - measured_share).max() * R), 5),
        **_against_measured_ends(run, tasks, order, row_engine, rec, finished, up, clock_scale),
    }


def _against_measured_ends(
    run: Any,
    tasks: Tasks,
    order: np.ndarray,
    row_engine: dict[int, int],
    rec: dict[str, Any],
    finished: np.ndarray | None,
    up: np.ndarray,
    clock_scale: float,
) -> dict[str, Any]:
    """For a run that records its task ends (finished, else None for both): the model's ends
    against them (`_task_ends`) and Ray's pick replayed with them (`rule_check`)."""
    if finished is None:
        return {"task_ends": None, "rule_with_measured_ends": None, "rule_with_pool_view": None}
    engine = np.array([row_engine[int(order[s])] for s in tasks.starts[:-1]])
    rank = np.argsort(np.asarray(rec["batch_handout_s"], float), kind="stable")  # as _arrived_tasks
    handout = np.asarray(rec["batch_handout_s"], float)[rank]
    freed, running = rec.get("batch_freed_s") or [None], rec.get("engine_running_s") or [None]
    pool_view = None
    if None not in freed and None not in running:  # ... what Ray's actor pool saw, where recorded
        joins = np.r_[running, up[len(running) :]]  # engines that ran nothing: never up
        pool_view = rule_check(tasks, engine, handout, np.asarray(freed, float)[rank], joins)
    return {
        "task_ends": _task_ends(run, order, row_engine, finished - up.min(), clock_scale),
        "rule_with_measured_ends": rule_check(tasks, engine, handout, finished, up),
        "rule_with_pool_view": pool_view,
    }


def _run_rows(rec: dict[str, Any], rows: list[dict[str, Any]], where: str) -> tuple[np.ndarray, dict, dict]:
    """A run's rows' output lengths (its workload's), and each row's block and engine."""
    workload = _field(rec, "workload", where)
    if any(workload not in r.get("output_tokens", {}) for r in rows):
        raise ValueError(f"{where}: workload={workload!r}, but not every row records output_tokens[{workload!r}]")
    outs = np.array([int(r["output_tokens"][workload]) for r in rows], np.int64)
    row_block, row_engine = _int_map(rec, "row_block", where), _int_map(rec, "row_engine", where)
    if sorted(row_engine) != list(range(len(rows))):
        raise ValueError(f"{where}: row_engine must give each of the {len(rows)} rows its engine")
    return outs, row_block, row_engine


def _task_ends(
    run: Any, order: np.ndarray, row_engine: dict[int, int], measured: np.ndarray, clock_scale: float
) -> dict:
    """The model's task ends against the measured ones (batch_finished_s: when each task's last
    row finished in vLLM, a little before Ray frees the task's slot, when the stage has returned
    its rows; here in seconds from the first engine up, tasks in hand-out order), over the tasks
    the model put on the engine that ran them: the median error and the median absolute error,
    and per engine how far apart the first five of those tasks it was handed ended, measured and
    predicted (vLLM runs the rows it admits at once in one batch, and tasks admitted together
    end about together, each when its longest row does; the model's clock, an engine's admitted
    work, ends them one after another)."""
    predicted = run.grain_time_s / clock_scale
    engine = np.array([row_engine[int(order[s])] for s in run.dispatch.starts[:-1]])
    same = engine == run.grain_replica
    error = predicted[same] - measured[same]

    def first_five(ends: np.ndarray) -> list[float | None]:
        spans = [ends[same & (engine == e)][:5] for e in range(len(run.busy_s))]
        return [round(float(np.ptp(x)), 2) if len(x) else None for x in spans]

    return {
        "same_engine_tasks": int(same.sum()),
        "median_error_s": round(float(np.median(error)), 2) if len(error) else None,
        "median_abs_error_s": round(float(np.median(np.abs(error))), 2) if len(error) else None,
        "first_five_span_s": {"measured": first_five(measured), "predicted": first_five(predicted)},
    }


def rule_check(tasks: Tasks, engine: np.ndarray, handout: np.ndarray, finished: np.ndarray, up: np.ndarray) -> dict:
    """Ray's pick alone, replayed over a run's own hand-outs (tasks, engine: the one Ray gave
    each, handout and finished: when Ray handed each out and when its last row finished, all in
    hand-out order; batch_handout_s, batch_finished_s) with its measured task ends: the engines
    join Ray's heaps at their ready times (up), each task handed out or ended re-ranks its
    engine, in time order, and at each hand-out `pick_actor` names an engine, against Ray's.
    The model's errors are its rule's and its clock's (when tasks end, on the bench's shared
    cores); this measures the rule without the clock. `contested`: the hand-outs when two or
    more engines up had room (the others any rule gets right), and how many of those it gave;
    `rows_per_engine`: the rows of the tasks the rule picked each engine for, against Ray's (each
    pick is made in the state Ray's own picks left, so a miss moves one task's rows, no more).
    Both biases of the replay (an engine joins when its engine was built, Ray sees it between
    scheduling steps; a slot frees at the task's last row, Ray frees it once it has the rows)
    give it more room than Ray had."""
    n, R = len(handout), len(up)
    data_node = node_numbers(tasks.data_node, n, "data_node", "tasks", ndim=2)
    actor_node = node_numbers(tasks.actor_node, R, "actor_node", "actors")
    heap, size, pos = dispatch.new_heaps(R, data_node, actor_node)
    inflight = np.zeros(R, np.int64)
    joins = [(float(up[e]), -1, e) for e in range(R) if np.isfinite(up[e])]
    events = sorted(joins + [(float(finished[t]), t, int(engine[t])) for t in range(n)])
    joined = np.zeros(R, bool)
    k, misses, contested, contested_as_ray = 0, [], 0, 0
    rule_rows = np.zeros(R, np.int64)  # each task's rows on the engine the rule picked
    for i in range(n):
        while k < len(events) and events[k][0] <= handout[i]:
            _, task, e = events[k]
            if task >= 0:
                inflight[e] -= 1
            joined[e] = True
            dispatch.rank_actor(heap, size, pos, actor_node[e], e, inflight)
            k += 1
        picked = int(dispatch.pick_actor(data_node[i], heap, size, inflight, tasks.max_in_flight))
        if np.sum(joined & (inflight < tasks.max_in_flight)) >= 2:
            contested += 1
            contested_as_ray += int(picked == engine[i])  # a numpy bool would make the count numpy's (no JSON)
        if picked != engine[i]:
            misses.append({"handout": i, "in_flight": inflight.tolist(), "rule": picked, "ray": int(engine[i])})
        rule_rows[picked] += tasks.starts[i + 1] - tasks.starts[i]
        inflight[engine[i]] += 1
        dispatch.rank_actor(heap, size, pos, actor_node[engine[i]], engine[i], inflight)
    ray_rows = np.bincount(engine, weights=np.diff(tasks.starts)[:n], minlength=R)
    return {
        "handouts": n,
        "as_ray": n - len(misses),
        "contested": {"handouts": contested, "as_ray": contested_as_ray},
        "rows_per_engine": {"rule": rule_rows.tolist(), "ray": ray_rows.astype(int).tolist()},
        "rows_per_engine_error": round(float(np.abs(rule_rows - ray_rows).max() / ray_rows.mean()), 5),
        "misses": misses,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="The dispatch model against scale_bench files' ray.data.llm runs.")
    ap.add_argument("scale_bench", nargs="+", help="scale_bench.json files (or extracts, .json.gz)")
    ap.add_argument(
        "--extract", default=None, help="also write what the validation reads of the one file here (.json.gz)"
    )
    ap.add_argument(
        "--speed-noise",
        type=float,
        default=None,
        help="instead, replay each run --draws more times, each engine's pace drawn in 1 +- this (speed_noise)",
    )
    ap.add_argument("--draws", type=int, default=10, help="replays per run for --speed-noise")
    ap.add_argument(
        "--measured-pace",
        action="store_true",
        help="instead, replay the runs that record their engines' paces at those paces and at even ones",
    )
    args = ap.parse_args(argv)
    if args.measured_pace:
        paced = paced_replays([Path(p) for p in args.scale_bench])
        for key, run in paced["runs"].items():
            print(key, json.dumps(run))
        print(f"rows per engine within {GOAL}: {json.dumps(paced['rows_per_engine_within_goal'])}")
        return
    if args.speed_noise is not None:
        noisy = speed_noise([Path(p) for p in args.scale_bench], args.speed_noise, args.draws)
        for key, run in noisy["runs"].items():
            print(key, json.dumps(run))
        print(f"engines' paces within 1 +- {args.speed_noise}: rows per engine moved more than {GOAL} from the")
        print(f"even-paced replay in {noisy['moved']}, within {GOAL} of the measured in {noisy['within_goal']}")
        return
    if args.extract:
        if len(args.scale_bench) != 1:
            ap.error("--extract takes one scale_bench file")
        out = Path(args.extract)
        out.write_bytes(
            gzip.compress(
                json.dumps(extract(load_bench(Path(args.scale_bench[0]))), separators=(",", ":")).encode(), 9, mtime=0
            )
        )
        print(f"wrote {out}")
    held = validate_files([Path(p) for p in args.scale_bench])
    for path, report in held["files"].items():
        for key, run in report["runs"].items():
            print(path, key, json.dumps({k: run[k] for k in ("ready_s", "errors", "busy_share_error")}))
        print(f"{path}: max_abs_error {report['max_abs_error']} (goal {report['goal']})")
    for path, report in held["files"].items():
        for key, cell in report["cells"].items():
            print(path, key, json.dumps({k: cell[k] for k in ("repeats", "errors", "measured_spread")}))
    print(
        f"runs within the goal: {held['runs_within_goal']}; in rows per engine: {held['rows_per_engine_within_goal']}"
    )
    print(f"cells within the goal (medians of their repeats): {held['cells_within_goal']}")
    if held["rule_with_measured_ends"]:
        print(f"Ray's pick given the measured task ends gave Ray's engine in {held['rule_with_measured_ends']}")
    if held["rule_with_pool_view"]:
        print(f"... given what Ray's actor pool saw (engines pickable, slots freed): {held['rule_with_pool_view']}")
    if held["measured_pace"]:
        print(f"rows per engine within {GOAL}, even paces and measured: {json.dumps(held['measured_pace'])}")


if __name__ == "__main__":
    main()
