"""ProcessorConfig: what the Python API takes and what a job spec becomes.

A frozen dataclass so that it travels to Ray actors as it is; the YAML JobSpec (jobs/spec.py)
is validated at the edge and converted into this.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from prefixflow.operators.template import PromptTemplate, check_syntax
from prefixflow.pipeline.requests import SamplingParams

ORDERS = ("fcfs", "dfs", "batchllm", "blendserve")


@dataclass(frozen=True)
class ProcessorConfig:
    """Options of a prefixflow processor (see `prefixflow.build_processor`).

    model: Hugging Face model directory.
    prompt: how a row becomes a prompt (a PromptTemplate or a dict of its fields). None: each
        row carries `messages` (chat) or `prompt` (text) itself, as in ray.data.llm.
    sampling: default SamplingParams (or a dict of its fields); a row's `sampling_params`
        column overrides fields per row.
    engine: EngineConfig fields other than `model` (dtype, device, max_num_batched_tokens, ...).
    order: plan order policy: fcfs, dfs, batchllm or blendserve.
    replicas: data-parallel engine actors (Ray's `concurrency`).
    num_gpus_per_replica / num_cpus_per_replica: resources of each engine actor.
    tokenize_concurrency / tokenize_batch_size: tokenizer actors and their batch size.
    rows_per_chunk: outputs per streamed output block (and per written part).
    include_prompt: add the rendered prompt text as a `prompt` column.
    openai_batch: rows are OpenAI batch requests (custom_id + body), see operators/openai_batch.
    """

    model: str
    prompt: PromptTemplate | dict[str, Any] | None = None
    sampling: SamplingParams | dict[str, Any] = field(default_factory=SamplingParams)
    engine: dict[str, Any] = field(default_factory=dict)
    order: str = "batchllm"
    replicas: int = 1
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 1.0
    tokenize_concurrency: int = 1
    tokenize_batch_size: int = 256
    rows_per_chunk: int = 1000
    include_prompt: bool = False
    openai_batch: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.prompt, dict):
            object.__setattr__(self, "prompt", PromptTemplate(**self.prompt))
        if isinstance(self.sampling, dict):
            object.__setattr__(self, "sampling", SamplingParams(**self.sampling))
        if self.prompt is not None:
            for name in ("template", "system", "user"):
                check_syntax(f"prompt.{name}", getattr(self.prompt, name))
        _require(self.order in ORDERS, "order", self.order, f"use one of {', '.join(ORDERS)}")
        for name in ("replicas", "tokenize_concurrency", "tokenize_batch_size", "rows_per_chunk"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), "use a positive integer")
        _require("model" not in self.engine, "engine", self.engine,
                 "give the model as ProcessorConfig.model, not inside engine")
        self.engine_config()  # EngineConfig checks its own fields, naming them

    def engine_config(self) -> Any:
        from prefixflow.engine.config import EngineConfig

        return EngineConfig(model=self.model, **self.engine)

    def with_(self, **changes: Any) -> "ProcessorConfig":
        return replace(self, **changes)


def _require(ok: bool, name: str, value: object, fix: str) -> None:
    if not ok:
        raise ValueError(f"ProcessorConfig.{name}={value!r} is invalid: {fix}")
