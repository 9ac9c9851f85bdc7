"""Per-request compute and memory time from a model shape and a hardware profile (BlendServe Sec. 4).

For a request with p prompt tokens of which s are already computed (a shared prefix or a cached
one) and d output tokens, on a model of L layers, hidden size h, Hq query heads, Hkv KV heads of
dimension D, and a device of F FLOP/s peak and B bytes/s memory bandwidth:

    GEMM FLOPs = 2 * P_layers * ((p - s) + d) + 2 * h * V * d
        Sec. 4.1's "2 * model_size" FLOPs per token; P_layers = L * (attention + MLP weights);
        logits (the h x V head) only for output tokens.
    attention  = 2 * L * Hq * D * (p^2 - s^2)
        QK^T and PV of the causal prefill of the p - s new tokens (the paper's
        4 * L * h * l_in^2 counts the full square; a causal kernel computes half of it).
    T_comp     = (GEMM FLOPs + attention) / F
    T_mem      = sum_{i=1..d} (p + i) * kv_bytes_per_token / B
               = (d * p + d * (d + 1) / 2) * 2 * L * Hkv * D * dtype_bytes / B
        Sec. 4.1: each decode step reads the KV of every earlier token.
    kv_bytes   = (p + d) * kv_bytes_per_token      (the footprint at completion)
    density    = T_comp / T_mem                    (Sec. 4.1's compute density)

Sharing a prefix saves compute but no memory traffic: every member still reads the prefix's KV
during decode (Sec. 3.3). Sec. 4.2 shows that the request-level density is the batch-level one
under continuous batching, so densities of sets of requests add as sum(T_comp) / sum(T_mem).

One engine step (`CostModel.step_seconds`, a prediction for pricing schedules): its T tokens'
GEMMs and prefill attention run at the roofline, max(FLOPs / F, weight bytes / B), then decode
attention reads each decode's KV (memory-bound). With `bubbles`, every decode of the step costs
what the longest costs (n * max KV length: AlignedServe Sec. 2.3's per-iteration bubble, a
kernel that gives each sequence one program and waits for the longest); without, the reads
are perfectly balanced (sum of KV lengths). Real kernels (split-K decode) lie in between.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_OUTPUT_LEN = 128  # output tokens assumed per request when the caller gives no estimate
_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a Llama-family decoder that set its FLOPs and KV bytes."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"ModelShape.{name}={value!r} is invalid: use a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | os.PathLike) -> "ModelShape":
        """From a Hugging Face config.json: a dict, the file's path, or the model directory."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"model={str(config)!r} is not a config.json or a directory holding one")
            raw: dict[str, Any] = json.loads(path.read_text())
        else:
            raw = config
        cfg: dict[str, Any] = raw.get("text_config", raw)  # multi-modal wrappers keep the LLM inside
        missing = [
            k
            for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
            if k not in cfg
        ]
        if missing:
            raise ValueError(f"model config lacks {', '.join(missing)}: give a Llama-family config.json")
        heads = int(cfg["num_attention_heads"])
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
        return cls(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        )

    @property
    def layer_params(self) -> int:
        """Weights of the decoder layers that GEMMs touch: q, k, v, o and a gated MLP."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        return self.num_layers * (attn + 3 * h * self.intermediate_size)

    @property
    def weight_bytes(self) -> int:
        embeddings = 2 * self.vocab_size * self.hidden_size  # input table and LM head
        return (self.layer_params + embeddings) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


# Llama-3.1-8B: the model BlendServe's case study and most offline batch jobs use.
LLAMA3_8B = ModelShape(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    dtype_bytes=2,
)


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """peak_flops: dense 16-bit tensor FLOP/s; mem_bandwidth: bytes/s; memory_bytes: device memory."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth", "memory_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HardwareProfile.{name}={getattr(self, name)!r} must be positive")

    def kv_budget_bytes(self, model: ModelShape, memory_utilization: float = 0.9) -> float:
        """KV-cache memory left after the weights (at least 5% of the device)."""
        return max(memory_utilization * self.memory_bytes - model.weight_bytes, 0.05 * self.memory_bytes)


GIB = 1024**3
HARDWARE = {  # vendor datasheet peaks (dense bf16, HBM bandwidth, capacity)
    "h100": HardwareProfile("h100", 989e12, 3.35e12, 80 * GIB),
    "h200": HardwareProfile("h200", 989e12, 4.8e12, 141 * GIB),
    "a100": HardwareProfile("a100", 312e12, 2.039e12, 80 * GIB),
}


