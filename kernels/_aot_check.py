"""Compile every Triton kernel for a CUDA target without a GPU (Triton's ahead-of-time path
down to a cubin through the wheel's ptxas). The CPU interpreter does not catch compiler-only
errors (types of loop-carried values, layouts, shared memory); this does.

    TRITON_INTERPRET=0 .venv/bin/python -m prefixflow.kernels._aot_check [--arch 90]

Must run in a process where TRITON_INTERPRET was unset or 0 when triton was imported.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from prefixflow.kernels import _attn_core, kv_write, packed_prefill, paged_decode
from prefixflow.kernels import norm, prefix_attention, rotary

PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}
INT_PTRS = (
    "kv_lens_ptr",
    "bt_ptr",
    "cu_ptr",
    "tile_cu_ptr",
    "prefix_lens_ptr",
    "pbt_ptr",
    "group_tok_ptr",
    "p_tile_cu_ptr",
    "o_tile_cu_ptr",
    "ranges_ptr",
)
DATA_PTRS = (
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "out_ptr",
    "k_cache_ptr",
    "v_cache_ptr",
    "x_ptr",
    "res_ptr",
    "w_ptr",
    "y_ptr",
    "new_res_ptr",
    "cos_ptr",
    "sin_ptr",
)


def _signature(fn, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in DATA_PTRS:
            sig[name] = PTR[dtype]
        elif name in INT_PTRS:
            sig[name] = "*i32"
        elif name == "slot_ptr":
            sig[name] = "*i64"
        elif name in ("o_part_ptr", "lse_part_ptr"):
            sig[name] = "*fp32"
        elif name in ("qk_scale", "eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _jobs(dtype: str) -> list[tuple[str, object, dict, int]]:
    f32 = dtype == "float32"
    attn = dict(HEAD_DIM=128, PAGE=16, DOT_F32=f32)
    decode_n = 32 if f32 else 64  # as paged_decode_attention_triton picks
    prefill_cfg = packed_prefill.prefill_config(getattr(torch, dtype), 4, 128, False)
    prefill_warps = prefill_cfg.pop("num_warps")
    jobs = [
        ("decode", paged_decode._decode_kernel, dict(GROUP=4, BLOCK_M=16, BLOCK_N=decode_n, NUM_SPLITS=1, **attn), 8),
        (
            "decode_split",
            paged_decode._decode_kernel,
            dict(GROUP=8, BLOCK_M=16, BLOCK_N=decode_n, NUM_SPLITS=4, **attn),
            8,
        ),
        (
            "prefill",
            packed_prefill._prefill_kernel,
            dict(GROUP=4, HEAD_DIM=128, DOT_F32=f32, **prefill_cfg),
            prefill_warps,
        ),
        ("plan", _attn_core.plan_kernel, dict(GROUP=4, BM_O=16, BM_P=64, WITH_GROUPS=True, BLOCK=128), 4),
        ("merge", _attn_core.merge_kernel, dict(NUM_SLOTS=3, HEAD_DIM=128, BLOCK_R=16), 4),
        ("rms_norm", norm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096), 16),
        ("rotary", rotary._rotary_kernel, dict(HEAD_DIM=128, BLOCK_H=64), 4),
        ("kv_write", kv_write._write_kernel, dict(HEAD_DIM=128, NUM_KV_HEADS=8, BLOCK_H=8), 4),
    ]
    for t, s, g in ((256, 256, 16), (4000, 263, 17), (256, 256, 0), (8, 8, 1)):
        cfg = prefix_attention._pick_config(
            t, s, g, 4, 8, 2048, 4096, t * 32 * 128 * 4, getattr(torch, dtype), torch.device("cpu"), False
        )
        jobs.append(
            (f"prefix_shared_t{t}_s{s}_g{g}", prefix_attention._prefix_shared_kernel, dict(GROUP=4, **cfg, **attn), 8)
        )
    return jobs


def _resource_usage(cubin: bytes) -> str:
    """Registers / stack (spills) per thread from cuobjdump, when the wheel ships it."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "cuobjdump not found"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    lines = [ln.strip() for ln in out.stdout.splitlines() if "REG:" in ln]
    return " ".join(lines[0].split()[:2]) if lines else out.stderr.strip()[:200]


def compile_all(
    arch: int = 90, dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32"), resources: bool = False
) -> list[dict]:
    """Compiles each kernel configuration; raises on the first compiler error. Returns one row
    per configuration with its shared memory (and registers/spills when `resources`)."""
    done = []
    target = GPUTarget("cuda", arch, 32)
    for dtype in dtypes:
        for name, fn, constexprs, warps in _jobs(dtype):
            start = time.time()
            src = ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs), constexprs=constexprs)
            kernel = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": 3})
            row = dict(
                kernel=name, dtype=dtype, shared_bytes=kernel.metadata.shared, seconds=round(time.time() - start, 2)
            )
            if resources:
                row["resources"] = _resource_usage(kernel.asm["cubin"])
            done.append(row)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability * 10")
    parser.add_argument("--dtype", action="append", choices=sorted(PTR), help="repeatable; default: all three")
    args = parser.parse_args()
    dtypes = tuple(args.dtype) if args.dtype else ("float16", "bfloat16", "float32")
    for row in compile_all(args.arch, dtypes, resources=True):
        print(row)


if __name__ == "__main__":
    main()
