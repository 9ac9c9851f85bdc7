"""Prefix-affine work stealing: the WorkQueue's rules (operators/stages/work_queue.py), driven directly."""

from __future__ import annotations

import random

from prefixflow.operators.stages.work_queue import DONE, UNIT, WAIT, WorkQueue


def queue(replicas: list[int], seconds: list[float] | None = None, **kw) -> WorkQueue:
    return WorkQueue(replicas, seconds or [1.0] * len(replicas), max(replicas) + 1, **kw)


def test_own_units_first_in_plan_order():
    q = queue([0, 0, 0, 1, 1])
    assert [q.take(0, "a").unit for _ in range(3)] == [0, 1, 2]
    assert all(t.stolen_from == -1 for t in (q.take(1, "b"),))


def test_a_replica_that_runs_dry_takes_the_last_unit_of_the_busiest_whole():
    # replica 0: units 0-1 (2 s); replica 1: units 2-4 (1 + 1 + 5 s: the most left); replica 2: 5
    q = queue([0, 0, 1, 1, 1, 2], [1, 1, 1, 1, 5, 1])
    assert q.take(2, "c").unit == 5  # its own first
    stolen = q.take(2, "c")  # then the back of the busiest queue
    assert (stolen.kind, stolen.unit, stolen.stolen_from, stolen.rows) == (UNIT, 4, 1, None)
    assert q.take(1, "b").unit == 2  # the victim keeps its order from the front
    assert q.steals == [
        {
            "unit": 4,
            "from": 1,
            "to": 2,
            "seconds": 5.0,
            "shared_tokens_again": 0,
            "victim_expected_s": 7.0,
            "thief_expected_s": 6.0,
            "at_s": q.steals[0]["at_s"],
        }
    ]


def test_a_thief_takes_the_unit_whose_prefix_it_computes_again_least():
    """Replica 1's queue: units 1-3 are pieces of one document (each shares 900 tokens with the
    one before it), unit 4 a document of its own, units 5-6 the two pieces of another (300).
    The thief takes unit 4 first (it shares nothing), then from the back: unit 6 costs it the
    300 tokens unit 5 has too, unit 5 then nothing (its neighbour is the thief's), and so on;
    the victim keeps its order from the front."""
    q = queue([0, 1, 1, 1, 1, 1, 1], unit_shared=[0, 0, 900, 900, 0, 0, 300])
    assert q.take(0, "a").unit == 0
    assert [q.take(0, "a").unit for _ in range(5)] == [4, 6, 5, 3, 2]
    assert [s["shared_tokens_again"] for s in q.steals] == [0, 300, 0, 900, 0]
    assert q.take(1, "b").unit == 1


def test_loose_units_go_last_so_a_thief_finds_them_and_computes_no_prefix_twice():
    """Replica 0's plan (scale_bench's N = 4 shape): units 0-2 are documents asked once (each
    shares only the 64-token system prompt with its neighbours: the window's floor), units 3-5
    the pieces of one document (1,952 tokens shared). Its engine takes the document first and
    the loose units last; a thief that comes takes a loose unit, not a piece of the document.
    Without stealing the plan's order stays."""
    shape = dict(unit_shared=[0, 64, 64, 64, 1952, 1952, 0])
    q = queue([0, 0, 0, 0, 0, 0, 1], **shape)
    assert [q.take(0, "a").unit for _ in range(2)] == [3, 4]
    assert q.take(1, "b").unit == 6
    stolen = q.take(1, "b")
    assert (stolen.unit, stolen.stolen_from, q.steals[-1]["shared_tokens_again"]) == (2, 0, 0)
    assert [q.take(0, "a").unit for _ in range(3)] == [5, 0, 1]
    static = queue([0, 0, 0, 0, 0, 0, 1], steal=False, **shape)
    assert [static.take(0, "a").unit for _ in range(6)] == [0, 1, 2, 3, 4, 5]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_victim_is_the_replica_expected_to_finish_last_at_its_measured_pace():
    """Replica 0 has more predicted work queued (6 s against 5 s) but runs twice as fast as
    predicted; replica 1 runs at half speed and holds a unit: replica 1 is relieved first."""
    clock = Clock()
    q = queue([0, 0, 0, 0, 1, 1, 1, 2], [5, 5, 5, 6, 5, 5, 5, 5], clock=clock)
    assert [q.take(r, t).unit for r, t in ((0, "a"), (1, "b"), (2, "c"))] == [0, 4, 7]
    clock.now = 2.5
    q.finished(0, "a")
    assert q.take(0, "a").unit == 1
    clock.now = 5.0
    q.finished(1, "a")
    q.finished(7, "c")
    assert q.take(0, "a").unit == 2
    clock.now = 10.0
    q.finished(4, "b")
    assert q.take(1, "b").unit == 5
    assert q.paces() == [1.0, 0.5, 0.5]  # predicted seconds finished per second since the first take
    # replica 0: (6 queued + 5 held) / 1.0 = 11 s; replica 1: (5 + 5) / 0.5 = 20 s
    assert q.expected_seconds_left()[:2] == [11.0, 20.0]
    stolen = q.take(2, "c")
    assert (stolen.unit, stolen.stolen_from) == (6, 1)