def measure_cpu_profile(
    matmul_size: int = 512, copy_mib: int = 64, memory_bytes: float = 4 * GIB, repeats: int = 3
) -> HardwareProfile:
    """A profile of this CPU: float32 matmul FLOP/s and array-copy bandwidth (read + write)."""
    a = np.ones((matmul_size, matmul_size), dtype=np.float32)
    src = np.ones(copy_mib * 1024 * 1024 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    flops, bandwidth = 0.0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        flops = max(flops, 2 * matmul_size**3 / max(time.perf_counter() - start, 1e-9))
        start = time.perf_counter()
        np.copyto(dst, src)
        bandwidth = max(bandwidth, 2 * src.nbytes / max(time.perf_counter() - start, 1e-9))
    return HardwareProfile("cpu", flops, bandwidth, memory_bytes)


def get_hardware(hardware: str | HardwareProfile) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware == "cpu":
        return measure_cpu_profile()
    if hardware not in HARDWARE:
        raise ValueError(
            f"hardware={hardware!r} is not a known profile: use one of "
            f"{', '.join([*HARDWARE, 'cpu'])} or a HardwareProfile"
        )
    return HARDWARE[hardware]


def get_model_shape(model: ModelShape | dict | str | os.PathLike | None) -> ModelShape:
    if model is None:
        return LLAMA3_8B
    if isinstance(model, ModelShape):
        return model
    return ModelShape.from_hf_config(model)


@dataclass(frozen=True, slots=True, eq=False)
class RequestCost:
    """Per-request predictions, all [n] float64: seconds, bytes and T_comp / T_mem."""

    compute_s: np.ndarray
    memory_s: np.ndarray
    kv_bytes: np.ndarray
    density: np.ndarray


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelShape = LLAMA3_8B
    hardware: HardwareProfile = HARDWARE["h100"]

    @classmethod
    def create(
        cls, model: ModelShape | dict | str | None = None, hardware: str | HardwareProfile = "h100"
    ) -> "CostModel":
        return cls(get_model_shape(model), get_hardware(hardware))

    @property
    def kv_budget_bytes(self) -> float:
        return self.hardware.kv_budget_bytes(self.model)

    def compute_seconds(
        self, prompt_lens: np.ndarray, output_lens: np.ndarray, cached_lens: np.ndarray | int = 0
    ) -> np.ndarray:
        """T_comp of tokens cached_lens .. prompt_lens-1 plus the decode (module docstring)."""
        m = self.model
        p = np.asarray(prompt_lens, dtype=np.float64)
        d = np.asarray(output_lens, dtype=np.float64)
        s = np.asarray(cached_lens, dtype=np.float64)
        gemm = 2.0 * m.layer_params * ((p - s) + d) + 2.0 * m.hidden_size * m.vocab_size * d
        attn = 2.0 * m.num_layers * m.num_heads * m.head_dim * (p * p - s * s)
        return (gemm + attn) / self.hardware.peak_flops

    def memory_seconds(self, prompt_lens: np.ndarray, output_lens: np.ndarray) -> np.ndarray:
        """T_mem: KV bytes that decode attention reads, over the bandwidth."""
        p = np.asarray(prompt_lens, dtype=np.float64)
        d = np.asarray(output_lens, dtype=np.float64)
        tokens_read = d * p + d * (d + 1.0) / 2.0
        return tokens_read * self.model.kv_bytes_per_token / self.hardware.mem_bandwidth

    def prefix_seconds(self, prefix_lens: np.ndarray) -> np.ndarray:
        """T_comp of a shared prefix computed once (no decode, no logits)."""
        return self.compute_seconds(prefix_lens, np.zeros_like(np.asarray(prefix_lens)), 0)

    def step_seconds(
        self,
        decode_kv_lens: np.ndarray | list[int],
        prefill_chunks: np.ndarray | Sequence[tuple[int, int]] = (),
        bubbles: bool = True,
    ) -> float:
        """Predicted seconds of one engine step (module docstring).

        decode_kv_lens: KV tokens each decode of the step attends to (its context).
        prefill_chunks: (tokens already in context, new tokens) per prefill chunk; each is
            counted as sampling one token (an upper bound on the LM-head work).
        """
        m = self.model
        kv = np.asarray(decode_kv_lens, dtype=np.float64)
        chunks = np.asarray(prefill_chunks, dtype=np.float64).reshape(-1, 2)
        ctx, new = chunks[:, 0], chunks[:, 1]
        tokens, sampled = len(kv) + new.sum(), len(kv) + len(chunks)
        per_head = 2.0 * m.num_layers * m.num_heads * m.head_dim
        flops = (
            2.0 * m.layer_params * tokens
            + 2.0 * m.hidden_size * m.vocab_size * sampled
            + per_head * ((ctx + new) ** 2 - ctx**2).sum()
            + 2.0 * per_head * kv.sum()
        )
        weights = (m.layer_params + m.hidden_size * m.vocab_size) * m.dtype_bytes
        linear = max(flops / self.hardware.peak_flops, weights / self.hardware.mem_bandwidth)
        read = len(kv) * kv.max() if bubbles and len(kv) else kv.sum()
        return float(linear + read * m.kv_bytes_per_token / self.hardware.mem_bandwidth)

    def predict(
        self, prompt_lens: np.ndarray, output_lens: np.ndarray, cached_lens: np.ndarray | int = 0
    ) -> RequestCost:
        """Vectorised over requests: arrays in, arrays out."""
        comp = self.compute_seconds(prompt_lens, output_lens, cached_lens)
        mem = self.memory_seconds(prompt_lens, output_lens)
        kv = (np.asarray(prompt_lens, np.float64) + np.asarray(output_lens, np.float64)) * self.model.kv_bytes_per_token
        return RequestCost(comp, mem, kv, density(comp, mem))


def density(compute_s: np.ndarray | float, memory_s: np.ndarray | float) -> np.ndarray:
    """T_comp / T_mem; work with no decode is treated as reading one token (finite, very dense)."""
    floor = 1e-12
    rho: np.ndarray = np.asarray(compute_s, dtype=np.float64) / np.maximum(np.asarray(memory_s, np.float64), floor)
    return rho
