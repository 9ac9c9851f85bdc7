"""The shape of a Llama-family checkpoint, read from its config.json without torch.

The engine builds its model from `ModelArgs`; the job's preflight (KV block bytes, the model's
length limit) and the benchmarks read the same shape in processes that never load weights, so
this module imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixflow.model_source import resolve_model

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Base models without an LM head (embedding checkpoints such as e5-mistral's MistralModel): the
# same network, its weights named without the "model." prefix; they embed, they cannot generate.
BASE_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
# Sequence classifiers: the network and a `score` head ([labels, hidden], no bias) on the last
# token's final hidden state, for the classify task.
CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("softmax", "sigmoid", "identity")  # ModelArgs.activation's values the engines apply
# The torch.nn.modules a sentence-transformers cross-encoder's config may name as its activation
# (nothing else is imported or run). Softmax and Sigmoid both mean "classify" as vLLM takes them:
# sigmoid over one label, softmax over more.
SBERT_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "classify",
    "torch.nn.modules.activation.Softmax": "classify",
    "torch.nn.modules.linear.Identity": "identity",
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """theta: base wavelength. rope_type: one of SUPPORTED_ROPE_TYPES. factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings: the scaling's parameters."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported: use one of {', '.join(SUPPORTED_ROPE_TYPES)}"
            )


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The shape of a Llama-family model, parsed from config.json by the loader."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before rotary
    sliding_window: int | None = None  # None: full attention
    has_lm_head: bool = True  # False: a base model or a classifier, which embed (and classify)
    labels: tuple[str, ...] = ()  # a classifier's labels (config.json id2label), in id order
    # What a classifier's label logits become, chosen from config.json as vLLM's pooler chooses
    # it (`_activation`): "softmax" over two or more labels, "sigmoid" over one (a cross-encoder's
    # relevance score) or for multi-label problems, "identity" for regression; any other value
    # is the activation the config names, which require_classifier refuses.
    activation: str = "softmax"

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """K and V elements one token occupies in the cache, all layers (multiply by the
        element size for bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def require_lm_head(args: ModelArgs, task: str) -> None:
    """ValueError for a base model or classifier (no LM head) asked to do what needs the
    vocabulary's logits (`task`)."""
    if not args.has_lm_head:
        kind = "a sequence classifier" if args.labels else "a base model"
        can = "embed (task: embed) and classify (task: classify)" if args.labels else "embed (task: embed)"
        raise ValueError(
            f"the checkpoint is {kind} ({args.architecture.replace('ForCausalLM', '')}) without an "
            f"LM head: it can {can}, not {task}; use a {args.architecture} checkpoint to {task}"
        )


def require_classifier(args: ModelArgs) -> None:
    """ValueError for a checkpoint without a classification head asked to classify, or whose
    config names an activation the engines do not apply."""
    if not args.labels:
        raise ValueError(
            f"task classify needs a sequence classification checkpoint ({', '.join(CLASSIFIER_ARCHITECTURES)}: "
            f"a score head over labels); this one is {args.architecture if args.has_lm_head else 'a base model'}"
        )
    if args.activation not in ACTIVATIONS:
        raise ValueError(
            f"config.json names the cross-encoder activation {args.activation!r}: prefixflow applies "
            f"{', '.join(SBERT_ACTIVATIONS)} (remove it for the default: sigmoid over one label, "
            "softmax over more)"
        )


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


# A vision-language checkpoint's text_config names its language model by model_type only.
TEXT_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TEXT_MODEL_TYPES["qwen3"] = "Qwen3ForCausalLM"


def read_model_args(path: str | Path, vision: bool = False) -> ModelArgs:
    """Parse config.json into ModelArgs; unknown architectures raise ValueError.

    vision: the caller runs vision-language models (the vLLM backend): a config whose
    text_config is one of the supported language models gives that model's args (the KV cache
    is the language model's). Elsewhere such a checkpoint is refused: the native engine runs text."""
    cfg = read_json(resolve_model(path) / "config.json")
    archs = cfg.get("architectures") or []
    text = cfg.get("text_config")
    if vision and isinstance(text, dict) and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        arch = TEXT_MODEL_TYPES.get(str(text.get("model_type")))
        if arch is not None:
            cfg, archs = text, [arch]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    has_lm_head = arch is not None
    headless = {**BASE_ARCHITECTURES, **CLASSIFIER_ARCHITECTURES}
    if arch is None:  # a base model or a classifier: the same network as its causal LM's
        arch = next((headless[a] for a in archs if a in headless), None)
    classifier = not has_lm_head and any(a in CLASSIFIER_ARCHITECTURES for a in archs)
    if arch is None:
        vlm = " (a vision-language model whose text_config is one of those runs on engine.backend vllm)"
        raise ValueError(
            f"config.json architectures={archs!r} is not supported: prefixflow's "
            f"engine runs {', '.join(SUPPORTED_ARCHITECTURES)} (and, to embed or classify, "
            f"{', '.join(headless)}){vlm if isinstance(text, dict) else ''}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json hidden_act={cfg['hidden_act']!r} is not supported: the engine implements silu only"
        )
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    sliding = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        sliding = None  # Qwen2/3 list a window but only use it when use_sliding_window is set
    return ModelArgs(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=_rope_config(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(sliding) if sliding else None,
        has_lm_head=has_lm_head,
        labels=_labels(cfg) if classifier else (),
        activation=_activation(cfg, len(_labels(cfg))) if classifier else "softmax",
    )


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels by id: config.json id2label, else num_labels (LABEL_i, as
    transformers names them)."""
    id2label = cfg.get("id2label") or {}
    count = int(cfg.get("num_labels") or len(id2label) or 2)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))


def _activation(cfg: dict[str, Any], num_labels: int) -> str:
    """A classifier's activation (ModelArgs.activation) from config.json, as vLLM's pooler picks
    it: problem_type first, then a sentence-transformers cross-encoder's activation_fn (a null
    one: the default), else softmax over two or more labels and sigmoid over one. A name
    outside SBERT_ACTIVATIONS comes back as it is (never imported), for require_classifier to
    refuse when the checkpoint is asked to classify (it still embeds)."""
    by_labels = "softmax" if num_labels >= 2 else "sigmoid"
    problem = cfg.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem == "single_label_classification":
        return by_labels
    sbert = cfg.get("sentence_transformers")
    if isinstance(sbert, dict) and "activation_fn" in sbert:
        name = sbert["activation_fn"]
    else:
        name = cfg.get("sbert_ce_default_activation_function")
    if name is None:
        return by_labels
    if name not in SBERT_ACTIVATIONS:
        return str(name)
    return by_labels if SBERT_ACTIVATIONS[name] == "classify" else "identity"


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); 4.x wrote rope_theta + rope_scaling.
    params: dict[str, Any] = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    fields = {
        k: params[k]
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if k in params
    }
    return RopeConfig(theta=theta, rope_type=rope_type, **fields)
