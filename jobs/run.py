"""Run a job spec: read -> tokenize -> plan -> generate -> write, on the Ray cluster at hand.

    prefixflow run job.yaml [--dry-run]      (or: python -m prefixflow.cli run job.yaml)

The command line (prefixflow/cli.py) sits above this module and calls `run_job`; nothing here
imports it.

This and the CLI are the only places that call ray.init. Which cluster a run uses: the one
named by --address or RAY_ADDRESS (as under `ray job submit`), else a new local one started
for this run (never a cluster that happens to run on the machine); the first line says which.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from prefixflow.jobs import report
from prefixflow.jobs.job import Job
from prefixflow.jobs.plot import write_plot
from prefixflow.jobs.preflight import check_resources, preflight  # preflight: also imported from here
from prefixflow.jobs.spec import JobSpec
from prefixflow.model_source import model_fingerprint, resolve_model
from prefixflow.operators.faces.processor import Processor
from prefixflow.operators.results.bookkeeping import MANIFEST
from prefixflow.operators.results.commit import (
    Committed,
    OutputLock,
    check_job_file,
    drop_fenced,
    input_listing,
    job_identity,
    load_committed,
    check_window,
)
from prefixflow.operators.results.openai_output import system_fingerprint, write_results
from prefixflow.operators.results.sink import sink_name
from prefixflow.operators.results.write import (
    WriteOptions,
    clear_end_markers,
    prepare_output,
    write_json,
)
from prefixflow.operators.stages.job_hub import start_sink
from prefixflow.operators.stages.plan import PlannedJob
from prefixflow.operators.stages.window_plans import joined_windows, window_summary
from prefixflow.operators.results.table_commit import commit_to_table, job_id
from prefixflow.operators.stages.read import estimated_rows, input_files, read_dataset
from prefixflow.operators.stages.read_table import pinned
from prefixflow.operators.stages.supervise import Supervisor, check_window_resources, start_engines, stop_engines
from prefixflow.storage import join

# A windowed job's dry run plans its first windows only (window_rows / 16, / 8, / 4, / 2, and one
# whole: about twice window_rows rows) and scales the rest by rows (report.dry_run_result).
DRY_RUN_WINDOWS = 5


# The local cluster a run starts keeps an idle worker process for 10 s (Ray's default: one
# second beyond as many idle workers as there are free CPUs). A job's engines hold most of the
# CPUs, so at one second every burst of small tasks (a window's gathers, the units' payloads)
# started its workers anew, each importing Ray Data and pyarrow: a windowed job of 20,000 rows
# on 2 cores started 49 workers and took 63 s, 126 CPU-s; at 10 s, 15 and 36 s, 77 CPU-s; at
# 60 s no fewer starts and more CPU (idle workers poll: about 1% of a core each), which showed
# on Ray's multi-node test cluster (test_multinode's node-lost test: 148 CPU-s at 1 s, 150 at
# 10 s, 165 at 60 s). bench/stream_job_bench.py starts its cluster with these settings too.
LOCAL_CLUSTER_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 10_000}

# A job whose spec leaves window_rows unset is planned whole up to AUTO_WINDOW_ABOVE rows, in
# windows of AUTO_WINDOW_ROWS above (sized_windows). One plan holds about 250 bytes a row on the
# driver while it plans (25 GB for 100M rows) and keeps every engine waiting for all of it;
# windows of 1M rows planned 100M prompts in 1.5 GiB (bench/plan_bench --stream) for a few
# percent more prompt tokens (bench/stream_bench).
AUTO_WINDOW_ABOVE = 4_000_000
AUTO_WINDOW_ROWS = 1_000_000


def ensure_ray(address: str | None = None) -> None:
    """Join the cluster at `address` or RAY_ADDRESS, else start a local one for this run;
    say which on stderr. Nothing to do when Ray is already initialized (tests, notebooks)."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # "local": a new cluster, even where another one runs on this machine (plain
        # ray.init() would join that one); without the dashboard it starts quicker.
        ray.init(
            address="local", include_dashboard=False, log_to_driver=True, _system_config=LOCAL_CLUSTER_SYSTEM_CONFIG
        )
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
    gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
    where = (
        f"joined the cluster at {address}"
        if address
        else ("started a local cluster for this run (set RAY_ADDRESS or --address to use another)")
    )
    print(f"Ray: {where}: {len(nodes)} node(s), {cpus:g} CPU(s), {gpus:g} GPU(s)", file=sys.stderr, flush=True)


