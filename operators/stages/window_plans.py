"""A job planned in windows: each window's plan a Ray task on any node, the driver merging.

plan_windows reads the tokenized dataset's blocks as Ray Data streams them and cuts them into
windows (pipeline/windows.window_sizes: small first, so that the engines get work within
seconds). Each window is planned by a Ray task (`_plan_window`, the cluster's nodes in turn;
its metadata and hash gathers run beside the blocks as in a whole-job plan), so that
planning a large job is not bounded by the driver's CPU: with `planners` windows in flight,
that many windows plan at once on as many nodes. The driver only numbers the windows on (rows,
units, groups, ranks) and keeps the prefix homes (pipeline/homes.py): each window's plan
returns what its rows add (HomeEntries), merged in window order.

What planning in parallel costs: a window sees the homes of the windows up to `planners`
before it only (window k is planned against the homes after window k - planners), so the
prefixes those in-flight windows computed are not yet steered to their replica. The rule is
fixed by the window's number, not by which task finished first, so the plan is the same in
every run (a resume checks each window against the first run's, jobs/run.py). planners = 1 is
one window planned at a time, each against every window before it.

OpenAI batch input (custom_ids, which must be unique across the whole job) is planned one window
at a time on the driver, which keeps every custom_id seen: a window's duplicates are found
against the windows' before it without sending that table to a task and back for each window.

A planning task holds 0.25 CPU slot (PLANNER_CPUS) although its plan keeps a core busy: the slots
are what the job's resource check keeps for planning (operators/stages/supervise.planning_cpus),
and planning on the driver, before, held none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from prefixflow.operators.stages.plan import PlannedJob, PlanOptions, plan_blocks
from prefixflow.operators.stages.windows import END, POLL_S  # the feed's end of stream and wait step
from prefixflow.pipeline.homes import HomeEntries, PrefixHomes, estimated_cache_blocks
from prefixflow.pipeline.windows import WindowedPlan, continued_table, window_sizes

# A planning task's CPU share: the metadata and hash gathers it waits on take 0.25 each (plan.py),
# and a task blocked in ray.get lends its share back, so nested gathers never starve.
PLANNER_CPUS = 0.25


def plan_windows(ds: Any, window_rows: int, planners: int = 1, **options: Any) -> Generator[PlannedJob, None, None]:
    """Plan the tokenized dataset `ds` in windows of about `window_rows` rows, in row order:
    window k holds the rows after window k-1's. A window ends at the first block boundary past
    its size, so the windows (and, for a given `planners`, the plans) are the same in every run
    that reads the same blocks. Up to `planners` windows plan at once, each a Ray task (module
    doc); they are yielded in window order, each as soon as it and those before it are planned.
    options: PlanOptions' fields."""
    if planners < 1:
        raise ValueError(f"planners={planners} is invalid: plan at least 1 window at a time")
    opts = PlanOptions(**options)
    flight = _WindowsInFlight(opts, 1 if opts.custom_ids else planners)
    sizes = window_sizes(window_rows)
    reader = _BundleReader(ds)
    refs: list[Any] = []
    rows, target, waited = 0, next(sizes), time.perf_counter()
    try:
        while (got := reader.get(flight.waiting)) is not END:
            if got is not None:  # a bundle: (its block refs, its rows)
                refs, rows = refs + got[0], rows + got[1]
                if rows >= target:
                    yield from flight.submit(refs, rows, time.perf_counter() - waited)
                    refs, rows, target, waited = [], 0, next(sizes), time.perf_counter()
            yield from flight.ready()
        if refs or flight.submitted == 0:  # the rest; an empty dataset is one empty window
            yield from flight.submit(refs, rows, time.perf_counter() - waited)
        yield from flight.drain()
    finally:  # the last window taken, a failure, or the consumer done early (closed)
        reader.stop()
        flight.cancel()


