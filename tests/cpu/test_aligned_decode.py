"""AlignedServe's aligned decode batches (engine.aligned_decode_batch) on a real tiny model, and
the switch through the job spec and the Python API. The step plans themselves are checked with
the fake runner in test_scheduler.py (test_aligned_decode_batches_...)."""

from __future__ import annotations

import random

import pytest

from prefixflow.engine import EngineConfig, LLMEngine, SamplingParams
from prefixflow.engine.models.tiny import tiny_checkpoint_cached
from prefixflow.jobs.spec import SpecError, parse_spec
from prefixflow.operators.config import ProcessorConfig


def spread_prompts(vocab: int) -> list[list[int]]:
    """A dozen prompts, short and long alternating (plan order mixes the lengths), plus two
    that share a prefix."""
    rng = random.Random(0)
    tok = lambda: rng.randrange(3, vocab)  # noqa: E731  (0..2 are pad / bos / eos)
    prompts = [[tok() for _ in range(rng.randint(3, 6) if i % 2 else rng.randint(40, 48))] for i in range(10)]
    prefix = [tok() for _ in range(20)]
    return prompts + [prefix + [tok(), tok()], prefix + [tok()]]


def test_greedy_outputs_are_the_same_with_aligned_decode_batches():
    path = str(tiny_checkpoint_cached("llama", seed=1))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    results, engines = {}, {}
    for n in (None, 3):
        engines[n] = engine = LLMEngine(
            EngineConfig(
                model=path,
                device="cpu",
                block_size=4,
                kv_cache_bytes=16 << 20,
                max_num_batched_tokens=64,
                aligned_decode_batch=n,
            )
        )
        prompts = spread_prompts(engine.runner.vocab_size)
        results[n] = engine.generate(prompts, params)
    off, on = results[None], results[3]
    assert [list(o.token_ids) for o in on] == [list(o.token_ids) for o in off]
    for a, b in zip(on, off):
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # The switch did act: decode steps of at most 3 (off: up to every request at once).
    assert max(s.num_decode_tokens for s in engines[3].stats) == 3
    assert max(s.num_decode_tokens for s in engines[None].stats) > 3


def _spec(engine: dict) -> dict:
    return {
        "model": "m",
        "input": {"path": "in.jsonl"},
        "output": {"path": "out"},
        "prompt": {"template": "Q: {{ question }}"},
        "engine": engine,
    }


def test_the_switch_in_a_spec_and_in_processor_config(tiny_model):
    assert parse_spec(_spec({"aligned_decode_batch": 32})).engine.aligned_decode_batch == 32
    with pytest.raises(SpecError) as e:
        parse_spec(_spec({"aligned_decode_batch": 0}))
    assert "aligned_decode_batch" in str(e.value) and "positive number" in str(e.value)
    config = ProcessorConfig(model=str(tiny_model), engine={"aligned_decode_batch": 16})
    assert config.engine_config.aligned_decode_batch == 16
    with pytest.raises(ValueError, match="EngineConfig.aligned_decode_batch=0"):
        ProcessorConfig(model=str(tiny_model), engine={"aligned_decode_batch": 0})


def test_the_vllm_backend_refuses_the_switch(tiny_model):
    with pytest.raises(SpecError) as e:
        parse_spec(_spec({"backend": "vllm", "aligned_decode_batch": 32}))
    assert "only engine.backend: native honours it" in dict(e.value.problems)["engine.aligned_decode_batch"]
    with pytest.raises(ValueError, match="engine.aligned_decode_batch"):
        ProcessorConfig(model=str(tiny_model), engine={"backend": "vllm", "aligned_decode_batch": 32})
