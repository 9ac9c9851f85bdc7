"""Prefix-shared attention for mixed steps (BatchLLM Sec. 4.3.3, horizontal fusion).

S sequences run in one step; G groups of them share a prefix whose KV is complete in the cache
(its own blocks, `prefix_block_tables`). Query i of sequence s attends to (a) all keys of its
group's prefix, non-causally, and (b) its own keys 0 .. kv_lens[s] - q_len + i, causally; one
softmax spans both parts.

Triton design: one launch, two kinds of programs. "Prefix" programs take a tile of a group's
queries (all members' query tokens, packed, times the query heads of one kv head for GQA) and
stream the prefix KV once for the whole tile: that single load shared by every member is the
point of prefix sharing. "Own" programs take a tile of one sequence's queries against its own
KV, causal. Both write a normalised partial output and its log-sum-exp; a small merge kernel
combines the two parts per query (Cascade Inference's merge, fused here in one launch per
part kind as in BatchLLM's horizontal fusion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixflow.kernels import _common, cpu_kernels
from prefixflow.kernels._common import (
    FLOAT_DTYPES,
    REF_FLOAT_DTYPES,
    BlockIndex,
    DecodeBatch,
    attention_lse,
    block_index,
    causal_attention,
    check_cache,
    check_head_dim_for_triton,
    check_last_dim_contiguous,
    check_out,
    check_tensor,
    compute_dtype,
    decode_attention,
    decode_plan,
    gather_index,
    interpreting,
    layer_key,
    once_per_step,
    use_triton,
)


def _check_args(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    kv_lens,
    block_tables,
    prefix_lens,
    prefix_block_tables,
    prefix_seq_ranges,
    dtypes,
) -> None:
    """Shape, dtype and device checks (no values: they would need a device sync)."""
    check_tensor("q", q, 3, dtypes)
    dev = q.device
    _, hq, d = q.shape
    check_cache(k_cache, v_cache, hq, d, (q.dtype,), dev)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), dev)
    s = cu_seqlens_q.shape[0] - 1
    if s < 0:
        raise ValueError("cu_seqlens_q must have S + 1 >= 1 entries, starting with 0")
    check_tensor("kv_lens", kv_lens, 1, (torch.int32,), dev)
    check_tensor("block_tables", block_tables, 2, (torch.int32,), dev)
    if kv_lens.shape[0] != s or block_tables.shape[0] != s:
        raise ValueError(
            f"kv_lens has {kv_lens.shape[0]} and block_tables {block_tables.shape[0]} "
            f"rows; cu_seqlens_q implies S={s} sequences"
        )
    check_tensor("prefix_lens", prefix_lens, 1, (torch.int32,), dev)
    check_tensor("prefix_block_tables", prefix_block_tables, 2, (torch.int32,), dev)
    check_tensor("prefix_seq_ranges", prefix_seq_ranges, 1, (torch.int32,), dev)
    g = prefix_lens.shape[0]
    if prefix_block_tables.shape[0] != g or prefix_seq_ranges.shape[0] != g + 1:
        raise ValueError(
            f"G={g} prefixes (prefix_lens) need prefix_block_tables with G rows "
            f"(got {prefix_block_tables.shape[0]}) and prefix_seq_ranges with G+1 "
            f"entries (got {prefix_seq_ranges.shape[0]})"
        )


def prefix_shared_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_seq_ranges: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a mixed step with shared prefixes (Triton on CUDA, torch otherwise).

    q: [T, Hq, D] float16/bfloat16/float32, the queries of S sequences concatenated.
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], q's dtype.
    cu_seqlens_q: [S + 1] int32, sequence s owns queries cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1.
    kv_lens: [S] int32, own KV tokens of each sequence after this step's writes (its q_len
        queries are the last q_len of them).
    block_tables: [S, max_blocks] int32, own key j of seq s is at block_tables[s, j // block_size].
    prefix_lens: [G] int32 (may be 0); prefix_block_tables: [G, max_prefix_blocks] int32.
    prefix_seq_ranges: [G + 1] int32 non-decreasing: sequences prefix_seq_ranges[g] ..
        prefix_seq_ranges[g+1]-1 share prefix g; sequences >= prefix_seq_ranges[G] have none.
    scale: softmax scale. out: optional [T, Hq, D] in q's dtype.
    Returns out: [T, Hq, D] in q's dtype.
    """
    args = (
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        kv_lens,
        block_tables,
        prefix_lens,
        prefix_block_tables,
        prefix_seq_ranges,
        scale,
        out,
    )
    if use_triton(q):
        return prefix_shared_attention_triton(*args)
    if cpu_kernels.supports(q, k_cache):
        return prefix_shared_attention_cpu(*args)
    return prefix_shared_attention_ref(*args)


