"""Prefix homes (pipeline/homes.py): which replica holds which blocks from a job's earlier
windows, and the plan that sends a later window's units there (issue 39)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.bench.stream_bench import ReplicaCaches
from prefixflow.pipeline import build_plan
from prefixflow.pipeline.block_hash import HashedPrompts, block_hashes
from prefixflow.pipeline.homes import PrefixHomes, homes_of
from prefixflow.pipeline.partition import Affinity, partition_runs
from prefixflow.pipeline.ragged import RaggedTokens

BLOCK = 4


def _hashed(prompts: list[list[int]]) -> HashedPrompts:
    return HashedPrompts.from_tokens(prompts, BLOCK)


def _ran(homes: PrefixHomes, prompts: list[list[int]], replicas: list[int]) -> PrefixHomes:
    """The homes once `prompts` ran, prompt i on replicas[i], in that order."""
    return homes.after(_hashed(prompts), np.asarray(replicas), np.arange(len(prompts)))


def test_a_row_finds_the_whole_blocks_of_its_prefix_and_the_replicas_that_hold_them():
    doc, other = list(range(100, 118)), list(range(200, 218))  # 18 tokens: 4 whole blocks
    homes = _ran(PrefixHomes.empty(3, 1000), [doc + [1, 2], other + [3], doc + [5, 6, 7]], [1, 2, 0])
    hits = homes.find(_hashed([doc + [9, 9, 9], other + [4, 4], [7] * 9, doc[:8]]))
    # doc's 4 whole blocks (16 tokens) are on replicas 0 and 1; other's on replica 2; a prompt
    # seen nowhere finds nothing; a prompt that is a whole prefix keeps its last token to compute.
    assert hits.hit.tolist() == [16, 16, 0, 4]
    pairs = sorted(zip(hits.pair_row.tolist(), hits.pair_replica.tolist()))
    assert pairs == [(0, 0), (0, 1), (1, 2), (3, 0), (3, 1)]
    assert not hits.everywhere.any()
    assert hits.first_home(4).tolist() == [0, 2, -1, 0]
    assert hits.on_replica(np.array([1, 0, 0, 2])).tolist() == [True, False, False, False]


def test_a_prefix_on_every_replica_is_found_everywhere():
    system = list(range(50, 66))
    homes = _ran(PrefixHomes.empty(2, 1000), [system + [1], system + [2]], [0, 1])
    hits = homes.find(_hashed([system + [3, 4]]))
    assert hits.hit.tolist() == [16] and hits.everywhere.tolist() == [True]
    assert len(hits.pair_row) == 0 and hits.on_replica(np.array([1])).tolist() == [True]


def test_each_replica_keeps_its_latest_blocks_up_to_its_capacity():
    old, new = list(range(300, 316)), list(range(400, 416))  # 4 blocks each
    homes = _ran(PrefixHomes.empty(2, 5), [old, new], [0, 0])
    assert homes.num_blocks == 5  # the later prompt's 4 blocks and one of the older's
    hits = homes.find(_hashed([new + [1], old + [1]]))
    assert hits.hit.tolist()[0] == 16  # the latest are kept whole
    assert hits.hit.tolist()[1] < 16  # the oldest went first
    again = _ran(homes, [old], [0])  # used again: now the latest
    assert again.find(_hashed([old + [1]])).hit.tolist() == [16]
    assert (again.replica == 0).sum() <= 5


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 4), st.integers(0, 30))
@settings(max_examples=60, deadline=None)
def test_the_homes_never_hold_more_than_their_capacity_per_replica(docs, replicas, capacity):
    prompts = [[d] * 10 + [i] for i, d in enumerate(docs)]
    homes = PrefixHomes.empty(replicas, capacity)
    for lo in range(0, len(prompts), 7):
        window = prompts[lo : lo + 7]
        homes = _ran(homes, window, [i % replicas for i in range(len(window))])
        assert np.bincount(homes.replica, minlength=replicas).max(initial=0) <= capacity
        keys = list(zip(homes.hashes.tolist(), homes.replica.tolist()))
        assert keys == sorted(set(keys))  # one entry per (hash, replica), sorted for the lookup


def test_a_run_goes_to_its_home_within_the_replicas_share():
    starts = np.arange(9, dtype=np.int64)  # 8 runs of one row, equal cost
    comp, mem = np.ones(8), np.ones(8)
    home = np.array([3, 3, 3, 3, 3, -1, -1, -1])  # five runs want replica 3: its share is 2
    part = partition_runs(
        starts, comp, mem, np.zeros(8), np.zeros(8, np.int64), 4, affinity=Affinity(home, np.full(8, 0.5) * (home >= 0))
    )
    replica_of = dict(zip(part.part_run.tolist(), part.part_replica.tolist()))
    assert sorted(replica_of) == list(range(8))
    assert sum(1 for r in range(5) if replica_of[r] == 3) >= 2  # the room a fair share leaves
    assert np.bincount(part.part_replica, minlength=4).max() <= 3


def _docs(seed: int, n: int) -> list[list[int]]:
    """n rows of 6 documents (40 tokens each) asked short questions, in random order."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1000, 40).tolist() for _ in range(6)]
    return [docs[int(rng.integers(0, 6))] + rng.integers(0, 1000, 6).tolist() for _ in range(n)]


