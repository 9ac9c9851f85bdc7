"""ray.data.llm's face on prefixflow's planned Processor: switch by changing one import.

    from prefixflow import build_processor, vLLMEngineProcessorConfig   # was ray.data.llm
    (build_llm_processor, Ray's older name, works too)

`vLLMEngineProcessorConfig` takes ray.data.llm's field names and becomes a ProcessorConfig:
    model_source -> model; engine_kwargs -> engine.backend: vllm, the vLLM arguments prefixflow
    sets itself (max_model_len, max_num_batched_tokens, max_num_seqs, enable_prefix_caching,
    dtype, ...) -> their EngineConfig fields (`engine_settings`), the rest -> vLLM engine
    arguments, checked against vLLM's argument names before any actor starts;
    concurrency (an int) -> replicas;
    batch_size -> rows_per_chunk (rows per output block); tokenize_stage's batch_size and
    concurrency -> the tokenize actors'; order (prefixflow's own) -> the plan order.
Accepted as they are, because prefixflow always does what they ask for or they only tune Ray's
streaming: apply_chat_template / chat_template_stage (a row's `messages` get the tokenizer's
chat template, a `prompt` is used as it is), tokenize / tokenize_stage, detokenize /
detokenize_stage (text always comes back), should_continue_on_error (a failed row is an error
row either way, never a failed job; True adds ray.data.llm's `__inference_error__` column),
log_engine_metrics, max_concurrent_batches, max_pending_requests, max_tasks_in_flight_per_actor.
Anything else prefixflow cannot honour (a custom chat_template, autoscaling concurrency,
runtime_env, LoRA, multimodal, task_type other than generate, ...) raises a ValueError naming
the field, never dropped in silence.

The result is prefixflow's Processor (tokenize -> global plan -> replicas), so rows sharing a
prefix run together. Preprocess output is merged into the row; postprocess runs on each output
row, which has ray.data.llm's columns (generated_text, generated_tokens, num_input_tokens,
num_generated_tokens, prompt, prompt_token_ids, time_taken_llm) beside prefixflow's
(finish_reason, error, row_id, replica). time_taken_llm is null: a planned group's rows are
computed together, so no per-row engine time exists (Processor.metrics() has per-replica times).
prompt_token_ids cost a second tokenizer pass over the output rows (the plan keeps token ids
away from the output rows). The engine is always vLLM here, as the config's name says; for
prefixflow's native engine use ProcessorConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import pyarrow as pa

from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.processor import Merged, Processor
from prefixflow.operators.tokenize import TOKENS, Tokenize, TokenizeOptions, model_max_len

Row = dict[str, Any]
STAGES = ("chat_template_stage", "tokenize_stage", "detokenize_stage")


@dataclass(frozen=True)
class vLLMEngineProcessorConfig:  # noqa: N801 (ray.data.llm's name)
    """ray.data.llm.vLLMEngineProcessorConfig's fields (see the module docstring for how each
    maps); a field whose value prefixflow cannot honour raises ValueError naming it."""

    model_source: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int | tuple[int, int] = 1
    batch_size: int = 32
    apply_chat_template: bool = True
    chat_template: str | None = None
    tokenize: bool = True
    detokenize: bool = True
    has_image: bool = False
    chat_template_stage: bool | dict[str, Any] = True
    tokenize_stage: bool | dict[str, Any] = True
    detokenize_stage: bool | dict[str, Any] = True
    prepare_multimodal_stage: bool | dict[str, Any] = False
    task_type: str = "generate"
    runtime_env: dict[str, Any] | None = None
    accelerator_type: str | None = None
    resources_per_bundle: dict[str, Any] | None = None
    placement_group_config: dict[str, Any] | None = None
    dynamic_lora_loading_path: str | None = None
    max_pending_requests: int | None = None
    max_concurrent_batches: int = 8
    max_tasks_in_flight_per_actor: int | None = None
    should_continue_on_error: bool = False
    log_engine_metrics: bool = True
    order: str = "batchllm"  # prefixflow's: the plan order (fcfs, dfs, batchllm, blendserve)

    def __post_init__(self) -> None:
        for name, value, fix in self.problems():
            raise ValueError(f"vLLMEngineProcessorConfig.{name}={value!r} is invalid: {fix}")
        self.processor_config()  # ProcessorConfig checks the rest (engine_kwargs by name)

    def problems(self) -> list[tuple[str, Any, str]]:
        """(field, value, fix) for each setting prefixflow cannot honour."""
        unsupported = {
            "chat_template": "prefixflow renders the tokenizer's own chat template: remove it, "
                             "or render the prompt in preprocess and return it as `prompt`",
            "has_image": "images are not supported: remove it",
            "prepare_multimodal_stage": "multimodal inputs are not supported: remove it",
            "runtime_env": "engine actors run in the job's environment: remove it",
            "accelerator_type": "prefixflow asks Ray for GPUs, not a type: remove it",
            "resources_per_bundle": "each replica is one actor: remove it",
            "placement_group_config": "each replica is one actor: remove it",
            "dynamic_lora_loading_path": "LoRA adapters are not supported: remove it",
        }
        defaults = {f.name: f.default for f in fields(self)}
        out = [(name, getattr(self, name), fix) for name, fix in unsupported.items()
               if getattr(self, name) != defaults[name]]
        if self.task_type != "generate":
            out.append(("task_type", self.task_type, "only 'generate' is supported"))
        if not isinstance(self.concurrency, int) or isinstance(self.concurrency, bool):
            out.append(("concurrency", self.concurrency, "the plan splits the rows among a fixed "
                        "number of replicas up front: give an int, not an autoscaling range"))
        if not isinstance(self.engine_kwargs, dict):
            out.append(("engine_kwargs", self.engine_kwargs, "give a dict of vLLM engine arguments"))
        return out + [p for name in STAGES for p in _stage_problems(name, getattr(self, name))]

    def processor_config(self, num_gpus_per_replica: float = 0.0) -> ProcessorConfig:
        tokenize = self.tokenize_stage if isinstance(self.tokenize_stage, dict) else {}
        return ProcessorConfig(
            model=self.model_source, engine=engine_settings(self.engine_kwargs),
            replicas=self.concurrency, rows_per_chunk=self.batch_size,  # type: ignore[arg-type]
            tokenize_batch_size=tokenize.get("batch_size") or 256,
            tokenize_concurrency=tokenize.get("concurrency") or 1,
            num_gpus_per_replica=num_gpus_per_replica, include_prompt=True, order=self.order)


def engine_settings(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """ProcessorConfig.engine for ray.data.llm's engine_kwargs: the vLLM arguments prefixflow
    derives from its own EngineConfig (engine/vllm_args.OWN_ARGS: max_model_len,
    max_num_batched_tokens, max_num_seqs, enable_prefix_caching, dtype, ...) become those
    fields, so both backends read one setting; the rest pass to vLLM as they are."""
    from prefixflow.engine.vllm_args import OWN_ARGS  # torch-free, does not import vLLM

    engine: dict[str, Any] = {"backend": "vllm", "vllm": {}}
    for key, value in engine_kwargs.items():
        ours = OWN_ARGS.get(key, "").removeprefix("engine.")
        # model is model_source; num_gpu_blocks_override counts blocks, not bytes: both stay
        # vLLM arguments, which the check then refuses by name.
        if ours.isidentifier() and key not in ("model", "num_gpu_blocks_override"):
            engine[ours] = value
        else:
            engine["vllm"][key] = value
    return engine


def _stage_problems(name: str, value: Any) -> list[tuple[str, Any, str]]:
    """A stage config (bool or dict): `enabled`, and for tokenize_stage batch_size/concurrency;
    resource keys left unset. prefixflow renders chat templates inside its tokenize actors and
    detokenizes inside the engine, so those stages have no actors of their own to size."""
    if isinstance(value, bool):
        return []
    if not isinstance(value, dict):
        return [(name, value, "give a bool or a dict")]
    sized = ("batch_size", "concurrency") if name == "tokenize_stage" else ()
    fix = ("prefixflow runs it inside the tokenize actors (size them with tokenize_stage)"
           if name == "chat_template_stage" else "prefixflow runs it inside its own actors")
    return [(f"{name}.{key}", v, f"not supported here: {fix}; remove it") for key, v in value.items()
            if key != "enabled" and key not in sized and v not in (None, {}, False)]


class RayLLMProcessor:
    """A callable Dataset -> Dataset: preprocess (merged) -> prefixflow's Processor ->
    ray.data.llm's output columns -> postprocess."""

    def __init__(self, config: vLLMEngineProcessorConfig, processor: Processor,
                 preprocess: Callable[[Row], Row] | None, postprocess: Callable[[Row], Row] | None,
                 preprocess_map_kwargs: dict[str, Any], postprocess_map_kwargs: dict[str, Any]):
        self.ray_config = config
        self.processor = processor
        self.preprocess, self.postprocess = preprocess, postprocess
        self.pre_kwargs, self.post_kwargs = preprocess_map_kwargs, postprocess_map_kwargs

    def __call__(self, ds: Any) -> Any:
        from ray.data import ActorPoolStrategy

        if self.preprocess is not None:
            ds = ds.map(Merged(self.preprocess), **self.pre_kwargs)
        out = self.processor(ds)
        cfg = self.processor.config
        opts = TokenizeOptions(model=cfg.model, prompt=None, max_model_len=model_max_len(
            cfg.model, cfg.engine.get("max_model_len")))
        rc = self.ray_config
        detokenize = rc.detokenize and rc.detokenize_stage not in (False, {"enabled": False})
        out = out.map_batches(RayColumns, fn_constructor_kwargs={
            "opts": opts, "error_column": rc.should_continue_on_error, "detokenize": detokenize},
            batch_size=cfg.tokenize_batch_size, batch_format="pyarrow",
            compute=ActorPoolStrategy(size=cfg.tokenize_concurrency))
        if self.postprocess is not None:
            out = out.map(self.postprocess, **self.post_kwargs)
        return out

    def metrics(self) -> list[dict[str, Any]]:
        return self.processor.metrics()


