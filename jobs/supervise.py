"""The generate stage of a job: R engine actors under Ray core, each restarted alone when it dies.

    manifests, faults = run_replicas(processor, planned, sink, wopts, spec, progress)

One actor per work item (a replica's partition of the plan, or ERRORS_ITEM for the error
records) runs `ReplicaGenerator.run_item`, committing each part itself (operators/commit.py).
When an actor dies, only its item starts again, on a new actor that skips the rows committed
by then; the other replicas never stop. Whether a death is a row's fault, and when to give a
replica up or stop the job, is decided by jobs/attempts.py.

Ray Data's actor pool is not used here on purpose: a dead actor fails its whole execution,
which stops every replica (and reloads every model) for one death.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import numpy as np

from prefixflow.jobs.attempts import AttemptLedger
from prefixflow.operators.commit import Committed, load_committed
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.generate import ERRORS_ITEM, ReplicaGenerator
from prefixflow.operators.plan import replica_group_refs, replica_row_ids
from prefixflow.operators.processor import engine_actor_options
from prefixflow.operators.write import WriteOptions


@dataclasses.dataclass
class _Running:
    item: int
    actor: Any
    token: str         # names this run of the item to the sink
    started: float
    rows: np.ndarray   # the item's rows when it started (committed ones included)


def run_replicas(processor: Any, planned: Any, sink: Any, wopts: WriteOptions, spec: Any,
                 progress: Any) -> tuple[list[dict], dict[str, Any]]:
    """Run every uncommitted row; returns this run's manifest rows and the fault report."""
    return Supervisor(processor.config, planned, sink, wopts, spec.max_retries_per_row,
                      progress).run()


