"""Planning from block hashes (issue 18): whole-block sharing, BatchLLM's shapes, collisions,
the bounded sort, and the plan stage over a real dataset (token ids stay in the blocks)."""

from __future__ import annotations

import numpy as np
import pytest

from prefixflow.bench.plan_bench import multi_level_set, shared_prefix_set
from prefixflow.pipeline import RaggedTokens, build_plan, sort_with_lcp
from prefixflow.pipeline.block_hash import HashedPrompts, block_hashes, shared_prefix, sort_hashes_with_lcp
from prefixflow.pipeline.prefix_tree import ragged_gather


def _groups(plan, replicas: int = 1) -> list:
    return [
        (g.replica, g.row_ids.tolist(), g.prefix.tolist(), [d.tolist() for d in g.distinct])
        for r in range(replicas)
        for g in plan.groups(r)
    ]


def _token_lcp(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_hash_lcp_counts_whole_blocks(block_size):
    rng = np.random.default_rng(block_size)
    stem = rng.integers(0, 5, 60).tolist()
    prompts = [stem[: rng.integers(0, 60)] + rng.integers(0, 2, rng.integers(0, 8)).tolist() for _ in range(80)]
    prompts = [p or [1] for p in prompts] + [prompts[3], prompts[3]]  # and duplicates
    tokens = RaggedTokens.from_sequences(prompts)
    hashes = block_hashes(tokens, block_size)
    order, lcp = sort_hashes_with_lcp(tokens.lengths, ragged_gather(hashes), block_size)
    assert sorted(order.tolist()) == list(range(len(prompts)))
    for k, (a, b) in enumerate(zip(order[:-1], order[1:])):
        pa_, pb = prompts[a], prompts[b]
        # Equal prompts share all; others share their common tokens rounded down to blocks.
        want = len(pa_) if pa_ == pb else _token_lcp(pa_, pb) // block_size * block_size
        assert lcp[k] == want
    # Prompts sharing a block prefix are contiguous: the LCP of any two is the minimum between.
    for i in range(0, len(order), 7):
        for j in range(i + 1, len(order), 5):
            a, b = prompts[order[i]], prompts[order[j]]
            want = len(a) if a == b else _token_lcp(a, b) // block_size * block_size
            assert lcp[i:j].min() == want


def test_bounded_sort_window_gives_the_same_order():
    # max_cells=1: one hash per row per level while many rows are undecided; the same result.
    prompts = [p.tolist() for p in shared_prefix_set(48, 40, 9, 4, seed=2)]
    tokens = RaggedTokens.from_sequences(prompts)
    gather = ragged_gather(block_hashes(tokens, 4))
    free = sort_hashes_with_lcp(tokens.lengths, gather, 4)
    bounded = sort_hashes_with_lcp(tokens.lengths, gather, 4, max_cells=1)
    assert free[0].tolist() == bounded[0].tolist() and free[1].tolist() == bounded[1].tolist()
    assert sort_with_lcp(tokens)[1].max() == 40


@pytest.mark.parametrize("order", ["batchllm", "dfs", "blendserve"])
@pytest.mark.parametrize("prefix_len, distinct_len, degree", [(2000, 200, 4), (2000, 1000, 16), (1024, 1000, 2)])
def test_batchllm_shapes_plan_the_same_from_hashes(order, prefix_len, distinct_len, degree):
    # Prefixes of whole 16-token blocks: the hash plan equals the token plan (groups, order,
    # replicas), so its saving ratios are the same.
    tokens = shared_prefix_set(64, prefix_len, distinct_len, degree, seed=1)
    outs = np.arange(64) % 9 * 20 + 1
    kwargs = dict(order=order, num_replicas=2, output_lens=outs)
    from_tokens = build_plan(tokens, **kwargs)
    from_hashes = build_plan(HashedPrompts.from_tokens(tokens, 16), **kwargs)
    assert from_hashes.table.to_pydict() == from_tokens.table.to_pydict()
    assert _groups(from_hashes, 2) == _groups(from_tokens, 2)
    for key in ("token_saving_ratio", "single_level_token_saving_ratio", "optimal_token_saving_ratio"):
        assert from_hashes.summary[key] == from_tokens.summary[key]


def test_multi_level_shape_plans_whole_blocks_and_runs_the_whole_prefix():
    # 490 + 11 shared tokens: the nested groups are the sub-categories' pairs (the 490-token
    # level reaches them through the cache), 501 tokens = 31 blocks + 5. The hash plan counts
    # the whole blocks (what a KV cache of 16-token blocks can share), the same groups form,
    # and the groups the replica gets share all 501 tokens again (the tokens settle the last
    # block).
    tokens = multi_level_set(groups=3, subcategories=8, per_sub=2)
    from_tokens = build_plan(tokens)
    from_hashes = build_plan(HashedPrompts.from_tokens(tokens, 16))
    members = lambda plan: sorted(g[1] for g in _groups(plan))  # noqa: E731
    assert members(from_hashes) == members(from_tokens)
    assert set(from_hashes.table.column("prefix_len").to_pylist()) == {496}
    assert set(from_tokens.table.column("prefix_len").to_pylist()) == {501}
    # each 490-token level computed once per group of 16 prompts, in whole blocks from hashes
    tree_tokens = 3 * 490 + 3 * 8 * 11 + 48 * (1000 - 501)
    assert from_tokens.summary["computed_prompt_tokens"] == tree_tokens
    assert from_hashes.summary["computed_prompt_tokens"] <= tree_tokens + 3 * 8 * 16
    assert _groups(from_hashes) == _groups(from_tokens)


def test_a_hash_collision_shrinks_the_prefix_to_the_real_tokens():
    # Every block of the same length hashes alike: the hashes claim that all prompts of one
    # length are equal. The replica's check finds the tokens the members really share.
    collide = lambda flat, start, count, block_size: count.astype(np.uint64)  # noqa: E731
    a, b = [1] * 8 + [2] * 8, [1] * 8 + [3] * 8
    prompts = [a + [5, 6], a + [7, 8], b + [9, 9], [4] * 18]
    plan = build_plan(HashedPrompts.from_tokens(prompts, 4, hash_fn=collide), row_ids=[10, 11, 12, 13])
    assert plan.summary["num_groups"] == 1  # the claim: one group sharing 16 tokens or more
    (group,) = plan.groups(0)
    assert group.prefix_len == 0  # [4] * 18 shares nothing with the others
    by_id = dict(zip([10, 11, 12, 13], prompts))
    for rid, distinct in zip(group.row_ids.tolist(), group.distinct):
        assert group.prefix.tolist() + distinct.tolist() == by_id[rid]
    assert shared_prefix(16, [np.array(a + [5]), np.array(a + [7])], 4) == 16
    assert shared_prefix(16, [np.array(a), np.array(b)], 4) == 8
    assert shared_prefix(16, [np.array(a), np.array(a[:12])], 4) == 12
    assert shared_prefix(8, [np.array(a + [5]), np.array(a + [7])], 4) == 11  # into the next block


def test_bad_block_size_names_the_field():
    with pytest.raises(ValueError, match="block_size=0"):
        HashedPrompts.from_tokens([[1, 2]], block_size=0)


@pytest.mark.slow
def test_plan_dataset_plans_from_hashes_in_the_blocks(ray_local):
    import pyarrow as pa

    from prefixflow.operators.stages.plan import plan_dataset

    # Three dataset blocks of tokenized rows (one an error record): the sort gathers hashes
    # from all of them, the driver never holds the token ids, groups(r) fetches them.
    rng = np.random.default_rng(4)
    stems = [rng.integers(0, 50, n).tolist() for n in (9, 14, 30)]
    prompts = [stems[i % 3] + rng.integers(0, 50, rng.integers(1, 6)).tolist() for i in range(12)]
    errors = [None] * 12
    errors[7], prompts[7] = "bad row", []
    tables = [
        pa.table(
            {
                "_pf_tokens": pa.array(prompts[lo:hi], pa.list_(pa.int32())),
                "_pf_error": pa.array(errors[lo:hi], pa.string()),
            }
        )
        for lo, hi in ((0, 5), (5, 9), (9, 12))
    ]
    planned = plan_dataset(ray_local.data.from_arrow(tables), order="batchllm", num_replicas=2, block_size=4)
    assert len(planned.rows.block_refs) == 3 and planned.error_row_ids.tolist() == [7]
    good = [i for i in range(12) if i != 7]
    expected = build_plan(
        HashedPrompts.from_tokens([prompts[i] for i in good], 4), row_ids=good, order="batchllm", num_replicas=2
    )
    assert planned.plan.tokens is None  # the driver never gathered the token ids
    assert planned.plan.table.to_pydict() == expected.table.to_pydict()
    assert _groups(planned.plan, 2) == _groups(expected, 2)
    assert planned.plan.summary["token_saving_ratio"] > 0


def test_plan_bench_stream_plans_in_windows_and_keeps_what_the_driver_keeps():
    from prefixflow.bench.plan_bench import measure_stream

    r = measure_stream(20_000, 4_000, replicas=2)
    # windows of 250, 500, 1,000, 2,000, 4,000, 4,000, 4,000, 4,000 and the last 250 rows
    assert r["num_windows"] == 9 and r["num_prompts"] == 20_000
    assert r["kept_across_windows_bytes"] >= 8 * 20_000  # each row's id, in its unit
    assert 0 < r["token_saving_ratio"] < 1 and r["peak_process_rss_bytes"] >= r["rss_before_plan_bytes"]
    # The prefix homes are kept too, bounded by replicas x cache blocks (20 bytes a block).
    assert 0 < r["prefix_homes_bytes"] <= 2 * 29_206 * 20
