"""Processor: the stages chained on a Ray Dataset: tokenize -> plan -> generate.

    processor = Processor(config)
    out = processor(ds)              # lazy Dataset of outputs (the plan barrier runs now)

Calling a processor runs tokenization and the plan immediately, because the plan needs every
prompt (the global barrier); generation stays lazy, like any Ray Dataset transform. The CLI
uses the pieces (`plan`, `generate`) to add the part writer and progress.
"""

from __future__ import annotations

from typing import Any, Callable

from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.generate import ERRORS_ITEM, ReplicaGenerator
from prefixflow.operators.plan import PlannedJob, plan_dataset, replica_group_refs
from prefixflow.operators.tokenize import Tokenize, TokenizeOptions, model_max_len

Row = dict[str, Any]


class Processor:
    """A callable Dataset -> Dataset, shaped like `ray.data.llm.build_processor`'s result.

    preprocess: row -> dict, applied first (e.g. build `messages` from your columns); what it
        returns is merged into the row, as in ray.data.llm, so the row's other columns (an `id`)
        stay (a returned key replaces the row's column of that name).
    postprocess: row -> row, applied to each output row (input columns plus generated_text,
        generated_tokens, num_input_tokens, num_generated_tokens, finish_reason, error, row_id).
    """

    def __init__(self, config: ProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None):
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.last_plan: PlannedJob | None = None
        self.sink: Any = None

    def __call__(self, ds: Any) -> Any:
        from prefixflow.operators.write import start_sink

        if self.preprocess is not None:
            ds = ds.map(Merged(self.preprocess))
        self.last_plan = self.plan(ds)
        if self.sink is None:  # one small actor per processor collects per-replica records
            self.sink = start_sink()
        out = self.generate(self.last_plan, self.sink)
        out = out.drop_columns(["_pf_rank", "_pf_computed", "_pf_cached"])
        if self.postprocess is not None:
            out = out.map(self.postprocess)
        return out

    def tokenize(self, ds: Any) -> Any:
        from ray.data import ActorPoolStrategy

        cfg = self.config
        opts = TokenizeOptions(
            model=cfg.model, prompt=cfg.prompt,  # type: ignore[arg-type]
            max_model_len=model_max_len(cfg.model, cfg.engine.get("max_model_len")),
            trust_remote_code=bool(cfg.engine.get("trust_remote_code", False)),
            keep_prompt=cfg.include_prompt, sampling=cfg.sampling)
        out = ds.map_batches(Tokenize, fn_constructor_kwargs={"opts": opts},
                             batch_size=cfg.tokenize_batch_size, batch_format="pyarrow",
                             compute=ActorPoolStrategy(size=cfg.tokenize_concurrency))
        # Row ids are positions in the materialized dataset: keep block order deterministic.
        out.context.execution_options.preserve_order = True
        return out

    def plan(self, ds: Any) -> PlannedJob:
        """Tokenize `ds` and plan it (materializes; the rows stay in the object store)."""
        return plan_dataset(self.tokenize(ds), order=self.config.order,
                            num_replicas=self.config.replicas, custom_ids=self.config.openai_batch,
                            default_max_tokens=self.config.sampling.max_tokens,
                            block_size=self.config.engine_config().block_size)

    def generate(self, planned: PlannedJob, sink: Any = None) -> Any:
        """A lazy Dataset of output blocks: R engine actors run their partitions.

        A job run from a spec (jobs/run.py) does not come here: it runs the same engine actors
        under jobs/supervise.py, which commits parts and restarts a dead actor alone.
        """
        import ray
        from ray.data import ActorPoolStrategy

        cfg = self.config
        group_refs = replica_group_refs(planned, cfg.replicas)
        items = list(range(cfg.replicas)) + ([ERRORS_ITEM] if len(planned.error_row_ids) else [])
        work = ray.data.from_items([{"item": i} for i in items], override_num_blocks=len(items))
        kwargs = dict(config=cfg, rows=planned.rows, group_refs=group_refs,
                      error_row_ids=planned.error_row_ids, extra_errors=planned.extra_errors, sink=sink)
        # One work item per actor at a time, so R replicas really run side by side.
        pool = ActorPoolStrategy(size=cfg.replicas, max_tasks_in_flight_per_actor=1)
        # No restarts and no task retries: a restarted actor would silently redo its whole
        # replica, and one dying at every model load (OOM, bad node) would loop forever.
        remote_args: dict[str, Any] = engine_actor_options(cfg)
        if sink is not None:  # a live bar of the replicas' rows on the driver (operators/progress.py)
            sink.show_progress.remote(planned.rows.num_rows, len(planned.error_row_ids))
        return work.map_batches(ReplicaGenerator, fn_constructor_kwargs=kwargs, batch_size=1,
                                batch_format="pyarrow", compute=pool, **remote_args)

    def metrics(self) -> list[dict[str, Any]]:
        """Per-replica records (times, per-step token counts) of the last executed run."""
        import ray

        return [] if self.sink is None else ray.get(self.sink.get.remote())


class Merged:
    """A preprocess function whose result is merged into the row it was given (ray.data.llm's
    semantics): a picklable wrapper, so that Ray ships the user's function to its workers."""

    def __init__(self, fn: Callable[[Row], Row]):
        self.fn = fn

    def __call__(self, row: Row) -> Row:
        out = self.fn(row)
        if not isinstance(out, dict):
            raise TypeError(f"preprocess returned {type(out).__name__}: return a dict of the "
                            "columns to add or replace (the row's other columns are kept)")
        return {**row, **out}


def engine_actor_options(cfg: ProcessorConfig, needs_engine: bool = True) -> dict[str, Any]:
    """Ray options of an engine actor: its resources (none when it only writes error records,
    needs_engine=False); spread over the cluster's nodes (data-parallel replicas share no
    state, and each one wants a node's memory bandwidth to itself); no restarts, no task
    retries (a death is handled by whoever runs the actors, which knows what was committed)."""
    opts: dict[str, Any] = {"num_cpus": cfg.num_cpus_per_replica if needs_engine else 0,
                            "max_restarts": 0, "max_task_retries": 0, "scheduling_strategy": "SPREAD"}
    if cfg.num_gpus_per_replica and needs_engine:
        opts["num_gpus"] = cfg.num_gpus_per_replica
    return opts
