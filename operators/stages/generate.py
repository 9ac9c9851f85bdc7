"""Generate stage: engine actors, each running the plan units it is given.

The job's driver (operators/stages/supervise.py, for a job from a spec and for the Python API
alike) starts one `ReplicaGenerator` actor per replica and calls `run_item`: the actor takes
units from the run's work queue (operators/stages/work_queue.py, in the job's actor:
job_hub.py) as its engine has room, its own replica's first, then (run dry) unstarted ones of
the busiest replica, and commits each part itself (to the output path, or to the
sink). It hands the units to a ReplicaRunner, which every path shares (the streaming
batch_generator.Generator too): it loads the engine of the configured backend (native or vLLM)
once, feeds it the units' groups lazily and yields output blocks as requests finish.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import pyarrow as pa

from prefixflow.engine.intake import IDLE_POLL_S, NOT_READY
from prefixflow.engine.outputs import EngineTotals, RequestOutput, StepStats, error_output, summed_totals
from prefixflow.engine.scoring.choices import ScoreOutput
from prefixflow.engine.scoring.options import ScoreOptions
from prefixflow.engine.scoring.pooling import EmbedOutput
from prefixflow.operators.columns import ERROR, SOURCE
from prefixflow.operators.config import PREFILL_TASKS, ProcessorConfig
from prefixflow.operators.results.outputs import error_records, output_chunk, plain, token_counts
from prefixflow.operators.results.score import row_choices
from prefixflow.operators.results.write import WriteOptions, part_manifest, ray_node_id, write_part
from prefixflow.operators.row_sampling import row_params
from prefixflow.operators.stages.isolate import run_isolated, without_rows
from prefixflow.operators.stages.plan import RowIndex, UnitPayload, fetch_rows
from prefixflow.operators.stages.work_queue import DONE, WAIT, Take
from prefixflow.pipeline.plan import PlanUnit

if TYPE_CHECKING:
    from prefixflow.operators.stages.job_hub import RunQueue

logger = logging.getLogger(__name__)
ERRORS_ITEM = -1
PROGRESS_EVERY_S = 0.5  # how often a running replica reports its counters (live progress line)
REPORT_EVERY_S = 0.5  # how often an engine tells the work queue of its outputs (its pace)
WAIT_RETRY_S = 0.25  # how long an engine told to WAIT goes on with what it holds before asking again
# A job's engine commits its first part of each plan replica at this share of rows_per_chunk, so
# that the job's first results are on storage within seconds of its first row (a window of a
# windowed job holds a few hundred rows per replica at first: at 1,000 rows a part, the first
# part waited for the third window), as the windows start small (pipeline/windows.py); never
# under FIRST_PART_MIN_ROWS rows (a part of a few rows buys nothing).
FIRST_PART_SHARE = 8
FIRST_PART_MIN_ROWS = 16


class GeneratingEngine(Protocol):
    """What a replica's runner uses of a generating engine (LLMEngine, VllmEngine): `run` over
    planned groups as it has room, `reset` after a failed run, and the last run's records,
    `stats` (one StepStats per step, appended as it runs: the live progress reads it) and
    `totals` (set when the run ends)."""

    stats: list[StepStats]
    totals: EngineTotals | None

    def run(self, groups: Iterable[Any], params: Any) -> Iterator[RequestOutput]: ...

    def reset(self) -> None: ...


class ScoringEngine(Protocol):
    """What the runner uses of a prefill-only engine (Scorer, VllmEngine): `score_groups` and
    `embed_groups`, and the same records (a Scorer makes no steps: its `stats` stays empty)."""

    stats: list[StepStats]
    totals: EngineTotals | None

    def score_groups(self, groups: Iterable[Any], choices: Any) -> Iterator[ScoreOutput]: ...

    def embed_groups(self, groups: Iterable[Any], pooling: Any) -> Iterator[EmbedOutput]: ...

    def classify_groups(self, groups: Iterable[Any]) -> Iterator[ScoreOutput]: ...


ReplicaEngine = GeneratingEngine | ScoringEngine


class UnitFeed:
    """The units one engine runs, in the order it gets them, minus the rows not to run.

    queue: the run's work queue (operators/stages/job_hub.RunQueue), which hands out the units,
    each with an object ref of its payload (operators/stages/plan.unit_payload_refs). skip:
    rows committed by an earlier run or given up.
    Iterating yields UnitPayloads, or NOT_READY while the queue says WAIT (asking it again at
    most every WAIT_RETRY_S); `ran` tells the queue what share of each unit's rows has its
    output (the pace of work stealing), `committed` when every row of a unit is committed.
    """

    def __init__(self, replica: int, skip: np.ndarray, queue: RunQueue, token: str):
        self.replica, self.skip, self.queue, self.token = replica, skip, queue, token
        self.left: dict[int, int] = {}  # unit -> its rows not committed yet
        self.size: dict[int, int] = {}  # unit -> its rows to run, as taken
        self.to_run: dict[int, int] = {}  # unit -> its rows without an output yet
        self.unreported: set[int] = set()  # units with outputs the queue has not heard of
        self.next_report = 0.0  # time.monotonic() after which outputs are reported
        self.unit_of: dict[int, int] = {}  # row -> its unit
        self.stolen: list[int] = []  # units taken from another replica's queue
        self.units: list[int] = []  # every unit run, in the order taken

    def __iter__(self) -> Iterator[UnitPayload | None]:
        import ray

        asked = -WAIT_RETRY_S
        while True:
            if time.monotonic() - asked < WAIT_RETRY_S:
                yield NOT_READY
                continue
            take: Take = ray.get(self.queue.take(self.replica, self.token))
            if take.kind == DONE:
                return
            if take.kind == WAIT:
                asked = time.monotonic()
                yield NOT_READY
                continue
            if take.stolen_from >= 0:
                self.stolen.append(take.unit)
            yield from self._runnable(ray.get(take.payload), take.rows)

    def _runnable(self, payload: UnitPayload, rows: tuple[int, ...] | None) -> Iterator[UnitPayload]:
        """The payload less the rows not to run; a unit with none left is finished at once."""
        unit = payload.unit
        ids = unit.row_ids
        keep = (
            ~np.isin(ids, self.skip)
            if rows is None
            else np.isin(ids, np.asarray(rows, np.int64)) & ~np.isin(ids, self.skip)
        )
        if not keep.any():
            self._finished(unit.unit_id)
            return
        if not keep.all():
            groups = [g for g in (without_rows(g, ids[~keep]) for g in unit.groups) if g is not None]
            unit = PlanUnit(unit.unit_id, unit.replica, groups, unit.predicted_seconds)
            payload = UnitPayload(unit, payload.rows.filter(pa.array(keep)), payload.ranks[keep])
        self.units.append(unit.unit_id)
        self.left[unit.unit_id] = self.to_run[unit.unit_id] = self.size[unit.unit_id] = len(unit.row_ids)
        self.unit_of.update((int(r), unit.unit_id) for r in unit.row_ids)
        yield payload

    def ran(self, row_id: int) -> None:
        """A row has its output. The queue hears the share of each unit's rows with outputs at
        most every REPORT_EVERY_S, and at once when a unit has all of them (it has run; its
        commit may come much later, a part holding many units)."""
        unit = self.unit_of.get(int(row_id))
        if unit is None or unit not in self.to_run:
            return
        self.to_run[unit] -= 1
        self.unreported.add(unit)
        if self.to_run[unit] and time.monotonic() < self.next_report:
            return
        shares = {u: 1.0 - self.to_run[u] / self.size[u] for u in self.unreported}
        self.queue.ran(self.token, shares)
        self.unreported.clear()
        self.next_report = time.monotonic() + REPORT_EVERY_S
        for u, share in shares.items():
            if share >= 1.0:
                del self.to_run[u]

    def committed(self, row_ids: Iterable[int]) -> None:
        """Rows just committed: a unit whose rows are all committed is finished."""
        for r in row_ids:
            unit = self.unit_of.pop(int(r), None)
            if unit is None:
                continue
            self.left[unit] -= 1
            if self.left[unit] == 0:
                del self.left[unit]
                self._finished(unit)

    def _finished(self, unit: int) -> None:
        self.queue.finished(unit, self.token)


class ReplicaRunner:
    """One replica's run, the same for every backend and every caller (the job driver through
    ReplicaGenerator, batch_generator.Generator): builds the engine
    once, feeds it the units of a UnitFeed as it has room, and yields output chunks.
    """

    def __init__(self, config: ProcessorConfig, report: Callable[[dict[str, Any]], None] | None = None):
        self.config = config
        self.engine: ReplicaEngine | None = None
        self.engine_replica = 0  # the replica the engine was built for (backend http: its server)
        self.record: dict[str, Any] | None = None  # the last run's metrics (see _record)
        # Called with live counters while the engine runs (a Heartbeat thread; none: no reports).
        self.report = report

    def load(self, replica: int = 0) -> ReplicaEngine:
        """The engine, built at the first call (a model engine serves any replica); an http
        engine talks to `replica`'s server, so another replica's run builds another."""
        if self.engine is None or (self.config.backend == "http" and replica != self.engine_replica):
            close = getattr(self.engine, "close", None)  # an http engine's request threads
            if close is not None:
                close()
            self.engine, self.engine_replica = make_engine(self.config, replica), replica
        return self.engine

    def run(self, replica: int, groups: list[Any], rows: pa.Table, row_ids: np.ndarray) -> Iterator[pa.Table]:
        """Output chunks of a list of groups run as one unit (batch_generator's per-batch plan;
        see one_unit)."""
        yield from self.run_units(replica, [one_unit(replica, groups, rows, row_ids)])

    def run_units(
        self,
        replica: int,
        feed: Iterable[UnitPayload | None],
        ran: Callable[[int], None] | None = None,
        first_rows: int | None = None,
    ) -> Iterator[pa.Table]:
        """Output chunks (config.rows_per_chunk rows, each of one plan replica, so that a part
        keeps its plan name) of the units `feed` yields, taken as the engine has room; `ran`
        hears each row id as its output comes (UnitFeed.ran); first_rows: the rows of each plan
        replica's first chunk, where fewer (FIRST_PART_SHARE)."""
        started = time.time()
        self.record = None
        book = _Book(self.config)
        engine = self.load(replica)
        loaded = time.time()
        pending: dict[int, list[Any]] = {}  # plan replica -> finished outputs not yet in a chunk
        chunked: set[int] = set()  # plan replicas that had a chunk in this run
        first = min(first_rows or self.config.rows_per_chunk, self.config.rows_per_chunk)
        beat = Heartbeat(engine, replica, loaded, self.report) if self.report is not None else None
        try:
            for out in engine_outputs(engine, self.config, book, feed):
                book.first_output_s = book.first_output_s or time.time()
                if beat is not None:
                    beat.finished(out)
                if ran is not None:
                    ran(out.row_id)
                plan_replica = book.plan_replica(out.row_id)
                outs = pending.setdefault(plan_replica, [])
                outs.append(out)
                if len(outs) >= (self.config.rows_per_chunk if plan_replica in chunked else first):
                    chunked.add(plan_replica)
                    yield book.chunk(pending.pop(plan_replica), replica)
        finally:
            if beat is not None:
                beat.stop()
        for outs in pending.values():
            yield book.chunk(outs, replica)
        self.record = self._record(replica, started, loaded, book)

    def _record(self, replica: int, started: float, loaded: float, book: "_Book") -> dict[str, Any]:
        """Times and the engine's per-step token counts of one run (metrics.json's replicas)."""
        finished = time.time()
        engine = self.load(replica)
        totals = engine.totals
        steps = [plain(s) for s in engine.stats]
        return {
            "replica": replica,
            "num_rows": book.num_rows,
            "num_groups": book.num_groups,
            "num_units": len(book.units),
            "start_s": started,
            "engine_ready_s": loaded,
            "first_output_s": book.first_output_s,  # wall clock of its first finished row, or None
            "end_s": finished,
            "seconds": finished - started,
            "run_seconds": finished - loaded,
            "engine_totals": plain(totals) if totals is not None else None,
            "steps": steps,
        }


