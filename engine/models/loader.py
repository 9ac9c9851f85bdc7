"""Hugging Face model directory -> our model and tokenizer.

The folder comes from prefixflow.model_source, which also takes hub ids, .gguf files, s3:// folders
and the short name of the packaged real model.

Reads config.json with `model_args` (torch-free: the job's driver reads the shape too), builds
`models.llama.LlamaForCausalLM` on the meta device, materialises it on the target device in the
target dtype and copies the safetensors weights in (one file, or shards listed by
model.safetensors.index.json). transformers' model classes are never used for inference; the
tokenizer comes from prefixflow/tokenizer.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.models.layers.linear import prepack_linears
from prefixflow.engine.models.llama import LlamaForCausalLM
from prefixflow.engine.models.model_args import ModelArgs, read_json, read_model_args
from prefixflow.model_source import resolve_model, weight_files
from prefixflow.tokenizer import load_tokenizer as load

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Weights in some checkpoints that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def model_dir(path: str | Path) -> Path:
    """The local Hugging Face folder of `path`: a folder, hub id, .gguf file, s3:// folder or
    short name, resolved (converted or copied once) by prefixflow.model_source."""
    return resolve_model(path)


def load_model(
    path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu", max_positions: int | None = None
) -> LlamaForCausalLM:
    """Build our model for the checkpoint at `path` and load its weights.

    dtype: "auto" (see `torch_dtype`), "float32", "bfloat16" or "float16". max_positions: size
    of the rotary table (default: the model's max_position_embeddings).
    """
    folder = model_dir(path)
    torch_type = torch_dtype(dtype, folder, device)
    args = read_model_args(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_positions or args.max_position_embeddings)
    _materialize(model.to(dtype=torch_type), torch.device(device))
    model.model.rotary.reset_cache()  # fp32 table; _materialize left it uninitialised
    model.tie_weights()
    _load_weights(model, weight_files(folder))
    if torch.device(device).type == "cpu":
        prepack_linears(model)  # after the weights are in: it reorders them for oneDNN
    return model.eval().requires_grad_(False)


def resolve_device(device: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu; checks that a requested CUDA device exists."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device={device!r} but CUDA is not available; use 'cpu' or 'auto'")
    return dev


def resolve_max_model_len(config: EngineConfig, args: ModelArgs) -> int:
    limit = args.max_position_embeddings
    if args.sliding_window is not None:
        limit = min(limit, args.sliding_window)  # full attention is exact only inside the window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"EngineConfig.max_model_len={config.max_model_len} exceeds what the "
            f"model supports ({limit}: max_position_embeddings, or the sliding "
            "window); use a smaller value or None"
        )
    return config.max_model_len


def torch_dtype(dtype: str, path: str | Path, device: str | torch.device) -> torch.dtype:
    """The dtype weights, activations and KV use. "auto", as vLLM does: on a GPU the dtype the
    checkpoint was saved in (config.json `dtype`, `torch_dtype` before transformers 5), on a CPU
    float32 (CPU half-precision matmuls are slow or missing, and float32 is exact)."""
    if dtype in DTYPES:
        return DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype={dtype!r} is not supported: use auto or one of {', '.join(DTYPES)}")
    if torch.device(device).type == "cpu":
        return torch.float32
    cfg = read_json(model_dir(path) / "config.json")
    saved = cfg.get("dtype") or cfg.get("torch_dtype")
    # float64 or a missing entry: float32, which every device runs.
    return DTYPES.get(str(saved), torch.float32)


@torch.no_grad()
def _materialize(model: nn.Module, device: torch.device) -> None:
    """Each meta tensor of `model` replaced by an uninitialised one of its dtype on `device`:
    Module.to_empty's result, without its path for meta tensors through torch's Python refs,
    whose first use imports sympy (1.1 s of a SmolLM2 engine's 4 s start on a CPU)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False
                )
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def _load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters())
    expected = {(name, i) for name, n in _num_hf_tensors(model).items() for i in range(n)}
    loaded: set[tuple[str, int]] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                if hf_name == "lm_head.weight" and model.args.tie_word_embeddings:
                    continue  # tied checkpoints sometimes store the copy too
                ours = hf_name  # a base model's weights lack the "model." prefix
                if not model.args.has_lm_head and not hf_name.startswith(("model.", "score.")):
                    ours = f"model.{hf_name}"
                name, rows = model.slice_of(ours)
                if name not in params:
                    raise ValueError(
                        f"{file.name} holds weight {hf_name!r} that the {model.args.architecture} model does not have"
                    )
                target = params[name] if rows is None else params[name][rows]
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"weight {hf_name!r} in {file.name} has shape "
                        f"{tuple(tensor.shape)}; config.json implies "
                        f"{tuple(target.shape)}"
                    )
                target.copy_(tensor)
                loaded.add((name, 0 if rows is None else _slice_index(model, ours)))
    missing = sorted(f"{n}[{i}]" for n, i in expected - loaded)
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(f"the checkpoint lacks weights (ours[slice]): {missing[:8]}{more}")


def _num_hf_tensors(model: LlamaForCausalLM) -> dict[str, int]:
    """Each parameter name -> how many HF tensors fill it (3 for qkv, 2 for gate_up)."""
    return {
        name: 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
        for name, _ in model.named_parameters()
    }


def _slice_index(model: LlamaForCausalLM, hf_name: str) -> int:
    return model.packed_modules[hf_name.split(".")[-2]][1]


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer (prefixflow/tokenizer.py: tokenizer.json read directly where that
    equals transformers' AutoTokenizer, which is used otherwise)."""
    return load(model_dir(path), trust_remote_code)


def read_eos_token_ids(path: str | Path, tokenizer: Any = None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    p = model_dir(path)
    for name in ("generation_config.json", "config.json"):
        f = p / name
        eos = read_json(f).get("eos_token_id") if f.is_file() else None
        if eos is not None:
            ids = eos if isinstance(eos, list) else [eos]
            return tuple(dict.fromkeys(int(i) for i in ids))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (int(tokenizer.eos_token_id),)
    return ()
