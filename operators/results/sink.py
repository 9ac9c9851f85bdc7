"""The job's MetricsSink: what the engine actors report to (per-replica stats, committed parts,
engines loaded, live counters), feeding Ray's metrics (JobMetrics). It runs in the job's one
small actor on the driver's node, with the job's work queues (operators/stages/job_hub.py). Its
own module, apart from the write stage, because every job starts that actor in a fresh worker
process: this module imports neither pyarrow nor the config (about 0.5 s of CPU per job on this
2-core machine), only what the actor runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixflow.operators.results.progress import LiveBar

if TYPE_CHECKING:
    import pyarrow as pa

    from prefixflow.operators.results.commit import Committed


class MetricsSink:
    """What the engine actors report to, in the job's one small actor (operators/stages/
    job_hub.JobHub): per-replica stats when a replica finishes, and for the job driver
    (operators/stages/supervise.py) each committed part, each engine that has loaded its model
    and each replica's live counters (for the Python API it draws them as a live bar,
    `show_progress`). Named, so that another process can read a running job's state. It also
    feeds Ray's metrics (JobMetrics): the dashboard and Prometheus see a running job."""

    def __init__(self, job: str = "prefixflow") -> None:
        self.records: list[dict[str, Any]] = []
        self.new_parts: list[dict[str, Any]] = []
        # The Python API's committed blocks (commit_block), per run of its job: a Dataset that
        # executes twice (or two Datasets of one processor) runs the job again, from nothing.
        self.runs: dict[str, _RunBlocks] = {}
        self.retired: dict[str, set[str]] = {}  # run -> engines whose commits are refused now
        self.ended: set[str] = set()
        self.engines: dict[str, dict[str, int]] = {}  # run token -> {"pid", "item"}
        self.live: dict[int, dict[str, Any]] = {}  # replica -> its last live report
        self.metrics = JobMetrics(job)
        self.bar: Any = None  # the Python API's live bar on the driver (show_progress)

    def put(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def get(self) -> list[dict[str, Any]]:
        return sorted(self.records, key=lambda r: r["replica"])

    def engine_ready(self, token: str, pid: int, item: int) -> None:
        self.engines[token] = {"pid": pid, "item": item}

    def engine_died(self, item: int) -> None:
        self.metrics.engine_died(item)

    def committed(self, manifest: dict[str, Any]) -> None:
        self.new_parts.append(manifest)
        self.metrics.committed(manifest)

    def commit_block(self, run: str, token: str, block: pa.Table, manifest: dict[str, Any]) -> None:
        """The Python API's commit of an output block of `run` by the engine `token` (no output
        path): once this returns, the block's rows are committed. The sink puts its own copy in
        the object store, owned by the sink, so that it outlives the engine actor that sent it.
        A commit of an engine the driver retired (it died: its rows may run again elsewhere) or
        of a run that ended is dropped."""
        import ray

        if run in self.ended or token in self.retired.get(run, ()):
            return
        held = self.runs.setdefault(run, _RunBlocks())
        held.refs.append(ray.put(block))
        held.parts.append(manifest)
        held.rows.append(block.column("row_id").to_numpy().astype(np.int64))
        self.committed(manifest)

    def take_blocks(self, run: str) -> list[Any]:
        """Refs of `run`'s blocks committed since the last call, in commit order."""
        held = self.runs.get(run)
        if held is None:
            return []
        refs, held.refs = held.refs, []
        return refs

    def committed_rows(self, run: str) -> Committed:
        """Every block `run` committed so far, as a resume reads an output path."""
        # lazy: commit.py imports pyarrow and the config, which the sink's process need not load
        from prefixflow.operators.results.commit import Committed

        held = self.runs.get(run) or _RunBlocks()
        ids = np.unique(np.concatenate(held.rows)) if held.rows else np.zeros(0, np.int64)
        return Committed(row_ids=ids, manifests=list(held.parts), removed=[])

    def retire(self, run: str, tokens: list[str]) -> None:
        """No more commits from these engines of `run` (Supervisor._retire)."""
        self.retired.setdefault(run, set()).update(tokens)

    def end_run(self, run: str) -> None:
        """`run` has ended (or its Dataset was abandoned): its blocks not taken are dropped, and
        the live bar shows its last counts."""
        if self.bar is not None:
            self.bar.draw(force=True)
            if not self.bar.close_when_done:
                self.bar.close()
        self.runs.pop(run, None)
        self.retired.pop(run, None)
        self.ended.add(run)

    def active_runs(self) -> list[str]:
        return list(self.runs)

    def progress(self, counts: dict[str, Any]) -> None:
        """A replica's live counters (operators/generate.Heartbeat): the latest one is kept."""
        self.live[int(counts["replica"])] = counts
        self.metrics.progress(counts)
        if self.bar is not None:
            self.bar.report(counts)

    def show_progress(self, total_rows: int, error_rows: int, more: bool = False) -> None:
        """Draw a live bar of the replicas' counters on the driver (the Python API; a job's
        driver draws its own line): operators/progress.LiveBar. more: rows will be added
        (add_rows: a job planned in windows), the bar closes when the run ends."""
        if self.bar is not None:
            self.bar.close()
        self.live = {}
        self.bar = LiveBar("prefixflow", total_rows, error_rows, close_when_done=not more)
        self.bar.draw(force=True)

    def add_rows(self, rows: int, error_rows: int) -> None:
        """More rows to run on the live bar (the next window of the job)."""
        if self.bar is not None:
            self.bar.add_rows(rows, error_rows)

    def take_committed(self) -> list[dict[str, Any]]:
        """Manifest rows of the parts committed since the last call."""
        parts, self.new_parts = self.new_parts, []
        return parts

    def take_progress(self) -> dict[str, Any]:
        """The driver's poll: parts committed since the last call, and each replica's live counters."""
        return {"parts": self.take_committed(), "live": dict(self.live)}

    def status(self) -> dict[str, Any]:
        return {"engines_ready": dict(self.engines), "replicas_done": len(self.records), "live": dict(self.live)}


@dataclass
class _RunBlocks:
    """One run's committed blocks in the sink: refs not taken yet, and every committed part's
    manifest and row ids."""

    refs: list[Any] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)


