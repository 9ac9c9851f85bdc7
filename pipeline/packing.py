"""Prepacking (Zhao et al., Sec. 3): pack prompts into fixed-size sequences for one prefill.

Padding every prompt of a batch to the longest wastes compute on pad tokens. Prepacking instead
places prompts into bins of `bin_size` tokens (default: the longest prompt, Sec. 3.1) with
first-fit decreasing: prompts longest first, each into the first bin with room, a new bin when
none has room. Inside a bin prompts attend only to themselves (independent masking, Sec. 3.2)
and positions restart at 0 at every prompt (restart positional encoding).

`PackedBatch` holds the metadata a variable-length attention kernel needs (kernels/
packed_prefill.py): the token stream is the prompts concatenated in packed order, `cu_seqlens`
marks each prompt, `position_ids` restart per prompt, `segment_ids` name the prompt of every
token, and `bin_ptr` / `bin_offsets` mark the bins (for a padded [num_bins, bin_size] layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class PackedBatch:
    """Prompts packed into bins.

    bin_size: tokens per bin. prompt_order: [k] prompt indices in packed order (bin by bin).
    bin_ptr: [num_bins + 1] bin b holds prompt_order[bin_ptr[b]:bin_ptr[b + 1]].
    cu_seqlens: [k + 1] int32 token offsets of the packed prompts in the (unpadded) stream.
    start_in_bin: [k] where each packed prompt starts inside its bin (the restart points).
    position_ids: [T] int64 position of each token within its own prompt (restarts at 0).
    segment_ids: [T] int64 index into prompt_order of each token's prompt.
    bin_offsets: [num_bins + 1] token offsets of the bins in the stream.
    """

    bin_size: int
    prompt_order: np.ndarray
    bin_ptr: np.ndarray
    cu_seqlens: np.ndarray
    start_in_bin: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    bin_offsets: np.ndarray

    @property
    def num_bins(self) -> int:
        return len(self.bin_ptr) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def bin_lengths(self) -> np.ndarray:
        return np.diff(self.bin_offsets)

    def padding_tokens(self) -> int:
        """Pad tokens of the padded [num_bins, bin_size] layout."""
        return self.num_bins * self.bin_size - self.num_tokens

    def pack_tokens(self, prompts: list[np.ndarray] | tuple[np.ndarray, ...]) -> np.ndarray:
        """[T] the prompts' tokens concatenated in packed order."""
        if not self.prompt_order.size:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(prompts[i]) for i in self.prompt_order.tolist()])

    def padded(self, stream: np.ndarray, pad: int = 0) -> np.ndarray:
        """[num_bins, bin_size] layout of a [T] per-token array (tokens or positions)."""
        out = np.full((self.num_bins, self.bin_size), pad, dtype=np.asarray(stream).dtype)
        bins = np.repeat(np.arange(self.num_bins), self.bin_lengths())
        cols = np.arange(self.num_tokens) - self.bin_offsets[bins]
        out[bins, cols] = stream
        return out


def first_fit_decreasing(lengths: np.ndarray, bin_size: int) -> np.ndarray:
    """Bin of every item under first-fit decreasing; [k] int64, bins numbered in opening order.

    Runs in O(k * num_bins / 64) with a vectorised search of the open bins' free space.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.max() > bin_size:
        raise ValueError(f"bin_size={bin_size} is smaller than the longest prompt ({lengths.max()} "
                         f"tokens): use a bin_size of at least the longest prompt")
    free = np.zeros(0, dtype=np.int64)
    capacity = 0
    assign = np.empty(len(lengths), dtype=np.int64)
    num_bins = 0
    for i in np.argsort(-lengths, kind="stable").tolist():
        need = lengths[i]
        room = np.flatnonzero(free[:num_bins] >= need)
        if len(room):
            b = int(room[0])
        else:
            if num_bins == capacity:
                capacity = max(2 * capacity, 16)
                free = np.r_[free, np.zeros(capacity - len(free), dtype=np.int64)]
            b = num_bins
            free[b] = bin_size
            num_bins += 1
        free[b] -= need
        assign[i] = b
    return assign


def pack(lengths: np.ndarray, bin_size: int | None = None) -> PackedBatch:
    """Prepack prompts of the given lengths (Prepacking Alg. 1: BINPACK, RESTART-PE, masks)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths.size and lengths.min() < 1):
        raise ValueError("lengths must be a 1-D array of positive prompt lengths")
    size = int(lengths.max()) if bin_size is None and lengths.size else int(bin_size or 1)
    assign = first_fit_decreasing(lengths, size)
    # Packed order: bin by bin, and within a bin in placement order (longest first).
    placement = np.argsort(-lengths, kind="stable")
    rank = np.empty_like(placement)
    rank[placement] = np.arange(len(placement))
    order = np.lexsort((rank, assign)).astype(np.int64)
    num_bins = int(assign.max()) + 1 if assign.size else 0
    bin_ptr = np.searchsorted(assign[order], np.arange(num_bins + 1)).astype(np.int64)
    packed_lens = lengths[order]
    cu = np.r_[0, np.cumsum(packed_lens)].astype(np.int32)
    bin_offsets = cu[bin_ptr].astype(np.int64)
    bin_of = np.repeat(np.arange(num_bins), np.diff(bin_ptr))
    start_in_bin = cu[:-1] - bin_offsets[bin_of] if num_bins else np.zeros(0, np.int64)
    segment = np.repeat(np.arange(len(order), dtype=np.int64), packed_lens)
    positions = np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1].astype(np.int64)[segment]
    return PackedBatch(size, order, bin_ptr, cu, start_in_bin.astype(np.int64), positions,
                       segment, bin_offsets)