@dataclass
class _Book:
    """What a run knows of the rows its engine took: each unit's input rows, and per row its
    place (unit, index), prompt tokens, computed tokens (prefix amortized), plan rank and plan
    replica; the sampling parameters (or score choices) of every row taken so far."""

    config: ProcessorConfig
    units: list[UnitPayload] = field(default_factory=list)
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # row -> (unit, index)
    counts: dict[int, tuple[int, float]] = field(default_factory=dict)  # row -> (prompt, computed)
    params: dict[int, Any] = field(default_factory=dict)  # row -> SamplingParams, or score choices
    groups_seen: set[int] = field(default_factory=set)
    num_groups: int = 0
    first_output_s: float | None = None  # wall clock of the first finished row (metrics.json)

    @property
    def num_rows(self) -> int:
        return len(self.where)

    def add(self, payload: UnitPayload) -> None:
        k = len(self.units)
        self.units.append(payload)
        ids = payload.unit.row_ids
        self.where.update((int(r), (k, i)) for i, r in enumerate(ids))
        for g in payload.unit.groups:
            prompt, computed = token_counts(g, g.group_id in self.groups_seen)
            self.counts.update(zip(g.row_ids.tolist(), zip(prompt, computed)))
            self.groups_seen.add(g.group_id)
            self.num_groups += 1
        if self.config.task == "score":
            per_row = row_choices(self.config.score_config, payload.rows, ids)
        elif self.config.task in ("embed", "classify"):
            per_row = None  # nothing per row: the engine has its pooling, or its labels
        else:
            per_row = row_params(self.config.sampling_params, payload.rows, ids)
        if isinstance(per_row, dict):
            self.params.update(per_row)
        else:  # one value for every row
            self.params.update(dict.fromkeys(ids.tolist(), per_row))

    def taking(self, feed: Iterable[UnitPayload | None]) -> Iterator[UnitPayload | None]:
        """The feed's payloads, each noted here as the engine takes it."""
        for payload in feed:
            if payload is not NOT_READY:
                self.add(payload)
            yield payload

    def plan_replica(self, row_id: int) -> int:
        return self.units[self.where[int(row_id)][0]].unit.replica

    def chunk(self, outs: list[Any], replica: int) -> pa.Table:
        """Output rows of `outs` (finished rows of one plan replica), in that order."""
        places = [self.where[int(o.row_id)] for o in outs]
        by_unit: dict[int, list[int]] = {}
        for n, (k, _) in enumerate(places):
            by_unit.setdefault(k, []).append(n)
        tables, order = [], []
        for k, ns in by_unit.items():
            tables.append(self.units[k].rows.take(pa.array([places[n][1] for n in ns], pa.int64())))
            order += ns
        rows = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        rows = rows.take(pa.array(np.argsort(np.asarray(order), kind="stable")))
        ranks = np.array([self.units[k].ranks[i] for k, i in places], dtype=np.int64)
        counts = [self.counts[int(o.row_id)] for o in outs]
        return output_chunk(
            outs,
            rows,
            np.array([c[0] for c in counts], np.int64),
            np.array([c[1] for c in counts], np.float64),
            ranks,
            replica,
            self.plan_replica(outs[0].row_id),
            self.config.task,
        )