def test_a_replica_that_finished_nothing_is_expected_at_the_jobs_mean_pace():
    clock = Clock()
    q = queue([0, 1, 1], [4, 4, 4], clock=clock)
    q.take(0, "a"), q.take(1, "b")
    clock.now = 2.0
    q.finished(0, "a")  # replica 0: pace 2; replica 1 finished nothing yet
    assert q.paces() == [2.0, None]
    assert q.expected_seconds_left() == [0.0, 4.0]  # (4 queued + 4 held) / the mean pace 2


def test_every_unit_is_handed_out_once():
    rng = random.Random(0)
    replicas = [rng.randrange(4) for _ in range(200)]
    q = queue(replicas, [rng.uniform(0.1, 3) for _ in replicas])
    got: list[int] = []
    tokens = {r: f"t{r}" for r in range(4)}
    while True:
        r = rng.randrange(4)
        t = q.take(r, tokens[r])
        if t.kind == UNIT:
            got.append(t.unit)
            q.finished(t.unit, tokens[r])
        elif t.kind == DONE:
            break
    assert sorted(got) == list(range(200))
    assert q.status()["all_done"] and q.status()["done"] == 200


def test_done_when_nothing_is_queued_and_held_units_finish():
    q = queue([0, 1])
    a, b = q.take(0, "a"), q.take(1, "b")
    assert q.take(0, "a").kind == DONE  # nothing unstarted: a ends once it ran its own
    assert not q.status()["all_done"]
    q.finished(a.unit, "a")
    q.finished(b.unit, "b")
    assert q.status()["all_done"] and q.status()["num_queued"] == 0


def test_a_dead_engines_units_come_back_with_their_uncommitted_rows():
    q = queue([0, 0, 1])
    first, second = q.take(0, "dead"), q.take(0, "dead")
    # Unit 0 was committed whole before the death; unit 1 had rows 7 and 9 left.
    back = q.release("dead", {first.unit: [], second.unit: [7, 9]}, replica=0)
    assert back == [second.unit]
    assert q.status()["done"] == 1
    again = q.take(1, "b")  # b's own unit first ...
    assert again.unit == 2
    stolen = q.take(1, "b")  # ... then the handed-back unit, with its rows left
    assert (stolen.unit, stolen.rows, stolen.stolen_from) == (second.unit, (7, 9), 0)


def test_a_resume_queues_only_what_is_left():
    q = queue([0, 0, 1], rows_left={1: [4]}, done_units=[0])
    t = q.take(0, "a")
    assert (t.unit, t.rows) == (1, (4,))
    assert q.take(0, "a").unit == 2  # stolen from replica 1, which never started
    assert q.status()["queued"] == [0, 0]


def test_a_late_replica_takes_its_own_remains_then_steals():
    q = queue([0, 0, 0, 0, 1, 1])
    for _ in range(4):
        q.take(0, "a")
    assert q.take(0, "a").unit == 5  # replica 1 has not started: its last unit
    late = [q.take(1, "b").unit, q.take(1, "b").kind]
    assert late == [4, DONE]  # its own first unit; nothing else is unstarted


def test_without_stealing_each_replica_takes_only_its_own_and_drop_gives_the_rest_up():
    q = queue([0, 0, 1, 1], steal=False)
    assert [q.take(0, "a").unit, q.take(0, "a").unit, q.take(0, "a").kind] == [0, 1, DONE]
    assert q.drop(1) == [2, 3]  # replica 1 given up: nobody takes its units
    assert q.take(1, "b").kind == DONE and q.status()["num_queued"] == 0


def test_the_driver_restarts_only_replicas_that_may_take_a_queued_unit():
    """operators/stages/supervise.py asks replicas_to_start which replicas get an engine. Without stealing,
    a replica whose own queue ran dry is not started again while another's units wait (the
    driver used to start, end and restart it in a loop, loading its model each time)."""
    from prefixflow.operators.stages.supervise import replicas_to_start

    q = queue([0, 1, 1, 1], steal=False)
    assert replicas_to_start(q.counts()["queued"], set(), set(), stealing=False) == [0, 1]
    q.take(0, "a"), q.take(1, "b")  # replica 0's one unit is taken; replica 1 has two queued
    q.finished(0, "a")
    assert replicas_to_start(q.counts()["queued"], {1}, set(), stealing=False) == []
    assert replicas_to_start(q.counts()["queued"], {1}, set(), stealing=True) == [0]  # it would steal
    assert replicas_to_start(q.counts()["queued"], set(), {1}, stealing=False) == []  # given up
    q.release("b", {1: [7]}, 1)  # replica 1's engine died holding unit 1: it starts again
    assert replicas_to_start(q.counts()["queued"], set(), set(), stealing=False) == [1]
    assert replicas_to_start([0, 0], set(), set(), stealing=True) == []