def run_job(
    spec: JobSpec, dry_run: bool = False, source: str = "<spec>", quiet: bool = False, address: str | None = None
) -> dict[str, Any]:
    """Run (or only plan, with dry_run) a validated job; returns the metrics dict."""
    started = time.perf_counter()
    preflight(spec, source, address)
    job = sized_windows(pin_table(spec.to_job(), quiet), quiet)
    wopts = job.write
    ensure_ray(address)
    lock = None
    if not dry_run:
        check_resources(spec, source)  # before prepare_output deletes anything
        # One job at a time on a path, from before anything there is deleted to the end; its
        # writers check that the lock is still theirs before each part (operators/results/commit.py).
        lock = OutputLock(wopts.path, wopts.storage).acquire()
        wopts = dataclasses.replace(wopts, fence=lock.holder["token"])
    try:
        if not dry_run:
            prepare_output(wopts, job.overwrite, job.resume)
        processor = Processor(job.config)
        # The engines load their models while the job is read and planned (none for a dry run);
        # a context the engine would refuse is refused first.
        processor.check_context()
        # Decided once: the engines started now and those a replica starts later run alike.
        options = processor.engine_options()
        if not dry_run:
            check_window_resources(job.config, options)
        engines = {} if dry_run else start_engines(job.config, options)
        try:
            planned, windows = plan_job(processor, job, whole=dry_run, sample=DRY_RUN_WINDOWS if dry_run else None)
            if dry_run:
                result = report.dry_run_result(planned, time.perf_counter() - started, _input_rows(job, planned))
                if not quiet:
                    print(report.plan_text(planned, result.get("sample")), flush=True)
                return result
            if not quiet:
                print(report.plan_text(planned), flush=True)
            return _generate(job, planned, wopts, started, quiet, engines, options, windows)
        finally:
            stop_engines(engines)  # those no Supervisor took (the plan failed; nothing to run)
    finally:
        if lock is not None:
            lock.release()


def plan_job(
    processor: Processor, job: Job, whole: bool = False, sample: int | None = None
) -> tuple[PlannedJob, Iterator[PlannedJob] | None]:
    """The job's plan, or its first window and the later ones (Processor.plans)."""
    return processor.plans(read_dataset(job.read), stealing=job.config.work_stealing, whole=whole, sample=sample)


def _input_rows(job: Job, planned: PlannedJob) -> int:
    """The input's rows: those planned, unless a dry run planned only its first DRY_RUN_WINDOWS
    windows; then counted by reading the input again, without tokenizing (parquet: from its
    metadata)."""
    if planned.plan.summary.get("num_windows", 0) < DRY_RUN_WINDOWS:
        return planned.rows.num_rows
    return int(read_dataset(job.read).count())


class _WindowLog:
    """A job planned in windows, window by window as each is queued (operators/stages/
    supervise.Supervisor's on_window): checked against the window the first run planned and
    recorded in _job.json (check_window), its rows to run added to the progress line
    (`before`: the rows committed before this run), and kept (its plan table and summary) for
    the report; `whole` is the job they make."""

    def __init__(
        self,
        job: Job,
        wopts: WriteOptions,
        identity: dict[str, Any],
        old: dict[str, Any] | None,
        progress: report.Progress,
        before: Committed,
    ):
        self.wopts, self.identity, self.replicas = wopts, identity, job.config.replicas
        self.progress, self.before = progress, np.asarray(before.row_ids)
        self.recorded: list[dict[str, Any]] = list((old or {}).get("windows") or [])
        self.kept: list[PlannedJob] = []

    def __call__(self, window: PlannedJob) -> None:
        check_window(self.wopts.path, self.identity, self.recorded, window, self.replicas, self.wopts.storage)
        self.kept.append(window_summary(window))
        add_rows_to_run(window, self.progress, self.before, window=True)

    def whole(self) -> PlannedJob:
        return joined_windows(self.kept)


