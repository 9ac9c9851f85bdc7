"""Random inputs of the attention kernels, for bench/kernel_bench.py and the kernel tests.

Not used by the engine; it lives with the bench that needs it (the tests' float64 oracles are
in tests/support/kernel_oracles.py). `make_prefix_case` lays out a step like the engine does:
every sequence's own KV and every prefix's KV in distinct, shuffled blocks; block tables padded
with 0 beyond the used blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixCase:
    """Arguments of `prefix_shared_attention` (see its docstring for shapes)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    block_tables: torch.Tensor
    prefix_lens: torch.Tensor
    prefix_block_tables: torch.Tensor
    prefix_seq_ranges: torch.Tensor
    scale: float

    def args(
        self,
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float,
    ]:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.cu_seqlens_q,
            self.kv_lens,
            self.block_tables,
            self.prefix_lens,
            self.prefix_block_tables,
            self.prefix_seq_ranges,
            self.scale,
        )


def _i32(x: list, device: str) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device)


def _tables(lens: list[int], block_size: int, next_block: list[int], perm: list[int]) -> list:
    rows = []
    for n in lens:
        nb = -(-n // block_size)
        rows.append([perm[next_block[0] + i] for i in range(nb)])
        next_block[0] += nb
    width = max([len(r) for r in rows] + [1])
    return [r + [0] * (width - len(r)) for r in rows]


def make_prefix_case(
    groups: list[tuple[int, list[tuple[int, int]]]],
    solo: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: str = "cpu",
    spare_blocks: int = 3,
) -> PrefixCase:
    """groups: [(prefix_len, [(q_len, kv_len) per member])]; solo: [(q_len, kv_len)] without
    prefix. Sequences are ordered group by group, then the solo ones."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [m for _, members in groups for m in members] + list(solo)
    prefix_lens = [p for p, _ in groups]
    need = sum(-(-n // block_size) for n in prefix_lens + [kv for _, kv in seqs])
    num_blocks = need + spare_blocks + 1  # block 0 stays a decoy of padded tables
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    counter = [0]
    prefix_tables = _tables(prefix_lens, block_size, counter, perm)
    seq_tables = _tables([kv for _, kv in seqs], block_size, counter, perm)
    ranges, n = [0], 0
    for _, members in groups:
        n += len(members)
        ranges.append(n)
    cu = [0]
    for q_len, _ in seqs:
        cu.append(cu[-1] + q_len)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    data_gen = torch.Generator(device=device).manual_seed(seed)  # big tensors on the device

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=data_gen, device=device).to(dtype)

    k_cache, v_cache, q = randn(*shape), randn(*shape), randn(cu[-1], num_heads, head_dim)
    ptab = _i32(prefix_tables, device) if groups else torch.zeros((0, 1), dtype=torch.int32, device=device)
    return PrefixCase(
        q,
        k_cache,
        v_cache,
        _i32(cu, device),
        _i32([kv for _, kv in seqs], device),
        _i32(seq_tables, device),
        _i32(prefix_lens, device),
        ptab,
        _i32(ranges, device),
        head_dim**-0.5,
    )
