"""RaggedTokens: many token-id sequences as one flat array plus offsets.

This is the planner's only input form. It is what an Arrow `list<int32>` column already is
(values + offsets), so the pipeline hands a gathered column over without copying tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class RaggedTokens:
    """Sequence i is `flat[offsets[i]:offsets[i + 1]]`.

    flat: [total_tokens] int32 or int64 token ids (not copied).
    offsets: [num_seqs + 1] int64, non-decreasing, offsets[0] == 0.
    """

    flat: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        if self.flat.ndim != 1 or self.offsets.ndim != 1 or len(self.offsets) < 1:
            raise ValueError("RaggedTokens needs a 1-D flat array and 1-D offsets with at least one entry")
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.flat):
            raise ValueError(
                f"RaggedTokens offsets must start at 0 and end at len(flat)={len(self.flat)}, "
                f"got {self.offsets[0]}..{self.offsets[-1]}"
            )
        if len(self.offsets) > 1 and np.any(np.diff(self.offsets) < 0):
            raise ValueError("RaggedTokens offsets must be non-decreasing")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, idx: np.ndarray) -> "RaggedTokens":
        """Sequences idx[0], idx[1], ... (copied), in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        lens = self.lengths[idx]
        offsets = np.r_[0, np.cumsum(lens)].astype(np.int64)
        at = np.repeat(self.offsets[:-1][idx] - offsets[:-1], lens) + np.arange(offsets[-1])
        return RaggedTokens(self.flat[at], offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]] | Any) -> "RaggedTokens":
        """Accepts RaggedTokens, a pyarrow (Chunked)ListArray of ints, or a sequence of sequences."""
        if isinstance(prompts, RaggedTokens):
            return prompts
        arrow = _from_arrow(prompts)
        if arrow is not None:
            return arrow
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.empty(int(offsets[-1]), dtype=np.int64)
        for i, p in enumerate(prompts):
            flat[offsets[i] : offsets[i + 1]] = p
        if len(flat) and (flat.min() < 0):
            raise ValueError("token ids must be non-negative integers")
        if len(flat) == 0 or flat.max() < 2**31:
            flat = flat.astype(np.int32)
        return cls(flat, offsets)


def _from_arrow(prompts: Any) -> RaggedTokens | None:
    """Zero-copy view of an Arrow list column, or None when `prompts` is not Arrow."""
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        return None
    if isinstance(prompts, pa.ChunkedArray):
        prompts = prompts.combine_chunks() if prompts.num_chunks != 1 else prompts.chunk(0)
    if not isinstance(prompts, (pa.ListArray, pa.LargeListArray)):
        return None
    if prompts.null_count:
        raise ValueError("token id lists must not be null")
    offsets = prompts.offsets.to_numpy().astype(np.int64)
    flat = prompts.values.to_numpy(zero_copy_only=False)
    start = int(offsets[0])
    if start or int(offsets[-1]) != len(flat):  # a sliced array: views into the values
        flat = flat[start : int(offsets[-1])]
        offsets = offsets - start
    return RaggedTokens(flat, offsets)
