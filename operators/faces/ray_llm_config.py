"""ray.data.llm's configuration classes (Ray 2.60), taking the same arguments, and how each maps
onto prefixflow's ProcessorConfig.

    from prefixflow import vLLMEngineProcessorConfig, ChatTemplateStageConfig   # was ray.data.llm

vLLMEngineProcessorConfig -> ProcessorConfig (`processor_config()`):
    model_source -> model; engine_kwargs -> engine.backend: vllm, where the vLLM arguments that
    prefixflow derives itself (max_model_len, max_num_batched_tokens, max_num_seqs,
    enable_prefix_caching, dtype, ...) become those EngineConfig fields, a key naming an
    EngineConfig field (kv_cache_bytes, ...) is that field, and the rest pass to vLLM, checked
    by name before anything starts; log_engine_metrics -> vLLM's stats logging on
    (disable_log_stats False) unless engine_kwargs set it; the sampling defaults -> vLLM's (a
    row's sampling_params over them, as Ray passes them to vllm.SamplingParams; the model's
    generation_config.json is not read); concurrency n or (m, n) -> n replicas
    (the plan's partitions; with (m, n) the engine pool may start with m); batch_size -> rows per
    output block and, unless the stages say otherwise, rows per tokenize batch; runtime_env ->
    every task and actor of the job; the GPUs of a replica are decided when the job runs
    (num_gpus_per_replica None: tensor_parallel_size x pipeline_parallel_size where the cluster
    has GPUs, none where it has none); accelerator_type and placement_group_config's bundles ->
    the engine actors' Ray options; order (prefixflow's own) -> the plan order;
    dynamic_lora_loading_path with engine_kwargs' enable_lora, max_loras, max_lora_rank ->
    ProcessorConfig.lora (a row's `model` names its adapter, a subfolder of the path);
    prepare_multimodal_stage enabled (or has_image) -> ProcessorConfig.images: image parts of
    rows' messages (image_url or image: data URLs, http(s) URLs, and local files under
    model_config_kwargs' allowed_local_media_path) on a vision-language model;
    task_type -> task (a cross-encoder's "score" is task classify on its one-label head).
Stage configs (bool, dict or the classes below): chat_template_stage (enabled: rows' `messages`
get the chat template, its chat_template / chat_template_kwargs included; off: rows give
`prompt`), tokenize_stage (batch_size, concurrency, num_cpus, memory, runtime_env size the
tokenize tasks (an actor pool's (min, max) caps the tasks at once at max); prefixflow always tokenizes, for the plan), detokenize_stage (on: text comes
back even where sampling_params said detokenize=False). Accepted without effect, because
prefixflow's replicas take their rows in plan order themselves: max_pending_requests,
max_concurrent_batches, max_tasks_in_flight_per_actor. Refused with a ValueError naming the
field and what to use instead: video and audio parts, a stage on another
model, and the SGLang, HTTP and Serve-deployment processors. Ray's older fields
(apply_chat_template, chat_template, tokenize, detokenize) are taken as the stages they became.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from prefixflow.engine.config import EngineConfig  # torch-free
from prefixflow.engine.vllm_backend.args import OWN_ARGS  # torch-free, does not import vLLM
from prefixflow.errors import invalid
from prefixflow.images import ImageConfig
from prefixflow.lora import LoraConfig
from prefixflow.operators.config import ProcessorConfig
from prefixflow.requests import SamplingParams

# A row's sampling_params go to vLLM's SamplingParams as they are in ray.data.llm: the fields a
# row leaves out take vLLM's defaults (ours, but max_tokens 16), not generation_config.json's.
VLLM_MAX_TOKENS = 16

Concurrency = int | tuple[int, int]
ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"model"}


def check_concurrency(cls: str, name: str, value: Any) -> Concurrency | None:
    """An int n >= 1 or a (min, max) pair with 1 <= min <= max (a list is taken as the pair)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 1 <= value[0] <= value[1]
    ):
        return (value[0], value[1])
    raise invalid(cls, name, value, "give a positive int, or a (min, max) pair with 1 <= min <= max")