class _BundleReader:
    """The tokenized dataset's bundles, read on a thread at most two ahead of plan_windows (one
    queued, one waiting to be: Ray Data reads no further than that), so that plan_windows can
    hand a window out as soon as its plan is done, while the next bundle is still being read."""

    def __init__(self, ds: Any):
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.stopping = threading.Event()
        threading.Thread(target=self._read, args=(ds,), name="prefixflow-window-reader", daemon=True).start()

    def _read(self, ds: Any) -> None:
        try:
            for bundle in ds.iter_internal_ref_bundles():
                if not self._put((list(bundle.block_refs), _bundle_rows(bundle))):
                    return
            self._put(END)
        except BaseException as e:  # noqa: BLE001 - raised where the windows are read (get)
            self._put(e)

    def _put(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self, poll: bool) -> Any:
        """The next bundle, END, or None where `poll` and none came within POLL_S."""
        try:
            item = self.ready.get(timeout=POLL_S if poll else None)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self.stopping.set()


def _bundle_rows(bundle: Any) -> int:
    """Rows of a bundle, from its blocks' metadata: the next window's first row id is known
    before this one is planned (windows plan in parallel)."""
    n = bundle.num_rows()
    if n is None:
        raise RuntimeError("a tokenized block came without its row count: windows cannot be numbered")
    return int(n)


class _WindowsInFlight:
    """The planning tasks in flight, the prefix homes after each window merged, and the job's
    numbering so far (plan_windows; the module doc says which homes a window is planned with)."""

    def __init__(self, opts: PlanOptions, planners: int):
        self.opts, self.planners = opts, planners
        capacity = opts.cache_blocks if opts.cache_blocks is not None else estimated_cache_blocks(opts.block_size)
        # homes[k]: the homes after the windows before window k (homes[0]: none); kept from the
        # oldest that a window still to be submitted needs.
        self.homes: dict[int, PrefixHomes] = {0: PrefixHomes.empty(opts.num_replicas, capacity)}
        self.seen: dict[Any, int] = {}  # custom_id -> its first row (custom_ids: planned on the driver)
        self.flying: deque[tuple[int, Any]] = deque()  # (window, its task's ref, or its plan made here)
        self.submitted, self.next_row = 0, 0
        self.last: PlannedJob | None = None  # the last window yielded

    def submit(self, refs: list[Any], rows: int, read_s: float) -> Iterator[PlannedJob]:
        """Plan the window of `refs` (`rows` rows) in a task, against the homes after window
        k - planners (waiting for that window first); yields the windows finished meanwhile."""
        import ray

        k = self.submitted
        while k - self.planners + 1 > self._merged_upto():
            yield self._finish()
        homes = self.homes[max(k - self.planners + 1, 0)]
        if self.opts.custom_ids:  # planned here, against (and adding to) every custom_id before
            self.flying.append((k, _plan_window(refs, self.opts, self.next_row, read_s, self.seen, homes)))
        else:
            task = ray.remote(_plan_window).options(num_cpus=PLANNER_CPUS, scheduling_strategy=_node_for(k))
            self.flying.append((k, task.remote(refs, self.opts, self.next_row, read_s, None, homes)))
        self.submitted, self.next_row = k + 1, self.next_row + rows
        for old in [j for j in self.homes if j < min(k - self.planners + 2, self._merged_upto())]:
            del self.homes[old]  # no window still to be submitted is planned against these

    @property
    def waiting(self) -> bool:
        """Windows are being planned: look for finished ones while bundles are awaited."""
        return bool(self.flying)

    def ready(self) -> Iterator[PlannedJob]:
        """The windows at the front that have finished planning, in order."""
        import ray

        while self.flying and (
            isinstance(self.flying[0][1], PlannedJob) or ray.wait([self.flying[0][1]], timeout=0)[0]
        ):
            yield self._finish()

    def cancel(self) -> None:
        """Stop the planning tasks still in flight (windows nobody will take)."""
        import ray

        for _, ref in self.flying:
            if not isinstance(ref, PlannedJob):  # a task's (one already done ignores it)
                ray.cancel(ref)
        self.flying.clear()

    def drain(self) -> Iterator[PlannedJob]:
        while self.flying:
            yield self._finish()

    def _merged_upto(self) -> int:
        """The number of windows whose homes are merged (homes[that] exists)."""
        return max(self.homes)

    def _finish(self) -> PlannedJob:
        """The front window once planned: numbered on from the window before, its homes merged."""
        import ray

        k, ref = self.flying.popleft()
        planned = ref if isinstance(ref, PlannedJob) else ray.get(ref)
        entries = planned.home_entries if planned.home_entries is not None else HomeEntries.empty()
        self.homes[k + 1] = self.homes[k].merged(entries)
        before = self.last
        if before is not None:
            end = before.rows.first_row + before.rows.num_rows
            if planned.rows.first_row != end:  # the blocks' row counts disagree with their rows
                raise RuntimeError(f"window {k} starts at row {planned.rows.first_row}, the one before ends at {end}")
            planned = dataclasses.replace(planned, **before.next_offsets())
        self.last = dataclasses.replace(planned, window=k)
        return self.last


