"""AlignedServe's prefix-aware decode batching: Density First Search over a quad-tree (Sec. 3.3).

Decode steps cost what their longest KV read costs, so a batch whose requests have similar KV
lengths wastes the least (AlignedServe Sec. 2.3-2.4). The quad-tree covers KV lengths
[0, max_len): the root holds the whole range and each node splits its range into four equal
sub-ranges, down to single lengths; a node counts its requests and their KV blocks.

Density First Search (Alg. 1), from the root:
- case 1: the node's blocks fit the memory threshold and it holds at least `min_requests`
  requests: they are the batch.
- case 2: the node's blocks exceed the threshold: descend into the child with the most requests
  (the densest range).
- case 3: the node fits but holds too few requests: widen the range over its neighbours, one
  request at a time on the side whose next length is closer (L-Search scans left, R-Search
  right), until the batch has `min_requests`, then keep widening inside the parent's range
  while the blocks fit.
Starvation (Sec. 3.5): every node of `starvation_level` keeps the time it last produced a batch
(or first held a request); one that has waited longer than `starvation_s` is searched first.

The tree is implicit: requests sorted by KV length make every node a contiguous slice, found
with a binary search, so a call costs O(n log n) for n waiting requests.

A batch "fits" when its blocks are within `max_blocks` and, if given, it holds at most
`max_requests` requests. The engine's scheduler (engine/native/scheduler.py) asks for exactly
EngineConfig.aligned_decode_batch requests (min = max) and lets the memory threshold never bind:
its running requests' KV stays in the cache whether they decode or wait (the cache plays the
KV pool of AlignedServe Sec. 3.2).
"""

from __future__ import annotations

import math

import numpy as np

from prefixflow.errors import require


