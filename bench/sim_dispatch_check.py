"""The dispatch model against measured ray.data.llm runs: `validate_dispatch` replays each run
that scale_bench.json records (its blocks in dispatch order, batch_size, tasks in flight,
engines, each row's measured output length and prompt) through sim_run.py's Ray hand-out and
compares rows per engine, computed prompt tokens and engine busy-time shares with the measured
ones (issue 38: goal within 5%).

What it reads (scale_bench.json): top-level "rows" [{"id", "prompt_tokens", "max_tokens",
"output_tokens": {workload: length}}], "token_rows" (each prompt's token ids, in row id order),
"args": {"block_size", "model" or "model_config": the checkpoint's config with "vocab_size"},
optionally "hardware_profile" {"peak_flops", "mem_bandwidth"} (else CPU_PROFILE); per run under
"runs" -> key -> "repeats": "system", "replicas", "workload", "block_rows", "batch_size",
"max_tasks_in_flight_per_actor", "max_num_seqs", "num_gpu_blocks", "rows_per_engine",
"engine_busy_s", "computed_prompt_tokens", "row_engine", "row_block", and optionally
"block_row_ids" (each block's row ids in the order the block holds them; without it: row id
order, or token order for a sorted run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from prefixflow.bench.sim_items import plain_items
from prefixflow.bench.sim_run import Cluster, RayData, Run, ray_tasks, simulate
from prefixflow.bench.sim_workloads import Workload, workload_from_tokens
from prefixflow.pipeline.cost_model import GIB, CostModel, HardwareProfile, ModelShape

GOAL = 0.05
# Used when the file records no hardware profile: cost_model.measure_cpu_profile on this
# project's 2-core machine, loaded, 2026-11-28, gave 10-19 GFLOP/s (fp32 matmul) and 1.7-4.8
# GB/s (copy). Only the busy-time shares depend on it, through the balance of compute and
# memory time; the bench should record its own ("hardware_profile").
CPU_PROFILE = HardwareProfile("scale_bench_cpu", 16e9, 3.5e9, 16 * GIB)


def validate_dispatch(scale_bench_json: Path, cost_model: CostModel | None = None) -> dict[str, Any]:
    """Per ray.data.llm run of the file (module doc): predicted and measured rows per engine,
    computed prompt tokens and busy-time shares, their errors, and the worst error overall."""
    path = Path(scale_bench_json)
    data = json.loads(path.read_text())
    rows, tokens = _rows(data, path)
    cm = cost_model or bench_cost_model(data, path)
    block_size = int(_field(data.get("args", {}), "block_size", f"{path}: args"))
    caps = np.array([int(r["max_tokens"]) for r in rows], np.int64)
    w = workload_from_tokens(tokens, caps)
    runs: dict[str, Any] = {}
    for key, cell in data.get("runs", {}).items():
        for k, rec in enumerate(cell.get("repeats", [])):
            if str(rec.get("system", key)).startswith("ray_llm"):
                runs[f"{key}#{k}"] = replay_run(w, rows, tokens, rec, block_size, cm, f"{path}: runs[{key}][{k}]")
    worst = max((max(abs(e) for e in r["errors"].values()) for r in runs.values()), default=None)
    return {"runs": runs, "max_abs_error": worst, "goal": GOAL, "within_goal": worst is not None and worst <= GOAL,
            "cost_model": {"hardware": cm.hardware.name, "peak_flops": cm.hardware.peak_flops,
                           "mem_bandwidth": cm.hardware.mem_bandwidth}}


def bench_cost_model(data: dict[str, Any], path: Path) -> CostModel:
    """The bench model's shape (args.model_config, else args.model; needs vocab_size; fp32 unless
    it says) on the recorded hardware profile, else CPU_PROFILE."""
    args = data.get("args", {})
    cfg = args.get("model_config") or args.get("model")
    if not cfg or "vocab_size" not in cfg:
        raise ValueError(f"{path}: args.model_config (or args.model) must give the bench model's config with "
                         "vocab_size, for the busy-time model; or pass cost_model")
    shape = ModelShape.from_hf_config({"torch_dtype": "float32", **cfg})
    hw = data.get("hardware_profile")
    profile = HardwareProfile("recorded", float(hw["peak_flops"]), float(hw["mem_bandwidth"]), 16 * GIB) if hw \
        else CPU_PROFILE
    return CostModel(shape, profile)


def _field(rec: dict[str, Any], name: str, where: str) -> Any:
    if name not in rec:
        raise ValueError(f"{where} has no {name!r}: scale_bench must record it for validate_dispatch")
    return rec[name]


def _rows(data: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], list[list[int]]]:
    rows, tokens = _field(data, "rows", str(path)), _field(data, "token_rows", str(path))
    if len(rows) != len(tokens) or [int(r["id"]) for r in rows] != list(range(len(rows))):
        raise ValueError(f"{path}: rows must hold ids 0..{len(tokens) - 1} in order, one per token_rows entry "
                         f"(got {len(rows)} rows for {len(tokens)} token rows)")
    for r, t in zip(rows, tokens):
        if int(r["prompt_tokens"]) != len(t):
            raise ValueError(f"{path}: row {r['id']} says prompt_tokens={r['prompt_tokens']} but its token_rows "
                             f"entry holds {len(t)} tokens")
    return rows, tokens


def _dispatch_order(rec: dict[str, Any], row_block: dict[int, int], tokens: list[list[int]],
                    where: str) -> tuple[np.ndarray, np.ndarray]:
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
        raise ValueError(f"{where}: block_rows, row_block (or block_row_ids) must place every row once, "
                         "block by block")
    return np.asarray(order, np.int64), block_rows


def _int_map(rec: dict[str, Any], name: str, where: str) -> dict[int, int]:
    return {int(k): int(v) for k, v in _field(rec, name, where).items()}   # JSON keys are strings


def replay_run(w: Workload, rows: list[dict[str, Any]], tokens: list[list[int]], rec: dict[str, Any],
               block_size: int, cm: CostModel, where: str) -> dict[str, Any]:
    """One measured run replayed through the dispatch model; its predictions, measurements, errors."""
    workload = _field(rec, "workload", where)
    if any(workload not in r.get("output_tokens", {}) for r in rows):
        raise ValueError(f"{where}: workload={workload!r}, but not every row records output_tokens[{workload!r}]")
    outs = np.array([int(r["output_tokens"][workload]) for r in rows], np.int64)
    row_block, row_engine = _int_map(rec, "row_block", where), _int_map(rec, "row_engine", where)
    if sorted(row_engine) != list(range(len(rows))):
        raise ValueError(f"{where}: row_engine must give each of the {len(rows)} rows its engine")
    order, block_rows = _dispatch_order(rec, row_block, tokens, where)
    R = int(_field(rec, "replicas", where))
    ray = RayData(len(block_rows), int(_field(rec, "batch_size", where)),
                  int(_field(rec, "max_tasks_in_flight_per_actor", where)))
    cluster = Cluster(R, (int(_field(rec, "num_gpu_blocks", where)) - 1) * block_size, block_size,
                      int(_field(rec, "max_num_seqs", where)))   # vLLM keeps one block as its null block
    run = simulate(w, plain_items(w, order, outs), cluster, cm, ray_tasks(len(order), ray, R, block_rows))
    measured_rows = np.asarray(_field(rec, "rows_per_engine", where), float)
    to_sim, mapping = engine_mapping(run, row_block, row_engine, block_rows, measured_rows)
    measured_busy = np.asarray(_field(rec, "engine_busy_s", where), float)
    measured_computed = int(_field(rec, "computed_prompt_tokens", where))
    pred_rows = np.bincount(run.item_replica, minlength=R)[to_sim].astype(float)
    pred_busy = run.busy_s[to_sim]
    pred_computed = int(run.computed_tokens(w).sum())
    measured_share, pred_share = measured_busy / measured_busy.sum(), pred_busy / pred_busy.sum()
    sim_engine = np.argsort(to_sim)[run.item_replica]          # simulated actor -> measured engine index
    agree = float(np.mean([row_engine[int(r)] == int(e) for r, e in zip(order, sim_engine)]))
    rows_error = np.abs(pred_rows - measured_rows).max() / measured_rows.mean()
    return {"engine_mapping": mapping, "num_tasks": int(len(run.grain_replica)),
            "row_engine_agreement": round(agree, 4),
            "predicted": {"rows_per_engine": pred_rows.astype(int).tolist(), "computed_prompt_tokens": pred_computed,
                          "busy_share": np.round(pred_share, 4).tolist()},
            "measured": {"rows_per_engine": measured_rows.astype(int).tolist(),
                         "computed_prompt_tokens": measured_computed,
                         "busy_share": np.round(measured_share, 4).tolist()},
            "errors": {"rows_per_engine": round(float(rows_error), 5),
                       "computed_prompt_tokens": round(pred_computed / measured_computed - 1, 5),
                       "busy_share": round(float(np.abs(pred_share - measured_share).max() * R), 5)}}


def engine_mapping(run: Run, row_block: dict[int, int], row_engine: dict[int, int], block_rows: np.ndarray,
                   measured_rows: np.ndarray) -> tuple[np.ndarray, str]:
    """[R] the simulated actor standing for each measured engine: the actor that got the first
    block the engine got ("first_block"; Ray's actor order is its own), or, when that is not one
    to one, both sides by rows, most first ("by_rows")."""
    R = len(run.busy_s)
    block_start = np.r_[0, np.cumsum(block_rows)[:-1]]
    task_of_block = np.searchsorted(run.dispatch.starts, block_start, side="right") - 1
    first: dict[int, int] = {}
    for r, e in row_engine.items():
        first[e] = min(first.get(e, row_block[r]), row_block[r])
    actors = [int(run.grain_replica[task_of_block[first[e]]]) if e in first else -1 for e in range(R)]
    if sorted(actors) == list(range(R)):
        return np.asarray(actors, np.int64), "first_block"
    by_rows = np.empty(R, np.int64)
    by_rows[np.argsort(-measured_rows, kind="stable")] = \
        np.argsort(-np.bincount(run.item_replica, minlength=R), kind="stable")
    return by_rows, "by_rows"
