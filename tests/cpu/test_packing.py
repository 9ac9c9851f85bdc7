"""Prepacking: first-fit decreasing bins and the varlen metadata (Prepacking Sec. 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.pipeline.packing import first_fit_decreasing, pack


@given(st.lists(st.integers(1, 64), min_size=1, max_size=60), st.sampled_from([None, 64, 100]))
@settings(max_examples=150, deadline=None)
def test_bins_never_overflow_and_metadata_rebuilds_prompts(lengths, bin_size):
    lengths = np.array(lengths)
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(0, 1000, n) for n in lengths]
    packed = pack(lengths, bin_size)
    size = packed.bin_size
    assert size == (bin_size or lengths.max())
    assert np.all(packed.bin_lengths() <= size)
    assert sorted(packed.prompt_order.tolist()) == list(range(len(lengths)))
    assert packed.num_bins <= len(lengths)
    # cu_seqlens, restart positions and segment ids rebuild every prompt.
    stream = packed.pack_tokens(prompts)
    for k, i in enumerate(packed.prompt_order.tolist()):
        lo, hi = packed.cu_seqlens[k], packed.cu_seqlens[k + 1]
        np.testing.assert_array_equal(stream[lo:hi], prompts[i])
        np.testing.assert_array_equal(packed.position_ids[lo:hi], np.arange(lengths[i]))
        assert np.all(packed.segment_ids[lo:hi] == k)
    # Restart points: each prompt starts inside its bin where the previous one ended.
    for b in range(packed.num_bins):
        members = range(packed.bin_ptr[b], packed.bin_ptr[b + 1])
        starts = [packed.start_in_bin[k] for k in members]
        ends = np.cumsum([0] + [lengths[packed.prompt_order[k]] for k in members])
        assert starts == ends[:-1].tolist()
    grid = packed.padded(packed.position_ids, pad=-1)
    assert grid.shape == (packed.num_bins, size)
    assert packed.padding_tokens() == int((grid == -1).sum())


def test_first_fit_decreasing_textbook_example():
    # Sorted 8, 7, 5, 4, 3, 2, 1 into bins of 10: {8, 2}, {7, 3}, {5, 4, 1}.
    assign = first_fit_decreasing(np.array([5, 8, 1, 7, 4, 2, 3]), 10)
    bins = {}
    for length, b in zip([5, 8, 1, 7, 4, 2, 3], assign.tolist()):
        bins.setdefault(b, []).append(length)
    assert sorted(sorted(v) for v in bins.values()) == [[1, 4, 5], [2, 8], [3, 7]]


def test_packing_beats_padding_on_varied_lengths():
    lengths = np.array([100, 10, 20, 30, 40, 50, 60, 90, 80, 70])
    packed = pack(lengths)
    assert packed.num_bins < len(lengths)
    assert packed.padding_tokens() < len(lengths) * lengths.max() - lengths.sum()
    assert packed.cu_seqlens.dtype == np.int32


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="bin_size=5"):
        pack(np.array([3, 9]), bin_size=5)
    with pytest.raises(ValueError, match="positive"):
        pack(np.array([3, 0]))
