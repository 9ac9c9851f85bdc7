"""The engine section of gpu_suite (issue 42): the native engine end to end on one device.

    python -m prefixflow.bench.gpu_engine [--dry-run] [--out FILE]

- parity: the native engine's greedy tokens against transformers' `generate` on the same device,
  float32, on the tiny llama and qwen2 checkpoints, prompts that share prefixes (engine groups):
  rows identical, and the largest gap between the two log-probabilities of a chosen token.
- decode: pure-decode steps of the 1B shape (Llama-3.2-1B's 16 layers, 2048 wide, 32 query and 8
  KV heads, 8192-wide MLP; the tiny tokenizer's 1,024-token vocabulary, so a small LM head) at 64
  and 256 requests. B rows share a 512-token prefix and have 16 tokens of their own, all running
  together; a run asking for 1 token (prefill and first sample) and one asking for 1 + S tokens
  tell S decode steps apart (the difference of their median walls over S). Beside the step: the
  weights floor (the weights' bytes read once at the device's measured copy bandwidth), and from
  torch's profiler over the same two runs, the device's busy time per decode step (the union of
  its kernels' intervals; the host's named ranges left out) and its share of the step timed
  without the profiler, the kernels launched per decode step and the largest kernels' device
  time per decode step, how many steps ran on the static buffers and replayed a graph, and the
  host's time per decode step by phase (the runner's profiler ranges, engine/native/phases.py;
  the rest is the scheduler's and the engine's), and its largest Python functions by their own
  time per decode step (cProfile over a third run of each).
- graphs_vs_eager: one decode step's logits as a graph, eagerly, and eagerly with block tables
  as wide as the graph's (which sizes the attention kernels' splits alike): whether the splits
  make the graphs' greedy tokens differ from eager's in bfloat16.
- default_budget: the engine with graphs as a job builds it (the KV budget from
  gpu_memory_utilization, graphs captured after the cache), decoding at the top rung: what
  model_runner.GRAPHS_BY_DEFAULT rests on.
- warmup: a fresh process builds the engine and runs a first step, twice: with empty kernel
  caches (PREFIXFLOW_CACHE for the C kernels, TRITON_CACHE_DIR for Triton's), then with the
  caches the first one filled (the issue's goals: at most 60 s, and 5 s when cached).
- each part twice: the engine's default steps, then with engine.cuda_graphs (decode steps
  replayed as CUDA graphs; on a CPU their static buffers, no graph); the goals are the graphs'.

--dry-run takes the same code on the CPU at a tiny shape (2 layers, 128 wide, 2 and 4 requests,
4 decode steps): every part shaped and checked to run, no number worth reading. Without it and
without CUDA it refuses. The GPU machine has torch, triton and transformers only: nothing here
needs Ray, pydantic or vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixflow.bench.record import covered_length

if TYPE_CHECKING:
    from prefixflow.engine.config import DType

SHAPE_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
)
SHAPE_DRY = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
PREFIX, OWN, BLOCK = 512, 16, 16
# The goals on a GPU: a 64-request decode step of the 1B shape, device busy share.
GOAL_STEP_64_S, GOAL_BUSY = 2.0e-3, 0.85


def parity(device: str, max_new: int = 16, cuda_graphs: bool = False) -> dict[str, Any]:
    """Native greedy vs transformers greedy, fp32, per architecture (the engine's decode steps
    replayed as CUDA graphs with cuda_graphs; their static buffers on a CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixflow.engine import EngineConfig, LLMEngine, SamplingParams
    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    out: dict[str, Any] = {}
    for arch in ("llama", "qwen2"):
        path = str(tiny_checkpoint_cached(arch, seed=1))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        torch.nn.Module.to(hf, device)  # the Module's own `to`: transformers' wrapper types it oddly
        engine = LLMEngine(
            EngineConfig(
                model=path,
                device=device,
                dtype="float32",
                block_size=BLOCK,
                kv_cache_bytes=64 << 20,
                max_num_seqs=16,  # the prompts' count rounded up: a short ladder of graphs
                cuda_graphs=cuda_graphs,
            )
        )
        prompts = _parity_prompts(hf.config.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=0)
        same, gap = 0, 0.0
        for prompt, got in zip(prompts, engine.generate(prompts, params)):
            tokens, ref_lp = hf_greedy(hf, prompt, max_new, device)
            same += list(got.token_ids) == tokens
            gap = max([gap] + [abs(a.logprob - b) for a, b in zip(got.logprobs, ref_lp)])
        out[arch] = {"rows": len(prompts), "rows_identical": same, "max_logprob_gap": gap, **_static_counts(engine)}
        del hf, engine
        _free(device)
    out["exact"] = all(v["rows_identical"] == v["rows"] for v in out.values())
    return out


def _static_counts(engine: Any) -> dict[str, float | None]:
    """How long the graphs' capture took, how many decode steps ran on the static buffers and how
    many of them replayed a CUDA graph (None: the engine has no static buffers): what says the
    graphs, not the eager steps, were measured."""
    static = engine.runner.static
    return {
        "graph_capture_s": None if static is None else static.capture_s,
        "static_steps": None if static is None else static.steps_run,
        "graph_replays": None if static is None else static.graph_replays,
    }


def hf_greedy(hf: Any, prompt: list[int], max_new: int, device: str = "cpu") -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (EOS ends them, as in our engine) and their log-probabilities:
    the oracle of the engine's parity here and in tests/cpu/test_engine_e2e.py."""
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


def _parity_prompts(vocab: int) -> list[list[int]]:
    """Two families sharing a prefix (one member equal to its prefix) and unrelated prompts."""
    rng = random.Random(0)
    tok = lambda: rng.randrange(3, vocab)  # noqa: E731  (0..2 are pad / bos / eos)
    prompts = []
    for prefix_len, own in ((40, [0, 3, 9, 5]), (70, [2, 30, 11])):
        prefix = [tok() for _ in range(prefix_len)]
        prompts += [prefix + [tok() for _ in range(n)] for n in own]
    prompts += [[tok() for _ in range(n)] for n in (1, 7, 30)]
    return prompts


def decode(
    device: str, dtype: DType, shape: dict[str, int], batches: list[int], decode_steps: int, cuda_graphs: bool = False
) -> dict:
    """The decode step of `shape` at each batch, beside the weights floor and the profile."""
    from prefixflow.bench.step_profile import copy_bandwidth
    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    path = str(tiny_checkpoint_cached("llama", seed=0, llama3_rope=False, **shape))
    bandwidth = copy_bandwidth(device)
    weight_bytes = weights_bytes(path, dtype)
    out: dict[str, Any] = {
        "shape": shape,
        "dtype": dtype,
        "copy_bytes_per_s": round(bandwidth),
        "weights_bytes": weight_bytes,
        "weights_floor_s": weight_bytes / bandwidth,
        "cuda_graphs": cuda_graphs,
    }
    for batch in batches:
        got = decode_batch(path, device, dtype, batch, decode_steps, cuda_graphs)
        got["step_over_weights_floor"] = round(got["decode_step_s"] / out["weights_floor_s"], 2)
        out[str(batch)] = got
    return out


def decode_batch(
    path: str, device: str, dtype: DType, batch: int, decode_steps: int, cuda_graphs: bool = False
) -> dict[str, Any]:
    from prefixflow.bench import peer_bench as pb

    prompts = _decode_prompts(batch)
    per_row = -(-(OWN + decode_steps + 1) // BLOCK) * BLOCK
    kv_bytes = 2 * (PREFIX + batch * per_row + 64 * BLOCK) * _kv_bytes_per_token(path, dtype)
    engine = _decode_engine(path, device, dtype, batch, cuda_graphs, kv_bytes)
    first = _runs(engine, pb.Workload("first", prompts, 1))
    full = _runs(engine, pb.Workload("decode", prompts, 1 + decode_steps))
    counts = _static_counts(engine)
    del engine
    _free(device)
    # The device's busy time per decode step, over the step timed without the profiler (the
    # profiled step is slower by the profiler's own host work; the device's kernels are not).
    busy = (full["device_busy_s"] - first["device_busy_s"]) / decode_steps
    step = (full["wall_s"] - first["wall_s"]) / decode_steps
    python = _per_step_ms(first, full, "python_s_by_function", decode_steps, 25)
    for run in (first, full):  # each run's largest only: every function the engine called is thousands
        run["python_s_by_function"] = dict(sorted(run["python_s_by_function"].items(), key=lambda kv: -kv[1])[:40])
    return {
        "batch": batch,
        "decode_steps": decode_steps,
        **counts,
        "decode_step_s": step,
        "device_busy_s_per_decode_step": busy if full["device_kernels"] else None,
        "device_busy_share": round(busy / step, 3) if full["device_kernels"] and step > 0 else None,
        "kernels_per_decode_step": (full["device_kernels"] - first["device_kernels"]) / decode_steps
        if full["device_kernels"]
        else None,
        "torch_ops_per_decode_step": (full["torch_ops"] - first["torch_ops"]) / decode_steps,
        "host_ms_per_decode_step": host_phases_ms(first, full, decode_steps),
        "device_ms_per_decode_step_by_kernel": _per_step_ms(first, full, "device_s_by_kernel", decode_steps),
        "python_ms_per_decode_step_by_function": python,
        "runs": {"first_token": first, "with_decode": full},
    }


def _decode_engine(
    path: str, device: str, dtype: DType, batch: int, cuda_graphs: bool, kv_cache_bytes: int | None
) -> Any:
    """The native engine the decode parts measure: `batch` requests at once, each prompt's
    prefill in one step (kv_cache_bytes None: the budget from gpu_memory_utilization)."""
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.native.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=path,
            device=device,
            dtype=dtype,
            block_size=BLOCK,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=batch,
            max_num_batched_tokens=max(2048, PREFIX + batch * OWN),
            max_model_len=2048,
            cuda_graphs=cuda_graphs,
        )
    )