def test_a_unit_counts_in_the_pace_when_its_rows_ran_long_before_their_commit():
    clock = Clock()
    q = queue([0, 0, 1], [4, 4, 4], clock=clock)
    q.take(0, "a"), q.take(1, "b")
    clock.now = 2.0
    q.ran("a", {0: 1.0})  # every output is out; the part holding them is not committed yet
    assert q.paces() == [2.0, None] and q.held_seconds[0] == 0.0
    q.finished(0, "a")  # the commit counts nothing twice
    assert q.paces() == [2.0, None] and q.counts()["done"] == 1
    q.ran("someone else", {2: 1.0})  # only the holder's word counts
    assert q.paces()[1] is None


def test_outputs_count_in_the_pace_row_by_row_before_the_unit_has_run():
    """An engine running many rows at once reports the share of each unit with outputs: half a
    unit's rows out is half its predicted seconds run, and no longer held."""
    clock = Clock()
    q = queue([0, 0, 1], [4, 4, 4], clock=clock)
    q.take(0, "a"), q.take(0, "a"), q.take(1, "b")
    clock.now = 2.0
    q.ran("a", {0: 0.5, 1: 0.25})
    assert q.paces()[0] == 1.5 and q.held_seconds[0] == 5.0  # 2 + 1 of 8 held seconds ran
    q.ran("a", {0: 0.5})  # the same share again counts nothing twice
    assert q.paces()[0] == 1.5
    q.ran("a", {0: 1.0})
    assert q.paces()[0] == 2.5 and q.held_seconds[0] == 3.0


def test_a_thief_still_busy_waits_rather_than_take_what_the_victim_reaches_first():
    """Replica 1 ran its queue dry but holds most of its work: it would have run replica 0's
    last unit in 18 s, replica 0 is expected to have run all of its own in 4: WAIT. Once
    replica 1 holds nothing and replica 0 turned out slow, it takes the unit."""
    clock = Clock()
    q = queue([0, 0, 0, 1], [2, 2, 2, 8], clock=clock)
    q.take(0, "a"), q.take(1, "b")
    clock.now = 2.0
    q.ran("a", {0: 1.0})
    q.ran("b", {3: 0.125})  # paces 1.0 and 0.5
    assert q.expected_seconds_left() == [4.0, 14.0]
    assert q.take(1, "b").kind == WAIT and not q.steals  # 14 + 2 / 0.5 = 18 s > 4 s
    assert q.status()["waits"] == [0, 1]
    assert q.take(0, "a").unit == 1  # the victim goes on in plan order
    clock.now = 14.0
    q.finished(3, "b")  # replica 1 holds nothing now: pace 8 / 14; replica 0's 4 s are late
    assert q.expected_seconds_left()[1] == 0.0
    stolen = q.take(1, "b")
    assert (stolen.kind, stolen.unit, stolen.stolen_from) == (UNIT, 2, 0)


def test_a_victim_with_no_engine_at_work_is_robbed_whatever_the_thiefs_pace():
    """Replica 1's engine never started (or died and its units came back): its units go to
    the slowest thief rather than wait for an engine that may never come."""
    clock = Clock()
    q = queue([0, 1, 1], [1, 5, 5], clock=clock)
    q.take(0, "a")
    clock.now = 10.0
    q.finished(0, "a")  # pace 0.1: the 5 s unit takes replica 0 50 s, replica 1 is expected in 100
    assert q.take(0, "a").unit == 2
    dead = q.take(1, "b")  # replica 1 starts, takes unit 1, dies: unit 1 comes back
    q.release("b", {dead.unit: [7]}, replica=1)
    assert q.engine_of[1] is None
    assert q.take(0, "a").unit == 1


def test_a_done_units_payload_is_let_go_and_a_handed_back_one_kept():
    q = queue([0, 0, 1], payloads=["p0", "p1", "p2"], done_units=[2])
    assert q.unit_payloads == ["p0", "p1", None]  # committed by an earlier run: never handed out
    a, b = q.take(0, "a"), q.take(0, "a")
    assert (a.payload, b.payload) == ("p0", "p1")
    q.finished(0, "a")
    assert q.unit_payloads[0] is None  # its rows are committed: the queue no longer holds them
    assert q.release("a", {1: [5]}, 0) == [1]  # the engine died with unit 1's row 5 uncommitted
    again = q.take(0, "a2")
    assert (again.unit, again.rows, again.payload) == (1, (5,), "p1")
