"""ModelRunner API: cache sizing, attributes, chunk order, sampling output, contract errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.native.step_batch import build_step_batch
from prefixflow.engine.native.model_runner import ModelRunner
from prefixflow.engine.native.step import SeqChunk, SharedPrefix, StepInput
from prefixflow.engine.models.tiny import make_tiny_checkpoint
from prefixflow.requests import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "mistral", seed=2)


@pytest.fixture(scope="module")
def runner(ckpt):
    return ModelRunner(
        EngineConfig(model=str(ckpt), device="auto", block_size=8, kv_cache_bytes=3_000_000, max_model_len=512)
    )


def test_attributes_and_cache_size(runner):
    # 2 layers x K,V x 2 kv heads x head_dim 32 x 4 bytes
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert runner.num_kv_blocks == 3_000_000 // (8 * runner.kv_bytes_per_token)
    assert runner.kv_cache.shape == (2, 2, runner.num_kv_blocks, 8, 2, 32)
    assert runner.block_size == 8 and runner.max_model_len == 512
    assert runner.vocab_size == len(runner.tokenizer)
    assert runner.eos_token_ids == (runner.tokenizer.eos_token_id,)
    assert runner.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_sampled_tokens_come_back_in_chunk_order(runner):
    prefix = SharedPrefix(block_table=(0, 1), length=11)
    prompt = tuple(range(20, 31))
    runner.execute(StepInput((SeqChunk(50, prompt, 0, 0, (0, 1)),), (prefix,)))  # the prefix
    chunks = (
        SeqChunk(7, (40, 41, 42), 0, 0, (5,), sample=True, sampling_params=GREEDY),
        SeqChunk(
            8,
            (43, 44),
            11,
            0,
            (6,),
            prefix_index=0,
            sample=True,
            sampling_params=SamplingParams(temperature=0.8, seed=3, logprobs=2),
        ),
        SeqChunk(9, (45,), 0, 0, (7,)),  # no sampling
        SeqChunk(10, (46, 47, 48, 49), 11, 0, (8,), prefix_index=0, sample=True, sampling_params=GREEDY),
    )
    out = runner.execute(StepInput(chunks, (prefix,)))
    assert [t.seq_id for t in out.sampled] == [7, 8, 10]
    assert len(out.sampled[1].top_logprobs) == 2 and out.sampled[0].top_logprobs == ()
    logits = runner.execute_logits(StepInput(chunks, (prefix,)))  # same step again: same KV
    assert logits.shape == (3, runner.vocab_size)
    assert [out.sampled[i].token_id for i in (0, 2)] == logits[[0, 2]].argmax(-1).tolist()
    logp = torch.log_softmax(logits, -1)
    for row, tok in enumerate(out.sampled):
        assert abs(tok.logprob - logp[row, tok.token_id].item()) < 1e-5


def test_the_last_layer_answers_only_the_sampled_rows(runner):
    """Rows that do not sample stop after their K/V in the last layer (step_batch's
    LastLayerBatch): the logits equal those of the whole last layer, and a prefix that no
    sampled row reads is left out of the last layer's view."""
    prefixes = (SharedPrefix(block_table=(0, 1), length=11), SharedPrefix((2,), 5))
    runner.execute(
        StepInput(
            (SeqChunk(50, tuple(range(20, 31)), 0, 0, (0, 1)), SeqChunk(51, tuple(range(60, 65)), 0, 0, (2,))), prefixes
        )
    )
    chunks = (
        SeqChunk(7, (40, 41, 42), 0, 0, (5,), sample=True, sampling_params=GREEDY),
        SeqChunk(8, (43, 44), 11, 0, (6,), prefix_index=0, sample=True, sampling_params=GREEDY),
        SeqChunk(9, (45,), 0, 0, (7,)),  # a prompt chunk that stops short
        SeqChunk(11, (46, 47), 5, 0, (9,), prefix_index=1),  # so does this member's
        SeqChunk(10, (46, 47, 48, 49), 11, 0, (8,), prefix_index=0, sample=True, sampling_params=GREEDY),
    )
    batch = build_step_batch(StepInput(chunks, prefixes), runner.block_size, runner.max_model_len, runner.num_kv_blocks)
    assert batch.num_tokens == 12 and batch.last is not None
    assert (batch.last.num_rows, batch.last.num_prefixes) == (3, 1)
    ids, positions, meta, logits_indices = runner._to_device(batch)
    # kernel order: prefix 0's members (8, 10), prefix 1's (11), then 7 and 9
    assert meta.last_layer.rows.tolist() == [1, 5, 10]
    assert meta.last_layer.kv_lens.tolist() == [2, 4, 3]
    assert logits_indices.tolist() == [2, 0, 1]  # chunk order: 7, 8, 10
    with torch.inference_mode():
        fast = runner.model(ids, positions, meta, logits_indices)
        whole = runner.model(ids, positions, replace(meta, last_layer=None), meta.last_layer.rows[logits_indices])
    torch.testing.assert_close(fast, whole, rtol=1e-5, atol=1e-5)