class Heartbeat:
    """A daemon thread that reports a running replica's counters every PROGRESS_EVERY_S:
    rows finished, tokens generated, engine steps, so that the driver's progress line moves
    between part commits. The engine runs on the caller's thread (torch releases the GIL in its
    kernels); this thread only reads: the engine's `stats` list (appended once per step, and
    replaced when a run starts) and the counts `finished` keeps.
    """

    def __init__(
        self,
        engine: ReplicaEngine,
        replica: int,
        run_started: float,
        report: Callable[[dict[str, Any]], None],
        every_s: float = PROGRESS_EVERY_S,
    ):
        self.engine, self.replica, self.run_started, self.report = engine, replica, run_started, report
        self.rows = self.output_tokens = 0  # from finished requests (main thread)
        self.decode_tokens = self.steps = 0  # from engine steps (this thread)
        self._seen: list[Any] | None = None  # the stats list read last, and how far
        self._index = 0
        self._report_failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(every_s,), daemon=True, name=f"prefixflow-heartbeat-{replica}"
        )
        self._thread.start()

    def finished(self, out: Any) -> None:
        self.rows += 1
        self.output_tokens += len(getattr(out, "token_ids", ()) or ())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._send()  # the last counts, so the line ends on the replica's totals

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._send()

    def _send(self) -> None:
        self._read_steps()
        # Steps count a decode token per running sequence as it is made; finished requests
        # count every token, the first (sampled at prefill) included: the larger is nearer.
        tokens = max(self.decode_tokens, self.output_tokens)
        try:
            self.report(
                {
                    "replica": self.replica,
                    "rows": self.rows,
                    "generated_tokens": tokens,
                    "steps": self.steps,
                    "run_started": self.run_started,
                    "time": time.time(),
                }
            )
        except Exception as e:  # noqa: BLE001 - a progress report must never fail the replica
            # said once (twice a second would flood the log): the bar stalls, the rows do not
            log = logger.debug if self._report_failed else logger.warning
            log(
                "replica %d: a progress report failed (%s: %s); the run goes on without live progress",
                self.replica,
                type(e).__name__,
                e,
            )
            self._report_failed = True

    def _read_steps(self) -> None:
        stats = self.engine.stats
        if stats is not self._seen:
            if self._seen is not None:  # a new run replaced the list: finish the old one first
                self._count(self._seen[self._index :])
            self._seen, self._index = stats, 0
        new = stats[self._index :]
        self._index += len(new)
        self._count(new)

    def _count(self, steps: list[Any]) -> None:
        self.steps += len(steps)
        self.decode_tokens += sum(getattr(s, "num_decode_tokens", 0) for s in steps)