def _decode_prompts(batch: int) -> list[list[int]]:
    """`batch` prompts sharing a PREFIX-token prefix, OWN tokens of their own each."""
    from prefixflow.bench import peer_bench as pb

    rng = random.Random(batch)
    prefix = [rng.randrange(3, pb.VOCAB) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, pb.VOCAB) for _ in range(OWN)] for _ in range(batch)]


def default_budget(device: str, dtype: DType, path: str, batch: int, decode_steps: int) -> dict[str, Any]:
    """The engine with graphs as a job builds it: no kv_cache_bytes on CUDA (the KV budget from
    gpu_memory_utilization, less the graphs' pool and logits), the graphs captured after the cache
    took its share of the device, then `batch` requests decoded (the top rung of the ladder). What
    model_runner.GRAPHS_BY_DEFAULT rests on. On a CPU (the dry run) a small cache instead."""
    import torch

    from prefixflow.bench import peer_bench as pb

    cuda = device.startswith("cuda")
    engine = _decode_engine(path, device, dtype, batch, True, None if cuda else 64 << 20)
    started = time.perf_counter()
    result, _ = pb.run_engine(engine, pb.Workload("decode", _decode_prompts(batch), 1 + decode_steps), "plan")
    _sync(device)
    out: dict[str, Any] = {
        "batch": batch,
        "num_kv_blocks": engine.runner.num_kv_blocks,
        "wall_s": round(time.perf_counter() - started, 3),
        "steps": result["steps"],
        **_static_counts(engine),
    }
    if cuda:
        free, total = torch.cuda.mem_get_info()
        out["device_memory"] = {
            "total_bytes": total,
            "free_bytes": free,
            "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        }
    del engine
    _free(device)
    return out


def graphs_vs_eager(device: str, dtype: DType, path: str, batch: int) -> dict[str, Any]:
    """Why the graphs' greedy tokens can differ from eager's: one decode step of `batch` members
    of a prefix group (the decode parts' layout), its logits three ways on one model runner: as
    a graph (the static buffers), eagerly, and eagerly with every block table (the members' and
    the prefix's) padded to the static buffers' width (max_model_len's), which sizes the
    attention kernels' splits as the graph's do. The graph also pads its prefix groups to the
    rung's size (64 groups, one with members), which eager cannot. Equal logits from the graph
    and the wide eager step would say the splits make the difference. (The first H200 run of
    this part padded only the members' tables: eager equal to itself, as expected.)"""
    from prefixflow.engine.native.step import SeqChunk, SharedPrefix, StepInput
    from prefixflow.requests import SamplingParams

    engine = _decode_engine(path, device, dtype, batch, True, None if device.startswith("cuda") else 64 << 20)
    runner, greedy = engine.runner, SamplingParams(temperature=0.0)
    static = runner.static
    own_blocks = -(-(OWN + 1) // BLOCK)
    prefix = SharedPrefix(block_table=tuple(range(PREFIX // BLOCK)), length=PREFIX)
    tables = [
        tuple(range(len(prefix.block_table) + i * own_blocks, len(prefix.block_table) + (i + 1) * own_blocks))
        for i in range(batch)
    ]
    prompts = _decode_prompts(batch)

    def padded(table: tuple[int, ...], width: int) -> tuple[int, ...]:  # with block 0, never read
        return table + (0,) * max(0, width - len(table))

    def member(i: int, tokens: list[int], cached: int, width: int = 0) -> SeqChunk:
        return SeqChunk(i, tuple(tokens), PREFIX + cached, cached, padded(tables[i], width), 0, True, greedy)

    prefill = prompts[0][:PREFIX]
    runner.execute_logits(StepInput((SeqChunk(-1, tuple(prefill), 0, 0, prefix.block_table),), (prefix,)))
    runner.execute_logits(StepInput(tuple(member(i, p[PREFIX:], 0) for i, p in enumerate(prompts)), (prefix,)))

    def decode_step(width: int = 0) -> StepInput:
        # width: the members' and the prefix's block tables padded to it (the graph's are both
        # max_blocks wide; the prefix-shared kernel sizes its splits of each from its width)
        wide = SharedPrefix(padded(prefix.block_table, width), PREFIX)
        return StepInput(tuple(member(i, [p[-1]], OWN, width) for i, p in enumerate(prompts)), (wide,))

    graph = runner.execute_logits(decode_step()).float().cpu()
    replays = static.graph_replays if static is not None else None
    runner.static = None  # the same runner's eager path
    try:
        eager = runner.execute_logits(decode_step()).float().cpu()
        wide = runner.execute_logits(decode_step(static.max_blocks if static else 0)).float().cpu()
    finally:
        runner.static = static
    del engine
    _free(device)

    return {
        "batch": batch,
        "graph_replays": replays,
        "graph_vs_eager": _compare_logits(graph, eager),
        "graph_vs_eager_wide_tables": _compare_logits(graph, wide),
        "eager_vs_eager_wide_tables": _compare_logits(eager, wide),
    }


def _compare_logits(a: Any, b: Any) -> dict[str, Any]:
    """Two [N, V] logits: equal, their largest difference, rows whose argmax agree."""
    return {
        "equal": bool((a == b).all()),
        "max_abs_diff": float((a - b).abs().max()),
        "argmax_equal_rows": int((a.argmax(-1) == b.argmax(-1)).sum()),
    }


def _runs(engine: Any, load: Any) -> dict[str, Any]:
    """Median wall of 3 runs, then one profiled run (device kernels, their busy union, torch ops)."""
    import torch
    from torch.profiler import ProfilerActivity

    from prefixflow.bench import peer_bench as pb
    from prefixflow.engine.native.phases import PHASES

    cuda = engine.runner.device.type == "cuda"
    walls = [pb.run_engine(engine, load, "plan")[0]["wall_s"] for _ in range(3)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        wall = time.perf_counter()
        result, _ = pb.run_engine(engine, load, "plan")
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - wall
    kernels = device_kernels(prof.events())

    def run_synced() -> None:
        pb.run_engine(engine, load, "plan")
        _sync(engine.runner.device.type)

    python = _python_s_by_function(run_synced)
    host = {name: 0.0 for name in PHASES}
    for avg in prof.key_averages():
        if avg.key in host:
            host[avg.key] += avg.cpu_time_total / 1e6
    return {
        "wall_s": statistics.median(walls),
        "walls_s": walls,
        "profiled_wall_s": wall,
        "device_kernels": len(kernels),
        "device_busy_s": covered_length([(e.time_range.start, e.time_range.end) for e in kernels])
        / 1e6,  # profiler's us
        "torch_ops": sum(1 for e in prof.events() if e.device_type != torch.autograd.DeviceType.CUDA),
        "host_phases_s": host,
        "device_s_by_kernel": _by_kernel(kernels),
        "python_s_by_function": python,
        "outputs_sha": result["outputs_sha"],
        "steps": result["steps"],
    }


def device_kernels(events: Any) -> list[Any]:
    """The profiler's device events that are work on the device: not the host's named ranges,
    which torch's profiler also lists as CUDA events (gpu_user_annotation, spanning from a range's
    first kernel to its last, gaps included)."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]


def _by_kernel(kernels: list[Any]) -> dict[str, float]:
    """Device seconds per kernel name (summed over its launches)."""
    seconds: dict[str, float] = {}
    for e in kernels:
        seconds[e.name] = seconds.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e6
    return seconds


def _per_step_ms(
    first: dict[str, Any], full: dict[str, Any], key: str, decode_steps: int, top: int = 15
) -> dict[str, float]:
    """Milliseconds per decode step by name from the two runs' `key` maps (seconds per name), the
    `top` largest (names cut to 120 characters): the device's by kernel (where the step's device
    time goes, beside the weights' floor), the host's by Python function."""
    per_step = {name: 1e3 * (s - first[key].get(name, 0.0)) / decode_steps for name, s in full[key].items()}
    largest = sorted(per_step.items(), key=lambda kv: -kv[1])[:top]
    return {name[:120]: round(ms, 4) for name, ms in largest}


def _python_s_by_function(run: Any) -> dict[str, float]:
    """Seconds spent in each Python function's own code (cProfile's tottime, its overhead
    included) over `run()`: which of the host's functions hold a step's time off the device."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(run)
    stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {f"{Path(file).name}:{line}({name})": row[2] for (file, line, name), row in stats.items()}


def host_phases_ms(first: dict[str, Any], full: dict[str, Any], decode_steps: int) -> dict[str, float]:
    """Where a decode step's host time goes, in the profiled runs (the profiler's own cost
    included): the runner's phases (engine/native/phases.py: sampling holds the wait for the device),
    and the rest of the step, the scheduler's and the engine's own work."""
    from prefixflow.engine.native.phases import PHASES

    per_step = {
        name.removeprefix("prefixflow."): 1e3
        * (full["host_phases_s"][name] - first["host_phases_s"][name])
        / decode_steps
        for name in PHASES
    }
    step = 1e3 * (full["profiled_wall_s"] - first["profiled_wall_s"]) / decode_steps
    per_step["scheduler_and_engine"] = step - sum(per_step.values())
    per_step["step"] = step
    return {k: round(v, 3) for k, v in per_step.items()}


def _free(device: str) -> None:
    """The memory of engines and models just dropped, back to the device."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def weights_bytes(path: str, dtype: str) -> int:
    """Bytes of the weights every decode token reads: per layer q, k, v, o, gate, up, down, and
    the LM head."""
    from prefixflow.bench.step_profile import weights_per_token

    return weights_per_token(path) * _elem(dtype)


def _kv_bytes_per_token(path: str, dtype: str) -> int:
    from prefixflow.engine.models.model_args import read_model_args

    return int(read_model_args(path).kv_bytes_per_token_per_elem * _elem(dtype))


def _elem(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def warmup(device: str, dtype: DType, path: str, cuda_graphs: bool = False) -> dict[str, Any]:
    """A fresh process builds the engine of the checkpoint at `path` (with engine.cuda_graphs:
    its graphs captured too) and runs a first step: with empty kernel caches, then with what
    the first filled."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PREFIXFLOW_CACHE": f"{tmp}/prefixflow", "TRITON_CACHE_DIR": f"{tmp}/triton"}
        runs = {}
        for name in ("cold", "cached"):
            cmd = [sys.executable, "-m", "prefixflow.bench.gpu_engine", "--warmup-child", path, device, dtype]
            cmd.append("graphs" if cuda_graphs else "eager")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"the warm-up process failed:\n{proc.stderr[-3000:]}")
            runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return runs


def warmup_child(path: str, device: str, dtype: str, steps: str) -> None:
    """In a fresh process: the engine built (imports included) and one 8-row step run, timed."""
    start = time.perf_counter()
    from prefixflow.engine import EngineConfig, LLMEngine, SamplingParams

    imported = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=path,
            device=device,
            dtype=dtype,
            block_size=BLOCK,
            kv_cache_bytes=256 << 20,
            cuda_graphs=steps == "graphs",
        )
    )
    built = time.perf_counter()
    prompts = [[3 + (7 * i + j) % 500 for j in range(40)] for i in range(8)]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    _sync(device)
    done = time.perf_counter()
    times = {"imports_s": imported - start, "engine_s": built - imported, "first_steps_s": done - built}
    print(json.dumps({**{k: round(v, 3) for k, v in times.items()}, "total_s": round(done - start, 3)}))


def run(dry_run: bool) -> dict[str, Any]:
    """Every part; on the CPU at the tiny shape under dry_run."""
    import torch

    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    device = "cpu" if dry_run else "cuda"
    dtype: DType = "float32" if dry_run else "bfloat16"
    shape, batches, steps = (SHAPE_DRY, [2, 4], 4) if dry_run else (SHAPE_1B, [64, 256], 32)
    started = time.perf_counter()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if not dry_run else "cpu (dry run)"}

    # Eager steps, then the same with the decode steps as CUDA graphs (engine.cuda_graphs; on a
    # CPU its static buffers): the goals are the graphs'.
    def checkpoint() -> str:  # made on first use, inside a part: its failure is that part's
        return str(tiny_checkpoint_cached("llama", seed=0, llama3_rope=False, **shape))

    parts = {
        "parity": lambda: parity(device),
        "parity_cuda_graphs": lambda: parity(device, cuda_graphs=True),
        "decode": lambda: decode(device, dtype, shape, batches, steps),
        "decode_cuda_graphs": lambda: decode(device, dtype, shape, batches, steps, cuda_graphs=True),
        "default_budget": lambda: default_budget(device, dtype, checkpoint(), batches[-1], steps),
        "graphs_vs_eager": lambda: graphs_vs_eager(device, dtype, checkpoint(), batches[0]),
        "warmup": lambda: warmup(device, dtype, checkpoint()),
        "warmup_cuda_graphs": lambda: warmup(device, dtype, checkpoint(), cuda_graphs=True),
    }
    for name, part in parts.items():
        out[name] = _guarded(part)
        print(f"gpu_engine {name}: {_brief(out[name])}", flush=True)
    out["goals"] = goals(out)
    # Whether the graphs' greedy tokens equal eager's (recorded, not a goal: in bfloat16 on the
    # H200 they differed at both batches, unpadded rungs; the cause was not measured, README).
    out["decode_outputs_equal_eager"] = {
        batch: out["decode"][batch]["runs"]["with_decode"]["outputs_sha"]
        == out["decode_cuda_graphs"][batch]["runs"]["with_decode"]["outputs_sha"]
        for batch in map(str, batches)
        if batch in out["decode"] and batch in out["decode_cuda_graphs"]
    }
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def _guarded(part: Any) -> dict[str, Any]:
    """A part's result, or its error and traceback: one part failing on a lent GPU (a capture
    that never ran there) must not cost the others' numbers."""
    import traceback

    try:
        return part()
    except Exception as exc:  # noqa: BLE001 - recorded in the report, which says the part failed
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


