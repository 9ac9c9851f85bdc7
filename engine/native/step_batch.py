"""StepInput -> the flat host arrays one forward pass needs (numpy, no torch).

The model runs over all chunks of a step as one flat token stream. This module orders the
chunks the way the prefix-shared attention kernel wants them (sequences sharing prefix g
contiguous, in prefix order, before the sequences without a prefix; BatchLLM Sec. 4.3.3) and
computes, vectorised, each token's id, rotary position and KV-cache slot, plus the per-sequence
and per-prefix tables. Everything lands in two flat buffers (int64, int32) so that the runner
copies them to the device in two transfers.

Only the sampled rows reach the LM head, so the last decoder layer needs every row's K/V but
only the sampled rows' attention, o_proj and MLP. When a step has rows that do not sample
(prefix computations, prefill chunks that stop short, every prompt token but a chunk's last),
the batch also carries the last layer's view: those rows, and the tables of their sequences as
one single query each (PrefillOnly Sec. 4's observation, which engine/scoring/forward.py uses
for the score task; here for every mixed step). A 4-layer model's prefill steps skip almost a
quarter of their linear work.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from prefixflow.engine.native.step import KVCopy, SeqChunk, StepInput


@dataclass(frozen=True, slots=True)
class StepBatch:
    """int64_buffer: [input_ids (T), positions (T), slot_mapping (T), logits_indices (N)].
    int32_buffer: [cu_seqlens_q (S+1), kv_lens (S), block_tables (S*max_blocks),
    prefix_lens (G), prefix_block_tables (G*max_prefix_blocks), prefix_seq_ranges (G+1)].
    logits_indices are rows of the last layer's output, in the ORIGINAL order of the sampling
    chunks: rows of the flat stream, or of `last`'s rows when there is a `last`."""

    int64_buffer: np.ndarray
    int32_buffer: np.ndarray
    num_tokens: int
    num_seqs: int
    num_prefixes: int
    num_sampled: int
    max_blocks: int
    max_prefix_blocks: int
    is_prefill_only: bool
    is_decode_only: bool
    last: LastLayerBatch | None = None  # None: the last layer computes every row


@dataclass(frozen=True, slots=True)
class LastLayerBatch:
    """The last layer's queries: N sampled rows, each one query of its own sequence (in kernel
    order: prefix groups first), over its prefix and all its own keys.
    int64_buffer: [rows of the flat stream (N), their slots (N)].
    int32_buffer: [cu_seqlens_q (N+1), kv_lens (N), block_tables (N*max_blocks), prefix_lens (G'),
    prefix_block_tables (G'*max_prefix_blocks), prefix_seq_ranges (G'+1)], over the G' prefixes
    that sampled rows read."""

    int64_buffer: np.ndarray
    int32_buffer: np.ndarray
    num_rows: int
    num_prefixes: int


