"""AlignedServe's Density First Search over the KV-length quad-tree (Sec. 3.3, 3.5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.engine.native.alignedserve import DensityFirstBatcher


def blocks_of(kv_lens: np.ndarray, block_size: int) -> np.ndarray:
    return np.maximum(-(-np.minimum(kv_lens, 65535) // block_size), 1)


@given(
    st.lists(st.integers(1, 70000), min_size=0, max_size=300),
    st.integers(1, 4000),
    st.integers(1, 64),
    st.sampled_from([1, 16]),
)
@settings(max_examples=200, deadline=None)
def test_batches_respect_memory_and_minimum_size(kv_lens, max_blocks, min_requests, block_size):
    lens = np.array(kv_lens, dtype=np.int64)
    batcher = DensityFirstBatcher(max_blocks, min_requests, block_size=block_size)
    batch = batcher.select(lens, now=0.0)
    blocks = blocks_of(lens, block_size)
    assert len(set(batch.tolist())) == len(batch)
    assert blocks[batch].sum() <= max_blocks
    # The shortest min_requests requests are the cheapest set of that size: if they fit, a
    # batch of at least min_requests exists and must be found.
    cheapest = np.sort(blocks)[:min_requests]
    if len(lens) >= min_requests and cheapest.sum() <= max_blocks:
        assert len(batch) >= min_requests
    elif len(lens) and blocks.min() <= max_blocks:
        assert len(batch) >= 1


def test_batch_comes_from_the_densest_length_range():
    rng = np.random.default_rng(0)
    dense = rng.integers(1000, 1100, 200)  # many requests of similar length
    sparse = rng.integers(100, 60000, 20)  # a few spread over the range
    lens = np.r_[sparse, dense]
    batcher = DensityFirstBatcher(max_blocks=4000, min_requests=36, block_size=16)
    batch = batcher.select(lens, now=0.0)
    assert len(batch) >= 36
    assert blocks_of(lens[batch], 16).sum() <= 4000
    picked = lens[batch]
    assert picked.max() - picked.min() < 1100  # similar lengths, not FCFS's spread
    assert np.mean((picked >= 1000) & (picked < 1100)) > 0.9


def test_few_requests_widen_towards_the_closest_lengths():
    lens = np.array([100, 105, 110, 5000, 5100, 9000])
    batch = DensityFirstBatcher(max_blocks=10_000, min_requests=3, block_size=1).select(lens, 0.0)
    assert sorted(lens[batch].tolist())[:3] == [100, 105, 110] or len(batch) == len(lens)
    tight = DensityFirstBatcher(max_blocks=400, min_requests=3, block_size=1).select(lens, 0.0)
    assert sorted(lens[tight].tolist()) == [100, 105, 110]


def test_starved_range_is_served_after_the_threshold():
    rng = np.random.default_rng(1)
    lonely = np.array([30000])
    batcher = DensityFirstBatcher(max_blocks=2000, min_requests=8, block_size=16, starvation_s=10.0)
    served_at = None
    for step in range(30):
        crowd = rng.integers(500, 600, 100)  # new similar requests keep arriving
        lens = np.r_[lonely, crowd]
        batch = batcher.select(lens, now=float(step))
        if 0 in batch.tolist():
            served_at = step
            break
    assert served_at is not None and 10 < served_at <= 12


def test_ids_and_bad_arguments():
    batcher = DensityFirstBatcher(max_blocks=100, min_requests=2, block_size=16)
    ids = np.array([70, 71, 72])
    assert sorted(batcher.select(np.array([16, 16, 32]), 0.0, ids=ids).tolist()) == [70, 71, 72]
    assert batcher.select(np.zeros(0, dtype=np.int64), 0.0).tolist() == []
    with pytest.raises(ValueError, match="min_requests=0"):
        DensityFirstBatcher(max_blocks=10, min_requests=0)
    with pytest.raises(ValueError, match="max_requests=2"):
        DensityFirstBatcher(max_blocks=10, min_requests=3, max_requests=2)


@given(st.lists(st.integers(1, 5000), min_size=0, max_size=200), st.integers(1, 40))
@settings(max_examples=100, deadline=None)
def test_request_cap_gives_full_batches_of_close_lengths(kv_lens, cap):
    # The engine's use: memory never binds, the step takes `cap` decodes.
    lens = np.array(kv_lens, dtype=np.int64)
    batcher = DensityFirstBatcher(max_blocks=1 << 40, min_requests=cap, max_requests=cap, block_size=16)
    batch = batcher.select(lens, now=0.0)
    assert len(set(batch.tolist())) == len(batch) == min(cap, len(lens))


def test_request_cap_picks_the_dense_range_not_the_spread():
    lens = np.r_[np.arange(1000, 1008), [10, 3000, 9000, 20000]]
    batch = DensityFirstBatcher(max_blocks=1 << 40, min_requests=8, max_requests=8, block_size=16).select(lens, 0.0)
    assert sorted(lens[batch].tolist()) == list(range(1000, 1008))


def test_step_price_counts_the_bubble_of_the_longest_kv_read():
    from prefixflow.pipeline.cost_model import LLAMA3_8B, CostModel

    cm = CostModel.create(LLAMA3_8B, "h100")
    m, bw = LLAMA3_8B, cm.hardware.mem_bandwidth
    weights = (m.layer_params + m.hidden_size * m.vocab_size) * m.dtype_bytes / bw  # decode: memory-bound
    kv = m.kv_bytes_per_token / bw
    assert cm.step_seconds([100, 1000], bubbles=False) == pytest.approx(weights + 1100 * kv)
    assert cm.step_seconds([100, 1000], bubbles=True) == pytest.approx(weights + 2000 * kv)
    # Same work, aligned into two steps of similar lengths: cheaper with bubbles, equal without.
    mixed = 2 * cm.step_seconds([100, 1000])
    aligned = cm.step_seconds([100, 100]) + cm.step_seconds([1000, 1000])
    assert aligned < mixed
    assert 2 * cm.step_seconds([100, 1000], bubbles=False) == pytest.approx(
        cm.step_seconds([100, 100], bubbles=False) + cm.step_seconds([1000, 1000], bubbles=False)
    )
    # A big prefill chunk is compute-bound: its FLOPs set the price.
    big = cm.step_seconds([], [(0, 8192)])
    assert big > weights and big == pytest.approx(
        cm.compute_seconds(8192, 0) + 2 * m.hidden_size * m.vocab_size / cm.hardware.peak_flops
    )