def _brief(result: dict[str, Any]) -> str:
    """One line for the log: the error, or each batch's decode step, busy share and host phases."""
    if "error" in result:
        return f"FAILED {result['error'][:300]}"
    steps = {
        k: (v["decode_step_s"], v["device_busy_share"], v["host_ms_per_decode_step"])
        for k, v in result.items()
        if isinstance(v, dict) and "decode_step_s" in v
    }
    return f"ok {steps}" if steps else "ok"


def goals(out: dict[str, Any]) -> dict[str, bool]:
    """The issue's goals, the graphs' numbers; a part that failed meets none of its goals."""
    step_64 = out["decode_cuda_graphs"].get("64", {})
    warm = out["warmup_cuda_graphs"]
    return {
        "float32_parity_exact": bool(out["parity"].get("exact") and out["parity_cuda_graphs"].get("exact")),
        "decode_step_64_at_most_2ms": step_64.get("decode_step_s", float("inf")) <= GOAL_STEP_64_S,
        "device_busy_at_least_85pct": (step_64.get("device_busy_share") or 0.0) >= GOAL_BUSY,
        "warmup_at_most_60s": "error" not in warm and warm["cold"]["total_s"] <= 60,
        "warmup_cached_at_most_5s": "error" not in warm and warm["cached"]["total_s"] <= 5,
        # not the issue's: what model_runner.GRAPHS_BY_DEFAULT (on) rests on
        "default_engine_replayed_graphs": (out["default_budget"].get("graph_replays") or 0) > 0,
    }


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--warmup-child":
        warmup_child(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every part on the CPU at a tiny shape")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--warmup-model", default=None, help="only the warm-up of this model (a name or path) on the CPU")
    ap.add_argument("--repeats", type=int, default=1, help="warm-up pairs (cold, cached) to run with --warmup-model")
    args = ap.parse_args()
    import torch

    if args.warmup_model:
        from prefixflow.bench.peer_bench import model_path

        runs = [warmup("cpu", "float32", model_path(args.warmup_model)) for _ in range(args.repeats)]
        result = {
            "model": args.warmup_model,
            "load_average": list(os.getloadavg()),
            "runs": runs,
            "median_total_s": {k: statistics.median(r[k]["total_s"] for r in runs) for k in ("cold", "cached")},
        }
        print(json.dumps(result["median_total_s"]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_engine needs a CUDA GPU (or --dry-run); none found, nothing run or written.")
    result = run(args.dry_run)
    print(json.dumps(result["goals"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
