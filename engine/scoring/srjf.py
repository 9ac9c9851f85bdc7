"""PrefillOnly's scheduling: shortest remaining job first with continuous JCT calibration (Sec. 6.3).

Prefill-only requests (scoring, classification) run one at a time (Sec. 6.1), so the order of
the waiting queue sets both latency and prefix-cache hits. Plain SRJF fixes each job's time at
arrival; with a prefix cache, a job gets shorter when the cache receives its prefix and longer
when the prefix is evicted. Alg. 1 therefore recomputes every waiting job's score before each
pick, against what the cache holds now:

    score(r) = jct(n_input, n_cached) - lambda * T_queue

with the JCT proxy n_input - n_cached (the tokens the cache does not cover: Pearson 0.987 with
measured JCT in the paper) unless a fitted `jct` is given, and lambda > 0 trading average
latency for the worst case (starvation). The lowest score runs next; ties go to the earliest
arrival. `calibrate=False` gives plain SRJF (n_cached taken once, at arrival).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from prefixflow.errors import require

CachedLen = Callable[[np.ndarray], int]  # tokens -> leading tokens the prefix cache holds
JCT = Callable[[int, int], float]  # (n_input, n_cached) -> predicted job time


def miss_tokens(n_input: int, n_cached: int) -> float:
    """The default JCT proxy: tokens not covered by the cached prefix."""
    return float(n_input - n_cached)


@dataclass(slots=True)
class _Waiting:
    req_id: Hashable
    tokens: np.ndarray
    arrival: float
    seq: int
    cached_at_arrival: int


class SRJFScheduler:
    """The waiting queue of a prefill-only engine.

    lam: lambda, score reduction per second of queueing (0: pure SRJF).
    calibrate: recompute n_cached at every pick (Alg. 1); False: plain SRJF.
    jct: optional fitted model jct(n_input, n_cached); default `miss_tokens`.
    """

    def __init__(self, lam: float = 0.0, calibrate: bool = True, jct: JCT | None = None) -> None:
        require(lam >= 0, "SRJFScheduler", "lam", lam, "use 0 (pure SRJF) or a positive weight")
        self.lam, self.calibrate, self.jct = lam, calibrate, jct or miss_tokens
        self._queue: list[_Waiting] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(
        self, req_id: Hashable, tokens: np.ndarray | list[int], now: float, cached_len: CachedLen | None = None
    ) -> None:
        """Queue a request. `cached_len` (the cache at arrival) is what plain SRJF scores by."""
        tokens = np.asarray(tokens)
        at_arrival = int(cached_len(tokens)) if cached_len is not None else 0
        self._queue.append(_Waiting(req_id, tokens, now, self._seq, at_arrival))
        self._seq += 1

    def scores(self, cached_len: CachedLen, now: float) -> np.ndarray:
        """Alg. 1 lines 5-9 for every waiting request, in queue order."""
        out = np.empty(len(self._queue))
        for i, w in enumerate(self._queue):
            cached = int(cached_len(w.tokens)) if self.calibrate else w.cached_at_arrival
            out[i] = self.jct(len(w.tokens), cached) - self.lam * (now - w.arrival)
        return out

    def pick(self, cached_len: CachedLen, now: float) -> Hashable:
        """Remove and return the request to run next (Alg. 1 lines 10-15)."""
        if not self._queue:
            raise ValueError("pick() on an empty queue: add requests first")
        scores = self.scores(cached_len, now)
        best = int(np.argmin(scores))  # argmin keeps the first (earliest queued) of equal scores
        return self._queue.pop(best).req_id

    def take(self, keep: Callable[[Hashable], bool], cost: Callable[[Hashable], int], budget: int) -> list[Hashable]:
        """Remove and return waiting requests `keep` accepts, in queue order, while their
        `cost` sums within `budget` (the mates packed with a picked request)."""
        at = set(take_waiting([w.req_id for w in self._queue], keep, cost, budget))
        taken = [w.req_id for i, w in enumerate(self._queue) if i in at]
        self._queue = [w for i, w in enumerate(self._queue) if i not in at]
        return taken


def take_waiting(
    ids: Sequence[Hashable], keep: Callable[[Hashable], bool], cost: Callable[[Hashable], int], budget: int
) -> list[int]:
    """Positions in `ids`, in order, of those `keep` accepts while their costs sum within
    `budget` (first fit: a request too large for what is left is passed over)."""
    out, used = [], 0
    for i, rid in enumerate(ids):
        if keep(rid) and used + cost(rid) <= budget:
            out.append(i)
            used += cost(rid)
    return out
