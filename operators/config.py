"""ProcessorConfig: what the Python API takes and what a job spec becomes (JobSpec.to_config).

A frozen dataclass so that it travels to Ray actors as it is. Settings flow one way: the job
spec, the Python API, ray.data.llm's config (operators/faces/ray_llm_config.py) and map_batches all
end in a ProcessorConfig, which checks every setting once (each check raising through
prefixflow.errors, one message per setting) and builds, once, the typed pieces every stage
reads: `engine_config` (EngineConfig), `backend`, `vllm_args` (checked against
engine/vllm_backend/args' allow-list) and `tokenize_options()`. Nothing downstream reads the `engine`
dict again. The job spec (jobs/spec.py) asks the same checks (`setting_problems`), so it
names the same fields with the same fixes before anything starts.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from prefixflow.engine.config import EngineConfig  # torch-free
from prefixflow.engine.http_backend.config import HttpConfig, http_problems  # torch-free
from prefixflow.engine.scoring.options import ScoreOptions  # torch-free
from prefixflow.engine.scoring.pooling import POOLING_KINDS, Pooling, model_pooling  # torch-free
from prefixflow.engine.vllm_backend.args import vllm_arg_problems  # torch-free, does not import vLLM
from prefixflow.images import ImageConfig
from prefixflow.lora import LoraAdapters, LoraConfig
from prefixflow.errors import InvalidSetting, did_you_mean, invalid, one_of, require, short
from prefixflow.model_source import resolve_model
from prefixflow.operators.template import PromptTemplate
from prefixflow.pipeline.ordering import ORDER_POLICIES
from prefixflow.pipeline.plan import DEFAULT_ORDER
from prefixflow.requests import SamplingParams
from prefixflow.storage import StorageOptions

# The job spec (jobs/spec.py) takes its choices for task and engine.backend from these.
TASKS = ("generate", "score", "embed", "classify")
OPENAI_TASKS = ("generate", "embed")  # what OpenAI batch files ask for (/v1/embeddings: embed)
PREFILL_TASKS = ("score", "embed", "classify")  # no decoding: one prefill per row (engine/scoring)
BACKENDS = ("native", "vllm", "http")
DEFAULT_BACKEND = "native"
# Tables a job reads (operators/stages/read_table.py) and writes (operators/results/table_commit.py).
INPUT_TABLE_FORMATS = ("delta", "iceberg", "lance", "unity_catalog")
OUTPUT_TABLE_FORMATS = ("delta", "iceberg", "lance")
# The module each table format needs, and the distribution that installs it (the `tables` extra).
TABLE_PACKAGES = {
    "delta": ("deltalake", "deltalake"),
    "iceberg": ("pyiceberg", "pyiceberg"),
    "lance": ("lance", "pylance"),
}


def table_package_problem(table_format: str) -> str | None:
    """Why a job cannot read or write `table_format` here (None: it can)."""
    import importlib.util

    module, distribution = TABLE_PACKAGES.get(table_format, (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"format {table_format} needs the {distribution} package: pip install 'prefixflow[tables]'"


CHOICES = {"task": TASKS, "order": ORDER_POLICIES, "engine.backend": BACKENDS}
# The engine dict's keys that choose the backend; the others are EngineConfig fields.
BACKEND_KEYS = ("backend", "vllm", "http")
# Score settings only the native Scorer honours (hybrid prefilling, its KV discard, SRJF order):
# vLLM scores a row by decoding one token with the choices' log-probabilities.
NATIVE_SCORE_FIELDS = (
    "chunk_size",
    "prefix_cache_bytes",
    "max_forward_bytes",
    "policy",
    "calibrate",
    "lam",
    "max_packed_tokens",
)
# generation_config.json keys -> SamplingParams fields: the ones vLLM's generation_config="auto"
# takes as defaults (do_sample is ignored there too). Fields SamplingParams lacks are skipped.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
}
Problem = tuple[str, Any, str]  # (field path from the top, value, fix)
# The numeric settings' limits, (lowest value, integer only, None allowed, fix): ProcessorConfig's
# check and the job spec's (replicas, tokenize.*, output.rows_per_part, resources.*), one message.
_COUNT = (1, True, False, "use a positive integer")
LIMITS: dict[str, tuple[float, bool, bool, str]] = {
    "replicas": _COUNT,
    "tokenize_concurrency": _COUNT,
    "tokenize_batch_size": _COUNT,
    "rows_per_chunk": _COUNT,
    "num_gpus_per_replica": (0, False, True, "use a number >= 0, or None to decide when the job runs"),
    "num_cpus_per_replica": (0, False, False, "use a number >= 0"),
    "max_retries_per_row": (0, True, False, "use an integer >= 0"),
    "window_rows": (0, True, True, "use a positive integer, or 0 (or None) to plan the whole job at once"),
    "window_planners": (1, True, False, "use a positive integer: how many windows are planned at once"),
}


@dataclass(frozen=True)
class TokenizeOptions:
    model: str
    prompt: PromptTemplate | None  # None: OpenAI batch rows carry their own messages/prompt
    max_model_len: int
    trust_remote_code: bool = False
    keep_prompt: bool = False
    sampling: Any = None  # default SamplingParams, to check a row's `sampling_params` overrides
    # Rows' own `messages` (no template): the tokenizer's chat template or this one, with these
    # extra variables; messages=False reads only `prompt` (ray.data.llm's chat stage off);
    # continue_last: a conversation that ends with an assistant message is continued, as
    # ray.data.llm's chat stage does, not answered.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    messages: bool = True
    continue_last: bool = False
    # The LoRA adapters' names (prefixflow/lora.py) when the job has them: each row's `model`
    # column must then name one of them or the job's model. None: the column is not read.
    adapters: tuple[str, ...] | None = None
    # The job's task: an OpenAI batch request whose url asks for another is an error record.
    task: str = "generate"
    # embed / classify: whether the job's vectors are normalized (its classes softmaxed), what
    # a row's ray.data.llm `pooling_params` may ask (use_activation) and nothing else.
    pooling_activation: bool | None = None
    # A job that takes images (engine.backend vllm, a vision-language model): where they may come
    # from, and the model's image token, which the chat template writes once per image. None:
    # an image part is the row's error record.
    images: ImageConfig | None = None
    image_token_id: int | None = None
    image_storage: StorageOptions | None = field(default=None, repr=False)  # images.root in object storage


def model_image_token(model: str) -> int | None:
    """The token id a vision-language model's chat template writes for each image (its config's
    image_token_id, or image_token_index), or None: the model takes text only."""
    config = json.loads((resolve_model(model) / "config.json").read_text())
    for key in ("image_token_id", "image_token_index"):
        if isinstance(config.get(key), int) and not isinstance(config[key], bool):
            return int(config[key])
    return None


def model_max_len(model: str, override: int | None) -> int:
    """The context length: the spec's max_model_len, else the model config's."""
    if override is not None:
        return override
    config = json.loads((resolve_model(model) / "config.json").read_text())
    # A vision-language model's context is its language model's (text_config).
    for cfg in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            if isinstance(cfg.get(key), int):
                return int(cfg[key])
    return 2048


@dataclass(frozen=True)
class ScoreConfig(ScoreOptions):
    """The `score` task (PrefillOnly): one probability per allowed answer instead of text.

    choices: the labels every row is scored on (strings or token ids), e.g. ("Yes", "No").
    choices_column: a list column giving each row its own labels (instead of `choices`).
    The rest are the `engine.scoring.options.ScoreOptions` fields (inherited, so they are
    written once): chunk_size (hybrid prefilling), prefix_cache_bytes, max_forward_bytes
    (longer rows become error records), choice_leading_space, policy ("srjf" | "fcfs"),
    calibrate, lam, add_special_tokens. The job spec's `score` section is generated from
    this class.
    """

    choices: tuple[str | int, ...] = ()
    choices_column: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if bool(self.choices) == bool(self.choices_column):
            raise invalid(
                "ScoreConfig",
                "choices",
                list(self.choices),
                "give exactly one of choices (e.g. ['Yes', 'No']) or choices_column",
            )
        super().__post_init__()  # ScoreOptions checks its own fields, naming them

    def options(self) -> ScoreOptions:
        return ScoreOptions(**{f.name: getattr(self, f.name) for f in fields(ScoreOptions)})


@dataclass(frozen=True)
class EmbedConfig:
    """The `embed` task: one vector per row, the model's final hidden states pooled
    (engine/scoring/pooling.py).

    pooling: "last" (the last token's) or "mean" (every token's); None: as the checkpoint's
        sentence-transformers files say, else "last" (vLLM's rule).
    normalize: scale to unit length; None: as the checkpoint says (a Normalize module), else
        true. The job spec's `embed` section is generated from this class.
    """

    pooling: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_KINDS:
            raise invalid("EmbedConfig", "pooling", self.pooling, f"use null or one of {', '.join(POOLING_KINDS)}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise invalid("EmbedConfig", "normalize", self.normalize, "use null, true or false")

    def pooling_of(self, model: str) -> Pooling:
        """The Pooling an engine runs for `model` (reads its folder: call where the model is)."""
        return model_pooling(resolve_model(model), self.pooling, self.normalize)


@dataclass(frozen=True)
class ProcessorConfig:
    """Options of a prefixflow processor (see `prefixflow.build_processor`).

    model: a Hugging Face model folder, a hub id in the local Hugging Face cache, a .gguf file,
        an s3:// folder or "smollm2-135m-instruct" (see prefixflow.model_source).
    prompt: how a row becomes a prompt (a PromptTemplate or a dict of its fields). None: each
        row carries `messages` (chat) or `prompt` (text) itself, as in ray.data.llm.
    sampling: default SamplingParams, or a dict of the fields you set: the others then come from
        the model's generation_config.json where it has them (temperature, top_p, top_k,
        max_new_tokens, ...), else SamplingParams' defaults. A SamplingParams is taken as it is.
        Kept as given; `sampling_params` is the whole SamplingParams, read from the model when
        first asked. A row's `sampling_params` column overrides fields per row.
    engine: EngineConfig fields other than `model` (dtype, device, max_num_batched_tokens, ...),
        plus `backend`: "native" (prefixflow's engine, the default), "vllm" or "http" (the
        OpenAI-compatible servers of `http`, an HttpConfig's fields: one replica per endpoint,
        task generate), and `vllm`: vLLM engine arguments passed through (like ray.data.llm's
        engine_kwargs), backend vllm only. Read once, into `engine_config`, `backend`,
        `vllm_args` and `http_config`.
    order: plan order policy: fcfs, dfs, batchllm (the default) or blendserve.
    replicas: data-parallel engine actors (Ray's `concurrency`): the plan is made for this many,
        and this many are started; one the cluster cannot hold yet starts when it can (a node
        added) and takes work then. Backend http: one per endpoint (1, the default, is taken as
        that many).
    min_replicas: the fewest engines the cluster must hold when the job starts (None: replicas),
        as ray.data.llm's `concurrency=(min, max)`.
    work_stealing: a replica that runs dry takes unstarted plan units of the one expected to finish last
        (operators/stages/work_queue.py); False: each runs only its own partition (the static plan).
    window_rows: plan the job in windows of this many rows (the first ones smaller), each
        dispatched to the engines while the next is read and planned (pipeline/windows.py);
        None: the whole job is read and planned before any row runs (one global plan, which
        shares every prefix, at the cost of the engines waiting for it). A job spec that leaves
        it unset gets windows above 4,000,000 input rows (jobs/run.py sized_windows); 0: the
        whole job planned at once, whatever its size.
    window_planners: with window_rows, how many windows are planned at once, each by a Ray task
        on any node (operators/stages/window_plans.py), so that planning keeps up with a large
        cluster; a window's plan then sees the prefix homes of the windows up to this many before
        it only (1: every window before). OpenAI batch input plans one window at a time, on the driver.
    max_retries_per_row: after an engine actor dies, its uncommitted rows run again on a new
        one; a replica whose actor dies this many more times in a row without committing a row
        has its rows left become error records (operators/stages/attempts.py).
    num_gpus_per_replica / num_cpus_per_replica: resources of each engine actor.
        num_gpus_per_replica None: decided when the job runs, on the cluster it runs on (the
        engine's tensor_parallel_size x pipeline_parallel_size GPUs where the cluster has GPUs,
        none where it has none), as ray.data.llm sizes its engines.
    tokenize_concurrency / tokenize_batch_size: tokenize tasks at once and their batch size.
    rows_per_chunk: outputs per streamed output block (and per written part).
    include_prompt: add the rendered prompt text as a `prompt` column.
    openai_batch: rows are OpenAI batch requests (custom_id + body), see operators/openai_batch.
    task: "generate" (text), "score" (choice probabilities; needs `score`), "embed" (one
        vector per row, in an `embeddings` column; `embed` tunes it) or "classify" (a sequence
        classification checkpoint's label probabilities, in the score task's columns).
    score: ScoreConfig (or a dict of its fields) for task "score".
    embed: EmbedConfig (or a dict of its fields) for task "embed"; None: the checkpoint's pooling.
    lora: LoraConfig (or a dict of its fields: path, max_loras, max_lora_rank): per-row LoRA
        adapters, ray.data.llm's dynamic_lora_loading_path; a row's `model` column names its
        adapter. Task generate on engine.backend vllm; the plan never groups rows of two adapters.
    images: ImageConfig (or a dict of its fields: root, allow_urls, max_bytes, max_pixels,
        timeout_s): where
        the images of chat messages may come from. A vision-language model (its config names an
        image token) on engine.backend vllm, task generate, takes image parts (data URLs only
        when this is None); elsewhere an image part is the row's error record.
    storage: how the job reaches object storage (a job spec's `storage` section): images under
        an images.root in object storage are read with it. None: the environment's settings.
    chat_template / chat_template_kwargs: for rows that carry `messages`: a Jinja chat template
        instead of the tokenizer's own, and more variables for it (e.g. {"enable_thinking":
        False}); rendered in the bounded sandbox (prefixflow/sandbox.py). Python API,
        map_batches and ray.data.llm's stages.
    runtime_env: the Ray runtime environment of every task and actor the job starts (tokenize,
        engine), e.g. {"env_vars": {"HF_TOKEN": ...}}. Python API only.

    Built from these once, typed, for every caller: engine_config (the EngineConfig of each
    replica), backend ("native" | "vllm"), vllm_args (the checked vLLM arguments). Building a
    config reads nothing: the model is first read where the job starts (`sampling_params`, the
    tokenize options, the engines), so a config can be built, checked and shipped to the
    cluster from a machine that cannot reach the model.
    """

    model: str
    prompt: PromptTemplate | dict[str, Any] | None = None
    sampling: SamplingParams | dict[str, Any] | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    order: str = DEFAULT_ORDER
    replicas: int = 1
    min_replicas: int | None = None
    work_stealing: bool = True
    window_rows: int | None = None
    window_planners: int = 1
    max_retries_per_row: int = 2
    num_gpus_per_replica: float | None = 0.0
    num_cpus_per_replica: float = 1.0
    tokenize_concurrency: int = 1
    tokenize_batch_size: int = 256
    rows_per_chunk: int = 1000
    include_prompt: bool = False
    openai_batch: bool = False
    task: str = "generate"
    score: ScoreConfig | dict[str, Any] | None = None
    embed: EmbedConfig | dict[str, Any] | None = None
    lora: LoraConfig | dict[str, Any] | None = None
    images: ImageConfig | dict[str, Any] | None = None
    storage: StorageOptions | None = field(default=None, repr=False)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    runtime_env: dict[str, Any] | None = None
    # Derived in __post_init__ (not arguments): what every stage reads.
    engine_config: EngineConfig = field(init=False, repr=False, compare=False)
    backend: str = field(init=False, repr=False, compare=False)
    vllm_args: dict[str, Any] = field(init=False, repr=False, compare=False)
    http_config: HttpConfig | None = field(init=False, repr=False, compare=False)

    @property
    def windowed(self) -> bool:
        """Whether the job is planned in windows: window_rows a positive count (0 or None: the
        whole job at once)."""
        return bool(self.window_rows)

    def __post_init__(self) -> None:
        if isinstance(self.prompt, dict):
            object.__setattr__(self, "prompt", PromptTemplate(**self.prompt))
        if not isinstance(self.sampling, SamplingParams):
            # its own errors first (an unknown key named), before the model is read
            SamplingParams().with_overrides(self.sampling or {})
        if isinstance(self.score, dict):
            object.__setattr__(self, "score", ScoreConfig(**self.score))
        if isinstance(self.embed, dict):
            object.__setattr__(self, "embed", EmbedConfig(**self.embed))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if isinstance(self.images, dict):
            object.__setattr__(self, "images", ImageConfig(**self.images))
        self._take_endpoint_count()
        self._check()
        engine = dict(self.engine)
        object.__setattr__(
            self,
            "engine_config",
            EngineConfig(model=self.model, **{k: v for k, v in engine.items() if k not in BACKEND_KEYS}),
        )  # it checks its fields
        problems = setting_problems(engine, self.task, self.score, self.order)
        if problems:  # every one, a line each
            raise ValueError(
                "\n".join(str(invalid("ProcessorConfig", name, value, fix)) for name, value, fix in problems)
            )
        object.__setattr__(self, "backend", engine.get("backend") or DEFAULT_BACKEND)
        object.__setattr__(self, "vllm_args", dict(engine.get("vllm") or {}))
        object.__setattr__(self, "http_config", HttpConfig.of(engine["http"]) if self.backend == "http" else None)

    def _take_endpoint_count(self) -> None:
        """Backend http runs one replica per endpoint: replicas 1 (the default) becomes their
        count, another count is refused (checked before the other replica settings)."""
        engine = self.engine if isinstance(self.engine, dict) else {}
        http = engine.get("http")
        endpoints = http.get("endpoints") if isinstance(http, dict) else None
        if engine.get("backend") != "http" or not isinstance(endpoints, (list, tuple)) or not endpoints:
            return  # not the http backend, or its endpoints are refused with the engine settings
        _require(
            self.replicas in (1, len(endpoints)),
            "replicas",
            self.replicas,
            f"engine.backend http runs one replica per endpoint: leave replicas out, or give {len(endpoints)}",
        )
        object.__setattr__(self, "replicas", len(endpoints))

    @property
    def prompt_template(self) -> PromptTemplate | None:
        """`prompt` as the PromptTemplate __post_init__ made of a dict."""
        assert not isinstance(self.prompt, dict), "__post_init__ builds the PromptTemplate"
        return self.prompt

    @property
    def score_config(self) -> ScoreConfig:
        """`score` as the ScoreConfig __post_init__ made of a dict (task "score" only)."""
        if not isinstance(self.score, ScoreConfig):
            raise ValueError(f"ProcessorConfig.score is {self.score!r}: task 'score' needs a ScoreConfig")
        return self.score

    @property
    def embed_config(self) -> EmbedConfig:
        """`embed` as the EmbedConfig __post_init__ made of a dict (EmbedConfig() when not given)."""
        assert not isinstance(self.embed, dict), "__post_init__ builds the EmbedConfig"
        return self.embed or EmbedConfig()

    def _pooling_activation(self) -> bool | None:
        """embed: the pooling's normalize (read from the model); classify: True (its activation)."""
        if self.task == "embed":
            return self.embed_config.pooling_of(self.model).normalize
        return True if self.task == "classify" else None

    @property
    def image_config(self) -> ImageConfig:
        """Where the job's images may come from (data URLs only when `images` is None)."""
        assert not isinstance(self.images, dict), "__post_init__ builds the ImageConfig"
        return self.images or ImageConfig()

    def lora_adapters(self) -> LoraAdapters | None:
        """The job's LoRA adapters, read from lora.path (None: no lora). Reads the folder."""
        assert not isinstance(self.lora, dict), "__post_init__ builds the LoraConfig"
        return None if self.lora is None else self.lora.adapters()

    @property
    def sampling_params(self) -> SamplingParams:
        """The SamplingParams each row starts from: `sampling` when it is one, else its fields
        over the model's generation_config.json (read once per config object, on first use; a
        config pickled after that carries it)."""
        return self._sampling_resolved[0]

    @property
    def sampling_from_model(self) -> dict[str, Any]:
        """The fields of sampling_params taken from the model's generation_config.json."""
        return self._sampling_resolved[1]

    @cached_property
    def _sampling_resolved(self) -> tuple[SamplingParams, dict[str, Any]]:
        if isinstance(self.sampling, SamplingParams):
            return self.sampling, {}
        return sampling_with_defaults(self.model, self.sampling or {})

    def _check(self) -> None:
        """The fields' own checks (task, order and the engine's are setting_problems')."""
        self._check_task_sections()
        for name, value, fix in limit_problems({name: getattr(self, name) for name in LIMITS}):
            raise invalid("ProcessorConfig", name, value, fix)
        _require(
            self.min_replicas is None or 1 <= self.min_replicas <= self.replicas,
            "min_replicas",
            self.min_replicas,
            f"use None or an integer from 1 to replicas ({self.replicas})",
        )
        _require(isinstance(self.work_stealing, bool), "work_stealing", self.work_stealing, "use True or False")
        _require(
            self.work_stealing is True or self.min_replicas in (None, self.replicas),
            "min_replicas",
            self.min_replicas,
            "a replicas range needs work_stealing=True: without it the partition of a replica the "
            "cluster cannot hold waits for that replica's engine (use min_replicas=None, or turn "
            "work_stealing on)",
        )
        for name, kind in (("chat_template", str), ("chat_template_kwargs", dict), ("runtime_env", dict)):
            value = getattr(self, name)
            _require(value is None or isinstance(value, kind), name, value, f"give a {kind.__name__} or None")
        _require(
            isinstance(self.engine, dict),
            "engine",
            self.engine,
            "give a dict of EngineConfig fields, plus backend, vllm and http",
        )
        _require(
            "model" not in self.engine,
            "engine",
            self.engine,
            "give the model as ProcessorConfig.model, not inside engine",
        )
        known = [f.name for f in fields(EngineConfig) if f.name != "model"] + list(BACKEND_KEYS)
        for key in self.engine:
            hint = did_you_mean(str(key), known)
            _require(
                key in known,
                f"engine.{key}",
                self.engine[key],
                f"not an engine setting: {hint + ' ' if hint else ''}use one of {', '.join(known)}",
            )

    def _check_task_sections(self) -> None:
        """The task's own sections (score, embed, lora) and what each task cannot read."""
        _require(
            self.task != "score" or self.score is not None,
            "score",
            self.score,
            "task 'score' needs score settings, e.g. score={'choices': ['Yes', 'No']}",
        )
        _require(
            self.task in OPENAI_TASKS or not self.openai_batch,
            "task",
            self.task,
            "OpenAI batch files hold chat/completion requests (task 'generate') or embeddings requests (task 'embed')",
        )
        _require(self.task == "embed" or self.embed is None, "embed", self.embed, "embed settings need task 'embed'")
        _require(
            self.lora is None or isinstance(self.lora, LoraConfig),
            "lora",
            self.lora,
            "give a LoraConfig, a dict or None",
        )
        vllm_generate = (
            self.task == "generate" and isinstance(self.engine, dict) and self.engine.get("backend") == "vllm"
        )
        for name, what in (("lora", "LoRA adapters"), ("images", "images")):
            _require(
                getattr(self, name) is None or vllm_generate,
                name,
                getattr(self, name),
                f"{what} run on engine.backend vllm, task generate: set the backend, or remove {name}",
            )

    def tokenize_options(self) -> TokenizeOptions:
        """The tokenize stage's options, built here for every caller (the Processor's tokenize
        actors, the map_batches Generator, ray.data.llm's stages). Reads the model's config
        for its context length unless engine.max_model_len is given."""
        lora = self.lora_adapters()
        image_token = model_image_token(self.model) if self.backend == "vllm" and self.task == "generate" else None
        return TokenizeOptions(
            model=self.model,
            prompt=self.prompt_template,
            max_model_len=model_max_len(self.model, self.engine_config.max_model_len),
            trust_remote_code=self.engine_config.trust_remote_code,
            keep_prompt=self.include_prompt,
            sampling=self.sampling_params,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            adapters=None if lora is None else lora.names,
            task=self.task,
            pooling_activation=self._pooling_activation(),
            images=None if image_token is None else self.image_config,
            image_token_id=image_token,
            image_storage=self.storage if image_token is not None else None,
        )

    @property
    def engine_workers(self) -> int:
        """Devices one replica's engine spans: vLLM's tensor x pipeline parallel size (1 native)."""
        args = self.vllm_args
        return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))

    def with_(self, **changes: Any) -> "ProcessorConfig":
        return replace(self, **changes)


