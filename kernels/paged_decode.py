"""Paged decode attention: one query per sequence over all of its cached keys.

Triton design: one program per (sequence, kv head, split). The query heads that share a kv
head are packed into one tile (GQA), so each K/V tile is loaded once for all of them; long
contexts are split into `num_splits` ranges (split-K, "flash-decoding") whose partial results
are merged by log-sum-exp in a second small kernel.
"""

from __future__ import annotations

import torch

from prefixflow.kernels import _common, cpu_kernels
from prefixflow.kernels._common import (
    FLOAT_DTYPES,
    REF_FLOAT_DTYPES,
    DecodeBatch,
    check_cache,
    check_head_dim_for_triton,
    check_last_dim_contiguous,
    check_out,
    check_shape,
    check_tensor,
    compute_dtype,
    decode_attention,
    decode_plan,
    interpreting,
    layer_key,
    once_per_step,
    use_triton,
)


def _check_args(q, k_cache, v_cache, kv_lens, block_tables, dtypes) -> None:
    check_tensor("q", q, 3, dtypes)
    dev = q.device
    s, hq, d = q.shape
    check_cache(k_cache, v_cache, hq, d, (q.dtype,), dev)
    check_tensor("kv_lens", kv_lens, 1, (torch.int32,), dev)
    check_shape("kv_lens", kv_lens, (s,))
    check_tensor("block_tables", block_tables, 2, (torch.int32,), dev)
    if block_tables.shape[0] != s:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, expected one per sequence ({s})")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache (Triton on CUDA, torch otherwise).

    q: [S, Hq, D] float16/bfloat16/float32, one query per sequence.
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], q's dtype.
    kv_lens: [S] int32 >= 1, keys of each sequence (its own query's key included).
    block_tables: [S, max_blocks] int32; key j of seq s is at block_tables[s, j // block_size].
    scale: softmax scale. out: optional [S, Hq, D] in q's dtype.
    num_splits: split-K factor of the Triton kernel (None: chosen from the shape).
    Returns out: [S, Hq, D] in q's dtype.
    """
    if use_triton(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, kv_lens, block_tables, scale, out, num_splits)
    if cpu_kernels.supports(q, k_cache):
        return paged_decode_attention_cpu(q, k_cache, v_cache, kv_lens, block_tables, scale, out)
    return paged_decode_attention_ref(q, k_cache, v_cache, kv_lens, block_tables, scale, out, num_splits)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` in C on the CPU (kernels/cpu_kernels.py; float32); checks and
    the kernel's bound arguments once per step."""
    call = once_per_step(
        "paged_decode_cpu",
        (kv_lens, block_tables),
        layer_key(q, k_cache, v_cache),
        lambda: _cpu_call(q, k_cache, v_cache, kv_lens, block_tables),
    )
    out = check_out(out, q)
    if q.shape[0] == 0:
        return out
    return call(q, k_cache, v_cache, scale, out)


def _cpu_call(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor
) -> cpu_kernels.AttentionCall:
    _check_args(q, k_cache, v_cache, kv_lens, block_tables, (torch.float32,))
    if q.shape[0]:
        lens = kv_lens.tolist()
        _check_kv_lens(min(lens))
        cpu_kernels.check_tables(k_cache.shape[0], k_cache.shape[1], lens, block_tables)
    return cpu_kernels.AttentionCall(kv_lens, block_tables)


def _check_kv_lens(shortest: int) -> None:
    if shortest < 1:
        raise ValueError(f"kv_lens must be >= 1 (a decode query sees its own key), got min {shortest}")


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Torch version of `paged_decode_attention` (num_splits is ignored): all sequences in
    one batched call over their gathered, padded keys."""
    _check_args(q, k_cache, v_cache, kv_lens, block_tables, REF_FLOAT_DTYPES)
    out = check_out(out, q)
    s = q.shape[0]
    if s == 0:
        return out
    cdt = compute_dtype(q.dtype)
    plan = once_per_step(
        "paged_decode",
        (kv_lens, block_tables),
        (k_cache.shape[1:], cdt, q.device, _common._DECODE_MAX_ELEMENTS),
        lambda: _plan(kv_lens, block_tables, k_cache, cdt),
    )
    o, _ = decode_attention(q.to(cdt), k_cache, v_cache, plan, scale)
    out.copy_(o)
    return out


def _plan(
    kv_lens: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor, dtype: torch.dtype
) -> list[DecodeBatch]:
    """The step's decode plan, after the value check (both once per step, for all layers)."""
    _check_kv_lens(int(kv_lens.min()))
    _, block_size, hkv, d = k_cache.shape
    return decode_plan(kv_lens, block_tables, block_size, hkv * d, dtype)


# ---------------------------------------------------------------------------------------------
# Triton path.

try:
    import triton
    import triton.language as tl

    from prefixflow.kernels._attn_core import (
        LOG2E,
        attend_range,
        attn_num_warps,
        dot_f32,
        launch_merge,
        load_rows,
        num_sms,
        row_block,
        store_partial,
        store_rows,
    )
except ImportError:  # pragma: no cover - triton is optional
    triton = None

if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        o_part_ptr,
        lse_part_ptr,
        kv_lens_ptr,
        bt_ptr,
        qk_scale,
        num_heads,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_bt,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # One program per (sequence, kv head, split); rows are the GROUP query heads.
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kv_len = tl.load(kv_lens_ptr + seq)
        chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(kv_len, lo + chunk)
        q, tok, head, valid = load_rows(
            q_ptr, seq, 1, kv_head, 0, stride_qt, stride_qh, GROUP, BLOCK_M, HEAD_DIM, DOT_F32
        )
        o, lse = attend_range(
            q,
            k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_kh,
            bt_ptr + seq.to(tl.int64) * stride_bt,
            lo,
            hi,
            tok,
            qk_scale,
            stride_kb,
            stride_kt,
            stride_kb,
            stride_kt,
            BLOCK_M,
            BLOCK_N,
            HEAD_DIM,
            PAGE,
            True,
            False,
            DOT_F32,
        )
        if NUM_SPLITS == 1:
            store_rows(out_ptr, o, seq, tok, head, valid, stride_ot, stride_oh, HEAD_DIM)
        else:
            store_partial(
                o_part_ptr, lse_part_ptr, o, lse, seq, tok, head, valid, split, num_heads, NUM_SPLITS, HEAD_DIM
            )


def _pick_num_splits(num_programs: int, max_len: int, device: torch.device) -> int:
    """Split-K only when (seq, kv head) programs cannot fill the GPU; ~256+ keys per split."""
    sms = num_sms(device)
    if num_programs >= 2 * sms:
        return 1
    return int(max(1, min(16, -(-2 * sms // num_programs), max_len // 256)))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton launcher of `paged_decode_attention` (same arguments). kv_lens must be >= 1
    (not checked: that would need a device sync). `config` overrides the tile choice
    ({"BLOCK_N", "num_warps", "num_stages"}); bench/kernel_bench.py sweeps it."""
    _check_args(q, k_cache, v_cache, kv_lens, block_tables, FLOAT_DTYPES)
    check_head_dim_for_triton(q.shape[2])
    check_last_dim_contiguous("q", q)
    check_tensor("kv_lens", kv_lens, 1, (torch.int32,), q.device, contiguous=True)
    check_last_dim_contiguous("block_tables", block_tables)
    out = check_out(out, q)
    s, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if s == 0:
        return out
    if num_splits is None:
        num_splits = _pick_num_splits(s * hkv, block_tables.shape[1] * block_size, q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    interp = interpreting()
    # fp32 dots run on CUDA cores and need smaller tiles not to spill (kernels/_aot_check.py);
    # the interpreter's cost grows with the tile size.
    cfg = dict(BLOCK_N=16 if interp else 32 if q.dtype == torch.float32 else 64, num_warps=attn_num_warps(d))
    cfg.update(config or {})
    if num_splits > 1:
        o_part = torch.empty(s, hq, num_splits, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(s, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # not touched by the kernel
    _decode_kernel[(s, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        o_part,
        lse_part,
        kv_lens,
        block_tables,
        scale * LOG2E,
        hq,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        BLOCK_M=row_block(hq // hkv),
        HEAD_DIM=d,
        PAGE=block_size,
        NUM_SPLITS=num_splits,
        DOT_F32=dot_f32(q.dtype, interp),
        **cfg,
    )
    if num_splits > 1:
        launch_merge(o_part, lse_part, out)
    return out