class RayColumns:
    """map_batches class: adds prompt_token_ids (the tokenize stage's ids: the same Tokenize
    on the row's `messages` or `prompt`; prefixflow's plan keeps ids away from the output),
    time_taken_llm (null) and, when asked, `__inference_error__` ("" on a good row). With
    ray.data.llm's detokenize stage on (its default), a row whose sampling_params said
    detokenize=False still gets its text, as there (the stage decodes generated_tokens)."""

    def __init__(self, opts: TokenizeOptions, error_column: bool, detokenize: bool):
        self.tokenize = Tokenize(opts)
        self.error_column, self.detokenize = error_column, detokenize

    def __call__(self, table: pa.Table) -> pa.Table:
        ids = self.tokenize(table.select([c for c in ("messages", "prompt") if c in table.column_names]))
        errors = table.column("error").to_pylist()
        ids_col = [None if e else v for e, v in zip(errors, ids.column(TOKENS).to_pylist())]
        table = table.append_column("prompt_token_ids", pa.array(ids_col, pa.list_(pa.int32())))
        table = table.append_column("time_taken_llm", pa.nulls(len(table), pa.float64()))
        if self.detokenize:
            table = self._texts(table)
        if self.error_column:
            table = table.append_column("__inference_error__",
                                        pa.array([e or "" for e in errors], pa.string()))
        return table

    def _texts(self, table: pa.Table) -> pa.Table:
        texts = table.column("generated_text").to_pylist()
        tokens = table.column("generated_tokens").to_pylist()
        texts = [self.tokenize.tokenizer.decode(ids, skip_special_tokens=True) if t == "" and ids else t
                 for t, ids in zip(texts, tokens)]
        i = table.column_names.index("generated_text")
        return table.set_column(i, "generated_text", pa.array(texts, pa.string()))


