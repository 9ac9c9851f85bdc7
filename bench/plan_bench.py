"""Planner benchmark: BatchLLM's microbenchmark shapes and its multi-level set (Sec. 4.3.1).

    python -m prefixflow.bench.plan_bench [--prompts 6400] [--out bench/results/plan_bench.json]

For each dataset: saving ratios (multi-level optimum, enlarged single level, plain first level,
the plan's order), planning time, prompts/s, prompt tokens/s, and peak memory the planner
allocates (tracemalloc sees numpy's buffers) relative to the token ids themselves (int32).
The prompts arrive shuffled, so the sort does real work.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import tracemalloc
from pathlib import Path

import numpy as np

from prefixflow.pipeline import RaggedTokens, build_plan

VOCAB = 32000


def shared_prefix_set(num_prompts: int, prefix_len: int, distinct_len: int, degree: int,
                      seed: int = 0) -> RaggedTokens:
    """num_prompts / degree groups; each group's members share a prefix, then distinct tokens."""
    rng = np.random.default_rng(seed)
    groups = num_prompts // degree
    prefixes = rng.integers(0, VOCAB, (groups, prefix_len), dtype=np.int32)
    rows = np.empty((groups * degree, prefix_len + distinct_len), dtype=np.int32)
    rows[:, :prefix_len] = np.repeat(prefixes, degree, axis=0)
    rows[:, prefix_len:] = rng.integers(0, VOCAB, (groups * degree, distinct_len), dtype=np.int32)
    return _shuffled(rows, rng)


def multi_level_set(groups: int = 50, subcategories: int = 64, per_sub: int = 2, length: int = 1000,
                    group_prefix: int = 490, sub_prefix: int = 11, seed: int = 0) -> RaggedTokens:
    """BatchLLM Sec. 4.3.1 Setting A: group prefix + sub prefix + random suffix, 1000 tokens."""
    rng = np.random.default_rng(seed)
    n = groups * subcategories * per_sub
    rows = rng.integers(0, VOCAB, (n, length), dtype=np.int32)
    g = np.repeat(rng.integers(0, VOCAB, (groups, group_prefix), dtype=np.int32), subcategories * per_sub, axis=0)
    s = np.repeat(rng.integers(0, VOCAB, (groups * subcategories, sub_prefix), dtype=np.int32), per_sub, axis=0)
    rows[:, :group_prefix] = g
    rows[:, group_prefix:group_prefix + sub_prefix] = s
    return _shuffled(rows, rng)


def _shuffled(rows: np.ndarray, rng: np.random.Generator) -> RaggedTokens:
    rows = rows[rng.permutation(len(rows))]
    offsets = np.arange(len(rows) + 1, dtype=np.int64) * rows.shape[1]
    return RaggedTokens(rows.reshape(-1), offsets)


def measure(name: str, tokens: RaggedTokens, order: str = "batchllm", repeats: int = 3) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = build_plan(tokens, order=order)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    build_plan(tokens, order=order)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    best = min(times)
    s = plan.summary
    token_bytes = tokens.num_tokens * 4
    return {
        "dataset": name,
        "order": order,
        "num_prompts": len(tokens),
        "prompt_tokens": tokens.num_tokens,
        "num_groups": s["num_groups"],
        "num_shared_groups": s["num_shared_groups"],
        "optimal_token_saving_ratio": round(s["optimal_token_saving_ratio"], 4),
        "single_level_token_saving_ratio": round(s["single_level_token_saving_ratio"], 4),
        "first_level_token_saving_ratio": round(s["first_level_token_saving_ratio"], 4),
        "token_saving_ratio": round(s["token_saving_ratio"], 4),
        "plan_seconds_best": round(best, 4),
        "plan_seconds_all": [round(t, 4) for t in times],
        "prompts_per_s": round(len(tokens) / best),
        "prompt_tokens_per_s": round(tokens.num_tokens / best),
        "peak_planner_bytes": int(peak),
        "token_id_bytes_int32": token_bytes,
        "peak_over_token_bytes": round(peak / token_bytes, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6400)
    ap.add_argument("--out", default="bench/results/plan_bench.json")
    args = ap.parse_args()
    results = []
    for prefix_len, distinct_len in [(2000, 200), (2000, 1000), (1000, 1000)]:
        for degree in (2, 4, 8, 16):
            name = f"shared {prefix_len}/{distinct_len} sd={degree}"
            results.append(measure(name, shared_prefix_set(args.prompts, prefix_len, distinct_len, degree)))
            print(json.dumps(results[-1]), flush=True)
    multi = multi_level_set()
    for order in ("batchllm", "dfs", "fcfs"):
        results.append(measure("multi-level 490+11+489 (50x64x2)", multi, order=order))
        print(json.dumps(results[-1]), flush=True)
    tps = [r["prompt_tokens_per_s"] for r in results]
    peaks = [r["peak_over_token_bytes"] for r in results]
    report = {
        "bench": "plan_bench",
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                    "processor": platform.processor() or platform.machine()},
        "goal": {"prompt_tokens_per_s": 20_000_000, "peak_over_token_bytes": 1.5},
        "min_prompt_tokens_per_s": min(tps),
        "max_peak_over_token_bytes": max(peaks),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"min tokens/s {min(tps):,}  max peak/token bytes {max(peaks):.3f}  -> {out}")


if __name__ == "__main__":
    main()
