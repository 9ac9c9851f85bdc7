"""EngineConfig: everything one replica's engine needs, validated once at construction.

Torch-free: the scheduler and block manager are built from this without a model on disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from prefixflow.errors import require
from prefixflow.requests import SamplingParams, params_for_row

DType = Literal["auto", "float32", "bfloat16", "float16"]
Policy = Literal["batchllm", "vllm"]
# Defaults every backend applies the same way, defined here once:
CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache on a CPU when kv_cache_bytes is not set
VLLM_SEQS_CAP = 256  # the request cap of vLLM's scheduler (and of our "vllm" policy) when one applies


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Options of one engine replica.

    model: a Hugging Face model folder, hub id (from the local cache), .gguf file, s3:// folder
        or "smollm2-135m-instruct" (prefixflow.model_source resolves it where the engine runs).
    dtype: weights, activations and KV dtype; "auto": the checkpoint's own dtype on a GPU,
        float32 on a CPU (as vLLM does).
    device: "cpu", "cuda", "cuda:N", or "auto" (cuda when available).
    block_size: tokens per paged KV block.
    kv_cache_bytes: memory budget of the paged KV cache (all layers, K and V). None: on CUDA,
        `gpu_memory_utilization` of the free memory after loading; on CPU, 1 GiB.
    gpu_memory_utilization: share of the device memory the engine may use (CUDA only).
    max_num_batched_tokens: per-step token limit (BatchLLM's S_chunk; vLLM's chunk size).
    max_num_seqs: cap on running requests. None for the BatchLLM policy (memory-centric token
        batching has no request cap); the vLLM-like baseline uses 256.
    max_model_len: longest prompt + output; None: the model's max_position_embeddings.
    policy: "batchllm" (grouped scheduling, three queues, memory-centric batching) or
        "vllm" (arrival order, request cap, LRU prefix cache) for ablations.
    enable_prefix_cache: hashed block cache for second-level reuse (and the vLLM policy's LRU).
    aligned_decode_batch: AlignedServe's KV-length-aligned decode batches (Sec. 3.3-3.4).
        None (off): every request ready to decode decodes in every step. N: a step decodes at
        most N of them (and at most max_num_batched_tokens); when more are ready, the N of
        similar KV length that Density First Search picks (engine/native/alignedserve.py), while the
        others keep their KV in the cache and wait. The step's other tokens go to prefill, so
        the cache fills with requests to choose from (AlignedServe's KV pool). Outputs are the
        same; the gain is a GPU one (a decode step waits for its longest KV read, Sec. 2.3).
        Native engine only.
    trust_remote_code: never needed for the supported architectures; kept False by default.
    seed: default seed for requests without their own.
    max_tokens_cap: the most tokens one request may generate, whatever its max_tokens asks
        (the job's sampling, a row's sampling_params, an OpenAI body's max_completion_tokens);
        a request asking more stops there, finish_reason "length". None: no cap. A guard for
        jobs whose rows set their own max_tokens. Both backends.
    cuda_graphs: decode steps on persistent buffers padded to a ladder of batch sizes,
        captured as one CUDA graph per size at engine start and replayed each step
        (engine/native/static_step.py). Unset (None): on where they can be captured (a CUDA
        device running the Triton kernels of the model's head size; an H200 verified them and
        the default engine with them, README; model_runner.GRAPHS_BY_DEFAULT), off elsewhere
        (a CPU, ROCm, other head sizes); the KV budget from gpu_memory_utilization keeps their
        memory out, and with kv_cache_bytes set, leave it free yourself. false: off; true: on,
        refused on CUDA where they cannot be captured, and on a CPU the same buffers without
        graphs (what the tests check). Native engine only: vLLM captures its own unless engine.vllm sets enforce_eager.
    """

    model: str
    dtype: DType = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    max_num_batched_tokens: int = 2048
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    policy: Policy = "batchllm"
    enable_prefix_cache: bool = True
    aligned_decode_batch: int | None = None
    trust_remote_code: bool = False
    seed: int = 0
    max_tokens_cap: int | None = None
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        self._check_model_and_memory()
        self._check_batching()

    def _check_model_and_memory(self) -> None:
        """The model, its dtype and the KV cache's shape and budget."""
        _require(
            isinstance(self.model, str) and self.model != "",
            "model",
            self.model,
            "give a Hugging Face model folder, a hub id, a .gguf file or 'smollm2-135m-instruct'",
        )
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "use auto, float32, bfloat16 or float16",
        )
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "block_size",
            self.block_size,
            "use a power of two between 1 and 256",
        )
        _require(
            self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
            "kv_cache_bytes",
            self.kv_cache_bytes,
            "give a positive number of bytes or None",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "use a value in (0, 1]",
        )

    def _check_batching(self) -> None:
        """The scheduler's limits: tokens per step, requests, lengths, policy and caps."""
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "use a positive token count",
        )
        _require(
            self.max_num_seqs is None or self.max_num_seqs >= 1,
            "max_num_seqs",
            self.max_num_seqs,
            "use None (no cap) or a positive count",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            "max_model_len",
            self.max_model_len,
            "use None or at least 2",
        )
        _require(self.policy in ("batchllm", "vllm"), "policy", self.policy, "use 'batchllm' or 'vllm'")
        _require(
            self.aligned_decode_batch is None or self.aligned_decode_batch >= 1,
            "aligned_decode_batch",
            self.aligned_decode_batch,
            "use None (off) or a positive number of requests per decode step",
        )
        _require(
            self.max_tokens_cap is None or self.max_tokens_cap >= 1,
            "max_tokens_cap",
            self.max_tokens_cap,
            "use None (no cap) or a positive number of tokens",
        )

    def row_params(self, params: SamplingParams | Mapping[int, SamplingParams], row_id: int) -> SamplingParams:
        """A row's SamplingParams as this engine runs them: the one place both backends
        (LLMEngine, VllmEngine) read a request's parameters, so an engine-wide limit on them
        is a field of this class and nothing else."""
        p = params_for_row(params, row_id)
        cap = self.max_tokens_cap
        if cap is None or p.max_tokens <= cap:
            return p
        return replace(p, max_tokens=cap, min_tokens=min(p.min_tokens, cap))

    @property
    def effective_max_num_seqs(self) -> int | None:
        """The request cap the scheduler applies: none for BatchLLM, 256 for the vLLM baseline."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return VLLM_SEQS_CAP if self.policy == "vllm" else None


def _require(ok: bool, name: str, value: object, fix: str) -> None:
    require(ok, "EngineConfig", name, value, fix)
