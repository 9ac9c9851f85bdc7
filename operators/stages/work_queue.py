"""Prefix-affine work stealing: each replica's queue of plan units, and who may take what.

The plan gives each replica an ordered queue of whole units (pipeline/plan.py Plan.units: a
subtree, or a piece of a large group; nothing shared with the rest but its parents' prefixes).
An engine takes its next unit when its scheduler has room (engine/intake.py):

  - from its own queue's front, in plan order, while it has any; its loose units last (below);
  - else, having run dry, an unstarted unit of the replica expected to finish last, whole:
    the unit's shared prefix is computed once, on the thief. Of the victim's queue, the unit
    whose prefix costs the least to compute twice (prefix affinity, `_to_steal`): one that
    shares nothing with its neighbours in the plan (a document wholly in it), or one next to a
    unit the thief took (its prefix is in the thief's cache); of equals the LAST: taking from
    the back leaves the victim its plan order, and the units it will reach last are the ones
    its cache is least likely to help. Only if that brings the job's end closer: while the
    victim's engine runs, the thief takes the unit only if it expects to have run it (after
    what it holds) before the victim expects to be done; else WAIT and ask again (the victim
    may reach the unit first). A victim with no engine at work (not started yet, or dead) is
    always robbed;
  - else DONE: the engine finishes what it holds and ends.

Loose units are kept for the end (work first, steal-friendly deque): a unit that shares
nothing with the units next to it in the plan beyond what every unit of its window shares (the
least any unit shares with the one before it on its replica: a system prompt, which every
replica computes once anyway) is taken by its own engine after the others. Its engine loses no
reuse by that, and a thief that comes finds it at the end, where it costs no prefix computed
twice: in scale_bench's N = 4 job a replica ran its document-less rows first and its two large
documents last, so the thieves, coming late, could only split a document and compute its
1,950-token prefix again, once each. Without stealing the plan's order is kept as it is.

A replica is expected to finish when the predicted seconds of its queued and held units are
done at its pace: the predicted seconds its engine ran per second since it first took a unit
(the job's mean pace until it ran any). A unit counts as run in the share of its rows that have
their outputs (`ran`, reported as they come), long before its part is committed (`finished`):
counting whole units only, an engine that runs hundreds of rows at once (vLLM) looks idle for
its first minute and is robbed of work it would have done sooner. So the rows' real cost
decides, not the cost model's guess: a replica whose outputs run longer than predicted, or
whose cache thrashes, is relieved first, and one holding much unfinished work is not left to
finish it alone.

A job planned in windows (operators/stages/window_plans.plan_windows) adds each window's units as it is
planned (`add`) and `close`s the queue after the last: until then a replica with nothing to
take is told to WAIT, not DONE (the next window may bring it work).

A unit is taken by one engine at a time, so a row never runs twice. When an engine dies, the
driver hands back its units with the rows still uncommitted (`release`); they go to the front of
the dead replica's queue, for its restarted engine or, if that never comes (a node lost), for
the others to take; engines that had ended are started again by the driver while units are
queued (operators/stages/supervise.py). A replica whose engine starts late (a node added; replicas given as a
range) takes its own queue's remains, then steals like any other.

Pure Python: the job driver (operators/stages/supervise.py) keeps one per run in the job's actor on
its own node (operators/stages/job_hub.py); the tests drive it directly.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import chain
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

UNIT, WAIT, DONE = "unit", "wait", "done"


def shared_beyond_floor(unit_replica: Sequence[int], unit_shared: Sequence[int]) -> list[int]:
    """What each unit shares with the unit before it (Plan.unit_shared; none given: nothing)
    beyond the floor: the least any unit shares with the unit before it on its replica (what
    every unit of the window shares: a system prompt, which every replica computes once)."""
    shared = [int(s) for s in unit_shared] if len(unit_shared) else [0] * len(unit_replica)
    floor = min((s for k, s in enumerate(shared) if k and unit_replica[k] == unit_replica[k - 1]), default=0)
    return [max(s - floor, 0) for s in shared]


def loose_units(beyond: Sequence[int]) -> list[bool]:
    """Whether each unit is loose (module docstring): it shares nothing beyond the floor
    (`shared_beyond_floor`) with the unit before it or the unit after it."""
    return [b == 0 and (k + 1 == len(beyond) or beyond[k + 1] == 0) for k, b in enumerate(beyond)]


@dataclass(frozen=True, slots=True)
class Take:
    """What `WorkQueue.take` hands an engine: a unit (kind UNIT) with the rows of it to run
    (None: all of them; a unit handed back after a death keeps only its uncommitted rows), the
    replica it was stolen from (-1: its own) and its payload (an object ref of its
    UnitPayload, as the driver gave it); WAIT (nothing to take now, ask again); or DONE."""

    kind: str
    unit: int = -1
    rows: tuple[int, ...] | None = None
    stolen_from: int = -1
    payload: Any = None


@dataclass(slots=True)
class _Unit:
    replica: int  # the replica whose queue holds it
    seconds: float  # predicted (cost model)
    rows: tuple[int, ...] | None = None  # rows left to run; None: all
    holder: str | None = None  # the engine (run token) that took it
    taker: int = -1  # the replica of that engine
    shared: int = 0  # prompt tokens it shares with the unit before it beyond its window's floor (`add`)
    credited: float = 0.0  # predicted seconds of it counted in the taker's pace (rows run)
    ran: bool = False  # every row of it has its output
    done: bool = False


@dataclass
class WorkQueue:
    """The job's units, queued per replica. unit_replica[u], unit_seconds[u], payloads[u]: the
    plan's replica, predicted seconds and payload ref of unit u (no payloads: Take.payload is
    None). rows_left: units an earlier run committed part of (unit -> its uncommitted rows);
    done_units: units it committed whole (a resume). closed: no more units will be added."""

    unit_replica: Sequence[int]
    unit_seconds: Sequence[float]
    num_replicas: int
    rows_left: Mapping[int, Sequence[int]] = field(default_factory=dict)
    done_units: Iterable[int] = ()
    steal: bool = True  # False: each replica takes only its own queue (the static plan)
    payloads: Sequence[Any] = ()
    closed: bool = True
    steals: list[dict] = field(default_factory=list)
    clock: Callable[[], float] = time.time
    unit_shared: Sequence[int] = ()  # Plan.unit_shared (none: no unit shares with another)

    def __post_init__(self) -> None:
        self.units: list[_Unit] = []
        self.unit_payloads: list[Any] = []
        self.queues: list[deque[int]] = [deque() for _ in range(self.num_replicas)]
        self.loose: list[deque[int]] = [deque() for _ in range(self.num_replicas)]  # taken after queues
        self.seconds_left = [0.0] * self.num_replicas
        self.add(self.unit_replica, self.unit_seconds, self.payloads, self.rows_left, self.done_units, self.unit_shared)
        self.held_seconds = [0.0] * self.num_replicas  # predicted seconds of units held, by taker
        self.done_seconds = [0.0] * self.num_replicas  # ... of units run (`ran`), by taker
        self.engine_of: list[str | None] = [None] * self.num_replicas  # the engine at work, by replica
        self.waits = [0] * self.num_replicas  # WAITs answered, by asking replica
        self.first_take: list[float | None] = [None] * self.num_replicas
        self.started = self.clock()

    def add(
        self,
        unit_replica: Sequence[int],
        unit_seconds: Sequence[float],
        payloads: Sequence[Any] = (),
        rows_left: Mapping[int, Sequence[int]] | None = None,
        done_units: Iterable[int] = (),
        unit_shared: Sequence[int] = (),
    ) -> int:
        """Queue more units (the next window of the plan), numbered on from the last; rows_left,
        done_units and unit_shared as in the constructor, by the units' new numbers. A unit's
        shared tokens count beyond the window's floor: the least a unit shares with the unit
        before it on its replica (module docstring). Returns the first."""
        first = len(self.units)
        done = set(done_units)
        beyond = shared_beyond_floor(unit_replica, unit_shared)
        loose = loose_units(beyond)
        for k, (r, s) in enumerate(zip(unit_replica, unit_seconds)):
            u = first + k
            self.units.append(_Unit(int(r), float(s), shared=beyond[k], done=u in done))
            self.unit_payloads.append(payloads[k] if len(payloads) and u not in done else None)
            if u not in done:
                (self.loose if self.steal and loose[k] else self.queues)[int(r)].append(u)
                self.seconds_left[int(r)] += float(s)
        for u, rows in (rows_left or {}).items():
            self.units[int(u)].rows = tuple(int(r) for r in rows)
        return first

    def close(self) -> None:
        """No more units will be added: a replica with nothing left to take is DONE."""
        self.closed = True

    def take(self, replica: int, token: str) -> Take:
        """The next unit for the engine `token` of `replica` (module docstring)."""
        if self.first_take[replica] is None:
            self.first_take[replica] = self.clock()
        self.engine_of[replica] = token
        own = self.queues[replica] or self.loose[replica]
        if own:
            return self._hand(own.popleft(), replica, token, -1)
        if not self.steal:
            return self._done(replica) if self.closed else Take(WAIT)
        paces = self.paces_or_mean()
        left = self.expected_seconds_left(paces)
        victims = [r for r in range(self.num_replicas) if self.queues[r] or self.loose[r]]
        if not victims:
            return self._done(replica) if self.closed else Take(WAIT)  # the next window may bring work
        victim = max(victims, key=lambda r: (left[r], -r))
        unit, again = self._to_steal(victim, replica)
        thief_expected = left[replica] + self.units[unit].seconds / paces[replica]
        if self.engine_of[victim] is not None and thief_expected >= left[victim]:
            self.waits[replica] += 1
            return Take(WAIT)
        (self.loose if unit in self.loose[victim] else self.queues)[victim].remove(unit)
        self.steals.append(
            {
                "unit": unit,
                "from": victim,
                "to": replica,
                "seconds": self.units[unit].seconds,
                "shared_tokens_again": again,
                "victim_expected_s": round(left[victim], 3),
                "thief_expected_s": round(thief_expected, 3),
                "at_s": self.clock() - self.started,
            }
        )
        return self._hand(unit, replica, token, victim)

    def _to_steal(self, victim: int, thief: int) -> tuple[int, int]:
        """(the unit of the victim's queue the thief takes, the prompt tokens it computes again)
        (module docstring): the least of those tokens, the last of equals (the loose units
        are the queue's end)."""
        best, least = -1, -1
        for u in chain(reversed(self.loose[victim]), reversed(self.queues[victim])):
            again = self._shared_elsewhere(u, thief)
            if least < 0 or again < least:
                best, least = u, again
            if again == 0:
                break
        return best, least

    def _shared_elsewhere(self, unit: int, thief: int) -> int:
        """Tokens `unit` shares with its neighbours in the plan (the units before and after it),
        which the thief computes again if it takes the unit: 0 if it shares nothing, or if the
        thief took one of the neighbours it shares with (their prefix is in its cache)."""
        after = unit + 1 < len(self.units) and self.units[unit + 1].shared
        sharing = [(n, s) for n, s in ((unit - 1, self.units[unit].shared), (unit + 1, int(after))) if s > 0]
        mine = (self.units[n] for n, _ in sharing)
        if any(u.taker == thief and (u.holder is not None or u.ran or u.done) for u in mine):
            return 0
        return max((s for _, s in sharing), default=0)

    def _done(self, replica: int) -> Take:
        self.engine_of[replica] = None
        return Take(DONE)

    def paces(self) -> list[float | None]:
        """Each replica's predicted seconds run per second since its first take (None before
        it ran a unit)."""
        now = self.clock()
        return [
            done / max(now - first, 1e-9) if done > 0 and first is not None else None
            for done, first in zip(self.done_seconds, self.first_take)
        ]

    def expected_seconds_left(self, paces: list[float] | None = None) -> list[float]:
        """Seconds until each replica has run its queued and held units, at its pace (module
        docstring; paces: paces_or_mean(), when the caller has it already)."""
        paces = paces or self.paces_or_mean()
        return [(self.seconds_left[r] + self.held_seconds[r]) / paces[r] for r in range(self.num_replicas)]

    def paces_or_mean(self) -> list[float]:
        """paces(), with the job's mean pace for a replica that ran nothing yet (1.0 before
        any did)."""
        paces = self.paces()
        known = [p for p in paces if p]
        mean = sum(known) / len(known) if known else 1.0
        return [p or mean for p in paces]

    def _hand(self, unit: int, replica: int, token: str, stolen_from: int) -> Take:
        u = self.units[unit]
        self.seconds_left[u.replica] -= u.seconds
        self.held_seconds[replica] += u.seconds
        u.holder, u.taker = token, replica
        return Take(UNIT, unit, u.rows, stolen_from, self.unit_payloads[unit])

    def ran(self, token: str, shares: Mapping[int, float]) -> None:
        """Outputs came: shares[u] of the rows unit u had when `token` took it have theirs (1.0:
        all, the unit has run). That share of its predicted seconds counts in the taker's pace
        and no longer as work it holds (module docstring). Only the holder's word counts."""
        for unit, share in shares.items():
            self._credit(int(unit), token, min(float(share), 1.0))

    def _credit(self, unit: int, token: str, share: float) -> None:
        u = self.units[unit]
        if u.holder != token or u.ran:
            return
        more = u.seconds * share - u.credited
        if more > 0:
            self.held_seconds[u.taker] -= more
            self.done_seconds[u.taker] += more
            u.credited += more
        u.ran = share >= 1.0

    def finished(self, unit: int, token: str) -> None:
        """Every row of `unit` that `token` was given is committed."""
        u = self.units[unit]
        if u.holder == token:
            self._credit(unit, token, 1.0)
            u.done, u.holder = True, None
            self.unit_payloads[unit] = None  # never handed out again: its rows may leave the object store

    def release(self, token: str, rows_left: Mapping[int, Sequence[int]], replica: int) -> list[int]:
        """The engine `token` died: each unit it held goes back to the front of `replica`'s
        queue with its rows still uncommitted (rows_left: unit -> rows; a unit with none left
        is done). Returns the units put back."""
        self.engine_of = [None if t == token else t for t in self.engine_of]
        back = []
        for u, unit in enumerate(self.units):
            if unit.holder != token:
                continue
            if not unit.ran:
                self.held_seconds[unit.taker] -= unit.seconds - unit.credited
            unit.holder, unit.ran, unit.credited = None, False, 0.0
            left = tuple(int(r) for r in rows_left.get(u, ()))
            if not left:
                unit.done = True
                self.unit_payloads[u] = None
                continue
            unit.rows, unit.replica = left, replica
            back.append(u)
        for u in reversed(back):  # in the order they were held
            self.queues[replica].appendleft(u)
            self.seconds_left[replica] += self.units[u].seconds
        return back

    def drop(self, replica: int) -> list[int]:
        """Take every unit still queued for `replica` out of the queue (its rows are given up,
        with no replica left to take them: the static plan); returns them."""
        units = [*self.queues[replica], *self.loose[replica]]
        self.queues[replica].clear()
        self.loose[replica].clear()
        self.seconds_left[replica] = 0.0
        for u in units:
            self.units[u].done = True
            self.unit_payloads[u] = None
        return units

    def held(self, token: str) -> list[int]:
        """The units the engine `token` holds now."""
        return [u for u, unit in enumerate(self.units) if unit.holder == token]

    def counts(self) -> dict:
        """Units queued per replica (and in all), held, done; whether every unit is done."""
        return {
            "queued": [len(q) + len(loose) for q, loose in zip(self.queues, self.loose)],
            "num_queued": sum(len(q) + len(loose) for q, loose in zip(self.queues, self.loose)),
            "held": sum(u.holder is not None for u in self.units),
            "done": sum(u.done for u in self.units),
            "units": len(self.units),
            "all_done": self.closed and all(u.done for u in self.units),
        }

    def status(self) -> dict:
        """counts(), every steal (unit, from, to, predicted seconds, expected ends, when), the
        WAITs answered per replica and the paces: metrics.json."""
        return {**self.counts(), "steals": list(self.steals), "waits": list(self.waits), "paces": self.paces()}