def add_rows_to_run(planned: PlannedJob, progress: report.Progress, before: np.ndarray, window: bool = False) -> None:
    """The rows of `planned` (a window, or the whole job) not committed `before` (row ids), to
    the progress line."""
    first, end = planned.rows.first_row, planned.rows.first_row + planned.rows.num_rows
    done = int(np.count_nonzero((before >= first) & (before < end)))
    progress.add_rows(planned.rows.num_rows - done, len(np.setdiff1d(planned.error_row_ids, before)), window)


def pin_table(job: Job, quiet: bool = True) -> Job:
    """The job with its input table's version fixed (the newest now, unless the spec names
    one): every read of this run, and the identity a resume checks, use that version."""
    if job.read.table is None:
        return job
    table = pinned(job.read.table, job.storage)
    if not quiet:
        print(f"input: {table.name} at version {table.version}", file=sys.stderr, flush=True)
    return dataclasses.replace(job, read=dataclasses.replace(job.read, table=table))


def sized_windows(job: Job, quiet: bool = True) -> Job:
    """The job planned in windows of AUTO_WINDOW_ROWS where its spec leaves window_rows unset
    (0: whole, whatever the size) and its input holds more than AUTO_WINDOW_ABOVE rows
    (read.estimated_rows: decided by the input alone, so that a resume decides alike);
    otherwise the job as it is."""
    if job.config.window_rows is not None:
        return job
    rows = estimated_rows(job.read)  # read with retries: a failure here fails the job, never flips it
    if rows is None or rows <= AUTO_WINDOW_ABOVE:
        return job
    if not quiet:
        print(
            f"plan: about {rows:,} input rows: planned in windows of {AUTO_WINDOW_ROWS:,} rows "
            f"(window_rows unset; above {AUTO_WINDOW_ABOVE:,} rows one plan would keep every engine "
            "waiting for all of it: set window_rows to choose, 0 to plan it whole)",
            file=sys.stderr,
            flush=True,
        )
    return dataclasses.replace(job, config=dataclasses.replace(job.config, window_rows=AUTO_WINDOW_ROWS))


def _generate(
    job: Job,
    planned: PlannedJob,
    wopts: WriteOptions,
    started: float,
    quiet: bool,
    engines: dict[int, Any],
    engine_options: dict[str, Any],
    windows: Iterator[PlannedJob] | None = None,
) -> dict[str, Any]:
    """Run every row not committed yet (on the started `engines`, and new ones where a replica
    has none), check that every row is, and write the end files. windows: the windows after
    `planned` of a job planned in windows (plan_job)."""
    import ray

    # A windowed job's windows are checked one by one, as they are planned (_WindowLog).
    identity, wopts = _identity(job, planned if windows is None else None, wopts)
    fingerprint = identity["fingerprint"]
    old = check_job_file(wopts.path, identity, wopts.storage, job.resume)
    clear_end_markers(wopts)
    # Every committed part is read once: one damaged since its commit runs its rows again.
    before = load_committed(wopts.path, wopts.storage, verify=True)
    # Named, so that another process can read the running job's state (operators/results/write.py).
    sink = start_sink(job.name, name=sink_name(fingerprint, os.getpid()))
    gen_started = time.perf_counter()
    progress = report.Progress(total_rows=0, quiet=quiet)
    log = None if windows is None else _WindowLog(job, wopts, identity, old, progress, before)
    if log is not None:
        log(planned)  # a windowed job's rows are added window by window, as each is queued
    else:
        add_rows_to_run(planned, progress, before.row_ids)
    supervisor = Supervisor(
        job.config,
        planned,
        sink,
        wopts,
        job.config.max_retries_per_row,
        progress,
        engine_options,
        engines,
        windows,
        on_window=log,
    )
    manifests, faults = supervisor.run()
    progress.close()
    planned = planned if log is None else log.whole()
    final, fenced = _every_row_committed(planned, wopts, before)
    # The commit records are the truth (a killed actor's last report may never arrive).
    metrics = report.metrics(
        job,
        planned,
        final.manifests,
        ray.get(sink.get.remote()),
        wall_s=time.perf_counter() - started,
        generate_s=time.perf_counter() - gen_started,
    )
    ray.kill(sink)  # now, not when Ray collects it: a resume in this process takes the same name
    metrics["fault_tolerance"] = {
        "rows_committed_before": before.num_rows,
        "rows_written": final.num_rows - before.num_rows,
        "rows_reported": sum(m["num_rows"] for m in manifests),
        # parts without a commit record, left by a killed driver (before) or a killed actor
        "orphans_removed": before.removed + final.removed,
        "fenced_parts_removed": fenced,
        **faults,
    }
    _write_end_files(job, wopts, planned, final, fingerprint, metrics)
    if not quiet:
        print(report.metrics_text(metrics, wopts.path), flush=True)
    return metrics


