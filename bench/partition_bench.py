"""Data-parallel partitioning benchmark: balance, sharing kept and planning time (BlendServe Sec. 5.5).

    python -m prefixflow.bench.partition_bench [--requests 100000] [--out bench/results/partition_bench.json]

Two synthetic workloads of `--requests` prompts (a few hundred tokens each):
- batchllm: prefix-sharing groups of Zipf-distributed sizes (a few groups hold thousands of
  prompts, so a replica's share cuts through them), prefixes 100-400 tokens, distinct parts
  20-200, outputs 10-300 tokens.
- blendserve: BlendServe Table 2's mix, Trace#1-like: BurstGPT-like compute-heavy chats, MMLU-like
  shared few-shot prompts with 1-3 output tokens, OpenVid-like short prompts with long outputs;
  one system prompt per trace (Appendix A.3).
For R = 1, 2, 4, 8 and orders batchllm and blendserve: max/mean predicted replica time, token
saving ratio relative to the single-replica plan of the same order, tokens lost to cuts,
planning seconds. Goal: max/mean <= 1.03 and saving >= 99% of R = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from prefixflow.pipeline import RaggedTokens, build_plan

VOCAB = 32000


def _ragged(parts: list[np.ndarray], lens: list[np.ndarray], rng: np.random.Generator) -> RaggedTokens:
    """Concatenate per-prompt segments: parts[k] is [n, max_len_k] and lens[k] [n] its used length."""
    total = np.sum(lens, axis=0)
    offsets = np.r_[0, np.cumsum(total)].astype(np.int64)
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    pos = offsets[:-1].copy()
    for block, used in zip(parts, lens):
        cols = np.arange(block.shape[1])
        mask = cols[None, :] < used[:, None]
        idx = pos[:, None] + cols[None, :]
        flat[idx[mask]] = block[mask]
        pos += used
    return RaggedTokens(flat, offsets)


def batchllm_workload(n: int, seed: int = 0) -> tuple[RaggedTokens, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.zipf(1.6, size=n), n // 10)
    sizes = sizes[np.cumsum(sizes) <= n]
    sizes = np.r_[sizes, np.ones(n - sizes.sum(), dtype=np.int64)]  # the rest share nothing
    group = np.repeat(np.arange(len(sizes)), sizes)[rng.permutation(n)]
    prefix_len = rng.integers(100, 400, len(sizes))[group]
    prefixes = rng.integers(0, VOCAB, (len(sizes), 400), dtype=np.int32)[group]
    distinct_len = rng.integers(20, 200, n)
    distinct = rng.integers(0, VOCAB, (n, 200), dtype=np.int32)
    tokens = _ragged([prefixes, distinct], [prefix_len, distinct_len], rng)
    return tokens, rng.integers(10, 300, n)


def blendserve_workload(n: int, seed: int = 0) -> tuple[RaggedTokens, np.ndarray]:
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=[0.45, 0.35, 0.20])  # BurstGPT, MMLU, OpenVid
    system = rng.integers(0, VOCAB, (3, 32), dtype=np.int32)[kind]
    shots = np.where(kind[:, None] == 1, rng.integers(0, VOCAB, (1, 200), dtype=np.int32), 0)
    shot_len = np.where(kind == 1, 200, 0)
    body_len = np.choose(kind, [rng.integers(100, 400, n), rng.integers(30, 80, n), rng.integers(30, 100, n)])
    body = rng.integers(0, VOCAB, (n, 400), dtype=np.int32)
    outs = np.choose(kind, [rng.integers(10, 120, n), rng.integers(1, 4, n), rng.integers(500, 3000, n)])
    tokens = _ragged([system, shots, body], [np.full(n, 32), shot_len, body_len], rng)
    return tokens, outs


def measure(
    workload: str, tokens: RaggedTokens, outs: np.ndarray, order: str, replicas: int, single: dict | None
) -> dict:
    start = time.perf_counter()
    plan = build_plan(tokens, output_lens=outs, order=order, num_replicas=replicas)
    seconds = time.perf_counter() - start
    s = plan.summary
    base = single["token_saving_ratio"] if single else s["token_saving_ratio"]
    return {
        "workload": workload,
        "order": order,
        "num_replicas": replicas,
        "num_requests": len(tokens),
        "prompt_tokens": tokens.num_tokens,
        "max_over_mean_predicted_time": round(s["predicted_seconds_max_over_mean"], 5),
        "predicted_seconds": [round(r["predicted_seconds"], 3) for r in s["replicas"]],
        "token_saving_ratio": round(s["token_saving_ratio"], 5),
        "saving_vs_single_replica": round(s["token_saving_ratio"] / base, 5) if base else 1.0,
        "sharing_kept_vs_single_level_grouping": round(s["sharing_kept"], 5),
        "lost_saving_tokens": s["lost_saving_tokens"],
        "lost_saving_tokens_per_replica": [r["lost_saving_tokens"] for r in s["replicas"]],
        "num_groups": s["num_groups"],
        "planning_seconds": round(seconds, 3),
        "_summary": s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--out", default="bench/results/partition_bench.json")
    args = ap.parse_args()
    results = []
    for name, make in (("batchllm", batchllm_workload), ("blendserve", blendserve_workload)):
        tokens, outs = make(args.requests)
        for order in ("batchllm", "blendserve"):
            single = None
            for replicas in (1, 2, 4, 8):
                row = measure(name, tokens, outs, order, replicas, single)
                single = single or row["_summary"]
                row.pop("_summary")
                results.append(row)
                print(json.dumps(row), flush=True)
    multi = [r for r in results if r["num_replicas"] > 1]
    report = {
        "bench": "partition_bench",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "cost_model": "Llama-3.1-8B shape on the h100 profile (pipeline/cost_model.py)",
        "goal": {"max_over_mean_predicted_time": 1.03, "saving_vs_single_replica": 0.99},
        "worst_max_over_mean": max(r["max_over_mean_predicted_time"] for r in multi),
        "worst_saving_vs_single_replica": min(r["saving_vs_single_replica"] for r in multi),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"worst max/mean {report['worst_max_over_mean']:.4f}  worst saving vs R=1 "
        f"{report['worst_saving_vs_single_replica']:.4f}  -> {out}"
    )


if __name__ == "__main__":
    main()
