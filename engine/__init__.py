"""One replica's engine, in four rooms over two shared modules.

    from prefixflow.engine import LLMEngine, EngineConfig, SamplingParams, RequestOutput

config.py (EngineConfig, every engine's settings) and outputs.py (what every engine hands back)
are shared; native/ is our engine (LLMEngine), scoring/ the score task (Scorer), vllm_backend/
the same interface on vLLM, http_backend/ on an OpenAI-compatible server, models/ the model,
its layers and its loading. The rooms import the
shared modules and models/, never each other, except that vllm_backend/ scores through
scoring/'s torch-free choices and options.

Names are imported lazily, so that `prefixflow.engine.native.scheduler` and
`prefixflow.engine.native.block_manager` can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "prefixflow.engine.native.llm_engine",
    "EngineConfig": "prefixflow.engine.config",
    "SamplingParams": "prefixflow.requests",
    "RequestOutput": "prefixflow.engine.outputs",
    "TokenLogprob": "prefixflow.engine.outputs",
    "StepStats": "prefixflow.engine.outputs",
    "EngineTotals": "prefixflow.engine.outputs",
    "Scorer": "prefixflow.engine.scoring.scorer",
    "ScoreOptions": "prefixflow.engine.scoring.options",
    "ScoreOutput": "prefixflow.engine.scoring.choices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'prefixflow.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
