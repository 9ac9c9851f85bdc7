"""Rotary position embeddings of q and k in one pass (Hugging Face's rotate-half convention).

cos_sin is the engine's table (engine/models/layers/rotary.py `RotaryEmbedding.cos_sin`):
[max_positions, 2, D] fp32 with cos at [:, 0] and sin at [:, 1], halves duplicated. The torch
versions round as HF does: cos/sin cast to the model dtype, x*cos and rotate_half(x)*sin each
rounded to the model dtype, then added. The Triton kernels are written the same way (and round
so under Triton's interpreter), but compiled for CUDA they do not: on an H200 a product stayed
in float32 before the add (the cast pair dropped) and float32 multiplies and adds fused, so they
are within an ulp of the torch versions, not equal (tests/gpu: 7.7% of bfloat16 elements differ).

`apply_rotary` is the model's own rotary on one tensor (cos and sin already indexed by position
and cast): the engine's layers take it from here, below the engine, and the CPU C kernel's
self-check (cpu_exact.py) takes its torch version, `apply_rotary_ref`.
"""

from __future__ import annotations

import torch

from prefixflow.kernels._common import (
    FLOAT_DTYPES,
    REF_FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_shape,
    check_tensor,
    use_triton,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None


def _check_args(q, k, positions, cos_sin, dtypes) -> None:
    check_tensor("q", q, 3, dtypes)
    check_tensor("k", k, 3, (q.dtype,), q.device)
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need the same T and the same even head_dim")
    check_tensor("positions", positions, 1, (torch.int64, torch.int32), q.device)
    check_shape("positions", positions, (t,))
    check_tensor("cos_sin", cos_sin, 3, (torch.float32,), q.device, contiguous=True)
    if tuple(cos_sin.shape[1:]) != (2, d):
        raise ValueError(f"cos_sin has shape {tuple(cos_sin.shape)}, expected [P, 2, {d}]")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (any strides); cos, sin: [T, 1, D] in x's dtype. HF's rotate-half convention
    (not interleaved): x * cos + cat(-x2, x1) * sin, bit for bit. Returns a new contiguous
    [T, H, D]. Triton on CUDA (one launch where torch takes five; within an ulp of torch, not
    bit for bit: the module's docstring), torch otherwise."""
    if use_triton(x, head_dims=None):
        return apply_rotary_triton(x, cos, sin)
    return apply_rotary_ref(x, cos, sin)


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


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] float (views allowed); positions: [T] int64 (< P);
    cos_sin: [P, 2, D] fp32. Returns new contiguous (q_rot, k_rot) in q's dtype.
    Triton on CUDA, torch otherwise."""
    if use_triton(q, head_dims=None):
        return rotary_embedding_triton(q, k, positions, cos_sin)
    return rotary_embedding_ref(q, k, positions, cos_sin)


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `rotary_embedding` (same arguments)."""
    _check_args(q, k, positions, cos_sin, REF_FLOAT_DTYPES)
    cs = cos_sin[positions.long()].to(q.dtype)  # [T, 2, D]
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    half = q.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    return rotate(q).contiguous(), rotate(k).contiguous()


if triton is not None:

    @triton.jit
    def _rotate_heads(
        x_ptr,
        y_ptr,
        stride_t,
        stride_h,
        tok,
        num_heads,
        cos,
        sin,
        sign,
        partner,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # x: [T, H, D] (strided), y: [T, H, D] contiguous; all heads of one token.
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HEAD_DIM)
        mask = (h < num_heads)[:, None]
        src = x_ptr + tok * stride_t + h[:, None] * stride_h
        x = tl.load(src + d[None, :], mask=mask, other=0.0)
        x_partner = tl.load(src + partner[None, :], mask=mask, other=0.0)
        first = (x.to(tl.float32) * cos[None, :]).to(x.dtype)
        second = ((x_partner.to(tl.float32) * sign[None, :]) * sin[None, :]).to(x.dtype)
        out = (first.to(tl.float32) + second.to(tl.float32)).to(x.dtype)
        dst = y_ptr + (tok * num_heads + h[:, None]) * HEAD_DIM + d[None, :]
        tl.store(dst, out, mask=mask)

    @triton.jit
    def _partner_and_sign(HEAD_DIM: tl.constexpr):
        # rotate_half as a gather: element d reads d + D/2 negated (first half) or d - D/2.
        d = tl.arange(0, HEAD_DIM)
        half = HEAD_DIM // 2
        return tl.where(d < half, d + half, d - half), tl.where(d < half, -1.0, 1.0)

    @triton.jit
    def _rotary_gathered_kernel(
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
        # One program per token; cos and sin are its rows of the table, already in x's dtype.
        tok = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        cos = tl.load(cos_ptr + tok * stride_cs + d).to(tl.float32)
        sin = tl.load(sin_ptr + tok * stride_cs + d).to(tl.float32)
        partner, sign = _partner_and_sign(HEAD_DIM)
        _rotate_heads(x_ptr, y_ptr, stride_t, stride_h, tok, num_heads, cos, sin, sign, partner, HEAD_DIM, BLOCK_H)

    @triton.jit
    def _rotary_kernel(
        q_ptr,
        k_ptr,
        qo_ptr,
        ko_ptr,
        pos_ptr,
        cs_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        num_q_heads,
        num_kv_heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
    ):
        # One program per token: loads its cos/sin row once for all q and k heads.
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        cos = tl.load(cs_ptr + pos * 2 * HEAD_DIM + d)
        sin = tl.load(cs_ptr + pos * 2 * HEAD_DIM + HEAD_DIM + d)
        cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)  # HF casts the table first
        sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
        partner, sign = _partner_and_sign(HEAD_DIM)
        _rotate_heads(
            q_ptr, qo_ptr, stride_qt, stride_qh, tok, num_q_heads, cos, sin, sign, partner, HEAD_DIM, BLOCK_HQ
        )
        _rotate_heads(
            k_ptr, ko_ptr, stride_kt, stride_kh, tok, num_kv_heads, cos, sin, sign, partner, HEAD_DIM, BLOCK_HK
        )


def rotary_embedding_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `rotary_embedding` (same arguments); head_dim a power of two."""
    _check_args(q, k, positions, cos_sin, FLOAT_DTYPES)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two for the Triton kernel")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=q.dtype, device=q.device)
    if t > 0:
        _rotary_kernel[(t,)](
            q,
            k,
            q_out,
            k_out,
            positions.contiguous(),
            cos_sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            hq,
            hkv,
            HEAD_DIM=d,
            BLOCK_HQ=triton.next_power_of_2(hq),
            BLOCK_HK=triton.next_power_of_2(hkv),
            num_warps=4,
        )
    return q_out, k_out


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
        _rotary_gathered_kernel[(t,)](
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
        )
    return out