@dataclass(frozen=True, kw_only=True)
class _StageConfig:
    """Fields every ray.data.llm stage config has; None: the processor's value."""

    enabled: bool = True
    batch_size: int | None = None
    concurrency: Concurrency | None = None
    runtime_env: dict[str, Any] | None = None
    num_cpus: float | None = None
    memory: float | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.enabled, bool):
            raise invalid(name, "enabled", self.enabled, "give True or False")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise invalid(name, "batch_size", self.batch_size, "give a positive int or None")
        object.__setattr__(self, "concurrency", check_concurrency(name, "concurrency", self.concurrency))
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise invalid(name, "runtime_env", self.runtime_env, "give a dict or None")

    def with_defaults(self, defaults: dict[str, Any]) -> Any:
        """A copy whose unset fields (batch_size, concurrency, runtime_env, model_source) take
        the processor's values."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in defaults.items() if k in values and values[k] is None})
        return type(self)(**values)


@dataclass(frozen=True, kw_only=True)
class ChatTemplateStageConfig(_StageConfig):
    model_source: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class TokenizerStageConfig(_StageConfig):
    model_source: str | None = None


@dataclass(frozen=True, kw_only=True)
class DetokenizeStageConfig(_StageConfig):
    model_source: str | None = None


@dataclass(frozen=True, kw_only=True)
class PrepareMultimodalStageConfig(_StageConfig):
    model_config_kwargs: dict[str, Any] | None = None
    chat_template_content_format: str | None = "string"
    apply_sys_msg_formatting: bool | None = False


@dataclass(frozen=True, kw_only=True)
class HttpRequestStageConfig(_StageConfig):
    pass


def resolve_stage(value: Any, cls: type, field_name: str, defaults: dict[str, Any]) -> Any:
    """A stage config given as a bool, a dict or `cls`, with the processor's defaults."""
    if isinstance(value, bool):
        stage = cls(enabled=value)
    elif isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise invalid(
                "vLLMEngineProcessorConfig",
                f"{field_name}.{unknown[0]}",
                value[unknown[0]],
                f"{cls.__name__} has no such field",
            )
        stage = cls(**value)
    elif isinstance(value, cls):
        stage = value
    else:
        raise invalid("vLLMEngineProcessorConfig", field_name, value, f"give a bool, a dict or a {cls.__name__}")
    return stage.with_defaults(defaults)


# ray.data.llm's task types -> prefixflow's tasks. A cross-encoder's "score" is classification
# by its one-label head (sigmoid, or the activation its config names), its score in
# `embeddings` as Ray's rows carry it; prefixflow's own task "score" is something else: choice
# probabilities of a generative model.
RAY_TASKS = {"generate": "generate", "embed": "embed", "classify": "classify", "score": "classify"}
TASK_TYPES = tuple(RAY_TASKS)
# engine_kwargs that become the LoraConfig (max_cpu_loras: every adapter stays in CPU memory)
LORA_KWARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# prepare_multimodal_stage's model_config_kwargs that prefixflow reads (vLLM's ModelConfig names)
MEDIA_KWARGS = ("allowed_local_media_path",)