class Supervisor:
    """The engine actors of one job run: starts one per work item with rows left, restarts an
    item whose actor died, gives a replica up when the ledger says so."""

    def __init__(self, config: ProcessorConfig, planned: Any, sink: Any, wopts: WriteOptions,
                 max_retries_per_row: int, progress: Any):
        import ray

        self.config, self.planned, self.sink, self.wopts, self.progress = (
            config, planned, sink, wopts, progress)
        self.actor_cls = ray.remote(ReplicaGenerator)
        self.group_refs = replica_group_refs(planned, config.replicas)
        self.replica_rows = [replica_row_ids(planned, r) for r in range(config.replicas)]
        self.ledger = AttemptLedger(max_retries=max_retries_per_row)
        self.poisoned: list[int] = []  # in the order given up, so that error ranks never move
        self.given_up: set[int] = set()
        self.failures: list[dict[str, Any]] = []
        self.manifests: list[dict] = []
        self.running: dict[Any, _Running] = {}  # task ref -> its run
        self.finished: set[int] = set()
        self.last = load_committed(wopts.path, wopts.storage, clean=False)

    def run(self) -> tuple[list[dict], dict[str, Any]]:
        import ray

        self._start_missing(self.last)
        try:
            while self.running:
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=0.5)
                self._drain()
                if not ready:
                    continue
                # One read of the commit records serves every item that just ended: an ended
                # item's actor writes nothing more, so its rows are all in this read.
                now = load_committed(self.wopts.path, self.wopts.storage, clean=False)
                for ref in ready:
                    self._ended(self.running.pop(ref), ref, now)
                self._start_missing(now)
            self._drain()
        finally:
            for run in self.running.values():  # a job-level failure: stop what still runs
                ray.kill(run.actor)
        return self.manifests, self._report()

    def _item_rows(self, item: int) -> np.ndarray:
        if item == ERRORS_ITEM:
            return np.concatenate([np.asarray(self.planned.error_row_ids, np.int64),
                                   np.asarray(self.poisoned, np.int64)])
        return self.replica_rows[item]

    def _start_missing(self, committed: Committed) -> None:
        """Start an actor for every item that has uncommitted rows and none running."""
        busy = {r.item for r in self.running.values()}
        for item in [*range(self.config.replicas), ERRORS_ITEM]:
            if item in busy or item in self.given_up or (item in self.finished and item != ERRORS_ITEM):
                continue
            if len(np.setdiff1d(self._item_rows(item), committed.row_ids)):
                self._start(item, committed)

    def _start(self, item: int, committed: Committed) -> None:
        import ray

        why = self.failures[-1]["error"] if self.failures else ""
        job = _with_error_rows(self.planned, self.poisoned, why)
        # The error records need no engine: that actor takes no GPU and no CPU slot.
        opts = engine_actor_options(self.config, needs_engine=item != ERRORS_ITEM)
        actor = self.actor_cls.options(**opts).remote(
            config=self.config, rows=self.planned.rows, group_refs=self.group_refs,
            error_row_ids=job.error_row_ids, extra_errors=job.extra_errors, sink=self.sink,
            done=committed.row_ids, skip=np.asarray(self.poisoned, np.int64), write=self.wopts)
        token = uuid.uuid4().hex
        self.running[actor.run_item.remote(item, token)] = _Running(
            item, actor, token, time.time(), self._item_rows(item))

    def _drain(self) -> None:
        """The parts committed since the last call, and the replicas' live counters, to the
        progress line (called about twice a second)."""
        import ray

        polled = ray.get(self.sink.take_progress.remote())
        self.progress.live(polled["live"])
        for m in polled["parts"]:
            self.manifests.append(m)
            self.progress.update(m)

    def _ended(self, run: _Running, ref: Any, now: Committed) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:
            ray.get(ref)
        except RayActorError as e:
            self._on_death(run, e, now)
            self.last = now
            return
        ray.kill(run.actor)  # its work is done: free its CPUs/GPU now
        self.finished.add(run.item)
        left = np.setdiff1d(run.rows, now.row_ids)
        if len(left):  # a bug, not a fault: starting it again would loop
            raise RuntimeError(f"work item {run.item} finished without committing "
                               f"rows {left[:10].tolist()}")

    def _on_death(self, run: _Running, error: BaseException, now: Committed) -> None:
        """Record a dead engine actor; give its replica up when the ledger says so."""
        import ray

        # A death before the engine was loaded is no row's fault (a node lost, OOM at load).
        loaded = run.token in ray.get(self.sink.status.remote())["engines_ready"]
        self.sink.engine_died.remote(run.item)  # Ray's metrics: engine deaths
        mine = self._item_rows(run.item)
        committed_mine = int(np.isin(mine, now.row_ids).sum())
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        self.failures.append({"item": run.item, "error": why, "engine_loaded": loaded,
                              "rows_committed": now.num_rows, "item_rows_committed": committed_mine,
                              "item_rows_left": int(len(mine) - committed_mine),
                              "after_s": round(time.time() - run.started, 2)})
        give_up = self.ledger.record_failure([run.item] if loaded else [], _gained(self.last, now),
                                             now.num_rows, why)
        for replica in give_up:
            left = np.setdiff1d(self._item_rows(replica), now.row_ids)
            known = set(self.poisoned)
            self.poisoned += [int(r) for r in left if int(r) not in known]
            self.given_up.add(replica)

    def _report(self) -> dict[str, Any]:
        return {"engine_failures": len(self.failures), "failures": self.failures,
                "rows_committed_at_failures": [f["rows_committed"] for f in self.failures],
                "replicas_given_up": sorted(self.given_up), "rows_given_up": len(self.poisoned)}


def _gained(before: Committed, after: Committed) -> dict[int, int]:
    """Rows committed between two reads of the commit records, per replica (-1: error parts)."""
    old = {m["part"] for m in before.manifests}
    gained: dict[int, int] = {}
    for m in after.manifests:
        if m["part"] not in old:
            gained[int(m["replica"])] = gained.get(int(m["replica"]), 0) + int(m["num_rows"])
    return gained


def _with_error_rows(planned: Any, rows: list[int], why: str) -> Any:
    """The planned job with `rows` turned into error records (they failed every attempt)."""
    if not rows:
        return planned
    msg = f"the engine failed on this row in every attempt ({why}): the row was given up"
    return dataclasses.replace(
        planned, error_row_ids=np.concatenate([planned.error_row_ids, np.asarray(rows, np.int64)]),
        extra_errors={**planned.extra_errors, **{r: msg for r in rows}})
