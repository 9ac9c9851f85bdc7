"""Where a native decode step's time goes, by batch size (issue 42's profile).

    python -m prefixflow.bench.step_profile [--models smollm2-135m-instruct,tiny]
        [--batches 1,8,64,256] [--decode-steps 32] [--label before]
        [--out bench/results/step_profile.json]

For each model and batch B, B rows share one 512-token prefix and have 16 tokens of their own
(greedy, fixed output length), all running together (max_num_seqs B, a roomy KV cache): each
decode step runs B sequences. Two runs tell the decode steps apart from the prefill: one asks
for 1 output token (prefill and the first sample only), one for 1 + `decode-steps`; what the
second spends more is `decode-steps` decode steps. Each run is timed 3 times (median wall),
then profiled once with torch's profiler, the parts torch cannot see wrapped in
record_function (native_profile.PARTS). A step's time is split into:

  matmul      the C skinny matmul (kernels/cpu_linear.py, a part) and oneDNN's linear (aten
              mm/addmm/... elsewhere) outside the other parts: projections, MLP, lm_head
  attention   the attention part (C or torch attention, with its K/V write)
  elementwise every other torch op outside the parts (norm, rotary, activation, adds, copies)
  sample      the sampler
  host        the scheduler (schedule, update) and the step's host arrays
  python      the rest of the wall time (Python between ops, the engine loop)

Beside it two floors: the matmul floor, the step's matmul FLOPs (2 x B x the weights every
token meets) at this machine's measured fp32 matmul rate (a 1024 x 1024 x 1024 mm, the same
threads); and the weights floor, those weights' bytes read once at the measured memory
bandwidth (a 256 MiB copy), which is what bounds a small batch.
Results go into `out` under [label][model/batch], so code before and after a change (another
checkout on PYTHONPATH) lands side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

PREFIX, OWN = 512, 16  # tokens: the shared prefix, each row's own
# The engine's linears run as oneDNN's prepacked linear on the CPU; aten's on other paths.
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn::_linear_pointwise"}
CATEGORIES = ("matmul", "attention", "elementwise", "sample", "host", "python")
HOST_PARTS = {"schedule", "update", "step_arrays"}


def matmul_rate(threads: int) -> float:
    """FLOP/s of a 1024^3 fp32 mm on `threads` threads (best of 5)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
    return 2 * 1024**3 / best


def memory_bandwidth(threads: int) -> float:
    """Bytes per second read and written by a 256 MiB copy on `threads` CPU threads."""
    import torch

    torch.set_num_threads(threads)
    return copy_bandwidth("cpu")


def copy_bandwidth(device: str, num_bytes: int = 256 << 20) -> float:
    """Bytes read and written per second by a copy of `num_bytes` on `device` (best of 5, after
    one warm-up): the weights-read floor of a decode step, for every bench (kernel_bench and
    gpu_engine use it too)."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weights_per_token(path: str) -> int:
    """Parameters of the matmuls every token meets: per layer q, k, v, o, gate, up, down;
    and the lm_head."""
    from prefixflow.engine.models.model_args import read_model_args

    a = read_model_args(path)
    attn = a.hidden_size * a.head_dim * (a.num_heads * 2 + a.num_kv_heads * 2)
    mlp = 3 * a.hidden_size * a.intermediate_size
    return a.num_layers * (attn + mlp) + a.hidden_size * a.vocab_size


def _categories(prof: Any) -> dict[str, float]:
    """Self CPU seconds by category (module docstring), python excluded."""
    out = dict.fromkeys(CATEGORIES[:-1], 0.0)
    for e in prof.events():
        if e.name.startswith("part:"):
            name = e.name[5:]
            if _part_of(e) is None:  # outermost part: its whole time, nested ops included
                out["host" if name in HOST_PARTS else name] += e.cpu_time_total / 1e6
            continue
        if _part_of(e) is not None or "::" not in e.name:  # inside a part, or not a torch op
            continue
        out["matmul" if e.name in MATMUL_OPS else "elementwise"] += e.self_cpu_time_total / 1e6
    return out


def _part_of(event: Any) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("part:"):
            return parent.name
        parent = parent.cpu_parent
    return None


def measure(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Median wall of 3 runs, decode step durations, then one profiled run's categories."""
    import torch
    from torch.profiler import ProfilerActivity

    from prefixflow.bench import peer_bench as pb

    load = pb.Workload("step", prompts, max_tokens)
    walls, outputs = [], None
    for _ in range(3):
        result, outs = pb.run_engine(engine, load, "plan")
        walls.append(result["wall_s"])
        outputs = result["outputs_sha"]
    steps = [s for s in engine.stats if s.num_prefill_tokens + s.num_prefix_tokens == 0]
    decode = [s.duration_s for s in steps]
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = _timed(lambda: pb.run_engine(engine, load, "plan"))
    cats = _categories(prof)
    cats["python"] = max(wall - sum(cats.values()), 0.0)
    return {
        "wall_s": statistics.median(walls),
        "walls_s": walls,
        "steps": engine.totals.num_steps,
        "decode_steps": len(decode),
        "decode_running_seqs_max": max((s.num_running_seqs for s in steps), default=0),
        "decode_step_median_s": statistics.median(decode) if decode else None,
        "profiled_wall_s": wall,
        "categories_s": cats,
        "outputs_sha": outputs,
    }


