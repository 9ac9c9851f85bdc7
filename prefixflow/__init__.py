"""prefixflow: offline batch LLM inference that plans the whole job before running it.

The subpackages live in the repository's top-level folders (pipeline/, engine/, kernels/,
operators/, jobs/, bench/) and install as `prefixflow.<folder>`.

    import prefixflow
    processor = prefixflow.build_processor(prefixflow.ProcessorConfig(model=...))

or, for ray.data.llm users, its names (Ray 2.60; only the import line changes):

    from prefixflow import build_processor, vLLMEngineProcessorConfig, ChatTemplateStageConfig
    (build_llm_processor, Ray's older name, works too)

The API names below are imported lazily: `import prefixflow` loads neither torch nor ray.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The public API's names: api.__all__, listed here so that `import prefixflow` imports nothing
# (tests/cpu/test_import_isolation.py checks that the two lists agree).
_API = (
    "build_processor",
    "ProcessorConfig",
    "Processor",
    "Generator",
    "PromptTemplate",
    "build_llm_processor",
    "vLLMEngineProcessorConfig",
    "ChatTemplateStageConfig",
    "TokenizerStageConfig",
    "DetokenizeStageConfig",
    "PrepareMultimodalStageConfig",
    "HttpRequestStageConfig",
    "SGLangEngineProcessorConfig",
    "HttpRequestProcessorConfig",
    "ServeDeploymentProcessorConfig",
)

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        # lazy: `import prefixflow` loads neither torch nor ray (see the docstring)
        from prefixflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'prefixflow' has no attribute {name!r}")
