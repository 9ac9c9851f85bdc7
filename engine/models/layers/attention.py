"""Paged attention of one decoder layer over a flat token batch (no padding, no batch dim).

The layer writes this step's K/V into the paged cache, then attends through `prefixflow.kernels`
(Triton on CUDA, C or torch on the CPU). Three paths, chosen per step from the
`AttentionMetadata` the model runner builds once for all layers:
- pure fresh prefill (no cached context, no shared prefix): `packed_prefill_attention`, which
  reads k/v directly and writes the cache in the same call; on a CPU with the C kernels the
  step takes the third path instead (their chunked attention beats PyTorch's flash kernel);
- pure decode without shared prefixes: `paged_decode_attention`;
- anything else (chunked prefill, mixed steps, members of prefix groups):
  `prefix_shared_attention`, which streams each shared prefix's KV once for all members of its
  group (BatchLLM Sec. 4.3.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prefixflow.kernels import (
    cpu_kernels,
    packed_prefill_attention,
    paged_decode_attention,
    prefix_shared_attention,
    write_kv_cache,
)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where one step's tokens live in the paged KV cache; shared by every layer.

    Sequences are ordered so that those sharing prefix g are contiguous and come in prefix
    order, before the sequences without a shared prefix (the kernel's layout).

    slot_mapping: [T] int64, cache slot of each token's K/V (block * block_size + offset).
    cu_seqlens_q: [S + 1] int32, sequence s owns tokens cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1.
    kv_lens: [S] int32, own KV tokens of each sequence after this step's writes.
    block_tables: [S, max_blocks] int32, own KV blocks (padded with 0).
    prefix_lens: [G] int32; prefix_block_tables: [G, max_prefix_blocks] int32.
    prefix_seq_ranges: [G + 1] int32, sequences r[g] .. r[g+1]-1 share prefix g.
    is_prefill_only: no sequence has cached context or a shared prefix.
    is_decode_only: every sequence has one query token and no shared prefix.
    last_layer: the last layer's view when some rows are not sampled: one query per sampled
        row (None: the last layer computes every row). Only sampled rows reach the LM head, so
        the last layer writes every row's K/V but attends, projects and runs the MLP for these.
    rows: in a `last_layer` view, [N] int64, the rows of the step its queries are (its
        slot_mapping holds their slots, written with the step's metadata before it is read).
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    block_tables: torch.Tensor
    prefix_lens: torch.Tensor
    prefix_block_tables: torch.Tensor
    prefix_seq_ranges: torch.Tensor
    is_prefill_only: bool
    is_decode_only: bool
    last_layer: AttentionMetadata | None = None
    rows: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """No weights: writes K/V into its layer's cache and attends. Caches are bound by
    `bind_cache` after the model runner allocates them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """k_cache, v_cache: [num_blocks, block_size, Hkv, D] views owned by the runner."""
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        queries: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]. With `queries` (the step's
        `last_layer` view), q holds only the rows queries.rows, [N, Hq, D]: every row's K/V is
        written, those N attend -> [N, Hq, D]."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                "the KV cache is not bound: ModelRunner allocates it; call bind_cache before running the model"
            )
        kc, vc = self.k_cache, self.v_cache
        if queries is not None:
            write_kv_cache(k, v, kc, vc, meta.slot_mapping)
            return self._attend(q, queries, kc, vc)
        if meta.is_prefill_only and not cpu_kernels.supports(q, kc):
            return packed_prefill_attention(
                q, k, v, meta.cu_seqlens_q, self.scale, k_cache=kc, v_cache=vc, slot_mapping=meta.slot_mapping
            )
        write_kv_cache(k, v, kc, vc, meta.slot_mapping)
        return self._attend(q, meta, kc, vc)

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """q over the cache (kc, vc: the bound caches), which holds this step's K/V already."""
        if meta.is_decode_only:
            return paged_decode_attention(q, kc, vc, meta.kv_lens, meta.block_tables, self.scale)
        return prefix_shared_attention(
            q,
            kc,
            vc,
            meta.cu_seqlens_q,
            meta.kv_lens,
            meta.block_tables,
            meta.prefix_lens,
            meta.prefix_block_tables,
            meta.prefix_seq_ranges,
            self.scale,
        )
