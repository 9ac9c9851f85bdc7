"""A replica running another replica's units (work stealing): the ReplicaRunner fed a thief's
sequence of units (its own, then the last of another replica's), without Ray; and the UnitFeed
an engine takes units through, against a run's queue in the job's actor (JobHub)."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pytest

from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.results.outputs import PLAN_REPLICA
from prefixflow.operators.stages.generate import WAIT_RETRY_S, ReplicaRunner, UnitFeed
from prefixflow.operators.stages.plan import UnitPayload
from prefixflow.operators.stages.job_hub import QUEUE, JobHub, hub_actor, open_queue
from prefixflow.pipeline import build_plan


@pytest.fixture(scope="module")
def planned():
    rng = np.random.default_rng(3)
    docs = [rng.integers(10, 300, 90).tolist() for _ in range(4)]
    prompts = [docs[d] + rng.integers(10, 300, 6).tolist() for d in range(4) for _ in range(5)]
    plan = build_plan(prompts, order="batchllm", num_replicas=2, min_prefix_len=16)
    rows = pa.table({"q": [f"row {i}" for i in range(len(prompts))]})
    payloads = {}
    for r in range(2):
        ranks = plan.replica_table(r).column("rank").to_numpy()
        at = 0
        for unit in plan.units(r):
            ids = unit.row_ids
            payloads[unit.unit_id] = UnitPayload(unit, rows.take(pa.array(ids)), ranks[at : at + len(ids)])
            at += len(ids)
    return plan, payloads


def _run(model, units: list[UnitPayload], replica: int) -> tuple[ReplicaRunner, pa.Table]:
    config = ProcessorConfig(
        model=str(model),
        sampling={"temperature": 0, "max_tokens": 4},
        engine={"device": "cpu", "kv_cache_bytes": 16 << 20, "block_size": 16},
    )
    runner = ReplicaRunner(config)
    chunks = list(runner.run_units(replica, units))
    return runner, pa.concat_tables(chunks, promote_options="permissive")


def test_each_plan_replicas_first_chunk_is_first_rows_then_rows_per_chunk(tiny_model, planned):
    """A job's engine commits a small first part per plan replica (FIRST_PART_SHARE), so that the
    first results are on storage within seconds; the later chunks are rows_per_chunk rows."""
    plan, payloads = planned
    own = [payloads[u.unit_id] for u in plan.units(0)]
    stolen = [payloads[u.unit_id] for u in plan.units(1)][-1]
    config = ProcessorConfig(
        model=str(tiny_model),
        sampling={"temperature": 0, "max_tokens": 2},
        engine={"device": "cpu", "kv_cache_bytes": 16 << 20, "block_size": 16},
        rows_per_chunk=3,
    )
    chunks = list(ReplicaRunner(config).run_units(0, own + [stolen], first_rows=1))
    sizes: dict[int, list[int]] = {}
    for chunk in chunks:
        (replica,) = set(chunk.column(PLAN_REPLICA).to_pylist())
        sizes.setdefault(replica, []).append(chunk.num_rows)
    assert sorted(sizes) == [0, 1]
    for replica, rows in sizes.items():
        assert rows[0] == 1 and all(n == 3 for n in rows[1:-1]) and 1 <= rows[-1] <= 3, (replica, rows)
    assert sum(c.num_rows for c in chunks) == sum(len(p.unit.row_ids) for p in own + [stolen])


def test_a_stolen_unit_runs_whole_on_the_thief_with_its_prefix_computed_once(tiny_model, planned):
    plan, payloads = planned
    own = [payloads[u.unit_id] for u in plan.units(0)]
    victim = [payloads[u.unit_id] for u in plan.units(1)]
    assert own and victim
    thief, out = _run(tiny_model, own + [victim[-1]], replica=0)
    # Every row of its own units and of the stolen one, once; the stolen rows keep their plan
    # replica (their parts are named after it), and say who ran them.
    ran = sorted(out.column("row_id").to_pylist())
    assert ran == sorted(int(r) for p in own + [victim[-1]] for r in p.unit.row_ids)
    stolen = set(victim[-1].unit.row_ids.tolist())
    for row in out.to_pylist():
        assert row["replica"] == 0 and row[PLAN_REPLICA] == (1 if row["row_id"] in stolen else 0)
    # Each run's shared prefix computed once on the thief, however many units cut it (a later
    # piece joins the group of the first): the engine computed each prefix once and every
    # member's own part, no more.
    groups = [g for p in own + [victim[-1]] for g in p.unit.groups]
    prefixes = {g.group_id: g.prefix_len for g in groups}
    assert len(prefixes) < len(groups)  # some runs were cut into several units
    totals = thief.engine.totals
    assert totals.num_computed_prompt_tokens == sum(prefixes.values()) + sum(len(d) for g in groups for d in g.distinct)
    assert thief.record["num_units"] == len(own) + 1
    # The same answers as the victim's own engine gives them.
    _, theirs = _run(tiny_model, victim, replica=1)
    want = {r["row_id"]: r["generated_tokens"] for r in theirs.to_pylist()}
    assert all(want[r["row_id"]] == r["generated_tokens"] for r in out.to_pylist() if r["row_id"] in stolen)


def test_the_feed_waits_while_the_busy_victim_would_finish_first_then_ends(ray_local, planned):
    """Replica 0's engine takes its own units through the feed, then, its queue dry, the queue
    says WAIT: its own units (predicted 10 s each, nothing run yet) outweigh all of replica 1's,
    whose engine is at work. The feed yields NOT_READY (the engine goes on with what it holds)
    until replica 1 took its last unit; then it ends. Its outputs reach the queue's pace."""
    import ray

    plan, payloads = planned
    units = [[u.unit_id for u in plan.units(r)] for r in range(2)]
    assert units[0] == list(range(len(units[0]))) and len(units[1]) >= 2  # numbered replica by replica
    seconds = [10.0] * len(units[0]) + [0.1] * len(units[1])
    refs = [ray.put(payloads[u]) for us in units for u in us]  # by unit id
    hub = hub_actor().options(num_cpus=0).remote()  # the job's actor, holding its run's queue
    queue = open_queue(hub, [0] * len(units[0]) + [1] * len(units[1]), seconds, 2, payloads=refs)
    assert ray.get(queue.take(1, "victim")).unit == units[1][0]
    unit_feed = UnitFeed(0, np.array([], np.int64), queue, "thief")
    feed = iter(unit_feed)
    own = [next(feed) for _ in units[0]]
    assert [p.unit.unit_id for p in own] == units[0]
    assert next(feed) is None and next(feed) is None  # WAIT, then not asked again at once
    unit_feed.ran(int(own[0].unit.row_ids[0]))  # the first output is reported at once
    for _ in units[1][1:]:
        assert ray.get(queue.take(1, "victim")).kind == "unit"
    time.sleep(WAIT_RETRY_S)
    assert list(feed) == []  # asked again: nothing is queued, DONE
    status = ray.get(queue.end())
    assert status["steals"] == [] and status["paces"][0] > 0
    assert ray.get(hub.status.remote())["engines_ready"] == {}  # the sink's side, in the same actor
    # The run's queue is gone; an engine still asking is told DONE, holds nothing.
    assert ray.get(queue.take(0, "late")).kind == "done" and ray.get(queue.held("late")) == []
    assert ray.get(hub.queue_runs.remote()) == [] and ray.get(queue.end()) == {}


def test_every_queue_call_of_the_hub_answers_on_the_queues_thread():
    """The queues' state is touched by one thread only, apart from the sink's: a queue method
    left in the default group would run beside the others (and wait behind the sink's work)."""
    from prefixflow.operators.results.sink import MetricsSink

    own = [name for name in vars(JobHub) if not name.startswith("_")]
    assert own and not set(own) & set(vars(MetricsSink))  # no sink method is shadowed
    assert {name: getattr(JobHub, name).__ray_concurrency_group__ for name in own} == dict.fromkeys(own, QUEUE)