def make_engine(config: ProcessorConfig, replica: int = 0) -> ReplicaEngine:
    """The engine of one replica: the one place that picks its class by backend and task.
    replica: which one (backend http: it picks the replica's server)."""
    if config.backend == "http":
        from prefixflow.engine.http_backend.engine import HttpEngine  # torch-free, but only where it runs

        assert config.http_config is not None, "ProcessorConfig builds http_config for backend http"
        return HttpEngine(config.engine_config, config.http_config, replica)
    if config.backend == "vllm":
        # lazy: the engines import torch (and vLLM), in the engine actor only, never on the driver
        from prefixflow.engine.vllm_backend.engine import GroupScheduling, VllmEngine

        engine = config.engine_config
        # policy batchllm: our group scheduler inside vLLM (a request cap only when one is set);
        # policy vllm: vLLM's own scheduler, as the native engine's vllm policy imitates it.
        parts = GroupScheduling(no_cap=engine.max_num_seqs is None) if engine.policy == "batchllm" else False
        pooling = config.embed_config.pooling_of(config.model) if config.task == "embed" else None
        classify = config.task == "classify"
        return VllmEngine(
            engine,
            config.vllm_args,
            group_scheduler=parts,
            pooling=pooling,
            classify=classify,
            lora=config.lora_adapters(),
        )
    if config.task in PREFILL_TASKS:
        # lazy: the engines import torch (and vLLM), in the engine actor only, never on the driver
        from prefixflow.engine import Scorer

        # embed: the score task's default options (chunk size, prefix cache, SRJF order)
        options = config.score_config.options() if config.task == "score" else ScoreOptions()
        return Scorer(config.engine_config, options)
    # lazy: the engines import torch (and vLLM), in the engine actor only, never on the driver
    from prefixflow.engine import LLMEngine

    return LLMEngine(config.engine_config)


