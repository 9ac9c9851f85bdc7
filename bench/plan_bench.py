"""Planner benchmark: BatchLLM's microbenchmark shapes and its multi-level set (Sec. 4.3.1).

    python -m prefixflow.bench.plan_bench [--prompts 6400] [--out bench/results/plan_bench.json]
    python -m prefixflow.bench.plan_bench --scale [--sizes 1000000,3000000,10000000]
    python -m prefixflow.bench.plan_bench --stream 100000000 [--window 1000000]

--scale plans millions of synthetic prompts from their block hashes (issue 18), the way
plan_dataset does, each size in its own process: planned prompt tokens/s, the planner's peak
memory (resident set growth while planning; the synthetic rows stand in for the object store
and are generated per block on request, never as token arrays), the predicted GPU time of the
job (cost model, 8 H100 replicas, Llama-3.1-8B), and a linear extrapolation to 100M prompts.
plan_s is wall time on a shared machine; plan_cpu_s, the planner's CPU time, is what a quiet
driver would take (the planner is single-threaded).
The results go under `scale` in the output file, the other entries are kept.
--stream plans that many synthetic prompts in windows, as a job with window_rows (issue 39):
peak RSS of the one process against the windows planned, with what the windowed driver keeps
across windows; under `stream`. Windows planned as Ray tasks on a multi-node test cluster, by
the number planned at once: bench/window_tasks_bench.py, under `stream_tasks`.

For each dataset: saving ratios (multi-level optimum, enlarged single level, plain first level,
the plan's order), planning time, prompts/s, prompt tokens/s, and peak memory the planner
allocates (tracemalloc sees numpy's buffers) relative to the token ids themselves (int32).
The prompts arrive shuffled, so the sort does real work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import cast

import numpy as np

from prefixflow.pipeline import RaggedTokens, build_plan
from prefixflow.pipeline.block_hash import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_CELLS, HashedPrompts
from prefixflow.pipeline.homes import PrefixHomes, estimated_cache_blocks, homes_of
from prefixflow.pipeline.windows import merge_summaries, window_sizes

VOCAB = 32000


def shared_prefix_set(num_prompts: int, prefix_len: int, distinct_len: int, degree: int, seed: int = 0) -> RaggedTokens:
    """num_prompts / degree groups; each group's members share a prefix, then distinct tokens."""
    rng = np.random.default_rng(seed)
    groups = num_prompts // degree
    prefixes = rng.integers(0, VOCAB, (groups, prefix_len), dtype=np.int32)
    rows = np.empty((groups * degree, prefix_len + distinct_len), dtype=np.int32)
    rows[:, :prefix_len] = np.repeat(prefixes, degree, axis=0)
    rows[:, prefix_len:] = rng.integers(0, VOCAB, (groups * degree, distinct_len), dtype=np.int32)
    return _shuffled(rows, rng)


def multi_level_set(
    groups: int = 50,
    subcategories: int = 64,
    per_sub: int = 2,
    length: int = 1000,
    group_prefix: int = 490,
    sub_prefix: int = 11,
    seed: int = 0,
) -> RaggedTokens:
    """BatchLLM Sec. 4.3.1 Setting A: group prefix + sub prefix + random suffix, 1000 tokens."""
    rng = np.random.default_rng(seed)
    n = groups * subcategories * per_sub
    rows = rng.integers(0, VOCAB, (n, length), dtype=np.int32)
    g = np.repeat(rng.integers(0, VOCAB, (groups, group_prefix), dtype=np.int32), subcategories * per_sub, axis=0)
    s = np.repeat(rng.integers(0, VOCAB, (groups * subcategories, sub_prefix), dtype=np.int32), per_sub, axis=0)
    rows[:, :group_prefix] = g
    rows[:, group_prefix : group_prefix + sub_prefix] = s
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


