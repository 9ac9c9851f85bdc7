"""Planner properties on random prompt sets (hypothesis) and against brute force."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.pipeline import RaggedTokens, build_plan, sort_with_lcp
from prefixflow.pipeline.block_hash import HashedPrompts
from prefixflow.pipeline.grouping import first_level_saved_tokens, maximize_reuse
from prefixflow.pipeline.prefix_tree import PrefixTree


@st.composite
def prompt_sets(draw, max_prompts: int = 24, vocab: int = 3):
    """Prompts built from a few shared stems, so that the tree has several levels."""
    stems = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=40), min_size=1, max_size=4))
    n = draw(st.integers(1, max_prompts))
    prompts = []
    for _ in range(n):
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        tail = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
        prompt = stem[:cut] + tail
        prompts.append(prompt or [0])
    return prompts


def lcp_of(prompts: list[list[int]]) -> int:
    k, shortest = 0, min(len(p) for p in prompts)
    while k < shortest and all(p[k] == prompts[0][k] for p in prompts):
        k += 1
    return k


@given(prompt_sets(), st.sampled_from([1, 2, 5, 32]))
@settings(max_examples=150, deadline=None)
def test_sort_and_lcp_are_exact(prompts, block):
    order, lcp = sort_with_lcp(RaggedTokens.from_sequences(prompts), block)
    ordered = [prompts[i] for i in order]
    assert ordered == sorted(prompts)
    assert sorted(order.tolist()) == list(range(len(prompts)))
    assert lcp.tolist() == [lcp_of([a, b]) for a, b in zip(ordered, ordered[1:])]


@given(prompt_sets(), st.sampled_from(["fcfs", "dfs", "batchllm", "blendserve"]), st.integers(1, 4))
@settings(max_examples=120, deadline=None)
def test_plan_covers_every_row_once_and_prefixes_are_shared(prompts, order, replicas):
    row_ids = np.arange(len(prompts)) * 7 + 3
    plan = build_plan(prompts, row_ids=row_ids, order=order, num_replicas=replicas)
    table = plan.table
    assert sorted(table.column("row_id").to_pylist()) == sorted(row_ids.tolist())
    seen = []
    by_id = dict(zip(row_ids.tolist(), prompts))
    for r in range(replicas):
        ranks = plan.replica_table(r).column("rank").to_pylist()
        assert ranks == list(range(len(ranks)))
        for group in plan.groups(r):
            for rid, distinct in zip(group.row_ids.tolist(), group.distinct):
                seen.append(rid)
                assert list(group.prefix) + list(distinct) == by_id[rid]
            if group.num_members > 1:
                assert group.prefix_len <= lcp_of([by_id[i] for i in group.row_ids.tolist()])
            else:
                assert group.prefix_len == 0
    assert sorted(seen) == sorted(row_ids.tolist())
    assert len(seen) == len(set(seen))
    s = plan.summary
    assert s["num_rows"] == len(prompts)
    assert s["prompt_tokens"] == sum(len(p) for p in prompts)


def _plan_view(plan, replicas: int) -> list:
    return [plan.table.to_pydict()] + [
        (g.group_id, g.replica, g.row_ids.tolist(), g.prefix.tolist(), [d.tolist() for d in g.distinct])
        for r in range(replicas)
        for g in plan.groups(r)
    ]


@given(prompt_sets(), st.sampled_from(["fcfs", "dfs", "batchllm", "blendserve"]), st.integers(1, 3), st.booleans())
@settings(max_examples=50, deadline=None)
def test_plan_from_block_hashes_equals_plan_from_tokens(prompts, order, replicas, with_outputs):
    # Blocks of one token: the hashes hold everything the tokens do, so the plans are equal
    # (groups, order, replicas), though the hash sort puts prompts in another order.
    outs = [(7 * i) % 50 for i in range(len(prompts))] if with_outputs else None
    kwargs = dict(order=order, num_replicas=replicas, output_lens=outs, row_ids=np.arange(len(prompts)) + 5)
    from_tokens = build_plan(prompts, **kwargs)
    from_hashes = build_plan(HashedPrompts.from_tokens(prompts, block_size=1), **kwargs)
    assert _plan_view(from_hashes, replicas) == _plan_view(from_tokens, replicas)
    assert from_hashes.summary["token_saving_ratio"] == from_tokens.summary["token_saving_ratio"]


@given(prompt_sets())
@settings(max_examples=150, deadline=None)
def test_enlarged_first_level_is_bounded_by_plain_first_level_and_multilevel_optimum(prompts):
    tree = PrefixTree.build(RaggedTokens.from_sequences(prompts), block=4)
    grouping = maximize_reuse(tree)
    optimum = sum(map(len, prompts)) - tree.tree_tokens()
    assert first_level_saved_tokens(tree) <= grouping.saved_tokens <= optimum
    s = build_plan(prompts, order="fcfs").summary
    assert (
        s["first_level_token_saving_ratio"]
        <= s["single_level_token_saving_ratio"]
        <= s["optimal_token_saving_ratio"] + 1e-12
    )


@given(prompt_sets(), st.integers(1, 3))
@settings(max_examples=150, deadline=None)
def test_batchllm_plan_computes_every_edge_of_the_tree_once(prompts, replicas):
    # Nested groups run depth first: each distinct prompt token once (the tree's multi-level
    # optimum), plus the last token of a prompt that another prompt extends or repeats (the
    # engine computes it to sample from), plus each extra replica's recomputed path.
    tree = PrefixTree.build(RaggedTokens.from_sequences(prompts))
    covered = sum(1 for i, p in enumerate(prompts) if any(j != i and q[: len(p)] == p for j, q in enumerate(prompts)))
    plan = build_plan(prompts, order="batchllm", num_replicas=replicas)
    computed = plan.summary["computed_prompt_tokens"]
    assert tree.tree_tokens() <= computed
    if replicas == 1:
        assert computed <= tree.tree_tokens() + covered
    assert plan.summary["token_saving_ratio"] >= 0.0


def test_batchllm_plan_shares_every_level_of_a_conversation():
    # Turn k+1 extends turn k: one level of groups recomputes each earlier turn in every later
    # one; nested groups compute each turn's new tokens once.
    rng = np.random.default_rng(1)
    system = rng.integers(0, 500, 64).tolist()
    prompts = []
    for chat in range(5):
        turn = system + rng.integers(0, 500, 20).tolist()
        for _ in range(4):
            prompts.append(list(turn))
            turn = turn + rng.integers(0, 500, 48).tolist()
    order = rng.permutation(len(prompts))
    plan = build_plan([prompts[i] for i in order], order="batchllm", output_lens=[16] * len(prompts))
    s = plan.summary
    tree_tokens = 64 + 5 * (20 + 3 * 48)
    # every turn but the last of each chat is a prefix of the next: its last token once more
    assert s["computed_prompt_tokens"] <= tree_tokens + 15
    assert s["single_level_token_saving_ratio"] < s["token_saving_ratio"] <= s["optimal_token_saving_ratio"]


def _partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1 :]
        yield [[first]] + part


def brute_force_single_level(prompts: list[list[int]], min_prefix_len: int = 1) -> int:
    """Best sum over groups of (members - 1) * common prefix, over all set partitions whose
    groups of two or more share at least min_prefix_len tokens."""
    best = 0
    for part in _partitions(list(range(len(prompts)))):
        shared = [lcp_of([prompts[i] for i in g]) for g in part if len(g) > 1]
        if all(s >= min_prefix_len for s in shared):
            best = max(best, sum((len(g) - 1) * s for g, s in zip([g for g in part if len(g) > 1], shared)))
    return best


@given(prompt_sets(max_prompts=7, vocab=2), st.sampled_from([1, 1, 3, 6]))
@settings(max_examples=150, deadline=None)
def test_enlarged_grouping_equals_brute_force_optimum_on_small_trees(prompts, min_prefix_len):
    tree = PrefixTree.build(RaggedTokens.from_sequences(prompts), block=2)
    grouping = maximize_reuse(tree, min_prefix_len)
    assert grouping.saved_tokens == brute_force_single_level(prompts, min_prefix_len)
    assert np.all((grouping.prefix_len == 0) | (grouping.prefix_len >= min_prefix_len))


def test_orders_differ_as_documented():
    rng = np.random.default_rng(0)
    long_prefix, short_prefix = rng.integers(0, 50, 300).tolist(), rng.integers(50, 99, 20).tolist()
    prompts = []
    for i in range(6):  # interleaved input: two families
        prompts.append(long_prefix + [100 + i])
        prompts.append(short_prefix + [200 + i])
    fcfs = build_plan(prompts, order="fcfs")
    batch = build_plan(prompts, order="batchllm")
    dfs = build_plan(prompts, order="dfs")
    assert fcfs.table.column("row_id").to_pylist() == list(range(12))
    assert fcfs.summary["token_saving_ratio"] == 0.0  # interleaving breaks every run
    assert batch.summary["num_groups"] == 2
    # Eq. 3: the family with fewer prefill tokens runs first.
    assert batch.groups(0)[0].prefix_len == 20
    # DFS: heaviest subtree first.
    assert dfs.groups(0)[0].prefix_len == 300
    assert batch.summary["token_saving_ratio"] == pytest.approx(dfs.summary["token_saving_ratio"])


def test_output_length_estimates_reorder_groups():
    a, b = [1] * 50, [2] * 50
    prompts = [a + [3], a + [4], b + [5], b + [6]]
    # Group b expects long outputs: R_group = sum L_decode / prefill puts it first (Eq. 2).
    plan = build_plan(prompts, output_lens=[1, 1, 100, 100])
    assert plan.groups(0)[0].row_ids.tolist() == [2, 3]
    assert plan.table.column("output_len").to_pylist()[:2] == [100, 100]


def test_arrow_input_is_a_zero_copy_view():
    values = pa.array(np.arange(12, dtype=np.int32))
    arr = pa.ListArray.from_arrays(pa.array([0, 4, 8, 12], pa.int32()), values)
    tokens = RaggedTokens.from_sequences(arr)
    assert tokens.flat.ctypes.data == values.buffers()[1].address
    sliced = RaggedTokens.from_sequences(arr.slice(1, 2))
    assert sliced[0].tolist() == [4, 5, 6, 7] and len(sliced) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"row_ids": [1, 1]}, "unique"),
        ({"row_ids": [1]}, "one id per prompt"),
        ({"order": "lifo"}, "order='lifo'"),
        ({"num_replicas": 0}, "num_replicas=0"),
        ({"output_lens": [1, -2]}, "non-negative, or -1"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_plan([[1, 2], [1, 3]], **kwargs)


def test_empty_prompts_are_planned_alone():
    # The planner never drops a row: an empty prompt is a group of one, and the engine turns it
    # into an error record.
    plan = build_plan([[1, 2], [], [1, 2], []], row_ids=[10, 11, 12, 13])
    assert sorted(plan.table.column("row_id").to_pylist()) == [10, 11, 12, 13]
    empty = [g for g in plan.groups(0) if g.prompt_tokens() == 0]
    assert sorted(int(g.row_ids[0]) for g in empty) == [11, 13]
    assert all(g.num_members == 1 for g in empty)


def test_unknown_output_lengths_are_estimated_within_their_subtree():
    a, b = [1] * 40, [2] * 40
    prompts = [a + [3], a + [4], a + [5], b + [6], b + [7]]
    plan = build_plan(prompts, output_lens=[200, -1, 200, 1, -1])
    # Row 1 borrows its siblings' 200 and row 4 its sibling's 1, so family a runs first.
    assert plan.groups(0)[0].row_ids.tolist() == [0, 1, 2]
    table = plan.table.to_pydict()
    assert dict(zip(table["row_id"], table["output_len"]))[1] is None


def _chats(num_chats: int = 6, turns: int = 6, seed: int = 0) -> tuple[list[list[int]], np.ndarray]:
    """Chats under one system prompt, each turn its prompt (the whole history), rows shuffled;
    returns (prompts, chat of each row)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1000, 2000, 32).tolist()
    prompts, chat_of = [], []
    for c in range(num_chats):
        history = system + [c + 3]
        for _ in range(turns):
            history = history + rng.integers(3, 999, 40).tolist()
            prompts.append(list(history))
            chat_of.append(c)
    perm = rng.permutation(len(prompts))
    return [prompts[i] for i in perm], np.asarray(chat_of)[perm]


def test_a_small_job_keeps_each_chat_together_across_replicas():
    """A job so small that one chat spans several partition units (a unit is 1/32 of a
    replica's share): the units of a chat stay one family in the scan, so a replica boundary
    splits at most the chats where the dual scan's two ends stop, not every chat (each piece
    would compute the chat's history again). Never more than the single-level plan computes."""
    prompts, chat_of = _chats()
    plan = build_plan(prompts, num_replicas=2, min_prefix_len=16)
    s = plan.summary
    replica = np.empty(len(prompts), dtype=np.int64)
    replica[plan.table.column("row_id").to_numpy()] = plan.table.column("replica").to_numpy()
    split = [len(set(replica[chat_of == c].tolist())) > 1 for c in range(6)]
    assert sum(split) <= 2
    assert s["batchllm_plan"] == "nested"
    assert s["token_saving_ratio"] > s["single_level_token_saving_ratio"]
    one = build_plan(prompts, num_replicas=1, min_prefix_len=16).summary["computed_prompt_tokens"]
    assert s["computed_prompt_tokens"] <= one + 2 * (32 + 6 * 40)  # at most two histories again
