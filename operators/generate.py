"""Generate stage: R engine actors, each running its partition of the plan.

Used through Ray Data by the Python API: a dataset of work items (replica indices, plus -1 for
the error records) goes through `map_batches(ReplicaGenerator, concurrency=R, batch_size=1)`.
A job run from a spec uses the same class as plain Ray actors (`run_item`, jobs/supervise.py),
so that a dead actor can be replaced alone. An actor pulls its replica's groups and rows from
the object store and hands them to a ReplicaRunner, which every path shares (the streaming
batch_generator.Generator too): it loads the engine of the configured backend (native or
vLLM) once, runs the groups in plan order and yields output blocks as requests finish.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from prefixflow.engine.outputs import error_output
from prefixflow.engine.scoring.choices import ScoreOutput
from prefixflow.operators.columns import ERROR, SOURCE
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.isolate import run_isolated, without_rows
from prefixflow.operators.outputs import COMPUTED, RANK, output_chunk, plain, token_counts, with_outputs
from prefixflow.operators.plan import RowIndex, fetch_rows
from prefixflow.operators.row_sampling import row_params
from prefixflow.operators.score import row_choices, with_score_fields
from prefixflow.operators.write import ray_node_id, write_part

logger = logging.getLogger(__name__)
ERRORS_ITEM = -1
PROGRESS_EVERY_S = 0.5  # how often a running replica reports its counters (live progress line)


class ReplicaRunner:
    """One replica's run, the same for every backend and every caller (Processor.generate and
    the job driver through ReplicaGenerator, batch_generator.Generator): builds the engine once,
    runs a replica's groups minus the rows not to run, and yields output chunks.
    """

    def __init__(self, config: ProcessorConfig, report: Callable[[dict[str, Any]], None] | None = None):
        self.config = config
        self.engine: Any = None
        self.record: dict[str, Any] | None = None  # the last run's metrics (see _record)
        # Called with live counters while the engine runs (a Heartbeat thread; none: no reports).
        self.report = report

    def load(self) -> Any:
        if self.engine is None:
            self.engine = make_engine(self.config)
        return self.engine

    def run(self, replica: int, groups: list[Any], rows: pa.Table, row_ids: np.ndarray,
            not_run: np.ndarray | None = None) -> Iterator[pa.Table]:
        """Output chunks (config.rows_per_chunk rows) of `groups` minus the rows in `not_run`.

        rows: the replica's input rows in plan order, row_ids: their ids (the groups' row ids
        concatenated). Ranks (and so part names) stay those of the full plan; only the engine
        sees less.
        """
        started = time.time()
        self.record = None
        pos = {int(r): i for i, r in enumerate(row_ids)}
        prompt_len, computed = token_counts(groups, len(row_ids))
        skip = np.zeros(0, np.int64) if not_run is None else not_run
        todo = [g for g in (without_rows(g, skip) for g in groups) if g is not None]
        if not todo:
            return
        engine = self.load()
        loaded = time.time()
        pending: list[Any] = []
        score = self.config.task == "score"
        beat = Heartbeat(engine, replica, loaded, self.report) if self.report is not None else None
        try:
            for out in engine_outputs(engine, self.config, todo, rows, row_ids):
                pending.append(out)
                if beat is not None:
                    beat.finished(out)
                if len(pending) >= self.config.rows_per_chunk:
                    yield output_chunk(pending, rows, pos, prompt_len, computed, replica, score)
                    pending = []
        finally:
            if beat is not None:
                beat.stop()
        if pending:
            yield output_chunk(pending, rows, pos, prompt_len, computed, replica, score)
        self.record = self._record(replica, started, loaded, todo)

    def _record(self, replica: int, started: float, loaded: float, groups: list[Any]) -> dict[str, Any]:
        """Times and the engine's per-step token counts of one run (metrics.json's replicas)."""
        finished = time.time()
        stats = getattr(self.engine, "stats", None)
        totals = getattr(self.engine, "totals", None)
        if self.config.task == "score" and self.config.backend == "native":
            # the native Scorer keeps run totals, not per-step records
            stats, totals = None, {k: v for k, v in plain(stats).items() if k != "latency_s"}
        steps = [plain(s) for s in stats] if stats is not None else []
        return {"replica": replica, "num_rows": sum(g.num_members for g in groups),
                "num_groups": len(groups), "start_s": started, "engine_ready_s": loaded,
                "end_s": finished, "seconds": finished - started, "run_seconds": finished - loaded,
                "engine_totals": plain(totals) if totals is not None else None, "steps": steps}


class Heartbeat:
    """A daemon thread that reports a running replica's counters every PROGRESS_EVERY_S:
    rows finished, tokens generated, engine steps, so that the driver's progress line moves
    between part commits. The engine runs on the caller's thread (torch releases the GIL in its
    kernels); this thread only reads: the engine's `stats` list (appended once per step, and
    replaced when a run starts) and the counts `finished` keeps.
    """

    def __init__(self, engine: Any, replica: int, run_started: float,
                 report: Callable[[dict[str, Any]], None], every_s: float = PROGRESS_EVERY_S):
        self.engine, self.replica, self.run_started, self.report = engine, replica, run_started, report
        self.rows = self.output_tokens = 0   # from finished requests (main thread)
        self.decode_tokens = self.steps = 0  # from engine steps (this thread)
        self._seen: list[Any] | None = None  # the stats list read last, and how far
        self._index = 0
        self._report_failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True,
                                        name=f"prefixflow-heartbeat-{replica}")
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
            self.report({"replica": self.replica, "rows": self.rows, "generated_tokens": tokens,
                         "steps": self.steps, "run_started": self.run_started, "time": time.time()})
        except Exception as e:  # noqa: BLE001 - a progress report must never fail the replica
            # said once (twice a second would flood the log): the bar stalls, the rows do not
            log = logger.debug if self._report_failed else logger.warning
            log("replica %d: a progress report failed (%s: %s); the run goes on without live "
                "progress", self.replica, type(e).__name__, e)
            self._report_failed = True

    def _read_steps(self) -> None:
        stats = getattr(self.engine, "stats", None)
        if not isinstance(stats, list):  # the native Scorer keeps totals only: rows then
            return
        if stats is not self._seen:
            if self._seen is not None:  # a new run replaced the list: finish the old one first
                self._count(self._seen[self._index:])
            self._seen, self._index = stats, 0
        new = stats[self._index:]
        self._index += len(new)
        self._count(new)

    def _count(self, steps: list[Any]) -> None:
        self.steps += len(steps)
        self.decode_tokens += sum(getattr(s, "num_decode_tokens", 0) for s in steps)


def make_engine(config: ProcessorConfig) -> Any:
    """The engine of one replica: the one place that picks its class by backend and task."""
    if config.backend == "vllm":
        # lazy: the engines import torch (and vLLM), in the engine actor only, never on the driver
        from prefixflow.engine.vllm_backend.engine import GroupScheduling, VllmEngine

        engine = config.engine_config
        # policy batchllm: our group scheduler inside vLLM (a request cap only when one is set);
        # policy vllm: vLLM's own scheduler, as the native engine's vllm policy imitates it.
        parts = GroupScheduling(no_cap=engine.max_num_seqs is None) if engine.policy == "batchllm" else False
        return VllmEngine(engine, config.vllm_args, group_scheduler=parts)
    if config.task == "score":
        # lazy: the engines import torch (and vLLM), in the engine actor only, never on the driver
        from prefixflow.engine import Scorer

        return Scorer(config.engine_config, config.score.options())
    # lazy: the engines import torch (and vLLM), in the engine actor only, never on the driver
    from prefixflow.engine import LLMEngine

    return LLMEngine(config.engine_config)


class ReplicaGenerator:
    """An engine actor: a map_batches callable class (Processor.generate) whose `run_item` is
    also called as a plain Ray actor (jobs/supervise.py). Both run a ReplicaRunner."""

    def __init__(self, config: ProcessorConfig, rows: RowIndex, group_refs: list[Any],
                 error_row_ids: np.ndarray, extra_errors: dict[int, str], sink: Any = None,
                 done: np.ndarray | None = None, skip: np.ndarray | None = None,
                 write: Any = None):
        self.config = config
        # Row ids already committed by an earlier attempt (operators/commit.py): not run again.
        self.done = np.zeros(0, np.int64) if done is None else np.asarray(done, np.int64)
        # Rows the engine must not run (given up after repeated failures; error records now).
        self.skip = np.zeros(0, np.int64) if skip is None else np.asarray(skip, np.int64)
        self.rows = rows
        self.group_refs = group_refs
        self.error_row_ids = error_row_ids
        self.extra_errors = extra_errors
        self.sink = sink
        # WriteOptions: commit each output chunk here, as soon as it is done, and yield its
        # manifest row instead (Ray Data would merge the chunks into one block before a
        # downstream writer saw them, and a crash would lose them all).
        self.write = write
        self.runner = ReplicaRunner(config, report=self._report if sink is not None else None)

    def _report(self, counts: dict[str, Any]) -> None:
        """Live counters to the sink, fire and forget: the engine never waits on the driver."""
        self.sink.progress.remote(counts)

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        for item in batch.column("item").to_pylist():
            chunks = self._chunks(int(item))
            if self.write is None:
                yield from chunks
                continue
            for chunk in chunks:
                yield write_part(chunk, self.write)

    def run_item(self, item: int, token: str) -> int:
        """The job driver's path (jobs/supervise.py runs these actors with Ray core): run one
        work item, committing each part as soon as it is done; returns the rows written.
        token: names this run of the item to the sink.

        The sink hears when the engine is loaded (a death before that is no row's fault) and
        gets each committed part's manifest row, for the driver's progress line.
        """
        import ray

        if item != ERRORS_ITEM:
            self.runner.load()
        ray.get(self.sink.engine_ready.remote(token, os.getpid(), int(item)))
        rows = 0
        for chunk in self._chunks(item):
            manifest = write_part(chunk, self.write).to_pylist()[0]
            self.sink.committed.remote(manifest)
            rows += chunk.num_rows
        return rows

    def _chunks(self, item: int) -> Iterator[pa.Table]:
        if item == ERRORS_ITEM:
            yield from self._error_records()
            return
        import ray

        groups = ray.get(self.group_refs[item])
        if not groups:
            return
        row_ids = np.concatenate([g.row_ids for g in groups]).astype(np.int64)
        rows = fetch_rows(self.rows, row_ids)
        yield from self.runner.run(item, groups, rows, row_ids, np.union1d(self.done, self.skip))
        if self.runner.record is not None and self.sink is not None:
            record = {**self.runner.record, "node_id": ray_node_id()}
            ray.get(self.sink.put.remote(record))  # recorded before the item ends

    def _error_records(self) -> Iterator[pa.Table]:
        ids = self.error_row_ids
        for lo in range(0, len(ids), self.config.rows_per_chunk):
            chunk = ids[lo:lo + self.config.rows_per_chunk]
            ranks = np.arange(lo, lo + len(chunk))[~np.isin(chunk, self.done)]
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
            n = len(chunk)
            columns = {"row_id": chunk.tolist(), "generated_text": [None] * n, "generated_tokens": [[]] * n,
                       "num_input_tokens": [0] * n, "num_generated_tokens": [0] * n,
                       "finish_reason": [None] * n, "error": messages, "replica": [-1] * n,
                       RANK: ranks.tolist(), COMPUTED: [0.0] * n}
            score = self.config.task == "score"
            table = with_outputs(rows, columns, score)
            yield with_score_fields(table, None) if score else table


def engine_outputs(engine: Any, config: ProcessorConfig, todo: list[Any], rows: pa.Table,
                   row_ids: np.ndarray) -> Iterator[Any]:
    """The engine's outputs for a replica's groups (generated requests, or scored rows), one per
    row: an exception inside the engine fails only the rows it hits (operators/isolate.py)."""
    if config.task == "score":
        choices = row_choices(config.score, rows, row_ids)
        # The native Scorer took its options when it was built; VllmEngine takes them per run.
        more = {"options": config.score.options()} if config.backend == "vllm" else {}
        return run_isolated(lambda groups: engine.score_groups(groups, choices, **more), todo, lambda: None,
                            lambda rid, why: ScoreOutput(row_id=rid, choices=(), error=why))
    params = row_params(config.sampling, rows, row_ids)
    return run_isolated(lambda groups: engine.run(groups, params), todo, engine.reset,
                        lambda rid, why: error_output(rid, [], why))


