"""Plan units: the grain of work stealing (pipeline/plan.py Plan.units)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.pipeline import build_plan
from prefixflow.pipeline.multilevel import UNITS_PER_REPLICA


def zipf_docs(num_rows: int, seed: int = 0) -> list[list[int]]:
    """Documents asked Zipf-many questions: one document holds a large share of the rows."""
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(0, 500, size=int(rng.integers(50, 300)))) for _ in range(30)]
    return [
        [1, 2, 3] + docs[min(int(rng.zipf(1.5)) - 1, 29)] + list(rng.integers(0, 500, size=10)) for _ in range(num_rows)
    ]


@pytest.mark.parametrize("order", ["batchllm", "fcfs", "dfs", "blendserve"])
@pytest.mark.parametrize("replicas", [1, 3])
def test_units_cover_each_replica_in_plan_order(order, replicas):
    prompts = zipf_docs(400)
    outs = np.random.default_rng(1).integers(8, 128, size=len(prompts))
    plan = build_plan(prompts, order=order, num_replicas=replicas, min_prefix_len=16, output_lens=outs)
    seen = 0
    for r in range(replicas):
        units = plan.units(r)
        assert all(u.replica == r for u in units)
        # Units in order are the replica's plan rows in order, and groups keep their prefixes.
        rows = np.concatenate([u.row_ids for u in units])
        assert rows.tolist() == np.concatenate([g.row_ids for g in plan.groups(r)]).tolist()
        assert rows.tolist() == plan.replica_table(r).column("row_id").to_pylist()
        for u in units:
            assert u.groups and u.predicted_seconds == plan.unit_seconds[u.unit_id]
            for g in u.groups:
                assert all(list(g.prompt(i)) == prompts[int(row)] for i, row in enumerate(g.row_ids))
        # A piece of a cut run keeps the run's prefix (to join its group in the engine).
        prefix = dict(zip(plan.table.column("row_id").to_pylist(), plan.table.column("prefix_len").to_pylist()))
        assert all(g.prefix_len == prefix[int(g.row_ids[0])] for u in units for g in u.groups)
        seen += len(units)
    assert seen == plan.num_units == plan.summary["num_units"]


def test_a_large_group_is_cut_into_units_of_a_replicas_share():
    """One document asked most of the questions is one single-level group; its units are each
    at most a share of a replica's time (so a replica that runs dry finds work of that grain)."""
    prompts = zipf_docs(600)
    plan = build_plan(prompts, order="dfs", num_replicas=4, min_prefix_len=16)
    sizes = np.diff(plan.table.column("group_id").to_numpy(), prepend=-1) != 0
    assert np.diff(np.flatnonzero(np.r_[sizes, True])).max() > 600 // 8  # one large group
    cap = plan.unit_seconds.sum() / (4 * UNITS_PER_REPLICA)
    assert plan.num_units >= 4 * UNITS_PER_REPLICA // 2
    assert plan.unit_seconds.max() <= 2 * cap
    # Cutting units changes neither the runs nor the order.
    plain = build_plan(prompts, order="dfs", num_replicas=4, min_prefix_len=16)
    assert plan.table.equals(plain.table)


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=40), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_units_partition_the_plan(prompts, replicas):
    plan = build_plan(prompts, order="batchllm", num_replicas=replicas)
    starts = plan.unit_starts
    assert starts[0] == 0 and starts[-1] == len(prompts) and np.all(np.diff(starts) > 0)
    replica = plan.table.column("replica").to_numpy()
    for lo, hi in zip(starts[:-1], starts[1:]):
        assert len(set(replica[lo:hi].tolist())) == 1  # a unit never spans replicas
    got = sorted(int(r) for k in range(replicas) for u in plan.units(k) for r in u.row_ids)
    assert got == list(range(len(prompts)))


@pytest.mark.parametrize("order", ["fcfs", "batchllm"])
def test_parts_of_a_row_each_join_into_units_of_a_replicas_share(order):
    """Rows that share nothing are parts of one row each (a windowed plan's documents whose
    prefixes live on different replicas are too): they join into units of about a replica's share
    / UNITS_PER_REPLICA, so that an engine takes tens of units from the work queue, not one per
    row (each take a round trip)."""
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 30_000, size=int(rng.integers(20, 200)))) for _ in range(3000)]
    plan = build_plan(prompts, order=order, num_replicas=2, min_prefix_len=16)
    assert UNITS_PER_REPLICA <= plan.num_units <= 2 * 2 * UNITS_PER_REPLICA + 2
    cap = plan.unit_seconds.sum() / (2 * UNITS_PER_REPLICA)
    assert plan.unit_seconds.max() <= 2 * cap
    rows = [int(r) for k in range(2) for u in plan.units(k) for r in u.row_ids]
    assert sorted(rows) == list(range(3000))


@pytest.mark.parametrize("order", ["batchllm", "dfs"])
def test_a_units_shared_tokens_are_what_its_first_row_shares_with_the_row_before(order):
    """Plan.unit_shared, what a thief computes again (work_queue.py): batchllm's order knows the
    rows' shared tokens (its prev_lcp; under min_prefix_len, none); the other orders
    count a run's prefix where a unit continues a run. Never more than the rows' common
    prefix; 0 where a replica starts."""
    prompts = zipf_docs(400)
    plan = build_plan(prompts, order=order, num_replicas=3, min_prefix_len=16, stealing=True)
    rows = plan.table.column("row_id").to_numpy()
    replica = plan.table.column("replica").to_numpy()
    starts = plan.unit_starts[:-1]
    assert len(plan.unit_shared) == plan.num_units and plan.num_units > 3 * 4
    for first, shared in zip(starts.tolist(), plan.unit_shared.tolist()):
        if first == 0 or replica[first] != replica[first - 1]:
            assert shared == 0
            continue
        a, b = prompts[rows[first - 1]], prompts[rows[first]]
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert shared <= common
        if order == "batchllm":
            assert shared == (common if common >= 16 else 0)
    assert plan.unit_shared.max() > 3  # some units are pieces of a document