def _identity(job: Job, planned: PlannedJob | None, wopts: WriteOptions) -> tuple[dict[str, Any], WriteOptions]:
    """What a resume must find unchanged (operators/results/commit.job_identity; planned None:
    a job planned in windows), and the write options with OpenAI's system fingerprint."""
    # The files the reader read (not every file beside them in a folder): their sizes are part
    # of what a resume must find unchanged.
    table = job.read.table
    inputs = table.identity() if table is not None else input_listing(input_files(job.read), wopts.storage)
    model = model_fingerprint(resolve_model(job.config.model))
    identity = job_identity(planned, job.config.replicas, job.identity_key, inputs, model)
    if wopts.format == "openai":
        wopts = dataclasses.replace(wopts, system_fingerprint=system_fingerprint(model, job.engine_fields))
    return identity, wopts


def _every_row_committed(planned: PlannedJob, wopts: WriteOptions, before: Committed) -> tuple[Committed, list[str]]:
    """The committed rows at the end, and the fenced parts dropped; raises unless every row of
    the job is committed, once (never report success short)."""
    final = load_committed(wopts.path, wopts.storage)
    # Without the parts a dead job's actors still committed after this job took the path over:
    # this job ran their rows itself (operators/results/commit.py: fencing).
    final, fenced = drop_fenced(wopts.path, wopts.storage, wopts.fence, before, final) if wopts.fence else (final, [])
    missing = np.setdiff1d(np.arange(planned.rows.num_rows), final.row_ids)
    if len(missing) or len(final.row_ids) != planned.rows.num_rows:
        raise RuntimeError(
            f"rows {missing[:10].tolist()} ({len(missing)} in all) of "
            f"{wopts.path!r} were not committed: rerun with output.resume: true"
        )
    return final, fenced


def _write_end_files(
    job: Job, wopts: WriteOptions, planned: PlannedJob, final: Committed, fingerprint: str, metrics: dict[str, Any]
) -> None:
    """_manifest.json, the rows into the table (table output), plot.png, metrics.json (and
    results.jsonl for OpenAI's format), then _SUCCESS last: a folder with _SUCCESS holds every
    row once (and its table has them)."""
    write_json(
        join(wopts.path, MANIFEST),
        {
            "fingerprint": fingerprint,
            "num_rows": final.num_rows,
            "parts": sorted(m["part"] for m in final.manifests),
            "row_ids": final.row_ids.tolist(),
        },
        wopts.storage,
    )
    if job.table_out is not None:  # every row is in a committed part: now into the table, once
        parts = [m["part"] for m in final.manifests]
        metrics["table"] = commit_to_table(job.table_out, wopts.path, parts, job_id(fingerprint), wopts.storage)
    metrics["plot"] = write_plot(metrics, planned.plan.group_sizes, join(wopts.path, "plot.png"), wopts.storage)
    write_json(join(wopts.path, "metrics.json"), metrics, wopts.storage)
    if wopts.format == "openai":  # one file in input order, as vLLM's run-batch
        write_results(wopts.path, wopts.storage, job.error_file)
    write_json(join(wopts.path, "_SUCCESS"), {}, wopts.storage)