def test_step_without_sampling(runner):
    out = runner.execute(StepInput((SeqChunk(1, (4, 5, 6), 0, 0, (3,)),)))
    assert out.sampled == ()


@pytest.mark.parametrize(
    "chunk, message",
    [
        (SeqChunk(1, (4, 5, 6), 0, 0, ()), "too few"),
        (SeqChunk(1, (), 0, 0, (3,)), "no token_ids"),
        (SeqChunk(1, (4,), 512, 0, (3,)), "max_model_len"),
        (SeqChunk(1, (4,), 0, 0, (3,), sample=True), "sampling_params"),
        (SeqChunk(1, (4,), 0, 0, (10**6,)), "block ids"),
        (SeqChunk(1, (4,), 0, 0, (3,), prefix_index=2), "prefix_index"),
    ],
)
def test_contract_errors(runner, chunk, message):
    with pytest.raises(ValueError, match=message):
        runner.execute(StepInput((chunk,)))


def test_config_errors(ckpt):
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(EngineConfig(model=str(ckpt), device="cpu", kv_cache_bytes=1 << 20, max_model_len=10**6))
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        ModelRunner(EngineConfig(model=str(ckpt), device="cpu", kv_cache_bytes=100))


def test_sliding_window_bounds_max_model_len(tmp_path):
    # We attend to the whole context, which equals Mistral's sliding window attention only
    # while sequences fit in the window.
    path = make_tiny_checkpoint(tmp_path, "mistral", sliding_window=64)
    runner = ModelRunner(EngineConfig(model=str(path), device="cpu", kv_cache_bytes=1 << 20))
    assert runner.max_model_len == 64
    with pytest.raises(ValueError, match="sliding window"):
        ModelRunner(EngineConfig(model=str(path), device="cpu", kv_cache_bytes=1 << 20, max_model_len=65))


def test_small_cpu_steps_run_on_one_thread_when_oversubscribed_and_restore_the_count(runner, monkeypatch):
    from prefixflow.engine.native import model_runner

    if runner.device.type != "cpu":
        pytest.skip("thread counts are a CPU matter")
    busy = [True]
    monkeypatch.setattr(model_runner, "cpu_oversubscribed", lambda: busy[0])
    seen = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda *a: seen.append(torch.get_num_threads()) or forward(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        greedy = SamplingParams(temperature=0.0)
        small = StepInput(
            chunks=(
                SeqChunk(
                    seq_id=0,
                    token_ids=(5, 6, 7),
                    start_pos=0,
                    num_cached_tokens=0,
                    block_table=(1,),
                    sample=True,
                    sampling_params=greedy,
                ),
            )
        )
        runner.execute(small)
        busy[0] = False  # a CPU to itself: every thread
        runner.execute(small)
        busy[0] = True
        monkeypatch.setattr(model_runner, "SINGLE_THREAD_MAX_TOKENS", 2)  # now a "large" step
        runner.execute(small)
        assert seen == [1, 2, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_engine_alone_on_its_cores_is_not_oversubscribed(monkeypatch):
    import os

    from prefixflow.engine.native import model_runner

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for load, busy in ((2.4, False), (3.0, False), (3.2, True), (6.0, True)):
        # 2.4: a 2-thread engine's own busy threads and a little else
        monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
        assert model_runner.cpu_oversubscribed() is busy, load
