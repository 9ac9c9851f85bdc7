"""The Python API, in the shape of `ray.data.llm`:

    import prefixflow
    config = prefixflow.ProcessorConfig(model="/models/tiny", prompt={"template": "Q: {{ q }}"},
                                        sampling={"temperature": 0, "max_tokens": 32}, replicas=2)
    processor = prefixflow.build_processor(config, postprocess=lambda row: {...})
    out = processor(ds)            # plans the whole dataset now; returns a lazy Dataset

or, the lighter per-batch mode (no global plan):

    ds.map_batches(prefixflow.Generator, fn_constructor_kwargs={"config": config},
                   batch_size=512, concurrency=2, batch_format="pyarrow")

ray.data.llm's names work too (operators/ray_llm.py): `build_llm_processor(
vLLMEngineProcessorConfig(model_source=..., engine_kwargs={...}, concurrency=2), preprocess=...,
postprocess=...)` gives the same planned processor on the vLLM backend.

Neither imports torch or ray until used. The caller owns `ray.init`.
"""

from __future__ import annotations

from typing import Any, Callable

from prefixflow.operators.batch_generator import Generator
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.processor import Processor
from prefixflow.operators.ray_llm import RayLLMProcessor, build_llm_processor, vLLMEngineProcessorConfig
from prefixflow.operators.template import PromptTemplate

__all__ = ["Generator", "ProcessorConfig", "Processor", "PromptTemplate", "build_llm_processor",
           "build_processor", "vLLMEngineProcessorConfig"]


def build_processor(config: ProcessorConfig | vLLMEngineProcessorConfig,
                    preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None,
                    **ray_llm_kwargs: Any) -> Processor | RayLLMProcessor:
    """A callable Dataset -> Dataset that tokenizes, plans globally and generates.

    preprocess: row -> dict before tokenization (e.g. build `messages` or `prompt`), merged
        into the row (the row's other columns stay), as in ray.data.llm.
    postprocess: row -> row on each output row (input columns carried through, plus
        generated_text, generated_tokens, num_input_tokens, num_generated_tokens,
        finish_reason, error, row_id, replica).
    A vLLMEngineProcessorConfig goes to build_llm_processor (ray.data.llm's newer name for it
    is build_processor too), with its keyword arguments (preprocess_map_kwargs, ...).
    """
    if isinstance(config, vLLMEngineProcessorConfig):
        return build_llm_processor(config, preprocess, postprocess, **ray_llm_kwargs)
    if not isinstance(config, ProcessorConfig):
        raise TypeError(f"build_processor needs a ProcessorConfig, got {type(config).__name__}")
    if ray_llm_kwargs:
        raise TypeError(f"build_processor got {', '.join(ray_llm_kwargs)}: those are "
                        "ray.data.llm's, taken with a vLLMEngineProcessorConfig only")
    return Processor(config, preprocess=preprocess, postprocess=postprocess)
