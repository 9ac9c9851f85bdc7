"""The Python API, in the shape of `ray.data.llm`:

    import prefixflow
    config = prefixflow.ProcessorConfig(model="/models/tiny", prompt={"template": "Q: {{ q }}"},
                                        sampling={"temperature": 0, "max_tokens": 32}, replicas=2)
    processor = prefixflow.build_processor(config, postprocess=lambda row: {...})
    out = processor(ds)            # a lazy Dataset: the job (tokenize, plan, generate) runs when it executes

or, the lighter per-batch mode (no global plan):

    ds.map_batches(prefixflow.Generator, fn_constructor_kwargs={"config": config},
                   batch_size=512, concurrency=2, batch_format="pyarrow")

ray.data.llm's names (Ray 2.60) work too, changing only the import line (operators/faces/ray_llm.py):
`build_processor(vLLMEngineProcessorConfig(model_source=..., engine_kwargs={...}, concurrency=2,
chat_template_stage=ChatTemplateStageConfig(...)), preprocess=..., postprocess=...,
builder_kwargs=...)` gives the same planned processor on the vLLM backend, with Ray's columns.

Neither imports torch or ray until used. The caller owns `ray.init`.
"""

from __future__ import annotations

from typing import Any, Callable

from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.faces.batch_generator import Generator
from prefixflow.operators.faces.processor import Processor
from prefixflow.operators.faces.ray_llm import RayLLMProcessor
from prefixflow.operators.faces.ray_llm import build_processor as build_ray_llm_processor
from prefixflow.operators.faces.ray_llm_config import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    HttpRequestProcessorConfig,
    HttpRequestStageConfig,
    PrepareMultimodalStageConfig,
    SGLangEngineProcessorConfig,
    ServeDeploymentProcessorConfig,
    TokenizerStageConfig,
    vLLMEngineProcessorConfig,
)
from prefixflow.operators.template import PromptTemplate

# ours, then ray.data.llm's config classes under the names Ray gives them (the package's lazy
# exports, prefixflow/__init__.py, list the same)
__all__ = [
    "Generator",
    "ProcessorConfig",
    "Processor",
    "PromptTemplate",
    "build_llm_processor",
    "build_processor",
    "vLLMEngineProcessorConfig",
    "ChatTemplateStageConfig",
    "TokenizerStageConfig",
    "DetokenizeStageConfig",
    "PrepareMultimodalStageConfig",
    "HttpRequestStageConfig",
    "SGLangEngineProcessorConfig",
    "HttpRequestProcessorConfig",
    "ServeDeploymentProcessorConfig",
]


def build_processor(
    config: ProcessorConfig | vLLMEngineProcessorConfig,
    preprocess: Callable[[dict], dict] | None = None,
    postprocess: Callable[[dict], dict] | None = None,
    preprocess_map_kwargs: dict[str, Any] | None = None,
    postprocess_map_kwargs: dict[str, Any] | None = None,
    builder_kwargs: dict[str, Any] | None = None,
) -> Processor | RayLLMProcessor:
    """A callable Dataset -> Dataset that tokenizes, plans globally and generates when the
    Dataset it returns executes.

    preprocess: row -> dict before tokenization (e.g. build `messages` or `prompt`), merged
        into the row (the row's other columns stay), as in ray.data.llm.
    postprocess: row -> row on each output row (input columns carried through, plus
        generated_text, generated_tokens, num_input_tokens, num_generated_tokens,
        finish_reason, error, row_id, replica).
    preprocess_map_kwargs / postprocess_map_kwargs: Dataset.map arguments of those two stages.
    A vLLMEngineProcessorConfig gives ray.data.llm's processor (its columns and error rule;
    builder_kwargs: its `chat_template_kwargs`).
    """
    if isinstance(config, vLLMEngineProcessorConfig):
        return build_ray_llm_processor(
            config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs, builder_kwargs
        )
    if not isinstance(config, ProcessorConfig):
        raise TypeError(
            f"build_processor needs a ProcessorConfig or a vLLMEngineProcessorConfig, got {type(config).__name__}"
        )
    if builder_kwargs:
        raise TypeError(
            f"build_processor got builder_kwargs={builder_kwargs!r}: that is ray.data.llm's, "
            "taken with a vLLMEngineProcessorConfig; give ProcessorConfig(chat_template_kwargs=...)"
        )
    return Processor(
        config,
        preprocess=preprocess,
        postprocess=postprocess,
        preprocess_map_kwargs=preprocess_map_kwargs,
        postprocess_map_kwargs=postprocess_map_kwargs,
    )


build_llm_processor = build_processor  # ray.data.llm's older name, for code written for earlier Ray
