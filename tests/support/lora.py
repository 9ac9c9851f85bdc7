"""Tiny LoRA adapters in PEFT's layout, written by hand (peft is not a dependency), and their
oracle: transformers with each adapter merged into the weights (W + B A * alpha / r, what PEFT
computes for a LoRA layer without dropout).

An adapter targets every linear layer of a Llama block, so vLLM's packed layers (qkv_proj,
gate_up_proj) are exercised, and its weights are large enough to change greedy outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def _linear(name: str, layer: int) -> str:
    return f"model.layers.{layer}.{_MODULE.get(name, 'mlp')}.{name}"


def write_adapter(base: Path, out: Path, seed: int, rank: int = 8, alpha: int = 16) -> Path:
    """A random LoRA adapter for the checkpoint at `base`, saved as PEFT saves one."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    config = json.loads((base / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in TARGETS:
            out_dim, in_dim = weights[_linear(name, layer) + ".weight"].shape
            key = f"base_model.model.{_linear(name, layer)}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, in_dim, generator=g) * 0.3
            tensors[key + ".lora_B.weight"] = torch.randn(out_dim, rank, generator=g) * 0.3
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": str(base),
    }
    (out / "adapter_config.json").write_text(json.dumps(peft_config))
    return out


def merged_model(base: Path, adapter: Path | None):
    """transformers' model of `base` with `adapter` merged into its weights (None: the base)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is None:
        return model.eval()
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    state = model.state_dict()
    for key in [k for k in lora if k.endswith(".lora_A.weight")]:
        linear = key[len("base_model.model.") : -len(".lora_A.weight")]
        state[linear + ".weight"] += lora[key.replace("lora_A", "lora_B")] @ lora[key] * scale
    model.load_state_dict(state)
    return model.eval()


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """The model's greedy continuation of `prompt`, max_tokens long with EOS as any token (as
    ignore_eos generates; generate's min_new_tokens would instead forbid EOS)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
