"""PrefillOnly's SRJF with continuous JCT calibration (Sec. 6.2-6.3, Alg. 1)."""

from __future__ import annotations

import numpy as np
import pytest

from prefixflow.engine.scoring.srjf import SRJFScheduler


class OneRequestCache:
    """The paper's setting: the prefix cache holds the state of one request, the last run."""

    def __init__(self) -> None:
        self.tokens = np.zeros(0, dtype=np.int64)

    def cached_len(self, tokens: np.ndarray) -> int:
        n = min(len(tokens), len(self.tokens))
        diff = np.flatnonzero(tokens[:n] != self.tokens[:n])
        return int(diff[0]) if len(diff) else n

    def run(self, tokens: np.ndarray) -> bool:
        hit = self.cached_len(tokens) > 0
        self.tokens = tokens
        return hit


def abcd() -> dict[str, np.ndarray]:
    """A < C < B < D in length; A and D share a prefix, and so do B and C (Sec. 6.2)."""
    p1, p2 = np.arange(30), np.arange(1000, 1005)
    return {
        "A": np.r_[p1, 500],
        "B": np.r_[p2, np.arange(2000, 2040)],
        "C": np.r_[p2, np.arange(3000, 3030)],
        "D": np.r_[p1, np.arange(4000, 4030)],
    }


def run_all(picker) -> tuple[list[str], int]:
    reqs, cache, order, hits = abcd(), OneRequestCache(), [], 0
    queue = picker(reqs, cache)
    while True:
        name = queue(cache)
        if name is None:
            return order, hits
        order.append(name)
        hits += cache.run(reqs[name])


def srjf(calibrate: bool):
    def picker(reqs, cache):
        sched = SRJFScheduler(calibrate=calibrate)
        for name in "ABCD":
            sched.add(name, reqs[name], now=0.0, cached_len=cache.cached_len)
        return lambda c: sched.pick(c.cached_len, now=1.0) if len(sched) else None

    return picker


def fifo(reqs, cache):
    names = list("ABCD")
    return lambda c: names.pop(0) if names else None


def test_calibrated_srjf_reproduces_the_paper_example():
    lengths = {k: len(v) for k, v in abcd().items()}
    assert lengths["A"] < lengths["C"] < lengths["B"] < lengths["D"]
    assert run_all(fifo) == (list("ABCD"), 1)
    assert run_all(srjf(calibrate=False)) == (list("ACBD"), 1)
    assert run_all(srjf(calibrate=True)) == (list("ADCB"), 2)


def test_queueing_time_prevents_starvation():
    cache = OneRequestCache()
    sched = SRJFScheduler(lam=1.0)
    sched.add("old-long", np.arange(100), now=0.0)
    sched.add("new-short", np.arange(1000, 1010), now=95.0)
    # score(old) = 100 - 100 = 0 < score(new) = 10 - 5 = 5
    assert sched.pick(cache.cached_len, now=100.0) == "old-long"
    plain = SRJFScheduler(lam=0.0)
    plain.add("old-long", np.arange(100), now=0.0)
    plain.add("new-short", np.arange(1000, 1010), now=95.0)
    assert plain.pick(cache.cached_len, now=100.0) == "new-short"


def test_fitted_jct_model_and_errors():
    sched = SRJFScheduler(jct=lambda n_input, n_cached: 2.0 * n_input - n_cached)
    sched.add(1, np.arange(10), now=0.0)
    sched.add(2, np.arange(100, 108), now=0.0)
    assert sched.scores(lambda t: 0, now=0.0).tolist() == [20.0, 16.0]
    assert sched.pick(lambda t: 0, now=0.0) == 2
    with pytest.raises(ValueError, match="lam=-1"):
        SRJFScheduler(lam=-1)
    with pytest.raises(ValueError, match="empty queue"):
        SRJFScheduler().pick(lambda t: 0, now=0.0)
