"""The one driver of a job's engine actors, for every face: R actors under Ray core, fed by one
work queue, each restarted alone when it dies.

    manifests, faults = Supervisor(config, planned, sink, wopts, max_retries, progress).run()
    for _ in Supervisor(config, planned, sink, None, max_retries).steps(): ...  # the Python API

One actor per replica runs `ReplicaGenerator.run_item`, taking plan units from the run's
work queue (operators/stages/work_queue.py, in the job's actor, job_hub.py: its own replica's
in plan order, then, run dry, unstarted units of the busiest replica) and committing each part itself: to the output path
(a job run from a spec, operators/results/commit.py), or, with no WriteOptions (the Python API,
whose rows leave as a Dataset's blocks), to the job's MetricsSink, which keeps each committed
block in the object store until the driver takes it (operators/results/sink.MetricsSink.commit_block).
One more actor writes the error records (ERRORS_ITEM). When an actor dies, the units it held go back
to its replica's queue with their uncommitted rows, and its replica starts again on a new
actor; the others never stop, and take those units themselves when the new actor cannot start
(a node lost). An actor whose resources do not exist yet (a node to be added) starts when they
do and takes work then. Whether a death is a row's fault, and when to give a replica up or stop
the job, is decided by operators/stages/attempts.py.

Ray Data's actor pool is not used here on purpose: a dead actor fails its whole execution,
which stops every replica (and reloads every model) for one death.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.results.commit import Committed, load_committed
from prefixflow.operators.results.write import WriteOptions
from prefixflow.operators.stages.attempts import AttemptLedger
from prefixflow.operators.stages.generate import ERRORS_ITEM, ReplicaGenerator
from prefixflow.operators.stages.plan import PlannedJob, unit_payload_refs
from prefixflow.operators.stages.window_plans import PLANNER_CPUS
from prefixflow.operators.stages.windows import END, WindowFeed

if TYPE_CHECKING:
    from prefixflow.operators.stages.job_hub import RunQueue

logger = logging.getLogger(__name__)


class Progress(Protocol):
    """What the driver tells a progress display (jobs/report.Progress, the CLI's line)."""

    def live(self, replicas: dict[int, dict[str, Any]]) -> None: ...

    def update(self, manifest: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class _Running:
    item: int
    actor: Any
    token: str  # names this run of the item to the sink
    started: float
    rows: np.ndarray  # the error item's rows when it started (committed ones included)


class Supervisor:
    """The engine actors of one job run and their work queue: starts an actor per replica while
    units are queued (and one for the error records), restarts a replica whose actor died after
    handing its units back, gives a replica up when the ledger says so.

    sink: the job's actor (operators/stages/job_hub.start_sink), which also holds this run's
        work queue.
    wopts: where the actors commit their parts; None: to the sink (the Python API).
    progress: the driver's display of committed parts and live counters (None: none).
    engine_options: Ray options of the engine actors (default engine_actor_options(config)).
    engines: replica -> its engine actor, started (and loading) while the job was planned
        (start_engines); the replicas without one start theirs when the run starts.
    windows: the job's later windows (operators/stages/window_plans.plan_windows; `planned` is the
        first), taken on a thread (operators/stages/windows.py) while the engines run the windows
        before; each is queued once fewer units than half the last window's are left unstarted
        (so that one window is ready ahead of those queued, whatever the job's size).
        on_window(window) hears each before its units are queued (a resume checks it is the
        window the first run planned).
    """

    def __init__(
        self,
        config: ProcessorConfig,
        planned: PlannedJob,
        sink: Any,
        wopts: WriteOptions | None,
        max_retries_per_row: int,
        progress: Progress | None = None,
        engine_options: dict[str, Any] | None = None,
        engines: dict[int, Any] | None = None,
        windows: Iterator[PlannedJob] | None = None,
        on_window: Callable[[PlannedJob], None] | None = None,
    ):
        self.config, self.sink, self.wopts, self.progress = (config, sink, wopts, progress)
        self.engine_options = engine_actor_options(config) if engine_options is None else engine_options
        # Engine actors started before the plan (start_engines), each taken (popped) by its
        # replica's first start. The caller's dict itself: whoever ends first stops the rest.
        self.engines = engines if engines is not None else {}
        # The job so far (every window queued): where its rows are, and its error records.
        self.rows, self.error_row_ids, self.extra_errors = planned.rows, planned.error_row_ids, planned.extra_errors
        self.payloads = unit_payload_refs(planned, config.replicas)
        self.unit_rows: list[np.ndarray] = window_unit_rows(planned)
        self.on_window = on_window
        self.windows = WindowFeed(windows, self.config.replicas) if windows is not None else None
        self.last_window_units = planned.num_units
        self.ledger = AttemptLedger(max_retries=max_retries_per_row)
        self.poisoned: list[int] = []  # rows given up, in the order given up
        self.given_up: set[int] = set()
        self.failures: list[dict[str, Any]] = []
        self.manifests: list[dict] = []
        self.running: dict[Any, _Running] = {}  # task ref -> its run
        # Without an output path, the sink keeps this run's committed blocks under this key.
        self.commit_run = uuid.uuid4().hex if wopts is None else ""
        self.queue_status: dict[str, Any] | None = None  # the work queue's, when the run ended
        self.actor_starts: dict[int, int] = {}  # work item -> engine actors started for it
        self.last = self._committed()
        self.queue = self._start_queue(planned, self.last)

    def _committed(self) -> Committed:
        """Every row committed so far: the output path's commit records, or the sink's."""
        import ray

        if self.wopts is None:
            return ray.get(self.sink.committed_rows.remote(self.commit_run))
        return load_committed(self.wopts.path, self.wopts.storage, clean=False)

    def _start_queue(self, planned: PlannedJob, committed: Committed) -> RunQueue:
        """This run's WorkQueue, in the job's hub (on the driver's node: it lives as long as the
        driver), holding every unit with rows left (a resume: less the committed ones)."""
        # lazy: job_hub imports Ray (its actor's methods are declared with ray.method), and
        # `import prefixflow` (which reaches this module) needs no Ray
        from prefixflow.operators.stages.job_hub import open_queue

        replica, seconds, rows_left, done = _queued_units(planned.plan, self.unit_rows, 0, committed)
        return open_queue(
            self.sink,
            replica,
            seconds,
            self.config.replicas,
            rows_left,
            done,
            self.config.work_stealing,
            [ref for refs in self.payloads for ref in refs],  # by unit id: replica by replica
            closed=self.windows is None,
            unit_shared=planned.plan.unit_shared.tolist(),
        )

    def _take_window(self) -> None:
        """Queue the next window of a job planned in windows when the queue runs low (class
        docstring), or close the queue after the last. A failed read or plan of a window fails
        the job here, as soon as it is known."""
        import ray

        if self.windows is None or self.windows.ended:
            return
        self.windows.check()
        counts = ray.get(self.queue.counts())
        nobody = self.given_up.issuperset(range(self.config.replicas))  # its rows become error records
        if counts["num_queued"] > self.last_window_units // 2 and not nobody:
            return
        got = self.windows.poll()
        if got is END:
            self.queue.close()
            stop_engines(self.engines)  # started for replicas that never had work
        elif got is not None:
            self._queue_window(*got)

    def _queue_window(self, window: PlannedJob, payloads: list[list[Any]]) -> None:
        """The window's units into the work queue, after on_window; replicas that may take them
        started. Without work stealing, a given-up replica's units become error records."""
        import ray

        now = self._committed()
        if self.on_window is not None:
            self.on_window(window)  # before any of its rows can run
        rows = window_unit_rows(window)
        replica, seconds, rows_left, done = _queued_units(window.plan, rows, window.first_unit, now)
        self.unit_rows += rows
        self.rows = self.rows.joined(window.rows)
        self.error_row_ids = np.concatenate([self.error_row_ids, window.error_row_ids])
        self.extra_errors = {**self.extra_errors, **window.extra_errors}
        self.last_window_units = window.num_units
        flat = [ref for refs in payloads for ref in refs]
        first = ray.get(self.queue.add(replica, seconds, flat, rows_left, done, window.plan.unit_shared.tolist()))
        if first != window.first_unit:  # unit ids are the windows' numbering: a bug, not a fault
            raise RuntimeError(f"window {window.window} starts at unit {window.first_unit}, the queue at {first}")
        if not self.config.work_stealing:
            for r in self.given_up:
                self._poison(self._drop_queued(r, now))
        self._start_missing(now)

    def _drop_queued(self, replica: int, committed: Committed) -> dict[int, np.ndarray]:
        """The units queued for a given-up replica out of the queue (the static plan: nobody else
        takes them), and their uncommitted rows."""
        import ray

        queued = ray.get(self.queue.drop(replica))
        return {u: np.setdiff1d(self.unit_rows[u], committed.row_ids) for u in queued}

    def _poison(self, rows: dict[int, np.ndarray]) -> None:
        """These units' rows become error records (they failed every attempt, or nobody is left
        to run them)."""
        known = set(self.poisoned)
        self.poisoned += [int(r) for left in rows.values() for r in left if int(r) not in known]

    def _windows_left(self) -> bool:
        return self.windows is not None and not self.windows.ended

    def run(self) -> tuple[list[dict], dict[str, Any]]:
        """Run every uncommitted row; returns this run's manifest rows and the fault report."""
        for _ in self.steps():
            pass
        return self.manifests, self.report()

    def steps(self) -> Iterator[None]:
        """run's loop, yielding about twice a second (and whenever an item ends) so that the
        caller can take what was committed. Closing it early stops every actor."""
        import ray

        try:
            self._start_missing(self.last)
            if self.windows is None:  # a started engine whose replica has nothing to run: its resources back
                stop_engines(self.engines)
            # Every unit's payload is built on this node before anything else happens (while the
            # engines load): from here on, a lost worker node loses no unit another must take.
            refs = [ref for refs in self.payloads for ref in refs]
            ray.wait(refs, num_returns=len(refs), fetch_local=False)
            # From here the queue holds them, and lets each go when its unit is done.
            refs, self.payloads = [], []
            if self.windows is not None:
                self.windows.start()
            while self.running or self._windows_left():
                self._take_window()
                if not self.running:  # nothing runs until the next window is queued
                    time.sleep(0.2)
                    self._drain()
                    yield
                    continue
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=0.5)
                self._drain()
                if ready:
                    self._retire([self.running[ref].token for ref in ready])
                    # One read of the commits serves every item that just ended: an ended
                    # item's actor commits nothing more, so its rows are all in this read.
                    now = self._committed()
                    for ref in ready:
                        self._ended(self.running.pop(ref), ref, now)
                    self._start_missing(now)
                else:
                    self._stop_idle()
                yield
            self._drain()
        finally:
            stop_engines(self.engines)
            if self.windows is not None:
                self.windows.stop()
            for run in self.running.values():  # a job-level failure: stop what still runs
                ray.kill(run.actor)
            self.queue_status = ray.get(self.queue.end())

    def _retire(self, tokens: list[str]) -> None:
        """The sink takes no more commits from these engines' runs (they ended, or died with a
        commit perhaps still on its way): what the next read of the commits holds is final."""
        import ray

        if self.wopts is None:  # a part on an output path is fenced by its commit record
            ray.get(self.sink.retire.remote(self.commit_run, tokens))

    def _start_missing(self, committed: Committed) -> None:
        """Start an actor for every replica that has none running, is not given up and may take
        a queued unit (at the start; after a death handed some back, an ended replica starts
        again too), and for the error records when some are left."""
        import ray

        busy = {r.item for r in self.running.values()}
        queued = ray.get(self.queue.counts())["queued"]
        if sum(queued) and self.given_up.issuperset(range(self.config.replicas)):
            self._give_up_the_rest(committed)  # no replica left to take the queued units
            queued = [0] * len(queued)
        for item in replicas_to_start(queued, busy, self.given_up, self.config.work_stealing):
            self._start(item, committed)
        if ERRORS_ITEM not in busy and len(np.setdiff1d(self._error_rows(), committed.row_ids)):
            self._start(ERRORS_ITEM, committed)

    def _give_up_the_rest(self, committed: Committed) -> None:
        """Every replica was given up: the rows still queued become error records too."""
        self._poison({-1: np.setdiff1d(np.concatenate(self.unit_rows or [np.zeros(0, np.int64)]), committed.row_ids)})

    def _error_rows(self) -> np.ndarray:
        return self._error_records("")[0]

    def _start(self, item: int, committed: Committed) -> None:
        self.actor_starts[item] = self.actor_starts.get(item, 0) + 1
        why = self.failures[-1]["error"] if self.failures else ""
        error_row_ids, extra_errors = self._error_records(why)
        # The error records need no engine: that actor takes no GPU and no CPU slot.
        opts = self.engine_options if item != ERRORS_ITEM else engine_actor_options(self.config, needs_engine=False)
        actor = self.engines.pop(item, None) or new_engine_actor(self.config, opts)
        actor.take_job.remote(
            rows=self.rows,
            error_row_ids=error_row_ids,
            extra_errors=extra_errors,
            sink=self.sink,
            done=committed.row_ids,
            skip=np.asarray(self.poisoned, np.int64),
            write=self.wopts,
            commit_run=self.commit_run,
        )
        token = uuid.uuid4().hex
        queue = None if item == ERRORS_ITEM else self.queue
        self.running[actor.run_item.remote(item, token, queue)] = _Running(
            item, actor, token, time.time(), self._error_rows() if item == ERRORS_ITEM else np.zeros(0, np.int64)
        )

    def _error_records(self, why: str) -> tuple[np.ndarray, dict[int, str]]:
        """The rows that become error records, and why where the row does not say: the plan's,
        and those given up (they failed every attempt)."""
        if not self.poisoned:
            return np.asarray(self.error_row_ids, np.int64), self.extra_errors
        msg = f"the engine failed on this row in every attempt ({why}): the row was given up"
        return (
            np.concatenate([self.error_row_ids, np.asarray(self.poisoned, np.int64)]),
            {**self.extra_errors, **dict.fromkeys(self.poisoned, msg)},
        )

    def _stop_idle(self) -> None:
        """Once every unit is done, stop the replica actors that never loaded their engine
        (waiting for resources that may never come: a node lost): none has work left."""
        import ray

        if not ray.get(self.queue.counts())["all_done"]:
            return
        ready = ray.get(self.sink.status.remote())["engines_ready"]
        for ref, run in list(self.running.items()):
            if run.item != ERRORS_ITEM and run.token not in ready:
                ray.kill(run.actor)
                del self.running[ref]

    def _drain(self) -> None:
        """The parts committed since the last call, and the replicas' live counters, to the
        progress line (called about twice a second)."""
        import ray

        polled = ray.get(self.sink.take_progress.remote())
        if self.progress is not None:
            self.progress.live(polled["live"])
        for m in polled["parts"]:
            self.manifests.append(m)
            if self.progress is not None:
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
        left = np.setdiff1d(run.rows, now.row_ids)
        if len(left):  # a bug, not a fault: starting it again would loop
            raise RuntimeError(f"work item {run.item} finished without committing rows {left[:10].tolist()}")

    def _on_death(self, run: _Running, error: BaseException, now: Committed) -> None:
        """Record a dead engine actor; hand its units back to the queue (their uncommitted
        rows), or give its replica up when the ledger says so (those rows become errors)."""
        import ray

        # A death before the engine was loaded is no row's fault (a node lost, OOM at load).
        loaded = run.token in ray.get(self.sink.status.remote())["engines_ready"]
        self.sink.engine_died.remote(run.item)  # Ray's metrics: engine deaths
        held = ray.get(self.queue.held(run.token)) if run.item != ERRORS_ITEM else []
        left = {u: np.setdiff1d(self.unit_rows[u], np.union1d(now.row_ids, self.poisoned)) for u in held}
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        self.failures.append(
            {
                "item": run.item,
                "error": why,
                "engine_loaded": loaded,
                "rows_committed": now.num_rows,
                "units_held": len(held),
                "item_rows_left": int(sum(len(v) for v in left.values())),
                "after_s": round(time.time() - run.started, 2),
            }
        )
        give_up = self.ledger.record_failure([run.item] if loaded else [], _gained(self.last, now), now.num_rows, why)
        if run.item in give_up:  # its rows failed every attempt: error records now
            if not self.config.work_stealing:  # nobody else will take its queued units either
                left.update(self._drop_queued(run.item, now))
            self._poison(left)
            left = {}
        if run.item != ERRORS_ITEM:
            ray.get(self.queue.release(run.token, {u: v.tolist() for u, v in left.items()}, run.item))
        self.given_up.update(give_up)

    def report(self) -> dict[str, Any]:
        """The fault report of the run (metrics.json's fault_tolerance, with the counts of rows)."""
        status = self.queue_status or {"units": 0, "steals": [], "paces": []}
        return {
            "engine_failures": len(self.failures),
            "failures": self.failures,
            "rows_committed_at_failures": [f["rows_committed"] for f in self.failures],
            "replicas_given_up": sorted(self.given_up),
            "actor_starts": dict(self.actor_starts),
            "rows_given_up": len(self.poisoned),
            "work_queue": {"units": status["units"], "steals": status["steals"], "paces": status["paces"]},
        }


def start_engines(cfg: ProcessorConfig, options: dict[str, Any]) -> dict[int, Any]:
    """One engine actor per replica, loading its model now, while the job is read and planned
    (the Supervisor hands each its work once the plan is made): replica -> actor. None are
    started where they would take the CPU slots the planning stages need: engines that use GPUs
    start at once; CPU engines only where the cluster's free CPUs hold them and the tokenize
    pool with one slot to spare (else the plan could wait for a slot that an engine, waiting for
    the plan, holds)."""
    short = cpus_short(cfg, options)
    if short is not None:
        logger.info("the engines start after the plan: %g free CPUs, %g needed to start them now", *short)
        return {}
    engines = {r: new_engine_actor(cfg, options) for r in range(cfg.replicas)}
    for actor in engines.values():
        actor.load.remote()  # a failed load surfaces at the replica's run_item, as a death before loading
    return engines


SLOT_RELEASE_GRACE_S = 30.0  # how long a windowed job waits for CPU slots a finished job still holds


def cpus_short(cfg: ProcessorConfig, options: dict[str, Any]) -> tuple[float, float] | None:
    """(free CPUs, CPUs needed) where the cluster's free CPU slots cannot hold the job's engine
    actors (with `options`) and its tokenize tasks at once, with planning_cpus to spare for the
    planning tasks; None where they can (or the engines take GPUs: they are started at once)."""
    import ray

    if options.get("num_gpus"):
        return None
    free = ray.available_resources().get("CPU", 0.0)
    needed = cfg.replicas * options.get("num_cpus", 1) + cfg.tokenize_concurrency + planning_cpus(cfg)
    return (free, needed) if free < needed else None


def planning_cpus(cfg: ProcessorConfig) -> float:
    """CPU slots kept for the planning tasks: one, or a windowed job's planners' where more."""
    return max(1.0, cfg.window_planners * PLANNER_CPUS) if cfg.windowed else 1.0


def check_window_resources(
    cfg: ProcessorConfig, options: dict[str, Any], grace_s: float = SLOT_RELEASE_GRACE_S
) -> None:
    """A job planned in windows runs its engines while it tokenizes the next window: refused
    where the cluster cannot hold both (the engines would wait forever for a window that no
    CPU slot is left to tokenize). Slots short are waited for up to `grace_s` first: the actors
    of a job that just finished in the same cluster (a notebook's previous cell, the test
    before) give theirs back within seconds."""
    if not cfg.windowed:
        return
    deadline = time.monotonic() + grace_s
    short = cpus_short(cfg, options)
    while short is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        short = cpus_short(cfg, options)
    if short is not None:
        raise ValueError(
            f"window_rows={cfg.window_rows}: a job planned in windows runs its engines while it reads and "
            f"tokenizes the next window, and the cluster has {short[0]:g} free CPUs where {short[1]:g} are "
            f"needed ({cfg.replicas} replicas x {options.get('num_cpus', 1):g} CPUs, {cfg.tokenize_concurrency} "
            f"tokenize tasks and {planning_cpus(cfg):g} for planning): lower replicas, resources.num_cpus_per_replica or "
            "tokenize.concurrency, use a larger cluster, or plan the job whole (window_rows: 0)"
        )


@functools.cache
def _engine_actor_class() -> Any:
    """ReplicaGenerator as a Ray actor class, made once (Ray exports it again to each new
    cluster a process joins)."""
    import ray

    return ray.remote(ReplicaGenerator)


def new_engine_actor(cfg: ProcessorConfig, options: dict[str, Any]) -> Any:
    """A replica's engine actor with these Ray options (engine_actor_options); it loads its
    model when asked (load) or at its first run_item."""
    return _engine_actor_class().options(**options).remote(cfg)


def stop_engines(engines: dict[int, Any]) -> None:
    """Stop the started engines no replica took (left in `engines`, which this empties)."""
    import ray

    for actor in engines.values():
        ray.kill(actor)
    engines.clear()


def engine_actor_options(cfg: ProcessorConfig, needs_engine: bool = True) -> dict[str, Any]:
    """Ray options of an engine actor: its resources (none when it only writes error records,
    needs_engine=False); spread over the cluster's nodes (data-parallel replicas share no
    state, and each one wants a node's memory bandwidth to itself); no restarts, no task
    retries (a death is handled by whoever runs the actors, which knows what was committed)."""
    opts: dict[str, Any] = {
        "num_cpus": cfg.num_cpus_per_replica if needs_engine else 0,
        "max_restarts": 0,
        "max_task_retries": 0,
        "scheduling_strategy": "SPREAD",
    }
    gpus = gpus_per_replica(cfg) if needs_engine else 0
    if gpus:
        opts["num_gpus"] = gpus
    if cfg.runtime_env is not None:
        opts["runtime_env"] = cfg.runtime_env
    return opts


def gpus_per_replica(cfg: ProcessorConfig) -> float:
    """An engine actor's GPUs: num_gpus_per_replica, or where that is None (decide when the job
    runs) the engine's tensor_parallel_size x pipeline_parallel_size on a cluster with GPUs,
    none on one without (vLLM's CPU backend, the native engine on CPUs); none for engines
    that send their work to servers (backend http)."""
    if cfg.backend == "http":
        return 0.0
    if cfg.num_gpus_per_replica is not None:
        return cfg.num_gpus_per_replica
    import ray

    if not ray.cluster_resources().get("GPU"):
        return 0.0
    return float(cfg.engine_workers)


def replicas_to_start(queued: list[int], running: set[int], given_up: set[int], stealing: bool) -> list[int]:
    """The replicas to start an engine for: none running, not given up, and a queued unit it
    may take (queued[r]: units in replica r's queue). With stealing, any queued unit; without
    (the static plan), only its own: a replica whose queue ran dry would start, find nothing
    and end, again and again, loading its model each time while the others still run."""
    return [
        r
        for r in range(len(queued))
        if r not in running and r not in given_up and (queued[r] if not stealing else sum(queued)) > 0
    ]


def _gained(before: Committed, after: Committed) -> dict[int, int]:
    """Rows committed between two reads of the commit records, per replica (-1: error parts)."""
    old = {m["part"] for m in before.manifests}
    gained: dict[int, int] = {}
    for m in after.manifests:
        if m["part"] not in old:
            gained[int(m["replica"])] = gained.get(int(m["replica"]), 0) + int(m["num_rows"])
    return gained


def window_unit_rows(planned: PlannedJob) -> list[np.ndarray]:
    """Each unit's row ids, in the order of the window's unit ids."""
    plan = planned.plan
    row_ids = plan.table.column("row_id").to_numpy().astype(np.int64)
    return np.split(row_ids, plan.unit_starts[1:-1]) if plan.num_units else []


def _queued_units(
    plan: Any, unit_rows: list[np.ndarray], first_unit: int, committed: Committed
) -> tuple[list[int], list[float], dict[int, list[int]], list[int]]:
    """What the work queue takes of a plan's units (numbered from first_unit): each one's
    replica and predicted seconds, the uncommitted rows of those partly committed (a resume),
    the units committed whole."""
    rows_left, done = {}, []
    for k, rows in enumerate(unit_rows):
        left = np.setdiff1d(rows, committed.row_ids)
        if not len(left):
            done.append(first_unit + k)
        elif len(left) < len(rows):
            rows_left[first_unit + k] = left.tolist()
    replica = plan.table.column("replica").to_numpy()[plan.unit_starts[:-1]].tolist()
    return replica, plan.unit_seconds.tolist(), rows_left, done