def _windows(prompts: list[list[int]], size: int, homes: PrefixHomes | None) -> tuple[list, int, int]:
    """(plans, tokens the plans compute, tokens engines with unbounded caches compute)."""
    caches, plans, computed = ReplicaCaches(2, BLOCK), [], 0
    for lo in range(0, len(prompts), size):
        rows = prompts[lo : lo + size]
        plan = build_plan(_hashed(rows), num_replicas=2, min_prefix_len=BLOCK, stealing=True, homes=homes)
        homes = homes_of(plan, homes) if homes is not None else None
        replica = np.zeros(len(rows), dtype=np.int64)
        replica[plan.seq_index] = plan.table.column("replica").to_numpy()
        ragged = RaggedTokens.from_sequences(rows)
        caches.run(block_hashes(ragged, BLOCK), ragged.lengths, replica)
        plans.append(plan)
        computed += int(plan.summary["computed_prompt_tokens"])
    return plans, computed, caches.computed


def test_later_windows_go_where_their_documents_are_and_count_what_they_find_there():
    prompts = _docs(0, 120)
    plans, computed, simulated = _windows(prompts, 30, PrefixHomes.empty(2, 10_000))
    _, alone, alone_simulated = _windows(prompts, 30, None)
    for plan in plans:  # every row once
        assert sorted(plan.table.column("row_id").to_pylist()) == list(range(plan.summary["num_rows"]))
    assert plans[0].summary["home_hit_tokens"] == 0  # nothing before the first window
    assert sum(p.summary["home_hit_tokens"] for p in plans[1:]) > 0
    # Each document is prefilled about once per replica that holds it, not once per window.
    assert computed < alone and simulated < alone_simulated
    # The plan's count is what engines that keep their blocks compute, give or take the
    # members' partial last prefix block (a group shares it; a cache of whole blocks does not).
    assert simulated == pytest.approx(computed, rel=0.1)


