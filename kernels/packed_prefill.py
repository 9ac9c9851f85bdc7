"""Packed prefill attention (Prepacking): several prompts concatenated into one token stream,
causal within each prompt, independent across prompts; optionally writes K/V into the cache.
"""

from __future__ import annotations

import torch

from prefixflow.kernels._common import (
    FLOAT_DTYPES,
    REF_FLOAT_DTYPES,
    causal_attention,
    check_head_dim_for_triton,
    check_last_dim_contiguous,
    check_out,
    check_shape,
    check_tensor,
    compute_dtype,
    interpreting,
    use_triton,
)
from prefixflow.kernels.kv_write import write_kv_cache_ref


def _check_args(q, k, v, cu_seqlens, dtypes) -> None:
    check_tensor("q", q, 3, dtypes)
    dev = q.device
    t, hq, d = q.shape
    check_tensor("k", k, 3, (q.dtype,), dev)
    check_tensor("v", v, 3, (q.dtype,), dev)
    check_shape("v", v, tuple(k.shape))
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected [{t}, Hkv, {d}] like q")
    if k.shape[1] == 0 or hq % k.shape[1] != 0:
        raise ValueError(f"q has {hq} heads, not a multiple of k's {k.shape[1]} kv heads")
    check_tensor("cu_seqlens", cu_seqlens, 1, (torch.int32,), dev)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have S + 1 >= 1 entries, starting with 0")


def packed_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed prompts (Triton on CUDA, torch otherwise).

    q: [T, Hq, D] float16/bfloat16/float32; k, v: [T, Hkv, D] in q's dtype.
    cu_seqlens: [S + 1] int32, prompt s is tokens cu_seqlens[s] .. cu_seqlens[s+1]-1
        (cu_seqlens[0] == 0, cu_seqlens[S] == T); positions restart at each prompt.
    scale: softmax scale. out: optional [T, Hq, D] in q's dtype.
    k_cache, v_cache: optional [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64
        (slot = block * block_size + offset, -1 = skip). When given, k and v are also written
        into the cache.
    Returns out: [T, Hq, D] in q's dtype.
    """
    if use_triton(q):
        return packed_prefill_attention_triton(q, k, v, cu_seqlens, scale, out, k_cache, v_cache, slot_mapping)
    return packed_prefill_attention_ref(q, k, v, cu_seqlens, scale, out, k_cache, v_cache, slot_mapping)


def packed_prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch version of `packed_prefill_attention` (same arguments); one call per prompt."""
    _check_args(q, k, v, cu_seqlens, REF_FLOAT_DTYPES)
    out = check_out(out, q)
    _maybe_write_cache(k, v, k_cache, v_cache, slot_mapping, write_kv_cache_ref)
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[0]}, got {cu}")
    cdt = compute_dtype(q.dtype)
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)  # no copies in fp32 / fp64
    for lo, hi in zip(cu, cu[1:]):
        if hi > lo:  # one causal call per prompt straight on views of q, k, v
            out[lo:hi] = causal_attention(qc[lo:hi], kc[lo:hi], vc[lo:hi], scale)[0]
    return out


def _maybe_write_cache(k, v, k_cache, v_cache, slot_mapping, write) -> None:
    given = [x is not None for x in (k_cache, v_cache, slot_mapping)]
    if any(given) and not all(given):
        raise ValueError(
            "k_cache, v_cache and slot_mapping must be given together "
            f"(given: k_cache={given[0]}, v_cache={given[1]}, "
            f"slot_mapping={given[2]})"
        )
    if all(given):
        write(k, v, k_cache, v_cache, slot_mapping)


# ---------------------------------------------------------------------------------------------
# Triton path.

try:
    import triton
    import triton.language as tl

    from prefixflow.kernels._attn_core import (
        LOG2E,
        attend_range,
        dot_f32,
        find_owner,
        launch_plan,
        load_rows,
        row_block,
        store_rows,
    )
    from prefixflow.kernels.kv_write import write_kv_cache_triton
except ImportError:  # pragma: no cover - triton is optional
    triton = None

if triton is not None:

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        cu_ptr,
        tile_cu_ptr,
        num_seqs,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # Program (tile, kv head); tile t belongs to the prompt whose tile range holds it; its
        # rows are (token, query head of this kv head) pairs of that prompt only.
        t, kv_head = tl.program_id(0), tl.program_id(1)
        if t < tl.load(tile_cu_ptr + num_seqs):
            seq = find_owner(tile_cu_ptr, num_seqs, t, 128)
            tok0 = tl.load(cu_ptr + seq)
            n_tok = tl.load(cu_ptr + seq + 1) - tok0
            row0 = (t - tl.load(tile_cu_ptr + seq)) * BLOCK_M
            q, tok, head, valid = load_rows(
                q_ptr, tok0, n_tok, kv_head, row0, stride_qt, stride_qh, GROUP, BLOCK_M, HEAD_DIM, DOT_F32
            )
            last = tl.minimum(n_tok, (row0 + BLOCK_M - 1) // GROUP + 1)  # causal key bound
            base = tok0.to(tl.int64)
            o, lse = attend_range(
                q,
                k_ptr + base * stride_kt + kv_head * stride_kh,
                v_ptr + base * stride_vt + kv_head * stride_vh,
                cu_ptr,
                0,
                last,
                tok,
                qk_scale,
                0,
                stride_kt,
                0,
                stride_vt,
                BLOCK_M,
                BLOCK_N,
                HEAD_DIM,
                1,
                False,
                True,
                DOT_F32,
            )
            store_rows(out_ptr, o, tok0, tok, head, valid, stride_ot, stride_oh, HEAD_DIM)


def prefill_config(dtype: torch.dtype, group: int, head_dim: int, interp: bool) -> dict:
    """Tile shapes by a plain rule (the interpreter cannot autotune): the smallest legal tile
    under the interpreter; on GPUs 128 x 64 tiles, 32 x 32 for fp32 (its 128-row tiles need
    ~225 KB of shared memory, more than an A100 has, and larger ones spill registers)."""
    if interp:
        return dict(BLOCK_M=row_block(group), BLOCK_N=16, num_warps=4)
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4 if head_dim <= 64 else 8)


def packed_prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of `packed_prefill_attention` (same arguments). cu_seqlens must rise
    from 0 to T (not checked: that would need a device sync)."""
    _check_args(q, k, v, cu_seqlens, FLOAT_DTYPES)
    check_head_dim_for_triton(q.shape[2])
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(name, x)
    cu_seqlens = cu_seqlens.contiguous()
    out = check_out(out, q)
    _maybe_write_cache(k, v, k_cache, v_cache, slot_mapping, write_kv_cache_triton)
    t, hq, d = q.shape
    hkv = k.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    if t == 0 or num_seqs == 0:
        return out
    group = hq // hkv
    interp = interpreting()
    cfg = prefill_config(q.dtype, group, d, interp)
    tile_cu, _, _ = launch_plan(cu_seqlens, None, group, cfg["BLOCK_M"], cfg["BLOCK_M"])
    grid = (triton.cdiv(t * group, cfg["BLOCK_M"]) + num_seqs, hkv)
    _prefill_kernel[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        tile_cu,
        num_seqs,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        DOT_F32=dot_f32(q.dtype, interp),
        **cfg,
    )
    return out