def build_step_batch(step: StepInput, block_size: int, max_model_len: int, num_kv_blocks: int) -> StepBatch:
    """Flatten `step`; raises ValueError when a chunk contradicts the contract (engine/native/step.py)."""
    chunks = step.chunks
    if not chunks:
        raise ValueError("StepInput.chunks is empty; the scheduler must not run an empty step")
    for c in chunks:
        _check_chunk(c, step, block_size, max_model_len)
    for copy in step.copies:
        _check_copy(copy, block_size, num_kv_blocks)
    # Chunks with prefix g (in g order) first, then those without; stable within each.
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].prefix_index < 0, chunks[i].prefix_index))
    seqs = [chunks[i] for i in order]
    q_lens = np.array([len(c.token_ids) for c in seqs], dtype=np.int64)  # [S]
    cu = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    t = int(cu[-1])
    offset = np.arange(t, dtype=np.int64) - np.repeat(cu[:-1], q_lens)  # i within chunk
    starts = np.array([c.start_pos for c in seqs], dtype=np.int64)
    cached = np.array([c.num_cached_tokens for c in seqs], dtype=np.int64)
    positions = np.repeat(starts, q_lens) + offset  # [T]
    own_index = np.repeat(cached, q_lens) + offset  # [T] own-KV idx
    tables = _table_matrix([c.block_table for c in seqs])  # [S, max_blocks]
    seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
    slots = tables[seq_of_token, own_index // block_size].astype(np.int64) * block_size + own_index % block_size  # [T]
    ids = np.fromiter(chain.from_iterable(c.token_ids for c in seqs), dtype=np.int64, count=t)
    position_in_sorted = np.empty(len(chunks), dtype=np.int64)
    position_in_sorted[order] = np.arange(len(chunks))
    sampled_seqs = position_in_sorted[[i for i, c in enumerate(chunks) if c.sample]]  # [N]
    logits_indices = cu[sampled_seqs + 1] - 1
    p_lens, p_tables, ranges = _prefix_arrays(seqs, step)
    for name, tab in (("block_table", tables), ("prefix block_table", p_tables)):
        if tab.size and (tab.min() < 0 or tab.max() >= num_kv_blocks):
            raise ValueError(
                f"a {name} holds block ids in {tab.min()}..{tab.max()}, outside the cache's 0..{num_kv_blocks - 1}"
            )
    last = None
    if 0 < len(sampled_seqs) < t:
        last_seqs = np.sort(sampled_seqs)  # kernel order
        last = _last_layer_batch(last_seqs, cu, slots, cached + q_lens, tables, p_lens, p_tables, ranges)
        logits_indices = np.searchsorted(last_seqs, sampled_seqs)  # rows of `last`
    int64_buffer = np.concatenate([ids, positions, slots, logits_indices.astype(np.int64)])
    int32_buffer = np.concatenate([cu, cached + q_lens, tables.ravel(), p_lens, p_tables.ravel(), ranges]).astype(
        np.int32
    )
    has_prefix = seqs[0].prefix_index >= 0
    return StepBatch(
        int64_buffer=int64_buffer,
        int32_buffer=int32_buffer,
        num_tokens=t,
        num_seqs=len(seqs),
        num_prefixes=len(p_lens),
        num_sampled=len(logits_indices),
        max_blocks=tables.shape[1],
        max_prefix_blocks=p_tables.shape[1],
        is_prefill_only=not has_prefix and not cached.any(),
        is_decode_only=not has_prefix and bool((q_lens == 1).all()),
        last=last,
    )


def _last_layer_batch(
    last_seqs: np.ndarray,
    cu: np.ndarray,
    slots: np.ndarray,
    kv_lens: np.ndarray,
    tables: np.ndarray,
    p_lens: np.ndarray,
    p_tables: np.ndarray,
    ranges: np.ndarray,
) -> LastLayerBatch:
    """The sampled sequences `last_seqs` (ascending kernel indices) as one query each: the last
    row of each chunk, which sees all of its sequence's own keys after the step's writes."""
    rows = cu[last_seqs + 1] - 1
    # Sequences per prefix among the sampled ones; prefixes no sampled row reads are dropped.
    counts = np.diff(np.searchsorted(last_seqs, ranges))
    keep = counts > 0
    last_ranges = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(counts[keep], out=last_ranges[1:])
    return LastLayerBatch(
        int64_buffer=np.concatenate([rows, slots[rows]]),
        int32_buffer=np.concatenate(
            [
                np.arange(len(rows) + 1),
                kv_lens[last_seqs],
                tables[last_seqs].ravel(),
                p_lens[keep],
                p_tables[keep].ravel(),
                last_ranges,
            ]
        ).astype(np.int32),
        num_rows=len(rows),
        num_prefixes=int(keep.sum()),
    )


def _prefix_arrays(seqs: list[SeqChunk], step: StepInput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """prefix_lens [G], prefix_block_tables [G, max_prefix_blocks], prefix_seq_ranges [G+1]
    over the prefixes that this step's chunks use (G may be smaller than len(step.prefixes))."""
    used = sorted({c.prefix_index for c in seqs if c.prefix_index >= 0})
    counts = [sum(1 for c in seqs if c.prefix_index == g) for g in used]
    ranges = np.zeros(len(used) + 1, dtype=np.int64)
    np.cumsum(counts, out=ranges[1:])
    p_lens = np.array([step.prefixes[g].length for g in used], dtype=np.int64)
    p_tables = _table_matrix([step.prefixes[g].block_table for g in used])
    return p_lens, p_tables, ranges


def _table_matrix(tables: list[tuple[int, ...]]) -> np.ndarray:
    """Block tables padded with block 0 (never read past a sequence's length) into [R, W]."""
    width = max((len(t) for t in tables), default=0) or 1
    out = np.zeros((len(tables), width), dtype=np.int64)
    for r, t in enumerate(tables):
        out[r, : len(t)] = t
    return out


def _check_copy(copy: KVCopy, block_size: int, num_kv_blocks: int) -> None:
    if not (0 <= copy.src < num_kv_blocks and 0 <= copy.dst < num_kv_blocks and copy.src != copy.dst):
        raise ValueError(f"{copy} names blocks outside the cache's 0..{num_kv_blocks - 1} or one block twice")
    if not 0 < copy.num_tokens <= block_size:
        raise ValueError(f"{copy} copies {copy.num_tokens} slots of blocks of {block_size}")


def _check_chunk(c: SeqChunk, step: StepInput, block_size: int, max_model_len: int) -> None:
    n = len(c.token_ids)
    if n == 0:
        raise ValueError(f"SeqChunk(seq_id={c.seq_id}) has no token_ids; drop empty chunks")
    if c.start_pos < 0 or c.num_cached_tokens < 0:
        raise ValueError(
            f"SeqChunk(seq_id={c.seq_id}) has start_pos={c.start_pos}, "
            f"num_cached_tokens={c.num_cached_tokens}; both must be >= 0"
        )
    if c.start_pos + n > max_model_len:
        raise ValueError(
            f"SeqChunk(seq_id={c.seq_id}) reaches position {c.start_pos + n - 1}, beyond max_model_len={max_model_len}"
        )
    if len(c.block_table) * block_size < c.num_cached_tokens + n:
        raise ValueError(
            f"SeqChunk(seq_id={c.seq_id}).block_table has {len(c.block_table)} "
            f"blocks of {block_size}, too few for {c.num_cached_tokens} cached + "
            f"{n} new tokens"
        )
    if not -1 <= c.prefix_index < len(step.prefixes):
        raise ValueError(
            f"SeqChunk(seq_id={c.seq_id}).prefix_index={c.prefix_index} but the step has {len(step.prefixes)} prefixes"
        )
    if c.prefix_index >= 0:
        p = step.prefixes[c.prefix_index]
        if len(p.block_table) * block_size < p.length or p.length < 1:
            raise ValueError(
                f"SharedPrefix {c.prefix_index} has length {p.length} and "
                f"{len(p.block_table)} blocks of {block_size}; the blocks must "
                "cover a non-empty prefix"
            )
        if c.start_pos != p.length + c.num_cached_tokens:
            raise ValueError(
                f"SeqChunk(seq_id={c.seq_id}).start_pos={c.start_pos} must equal "
                f"prefix length {p.length} + num_cached_tokens {c.num_cached_tokens}"
            )
    if c.sample and c.sampling_params is None:
        raise ValueError(f"SeqChunk(seq_id={c.seq_id}) has sample=True but no sampling_params")
