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
from prefixflow.operators.generate import ERRORS_ITEM, ReplicaGenerator
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
    import ray
    from ray.exceptions import RayActorError

    cfg = processor.config
    engine_cls = ray.remote(ReplicaGenerator)
    groups = [planned.plan.groups(r) for r in range(cfg.replicas)]
    group_refs = [ray.put(g) for g in groups]
    replica_rows = [np.concatenate([np.zeros(0, np.int64)] + [g.row_ids for g in gs]).astype(np.int64)
                    for gs in groups]
    ledger = AttemptLedger(max_retries=spec.max_retries_per_row)
    poisoned: list[int] = []  # in the order given up, so that error ranks never move
    given_up: set[int] = set()
    failures: list[dict[str, Any]] = []
    manifests: list[dict] = []
    running: dict[Any, _Running] = {}
    finished: set[int] = set()

    def item_rows(item: int) -> np.ndarray:
        if item == ERRORS_ITEM:
            return np.concatenate([np.asarray(planned.error_row_ids, np.int64),
                                   np.asarray(poisoned, np.int64)])
        return replica_rows[item]

    def start_missing(committed: Committed) -> None:
        """Start an actor for every item that has uncommitted rows and none running."""
        busy = {r.item for r in running.values()}
        why = failures[-1]["error"] if failures else ""
        job = _with_error_rows(planned, poisoned, why)
        for item in [*range(cfg.replicas), ERRORS_ITEM]:
            if item in busy or item in given_up or (item in finished and item != ERRORS_ITEM):
                continue
            if not len(np.setdiff1d(item_rows(item), committed.row_ids)):
                continue
            # The error records need no engine: that actor takes no GPU and no CPU slot.
            opts = engine_actor_options(cfg, needs_engine=item != ERRORS_ITEM)
            actor = engine_cls.options(**opts).remote(
                config=cfg, rows=planned.rows, group_refs=group_refs,
                error_row_ids=job.error_row_ids, extra_errors=job.extra_errors, sink=sink,
                done=committed.row_ids, skip=np.asarray(poisoned, np.int64), write=wopts)
            token = uuid.uuid4().hex
            running[actor.run_item.remote(item, token)] = _Running(item, actor, token, time.time(),
                                                                   item_rows(item))

    def drain() -> None:
        for m in ray.get(sink.take_committed.remote()):
            manifests.append(m)
            progress.update(m)

    last = load_committed(wopts.path, wopts.storage, clean=False)
    start_missing(last)
    try:
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            drain()
            if not ready:
                continue
            # One read of the commit records serves every item that just ended: an ended
            # item's actor writes nothing more, so its rows are all in this read.
            now = load_committed(wopts.path, wopts.storage, clean=False)
            for ref in ready:
                run = running.pop(ref)
                try:
                    ray.get(ref)
                except RayActorError as e:
                    _on_death(run, e, now, last, ledger, sink, failures, item_rows, poisoned,
                              given_up)
                    last = now
                else:
                    ray.kill(run.actor)  # its work is done: free its CPUs/GPU now
                    finished.add(run.item)
                    left = np.setdiff1d(run.rows, now.row_ids)
                    if len(left):  # a bug, not a fault: starting it again would loop
                        raise RuntimeError(f"work item {run.item} finished without committing "
                                           f"rows {left[:10].tolist()}")
            start_missing(now)
        drain()
    finally:
        for run in running.values():  # a job-level failure: stop what still runs
            ray.kill(run.actor)
    return manifests, {
        "engine_failures": len(failures), "failures": failures,
        "rows_committed_at_failures": [f["rows_committed"] for f in failures],
        "replicas_given_up": sorted(given_up), "rows_given_up": len(poisoned)}


def _on_death(run: _Running, error: BaseException, now: Committed, last: Committed,
              ledger: AttemptLedger, sink: Any, failures: list, item_rows: Any, poisoned: list,
              given_up: set) -> None:
    """Record a dead engine actor; give its replica up when the ledger says so."""
    import ray

    # A death before the engine was loaded is no row's fault (a node lost, OOM at load).
    loaded = run.token in ray.get(sink.status.remote())["engines_ready"]
    mine = item_rows(run.item)
    committed_mine = int(np.isin(mine, now.row_ids).sum())
    why = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    failures.append({"item": run.item, "error": why, "engine_loaded": loaded,
                     "rows_committed": now.num_rows, "item_rows_committed": committed_mine,
                     "item_rows_left": int(len(mine) - committed_mine),
                     "after_s": round(time.time() - run.started, 2)})
    give_up = ledger.record_failure([run.item] if loaded else [], _gained(last, now),
                                    now.num_rows, why)
    for replica in give_up:
        left = np.setdiff1d(item_rows(replica), now.row_ids)
        known = set(poisoned)
        poisoned += [int(r) for r in left if int(r) not in known]
        given_up.add(replica)


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