@dataclass(frozen=True, kw_only=True)
class vLLMEngineProcessorConfig:  # ray.data.llm's name, lower case first
    """ray.data.llm.vLLMEngineProcessorConfig of Ray 2.60, field for field (see the module
    docstring for what each becomes). Frozen: build another to change a field."""

    model_source: str
    batch_size: int = 32
    accelerator_type: str | None = None
    concurrency: Concurrency = 1
    runtime_env: dict[str, Any] | None = None
    max_pending_requests: int | None = None
    max_concurrent_batches: int = 8
    max_tasks_in_flight_per_actor: int | None = None
    should_continue_on_error: bool = False
    chat_template_stage: Any = True
    tokenize_stage: Any = True
    detokenize_stage: Any = True
    prepare_multimodal_stage: Any = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    task_type: str = "generate"
    log_engine_metrics: bool = True
    dynamic_lora_loading_path: str | None = None
    placement_group_config: dict[str, Any] | None = None
    # Ray's older boolean fields (before stage configs): None = not given.
    apply_chat_template: bool | None = None
    chat_template: str | None = None
    tokenize: bool | None = None
    detokenize: bool | None = None
    has_image: bool | None = None
    order: str = "batchllm"  # prefixflow's own: the plan order (fcfs, dfs, batchllm, blendserve)

    def __post_init__(self) -> None:
        name = "vLLMEngineProcessorConfig"
        if not isinstance(self.model_source, str) or not self.model_source:
            raise invalid(name, "model_source", self.model_source, "give the model: a folder, hub id or .gguf")
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise invalid(name, "batch_size", self.batch_size, "give a positive int")
        object.__setattr__(self, "concurrency", check_concurrency(name, "concurrency", self.concurrency))
        if not isinstance(self.engine_kwargs, dict):
            raise invalid(name, "engine_kwargs", self.engine_kwargs, "give a dict of vLLM engine arguments")
        if self.task_type not in TASK_TYPES:
            raise invalid(name, "task_type", self.task_type, f"use one of {', '.join(TASK_TYPES)}")
        self.stages()  # each stage config checked, by name
        self.processor_config()  # ProcessorConfig checks the rest (engine_kwargs by name)
        self.engine_bundle()

    def stages(self) -> dict[str, Any]:
        """The four stage configs, resolved (legacy booleans folded in, processor defaults filled)."""
        defaults = {
            "batch_size": self.batch_size,
            "concurrency": self.concurrency,
            "runtime_env": self.runtime_env,
            "model_source": self.model_source,
        }
        chat = resolve_stage(self.chat_template_stage, ChatTemplateStageConfig, "chat_template_stage", defaults)
        if self.apply_chat_template is not None or self.chat_template is not None:
            chat = _replace(
                chat,
                enabled=chat.enabled if self.apply_chat_template is None else self.apply_chat_template,
                chat_template=self.chat_template or chat.chat_template,
            )
        tok = resolve_stage(self.tokenize_stage, TokenizerStageConfig, "tokenize_stage", defaults)
        if self.tokenize is not None:
            tok = _replace(tok, enabled=self.tokenize)
        detok = resolve_stage(self.detokenize_stage, DetokenizeStageConfig, "detokenize_stage", defaults)
        if self.detokenize is not None:
            detok = _replace(detok, enabled=self.detokenize)
        mm = resolve_stage(
            self.prepare_multimodal_stage, PrepareMultimodalStageConfig, "prepare_multimodal_stage", defaults
        )
        if self.has_image is not None:
            mm = _replace(mm, enabled=self.has_image)
        unknown = sorted(set(mm.model_config_kwargs or {}) - set(MEDIA_KWARGS))
        if unknown:
            raise invalid(
                "vLLMEngineProcessorConfig",
                f"prepare_multimodal_stage.model_config_kwargs.{unknown[0]}",
                (mm.model_config_kwargs or {})[unknown[0]],
                f"prefixflow reads {', '.join(MEDIA_KWARGS)} here; engine arguments go in engine_kwargs",
            )
        for stage_name, stage in (("chat_template_stage", chat), ("tokenize_stage", tok), ("detokenize_stage", detok)):
            if stage.model_source != self.model_source:
                raise invalid(
                    "vLLMEngineProcessorConfig",
                    f"{stage_name}.model_source",
                    stage.model_source,
                    "prefixflow renders, tokenizes and decodes with model_source's own tokenizer: remove it",
                )
        return {"chat_template": chat, "tokenize": tok, "detokenize": detok, "prepare_multimodal": mm}

    def processor_config(self, chat_template_kwargs: dict[str, Any] | None = None) -> ProcessorConfig:
        """The ProcessorConfig these settings become. chat_template_kwargs: build_processor's
        builder_kwargs' (the chat template stage's own win, as in ray.data.llm)."""
        stages = self.stages()
        chat, tok = stages["chat_template"], stages["tokenize"]
        sized = tok if tok.enabled or not chat.enabled else chat  # who sizes the tokenize tasks
        replicas = self.concurrency if isinstance(self.concurrency, int) else self.concurrency[1]
        least = self.concurrency if isinstance(self.concurrency, int) else self.concurrency[0]
        stage_concurrency = sized.concurrency if isinstance(sized.concurrency, int) else sized.concurrency[1]
        kwargs = chat.chat_template_kwargs if chat.chat_template_kwargs is not None else chat_template_kwargs
        return ProcessorConfig(
            model=self.model_source,
            engine=engine_settings(self.engine_kwargs, self.log_engine_metrics, self.task_type),
            replicas=replicas,
            min_replicas=least,
            rows_per_chunk=self.batch_size,
            tokenize_batch_size=sized.batch_size,
            tokenize_concurrency=stage_concurrency,
            num_gpus_per_replica=None,
            include_prompt=True,
            order=self.order,
            chat_template=chat.chat_template if chat.enabled else None,
            chat_template_kwargs=dict(kwargs) if kwargs and chat.enabled else None,
            runtime_env=self.runtime_env,
            num_cpus_per_replica=self.engine_bundle().get("CPU", 1.0),
            sampling=SamplingParams(max_tokens=VLLM_MAX_TOKENS),
            task=RAY_TASKS[self.task_type],
            lora=self.lora_config(),
            images=self.image_config(stages["prepare_multimodal"]),
        )

    def image_config(self, stage: PrepareMultimodalStageConfig) -> ImageConfig | None:
        """Images in rows' messages when the multimodal stage is on (or has_image): as Ray's
        stage reads them, http(s) URLs fetched, and local files under the stage's
        model_config_kwargs allowed_local_media_path (vLLM's rule: none without it)."""
        if not stage.enabled:
            return None
        root = (stage.model_config_kwargs or {}).get("allowed_local_media_path")
        return ImageConfig(root=root or None, allow_urls=True)

    def lora_config(self) -> LoraConfig | None:
        """Per-row LoRA: dynamic_lora_loading_path and engine_kwargs' LoRA arguments (a row's
        `model` names its adapter, a subfolder of the path, as in ray.data.llm)."""
        given = {k: self.engine_kwargs[k] for k in LORA_KWARGS if k in self.engine_kwargs}
        if self.dynamic_lora_loading_path is None:
            if given.get("enable_lora"):
                raise invalid(
                    "vLLMEngineProcessorConfig",
                    "dynamic_lora_loading_path",
                    None,
                    "per-row LoRA adapters are read from a folder with one subfolder per adapter: give it",
                )
            return None
        return LoraConfig(
            path=self.dynamic_lora_loading_path,
            max_loras=given.get("max_loras"),
            max_lora_rank=given.get("max_lora_rank"),
        )

    def engine_bundle(self) -> dict[str, float]:
        """An engine actor's resources from placement_group_config ({} when not given): its
        bundles summed (bundle_per_worker once per tensor x pipeline worker)."""
        pg = self.placement_group_config
        if pg is None:
            return {}
        name = "vLLMEngineProcessorConfig"
        if not isinstance(pg, dict) or not (set(pg) <= {"bundles", "bundle_per_worker", "strategy"}):
            raise invalid(
                name,
                "placement_group_config",
                pg,
                "give {'bundles': [...]} or {'bundle_per_worker': {...}}, optionally with 'strategy'",
            )
        if pg.get("bundle_per_worker") is not None:
            workers = self.engine_kwargs.get("tensor_parallel_size", 1) * self.engine_kwargs.get(
                "pipeline_parallel_size", 1
            )
            bundles = [pg["bundle_per_worker"]] * workers
        else:
            bundles = pg.get("bundles") or []
        if not bundles or not all(isinstance(b, dict) for b in bundles):
            raise invalid(name, "placement_group_config", pg, "give at least one bundle, each a dict of resources")
        total: dict[str, float] = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                total[key] = total.get(key, 0.0) + float(amount)
        return total


