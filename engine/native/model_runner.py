"""ModelRunner: one replica's model, paged KV cache and sampler behind `execute(StepInput)`.

API (what the scheduler side and the engine loop use):

    runner = ModelRunner(EngineConfig(model="path/to/hf_dir", dtype="float32", device="auto"))
    runner.num_kv_blocks       # int, blocks in the paged KV cache (ids 0 .. num_kv_blocks-1)
    runner.block_size          # int, tokens per block (EngineConfig.block_size)
    runner.kv_bytes_per_token  # int, K+V bytes of one token over all layers
    runner.max_model_len       # int, longest prompt + output (positions must stay below it)
    runner.vocab_size          # int
    runner.tokenizer           # transformers tokenizer of the checkpoint
    runner.eos_token_ids       # tuple[int, ...]
    runner.device, runner.dtype  # torch.device, torch.dtype of weights, activations and KV
    runner.args                # ModelArgs: the model's shape (layers, heads, head_dim, ...)
    out = runner.execute(step)         # StepOutput: one SampledToken per chunk with sample=True,
                                       # in the step's chunk order
    logits = runner.execute_logits(step)  # [num_sampled, vocab] fp32 raw logits, same order

Each `execute` makes the step's K/V copies (`StepInput.copies`), runs every chunk's tokens
(writing their K/V at the slots its block table gives), then samples from the last token of
each chunk that asks for it. The LM head runs only on those rows. Chunks may come in any
order: the runner puts the chunks that share a prefix next to each other, in prefix order,
before the others (the attention kernel's layout), and answers in the original order. Blocks are the scheduler's business: the runner trusts block
tables, but checks that they cover the tokens (ValueError otherwise). Token i of a chunk sits
at position start_pos + i, which must stay below max_model_len.

Sampling (engine/native/sampler.py): greedy when temperature is 0, else temperature, top-k, top-p; a
request's seed makes its tokens independent of the batch; logprobs are those of the raw logits.

KV cache size: `EngineConfig.kv_cache_bytes` when given; otherwise 1 GiB on CPU, and on CUDA
`gpu_memory_utilization` of the device memory minus what is in use after loading and the peak
activation memory of a warm-up step of `max_num_batched_tokens` tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prefixflow.engine.config import CPU_KV_CACHE_BYTES, VLLM_SEQS_CAP, EngineConfig
from prefixflow.engine.models.layers.attention import AttentionMetadata
from prefixflow.engine.models.loader import (
    load_model,
    load_tokenizer,
    read_eos_token_ids,
    resolve_device,
    resolve_max_model_len,
    torch_dtype,
)
from prefixflow.engine.models.model_args import read_model_args, require_lm_head
from prefixflow.engine.native.phases import FORWARD, PREPARE, SAMPLE, phase
from prefixflow.engine.native.sampler import Sampler
from prefixflow.engine.native.static_step import MAX_LADDER_BATCH, StaticDecode
from prefixflow.engine.native.step import SampledToken, SeqChunk, StepInput, StepOutput
from prefixflow.engine.native.step_batch import StepBatch, build_step_batch
from prefixflow.kernels import TRITON_HEAD_DIMS, triton_available
from prefixflow.requests import SamplingParams

# CPU steps of at most this many tokens (decode steps, small chunks) run on one thread while the
# CPU is oversubscribed (by the 1-minute load average, `cpu_oversubscribed`): a second thread's
# barrier waits then cost far more than it computes (peer_bench's quick decode_heavy, 2 threads
# at load 4-8: 25 s wall instead of 3.6 s on one thread). On a CPU the engine has to itself
# they use every thread, as vLLM's CPU build does: 12-request decode steps took 20-25% less wall
# time on 2 threads than on 1 (quiet 2-core machine, issue 17).
SINGLE_THREAD_MAX_TOKENS = 128
# Load average per core above which the CPU counts as oversubscribed. Not 1: the engine's own
# busy threads count, so a 2-thread engine alone on 2 cores reads 2-2.4, and at 1 it ran its
# decode steps on one thread with nobody to share the cores with (peer_bench decode_heavy 1.5x
# slower than alone at load 1.0-1.2).
OVERSUBSCRIBED_LOAD_PER_CORE = 1.5


# Whether engine.cuda_graphs, unset, turns the graphs on where they can be captured. On since an
# H200 verified the default engine with them (gpu_engine's default_budget part, 2026-12-04: the
# KV budget that keeps their pool and logits out, `_kv_budget_bytes`, and a capture after the
# cache took its share of the device, then 32 steps replayed at the top rung) besides the graphs
# themselves (float32 parity with transformers; README). The switch stays for a device that
# shows otherwise.
GRAPHS_BY_DEFAULT = True


def static_decode_wanted(setting: bool | None, device: torch.device, head_dim: int) -> bool:
    """Whether decode steps run on static buffers (as CUDA graphs on CUDA): as set, or, unset,
    where the graphs can be captured (a CUDA device, not ROCm's, running the Triton kernels of
    this head size) while GRAPHS_BY_DEFAULT says so. On a CPU the buffers only pad a step, so
    unset means off there; set true, they run (the tests)."""
    if setting is not None:
        return setting
    return GRAPHS_BY_DEFAULT and device.type == "cuda" and torch.version.hip is None and graphs_capturable(head_dim)


def graphs_capturable(head_dim: int) -> bool:
    """Whether a CUDA graph can hold this model's decode step: only with the Triton kernels, which
    take these head sizes (the torch fallbacks of others read values on the host, a sync, which a
    capture refuses)."""
    return head_dim in TRITON_HEAD_DIMS and triton_available()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.static: StaticDecode | None = None  # set last; steps before it (the CUDA profile) run eagerly
        self.device = resolve_device(config.device)
        self.dtype = torch_dtype(config.dtype, config.model, self.device)
        self.args = read_model_args(config.model)
        require_lm_head(self.args, "generate")
        self.max_model_len = resolve_max_model_len(config, self.args)
        self.vocab_size = self.args.vocab_size
        self.block_size = config.block_size
        self.model = load_model(config.model, config.dtype, self.device, self.max_model_len)
        self.tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        self.eos_token_ids = read_eos_token_ids(config.model, self.tokenizer)
        self.sampler = Sampler(config.seed, self.device)
        self.cuda_graphs = static_decode_wanted(config.cuda_graphs, self.device, self.args.head_dim)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.kv_bytes_per_token = self.args.kv_bytes_per_token_per_elem * elem
        self.num_kv_blocks = self._num_blocks(self._kv_budget_bytes())
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self.static = self._static_decode() if self.cuda_graphs else None

    # ------------------------------------------------------------------ public API

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step; one SampledToken per chunk with sample=True, in chunk order."""
        sampling = [c for c in step.chunks if c.sample]
        logits = self.execute_logits(step)
        if not sampling:
            return StepOutput(sampled=())
        params = [c.sampling_params for c in sampling if c.sampling_params is not None]
        assert len(params) == len(sampling), "build_step_batch lets no sampled chunk lack sampling_params"
        with phase(SAMPLE):
            out = self.sampler.sample(
                logits, params, [c.num_generated for c in sampling], [list(c.history) for c in sampling]
            )
        return StepOutput(
            sampled=tuple(
                SampledToken(
                    seq_id=c.seq_id,
                    token_id=out.token_ids[i],
                    logprob=out.logprobs[i],
                    top_logprobs=out.top_logprobs[i],
                )
                for i, c in enumerate(sampling)
            )
        )

    @torch.inference_mode()
    def execute_logits(self, step: StepInput) -> torch.Tensor:
        """Run one step; raw next-token logits [num_sampled, vocab] fp32 of the chunks with
        sample=True, in chunk order."""
        with phase(PREPARE):
            batch = build_step_batch(step, self.block_size, self.max_model_len, self.kv_cache.shape[2])
            for copy in step.copies:  # [layers, K/V, blocks, slots, ...]: every layer's slots at once
                self.kv_cache[:, :, copy.dst, : copy.num_tokens] = self.kv_cache[:, :, copy.src, : copy.num_tokens]
            rung = self.static.rung_for(batch) if self.static is not None else None
        with _cpu_threads(
            1
            if self.device.type == "cpu" and batch.num_tokens <= SINGLE_THREAD_MAX_TOKENS and cpu_oversubscribed()
            else None
        ):
            if rung is not None and self.static is not None:
                return self.static.run(batch, rung)
            with phase(PREPARE):
                ids, positions, meta, logits_indices = self._to_device(batch)
            with phase(FORWARD):
                logits: torch.Tensor = self.model(ids, positions, meta, logits_indices)
            return logits

    # ------------------------------------------------------------------ internals

    def _static_decode(self) -> StaticDecode:
        """Decode steps on persistent buffers (engine/native/static_step.py), captured as CUDA
        graphs on CUDA: a rung for each batch size up to the request cap, MAX_LADDER_BATCH and
        the step's token budget, block tables as wide as max_model_len needs."""
        static = StaticDecode(self.model, self._ladder_top(), -(-self.max_model_len // self.block_size), self.device)
        if self.device.type == "cuda":
            if not graphs_capturable(self.args.head_dim):
                raise ValueError(
                    f"EngineConfig.cuda_graphs captures the Triton kernels, which take head_dim in "
                    f"{TRITON_HEAD_DIMS} (with triton installed); this model's is {self.args.head_dim}: "
                    "set cuda_graphs to false"
                )
            with torch.inference_mode():
                static.capture()
        return static

    def _to_device(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        # Two host->device copies per step: all int64 arrays in one, all int32 ones in another
        # (the last layer's view, when there is one, after the step's own arrays).
        last = b.last
        longs = self._copy(b.int64_buffer if last is None else np.concatenate([b.int64_buffer, last.int64_buffer]))
        ints = self._copy(b.int32_buffer if last is None else np.concatenate([b.int32_buffer, last.int32_buffer]))
        t, n = b.num_tokens, b.num_sampled
        r = last.num_rows if last is not None else 0
        ids, positions, slots, logits_idx, rows, row_slots = longs.split([t, t, t, n, r, r])
        last_meta = None
        if last is not None:
            ints, last_ints = ints.split([b.int32_buffer.shape[0], last.int32_buffer.shape[0]])
            last_meta = _metadata(
                last_ints,
                row_slots,
                r,
                last.num_prefixes,
                b,
                rows=rows,
                is_prefill_only=False,
                is_decode_only=last.num_prefixes == 0,
            )
        meta = _metadata(
            ints,
            slots,
            b.num_seqs,
            b.num_prefixes,
            b,
            last_layer=last_meta,
            is_prefill_only=b.is_prefill_only,
            is_decode_only=b.is_decode_only,
        )
        return ids, positions, meta, logits_idx

    def _copy(self, host: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(host).to(self.device, non_blocking=True)

    def _ladder_top(self) -> int:
        """The static decode's top rung: the request cap, MAX_LADDER_BATCH, the token budget."""
        c = self.config
        return min(c.effective_max_num_seqs or MAX_LADDER_BATCH, MAX_LADDER_BATCH, c.max_num_batched_tokens)

    def _kv_budget_bytes(self) -> int:
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        activation = self._profile_activation_bytes()
        # With CUDA graphs, their pool too (at most a decode step of the top rung with its
        # logits, which the profile's step of max_num_batched_tokens tokens, as many sampled,
        # bounds) and the logits buffer they write.
        if self.cuda_graphs:
            activation = 2 * activation + self._ladder_top() * self.vocab_size * 4
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * self.config.gpu_memory_utilization - (total - free) - activation)

    def _profile_activation_bytes(self) -> int:
        """Peak extra memory of a warm-up step of max_num_batched_tokens tokens (CUDA)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.kv_cache = self._allocate_kv_cache(1)
        t = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_sampled = min(t, self.config.effective_max_num_seqs or VLLM_SEQS_CAP)
        logits = self.execute_logits(_warmup_step(t, num_sampled, self.block_size))
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * num_sampled
        self.sampler.sample(logits, params, [0] * num_sampled)
        del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del self.kv_cache  # the warm-up's cache, freed before the real one is sized
        torch.cuda.empty_cache()
        return max(0, peak - before)

    def _num_blocks(self, budget: int) -> int:
        num = budget // (self.block_size * self.kv_bytes_per_token)
        if num < 1:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds no block of "
                f"{self.block_size} tokens x {self.kv_bytes_per_token} bytes; raise "
                "EngineConfig.kv_cache_bytes or gpu_memory_utilization"
            )
        return int(num)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        a = self.args
        # [layers, K/V, blocks, block_size, Hkv, D]; zeros, so that never-written slots that a
        # kernel may load (and mask) hold no NaN.
        cache = torch.zeros(
            a.num_layers,
            2,
            num_blocks,
            self.block_size,
            a.num_kv_heads,
            a.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for layer, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(cache[layer, 0], cache[layer, 1])
        return cache


def _metadata(
    ints: torch.Tensor, slots: torch.Tensor, num_seqs: int, num_prefixes: int, b: StepBatch, **flags: Any
) -> AttentionMetadata:
    """The AttentionMetadata of int32 arrays laid out as StepBatch.int32_buffer, for num_seqs
    sequences and num_prefixes prefixes (the step's, or its last layer's view)."""
    s, g = num_seqs, num_prefixes
    cu, kv_lens, tables, p_lens, p_tables, ranges = ints.split(
        [s + 1, s, s * b.max_blocks, g, g * b.max_prefix_blocks, g + 1]
    )
    return AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=cu,
        kv_lens=kv_lens,
        block_tables=tables.view(s, b.max_blocks),
        prefix_lens=p_lens,
        prefix_block_tables=p_tables.view(g, b.max_prefix_blocks),
        prefix_seq_ranges=ranges,
        **flags,
    )


def cpu_oversubscribed() -> bool:
    """Clearly more runnable threads than cores over the last minute (this process's own
    included): OVERSUBSCRIBED_LOAD_PER_CORE per core."""
    try:
        return os.getloadavg()[0] > OVERSUBSCRIBED_LOAD_PER_CORE * (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return False


@contextmanager
def _cpu_threads(num: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `num` inside the block (None: unchanged)."""
    before = torch.get_num_threads()
    if num is None or num == before:
        yield
        return
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _warmup_step(num_tokens: int, num_sampled: int, block_size: int) -> StepInput:
    """A prefill step whose chunks all write into block 0 (only its memory use matters)."""
    sizes = [num_tokens // num_sampled] * num_sampled
    sizes[-1] += num_tokens - sum(sizes)
    params = SamplingParams(temperature=0.0)
    chunks = tuple(
        SeqChunk(
            seq_id=i,
            token_ids=(0,) * n,
            start_pos=0,
            num_cached_tokens=0,
            block_table=(0,) * -(-n // block_size),
            sample=True,
            sampling_params=params,
        )
        for i, n in enumerate(sizes)
    )
    return StepInput(chunks=chunks)
