"""Our model on the Triton kernels (through Triton's CPU interpreter) vs transformers.

On the CPU the attention layer dispatches to the kernels' torch references; here the layer's
kernel functions are swapped for the Triton launchers, so the layout the runner builds
(slot mapping, block tables, prefix ranges, chunk order) is checked against the kernels that
run on CUDA, and so are the norms and the rotary. One small scenario per attention path: pure prefill, prefix-shared mixed step,
pure decode. fp32 only (bf16 arithmetic is wrong in the interpreter, NOTES.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.models import llama
from prefixflow.engine.models.layers import attention
from prefixflow.engine.models.layers import norm as norm_layer
from prefixflow.engine.native.model_runner import ModelRunner
from prefixflow.engine.native.step import SeqChunk, SharedPrefix, StepInput
from prefixflow.engine.models.tiny import make_tiny_checkpoint
from prefixflow.kernels import cpu_exact
from prefixflow.kernels.kv_write import write_kv_cache_triton
from prefixflow.kernels.norm import rms_norm_triton
from prefixflow.kernels.packed_prefill import packed_prefill_attention_triton
from prefixflow.kernels.paged_decode import paged_decode_attention_triton
from prefixflow.kernels.prefix_attention import prefix_shared_attention_triton
from prefixflow.kernels.rotary import apply_rotary_triton
from prefixflow.requests import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
)

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def chunk(seq_id, toks, start, cached, table, prefix_index=-1, sample=True):
    return SeqChunk(
        seq_id=seq_id,
        token_ids=tuple(toks),
        start_pos=start,
        num_cached_tokens=cached,
        block_table=table,
        prefix_index=prefix_index,
        sample=sample,
        sampling_params=GREEDY if sample else None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qwen3: its per-head q/k norms on the kernel too
def test_runner_on_triton_kernels_matches_hf(tmp_path, monkeypatch, arch):
    from transformers import AutoModelForCausalLM

    calls: dict[str, int] = {}

    def counted(fn):
        def call(*args, **kwargs):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(attention, "write_kv_cache", write_kv_cache_triton)
    monkeypatch.setattr(attention, "packed_prefill_attention", packed_prefill_attention_triton)
    monkeypatch.setattr(attention, "paged_decode_attention", paged_decode_attention_triton)
    monkeypatch.setattr(attention, "prefix_shared_attention", prefix_shared_attention_triton)
    # and the norms and rotary as on CUDA: Triton, not the CPU's C kernels
    monkeypatch.setattr(cpu_exact, "supports_norm", lambda *args: False)
    monkeypatch.setattr(cpu_exact, "supports_rotary", lambda *args: False)
    monkeypatch.setattr(norm_layer, "kernel_norm_applies", lambda *args: True)
    monkeypatch.setattr(norm_layer, "rms_norm", counted(rms_norm_triton))
    monkeypatch.setattr(llama, "apply_rotary", counted(apply_rotary_triton))
    path = make_tiny_checkpoint(tmp_path, arch, seed=5)
    runner = ModelRunner(
        EngineConfig(model=str(path), device="cpu", block_size=BLOCK, kv_cache_bytes=64 * BLOCK * runner_bytes(path))
    )
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1]

    prefix, lone = list(range(30, 39)), list(range(60, 66))
    a, b = [71, 72, 73], [81, 82]
    shared = (SharedPrefix(block_table=(0, 1, 2), length=len(prefix)),)
    lone_t, a_t, b_t = (3, 4, 5), (6, 7), (8, 9)
    # Pure prefill: the prefix (written once) and the first part of the lone prompt.
    logits = runner.execute_logits(
        StepInput(
            (chunk(1, prefix, 0, 0, shared[0].block_table, sample=False), chunk(2, lone[:4], 0, 0, lone_t)), shared
        )
    )
    assert (logits[0] - ref(lone[:4])).abs().max() < 1e-4
    # Mixed: members after the prefix (own KV in fresh blocks) and the lone prompt's rest.
    logits = runner.execute_logits(
        StepInput(
            (
                chunk(2, lone[4:], 4, 4, lone_t),
                chunk(4, b, 9, 0, b_t, prefix_index=0),
                chunk(3, a, 9, 0, a_t, prefix_index=0),
            ),
            shared,
        )
    )
    for row, ids in enumerate((lone, prefix + b, prefix + a)):
        assert (logits[row] - ref(ids)).abs().max() < 1e-4
    # Pure decode of the lone sequence.
    logits = runner.execute_logits(StepInput((chunk(2, [90], 6, 6, lone_t),)))
    assert (logits[0] - ref(lone + [90])).abs().max() < 1e-4
    assert calls["rms_norm_triton"] > 0 and calls["apply_rotary_triton"] > 0, calls


def runner_bytes(path) -> int:
    """K+V bytes per token of the tiny checkpoint (fp32)."""
    from prefixflow.engine.models.model_args import read_model_args

    return read_model_args(path).kv_bytes_per_token_per_elem * 4
