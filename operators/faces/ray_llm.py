"""ray.data.llm's face (Ray 2.60) on prefixflow's planned Processor: switch by changing one import.

    from prefixflow import build_processor, vLLMEngineProcessorConfig   # was ray.data.llm
    (build_llm_processor, Ray's older name, works too)

The configuration classes and how their fields map are in operators/faces/ray_llm_config.py. The
processor is prefixflow's (tokenize -> global plan -> replicas, so rows sharing a prefix run
together) and as lazy as Ray's: `processor(ds)` builds the Dataset, the job runs when it
executes (operators/faces/lazy_job.py). Preprocess output is merged into the row; the rows then carry
ray.data.llm's columns, as Ray 2.60 writes them (RAY_COLUMNS), beside the input's and
prefixflow's finish_reason:
    prompt (the chat template applied), prompt_token_ids, num_input_tokens, generated_tokens,
    generated_text, num_generated_tokens, embeddings (task_type "embed": the vector; "classify":
    the label probabilities, as Ray's; else null), metrics,
    logprobs, prompt_logprobs,
    request_id (the row's id in the job), batch_uuid (one per output block), time_taken_llm
    (seconds from the start of the row's replica run, all its rows queued then as Ray queues a
    batch, to its output block), params (the row's sampling parameters), __inference_error__.
The engine consumes `sampling_params` and `tokenized_prompt`, as Ray's does. A row that fails
(a bad sampling parameter, a prompt past the context, an engine error) fails the dataset, as in
ray.data.llm, unless should_continue_on_error=True: then it comes back with its
__inference_error__ and empty outputs, and bypasses postprocess, which gets the good rows only.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from prefixflow.operators.config import TokenizeOptions
from prefixflow.operators.faces.processor import Merged, Processor, engine_actor_options
from prefixflow.operators.faces.ray_llm_config import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    HttpRequestProcessorConfig,
    HttpRequestStageConfig,
    PrepareMultimodalStageConfig,
    SGLangEngineProcessorConfig,
    ServeDeploymentProcessorConfig,
    TokenizerStageConfig,
    engine_settings,
    vLLMEngineProcessorConfig,
)
from prefixflow.operators.results.embed import EMBED_FIELDS
from prefixflow.operators.results.outputs import INTERNAL
from prefixflow.operators.row_sampling import row_sampling
from prefixflow.operators.stages.plan import fetch_rows
from prefixflow.operators.stages.tokenize import TOKENS
from prefixflow.tokenizer import load_tokenizer

Row = dict[str, Any]
logger = logging.getLogger(__name__)
ERROR_COLUMN = "__inference_error__"
# The columns ray.data.llm 2.60's vLLM stage writes on every row (stage outputs overwrite an
# input column of the same name); the engine pops these inputs.
RAY_COLUMNS = (
    "prompt",
    "prompt_token_ids",
    "num_input_tokens",
    "generated_tokens",
    "generated_text",
    "num_generated_tokens",
    "embeddings",
    "metrics",
    "logprobs",
    "prompt_logprobs",
    "request_id",
    "batch_uuid",
    "time_taken_llm",
    "params",
    ERROR_COLUMN,
)
CONSUMED = ("sampling_params", "tokenized_prompt")
OURS_DROPPED = ("error", "row_id", "replica")  # Ray has them as __inference_error__, request_id
METRICS_TYPE = pa.struct([pa.field("num_generation_tokens", pa.int64()), pa.field("num_cached_tokens", pa.int64())])


class RayLLMProcessor(Processor):
    """prefixflow's Processor with ray.data.llm's stages, columns and error rule."""

    def __init__(
        self,
        config: vLLMEngineProcessorConfig,
        preprocess: Callable[[Row], Row] | None = None,
        postprocess: Callable[[Row], Row] | None = None,
        preprocess_map_kwargs: dict[str, Any] | None = None,
        postprocess_map_kwargs: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        super().__init__(
            config.processor_config(chat_template_kwargs),
            preprocess,
            postprocess,
            preprocess_map_kwargs=preprocess_map_kwargs,
            postprocess_map_kwargs=postprocess_map_kwargs,
        )
        self.ray_config = config
        self.stages = config.stages()
        self._tokenizer: Any = None
        self._run_started: dict[int, float] = {}

    def __call__(self, ds: Any) -> Any:
        if self.preprocess is not None:
            ds = ds.map(Merged(self.preprocess), **self.preprocess_map_kwargs)
        out = self.outputs(ds)
        if self.postprocess is not None:
            wrapped = SkipErrors(self.postprocess, self.ray_config.should_continue_on_error)
            out = out.map(wrapped, **self.postprocess_map_kwargs)
        return out

    # ---- the stages -------------------------------------------------------------------------

    def tokenize_options(self) -> TokenizeOptions:
        # ray.data.llm's chat stage: rows give `messages` only while it is on, and a
        # conversation ending with an assistant message is continued
        return replace(super().tokenize_options(), messages=self.stages["chat_template"].enabled, continue_last=True)

    def tokenize_args(self) -> dict[str, Any]:
        from ray.data import TaskPoolStrategy

        chat, tok = self.stages["chat_template"], self.stages["tokenize"]
        stage = tok if tok.enabled or not chat.enabled else chat
        c = stage.concurrency
        # The stage runs as tasks (operators/stages/tokenize.py): an actor pool's (min, max)
        # is a cap on tasks at once, its max.
        args: dict[str, Any] = {"compute": TaskPoolStrategy(size=c if isinstance(c, int) else c[1])}
        for key in ("runtime_env", "num_cpus", "memory"):
            if getattr(stage, key) is not None:
                args[key] = getattr(stage, key)
        return args

    def engine_options(self) -> dict[str, Any]:
        opts = engine_actor_options(self.config)
        bundle = dict(self.ray_config.engine_bundle())
        bundle.pop("CPU", None)  # num_cpus_per_replica already
        if "GPU" in bundle:
            gpus = bundle.pop("GPU")
            opts.pop("num_gpus", None)
            if gpus:
                opts["num_gpus"] = gpus
        if bundle:
            opts["resources"] = bundle
        if self.ray_config.accelerator_type:
            opts["accelerator_type"] = self.ray_config.accelerator_type
        return opts

    # ---- the columns ------------------------------------------------------------------------

    def finish(self, block: pa.Table, planned: Any) -> pa.Table:
        """ray.data.llm's columns on an output block (see the module docstring)."""
        rows = block.to_pylist()
        errors = [r.get("error") for r in rows]
        bad = next((i for i, e in enumerate(errors) if e), None)
        if bad is not None and not self.ray_config.should_continue_on_error:
            raise RuntimeError(
                f"row {rows[bad].get('row_id')} failed: {errors[bad]} (ray.data.llm fails the "
                "dataset on a row's error; with should_continue_on_error=True such rows come "
                f"back with their {ERROR_COLUMN})"
            )
        ids = np.array([r["row_id"] for r in rows], dtype=np.int64)
        good = [i for i, e in enumerate(errors) if not e]
        prompt_ids: list[Any] = [None] * len(rows)
        if good:
            tokens = fetch_rows(planned.rows, ids[good], columns=(TOKENS,)).column(TOKENS).to_pylist()
            for i, t in zip(good, tokens):
                prompt_ids[i] = t
        detokenize = self.stages["detokenize"].enabled
        batch = uuid.uuid4().hex
        out: dict[str, list[Any]] = {name: [] for name in RAY_COLUMNS}
        for r, e, p in zip(rows, errors, prompt_ids):
            text = r.get("generated_text") or ""
            if detokenize and not text and r.get("generated_tokens") and not e:
                text = self._decode(r["generated_tokens"])
            pooled = self.config.task in ("embed", "classify")  # vLLM's pooling runner: no sampling
            params = "" if e or pooled else repr(row_sampling(self.config.sampling_params, r.get("sampling_params")))
            values = {
                "prompt": r.get("prompt") or "",
                "prompt_token_ids": p,
                "num_input_tokens": 0 if e else r["num_input_tokens"],
                "generated_tokens": [] if e else r["generated_tokens"],
                "generated_text": text,
                "num_generated_tokens": 0 if e else r["num_generated_tokens"],
                # Ray's classify rows carry the label probabilities in `embeddings`
                "embeddings": r.get("probs") if self.config.task == "classify" else r.get("embeddings"),
                "metrics": None
                if e
                else {"num_generation_tokens": r["num_generated_tokens"], "num_cached_tokens": r.get("_pf_cached")},
                "logprobs": None if pooled else r.get("logprobs"),
                "prompt_logprobs": None,
                "request_id": -1 if e else r["row_id"],
                "batch_uuid": batch,
                "time_taken_llm": -1.0 if e else self._time_taken(r["replica"]),
                "params": params,
                ERROR_COLUMN: e or "",
            }
            for name in RAY_COLUMNS:
                out[name].append(values[name])
        return _with_ray_columns(block, out, self.config.task)

    def _decode(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.config.model, self.config.engine_config.trust_remote_code)
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def _time_taken(self, replica: int) -> float:
        """Seconds since the replica's engine run started (its Heartbeat's run_started, in the
        job's sink), else since the job's generate stage started."""
        if replica not in self._run_started:
            import ray

            live = ray.get(self.sink.status.remote()).get("live", {})
            started = (live.get(replica) or {}).get("run_started")
            if started is None:
                return max(0.0, time.time() - self.generate_started)
            self._run_started[replica] = float(started)
        return max(0.0, time.time() - self._run_started[replica])

    # ---- ray.data.llm's Processor methods -----------------------------------------------------

    def list_stage_names(self) -> list[str]:
        names = {"chat_template": "ChatTemplateStage", "tokenize": "TokenizeStage"}
        out = [names[k] for k in ("chat_template", "tokenize") if self.stages[k].enabled]
        out.append("vLLMEngineStage")
        return out + (["DetokenizeStage"] if self.stages["detokenize"].enabled else [])

    def log_input_column_names(self) -> None:
        if self.stages["chat_template"].enabled:
            message = (
                "The first stage of the processor is ChatTemplateStage.\nRequired input columns:\n"
                "\tmessages: A list of messages in OpenAI chat format."
            )
        else:
            message = (
                "The first stage of the processor is TokenizeStage.\nRequired input columns:\n"
                "\tprompt: The text prompt (str) to tokenize."
            )
        logger.info(message + "\nOptional input columns:\n\tsampling_params: vLLM's sampling parameters.")