def build_llm_processor(config: vLLMEngineProcessorConfig, preprocess: Callable[[Row], Row] | None = None,
                        postprocess: Callable[[Row], Row] | None = None,
                        preprocess_map_kwargs: dict[str, Any] | None = None,
                        postprocess_map_kwargs: dict[str, Any] | None = None,
                        builder_kwargs: dict[str, Any] | None = None) -> RayLLMProcessor:
    """ray.data.llm.build_llm_processor (build_processor in newer Ray): a planned prefixflow
    Processor. A replica gets tensor_parallel_size x pipeline_parallel_size GPUs when the Ray
    cluster has GPUs (as ray.data.llm), none otherwise (vLLM's CPU backend)."""
    if not isinstance(config, vLLMEngineProcessorConfig):
        raise TypeError(f"build_llm_processor needs a vLLMEngineProcessorConfig, got {type(config).__name__}")
    if builder_kwargs:
        raise ValueError(f"build_llm_processor builder_kwargs={builder_kwargs!r} is invalid: "
                         "prefixflow renders the tokenizer's own chat template: remove it")
    processor = Processor(config.processor_config(_gpus_per_replica(config.engine_kwargs)))
    return RayLLMProcessor(config, processor, preprocess, postprocess,
                           dict(preprocess_map_kwargs or {}), dict(postprocess_map_kwargs or {}))


def _gpus_per_replica(engine_kwargs: dict[str, Any]) -> float:
    import ray

    if not ray.is_initialized() or not ray.cluster_resources().get("GPU"):
        return 0.0
    tp, pp = engine_kwargs.get("tensor_parallel_size", 1), engine_kwargs.get("pipeline_parallel_size", 1)
    return float(tp * pp)