class SyntheticHashes:
    """BatchLLM-like prompts known only by their block hashes, computed on request.

    90% of the prompts belong to groups of ~128 sharing a 300-700 token document, in pairs that
    also share 11 more tokens (BatchLLM Sec. 4.3.1's shape, grown); 10% share nothing. Lengths
    800-1200 tokens (~1k). A prompt costs 13 bytes here: what a dataset block would hold.
    """

    def __init__(self, num_prompts: int, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0):
        rng = np.random.default_rng(seed)
        num_groups = max(1, num_prompts // 128)
        self.block_size = block_size
        self.group = rng.integers(0, num_groups, num_prompts).astype(np.int32)
        self.sub = (self.group.astype(np.int64) * 64 + rng.integers(0, 64, num_prompts)).astype(np.int32)
        doc = rng.integers(300, 700, num_groups).astype(np.int16)
        shared = np.where(rng.random(num_prompts) < 0.9, doc[self.group], 0).astype(np.int16)
        self.shared = shared  # 0: no group
        self.length = rng.integers(800, 1200, num_prompts).astype(np.int32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.group, self.sub, self.shared, self.length))

    def gather(self, seqs: np.ndarray, depth: int, width: int) -> np.ndarray:
        """Hashes of blocks depth .. depth+width-1 (sort_by_gather's callback)."""
        k = depth + np.arange(width, dtype=np.int64)[None, :]
        doc_blocks = (self.shared[seqs].astype(np.int64) // self.block_size)[:, None]
        sub_blocks = np.where(self.shared[seqs] > 0, (self.shared[seqs].astype(np.int64) + 11) // self.block_size, 0)[
            :, None
        ]
        key = np.where(
            k < doc_blocks,
            self.group[seqs][:, None].astype(np.int64) + (1 << 40),
            np.where(k < sub_blocks, self.sub[seqs][:, None].astype(np.int64) + (2 << 40), seqs[:, None] + (3 << 40)),
        )
        x = (key * 1_000_003 + k).astype(np.uint64)
        for mult in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB):  # splitmix64's finaliser
            x = (x ^ (x >> np.uint64(31))) * np.uint64(mult)
        vals = (x >> np.uint64(1)).astype(np.int64)
        vals[k >= -(-self.length[seqs].astype(np.int64) // self.block_size)[:, None]] = -1
        return vals

    def prompts(self) -> HashedPrompts:
        def no_tokens(idx: np.ndarray) -> RaggedTokens:
            raise RuntimeError("synthetic prompts have no token ids")

        return HashedPrompts(self.length, self.gather, self.block_size, no_tokens, DEFAULT_MAX_CELLS)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes(*seen: int) -> int:
    """The process's peak RSS: the kernel's high-water mark, which Linux updates lazily (it can
    trail the current RSS by a few pages), and at least every RSS this process sampled."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _rss_bytes(), *seen)


def measure_scale(num_prompts: int, replicas: int = 8) -> dict:
    """One size, in this process (run by --scale in a fresh one per size)."""
    synth = SyntheticHashes(num_prompts)
    prompts = synth.prompts()
    before = _rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    plan = build_plan(prompts, order="batchllm", num_replicas=replicas)
    plan_s, plan_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _peak_rss_bytes(before)
    s = plan.summary
    predicted = [r["predicted_seconds"] for r in s["replicas"]]
    tokens = int(synth.length.sum())
    return {
        "num_prompts": num_prompts,
        "num_tokens": tokens,
        "block_size": synth.block_size,
        "replicas": replicas,
        "plan_s": round(plan_s, 2),
        "plan_cpu_s": round(plan_cpu_s, 2),
        "prompt_tokens_per_s": round(tokens / plan_s),
        "prompt_tokens_per_cpu_s": round(tokens / plan_cpu_s),
        "peak_driver_bytes": int(peak - before),
        "peak_process_rss_bytes": int(peak),
        "rss_before_plan_bytes": int(before),
        "synthetic_rows_bytes": synth.nbytes,
        "token_saving_ratio": round(s["token_saving_ratio"], 4),
        "num_groups": s["num_groups"],
        "tree_nodes": s["tree_nodes"],
        "predicted_job_seconds": round(max(predicted), 1),
        "predicted_gpu_seconds": round(sum(predicted), 1),
        "plan_share_of_predicted_job": round(plan_s / max(predicted), 5),
        "plan_cpu_share_of_predicted_job": round(plan_cpu_s / max(predicted), 5),
        "load_average": os.getloadavg()[0],
    }


def measure_stream(num_prompts: int, window_rows: int, replicas: int = 8) -> dict:
    """num_prompts planned in windows of window_rows (pipeline/windows.window_sizes), in this
    process, as a windowed job's driver plans them: each window a SyntheticHashes of its own
    (its rows numbered on from the last window's), planned and dropped; kept across windows what
    that driver keeps (operators/stages/supervise.py: each unit's row ids; jobs/run.py: each
    window's summary and group sizes; operators/stages/plan.py: the prefix homes, bounded by
    replicas x cache blocks). Peak RSS, and RSS after each window."""
    before = _rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    unit_rows: list[np.ndarray] = []
    group_sizes: list[np.ndarray] = []
    summaries: list[dict] = []
    rss_after: list[int] = []
    sizes, first = window_sizes(window_rows), 0
    homes = PrefixHomes.empty(replicas, estimated_cache_blocks(DEFAULT_BLOCK_SIZE))
    home_s = 0.0
    while first < num_prompts:
        size = min(next(sizes), num_prompts - first)
        synth = SyntheticHashes(size, seed=len(summaries))
        prompts = synth.prompts()
        plan = build_plan(prompts, row_ids=np.arange(first, first + size), num_replicas=replicas, homes=homes)
        t = time.perf_counter()
        homes = homes_of(plan, homes)
        home_s += time.perf_counter() - t
        row_ids = plan.table.column("row_id").to_numpy().astype(np.int64)
        unit_rows += np.split(row_ids, plan.unit_starts[1:-1])
        group_sizes.append(plan.group_sizes)
        summaries.append(plan.summary)
        del plan, synth
        first += size
        rss_after.append(_rss_bytes())
    merged = merge_summaries(summaries)
    kept = sum(a.nbytes for a in unit_rows) + sum(a.nbytes for a in group_sizes)
    homes_bytes = homes.hashes.nbytes + homes.replica.nbytes + homes.stamp.nbytes
    return {
        "num_prompts": num_prompts,
        "window_rows": window_rows,
        "num_windows": len(summaries),
        "replicas": replicas,
        "plan_s": round(time.perf_counter() - start, 1),
        "plan_cpu_s": round(time.process_time() - cpu_start, 1),
        "peak_process_rss_bytes": _peak_rss_bytes(before, *rss_after),
        "rss_before_plan_bytes": int(before),
        "rss_after_window_bytes": rss_after[:: max(1, len(rss_after) // 20)] + rss_after[-1:],
        "kept_across_windows_bytes": int(kept + homes_bytes),
        "prefix_homes_bytes": int(homes_bytes),
        "prefix_homes_record_s": round(home_s, 1),  # homes_of after each window (find is in plan_s)
        "home_hit_tokens": int(merged.get("home_hit_tokens", 0)),
        "token_saving_ratio": round(merged["token_saving_ratio"], 4),
        "num_groups": merged["num_groups"],
        "load_average": os.getloadavg()[0],
    }


def run_scale(sizes: list[int], out: Path) -> None:
    scale = []
    for n in sizes:
        proc = subprocess.run(
            [sys.executable, "-m", "prefixflow.bench.plan_bench", "--scale-one", str(n)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(f"{n:,} prompts failed (exit {proc.returncode}): {proc.stderr[-2000:]}", flush=True)
            break
        scale.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(scale[-1]), flush=True)
    report = json.loads(out.read_text()) if out.exists() else {"bench": "plan_bench"}
    report["scale"] = scale
    if scale:
        report["scale_extrapolated_100M"] = _extrapolate(scale, 100_000_000)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report.get("scale_extrapolated_100M")), f"-> {out}")


def _extrapolate(scale: list[dict], n: int) -> dict:
    """Least-squares line through (num_prompts, value) for time and memory: both are linear in
    the prompts (a fixed sort window aside)."""
    x = np.array([r["num_prompts"] for r in scale], dtype=float)

    def fit(key: str) -> float:  # np.polyval at a scalar n gives an np.float64, a float
        return (
            cast(float, np.polyval(np.polyfit(x, [r[key] for r in scale], 1), n))
            if len(x) > 1
            else scale[0][key] * n / x[0]
        )

    per_row = scale[-1]["predicted_job_seconds"] / scale[-1]["num_prompts"]
    return {
        "num_prompts": n,
        "plan_s": round(float(fit("plan_s")), 1),
        "plan_cpu_s": round(float(fit("plan_cpu_s")), 1),
        "peak_driver_bytes": int(fit("peak_driver_bytes")),
        "predicted_job_seconds": round(per_row * n, 1),
        "plan_share_of_predicted_job": round(float(fit("plan_s")) / (per_row * n), 5),
        "plan_cpu_share_of_predicted_job": round(float(fit("plan_cpu_s")) / (per_row * n), 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6400)
    ap.add_argument("--out", default="bench/results/plan_bench.json")
    ap.add_argument("--scale", action="store_true", help="plan millions of synthetic prompts from block hashes")
    ap.add_argument("--sizes", default="1000000,3000000,10000000", help="prompt counts for --scale")
    ap.add_argument("--scale-one", type=int, help=argparse.SUPPRESS)  # one size, in this process
    ap.add_argument("--stream", type=int, help="plan this many synthetic prompts in windows (--window)")
    ap.add_argument("--window", type=int, default=1_000_000, help="window_rows of --stream")
    args = ap.parse_args()
    if args.stream:
        result = measure_stream(args.stream, args.window)
        print(json.dumps(result), flush=True)
        out = Path(args.out)
        report = json.loads(out.read_text()) if out.exists() else {}
        report["stream"] = result
        out.write_text(json.dumps(report, indent=2) + "\n")
        return
    if args.scale_one:
        print(json.dumps(measure_scale(args.scale_one)), flush=True)
        return
    if args.scale:
        run_scale([int(x) for x in args.sizes.split(",")], Path(args.out))
        return
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
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "goal": {"prompt_tokens_per_s": 20_000_000, "peak_over_token_bytes": 1.5},
        "min_prompt_tokens_per_s": min(tps),
        "max_peak_over_token_bytes": max(peaks),
        "results": results,
    }
    out = Path(args.out)
    if out.exists():  # keep the --scale results, a separate run
        old = json.loads(out.read_text())
        report.update({k: old[k] for k in ("scale", "scale_extrapolated_100M", "stream") if k in old})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"min tokens/s {min(tps):,}  max peak/token bytes {max(peaks):.3f}  -> {out}")


if __name__ == "__main__":
    main()