def _require(ok: bool, name: str, value: object, fix: str) -> None:
    require(ok, "ProcessorConfig", name, value, fix)


def generation_defaults(model: str, skip: Collection[str] = ()) -> dict[str, Any]:
    """SamplingParams defaults from the model's generation_config.json ({} without one), less
    the fields in `skip` (the ones the user sets).

    ValueError naming the file when it is not a JSON object, or when a value taken from it is
    one SamplingParams refuses (top_p: 2): the user set none of it, so the message names the
    file and the key, and says how to override it."""
    path = generation_config_path(model)
    if not path.is_file():
        return {}
    fix = 'fix the file (a JSON object, e.g. {"temperature": 0.7}), or remove it'
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {fix}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}): {fix}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object: {fix}")
    known = {f.name for f in fields(SamplingParams)}
    taken = {
        key: name
        for key, name in GENERATION_CONFIG_KEYS.items()
        if config.get(key) is not None and name in known and name not in skip
    }
    for key, name in taken.items():
        try:
            SamplingParams().with_overrides({name: config[key]})
        except ValueError as e:  # SamplingParams.top_p=2.0: its fix, "use a value in (0, 1]"
            why = e.fix if isinstance(e, InvalidSetting) else str(e)
            raise ValueError(
                f"{path}: {key}={short(config[key])} is invalid: {why}; fix the file or set sampling.{name} in the spec"
            ) from None
    return {name: config[key] for key, name in taken.items()}


