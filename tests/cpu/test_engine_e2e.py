"""LLMEngine end to end on tiny checkpoints vs Hugging Face transformers `generate` (fp32, CPU).

Greedy outputs must match token for token, and logprobs within 1e-4 of HF's log_softmax,
for batches that mix shared prefixes (BatchLLM groups), different lengths, chunk boundaries
inside prompts and, in the slow tests, a KV budget small enough to force preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefixflow.bench.gpu_engine import hf_greedy
from prefixflow.engine import EngineConfig, LLMEngine, SamplingParams
from prefixflow.engine.models.tiny import tiny_checkpoint_cached

ARCHS = ("llama", "mistral", "qwen2")
BLOCK = 4
MAX_NEW = 8
ATOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    """(checkpoint path, HF model) for one architecture."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint_cached(request.param, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return str(path), hf


def workload(vocab: int, seed: int = 0) -> list[list[int]]:
    """Two prefix-sharing families (one member equal to its prefix) and unrelated prompts."""
    rng = random.Random(seed)
    tok = lambda: rng.randrange(3, vocab)  # noqa: E731  (0..2 are pad / bos / eos)
    prompts = []
    for prefix_len, members in ((13, 4), (22, 3)):
        prefix = [tok() for _ in range(prefix_len)]
        prompts += [prefix + [tok() for _ in range(n)] for n in [0, 3, 9, 5][:members]]
    prompts += [[tok() for _ in range(n)] for n in (1, 7, 30)]
    rng.shuffle(prompts)
    return prompts


def make_engine(path: str, **kwargs) -> LLMEngine:
    cfg = dict(model=path, device="cpu", block_size=BLOCK, kv_cache_bytes=16 << 20)
    cfg.update(kwargs)
    return LLMEngine(EngineConfig(**cfg))


def assert_same_as_hf(hf, prompts, outs) -> None:
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(hf, prompt, MAX_NEW)
        assert out.error is None
        assert list(out.prompt_token_ids) == prompt
        assert list(out.token_ids) == tokens
        ours = [lp.logprob for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < ATOL
        if out.logprobs[0].top:  # asked for top-n: the greedy token is the most likely one
            assert out.logprobs[0].top[0][0] == tokens[0]


def test_greedy_matches_hf_with_groups_and_chunked_prefill(model):
    path, hf = model
    engine = make_engine(path, max_num_batched_tokens=16)  # chunk boundaries inside prompts
    prompts = workload(hf.config.vocab_size)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2))
    assert_same_as_hf(hf, prompts, outs)
    assert any(o.prefix_len > 0 for o in outs)  # prefixes were shared
    assert engine.totals.token_saving_ratio > 0
    assert max(s.num_tokens for s in engine.stats) <= 16


@pytest.mark.slow
def test_greedy_matches_hf_under_preemption(model):
    path, hf = model
    probe = make_engine(path)
    bytes_per_block = probe.runner.kv_bytes_per_token * BLOCK
    engine = make_engine(path, kv_cache_bytes=28 * bytes_per_block, max_num_batched_tokens=24)
    assert engine.block_manager.num_blocks == 28
    prompts = workload(hf.config.vocab_size, seed=1)
    # Requests that stopped at their first token teach the scheduler to expect short outputs
    # (it keeps room for the share of max_tokens that finished requests used), so it starts
    # more than fits once outputs run to max_tokens: preemption has to make up for it.
    stop_at_once = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=tuple(range(hf.config.vocab_size)))
    engine.generate(prompts, stop_at_once)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0))
    assert engine.totals.num_preemptions > 0
    assert max(s.num_used_blocks for s in engine.stats) <= 28
    assert_same_as_hf(hf, prompts, outs)


@pytest.mark.slow
def test_vllm_policy_matches_hf(model):
    path, hf = model
    engine = make_engine(path, policy="vllm", max_num_batched_tokens=32)
    prompts = workload(hf.config.vocab_size, seed=2)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0))
    assert all(o.prefix_len == 0 for o in outs)
    assert_same_as_hf(hf, prompts, outs)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch():
    path = str(tiny_checkpoint_cached("llama", seed=1))
    engine = make_engine(path, max_num_batched_tokens=32)
    prompts = workload(engine.runner.vocab_size)
    params = [
        SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=100 + i, max_tokens=MAX_NEW)
        for i in range(len(prompts))
    ]
    batch = engine.generate(prompts, params)
    for i in (0, 4, len(prompts) - 1):
        alone = engine.generate([prompts[i]], [params[i]])[0]
        assert alone.token_ids == batch[i].token_ids