def test_documents_held_by_different_replicas_go_home_though_they_share_a_long_system_prompt():
    """In a small window (a windowed job's first ones) a long system prompt costs more than a
    unit's share, so a cut below it joins the documents' units into one family, which has one
    home: a family must not join documents whose homes differ, or half of them leave the
    replica that holds their prefix (multilevel._costly_cuts)."""
    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 64).tolist()
    docs = [system + rng.integers(0, 1000, 40).tolist() for _ in range(4)]
    home_of = [0, 0, 1, 1]
    homes = _ran(PrefixHomes.empty(2, 10_000), docs, home_of)  # an earlier window ran each document once
    rows = [docs[d] + rng.integers(0, 1000, 6).tolist() for d in rng.permutation(np.repeat(np.arange(4), 3))]
    doc_of = [next(d for d in range(4) if r[: len(docs[d])] == docs[d]) for r in rows]
    plan = build_plan(_hashed(rows), num_replicas=2, min_prefix_len=BLOCK, stealing=True, homes=homes)
    replica = np.zeros(len(rows), dtype=np.int64)
    replica[plan.seq_index] = plan.table.column("replica").to_numpy()
    assert [int(replica[i]) for i in range(len(rows))] == [home_of[d] for d in doc_of]
    # What the rows find there is counted: on each replica the first row finds the system prompt
    # and its document (104 tokens, whole blocks), the other document's first row that document
    # past the system prompt; every other row shares its prefix with the row before it.
    assert plan.summary["home_hit_tokens"] == 2 * (len(docs[0]) + 40)


@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=30), min_size=1, max_size=12), st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_the_lookup_where_the_hashes_are_finds_what_the_walk_through_gather_finds(prompts, replicas):
    import dataclasses

    homes = _ran(PrefixHomes.empty(replicas, 50), prompts[::2], [i % replicas for i in range(len(prompts[::2]))])
    hashed = _hashed(prompts)
    walked = homes.find(dataclasses.replace(hashed, find_leading=None))
    looked = homes.find(hashed)
    assert looked.hit.tolist() == walked.hit.tolist()
    assert looked.everywhere.tolist() == walked.everywhere.tolist()
    assert sorted(zip(looked.pair_row.tolist(), looked.pair_replica.tolist())) == sorted(
        zip(walked.pair_row.tolist(), walked.pair_replica.tolist())
    )


@given(
    st.integers(0, 10_000),
    st.integers(1, 4),
    st.integers(1, 3),
    st.lists(st.integers(1, 40), min_size=2, max_size=5),
)
@settings(max_examples=40, deadline=None)
def test_windows_with_homes_place_every_row_once_on_a_replica_of_the_job(seed, replicas, num_docs, window_sizes):
    """Windows of documents under a shared system prompt (families joined by it, split by their
    homes, placed home whole or run by run): each window's plan holds every row once, on
    replicas of the job, and counts no more home hits than its rows' prompts hold."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1000, int(rng.integers(0, 40))).tolist()
    docs = [system + rng.integers(0, 1000, int(rng.integers(4, 60))).tolist() for _ in range(num_docs)]
    homes = PrefixHomes.empty(replicas, int(rng.integers(1, 200)))
    for size in window_sizes:
        rows = [
            docs[int(rng.integers(0, num_docs))] + rng.integers(0, 1000, int(rng.integers(0, 9))).tolist()
            for _ in range(size)
        ]
        plan = build_plan(_hashed(rows), num_replicas=replicas, min_prefix_len=BLOCK, stealing=True, homes=homes)
        assert sorted(plan.table.column("row_id").to_pylist()) == list(range(size))
        assert set(plan.table.column("replica").to_pylist()) <= set(range(replicas))
        assert 0 <= plan.summary["home_hit_tokens"] <= sum(len(r) - 1 for r in rows)
        homes = homes_of(plan, homes)


def test_the_homes_hold_every_whole_block_of_group_members_and_prompts_run_whole():
    doc = list(range(500, 524))  # 6 blocks
    window = [doc + [1] * 9, doc + [2] * 9, list(range(600, 625))]  # a group of two, and a prompt alone
    plan = build_plan(_hashed(window), num_replicas=1, min_prefix_len=BLOCK)
    later = _hashed([doc + [1] * 9 + [3], list(range(600, 625)) + [4]])
    # Both engines hash a member's own blocks from the prompt's start (the native engine since
    # its members' blocks line up with the prompt's): the whole first prompt is found (8 whole
    # blocks, beyond the group's 6-block prefix), and the prompt run whole (6).
    assert homes_of(plan, PrefixHomes.empty(1, 1000)).find(later).hit.tolist() == [32, 24]
