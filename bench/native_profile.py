"""Where the native engine's time goes on one peer_bench workload (issue 17's profile).

    python -m prefixflow.bench.native_profile [--model tiny|smollm2-135m-instruct] [--quick]
        [--cache roomy|small] [--workload decode_heavy] [--repeats 3] [--label after]
        [--out bench/results/native_profile_issue17.json]

The engine runs in this process as peer_bench builds it (2 threads, the same KV cache, the
same prompts and greedy outputs); the best wall time of `repeats` runs, then one run under
torch's profiler, which times each torch op and, through record_function around them, the
parts torch cannot see: the C attention (inside "attention", with its K/V write), the C
matmul of decode-sized products ("matmul"), the scheduler, the step's host arrays and the
sampler. Results go into `out` under
[label][model/cache/workload], so runs of two versions of the code (another checkout on
PYTHONPATH) land side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

# The parts torch's profiler cannot see into (ctypes calls, Python), by what calls them.
PARTS = {
    "attention": ("prefixflow.engine.models.layers.attention", "PagedAttention", "forward"),
    # the C matmul of decode-sized products (oneDNN's show up as torch ops)
    "matmul": ("prefixflow.kernels.cpu_linear", None, "skinny_linear"),
    "schedule": ("prefixflow.engine.native.scheduler", "Scheduler", "schedule"),
    "update": ("prefixflow.engine.native.scheduler", "Scheduler", "update"),
    "sample": ("prefixflow.engine.native.sampler", "Sampler", "sample"),
    "step_arrays": ("prefixflow.engine.native.model_runner", None, "build_step_batch"),
}


def _wrap(name: str, fn: Callable) -> Callable:
    import torch

    def timed(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"part:{name}"):
            return fn(*args, **kwargs)

    return timed


_instrumented = False


def _instrument() -> None:
    """Wraps each of PARTS once per process (a second profile() reuses the wrappers)."""
    import importlib

    global _instrumented
    if _instrumented:
        return
    _instrumented = True
    for name, (module, cls, attr) in PARTS.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, attr, _wrap(name, getattr(owner, attr)))


def profile(model: str, quick: bool, cache: str, workload: str, repeats: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity

    from prefixflow.bench import peer_bench as pb

    path = pb.model_path(model)
    load = next(w for w in pb.workloads(quick) if w.name == workload)
    engine = pb.build_engine("native", pb.CACHES[cache], path)
    _instrument()
    pb.run_engine(engine, load, "plan")  # warm-up
    walls: list[float] = []
    result: dict = {}
    for _ in range(repeats):
        result, _ = pb.run_engine(engine, load, "plan")
        walls.append(result["wall_s"])
    steps: dict[str, list[float]] = defaultdict(list)
    for s in engine.stats:
        steps["decode" if s.num_prefill_tokens + s.num_prefix_tokens == 0 else "prefill/mixed"].append(s.duration_s)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        pb.run_engine(engine, load, "plan")
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    ops = sorted(
        ((e.key, e.self_cpu_time_total / 1e6, e.count) for e in events if not e.key.startswith("part:")),
        key=lambda x: -x[1],
    )[:12]
    parts = {e.key[5:]: [round(e.cpu_time_total / 1e6, 4), e.count] for e in events if e.key.startswith("part:")}
    return dict(
        wall_s=min(walls),
        all_wall_s=walls,
        steps=result.get("steps"),
        outputs_sha=result.get("outputs_sha"),
        step_seconds={k: [round(sum(v), 4), len(v)] for k, v in steps.items()},
        profiled_cpu_s=round(total, 4),
        parts_cpu_s_calls=parts,
        top_ops_self_cpu_s_calls=[[k, round(t, 4), c] for k, t, c in ops],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cache", default="roomy")
    ap.add_argument("--workload", default="decode_heavy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", default="bench/results/native_profile_issue17.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    started = time.time()
    entry = profile(args.model, args.quick, args.cache, args.workload, args.repeats)
    entry["profile_s"] = round(time.time() - started, 1)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    key = f"{args.model}{' quick' if args.quick else ''}/{args.cache}/{args.workload}"
    data.setdefault(args.label, {})[key] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(json.dumps({args.label: {key: entry}}, indent=1))


if __name__ == "__main__":
    main()