class JobMetrics:
    """A job's Ray metrics (ray.util.metrics), tagged with the job and the replica (-1: the
    error records): counters of committed rows and tokens (token saving = 1 - computed / prompt
    tokens) and engine deaths, gauges of each replica's live counters. Ray exports them through
    each node's metrics agent (Prometheus format) to the dashboard."""

    COUNTERS = {
        "rows": "rows committed to the output (error records included)",
        "rows_errored": "error records committed (bad rows, rows given up)",
        "prompt_tokens": "prompt tokens of the committed rows",
        "computed_prompt_tokens": "prompt tokens the plan computes for them (shared prefixes once)",
        "generated_tokens": "tokens generated for the committed rows",
        "engine_deaths": "engine actors that died",
    }
    GAUGES = {
        "live_rows": "rows the replica's running engine has finished",
        "live_generated_tokens": "tokens the replica's running engine has generated",
        "live_generated_tokens_per_s": "the replica's generated tokens per second since its engine loaded",
    }
    FROM_MANIFEST = {
        "rows": "num_rows",
        "rows_errored": "num_errors",
        "prompt_tokens": "prompt_tokens",
        "computed_prompt_tokens": "computed_prompt_tokens",
        "generated_tokens": "generated_tokens",
    }

    def __init__(self, job: str):
        from ray.util.metrics import Counter, Gauge

        self.job = job
        keys = ("job", "replica")
        self.counters = {k: Counter(f"prefixflow_{k}", description=d, tag_keys=keys) for k, d in self.COUNTERS.items()}
        self.gauges = {k: Gauge(f"prefixflow_{k}", description=d, tag_keys=keys) for k, d in self.GAUGES.items()}

    def _tags(self, replica: int) -> dict[str, str]:
        return {"job": self.job, "replica": str(replica)}

    def committed(self, manifest: dict[str, Any]) -> None:
        tags = self._tags(int(manifest["replica"]))
        for name, key in self.FROM_MANIFEST.items():
            if manifest[key]:  # a Counter takes only positive increments
                self.counters[name].inc(float(manifest[key]), tags=tags)

    def engine_died(self, item: int) -> None:
        self.counters["engine_deaths"].inc(1.0, tags=self._tags(item))

    def progress(self, counts: dict[str, Any]) -> None:
        tags = self._tags(int(counts["replica"]))
        seconds = max(counts["time"] - counts["run_started"], 1e-9)
        self.gauges["live_rows"].set(float(counts["rows"]), tags=tags)
        self.gauges["live_generated_tokens"].set(float(counts["generated_tokens"]), tags=tags)
        self.gauges["live_generated_tokens_per_s"].set(counts["generated_tokens"] / seconds, tags=tags)


def sink_name(fingerprint: str, driver_pid: int) -> str:
    """The job's sink actor name (namespace "prefixflow"; operators/stages/job_hub.start_sink)."""
    return f"prefixflow-{fingerprint[:16]}-{driver_pid}"