def profile_batch(path: str, batch: int, decode_steps: int, rate: float, bandwidth: float) -> dict[str, Any]:
    from prefixflow.bench import peer_bench as pb
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.models.model_args import read_model_args
    from prefixflow.engine.native.llm_engine import LLMEngine

    rng = random.Random(batch)
    prefix = [rng.randrange(3, pb.VOCAB) for _ in range(PREFIX)]
    prompts = [prefix + [rng.randrange(3, pb.VOCAB) for _ in range(OWN)] for _ in range(batch)]
    # Blocks, not tokens: each row's own tokens start a block of their own after the prefix.
    own_blocks = -(-(OWN + decode_steps + 1) // pb.BLOCK)
    tokens = (PREFIX // pb.BLOCK + batch * own_blocks + 64) * pb.BLOCK * 2
    config = EngineConfig(
        model=path,
        device="cpu",
        dtype="float32",
        block_size=pb.BLOCK,
        kv_cache_bytes=tokens * read_model_args(path).kv_bytes_per_token_per_elem * 4,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, PREFIX + batch * OWN),
        max_model_len=2048,
    )
    engine = LLMEngine(config)
    first = measure(engine, prompts, 1)
    full = measure(engine, prompts, 1 + decode_steps)
    per_step = {c: (full["categories_s"][c] - first["categories_s"][c]) / decode_steps for c in CATEGORIES}
    step_s = (full["wall_s"] - first["wall_s"]) / decode_steps
    floor = 2 * batch * weights_per_token(path) / rate
    weights_floor = 4 * weights_per_token(path) / bandwidth
    return {
        "batch": batch,
        "matmul_flops_per_s": round(rate),
        "memory_bytes_per_s": round(bandwidth),
        "decode_running_seqs_max": full["decode_running_seqs_max"],
        "decode_step_s": round(step_s, 6),
        "decode_step_median_s": full["decode_step_median_s"],
        "per_step_s": {c: round(v, 6) for c, v in per_step.items()},
        "share": {c: round(v / max(sum(per_step.values()), 1e-12), 4) for c, v in per_step.items()},
        "matmul_floor_s": round(floor, 6),
        "step_over_floor": round(step_s / floor, 2),
        "weights_floor_s": round(weights_floor, 6),
        "step_over_larger_floor": round(step_s / max(floor, weights_floor), 2),
        "matmul_over_floor": round(per_step["matmul"] / floor, 2),
        "runs": {"prefill_only": first, "with_decode": full},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,tiny")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--label", default="before")
    ap.add_argument("--out", default="bench/results/step_profile.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch

    from prefixflow.bench import native_profile, peer_bench as pb

    torch.set_num_threads(pb.THREADS)
    native_profile._instrument()
    rate, bandwidth = matmul_rate(pb.THREADS), memory_bandwidth(pb.THREADS)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    entry = data.setdefault(args.label, {})
    entry["meta"] = {
        "threads": pb.THREADS,
        "matmul_flops_per_s": round(rate),
        "memory_bytes_per_s": round(bandwidth),
        "load_average_at_start": list(os.getloadavg()),
        "prefix_tokens": PREFIX,
        "own_tokens": OWN,
        "decode_steps": args.decode_steps,
    }
    for model in args.models.split(","):
        path = pb.model_path(model)
        for batch in (int(b) for b in args.batches.split(",")):
            got = profile_batch(path, batch, args.decode_steps, rate, bandwidth)
            entry[f"{model}/{batch}"] = got
            print(
                f"{model} B={batch}: step {got['decode_step_s'] * 1e3:.1f} ms "
                f"(matmul floor {got['matmul_floor_s'] * 1e3:.2f} ms, weights floor "
                f"{got['weights_floor_s'] * 1e3:.2f} ms: {got['step_over_larger_floor']}x the larger), "
                + ", ".join(f"{c} {v:.0%}" for c, v in got["share"].items()),
                flush=True,
            )
    entry["meta"]["load_average_at_end"] = list(os.getloadavg())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
