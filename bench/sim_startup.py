"""Start-up: how long the GPUs wait before the first row reaches an engine, and the bytes each
way of feeding the cluster moves before generation.

Every system loads its engines in ENGINE_LOAD_S (the same for all). Then:
  arrival     ray.data.llm starts its engines at once and streams: the first block is read and
              tokenized while they load: max(engine load, first block);
  sorted      a sort is a barrier: every row is read and range-partitioned through the object
              store before the first block reaches an engine, then that block is tokenized:
              max(engine load, read + sort) + first block's tokenizing;
  plan(s)     prefixflow with one plan: read and tokenize every row (streamed: the slower of
              the two), gather the plan's metadata on the driver and plan, the engines loading
              meanwhile (issue 39; `startup_s` is the older order, engines started after the plan);
  streamed    prefixflow with window_rows (issue 39): the same for the first window only
              (window_rows / 16 rows), the engines loading meanwhile; each later window is
              planned while the engines run the one before (`window_plan_s`, with the prefix
              homes' lookup: plan_bench measured 13.1 s against 8.5 s a 1M-row window).
Tokenizing runs on the cluster's data CPUs (nodes x DATA_CPUS_PER_NODE); during generation it
keeps up with the engines (300M tokens/s at 64 replicas, far above their prefill rate), so it
stalls nothing after start-up. Rates (STARTUP_RATES) say which are measured and which assumed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from prefixflow.bench.sim_items import BLOCK_SIZE, SlicedPlan, trie_order_lcp
from prefixflow.bench.sim_workloads import Workload
from prefixflow.pipeline.block_hash import DEFAULT_MAX_CELLS
from prefixflow.pipeline.prefix_tree import DEFAULT_BLOCK

TEXT_BYTES_PER_TOKEN = 4  # UTF-8 bytes per token of English text
STREAM_WINDOW_ROWS = 1_000_000  # the streamed plan's window_rows (its first window: 1/16 of it)
HOMES_PLAN_FACTOR = 13.1 / 8.5  # a window's planning with the prefix homes, over without (plan_bench)
REPLICAS_PER_NODE = 8  # GPUs per node: copies of the plan sent to nodes


@dataclass(frozen=True, slots=True)
class StartupRates:
    """engine_load_s: assumed, every system. tokenize_tokens_per_cpu_s: measured on this
    project's 2-core machine (2026-11-28): SmolLM2's BPE through transformers' fast tokenizer,
    one thread, 1.85M tokens of the demo's English text, 391k tokens/s. plan_prompts_per_driver_cpu_s:
    measured, bench/results/plan_bench.json "scale": 10M prompts (9.995B tokens, as block hashes)
    planned in 209.72 s of driver CPU (taken per prompt: the driver's sort, tree and partition
    work per row; the hashes are made where the rows are tokenized). data_cpus_per_node, read_bytes_per_node_s,
    shuffle_bytes_per_node_s, driver_bytes_per_s: assumed (an 8-GPU node gives half of its 192
    vCPUs to data work; object storage reads 1 GB/s per node; a sort's shuffle moves 0.5 GB/s
    per node; the driver's link 1.25 GB/s)."""

    engine_load_s: float = 90.0
    tokenize_tokens_per_cpu_s: float = 390_000.0
    plan_prompts_per_driver_cpu_s: float = 10_000_000 / 209.72
    data_cpus_per_node: int = 96
    read_bytes_per_node_s: float = 1.0e9
    shuffle_bytes_per_node_s: float = 0.5e9
    driver_bytes_per_s: float = 1.25e9


STARTUP_RATES = StartupRates()


def sort_bytes(w: Workload) -> int:
    """`ds.sort` on the prompt text: every row's text crosses the object store once."""
    return int(w.prompt_lens.sum()) * TEXT_BYTES_PER_TOKEN


def plan_stage_bytes(
    w: Workload,
    plan: Any,
    block_size: int = BLOCK_SIZE,
    num_replicas: int = 1,
    order_lcp: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, int]:
    """What prefixflow's plan stage moves (operators/stages/plan.py): per-row metadata to the driver,
    the KV-block hashes its sort gathers, and the plan to each node. The sort gathers, level by
    level, `width` hashes of every row still tied with another (sort_by_gather with
    DEFAULT_MAX_CELLS), plus the row's index in the request."""
    if isinstance(plan, SlicedPlan):
        parts = [
            plan_stage_bytes(w.subset(rows), p, block_size, num_replicas) for rows, p in zip(plan.rows, plan.plans)
        ]
        return {k: sum(part[k] for part in parts) for k in parts[0]}
    order, lcp = order_lcp or trie_order_lcp(w)
    tied = np.zeros(len(w), np.int64)  # blocks shared with a neighbour
    if len(lcp):
        lcp_blocks = lcp // block_size
        tied[order[:-1]] = lcp_blocks
        tied[order[1:]] = np.maximum(tied[order[1:]], lcp_blocks)
    tied = np.sort(tied)
    hashes, requests, depth, active = 0, 0, 0, len(w)
    while active > 0:
        width = max(1, min(DEFAULT_BLOCK, DEFAULT_MAX_CELLS // active))
        hashes += active * width
        requests += active
        depth += width
        active = len(tied) - int(np.searchsorted(tied, depth))  # still tied past this level
    plan_bytes = plan.table.nbytes + plan.seq_index.nbytes + plan.run_starts.nbytes + plan.replica_runs.nbytes
    nodes = -(-num_replicas // REPLICAS_PER_NODE)
    out = {
        "row_metadata_to_driver": 16 * len(w),
        "sort_hashes_to_driver": 8 * hashes,
        "sort_requests_to_blocks": 8 * requests,
        "plan_to_nodes": int(plan_bytes) * nodes,
    }
    out["total"] = sum(out.values())
    return out


def startup_seconds(
    policy: str,
    num_rows: int,
    tokens: float,
    num_replicas: int,
    first_block_rows: int = 0,
    plan_bytes: int = 0,
    rates: StartupRates = STARTUP_RATES,
    window_rows: int = STREAM_WINDOW_ROWS,
) -> dict[str, float]:
    """The parts of a policy's start-up (module doc) and their total, "startup_s", for a
    workload of `num_rows` rows and `tokens` prompt tokens. first_block_rows: rows in the first
    block an engine gets (arrival, sorted); plan_bytes: plan_stage_bytes' total (plans)."""
    nodes = -(-num_replicas // REPLICAS_PER_NODE)
    text = tokens * TEXT_BYTES_PER_TOKEN
    read = text / (nodes * rates.read_bytes_per_node_s)
    cpus = nodes * rates.data_cpus_per_node
    block_tokens = tokens * first_block_rows / max(num_rows, 1)
    read_per_cpu = rates.read_bytes_per_node_s / rates.data_cpus_per_node  # a read task's share of its node
    first_block = block_tokens * TEXT_BYTES_PER_TOKEN / read_per_cpu + block_tokens / rates.tokenize_tokens_per_cpu_s
    load = rates.engine_load_s
    if policy == "arrival":
        parts = {"engine_load_s": load, "first_block_s": first_block, "startup_s": max(load, first_block)}
    elif policy == "sorted":
        sort = text / (nodes * rates.shuffle_bytes_per_node_s)
        tokenize_first = block_tokens / rates.tokenize_tokens_per_cpu_s
        parts = {
            "engine_load_s": load,
            "read_s": read,
            "sort_s": sort,
            "first_block_tokenize_s": tokenize_first,
            "startup_s": max(load, read + sort) + tokenize_first,
        }
    elif policy.startswith("plan"):
        tokenize = tokens / (cpus * rates.tokenize_tokens_per_cpu_s)
        gather = plan_bytes / rates.driver_bytes_per_s
        plan = num_rows / rates.plan_prompts_per_driver_cpu_s
        parts = {
            "read_s": read,
            "tokenize_s": tokenize,
            "gather_s": gather,
            "plan_s": plan,
            "engine_load_s": load,
            "startup_s": max(read, tokenize) + gather + plan + load,
            # what the same plan would wait if the engines loaded while it was made
            "startup_if_engines_load_meanwhile_s": max(load, max(read, tokenize) + gather + plan),
        }
    elif policy == "streamed":
        share = min(window_rows, num_rows) / max(num_rows, 1)  # a whole window's share of the job
        first = share / 16
        homes = HOMES_PLAN_FACTOR / rates.plan_prompts_per_driver_cpu_s
        prepared = max(read, tokens / (cpus * rates.tokenize_tokens_per_cpu_s)) + plan_bytes / rates.driver_bytes_per_s
        parts = {
            "window_rows": window_rows,
            "first_window_rows": int(first * num_rows),
            "first_window_s": first * prepared + first * num_rows / rates.plan_prompts_per_driver_cpu_s,
            "engine_load_s": load,
            "window_plan_s": share * prepared + share * num_rows * homes,
        }
        parts["startup_s"] = max(load, parts["first_window_s"])
    else:
        raise ValueError(f"policy={policy!r} has no start-up model: use arrival, sorted, streamed or a plan policy")
    return {k: round(v, 1) for k, v in parts.items()}


def rates_record(rates: StartupRates = STARTUP_RATES) -> dict[str, float]:
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(rates).items()}


def gpu_wait(result: dict[str, Any], window_rows: int = STREAM_WINDOW_ROWS) -> dict[str, Any]:
    """How long the GPUs wait before their first work, per mix of a cluster_sim result: the
    recorded start-ups (arrival, sorted, one plan with its engines loading meanwhile, and the
    older barrier that started them after it) beside the streamed plan's (computed here, closed
    form, from the mix's recorded rows, tokens and plan bytes), with the time one window takes
    the driver to plan against the time the engines take to run one (plan_steal's makespan)."""
    replicas = int(result["config"]["num_replicas"])
    out: dict[str, Any] = {"window_rows": window_rows, "num_replicas": replicas, "mixes": {}}
    for name, mix in result["mixes"].items():
        fixed = mix["output_models"]["fixed"]["policies"]
        plan = fixed["plan_steal"]["startup"]
        streamed = startup_seconds(
            "streamed", mix["num_prompts"], mix["prompt_tokens"], replicas, 0, mix["plan_stage_bytes"]["total"]
        )
        run_s = fixed["plan_steal"]["makespan_hours_without_startup"] * 3600
        waits = {
            "arrival": fixed["arrival"]["startup"]["startup_s"],
            "sorted": fixed["sorted"]["startup"]["startup_s"],
            "one_plan_engines_after_plan": plan["startup_s"],
            "one_plan_engines_load_meanwhile": plan["startup_if_engines_load_meanwhile_s"],
            "streamed_plan": streamed["startup_s"],
        }
        out["mixes"][name] = {
            "gpu_wait_s": waits,
            "gpu_wait_hours_all_replicas": {k: round(v * replicas / 3600, 2) for k, v in waits.items()},
            "streamed": streamed,
            "engines_s_per_window": round(run_s * window_rows / mix["num_prompts"], 1),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    """python -m prefixflow.bench.sim_startup [bench/results/cluster_sim.json]: adds
    `gpu_wait_before_first_work` (gpu_wait) to a cluster_sim result, without simulating again."""
    import json
    import sys

    path = (argv if argv is not None else sys.argv[1:] or ["bench/results/cluster_sim.json"])[0]
    with open(path) as f:
        result = json.load(f)
    result["gpu_wait_before_first_work"] = gpu_wait(result)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result["gpu_wait_before_first_work"], indent=1))


if __name__ == "__main__":
    main()