def _replace(stage: Any, **changes: Any) -> Any:
    values = {f.name: getattr(stage, f.name) for f in fields(stage)}
    return type(stage)(**{**values, **changes})


def engine_settings(
    engine_kwargs: dict[str, Any], log_engine_metrics: bool = True, task_type: str = "generate"
) -> dict[str, Any]:
    """ProcessorConfig.engine for ray.data.llm's engine_kwargs: the vLLM arguments prefixflow
    derives from its own EngineConfig (engine/vllm_backend/args.OWN_ARGS, the one mapping of vLLM names
    to EngineConfig fields: max_model_len, max_num_batched_tokens, max_num_seqs,
    enable_prefix_caching, dtype, ...) become those fields, so both backends read one setting;
    a key that names an EngineConfig field itself (kv_cache_bytes, device, ...: prefixflow's
    own, not vLLM arguments) is that field; the rest pass to vLLM as they are, checked by name.
    vLLM logs its stats when log_engine_metrics asks (as ray.data.llm) unless
    disable_log_stats is given."""
    engine: dict[str, Any] = {"backend": "vllm", "vllm": {}}
    for key, value in engine_kwargs.items():
        if key == "task_type" and value == task_type:
            continue  # ray.data.llm copies task_type into engine_kwargs itself
        if key in LORA_KWARGS:
            continue  # vLLMEngineProcessorConfig.lora_config's
        ours = OWN_ARGS.get(key, "").removeprefix("engine.")
        # model is model_source; num_gpu_blocks_override counts blocks, not bytes: both stay
        # vLLM arguments, which the check then refuses by name.
        if ours.isidentifier() and key not in ("model", "num_gpu_blocks_override"):
            engine[ours] = value
        elif key in ENGINE_FIELDS and key not in OWN_ARGS:
            engine[key] = value
        else:
            engine["vllm"][key] = value
    engine["vllm"].setdefault("disable_log_stats", not log_engine_metrics)
    return engine


def _refused(name: str, instead: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            f"{name} is not supported by prefixflow, which runs the model itself with vLLM or its own engine: {instead}"
        )

    return type(name, (), {"__init__": __init__, "__doc__": f"Refused: {instead}"})


SGLangEngineProcessorConfig = _refused(
    "SGLangEngineProcessorConfig",
    "use vLLMEngineProcessorConfig (the same fields, vLLM's engine_kwargs) or prefixflow.ProcessorConfig",
)
HttpRequestProcessorConfig = _refused(
    "HttpRequestProcessorConfig",
    "to send rows' prompts to OpenAI-compatible servers in plan order (one partition each, prefix-"
    "affine) use prefixflow.ProcessorConfig(engine={'backend': 'http', 'http': {'endpoints': [...]}}); "
    "for arbitrary payloads to any URL keep ray.data.llm's",
)
ServeDeploymentProcessorConfig = _refused(
    "ServeDeploymentProcessorConfig",
    "to query a Ray Serve deployment keep ray.data.llm's; to run "
    "the model here use vLLMEngineProcessorConfig or prefixflow.ProcessorConfig",
)