def _with_ray_columns(block: pa.Table, values: dict[str, list[Any]], task: str) -> pa.Table:
    """The block with Ray's columns written (replacing input columns of those names, and the
    `input_<name>` copies prefixflow kept of them), prefixflow's own error/row_id/replica dropped
    (an input column they displaced gets its name back), bookkeeping dropped."""
    names = block.column_names
    drop = set(INTERNAL) | set(OURS_DROPPED) | set(CONSUMED) | {f"input_{n}" for n in (*RAY_COLUMNS, *CONSUMED)}
    keep = [c for c in names if c not in drop and c not in RAY_COLUMNS]
    table = block.select(keep)
    back = {f"input_{n}": n for n in OURS_DROPPED if f"input_{n}" in names}
    table = table.rename_columns([back.get(c, c) for c in table.column_names])
    types = {
        "prompt_token_ids": pa.list_(pa.int64()),
        "num_input_tokens": pa.int64(),
        "generated_tokens": pa.list_(pa.int64()),
        "num_generated_tokens": pa.int64(),
        "request_id": pa.int64(),
        "time_taken_llm": pa.float64(),
        "metrics": METRICS_TYPE,
        "embeddings": EMBED_FIELDS[0].type if task in ("embed", "classify") else pa.null(),
        "prompt_logprobs": pa.null(),
    }
    for name in RAY_COLUMNS:
        kind = types.get(name)
        if name == "logprobs":
            kind = pa.string() if any(v is not None for v in values[name]) else pa.null()
        table = table.append_column(name, pa.array(values[name], kind or pa.string()))
    return table


