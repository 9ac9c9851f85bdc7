"""Windows planned as Ray tasks on a multi-node test cluster: planning throughput by planners.

    python -m prefixflow.bench.window_tasks_bench [--prompts 400000] [--window 100000]
        [--nodes 4] [--planners 1,2,4] [--repeats 3]

A job planned in windows (window_rows) plans each window in a Ray task on any node
(operators/stages/window_plans.py); `window_planners` of them at once. This bench starts
Ray's own multi-node test cluster (ray.cluster_utils.Cluster: a head and nodes - 1 workers of
one CPU each, on this machine), materializes a synthetic tokenized dataset on it (documents of
`--prefix` tokens, each asked questions of `--question` tokens, rows in random document order:
what a tokenize stage leaves, block by block), and plans it with plan_windows as a windowed job
does, for each number of planners, the runs interleaved. Per run: wall time, prompts/s, the
driver's CPU time (what stays on the driver: numbering the windows, merging the homes), each
window's node and task time, the computed prompt tokens (what planning in parallel costs: a
window sees the homes of the windows up to `planners` before it only), the load average.

On this 2-core machine the nodes share two cores, so planners beyond two can only overlap
waits, not add CPU: read the ratios as a floor of what separate machines give. The results go
under `stream_tasks` in bench/results/plan_bench.json (the other entries are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prefixflow.bench.scale_bench import LOOPBACK
from prefixflow.operators.columns import ERROR
from prefixflow.operators.stages.tokenize import TOKENS

VOCAB = 32000


def synthetic_block(batch: dict[str, np.ndarray], rows: int, docs: int, prefix: int, question: int) -> pa.Table:
    """The tokenized rows of one block (batch["id"][0]: the block's number): each row a random
    document's tokens (seeded by the document) and its own question."""
    block = int(batch["id"][0])
    rng = np.random.default_rng(block)
    doc_ids = rng.integers(0, docs, rows)
    firsts = {d: np.random.default_rng(1_000_003 + int(d)).integers(0, VOCAB, prefix, np.int32) for d in set(doc_ids)}
    own = rng.integers(0, VOCAB, (rows, question), np.int32)
    flat = np.concatenate([np.concatenate([firsts[d], own[i]]) for i, d in enumerate(doc_ids)])
    offsets = np.arange(rows + 1, dtype=np.int32) * (prefix + question)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int32()))
    return pa.table({TOKENS: tokens, ERROR: pa.nulls(rows, pa.string())})


def plan_once(ds: Any, window_rows: int, planners: int, replicas: int) -> dict[str, Any]:
    """One windowed plan of `ds` with `planners` at once: what the module doc lists."""
    from prefixflow.operators.stages.window_plans import joined_windows, plan_windows, window_summary

    start, cpu = time.perf_counter(), time.process_time()
    windows = [
        window_summary(w)
        for w in plan_windows(ds, window_rows, planners, order="batchllm", num_replicas=replicas, block_size=16)
    ]
    wall, driver_cpu = time.perf_counter() - start, time.process_time() - cpu
    whole = joined_windows(windows).plan.summary
    return {
        "planners": planners,
        "wall_s": round(wall, 2),
        "prompts_per_s": round(whole["num_rows"] / wall),
        "driver_cpu_s": round(driver_cpu, 2),
        "num_windows": len(windows),
        "window_nodes": [w.planned_on[:8] for w in windows],
        "window_task_s": [round(w.timings["plan_task_s"], 2) for w in windows],
        "computed_prompt_tokens": int(whole["computed_prompt_tokens"]),
        "prompt_tokens": int(whole["prompt_tokens"]),
        "home_hit_tokens": int(whole.get("home_hit_tokens", 0)),
        "load_average": os.getloadavg()[0],
    }


def _median_cell(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [r["wall_s"] for r in runs]
    return {
        "planners": runs[0]["planners"],
        "median_wall_s": statistics.median(walls),
        "min_wall_s": min(walls),
        "max_wall_s": max(walls),
        "median_prompts_per_s": statistics.median(r["prompts_per_s"] for r in runs),
        "median_driver_cpu_s": statistics.median(r["driver_cpu_s"] for r in runs),
        "nodes_used": sorted({n for r in runs for n in r["window_nodes"]}),
        "computed_prompt_tokens": runs[0]["computed_prompt_tokens"],
        "runs": runs,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Every node and this driver on 127.0.0.1 (bench/scale_bench.py): Ray reads it when imported.
    os.environ.update(LOOPBACK)
    import ray
    from ray.cluster_utils import Cluster

    # Each node's agent on a port the OS gives it (0): nodes on one machine would all want the
    # default one (tests/cpu/test_multinode.py).
    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "dashboard_agent_listen_port": 0}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(args.nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        blocks = -(-args.prompts // args.rows_per_block)
        make = {"rows": args.rows_per_block, "docs": args.docs, "prefix": args.prefix, "question": args.question}
        ds = ray.data.range(blocks, override_num_blocks=blocks)
        ds = ds.map_batches(synthetic_block, batch_size=1, fn_kwargs=make, batch_format="numpy").materialize()
        # One bundle per block, as a tokenize stage streams them (a materialized dataset may
        # hand all its blocks over as one bundle: one window).
        ds = ray.data.from_arrow_refs(ds.to_arrow_refs())
        planners = [int(p) for p in args.planners.split(",")]
        runs: dict[int, list[dict[str, Any]]] = {p: [] for p in planners}
        plan_once(ds, args.window, max(planners), args.replicas)  # not kept: starts each node's workers
        for _ in range(args.repeats):  # interleaved: each round runs every cell once
            for p in planners:
                runs[p].append(plan_once(ds, args.window, p, args.replicas))
                print(json.dumps({k: v for k, v in runs[p][-1].items() if k != "window_task_s"}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    cells = [_median_cell(runs[p]) for p in planners]
    base = cells[0]["median_wall_s"]
    for cell in cells:
        cell["speedup_over_first"] = round(base / cell["median_wall_s"], 3)
    return {
        "num_prompts": blocks * args.rows_per_block,
        "window_rows": args.window,
        "nodes": args.nodes,
        "cpus_per_node": 1,
        "machine_cores": os.cpu_count(),
        "replicas": args.replicas,
        "workload": make,
        "repeats": args.repeats,
        "cells": cells,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=400_000)
    ap.add_argument("--rows-per-block", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=100_000, help="window_rows")
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--prefix", type=int, default=256, help="document tokens")
    ap.add_argument("--question", type=int, default=24, help="question tokens")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--planners", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/plan_bench.json")
    args = ap.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    if out.name:
        report = json.loads(out.read_text()) if out.exists() else {"bench": "plan_bench"}
        report["stream_tasks"] = result
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps([{k: v for k, v in c.items() if k != "runs"} for c in result["cells"]], indent=1))
    return result


if __name__ == "__main__":
    main()
