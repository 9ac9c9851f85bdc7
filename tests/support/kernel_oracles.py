"""Naive float64 oracles of the attention kernels, for the kernel tests (CPU and GPU)."""

from __future__ import annotations

import torch

from prefixflow.bench.kernel_cases import PrefixCase


def naive_prefix_attention(c: PrefixCase) -> torch.Tensor:
    """Per-token, per-head float64 loop over the semantics of `prefix_shared_attention`."""
    q, kc, vc = c.q.double().cpu(), c.k_cache.double().cpu(), c.v_cache.double().cpu()
    cu, lens = c.cu_seqlens_q.tolist(), c.kv_lens.tolist()
    bt, pbt = c.block_tables.tolist(), c.prefix_block_tables.tolist()
    plens, ranges = c.prefix_lens.tolist(), c.prefix_seq_ranges.tolist()
    bs, hkv = kc.shape[1], kc.shape[2]
    ratio = q.shape[1] // hkv
    out = torch.full_like(q, float("nan"))
    for s in range(len(lens)):
        g = next((g for g in range(len(plens)) if ranges[g] <= s < ranges[g + 1]), -1)
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            slots = [(pbt[g][j // bs], j % bs) for j in range(plens[g])] if g >= 0 else []
            slots += [(bt[s][j // bs], j % bs) for j in range(lens[s] - q_len + i + 1)]
            blocks = torch.tensor([b for b, _ in slots])
            offs = torch.tensor([o for _, o in slots])
            for h in range(q.shape[1]):
                keys, vals = kc[blocks, offs, h // ratio], vc[blocks, offs, h // ratio]
                p = torch.softmax(keys @ q[cu[s] + i, h] * c.scale, dim=0)
                out[cu[s] + i, h] = p @ vals
    return out


def naive_packed_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-token float64 loop over the semantics of `packed_prefill_attention`."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    ratio = q.shape[1] // k.shape[1]
    out = torch.full_like(q, float("nan"))
    cu = cu_seqlens.tolist()
    for lo, hi in zip(cu, cu[1:]):
        for t in range(lo, hi):
            for h in range(q.shape[1]):
                keys, vals = k[lo : t + 1, h // ratio], v[lo : t + 1, h // ratio]
                out[t, h] = torch.softmax(keys @ q[t, h] * scale, dim=0) @ vals
    return out


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| in float64 (every element must be finite to pass)."""
    x, ref = x.double().cpu(), ref.double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
