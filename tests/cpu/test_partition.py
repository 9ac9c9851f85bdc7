"""Data-parallel partitioning (BlendServe Sec. 5.5): coverage, balance, cuts, Plan integration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.pipeline import build_plan
from prefixflow.pipeline.partition import partition_runs


@st.composite
def run_sets(draw):
    run_len = draw(st.lists(st.integers(1, 30), min_size=0, max_size=25))
    n = sum(run_len)
    floats = st.floats(0.0, 10.0, allow_nan=False)
    comp = np.array(draw(st.lists(floats, min_size=n, max_size=n)))
    mem = np.array(draw(st.lists(floats, min_size=n, max_size=n)))
    prefix = np.array([draw(st.integers(0, 50)) if k > 1 else 0 for k in run_len], dtype=np.int64)
    return np.r_[0, np.cumsum(run_len)].astype(np.int64), comp, mem, prefix


@given(run_sets(), st.integers(1, 6))
@settings(max_examples=200, deadline=None)
def test_every_row_exactly_once_in_policy_order(runs, replicas):
    starts, comp, mem, prefix = runs
    part = partition_runs(starts, comp, mem, prefix * 0.01, prefix, replicas)
    rows = (
        np.concatenate([np.arange(lo, hi) for lo, hi in zip(part.part_lo, part.part_hi)])
        if len(part.part_lo)
        else np.zeros(0, np.int64)
    )
    assert sorted(rows.tolist()) == list(range(int(starts[-1])))
    assert np.all(part.part_hi > part.part_lo)
    assert len(part.replica_parts) == replicas + 1
    for r in range(replicas):  # each replica keeps the policy's order of its parts
        lo = part.part_lo[part.replica_parts[r] : part.replica_parts[r + 1]]
        assert np.all(np.diff(lo) > 0)
        assert np.all(part.part_replica[part.replica_parts[r] : part.replica_parts[r + 1]] == r)
    # Each part inside its run; lost tokens are (parts of the run - 1) * prefix.
    assert np.all(starts[part.part_run] <= part.part_lo) and np.all(part.part_hi <= starts[part.part_run + 1])
    pieces = np.bincount(part.part_run, minlength=len(starts) - 1)
    assert part.lost_saving_tokens.sum() == ((pieces - 1) * prefix).sum()
    total_c = comp.sum() + (pieces * prefix * 0.01).sum()
    assert part.compute_s.sum() == pytest.approx(total_c)
    assert part.memory_s.sum() == pytest.approx(mem.sum())


def grouped_prompts(num_groups: int, seed: int = 0):
    """Groups of Zipf sizes (one larger than a replica's share), prefixes 50-150 tokens."""
    rng = np.random.default_rng(seed)
    sizes = np.r_[600, np.minimum(rng.zipf(1.8, num_groups), 200)]
    prompts, outs = [], []
    for g, size in enumerate(sizes):
        prefix = rng.integers(0, 32000, rng.integers(50, 150)).tolist()
        for _ in range(size):
            prompts.append(prefix + rng.integers(0, 32000, rng.integers(10, 60)).tolist())
            outs.append(int(rng.integers(5, 500)))
    perm = rng.permutation(len(prompts))
    return [prompts[i] for i in perm], np.array(outs)[perm]


@pytest.mark.parametrize("order", ["batchllm", "blendserve"])
def test_replicas_balance_and_keep_the_sharing(order):
    prompts, outs = grouped_prompts(300)
    single = build_plan(prompts, output_lens=outs, order=order)
    for replicas in (2, 4):
        plan = build_plan(prompts, output_lens=outs, order=order, num_replicas=replicas)
        s = plan.summary
        times = [r["predicted_seconds"] for r in s["replicas"]]
        assert max(times) / np.mean(times) <= 1.03
        assert s["predicted_seconds_max_over_mean"] == pytest.approx(max(times) / np.mean(times))
        assert s["token_saving_ratio"] >= 0.99 * single.summary["token_saving_ratio"]
        assert s["lost_saving_tokens"] == sum(r["lost_saving_tokens"] for r in s["replicas"])
        # lost: against the same plan uncut. batchllm takes the single-level plan where its
        # split computes fewer tokens than the nested one's (here: 133,341 vs 133,468 on 2)
        uncut = single.summary["computed_prompt_tokens"]
        if s.get("batchllm_plan") != single.summary.get("batchllm_plan"):
            uncut = round(s["prompt_tokens"] * (1 - s["single_level_token_saving_ratio"]))
        assert s["computed_prompt_tokens"] - uncut == s["lost_saving_tokens"]


def test_a_group_larger_than_a_share_is_one_group_per_replica_with_the_full_prefix():
    prefix = list(range(1, 101))
    prompts = [prefix + [1000 + i, 7] for i in range(40)]
    plan = build_plan(prompts, output_lens=[50] * 40, num_replicas=4)
    assert plan.summary["lost_saving_tokens"] == 3 * 100  # cut three times
    members = []
    for r in range(4):
        groups = plan.groups(r)
        assert len(groups) == 1 and groups[0].prefix.tolist() == prefix
        members.append(groups[0].num_members)
        assert plan.summary["replicas"][r]["lost_saving_tokens"] == (100 if r else 0)
    # Every part computes the prefix once, so the parts are about equal, not exactly 10 each.
    assert sum(members) == 40 and max(members) - min(members) <= 3
    assert plan.summary["predicted_seconds_max_over_mean"] <= 1.05


def test_model_config_and_hardware_change_the_prediction(tmp_path):
    prompts = [[1, 2, 3, i] for i in range(8)]
    small = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    a = build_plan(prompts, num_replicas=2, model=small)
    b = build_plan(prompts, num_replicas=2, hardware="a100")
    assert a.summary["replicas"][0]["predicted_seconds"] < b.summary["replicas"][0]["predicted_seconds"]
    assert b.summary["cost_model"]["hardware"] == "a100"
    assert a.summary["cost_model"]["output_len_assumed"] == 128
    with pytest.raises(ValueError, match="hardware='v100'"):
        build_plan(prompts, hardware="v100")


def test_bad_replica_count():
    with pytest.raises(ValueError, match="num_replicas=0"):
        partition_runs(np.array([0, 1]), np.ones(1), np.ones(1), np.zeros(1), np.zeros(1, np.int64), 0)


def test_a_documents_last_question_cut_off_by_a_full_replica_joins_the_rest():
    """Two documents of 11 and 9 questions, each question 1 s, each prefix 0.5 s, on 2
    replicas: the fill cuts the first document's last question off to the second replica
    (recomputing its prefix there); joined back, no prefix is computed twice, for a balance
    of one question's time, which work stealing evens out at run time."""
    starts = np.array([0, 11, 20])
    args = (starts, np.ones(20), np.zeros(20), np.array([0.5, 0.5]), np.array([100, 100]), 2)
    cut = partition_runs(*args)
    assert cut.lost_saving_tokens.sum() == 100  # the fill alone splits the first document
    joined = partition_runs(*args, join_s=1.5)
    assert joined.lost_saving_tokens.sum() == 0
    assert joined.part_lo.tolist() == [0, 11] and joined.part_hi.tolist() == [11, 20]
    assert joined.compute_s.tolist() == [11.5, 9.5]
    assert partition_runs(*args, join_s=1.0).lost_saving_tokens.sum() == 100  # the piece is above the grain


@given(run_sets(), st.integers(1, 6), st.floats(0.0, 20.0))
@settings(max_examples=100, deadline=None)
def test_joining_small_pieces_keeps_every_row_once_and_never_computes_more(runs, replicas, join_s):
    starts, comp, mem, prefix = runs
    plain = partition_runs(starts, comp, mem, prefix * 0.01, prefix, replicas)
    part = partition_runs(starts, comp, mem, prefix * 0.01, prefix, replicas, join_s=join_s)
    rows = (
        np.concatenate([np.arange(lo, hi) for lo, hi in zip(part.part_lo, part.part_hi)])
        if len(part.part_lo)
        else np.zeros(0, np.int64)
    )
    assert sorted(rows.tolist()) == list(range(int(starts[-1])))
    assert part.lost_saving_tokens.sum() <= plain.lost_saving_tokens.sum()


def test_a_plan_for_work_stealing_keeps_small_pieces_with_their_group():
    """Planned for engines that steal, a replica may take up to one unit's time more to keep a
    group's small piece with the rest (its prefix computed once); planned to run as it is (the
    Python API), the balance comes first. Both hold every row once."""
    prompts, outs = grouped_prompts(60, seed=3)
    static = build_plan(prompts, output_lens=outs, num_replicas=4)
    stealing = build_plan(prompts, output_lens=outs, num_replicas=4, stealing=True)
    assert sorted(stealing.table.column("row_id").to_pylist()) == list(range(len(prompts)))
    assert stealing.summary["computed_prompt_tokens"] < static.summary["computed_prompt_tokens"]
    assert (
        static.summary["predicted_seconds_max_over_mean"]
        <= stealing.summary["predicted_seconds_max_over_mean"]
        <= static.summary["predicted_seconds_max_over_mean"] + 1 / 32
    )  # one unit of a replica's share


def _documents_and_questions(num_rows: int, seed: int = 0) -> tuple[list[list[int]], np.ndarray]:
    """scale_bench's shape in token ids: one system prompt, documents of 200-2,000 tokens asked
    Zipf-many questions (the first about 30% of the rows). Returns (prompts, document of each)."""
    from prefixflow.bench.scale_workload import zipf_counts

    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1000, 64).tolist()
    prompts, docs = [], []
    for d, count in enumerate(zipf_counts(num_rows, num_rows * 3 // 10, 1.3)):
        document = rng.integers(0, 1000, int(np.exp(rng.uniform(np.log(200), np.log(2000))))).tolist()
        for _ in range(count):
            prompts.append(system + document + rng.integers(0, 1000, 24).tolist())
            docs.append(d)
    return prompts, np.asarray(docs)


def test_planned_for_stealing_a_documents_units_stay_together(monkeypatch):
    """Planned for engines that steal, the units of a document's questions are one family unless
    their cut is as cheap as a system prompt's (multilevel.STICKY_CUT_STEALING): the balance the
    cut would buy is stealing's to make at run time. Fewer documents are split across replicas
    and fewer prompt tokens computed than with the static plan's rule."""
    from prefixflow.pipeline import multilevel

    prompts, docs = _documents_and_questions(1000)

    def plan() -> tuple[int, int]:
        p = build_plan(prompts, output_lens=[160] * len(prompts), num_replicas=4, stealing=True, min_prefix_len=32)
        replica = p.table.column("replica").to_numpy()
        doc = docs[p.table.column("row_id").to_numpy()]
        assert sorted(p.table.column("row_id").to_pylist()) == list(range(len(prompts)))
        splits = sum(len(np.unique(replica[doc == d])) - 1 for d in range(int(docs.max()) + 1))
        return p.summary["computed_prompt_tokens"], splits

    together = plan()
    monkeypatch.setattr(multilevel, "STICKY_CUT_STEALING", multilevel.STICKY_CUT)
    scattered = plan()
    assert together[0] < scattered[0] and together[1] < scattered[1]