class DensityFirstBatcher:
    """Picks decode batches of similar KV length. The engine calls `select` when it needs one.

    max_blocks: memory threshold, KV blocks a batch may hold (the paper uses 40% of the GPU's).
    min_requests: smallest batch worth running (the paper uses 36).
    max_requests: largest batch (None: no cap); at least min_requests.
    block_size: tokens per KV block. max_len: lengths at or above it count as max_len - 1.
    starvation_s: a range that has produced no batch for this long is served first.
    starvation_level: tree level whose nodes keep starvation timestamps (4**level ranges).
    """

    def __init__(
        self,
        max_blocks: int,
        min_requests: int,
        block_size: int = 16,
        max_len: int = 65536,
        starvation_s: float = 30.0,
        starvation_level: int = 4,
        max_requests: int | None = None,
    ) -> None:
        owner = "DensityFirstBatcher"
        for name, value in (
            ("max_blocks", max_blocks),
            ("min_requests", min_requests),
            ("block_size", block_size),
            ("max_len", max_len),
        ):
            require(value >= 1, owner, name, value, "use a positive integer")
        require(
            max_requests is None or max_requests >= min_requests,
            owner,
            "max_requests",
            max_requests,
            f"use None or at least min_requests ({min_requests})",
        )
        require(starvation_s > 0, owner, "starvation_s", starvation_s, "use a positive number of seconds")
        self.max_requests = max_requests if max_requests is not None else np.iinfo(np.int64).max
        self.max_blocks, self.min_requests, self.block_size = max_blocks, min_requests, block_size
        self.depth = max(1, math.ceil(math.log(max_len, 4)))
        self.max_len = 4**self.depth
        self.starvation_s = starvation_s
        self.starvation_level = min(max(starvation_level, 0), self.depth)
        self._stamps: dict[int, float] = {}

    def select(self, kv_lens: np.ndarray, now: float, ids: np.ndarray | None = None) -> np.ndarray:
        """The next batch: positions in `kv_lens` (or `ids` at those positions).

        kv_lens: [n] KV tokens of each waiting request. now: the caller's clock in seconds.
        The batch never holds more than `max_blocks` blocks, and holds at least `min_requests`
        requests whenever that many fit (the shortest `min_requests` fit), except a batch
        that serves a starved range, which may be smaller.
        """
        lens = np.minimum(np.asarray(kv_lens, dtype=np.int64), self.max_len - 1)
        self._sorted = np.argsort(lens, kind="stable")
        self._lens = lens[self._sorted]
        blocks = np.maximum(-(-self._lens // self.block_size), 1)
        self._cum = np.r_[0, np.cumsum(blocks)]
        start = self._starved_node(now)
        a, b = self._search(*start)
        starved = start != (0, 0)  # a starved range is served even below min_requests
        if b - a < self.min_requests and not (starved and b > a):
            a, b = self._tightest_window(a, b)  # the searched range was too crowded or sparse
        if a == b and len(self._lens) and self._fits(0, 1):
            a, b = 0, 1  # at least the shortest request, when it fits at all
        batch = self._sorted[a:b]
        self._stamp(batch, lens, now)
        return batch if ids is None else np.asarray(ids)[batch]

    # -- the search ------------------------------------------------------------------------------
    def _range(self, level: int, index: int) -> tuple[int, int]:
        width = 4 ** (self.depth - level)
        lo, hi = np.searchsorted(self._lens, [index * width, (index + 1) * width])
        return int(lo), int(hi)

    def _blocks(self, a: int, b: int) -> int:
        return int(self._cum[b] - self._cum[a])

    def _fits(self, a: int, b: int) -> bool:
        return b - a <= self.max_requests and self._blocks(a, b) <= self.max_blocks

    def _search(self, level: int, index: int) -> tuple[int, int]:
        """Alg. 1 from the given node; returns a slice a..b-1 of the sorted requests."""
        parent = (level, index)
        while True:
            a, b = self._range(level, index)
            if self._fits(a, b):
                if b - a >= self.min_requests or (level == 0 and index == 0):
                    return a, b  # case 1
                return self._widen(a, b, self._range(*parent))  # case 3
            if level == self.depth:  # one length, too many to fit: as many as fit
                return a, a + self._fit_from(a, b)
            parent = (level, index)
            kids = [self._range(level + 1, 4 * index + k) for k in range(4)]
            best = max(range(4), key=lambda k: kids[k][1] - kids[k][0])  # case 2: densest child
            level, index = level + 1, 4 * index + best

    def _fit_from(self, a: int, b: int) -> int:
        by_blocks = int(np.searchsorted(self._cum[a : b + 1] - self._cum[a], self.max_blocks, "right")) - 1
        return min(by_blocks, self.max_requests)

    def _widen(self, a: int, b: int, parent: tuple[int, int]) -> tuple[int, int]:
        """Case 3: grow a..b-1 towards the closer neighbour (L-Search / R-Search)."""
        n, lens = len(self._lens), self._lens
        p_lo, p_hi = parent
        while True:
            can_l = a > 0 and self._fits(a - 1, b)
            can_r = b < n and self._fits(a, b + 1)
            if b - a >= self.min_requests:  # big enough: widen only inside the parent's range
                can_l, can_r = can_l and a > p_lo, can_r and b < p_hi
            if not (can_l or can_r):
                break
            go_left = can_l and (not can_r or lens[a] - lens[a - 1] <= lens[b] - lens[b - 1])
            a, b = (a - 1, b) if go_left else (a, b + 1)
        return a, b

    def _tightest_window(self, a: int, b: int) -> tuple[int, int]:
        """The min_requests consecutive lengths with the smallest spread that fit; (a, b) if none."""
        k = self.min_requests
        if len(self._lens) < k:
            return a, b
        starts = np.arange(len(self._lens) - k + 1)
        fits = self._cum[starts + k] - self._cum[starts] <= self.max_blocks
        if not fits.any():
            return a, b
        spread = np.where(fits, self._lens[starts + k - 1] - self._lens[starts], np.iinfo(np.int64).max)
        j = int(np.argmin(spread))
        return j, j + k

    # -- starvation ------------------------------------------------------------------------------
    def _node_of(self, lens: np.ndarray) -> np.ndarray:
        return lens >> (2 * (self.depth - self.starvation_level))

    def _starved_node(self, now: float) -> tuple[int, int]:
        """The longest-waiting node over `starvation_s`, else the root."""
        live = set(np.unique(self._node_of(self._lens)).tolist())
        self._stamps = {v: t for v, t in self._stamps.items() if v in live}
        for v in live:
            self._stamps.setdefault(v, now)
        if not self._stamps:
            return 0, 0
        oldest = min(self._stamps, key=lambda v: (self._stamps[v], v))
        if now - self._stamps[oldest] > self.starvation_s:
            return self.starvation_level, oldest
        return 0, 0

    def _stamp(self, batch: np.ndarray, lens: np.ndarray, now: float) -> None:
        for v in np.unique(self._node_of(lens[batch])).tolist():
            self._stamps[v] = now