def _node_for(window: int) -> Any:
    """Where window `window` is planned: the cluster's nodes with CPUs in turn, elsewhere when
    that node is gone or its CPU slots are taken (engine actors hold theirs while they wait for
    work: soft affinity alone would wait for that node for good). Ray's SPREAD would not do: it
    reuses the worker leased for the window before, so every window of a job planned on one node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0)
    if not nodes:
        return "DEFAULT"
    return NodeAffinitySchedulingStrategy(node_id=nodes[window % len(nodes)], soft=True, _spill_on_unavailable=True)


def _plan_window(
    refs: list[Any],
    opts: PlanOptions,
    first_row: int,
    read_s: float,
    seen: dict[Any, int] | None,
    homes: PrefixHomes,
) -> PlannedJob:
    """One window's plan (a Ray task; for custom_ids a call on the driver, `seen` updated in
    place): its numbering the window's own, its home_entries what its rows add to the homes."""
    import ray

    t0 = time.perf_counter()
    planned = plan_blocks(refs, opts, first_row=first_row, read_s=read_s, seen=seen, homes=homes)
    timings = {**planned.timings, "plan_task_s": time.perf_counter() - t0}
    where = ray.get_runtime_context().get_node_id()
    return dataclasses.replace(planned, timings=timings, planned_on=where)


def window_summary(window: PlannedJob, keep_table: bool = False) -> PlannedJob:
    """What the job keeps of a window once it is queued: its plan's summary and group sizes,
    and its table in the job's numbering where asked (pipeline/windows.WindowedPlan; the units'
    tokens and hashes may go)."""
    plan = window.plan
    zeros = (0,) * plan.num_replicas
    table = continued_table(plan.table, window.first_group, window.first_ranks or zeros) if keep_table else None
    return dataclasses.replace(window, plan=WindowedPlan(table, plan.summary, plan.group_sizes), home_entries=None)


def joined_windows(windows: list[PlannedJob]) -> PlannedJob:
    """The whole job planned in `windows` (window_summary()s, in window order), as the report
    and a dry run read a PlannedJob: its plan the windows' joined (WindowedPlan.join), rows and
    error rows joined, timings and bytes summed, and a content digest over the windows'."""
    rows = windows[0].rows
    for w in windows[1:]:
        rows = rows.joined(w.rows)
    timings: dict[str, float] = {}
    for w in windows:
        for key, value in w.timings.items():
            timings[key] = timings.get(key, 0.0) + value
    return PlannedJob(
        WindowedPlan.join([w.plan for w in windows]),
        rows,
        np.concatenate([w.error_row_ids for w in windows]),
        {k: v for w in windows for k, v in w.extra_errors.items()},
        timings,
        hashlib.sha256("".join(w.content_digest for w in windows).encode("ascii")).hexdigest(),
        sum(w.driver_bytes for w in windows),
    )