def generation_config_path(model: str) -> Path:
    """Where the model's generation_config.json is (or would be)."""
    from prefixflow.model_source import resolve_model  # torch-free

    return resolve_model(model) / "generation_config.json"


def sampling_with_defaults(model: str, given: dict[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
    """(the SamplingParams to use, the values taken from the model's generation_config.json):
    the fields in `given` win over the model's defaults. A bad value in `given` is named as the
    user's field (SamplingParams.<field>); one in the file names the file (generation_defaults)."""
    SamplingParams().with_overrides(given)  # the user's own values first, named as theirs
    taken = generation_defaults(model, skip=given)
    try:
        return SamplingParams().with_overrides({**taken, **given}), taken
    except ValueError as e:  # each is valid alone: the two disagree (min_tokens > max_tokens)
        source = ", ".join(f"{k}={short(v)}" for k, v in taken.items())
        raise ValueError(
            f"{e} ({source} taken from {generation_config_path(model)}: set them in the sampling settings to override)"
        ) from None


def choice_problems(values: dict[str, Any]) -> list[Problem]:
    """(field, value, fix) for each value of CHOICES' fields outside its choices: the one check
    of task, order and engine.backend (ProcessorConfig's, and the job spec's per field)."""
    return [(name, value, one_of(CHOICES[name])) for name, value in values.items() if value not in CHOICES[name]]


def limit_problems(values: dict[str, Any]) -> list[Problem]:
    """(field, value, fix) for each value of LIMITS' fields outside its limit: the one check of
    the numeric settings (ProcessorConfig's, and the job spec's per field)."""
    problems = []
    for name, value in values.items():
        lowest, integer, none_ok, fix = LIMITS[name]
        if value is None and none_ok:
            continue
        number = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
        if not number or not value >= lowest:  # `not >=` refuses NaN too
            problems.append((name, value, fix))
    return problems


def setting_problems(engine: dict[str, Any], task: str, score: Any, order: str) -> list[Problem]:
    """(field, value, fix) for each choice outside its set (task, order, engine.backend) and each
    setting the chosen backend cannot run: the check ProcessorConfig and the job spec both
    ask, before any actor starts. score: a ScoreConfig, a dict of its fields or None. Fields
    are named from the top: engine.vllm.<key>, score.<field>."""
    backend = engine.get("backend") or DEFAULT_BACKEND
    choices = choice_problems({"task": task, "order": order, "engine.backend": backend})
    return choices + (backend_problems(engine, task, score) if backend in BACKENDS else [])


def backend_problems(engine: dict[str, Any], task: str, score: Any) -> list[Problem]:
    """setting_problems' part for what the chosen backend (native or vllm) cannot run."""
    backend = engine.get("backend") or DEFAULT_BACKEND
    args = engine.get("vllm") or {}
    if not isinstance(args, dict):
        return [("engine.vllm", args, "give a mapping of vLLM engine arguments, e.g. {enforce_eager: true}")]
    problems: list[Problem] = []
    if backend != "native" and engine.get("cuda_graphs"):
        problems.append(
            (
                "engine.cuda_graphs",
                engine["cuda_graphs"],
                "only engine.backend: native honours it (vLLM captures its own graphs unless "
                "engine.vllm sets enforce_eager): remove it or use the native backend",
            )
        )
    if backend != "http" and engine.get("http") is not None:
        problems.append(
            ("engine.http", engine["http"], "server settings need engine.backend: http; set it, or remove engine.http")
        )
    if backend == "http":
        return problems + _http_problems(engine, task)
    if backend == "native":
        return problems + (
            [("engine.vllm", args, "vLLM arguments need engine.backend: vllm; set it, or remove engine.vllm")]
            if args
            else []
        )
    problems += _vllm_arg_problems(args)
    if engine.get("aligned_decode_batch") is not None:
        problems.append(
            (
                "engine.aligned_decode_batch",
                engine["aligned_decode_batch"],
                "only "
                "engine.backend: native honours it (vLLM forms its own decode batches): "
                "remove it or use the native backend",
            )
        )
    device = str(engine.get("device") or "auto")
    if device.startswith("cuda:"):
        problems.append(
            (
                "engine.device",
                device,
                "vLLM runs on the GPU(s) of the replica's actor (resources.num_gpus_per_replica): use cuda or auto",
            )
        )
    return problems + _native_score_problems(task, score)


def _http_problems(engine: dict[str, Any], task: str) -> list[Problem]:
    """What engine.backend http cannot run: its own settings (engine/http_backend/config.py),
    a task other than generate, vLLM arguments (the servers were started with theirs)."""
    problems = http_problems(engine.get("http"))
    if task != "generate":
        problems.append(("task", task, "engine.backend: http runs task generate (/v1/completions); use native or vllm"))
    if engine.get("vllm"):
        problems.append(
            ("engine.vllm", engine["vllm"], "the servers run with the arguments they were started with: remove it")
        )
    return problems


def _native_score_problems(task: str, score: Any) -> list[Problem]:
    """score.<field> settings the vLLM backend cannot honour (it scores with the choices'
    first-token log-probabilities)."""
    if task != "score":
        return []
    # fields(), not vars(): ScoreOptions' fields live in slots
    given = (
        score
        if isinstance(score, dict)
        else {f.name: getattr(score, f.name) for f in fields(score)}
        if score is not None
        else {}
    )
    defaults = ScoreConfig.__dataclass_fields__
    return [
        (
            f"score.{name}",
            given[name],
            "only engine.backend: native honours it (vLLM scores "
            "with the choices' first-token log-probabilities): remove it or use the native "
            "backend",
        )
        for name in NATIVE_SCORE_FIELDS
        if name in given and given[name] != defaults[name].default
    ]


def _vllm_arg_problems(args: dict[str, Any]) -> list[Problem]:
    """(field, value, fix) for each engine.vllm setting engine/vllm_backend/args refuses (its allow-list,
    nested keys and value types included). It reads vLLM's argument names without importing
    vLLM (milliseconds)."""
    try:
        return vllm_arg_problems(args)
    except ValueError as e:  # vLLM is not installed
        return [("engine.backend", "vllm", str(e))]