class SkipErrors:
    """ray.data.llm's postprocess wrapper: a row with an __inference_error__ bypasses the user's
    function and comes back whole; with should_continue_on_error each good row's result gets
    __inference_error__ "" (one schema for both kinds)."""

    def __init__(self, fn: Callable[[Row], Row], add_error_column: bool):
        self.fn, self.add_error_column = fn, add_error_column

    def __call__(self, row: Row) -> Row:
        if row.get(ERROR_COLUMN):
            return row
        out = self.fn(row)
        if self.add_error_column:
            out[ERROR_COLUMN] = ""
        return out


def build_processor(
    config: vLLMEngineProcessorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
    preprocess_map_kwargs: dict[str, Any] | None = None,
    postprocess_map_kwargs: dict[str, Any] | None = None,
    builder_kwargs: dict[str, Any] | None = None,
) -> RayLLMProcessor:
    """ray.data.llm.build_processor for a vLLMEngineProcessorConfig: prefixflow's planned,
    lazy processor. builder_kwargs: as Ray's vLLM builder, `chat_template_kwargs` only."""
    if not isinstance(config, vLLMEngineProcessorConfig):
        raise TypeError(f"build_processor needs a vLLMEngineProcessorConfig, got {type(config).__name__}")
    builder_kwargs = dict(builder_kwargs or {})
    reserved = {"preprocess", "postprocess", "preprocess_map_kwargs", "postprocess_map_kwargs"} & set(builder_kwargs)
    if reserved:
        raise ValueError(f"builder_kwargs cannot contain {sorted(reserved)}: pass them to build_processor itself")
    unknown = set(builder_kwargs) - {"chat_template_kwargs"}
    if unknown:
        raise TypeError(
            f"builder_kwargs {sorted(unknown)} are not arguments of the vLLM processor "
            "builder: it takes chat_template_kwargs"
        )
    return RayLLMProcessor(
        config,
        preprocess,
        postprocess,
        preprocess_map_kwargs,
        postprocess_map_kwargs,
        builder_kwargs.get("chat_template_kwargs"),
    )


build_llm_processor = build_processor  # Ray's older name, for code written for earlier Ray

__all__ = [
    "ChatTemplateStageConfig",
    "DetokenizeStageConfig",
    "HttpRequestProcessorConfig",
    "HttpRequestStageConfig",
    "PrepareMultimodalStageConfig",
    "RayLLMProcessor",
    "SGLangEngineProcessorConfig",
    "ServeDeploymentProcessorConfig",
    "TokenizerStageConfig",
    "build_llm_processor",
    "build_processor",
    "engine_settings",
    "vLLMEngineProcessorConfig",
]
