"""One replica's engine: paged KV, grouped scheduling, the model and its runner.

    from prefixflow.engine import LLMEngine, EngineConfig, SamplingParams, RequestOutput

Names are imported lazily, so that `prefixflow.engine.scheduler` and
`prefixflow.engine.block_manager` can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "prefixflow.engine.llm_engine",
    "EngineConfig": "prefixflow.engine.config",
    "SamplingParams": "prefixflow.requests",
    "RequestOutput": "prefixflow.engine.outputs",
    "TokenLogprob": "prefixflow.engine.outputs",
    "StepStats": "prefixflow.engine.outputs",
    "EngineTotals": "prefixflow.engine.outputs",
    "Scorer": "prefixflow.engine.scoring",
    "ScoreOptions": "prefixflow.engine.scoring_options",
    "ScoreOutput": "prefixflow.engine.scoring_choices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'prefixflow.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