def test_text_stop_strings_and_string_prompts():
    path = str(tiny_checkpoint_cached("llama", seed=1))
    engine = make_engine(path)
    tok = engine.tokenizer
    prompt = "The final answer is"
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert list(free.prompt_token_ids) == tok(prompt)["input_ids"]
    assert free.text == tok.decode(free.token_ids, skip_special_tokens=True)
    assert free.finish_reason == "length"
    stop = free.text.strip()[3:6]
    assert stop
    cut = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_too_long_prompt_gets_an_error_and_the_run_goes_on():
    path = str(tiny_checkpoint_cached("llama", seed=1))
    engine = make_engine(path, max_model_len=32)
    vocab = engine.runner.vocab_size
    outs = engine.generate(
        [[5] * 40, [6, 7, 8], [4, vocab]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert outs[0].error is not None and "max_model_len" in outs[0].error
    assert outs[0].finish_reason == "abort" and outs[0].token_ids == ()
    assert outs[1].error is None and len(outs[1].token_ids) == 4
    assert outs[2].error is not None and "vocabulary" in outs[2].error


def test_hashed_block_cache_hits_give_the_same_outputs(model):
    path, hf = model
    engine = make_engine(path, max_num_batched_tokens=64)
    prompts = workload(hf.config.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    cold = engine.generate(prompts, params)
    warm = engine.generate(prompts, params)  # same engine: full blocks come from the cache
    assert engine.totals.num_computed_prompt_tokens < sum(map(len, prompts)) // 4
    assert any(w.num_cached_tokens > w.prefix_len for w in warm)
    assert [w.token_ids for w in warm] == [c.token_ids for c in cold]
    assert_same_as_hf(hf, prompts, warm)


def test_a_later_prompt_finds_a_group_members_own_blocks(model):
    # A group's prefix ends inside a block (13 tokens, blocks of 4): each member copies the
    # partial block's K/V into its first own block, so its own blocks line up with the prompt's
    # and a later prompt that extends a member's finds them all: 5 whole blocks (20 tokens),
    # not only the prefix's 3.
    path, hf = model
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(3, hf.config.vocab_size) for _ in range(n)]  # noqa: E731
    prefix = tok(13)
    members = [prefix + tok(9), prefix + tok(4)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    engine = make_engine(path, max_num_batched_tokens=256)
    assert_same_as_hf(hf, members, engine.generate(members, params))
    later = [members[0] + tok(5)]
    outs = engine.generate(later, params)
    assert outs[0].num_cached_tokens == 20
    assert_same_as_hf(hf, later, outs)


def test_prefixes_admitted_in_one_step_share_their_common_blocks(model):
    # Two levels of sharing: one system prompt, then two documents asked two questions each.
    # Both groups' prefixes (system + document) start in the first step; the second reuses the
    # system prompt's blocks that the first writes in that same step (hashed when scheduled),
    # and the outputs still equal HF's.
    path, hf = model
    rng = random.Random(4)
    tok = lambda n: [rng.randrange(3, hf.config.vocab_size) for _ in range(n)]  # noqa: E731
    system = tok(4 * BLOCK)
    prompts = [system + doc + tok(3) for doc in (tok(9), tok(11)) for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    engine = make_engine(path, max_num_batched_tokens=256)
    outs = engine.generate(prompts, params)
    assert_same_as_hf(hf, prompts, outs)
    assert engine.stats[0].num_prefix_tokens == 2 * len(system) + 9 + 11 - len(system)
    alone = make_engine(path, max_num_batched_tokens=256, enable_prefix_cache=False)
    alone.generate(prompts, params)
    assert alone.totals.num_computed_prompt_tokens - engine.totals.num_computed_prompt_tokens == len(system)
