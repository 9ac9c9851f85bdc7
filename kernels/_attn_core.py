"""Triton building blocks shared by the attention kernels.

Row packing (GQA): a tile's rows are (query token, query head) pairs of ONE kv head: row r is
token r // GROUP and head kv_head * GROUP + r % GROUP, so each K/V tile loaded serves every
query head that reads it.

Softmax runs in base 2 (`qk_scale = scale * log2(e)`). A partial result is the normalised
output of a key range plus its log-sum-exp (base 2); `merge_kernel` combines a row's partials
(Cascade Inference / flash-decoding merge). An empty key range gives lse = -inf and output 0.

Precision: with DOT_F32 (fp32 inputs, or bf16 under the CPU interpreter, whose bf16 arithmetic
is wrong) every operand is cast to fp32 after loading and dots use IEEE fp32; otherwise the dots
take fp16/bf16 operands with fp32 accumulation (p is rounded to v's dtype), as FlashAttention
does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def find_owner(tile_cu_ptr, n, t, BLOCK: tl.constexpr):
    """Index i with tile_cu[i] <= t < tile_cu[i+1] (tile_cu: [n+1] non-decreasing, int32)."""
    owner = t * 0  # an int32 tensor from the start: a loop-carried value keeps its type
    for c in range(0, n, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        ends = tl.load(tile_cu_ptr + 1 + offs, mask=offs < n, other=2147483647)
        owner += tl.sum((ends <= t).to(tl.int32), axis=0).to(tl.int32)
    return owner


@triton.jit
def load_rows(
    q_ptr,
    tok0,
    n_tok,
    kv_head,
    row0,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Loads rows row0 .. row0+BLOCK_M of a packed tile; returns (q, tok, head, valid).
    tok is relative to tok0; rows with tok >= n_tok are padding (valid False, q = 0)."""
    r = row0 + tl.arange(0, BLOCK_M)
    tok = r // GROUP
    head = kv_head * GROUP + r % GROUP
    valid = tok < n_tok
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = q_ptr + (tok0 + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(ptrs, mask=valid[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q, tok, head, valid


@triton.jit
def attend_range(
    q,
    k_ptr,
    v_ptr,
    bt_ptr,
    kv_lo,
    kv_hi,
    limit,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Online softmax of the q tile over keys kv_lo .. kv_hi-1 (row r also needs key <= limit[r]
    when CAUSAL). k_ptr/v_ptr point at the kv head. PAGED: key n is at block bt_ptr[n // PAGE],
    offset n % PAGE (block stride stride_kb, token stride stride_kt); else at n * stride_kt.
    Returns (out [BLOCK_M, HEAD_DIM] fp32 normalised, lse [BLOCK_M] base 2)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < kv_hi
        if PAGED:
            blk = tl.load(bt_ptr + n // PAGE, mask=in_range, other=0).to(tl.int64)
            k_off = blk * stride_kb + (n % PAGE) * stride_kt
            v_off = blk * stride_vb + (n % PAGE) * stride_vt
        else:
            k_off = n.to(tl.int64) * stride_kt
            v_off = n.to(tl.int64) * stride_vt
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        keep = in_range[None, :]
        if CAUSAL:
            keep = keep & (n[None, :] <= limit[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def store_rows(out_ptr, o, tok0, tok, head, valid, stride_ot, stride_oh, HEAD_DIM: tl.constexpr):
    """Stores a tile's final rows into out [T, Hq, D] (cast to out's dtype)."""
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = out_ptr + (tok0 + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def store_partial(
    o_part_ptr,
    lse_part_ptr,
    o,
    lse,
    tok0,
    tok,
    head,
    valid,
    slot,
    num_heads,
    NUM_SLOTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Stores a partial result into o_part [T, Hq, NUM_SLOTS, D] / lse_part [T, Hq, NUM_SLOTS]."""
    row = ((tok0 + tok).to(tl.int64) * num_heads + head) * NUM_SLOTS + slot
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(o_part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=valid[:, None])
    tl.store(lse_part_ptr + row, lse, mask=valid)


@triton.jit
def merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    num_rows,
    num_heads,
    stride_ot,
    stride_oh,
    NUM_SLOTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[t, h] = sum_i w_i o_i / sum_i w_i with w_i = 2^(lse_i - max lse) over the slots."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < num_rows
    r64 = r.to(tl.int64)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for i in tl.static_range(NUM_SLOTS):
        m = tl.maximum(m, tl.load(lse_part_ptr + r64 * NUM_SLOTS + i, mask=valid, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for i in tl.static_range(NUM_SLOTS):
        w = tl.exp2(tl.load(lse_part_ptr + r64 * NUM_SLOTS + i, mask=valid, other=float("-inf")) - m)
        o = tl.load(
            o_part_ptr + (r64 * NUM_SLOTS + i)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=valid[:, None] & (w > 0.0)[:, None],
            other=0.0,
        )
        acc += w[:, None] * o
        total += w
    res = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tok, head = r // num_heads, r % num_heads
    ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(ptrs + offs_d[None, :], res.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def launch_merge(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> None:
    """o_part: [T, Hq, NUM_SLOTS, D] fp32; lse_part: [T, Hq, NUM_SLOTS] fp32; out: [T, Hq, D]."""
    t, hq, num_slots, d = o_part.shape
    block_r = 16
    grid = (triton.cdiv(t * hq, block_r),)
    if grid[0] == 0:
        return
    merge_kernel[grid](
        o_part,
        lse_part,
        out,
        t * hq,
        hq,
        out.stride(0),
        out.stride(1),
        NUM_SLOTS=num_slots,
        HEAD_DIM=d,
        BLOCK_R=block_r,
    )


@triton.jit
def _tile_prefix_sums(
    bounds_ptr,
    index_ptr,
    n,
    out_ptr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INDEXED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # out[0] = 0, out[i+1] = out[i] + cdiv((b[i+1] - b[i]) * GROUP, BLOCK_M), where
    # b = bounds, or bounds[index] when INDEXED. Sequential over chunks of BLOCK entries.
    carry = tl.program_id(0) * 0
    tl.store(out_ptr, carry)
    for c in range(0, n, BLOCK):
        i = c + tl.arange(0, BLOCK)
        m = i < n
        lo_i, hi_i = i, i + 1
        if INDEXED:
            lo_i = tl.load(index_ptr + i, mask=m, other=0)
            hi_i = tl.load(index_ptr + i + 1, mask=m, other=0)
        rows = (tl.load(bounds_ptr + hi_i, mask=m, other=0) - tl.load(bounds_ptr + lo_i, mask=m, other=0)) * GROUP
        tiles = tl.where(m, (rows + BLOCK_M - 1) // BLOCK_M, 0)
        tl.store(out_ptr + 1 + i, tl.cumsum(tiles, axis=0) + carry, mask=m)
        carry += tl.sum(tiles, axis=0).to(tl.int32)


@triton.jit
def plan_kernel(
    cu_ptr,
    ranges_ptr,
    o_tile_cu_ptr,
    p_tile_cu_ptr,
    group_tok_ptr,
    num_seqs,
    num_groups,
    GROUP: tl.constexpr,
    BM_O: tl.constexpr,
    BM_P: tl.constexpr,
    WITH_GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program computes the tile tables of a launch (instead of a dozen tiny torch ops):
    o_tile_cu [S+1] tiles per sequence; with groups also group_tok [G+1] = cu[ranges] (token
    bounds of each group) and p_tile_cu [G+1] tiles per group."""
    _tile_prefix_sums(cu_ptr, cu_ptr, num_seqs, o_tile_cu_ptr, GROUP, BM_O, False, BLOCK)
    if WITH_GROUPS:
        for c in range(0, num_groups + 1, BLOCK):
            i = c + tl.arange(0, BLOCK)
            m = i <= num_groups
            tl.store(group_tok_ptr + i, tl.load(cu_ptr + tl.load(ranges_ptr + i, mask=m, other=0), mask=m), mask=m)
        _tile_prefix_sums(cu_ptr, ranges_ptr, num_groups, p_tile_cu_ptr, GROUP, BM_P, True, BLOCK)


def launch_plan(
    cu_seqlens: torch.Tensor, ranges: torch.Tensor | None, group: int, bm_o: int, bm_p: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (o_tile_cu [S+1], p_tile_cu [G+1], group_tok [G+1]) int32 on cu_seqlens' device
    (the last two are empty without ranges)."""
    s = cu_seqlens.shape[0] - 1
    g = ranges.shape[0] - 1 if ranges is not None else -1
    buf = torch.empty(s + 1 + 2 * (g + 1), dtype=torch.int32, device=cu_seqlens.device)
    o_tile_cu, p_tile_cu, group_tok = buf[: s + 1], buf[s + 1 : s + 2 + g], buf[s + 2 + g :]
    plan_kernel[(1,)](
        cu_seqlens,
        ranges if ranges is not None else cu_seqlens,
        o_tile_cu,
        p_tile_cu if g >= 0 else buf,
        group_tok if g >= 0 else buf,
        s,
        max(g, 0),
        GROUP=group,
        BM_O=bm_o,
        BM_P=bm_p,
        WITH_GROUPS=ranges is not None,
        BLOCK=128,
    )
    return o_tile_cu, p_tile_cu, group_tok


def dot_f32(dtype: torch.dtype, interpreting: bool) -> bool:
    """fp32 dots for fp32 inputs, and for bf16 under the interpreter (its bf16 math is wrong);
    fp16 takes the GPU's tensor-core path (fp16 operands, fp32 accumulation) everywhere."""
    return dtype == torch.float32 or (interpreting and dtype == torch.bfloat16)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in under the interpreter)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def attn_num_warps(head_dim: int) -> int:
    """Warps of the paged kernels: with head_dim 128, four warps need more than 255 registers
    per thread and spill (ptxas, sm_90, checked with kernels/_aot_check.py); eight do not."""
    return 8 if head_dim >= 128 else 4


def row_block(group: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(group, minimum): tl.dot needs M >= 16."""
    return max(minimum, triton.next_power_of_2(group))