def prefix_shared_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_seq_ranges: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`prefix_shared_attention` in C on the CPU (kernels/cpu_kernels.py; float32): each query
    over its group's prefix and then its own keys in one pass, nothing gathered. The checks
    and the kernel's bound arguments are made once per step, for the first layer."""
    meta = (cu_seqlens_q, kv_lens, block_tables, prefix_lens, prefix_block_tables, prefix_seq_ranges)
    call = once_per_step(
        "prefix_shared_cpu", meta, layer_key(q, k_cache, v_cache), lambda: _cpu_call(q, k_cache, v_cache, *meta)
    )
    out = check_out(out, q)
    if q.shape[0] == 0:
        return out
    return call(q, k_cache, v_cache, scale, out)


def _cpu_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_seq_ranges: torch.Tensor,
) -> cpu_kernels.AttentionCall:
    """The C kernel bound to this step's metadata, after the argument and value checks."""
    _check_args(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        kv_lens,
        block_tables,
        prefix_lens,
        prefix_block_tables,
        prefix_seq_ranges,
        (torch.float32,),
    )
    cu, lens, ranges = cu_seqlens_q.tolist(), kv_lens.tolist(), prefix_seq_ranges.tolist()
    _check_values(cu, lens, ranges, q.shape[0])
    p_lens = prefix_lens.tolist()
    cpu_kernels.check_tables(k_cache.shape[0], k_cache.shape[1], lens, block_tables, p_lens, prefix_block_tables)
    prefix_of = [-1] * len(lens)
    for g in range(len(p_lens)):
        prefix_of[ranges[g] : ranges[g + 1]] = [g] * (ranges[g + 1] - ranges[g])
    return cpu_kernels.AttentionCall(
        kv_lens,
        block_tables,
        torch.tensor(prefix_of, dtype=torch.int32),
        prefix_lens,
        prefix_block_tables,
        cu_seqlens_q,
    )


def prefix_shared_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_seq_ranges: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch version of `prefix_shared_attention` (same arguments). Like the kernel it attends
    the two parts of each query's keys separately and merges them by log-sum-exp: own KV (all
    decode sequences in one padded batch, the others one causal call each), and each group's
    queries, all members at once, against the group's prefix read once (non-causal)."""
    _check_args(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        kv_lens,
        block_tables,
        prefix_lens,
        prefix_block_tables,
        prefix_seq_ranges,
        REF_FLOAT_DTYPES,
    )
    out = check_out(out, q)
    cdt = compute_dtype(q.dtype)
    meta = (cu_seqlens_q, kv_lens, block_tables, prefix_lens, prefix_block_tables, prefix_seq_ranges)
    plan = once_per_step(
        "prefix_shared",
        meta,
        (q.shape[0], k_cache.shape[1:], cdt, _common._DECODE_MAX_ELEMENTS),
        lambda: _plan(*meta, q.shape[0], k_cache, cdt),
    )
    if q.shape[0] == 0:
        return out
    qc = q.to(cdt)  # [T, Hq, D]
    o, lse = _own_attention(qc, k_cache, v_cache, plan, scale)
    for lo, hi, p_len, index in plan.groups:
        pk = gather_index(k_cache, index, qc.dtype, "k")[:p_len]
        pv = gather_index(v_cache, index, qc.dtype, "v")[:p_len]
        pk, pv = pk.transpose(0, 1)[None], pv.transpose(0, 1)[None]  # [1, Hkv, P, D]
        p_o, p_lse = attention_lse(qc[lo:hi].transpose(0, 1)[None], pk, pv, scale)
        # softmax over prefix + own keys = the two parts weighted by their exp(lse) shares
        own_share = torch.sigmoid(lse[lo:hi] - p_lse[0].transpose(0, 1)).unsqueeze(-1)
        o[lo:hi] = torch.lerp(p_o[0].transpose(0, 1), o[lo:hi], own_share)
    out.copy_(o)
    return out


