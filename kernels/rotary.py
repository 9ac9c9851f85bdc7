"""Rotary position embeddings (Hugging Face's rotate-half convention), on q and k heads at once.

`apply_rotary(x, cos, sin)` rotates every head of x, [T, H, D] (the q and k heads of the fused
projection, side by side), by its token's cos and sin rows, [T, 1, D] in x's dtype: the engine's
table (engine/models/layers/rotary.py `RotaryEmbedding`) indexed by position and cast once per
step. The engine's layers and the scoring path take it from here, below the engine; the CPU C
kernel's self-check (cpu_exact.py) takes its torch version, `apply_rotary_ref`.

The torch version rounds as HF does: x*cos and rotate_half(x)*sin each rounded to the model
dtype, then added. The Triton kernel is written the same way (and rounds so under Triton's
interpreter), but compiled for CUDA with Triton's default floating-point fusion it did not: on
an H200 (2026-12-04) 7.7% of bfloat16 elements, 8.8% of float16 and 25% of float32 differed
from torch's, at most by 0.031, 0.0039 and 4.8e-7 (bench/results/rotary_exactness_nvidia_h200.txt).
The compiled code says why: Triton fused x*cos and the add into one multiply-add, the product
unrounded (`FP_FUSION` below), and the launcher now turns that fusion off. That the kernel then
equals torch has been read from its PTX, not yet run on a GPU; tests/gpu asks a bound that
holds either way, two roundings of the larger term: |got - torch| <= 2 eps (|x cos| +
|rotate_half(x) sin|).
"""

from __future__ import annotations

import torch

from prefixflow.kernels._common import FLOAT_DTYPES, check_last_dim_contiguous, check_shape, check_tensor, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None


# Triton fuses a multiply and the add after it into one multiply-add by default, across the
# cast that rounds the product (sm_90 PTX: fma.rn.bf16 in bfloat16, fma.rn.f32 in float32), which
# is what made the kernel differ from torch on the H200. Off: each product rounded, then added
# (mul.rn / add.rn; tests/cpu/test_kernels_compile.py reads the PTX).
FP_FUSION = False


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (any strides); cos, sin: [T, 1, D] in x's dtype. x * cos + cat(-x2, x1) *
    sin; returns a new contiguous [T, H, D]. Triton on CUDA where the kernel takes the tensors
    (one launch where torch takes five; HF's roundings by its PTX, not yet checked on a GPU:
    the module's docstring), torch otherwise (HF's roundings, bit for bit)."""
    if triton_takes(x, cos, sin) and use_triton(x, head_dims=None):
        return apply_rotary_triton(x, cos, sin)
    return apply_rotary_ref(x, cos, sin)


def triton_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `apply_rotary_triton` takes these tensors (its checks, as a question): a float
    dtype it computes in, unit last strides, cos and sin in x's dtype with one row stride."""
    return (
        x.dim() == 3
        and x.dtype in FLOAT_DTYPES
        and cos.dtype == sin.dtype == x.dtype
        and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
        and x.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
    )


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch version of `apply_rotary` (same arguments)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # No negated copy and no concatenation; the same roundings as HF (x1*c + (-x2)*s equals
    # x1*c - x2*s exactly). addcmul_ would save two passes but may fuse the multiply-add,
    # which changes the last bit and can flip a greedy near-tie.
    out = x * cos
    out[..., :half] -= x2 * sin[..., :half]
    out[..., half:] += x1 * sin[..., half:]
    return out


if triton is not None:

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        y_ptr,
        cos_ptr,
        sin_ptr,
        stride_t,
        stride_h,
        stride_cs,
        num_heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per token: its cos and sin rows (already in x's dtype) once for all its
        # heads; x strided, y contiguous. rotate_half as a gather: element d reads d + D/2
        # negated (first half) or d - D/2.
        tok = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        half = HEAD_DIM // 2
        cos = tl.load(cos_ptr + tok * stride_cs + d).to(tl.float32)
        sin = tl.load(sin_ptr + tok * stride_cs + d).to(tl.float32)
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        h = tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None]
        src = x_ptr + tok * stride_t + h[:, None] * stride_h
        x = tl.load(src + d[None, :], mask=mask, other=0.0)
        x_partner = tl.load(src + partner[None, :], mask=mask, other=0.0)
        first = (x.to(tl.float32) * cos[None, :]).to(x.dtype)
        second = ((x_partner.to(tl.float32) * sign[None, :]) * sin[None, :]).to(x.dtype)
        out = (first.to(tl.float32) + second.to(tl.float32)).to(x.dtype)
        dst = y_ptr + (tok * num_heads + h[:, None]) * HEAD_DIM + d[None, :]
        tl.store(dst, out, mask=mask)


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton launcher of `apply_rotary` (same arguments); head_dim a power of two, x's last dim
    contiguous, cos and sin with the same strides (two views of one [T, 2, D] table rows)."""
    check_tensor("x", x, 3, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    t, heads, d = x.shape
    for name, c in (("cos", cos), ("sin", sin)):
        check_tensor(name, c, 3, (x.dtype,), x.device)
        check_shape(name, c, (t, 1, d))
        check_last_dim_contiguous(name, c)
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin need the same row stride, got {cos.stride(0)} and {sin.stride(0)}")
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two for the Triton kernel")
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t > 0:
        _rotary_kernel[(t,)](
            x,
            out,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            heads,
            HEAD_DIM=d,
            BLOCK_H=triton.next_power_of_2(heads),
            num_warps=4,
            enable_fp_fusion=FP_FUSION,
        )
    return out
