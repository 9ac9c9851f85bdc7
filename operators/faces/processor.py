"""Processor: the stages chained on a Ray Dataset: tokenize -> plan -> generate.

    processor = Processor(config)
    out = processor(ds)              # a lazy Dataset: nothing runs yet
    out.take_all()                   # tokenizes, plans (the global barrier), generates

Calling a processor only builds the Dataset, as any Ray Dataset transform (and ray.data.llm's
processor) does: the job runs when the Dataset executes, once per execution
(operators/faces/lazy_job.py: one read task plans and runs the replicas, Processor.run) under the
same driver as a job from a spec (operators/stages/supervise.py: a dead engine actor restarts
alone). The CLI uses the pieces (`plan`, the Supervisor) to add the part writer and progress. Every setting comes
from the ProcessorConfig's typed pieces (tokenize_options(), engine_config, backend, vllm_args);
`plan` first refuses a vLLM context the CPU's KV cache cannot hold (check_context).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Generator, Iterator

import pyarrow as pa

from prefixflow.engine.config import CPU_KV_CACHE_BYTES
from prefixflow.engine.vllm_backend.engine import cpu_context
from prefixflow.model_source import resolve_model
from prefixflow.operators.config import ProcessorConfig, TokenizeOptions
from prefixflow.operators.results.outputs import INTERNAL
from prefixflow.operators.stages.plan import PlannedJob, plan_dataset
from prefixflow.operators.stages.window_plans import joined_windows, plan_windows, window_summary
from prefixflow.operators.stages.supervise import (
    Supervisor,
    check_window_resources,
    engine_actor_options,
    start_engines,
    stop_engines,
)
from prefixflow.operators.stages.tokenize import tokenize_batch
from prefixflow.pipeline.cost_model import ModelShape
from prefixflow.pipeline.homes import cache_blocks

Row = dict[str, Any]
PLAN_RECORD = "plan"  # the sink record of a run's plan summary (Processor.plan_summary)
FAULTS_RECORD = "faults"  # the sink record of a finished run's fault report (Processor.fault_report)


class Processor:
    """A callable Dataset -> Dataset, shaped like `ray.data.llm.build_processor`'s result.

    preprocess: row -> dict, applied first (e.g. build `messages` from your columns); what it
        returns is merged into the row, as in ray.data.llm, so the row's other columns (an `id`)
        stay (a returned key replaces the row's column of that name).
    postprocess: row -> row, applied to each output row (input columns plus generated_text,
        generated_tokens, num_input_tokens, num_generated_tokens, finish_reason, error, row_id).
    """

    def __init__(
        self,
        config: ProcessorConfig,
        preprocess: Callable[[Row], Row] | None = None,
        postprocess: Callable[[Row], Row] | None = None,
        *,
        preprocess_map_kwargs: dict[str, Any] | None = None,
        postprocess_map_kwargs: dict[str, Any] | None = None,
    ):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        # Dataset.map arguments of the two user stages (resources, concurrency), as ray.data.llm's
        self.preprocess_map_kwargs = dict(preprocess_map_kwargs or {})
        self.postprocess_map_kwargs = dict(postprocess_map_kwargs or {})
        self.sink: Any = None
        self.generate_started = 0.0  # when the running job's replicas were asked for (Processor.run)

    def __call__(self, ds: Any) -> Any:
        if self.preprocess is not None:
            ds = ds.map(Merged(self.preprocess), **self.preprocess_map_kwargs)
        out = self.outputs(ds)
        if self.postprocess is not None:
            out = out.map(self.postprocess, **self.postprocess_map_kwargs)
        return out

    def outputs(self, ds: Any) -> Any:
        """The output rows of `ds` as a lazy Dataset: the job runs when it executes."""
        # lazy: lazy_job imports Ray's datasource API, job_hub Ray itself (its actor's methods
        # are declared with ray.method); building a processor needs no Ray
        from prefixflow.operators.faces.lazy_job import job_dataset
        from prefixflow.operators.stages.job_hub import start_sink

        if self.sink is None:  # one small actor per processor collects the runs' records
            self.sink = start_sink()
        return job_dataset(self, ds)

    def run(self, ds: Any) -> Iterator[pa.Table]:
        """The job, where its Dataset executes (operators/faces/lazy_job.py): tokenize and plan `ds`,
        run the replicas, and yield their output blocks as they are committed.

        The replicas run under the same driver as a job from a spec (operators/stages/supervise.py):
        an engine actor that dies is restarted alone and its uncommitted rows run again, so
        every row is yielded once. A block is committed when the sink holds it; this task takes
        the committed blocks between the driver's steps."""
        cfg = self.config
        self.check_context()
        # The engines load their models while `ds` is tokenized and planned; their options are
        # decided once, so that those started now and those a replica starts later run alike.
        options = self.engine_options()
        check_window_resources(cfg, options)
        engines = start_engines(cfg, options)
        try:
            # A job planned in windows: the first runs while the next ones are read and planned.
            planned, windows = self.plans(ds, stealing=cfg.work_stealing)
            yield from self._run_planned(planned, engines, options, windows)
        finally:
            stop_engines(engines)  # those no Supervisor took (the plan failed)

    def _run_planned(
        self,
        planned: PlannedJob,
        engines: dict[int, Any],
        engine_options: dict[str, Any],
        windows: Iterator[PlannedJob] | None = None,
    ) -> Iterator[pa.Table]:
        import ray

        cfg = self.config
        ray.get(self.sink.put.remote(_plan_record(planned)))
        self.generate_started = time.time()
        # a live bar of the replicas' rows on the driver (operators/results/progress.py)
        self.sink.show_progress.remote(planned.rows.num_rows, len(planned.error_row_ids), windows is not None)
        kept = [window_summary(planned)]

        def queued(window: PlannedJob) -> None:  # a later window, before its rows run
            kept.append(window_summary(window))
            self.sink.add_rows.remote(window.rows.num_rows, len(window.error_row_ids))

        supervisor = Supervisor(
            cfg,
            planned,
            self.sink,
            None,
            cfg.max_retries_per_row,
            engine_options=engine_options,
            engines=engines,
            windows=windows,
            on_window=queued,
        )
        run = supervisor.commit_run
        try:
            for _ in itertools.chain(supervisor.steps(), [None]):  # and once more after the last step
                for ref in ray.get(self.sink.take_blocks.remote(run)):
                    yield self.finish(ray.get(ref), planned)
            if windows is not None:  # the whole job's plan, now that every window is planned
                ray.get(self.sink.put.remote(_plan_record(joined_windows(kept))))
        finally:  # also when the run fails or its Dataset is abandoned (take(5))
            faults = {"replica": -1, "kind": FAULTS_RECORD, **supervisor.report()}
            ray.get([self.sink.end_run.remote(run), self.sink.put.remote(faults)])  # its blocks go

    def finish(self, block: pa.Table, planned: PlannedJob) -> pa.Table:
        """An output block as it leaves the job, bookkeeping dropped (ray_llm.RayLLMProcessor
        turns it into ray.data.llm's columns)."""
        return block.drop_columns([c for c in INTERNAL if c in block.column_names])

    def tokenize_options(self) -> TokenizeOptions:
        """The tokenize tasks' options: the config's (RayLLMProcessor adds its stages' flags)."""
        return self.config.tokenize_options()

    def tokenize_args(self) -> dict[str, Any]:
        """map_batches arguments of the tokenize tasks (how many at once, resources, environment)."""
        from ray.data import TaskPoolStrategy

        cfg = self.config
        args: dict[str, Any] = {"compute": TaskPoolStrategy(size=cfg.tokenize_concurrency)}
        if cfg.runtime_env is not None:
            args["runtime_env"] = cfg.runtime_env
        return args

    def tokenize(self, ds: Any) -> Any:
        out = ds.map_batches(
            tokenize_batch,
            fn_kwargs={"opts": self.tokenize_options()},
            batch_size=self.config.tokenize_batch_size,
            batch_format="pyarrow",
            **self.tokenize_args(),
        )
        # Row ids are positions in the materialized dataset: keep block order deterministic.
        out.context.execution_options.preserve_order = True
        return out

    def plan(self, ds: Any, stealing: bool = False) -> PlannedJob:
        """Tokenize `ds` and plan it (materializes; the rows stay in the object store).
        stealing: the engines will steal units (a job run with work_stealing)."""
        self.check_context()
        return plan_dataset(self.tokenize(ds), **self._plan_options(stealing))

    def plan_windows(self, ds: Any, stealing: bool = False) -> Generator[PlannedJob, None, None]:
        """Tokenize `ds` and plan it in windows of config.window_rows rows, each as it is read
        (operators/stages/window_plans.py, config.window_planners at once); lazy: nothing is read
        before the first is asked for."""
        self.check_context()
        if not self.config.window_rows:
            raise ValueError("plan_windows needs config.window_rows")
        windows, planners = self.config.window_rows, self.config.window_planners
        return plan_windows(self.tokenize(ds), windows, planners, **self._plan_options(stealing))

    def plans(
        self, ds: Any, stealing: bool = False, whole: bool = False, sample: int | None = None
    ) -> tuple[PlannedJob, Iterator[PlannedJob] | None]:
        """The plan of `ds`, and None; with config.window_rows, its first window and the later
        ones, each read and planned when asked for; whole: every window planned now, and the
        whole job returned (`prefixflow plan`), or its first `sample` windows joined (a dry run:
        the rest is not read)."""
        if not self.config.windowed:
            return self.plan(ds, stealing=stealing), None
        windows = self.plan_windows(ds, stealing=stealing)
        if whole:
            taken = windows if sample is None else itertools.islice(windows, sample)
            whole_plan = joined_windows([window_summary(w, keep_table=True) for w in taken])
            windows.close()  # a sample's: the windows still planning stop, the rest is not read
            return whole_plan, None
        return next(windows), windows

    def _plan_options(self, stealing: bool) -> dict[str, Any]:
        """operators/stages/plan.PlanOptions' fields for this config."""
        return {
            "order": self.config.order,
            "num_replicas": self.config.replicas,
            "custom_ids": self.config.openai_batch,
            "default_max_tokens": self.config.sampling_params.max_tokens,
            "block_size": self.config.engine_config.block_size,
            "stealing": stealing,
            "cache_blocks": self._cache_blocks() if self.config.windowed else None,
        }

    def _cache_blocks(self) -> int | None:
        """KV blocks one engine caches, for a windowed plan (pipeline/homes.py): its
        engine.kv_cache_bytes (on a CPU, the 1 GiB default) over the model's KV bytes per block
        in the checkpoint's dtype; None (the cost model's estimate) on a GPU without a budget,
        which the engine measures only where it starts."""
        engine = self.config.engine_config
        budget = engine.kv_cache_bytes or (None if self._engines_on_gpu() else CPU_KV_CACHE_BYTES)
        if budget is None:
            return None
        shape = ModelShape.from_hf_config(resolve_model(self.config.model) / "config.json")
        return cache_blocks(budget, shape.kv_bytes_per_token, engine.block_size)

    def check_context(self) -> None:
        """vLLM on CPUs runs engine.max_model_len as given or not at all: one its KV cache
        cannot hold is refused here, before tokenizing (engine/vllm_backend/engine.cpu_context, which
        the engine asks again where it starts)."""
        if self.config.backend != "vllm" or self._engines_on_gpu():
            return
        cpu_context(self.config.engine_config, str(resolve_model(self.config.model)))

    def _engines_on_gpu(self) -> bool:
        """The engines take GPUs (resources.num_gpus_per_replica, or engine.device cuda)."""
        return bool(self.engine_options().get("num_gpus")) or self.config.engine_config.device.startswith("cuda")

    def engine_options(self) -> dict[str, Any]:
        """Ray options of the engine actors, decided now (when the job runs)."""
        return engine_actor_options(self.config)

    def metrics(self) -> list[dict[str, Any]]:
        """Per-replica records (times, per-step token counts) of the runs so far."""
        return [r for r in self._records() if r.get("kind") not in (PLAN_RECORD, FAULTS_RECORD)]

    def fault_report(self) -> dict[str, Any] | None:
        """The last finished run's engine failures, restarts and work stealing (a job's
        metrics.json fault_tolerance), None before a run finished."""
        runs = [r for r in self._records() if r.get("kind") == FAULTS_RECORD]
        return {k: v for k, v in runs[-1].items() if k not in ("replica", "kind")} if runs else None

    def plan_summary(self) -> dict[str, Any] | None:
        """The last executed run's plan summary (groups, token saving ratios; Plan.summary),
        None before a run."""
        plans = [r for r in self._records() if r.get("kind") == PLAN_RECORD]
        return plans[-1]["summary"] if plans else None

    def _records(self) -> list[dict[str, Any]]:
        import ray

        return [] if self.sink is None else ray.get(self.sink.get.remote())


def _plan_record(planned: PlannedJob) -> dict[str, Any]:
    """The sink's record of a run's plan (Processor.plan_summary reads the last)."""
    return {
        "replica": -1,
        "kind": PLAN_RECORD,
        "summary": dict(planned.plan.summary),
        "timings": dict(planned.timings),
        "error_rows": len(planned.error_row_ids),
    }


class Merged:
    """A preprocess function whose result is merged into the row it was given (ray.data.llm's
    semantics): a picklable wrapper, so that Ray ships the user's function to its workers."""

    def __init__(self, fn: Callable[[Row], Row]):
        self.fn = fn

    def __call__(self, row: Row) -> Row:
        out = self.fn(row)
        if not isinstance(out, dict):
            raise TypeError(
                f"preprocess returned {type(out).__name__}: return a dict of the "
                "columns to add or replace (the row's other columns are kept)"
            )
        return {**row, **out}
