"""Attention kernel benchmark (GPU only): each Triton kernel against torch baselines and against
the device's measured copy bandwidth and matmul rate.

    .venv/bin/python -m prefixflow.bench.kernel_bench [--quick]

Writes bench/results/kernel_bench_<gpu>.json. CUDA events time every run; the reported time
is the median over many runs after warm-up. On a machine without CUDA it prints why and exits
without writing anything. Goals (H100): paged decode at >= 70% of the measured copy bandwidth;
prefix-shared decode (prefix 2000, distinct 200, 16 requests per prefix, 256 requests)
>= 4x faster than paged decode over the same sequences.

The launchers pick tiles by plain rules (no @triton.autotune: it fails under the interpreter);
`sweeps` in the JSON times alternative tile configurations of the two headline shapes so that
a session with a GPU can move the rules to the best measured ones.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from prefixflow.kernels import (
    apply_rotary,
    apply_rotary_ref,
    packed_prefill_attention,
    paged_decode_attention,
    prefix_shared_attention,
    rms_norm,
    rms_norm_ref,
    write_kv_cache,
)
from prefixflow.bench.step_profile import copy_bandwidth
from prefixflow.bench.kernel_cases import PrefixCase, make_prefix_case
from prefixflow.kernels.paged_decode import paged_decode_attention_triton
from prefixflow.kernels.prefix_attention import prefix_shared_attention_triton

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEVICE = "cuda"
DTYPE = torch.bfloat16
HQ, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B-like attention
DRY = False  # set by run(dry_run=True): the CPU, float32, small heads, one timed run per call


def _dry_setup() -> None:
    """Every benchmark shaped on the CPU (Triton's kernels under TRITON_INTERPRET=1, set before
    triton is imported): the code a GPU session will run, checked to run, numbers meaningless."""
    global DEVICE, DTYPE, HQ, HKV, D, DRY
    DEVICE, DTYPE, HQ, HKV, D, DRY = "cpu", torch.float32, 4, 2, 32, True


def time_ms(fn: Callable[[], object], warmup: int = 5, min_runs: int = 20, budget_ms: float = 400.0) -> float:
    """Median of per-run CUDA-event times after warm-up (at least min_runs runs); one clocked
    run on the CPU under a dry run."""
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < min_runs or (sum(times) < budget_ms and len(times) < 1000):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate, (bytes read + bytes written) / time, in GB/s."""
    return copy_bandwidth(str(DEVICE), 1 << (20 if DRY else 30)) / 1e9


def matmul_tflops() -> float:
    n = 256 if DRY else 8192
    a = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    b = torch.randn(n, n, device=DEVICE, dtype=DTYPE)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def kv_bytes(num_tokens: int, elem: int = 2) -> int:
    return num_tokens * HKV * D * 2 * elem


def _case(groups, solo, seed: int = 0) -> PrefixCase:
    return make_prefix_case(
        groups,
        solo,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=BLOCK,
        dtype=DTYPE,
        seed=seed,
        device=DEVICE,
        spare_blocks=0,
    )