class ReplicaGenerator:
    """An engine actor of the job driver (operators/stages/supervise.py): `run_item` runs a
    replica's units (from the run's work queue) on a ReplicaRunner, or writes the error records.

    Built from the config alone, so that it can load its engine (`load`) while the job is still
    read and planned (operators/stages/supervise.start_engines); `take_job` then hands it the
    planned job, before its first `run_item`."""

    def __init__(self, config: ProcessorConfig):
        self.config = config
        self.runner = ReplicaRunner(config, report=self._report)
        self.take_job(RowIndex((), np.zeros(1, np.int64)), np.zeros(0, np.int64), {}, None)  # until given one

    def load(self) -> None:
        """Load the engine now (a started engine actor, while the plan is made)."""
        self.runner.load()

    def take_job(
        self,
        rows: RowIndex,
        error_row_ids: np.ndarray,
        extra_errors: dict[int, str],
        sink: Any,
        done: np.ndarray | None = None,
        skip: np.ndarray | None = None,
        write: WriteOptions | None = None,
        commit_run: str = "",
    ) -> None:
        """The planned job this actor's next `run_item` works on."""
        # Row ids already committed by an earlier attempt (operators/results/commit.py): not run again.
        self.done = np.zeros(0, np.int64) if done is None else np.asarray(done, np.int64)
        # Rows the engine must not run (given up after repeated failures; error records now).
        self.skip = np.zeros(0, np.int64) if skip is None else np.asarray(skip, np.int64)
        self.rows = rows
        self.error_row_ids = error_row_ids
        self.extra_errors = extra_errors
        self.sink = sink
        # WriteOptions: commit each output chunk to the output path as soon as it is done;
        # None: to the sink, under the run's key, which holds it for the Python API's driver
        # (MetricsSink.commit_block).
        self.write, self.commit_run = write, commit_run

    def _report(self, counts: dict[str, Any]) -> None:
        """Live counters to the sink, fire and forget: the engine never waits on the driver."""
        self.sink.progress.remote(counts)

    def run_item(self, item: int, token: str, queue: RunQueue | None = None) -> int:
        """Run one work item for the job driver (operators/stages/supervise.py), committing each
        part as soon as it is done; returns the rows committed.
        token: names this engine to the sink and the queue; queue: the run's work queue, which
        hands out the units (None for the error records, which need none).

        The sink hears when the engine is loaded (a death before that is no row's fault) and
        gets each committed part's manifest row, for the driver's progress line.
        """
        import ray

        if item != ERRORS_ITEM:
            self.runner.load(item)
        ray.get(self.sink.engine_ready.remote(token, os.getpid(), int(item)))
        if item == ERRORS_ITEM:
            chunks, feed = self._error_records(), None
        else:
            assert queue is not None  # only the error records run without one
            feed = self._feed(item, queue, token)
            chunks = self._chunks(item, feed)
        rows = 0
        for chunk in chunks:
            if self.write is None:  # the Python API: the sink holds the committed blocks
                ray.get(self.sink.commit_block.remote(self.commit_run, token, chunk, part_manifest(chunk)))
            else:
                self.sink.committed.remote(write_part(chunk, self.write).to_pylist()[0])
            if feed is not None:
                feed.committed(chunk.column("row_id").to_pylist())
            rows += chunk.num_rows
        return rows

    def _feed(self, replica: int, queue: RunQueue, token: str) -> UnitFeed:
        return UnitFeed(replica, np.union1d(self.done, self.skip), queue, token)

    def _chunks(self, replica: int, feed: UnitFeed) -> Iterator[pa.Table]:
        import ray

        per_chunk = self.config.rows_per_chunk
        first_rows = max(per_chunk // FIRST_PART_SHARE, min(per_chunk, FIRST_PART_MIN_ROWS))
        yield from self.runner.run_units(replica, feed, feed.ran, first_rows)
        if self.runner.record is not None:
            record = {
                **self.runner.record,
                "node_id": ray_node_id(),
                "units": list(feed.units),
                "stolen_units": list(feed.stolen),
            }
            ray.get(self.sink.put.remote(record))  # recorded before the item ends

    def _error_records(self) -> Iterator[pa.Table]:
        ids = self.error_row_ids
        for lo in range(0, len(ids), self.config.rows_per_chunk):
            chunk = ids[lo : lo + self.config.rows_per_chunk]
            chunk = chunk[~np.isin(chunk, self.done)]
            if not len(chunk):
                continue
            rows = fetch_rows(self.rows, chunk)
            sources = rows.column(SOURCE).to_pylist() if SOURCE in rows.column_names else [None] * len(chunk)
            reasons = rows.column(ERROR).to_pylist()
            messages = []
            for rid, src, why in zip(chunk.tolist(), sources, reasons):
                why = why or self.extra_errors.get(rid, "unknown error")
                messages.append(f"{src}: {why}" if src else why)
            # Ranked by row id: an error part is named after its first row id, unique across
            # a job's runs and windows, whatever rows earlier runs gave up or later windows add.
            yield error_records(rows, chunk.tolist(), messages, -1, self.config.task)


def _prefill_outputs(
    engine: ScoringEngine, config: ProcessorConfig, book: "_Book", units: Iterable[UnitPayload | None]
) -> Iterator[Any]:
    """engine_outputs of a prefill task (score, embed, classify): unit by unit, no decoding."""
    if config.task == "classify":

        def run(groups: Iterable[Any]) -> Iterator[Any]:
            return engine.classify_groups(groups)

        def failed(rid: int, why: str) -> Any:
            return ScoreOutput(row_id=rid, choices=(), error=why)
    elif config.task == "embed":
        pooling = config.embed_config.pooling_of(config.model)

        def run(groups: Iterable[Any]) -> Iterator[Any]:
            return engine.embed_groups(groups, pooling)

        def failed(rid: int, why: str) -> Any:
            return EmbedOutput(row_id=rid, error=why)
    else:
        # The native Scorer took its options when it was built; VllmEngine takes them per run.
        more = {"options": config.score_config.options()} if config.backend == "vllm" else {}

        def run(groups: Iterable[Any]) -> Iterator[Any]:
            return engine.score_groups(groups, book.params, **more)

        def failed(rid: int, why: str) -> Any:
            return ScoreOutput(row_id=rid, choices=(), error=why)

    totals: list[EngineTotals] = []
    for payload in units:
        if payload is NOT_READY:
            time.sleep(IDLE_POLL_S)
            continue
        yield from run_isolated(run, payload.unit.groups, lambda: None, failed)
        if engine.totals is not None:
            totals.append(engine.totals)
    # Each unit was one engine run, with its own totals: the replica's record sums them.
    engine.totals = summed_totals(totals)


def one_unit(replica: int, groups: list[Any], rows: pa.Table, row_ids: np.ndarray) -> UnitPayload:
    """A list of groups as one unit. rows: input rows, one per id in `row_ids` (any order);
    each row's rank is its position in the groups."""
    order = np.concatenate([g.row_ids for g in groups]).astype(np.int64) if groups else np.zeros(0, np.int64)
    at = {int(r): i for i, r in enumerate(np.asarray(row_ids).tolist())}
    taken = rows.take(pa.array([at[int(r)] for r in order], pa.int64()))
    return UnitPayload(PlanUnit(0, replica, list(groups), 0.0), taken, np.arange(len(order), dtype=np.int64))


def group_outputs(
    engine: ReplicaEngine, config: ProcessorConfig, groups: list[Any], rows: pa.Table, row_ids: np.ndarray
) -> Iterator[Any]:
    """engine_outputs for a list of groups run as one unit (one_unit)."""
    return engine_outputs(engine, config, _Book(config), [one_unit(0, groups, rows, row_ids)])


def engine_outputs(
    engine: ReplicaEngine, config: ProcessorConfig, book: "_Book", feed: Iterable[UnitPayload | None]
) -> Iterator[Any]:
    """The engine's outputs for the units of `feed` (generated requests, or scored rows), one
    per row: an exception inside the engine fails only the rows it hits (operators/stages/isolate.py).
    Generation takes the units' groups as the engine has room (engine/intake.py); the score
    task, prefill only, scores unit by unit. `book` notes each unit as it is taken (its rows'
    sampling parameters or choices among them) before the engine reads them."""
    units = book.taking(feed)
    if config.task in PREFILL_TASKS:
        yield from _prefill_outputs(cast(ScoringEngine, engine), config, book, units)
        return
    groups = (g for payload in units for g in ((NOT_READY,) if payload is NOT_READY else payload.unit.groups))
    generator = cast(GeneratingEngine, engine)
    yield from run_isolated(
        lambda gs: generator.run(gs, book.params), groups, generator.reset, lambda rid, why: error_output(rid, [], why)
    )