@dataclass(frozen=True, slots=True)
class _Plan:
    """The layer-independent host work of one step (built once, used by every layer).

    decode: plan of the single-query sequences' batched decode; decode_rows: their query rows
    (None when every sequence is one). multi: (first row, end row, first key, end key) of the
    other sequences in their one gather `multi_index`. groups: (first row, end row, prefix
    length, prefix blocks) of each group with queries and a non-empty prefix.
    """

    decode: list[DecodeBatch]
    decode_rows: torch.Tensor | None
    multi: list[tuple[int, int, int, int]]
    multi_index: BlockIndex | None
    groups: list[tuple[int, int, int, BlockIndex]]


def _plan(
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_seq_ranges: torch.Tensor,
    num_tokens: int,
    k_cache: torch.Tensor,
    dtype: torch.dtype,
) -> _Plan:
    cu, lens, ranges = cu_seqlens_q.tolist(), kv_lens.tolist(), prefix_seq_ranges.tolist()
    _check_values(cu, lens, ranges, num_tokens)
    _, block_size, hkv, d = k_cache.shape
    q_lens = [hi - lo for lo, hi in zip(cu, cu[1:])]
    decode = [s for s, n in enumerate(q_lens) if n == 1]
    multi = [s for s, n in enumerate(q_lens) if n > 1]
    dev = cu_seqlens_q.device
    decode_rows, decode_plan_ = None, []
    if len(decode) == len(q_lens):  # every row is a sequence's single query
        decode_plan_ = decode_plan(kv_lens, block_tables, block_size, hkv * d, dtype)
    elif decode:
        seqs = torch.tensor(decode, device=dev)
        decode_rows = torch.tensor([cu[s] for s in decode], device=dev)
        decode_plan_ = decode_plan(kv_lens[seqs], block_tables[seqs], block_size, hkv * d, dtype)
    spans, multi_index, start = [], None, 0
    if multi:
        # All their blocks in one gather; sequence s's keys start its run of nb[s] blocks.
        nb = [-(-lens[s] // block_size) for s in multi]
        multi_index = block_index(block_tables[torch.tensor(multi, device=dev)], nb)
        for s, n in zip(multi, nb):
            spans.append((cu[s], cu[s + 1], start, start + lens[s]))
            start += n * block_size
    groups = []
    for g, p_len in enumerate(prefix_lens.tolist()):
        lo, hi = cu[ranges[g]], cu[ranges[g + 1]]
        if p_len > 0 and hi > lo:
            groups.append((lo, hi, p_len, block_index(prefix_block_tables[g : g + 1], [-(-p_len // block_size)])))
    return _Plan(decode_plan_, decode_rows, spans, multi_index, groups)


def _own_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _Plan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's queries over its own paged KV, causally. q: [T, Hq, D] fp32/fp64.
    Returns (out [T, Hq, D], lse [T, Hq])."""
    if plan.decode and plan.decode_rows is None and not plan.multi:
        return decode_attention(q, k_cache, v_cache, plan.decode, scale)
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:2])
    if plan.decode_rows is not None:
        rows = plan.decode_rows
        o_d, lse_d = decode_attention(q[rows], k_cache, v_cache, plan.decode, scale)
        o.index_copy_(0, rows, o_d)
        lse.index_copy_(0, rows, lse_d)
    if plan.multi_index is not None:
        k = gather_index(k_cache, plan.multi_index, q.dtype, "k")  # [sum nb*bs, Hkv, D]
        v = gather_index(v_cache, plan.multi_index, q.dtype, "v")
        for lo, hi, start, end in plan.multi:
            o[lo:hi], lse[lo:hi] = causal_attention(q[lo:hi], k[start:end], v[start:end], scale)
    return o, lse


def _check_values(cu: list[int], lens: list[int], ranges: list[int], num_tokens: int) -> None:
    """Value checks the reference can afford (the launcher cannot without a device sync)."""
    if cu[0] != 0 or cu[-1] != num_tokens or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to T={num_tokens}, got {cu}")
    for s, (lo, hi) in enumerate(zip(cu, cu[1:])):
        if hi - lo > lens[s]:
            raise ValueError(
                f"kv_lens[{s}]={lens[s]} < its {hi - lo} queries; kv_lens counts "
                "the sequence's own keys including this step's"
            )
    if any(a > b for a, b in zip(ranges, ranges[1:])) or ranges[0] < 0 or ranges[-1] > len(lens):
        raise ValueError(f"prefix_seq_ranges must be non-decreasing within 0..S={len(lens)}, got {ranges}")


# ---------------------------------------------------------------------------------------------
# Triton path (BatchLLM Sec. 4.3.3): one horizontally fused launch of prefix programs and own
# programs, each writing partial results, then one merge launch.

try:
    import triton
    import triton.language as tl

    from prefixflow.kernels._attn_core import (
        LOG2E,
        attend_range,
        attn_num_warps,
        dot_f32,
        find_owner,
        launch_merge,
        launch_plan,
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
    def _split_range(end, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys lo .. hi-1 of split `split` when keys 0 .. end-1 are cut into NUM_SPLITS chunks
        of whole BLOCK_N tiles; returns (lo, hi), empty (lo >= hi) for a split past the end."""
        chunk = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(end, lo + chunk)
        return lo, hi

    @triton.jit
    def _prefix_program(
        q_view,
        kv_view,
        o_part_ptr,
        lse_part_ptr,
        pbt_ptr,
        prefix_lens_ptr,
        group_tok_ptr,
        tile_cu_ptr,
        num_groups,
        prefix_pid,
        kv_head,
        qk_scale,
        num_heads,
        stride_pbt,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        NSP: tl.constexpr,
        NUM_SLOTS: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # A tile of one group's packed queries (all members' tokens x GROUP heads) against one
        # split of the group's prefix: every prefix K/V tile is loaded once for all members.
        # prefix_pid: the program's index among the prefix programs (tile t, split).
        t, split = prefix_pid // NSP, prefix_pid % NSP
        q_ptr, stride_qt, stride_qh = q_view
        k_ptr, v_ptr, stride_kb, stride_kt = kv_view
        if t < tl.load(tile_cu_ptr + num_groups):
            g = find_owner(tile_cu_ptr, num_groups, t, 128)
            tok0 = tl.load(group_tok_ptr + g)
            n_tok = tl.load(group_tok_ptr + g + 1) - tok0
            row0 = (t - tl.load(tile_cu_ptr + g)) * BLOCK_M
            q, tok, head, valid = load_rows(
                q_ptr, tok0, n_tok, kv_head, row0, stride_qt, stride_qh, GROUP, BLOCK_M, HEAD_DIM, DOT_F32
            )
            p_len = tl.load(prefix_lens_ptr + g)
            lo, hi = _split_range(p_len, split, NSP, BLOCK_N)
            o, lse = attend_range(
                q,
                k_ptr,
                v_ptr,
                pbt_ptr + g.to(tl.int64) * stride_pbt,
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
            store_partial(
                o_part_ptr, lse_part_ptr, o, lse, tok0, tok, head, valid, split, num_heads, NUM_SLOTS, HEAD_DIM
            )

    @triton.jit
    def _store_own_part(
        out_view,
        o_part_ptr,
        lse_part_ptr,
        o,
        lse,
        tok0,
        tok,
        head,
        valid,
        split,
        num_heads,
        HEAD_DIM: tl.constexpr,
        NSP: tl.constexpr,
        NSO: tl.constexpr,
    ):
        # With no prefix programs and one own split the own part is the whole result: it goes
        # straight to out. Otherwise it fills slot NSP + split of the partials for the merge.
        if NSP == 0 and NSO == 1:
            out_ptr, stride_ot, stride_oh = out_view
            store_rows(out_ptr, o, tok0, tok, head, valid, stride_ot, stride_oh, HEAD_DIM)
        else:
            store_partial(
                o_part_ptr,
                lse_part_ptr,
                o,
                lse,
                tok0,
                tok,
                head,
                valid,
                NSP + split,
                num_heads,
                NSP + NSO,
                HEAD_DIM,
            )

    @triton.jit
    def _clear_prefix_slots(
        lse_part_ptr,
        ranges_ptr,
        num_groups,
        seq,
        tok0,
        tok,
        head,
        valid,
        split,
        num_heads,
        BLOCK_M: tl.constexpr,
        NSP: tl.constexpr,
        NSO: tl.constexpr,
    ):
        # No prefix program covers a sequence outside every group: give its prefix
        # slots weight zero here (lse = -inf) instead of filling the buffer first.
        if split == 0:
            if (seq < tl.load(ranges_ptr)) | (seq >= tl.load(ranges_ptr + num_groups)):
                row = ((tok0 + tok).to(tl.int64) * num_heads + head) * (NSP + NSO)
                none = tl.full([BLOCK_M], float("-inf"), tl.float32)
                for i in tl.static_range(NSP):
                    tl.store(lse_part_ptr + row + i, none, mask=valid)

    @triton.jit
    def _own_program(
        q_view,
        kv_view,
        out_view,
        o_part_ptr,
        lse_part_ptr,
        bt_ptr,
        cu_ptr,
        kv_lens_ptr,
        tile_cu_ptr,
        ranges_ptr,
        num_groups,
        num_seqs,
        own_pid,
        kv_head,
        qk_scale,
        num_heads,
        stride_bt,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        NSP: tl.constexpr,
        NSO: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # A tile of one sequence's queries against one split of its own KV, causal.
        # own_pid: the program's index among the own programs (tile t, split).
        t, split = own_pid // NSO, own_pid % NSO
        q_ptr, stride_qt, stride_qh = q_view
        k_ptr, v_ptr, stride_kb, stride_kt = kv_view
        if t < tl.load(tile_cu_ptr + num_seqs):
            seq = find_owner(tile_cu_ptr, num_seqs, t, 128)
            tok0 = tl.load(cu_ptr + seq)
            n_tok = tl.load(cu_ptr + seq + 1) - tok0
            kv_len = tl.load(kv_lens_ptr + seq)
            row0 = (t - tl.load(tile_cu_ptr + seq)) * BLOCK_M
            q, tok, head, valid = load_rows(
                q_ptr, tok0, n_tok, kv_head, row0, stride_qt, stride_qh, GROUP, BLOCK_M, HEAD_DIM, DOT_F32
            )
            limit = kv_len - n_tok + tok  # query i sees own keys <= limit
            last_tok = tl.minimum(n_tok - 1, (row0 + BLOCK_M - 1) // GROUP)
            end = kv_len - n_tok + last_tok + 1  # the tile's last query sees own keys < end
            lo, hi = _split_range(end, split, NSO, BLOCK_N)
            o, lse = attend_range(
                q,
                k_ptr,
                v_ptr,
                bt_ptr + seq.to(tl.int64) * stride_bt,
                lo,
                hi,
                limit,
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
                True,
                DOT_F32,
            )
            _store_own_part(
                out_view, o_part_ptr, lse_part_ptr, o, lse, tok0, tok, head, valid, split, num_heads, HEAD_DIM, NSP, NSO
            )
            if NSP > 0:
                _clear_prefix_slots(
                    lse_part_ptr,
                    ranges_ptr,
                    num_groups,
                    seq,
                    tok0,
                    tok,
                    head,
                    valid,
                    split,
                    num_heads,
                    BLOCK_M,
                    NSP,
                    NSO,
                )

    @triton.jit
    def _prefix_shared_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        o_part_ptr,
        lse_part_ptr,
        cu_ptr,
        kv_lens_ptr,
        bt_ptr,
        prefix_lens_ptr,
        pbt_ptr,
        ranges_ptr,
        group_tok_ptr,
        p_tile_cu_ptr,
        o_tile_cu_ptr,
        num_groups,
        num_seqs,
        num_prefix_programs,
        qk_scale,
        num_heads,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_bt,
        stride_pbt,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        BM_P: tl.constexpr,
        BN_P: tl.constexpr,
        BM_O: tl.constexpr,
        BN_O: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        NSP: tl.constexpr,
        NSO: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # Horizontal fusion: programs [0, num_prefix_programs) are prefix programs, the rest
        # own programs; each kind has its own tile shape (BM_P/BN_P vs BM_O/BN_O).
        # q, this kv head's K/V and out go to the programs as (pointers, strides) tuples.
        pid, kv_head = tl.program_id(0), tl.program_id(1)
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_kh
        q_view = (q_ptr, stride_qt, stride_qh)
        kv_view = (k_head, v_head, stride_kb, stride_kt)
        if NSP > 0:  # constexpr guard: with no groups the prefix branch is not compiled
            if pid < num_prefix_programs:
                _prefix_program(
                    q_view,
                    kv_view,
                    o_part_ptr,
                    lse_part_ptr,
                    pbt_ptr,
                    prefix_lens_ptr,
                    group_tok_ptr,
                    p_tile_cu_ptr,
                    num_groups,
                    pid,
                    kv_head,
                    qk_scale,
                    num_heads,
                    stride_pbt,
                    GROUP,
                    BM_P,
                    BN_P,
                    HEAD_DIM,
                    PAGE,
                    NSP,
                    NSP + NSO,
                    DOT_F32,
                )
        if pid >= num_prefix_programs:
            _own_program(
                q_view,
                kv_view,
                (out_ptr, stride_ot, stride_oh),
                o_part_ptr,
                lse_part_ptr,
                bt_ptr,
                cu_ptr,
                kv_lens_ptr,
                o_tile_cu_ptr,
                ranges_ptr,
                num_groups,
                num_seqs,
                pid - num_prefix_programs,
                kv_head,
                qk_scale,
                num_heads,
                stride_bt,
                GROUP,
                BM_O,
                BN_O,
                HEAD_DIM,
                PAGE,
                NSP,
                NSO,
                DOT_F32,
            )


def _pick_config(
    t: int,
    s: int,
    g: int,
    group: int,
    hkv: int,
    prefix_cap: int,
    own_cap: int,
    bytes_per_slot: int,
    dtype: torch.dtype,
    device: torch.device,
    interp: bool,
) -> dict:
    """Tile shapes and split counts by a plain rule from shapes only (no device sync, and the
    interpreter cannot autotune). Under the interpreter the smallest legal tiles keep the
    program count low; fp32 (CUDA-core dots) takes 32-key tiles so as not to spill."""
    if interp:
        bm = row_block(group)
        cfg = dict(BM_P=bm, BN_P=16, BM_O=bm, BN_O=16)
    else:
        prefill_heavy = t > 4 * max(s, 1)
        f32 = dtype == torch.float32
        bm_o = (32 if f32 else 64) if prefill_heavy else row_block(group)
        cfg = dict(BM_P=64, BN_P=32 if f32 else 64, BM_O=bm_o, BN_O=32 if f32 else 64)
    sms = num_sms(device)
    nsp = 0 if g == 0 else int(min(8, max(1, prefix_cap // 512)))
    # Own KV is split only when (sequence, kv head) programs cannot fill the GPU twice over,
    # and into ranges of at least ~512 keys.
    nso = 1 if s * hkv >= 2 * sms else max(1, min(8, -(-2 * sms // (s * hkv)), own_cap // 512))
    max_slots = max(2, (512 << 20) // max(bytes_per_slot, 1))  # bound the fp32 partials
    if nsp + nso > max_slots:
        nsp, nso = min(nsp, 1), 1
    cfg.update(NSP=nsp, NSO=nso)
    return cfg


def _check_triton_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_seq_ranges: torch.Tensor,
) -> None:
    """`_check_args` plus what the kernel needs: a supported head_dim, rows it can index with
    one stride (last dims contiguous)."""
    _check_args(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        kv_lens,
        block_tables,
        prefix_lens,
        prefix_block_tables,
        prefix_seq_ranges,
        FLOAT_DTYPES,
    )
    check_head_dim_for_triton(q.shape[2])
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("block_tables", block_tables)
    check_last_dim_contiguous("prefix_block_tables", prefix_block_tables)


def _launch_config(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    s: int,
    g: int,
    interp: bool,
    config: dict | None,
) -> dict:
    """`_pick_config`'s choice with the warps, overridden by the caller's `config`; NSP is 0
    without groups (no prefix programs), and both split counts must be >= 1 with groups."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    cfg = _pick_config(
        t,
        s,
        g,
        hq // hkv,
        hkv,
        prefix_block_tables.shape[1] * block_size,
        block_tables.shape[1] * block_size,
        t * hq * d * 4,
        q.dtype,
        q.device,
        interp,
    )
    cfg["num_warps"] = attn_num_warps(d)
    cfg.update(config or {})
    if g == 0:
        cfg["NSP"] = 0  # no groups, no prefix programs
    elif cfg["NSP"] < 1 or cfg["NSO"] < 1:
        raise ValueError(f"config NSP={cfg['NSP']}, NSO={cfg['NSO']}: both must be >= 1 when there are prefix groups")
    return cfg


def _partial_buffers(q: torch.Tensor, out: torch.Tensor, slots: int, direct: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_part [T, Hq, slots, D], lse_part [T, Hq, slots]) fp32 for the merge, or out twice when
    the kernel writes out directly (it then touches neither)."""
    if direct:
        return out, out
    t, hq, d = q.shape
    o_part = torch.empty(t, hq, slots, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(t, hq, slots, dtype=torch.float32, device=q.device)
    return o_part, lse_part


def _launch_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    cu: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    ranges: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    cfg: dict,
    interp: bool,
) -> None:
    """One launch of `_prefix_shared_kernel`: its prefix programs, then its own programs, for
    each kv head. tiles: (o_tile_cu, p_tile_cu, group_tok) from `launch_plan`."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    s, g, group = kv_lens.shape[0], prefix_lens.shape[0], hq // hkv
    o_tile_cu, p_tile_cu, group_tok = tiles
    num_prefix_programs = (triton.cdiv(t * group, cfg["BM_P"]) + g) * cfg["NSP"]
    num_own_programs = (triton.cdiv(t * group, cfg["BM_O"]) + s) * cfg["NSO"]
    grid = (num_prefix_programs + num_own_programs, hkv)
    _prefix_shared_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        o_part,
        lse_part,
        cu,
        kv_lens.contiguous(),
        block_tables,
        prefix_lens.contiguous(),
        prefix_block_tables,
        ranges,
        group_tok,
        p_tile_cu,
        o_tile_cu,
        g,
        s,
        num_prefix_programs,
        scale * LOG2E,
        hq,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        prefix_block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        PAGE=block_size,
        DOT_F32=dot_f32(q.dtype, interp),
        **cfg,
    )


def prefix_shared_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_seq_ranges: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton launcher of `prefix_shared_attention` (same arguments). Values (cu_seqlens_q
    rising, kv_lens >= q_len, ranges within 0..S) are not checked: that needs a device sync.
    `config` overrides the plain-rule choice of `_pick_config` (BM_P, BN_P, BM_O, BN_O, NSP,
    NSO, num_warps, num_stages); bench/kernel_bench.py sweeps it."""
    _check_triton_args(
        q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables, prefix_lens, prefix_block_tables, prefix_seq_ranges
    )
    out = check_out(out, q)
    s, g, group = kv_lens.shape[0], prefix_lens.shape[0], q.shape[1] // k_cache.shape[2]
    if q.shape[0] == 0 or s == 0:
        return out
    interp = interpreting()
    cfg = _launch_config(q, k_cache, block_tables, prefix_block_tables, s, g, interp, config)
    nsp, nso = cfg["NSP"], cfg["NSO"]
    cu, ranges = cu_seqlens_q.contiguous(), prefix_seq_ranges.contiguous()
    o_tile_cu, p_tile_cu, group_tok = launch_plan(cu, ranges if nsp > 0 else None, group, cfg["BM_O"], cfg["BM_P"])
    direct = nsp == 0 and nso == 1
    o_part, lse_part = _partial_buffers(q, out, nsp + nso, direct)
    if nsp == 0:
        p_tile_cu = group_tok = o_tile_cu  # not read by the kernel
    tiles = (o_tile_cu, p_tile_cu, group_tok)
    _launch_kernel(
        q,
        k_cache,
        v_cache,
        out,
        o_part,
        lse_part,
        cu,
        kv_lens,
        block_tables,
        prefix_lens,
        prefix_block_tables,
        ranges,
        tiles,
        scale,
        cfg,
        interp,
    )
    if not direct:
        launch_merge(o_part, lse_part, out)
    return out