def _full_tables(c: PrefixCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's prefix blocks followed by its own blocks, as plain paged decode (and
    vLLM's block sharing) sees them. Needs prefix lengths that are multiples of BLOCK."""
    plens, ranges = c.prefix_lens.tolist(), c.prefix_seq_ranges.tolist()
    lens, rows = c.kv_lens.tolist(), []
    for s, own in enumerate(lens):
        g = next((g for g in range(len(plens)) if ranges[g] <= s < ranges[g + 1]), -1)
        assert g < 0 or plens[g] % BLOCK == 0
        pre = c.prefix_block_tables[g, : plens[g] // BLOCK].tolist() if g >= 0 else []
        rows.append(pre + c.block_tables[s, : -(-own // BLOCK)].tolist())
        lens[s] = own + (plens[g] if g >= 0 else 0)
    width = max(len(r) for r in rows)
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return tables.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _paged_decode_loop(c: PrefixCase, kv_len: int) -> Callable[[], None]:
    """Per-request torch baseline: gather the request's blocks, then SDPA."""
    nb = -(-kv_len // BLOCK)

    def run() -> None:
        for s in range(c.q.shape[0]):
            blocks = c.block_tables[s, :nb].long()
            k = c.k_cache[blocks].reshape(-1, HKV, D)[:kv_len].transpose(0, 1)  # [Hkv, L, D]
            v = c.v_cache[blocks].reshape(-1, HKV, D)[:kv_len].transpose(0, 1)
            F.scaled_dot_product_attention(c.q[s].unsqueeze(1), k, v, scale=c.scale, enable_gqa=True)

    return run


def bench_decode(num_seqs: int, kv_len: int, copy_gbs: float) -> dict:
    c = _case([], [(1, kv_len)] * num_seqs)
    args = (c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale)
    ours = time_ms(lambda: paged_decode_attention(*args))
    nb = -(-kv_len // BLOCK)
    blocks = c.block_tables[:, :nb].long()
    kd = c.k_cache[blocks].reshape(num_seqs, -1, HKV, D)[:, :kv_len].transpose(1, 2).contiguous()
    vd = c.v_cache[blocks].reshape(num_seqs, -1, HKV, D)[:, :kv_len].transpose(1, 2).contiguous()
    qd = c.q.unsqueeze(2)  # [S, Hq, 1, D]
    dense = time_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=c.scale, enable_gqa=True))
    loop = time_ms(_paged_decode_loop(c, kv_len), warmup=1, min_runs=3)
    gbs = kv_bytes(num_seqs * kv_len) / ours / 1e6
    return dict(
        kernel="paged_decode",
        num_seqs=num_seqs,
        kv_len=kv_len,
        ours_ms=ours,
        sdpa_dense_contiguous_ms=dense,
        torch_per_request_loop_ms=loop,
        speedup_vs_loop=loop / ours,
        kv_gbs=gbs,
        frac_of_copy_bw=gbs / copy_gbs,
    )


def bench_prefix_decode(prefix: int, distinct: int, degree: int, num_requests: int, copy_gbs: float) -> dict:
    groups = [(prefix, [(1, distinct)] * degree) for _ in range(num_requests // degree)]
    c = _case(groups, [])
    ours_out = prefix_shared_attention(*c.args())
    ours = time_ms(lambda: prefix_shared_attention(*c.args(), out=ours_out))
    tables, lens = _full_tables(c)
    dargs = (c.q, c.k_cache, c.v_cache, lens, tables, c.scale)
    paged_out = paged_decode_attention(*dargs)
    paged = time_ms(lambda: paged_decode_attention(*dargs, out=paged_out))
    diff = float((ours_out.float() - paged_out.float()).abs().max())
    unique = kv_bytes(len(groups) * prefix + num_requests * distinct)
    return dict(
        kernel="prefix_shared_decode",
        prefix_len=prefix,
        distinct_len=distinct,
        sharing_degree=degree,
        num_requests=num_requests,
        ours_ms=ours,
        paged_decode_ms=paged,
        speedup_vs_paged_decode=paged / ours,
        max_abs_diff_vs_paged_decode=diff,
        unique_kv_gbs=unique / ours / 1e6,
        frac_of_copy_bw=unique / ours / 1e6 / copy_gbs,
    )


def _attention_flops(q_lens: list[int], keys_last: list[int]) -> float:
    """Causal FLOPs (QK^T and PV) when query i of a chunk sees keys_last - q_len + i + 1 keys."""
    total = 0
    for n, last in zip(q_lens, keys_last):
        total += n * (last - n) + n * (n + 1) // 2
    return 4.0 * HQ * D * total


def bench_mixed(
    num_prefill: int, chunk: int, num_decode: int, tflops: float, prefix: int = 2000, distinct: int = 200
) -> dict:
    """BatchLLM Fig. 11c: prefill chunks and decodes of prefix groups (16 each) in one step."""
    decode_groups = [(prefix, [(1, distinct)] * 16) for _ in range(num_decode // 16)]
    prefill_group = [(prefix, [(chunk, chunk)] * num_prefill)]
    c = _case(prefill_group + decode_groups, [])
    out = prefix_shared_attention(*c.args())
    ours = time_ms(lambda: prefix_shared_attention(*c.args(), out=out))
    q_lens = [chunk] * num_prefill + [1] * num_decode
    keys = [prefix + chunk] * num_prefill + [prefix + distinct] * num_decode
    flops = _attention_flops(q_lens, keys)
    return dict(
        kernel="prefix_shared_mixed",
        num_prefill=num_prefill,
        chunk=chunk,
        num_decode=num_decode,
        ours_ms=ours,
        tflops=flops / ours / 1e9,
        frac_of_matmul=flops / ours / 1e9 / tflops,
    )


def bench_prefill(num_prompts: int, length: int, tflops: float) -> dict:
    t = num_prompts * length
    q = torch.randn(t, HQ, D, device=DEVICE, dtype=DTYPE)
    k = torch.randn(t, HKV, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn(t, HKV, D, device=DEVICE, dtype=DTYPE)
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    ours = time_ms(lambda: packed_prefill_attention(q, k, v, cu, D**-0.5, out=out))

    def loop() -> None:
        for lo in range(0, t, length):
            F.scaled_dot_product_attention(
                q[lo : lo + length].transpose(0, 1),
                k[lo : lo + length].transpose(0, 1),
                v[lo : lo + length].transpose(0, 1),
                is_causal=True,
                scale=D**-0.5,
                enable_gqa=True,
            )

    sdpa = time_ms(loop)
    flops = _attention_flops([length] * num_prompts, [length] * num_prompts)
    return dict(
        kernel="packed_prefill",
        num_prompts=num_prompts,
        length=length,
        ours_ms=ours,
        sdpa_per_prompt_ms=sdpa,
        speedup_vs_sdpa=sdpa / ours,
        tflops=flops / ours / 1e9,
        frac_of_matmul=flops / ours / 1e9 / tflops,
    )


def bench_kv_write(num_tokens: int, copy_gbs: float) -> dict:
    k = torch.randn(num_tokens, HKV, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    k_cache = torch.zeros(num_tokens // BLOCK + 1, BLOCK, HKV, D, device=DEVICE, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_tokens, device=DEVICE)
    ours = time_ms(lambda: write_kv_cache(k, v, k_cache, v_cache, slots))
    gbs = 2 * kv_bytes(num_tokens) / ours / 1e6  # read + write
    return dict(kernel="write_kv_cache", num_tokens=num_tokens, ours_ms=ours, gbs=gbs, frac_of_copy_bw=gbs / copy_gbs)


def bench_norm_rope(num_tokens: int, copy_gbs: float) -> list[dict]:
    """Fused residual-add + RMSNorm and q/k rotary vs the eager torch code (the references)."""
    hidden = HQ * D
    x, res = torch.randn(2, num_tokens, hidden, device=DEVICE, dtype=DTYPE)
    w = torch.randn(hidden, device=DEVICE, dtype=DTYPE)
    ours = time_ms(lambda: rms_norm(x, w, 1e-5, res))
    eager = time_ms(lambda: rms_norm_ref(x, w, 1e-5, res))
    norm_bytes = 4 * x.numel() * x.element_size()  # x, res in; y, res out
    qkv = torch.randn(num_tokens, HQ + 2 * HKV, D, device=DEVICE, dtype=DTYPE)
    qk = qkv[:, : HQ + HKV]  # the q and k heads, rotated in one call as the model does
    pos = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    emb = torch.outer(torch.arange(8192, device=DEVICE).float(), inv).repeat(1, 2)
    cs = torch.stack([emb.cos(), emb.sin()], dim=1)[pos].to(DTYPE)  # gathered once per step
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    ours_rope = time_ms(lambda: apply_rotary(qk, cos, sin))
    eager_rope = time_ms(lambda: apply_rotary_ref(qk, cos, sin))
    rope_bytes = 2 * num_tokens * (HQ + HKV) * D * qkv.element_size()
    return [
        dict(
            kernel="rms_norm_residual",
            num_tokens=num_tokens,
            hidden=hidden,
            ours_ms=ours,
            torch_eager_ms=eager,
            speedup_vs_eager=eager / ours,
            frac_of_copy_bw=norm_bytes / ours / 1e6 / copy_gbs,
        ),
        dict(
            kernel="rotary_qk",
            num_tokens=num_tokens,
            ours_ms=ours_rope,
            torch_eager_ms=eager_rope,
            speedup_vs_eager=eager_rope / ours_rope,
            frac_of_copy_bw=rope_bytes / ours_rope / 1e6 / copy_gbs,
        ),
    ]


def _sweep(run_with: Callable[[dict], object], configs: list[dict]) -> list[dict]:
    """Times each tile configuration (the offline stand-in for Triton's autotuner, which the
    launchers do not use so that one code path serves the interpreter too)."""
    rows = []
    for cfg in configs:
        try:
            rows.append(dict(config=cfg, ms=time_ms(lambda: run_with(cfg))))
        except Exception as exc:  # a config may not fit the GPU (shared memory, registers)
            if DRY:  # on the CPU every config runs: a failure is a bug a GPU session would hit
                raise
            rows.append(dict(config=cfg, error=f"{type(exc).__name__}: {exc}"[:300]))
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))


def sweep_decode(num_seqs: int, kv_len: int) -> list[dict]:
    c = _case([], [(1, kv_len)] * num_seqs)
    out = torch.empty_like(c.q)
    args = (c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale)
    configs = [dict(BLOCK_N=n, num_warps=w, num_stages=st) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    configs = configs[:2] if DRY else configs
    return _sweep(lambda cfg: paged_decode_attention_triton(*args, out=out, config=cfg), configs)


def sweep_prefix_decode(prefix: int, distinct: int, degree: int, num_requests: int) -> list[dict]:
    c = _case([(prefix, [(1, distinct)] * degree) for _ in range(num_requests // degree)], [])
    out = torch.empty_like(c.q)
    configs = [dict(NSP=nsp, BM_P=bm, BN_P=64, num_warps=w) for nsp in (1, 2, 4, 8) for bm in (64, 128) for w in (4, 8)]
    configs = configs[:2] if DRY else configs
    return _sweep(lambda cfg: prefix_shared_attention_triton(*c.args(), out=out, config=cfg), configs)


def gpu_slug() -> str:
    if DRY:
        return "cpu_dry_run"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")


def run(quick: bool = False, dry_run: bool = False) -> dict:
    if dry_run:
        _dry_setup()
    copy_gbs, tflops = copy_bandwidth_gbs(), matmul_tflops()
    shapes = _shapes(quick, dry_run)
    results = [bench_decode(s, n, copy_gbs) for s, n in shapes["decode"]]
    results += [bench_prefix_decode(p, n, d, r, copy_gbs) for p, n, d, r in shapes["prefix"]]
    num_prefill, chunk, num_decode, prefix, distinct = shapes["mixed"]
    results += [bench_mixed(num_prefill, chunk, num_decode, tflops, prefix, distinct)]
    results += [bench_prefill(n, length, tflops) for n, length in shapes["prefill"]]
    results += [bench_kv_write(shapes["tokens"], copy_gbs)]
    results += bench_norm_rope(shapes["tokens"], copy_gbs)
    headline = [r for r in results if r["kernel"] == "prefix_shared_decode"][0]
    decode_main = results[0]
    sweeps = dict(
        paged_decode_256x2200=sweep_decode(*shapes["decode"][0]),
        prefix_shared_decode_2000_200_16_256=sweep_prefix_decode(*shapes["prefix"][0]),
    )
    return dict(
        gpu=torch.cuda.get_device_name() if not DRY else "cpu (dry run)",
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        dtype=str(DTYPE),
        heads=(HQ, HKV, D),
        block_size=BLOCK,
        copy_bandwidth_gbs=copy_gbs,
        matmul_tflops=tflops,
        goals={
            "decode_frac_of_copy_bw>=0.7": decode_main["frac_of_copy_bw"] >= 0.7,
            "prefix_shared_speedup>=4": headline["speedup_vs_paged_decode"] >= 4.0,
        },
        results=results,
        sweeps=sweeps,
    )


def _shapes(quick: bool, dry_run: bool) -> dict[str, Any]:
    """The benchmarks' shapes: (sequences, KV length) of decode; (prefix, distinct, degree,
    requests) of prefix-shared decode; (prefill chunks, chunk, decodes, prefix, distinct) of the
    mixed step; (prompts, length) of prefill; tokens of the KV write and norm/rotary."""
    if dry_run:  # the first of each list is what the sweeps time
        return dict(decode=[(2, 40)], prefix=[(32, 8, 2, 4)], mixed=(1, 8, 16, 32, 8), prefill=[(2, 16)], tokens=64)
    return dict(
        decode=[(256, 2200), (32, 2200)] if quick else [(256, 2200), (32, 2200), (256, 1024), (64, 8192), (8, 32768)],
        prefix=[(2000, 200, 16, 256)]
        if quick
        else [(2000, 200, 16, 256), (2000, 200, 256, 256), (2048, 256, 32, 32), (256, 2048, 256, 256)],
        mixed=(7, 512, 256, 2000, 200),
        prefill=[(8, 1024)] if quick else [(8, 1024), (2, 4096), (32, 256)],
        tokens=8192,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU; none found, nothing measured or written.")
        sys.exit(1)
    report = run(args.quick)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"kernel_bench_{gpu_slug()}.json"
    path.write_text(json.dumps(report, indent=2))
    for r in report["results"]:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
    print(f"goals: {report['goals']}\nwrote {path}")


if __name__ == "__main__":
    main()
