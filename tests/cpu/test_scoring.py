"""The `score` task (PrefillOnly) vs transformers, fp32 CPU: choice probabilities, hybrid
prefilling with chunk sizes that do and do not divide the prompts, shared prefixes computed once,
per-row errors, the maximum input length, and SRJF with continuous JCT calibration."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.scoring.scorer import Scorer, ScoreOptions
from prefixflow.engine.scoring.forward import forward_bytes, max_input_len
from prefixflow.engine.models.tiny import tiny_checkpoint_cached
from prefixflow.requests import PrefixGroup

ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def ckpt(request):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint_cached(request.param, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def scorer(path, **options) -> Scorer:
    return Scorer(EngineConfig(model=str(path), device="cpu"), ScoreOptions(**options))


def hf_scores(hf, ids: list[int], choice_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].float()  # [V]
    idx = torch.tensor(choice_ids)
    return (torch.softmax(logits[idx], -1).numpy(), torch.log_softmax(logits, -1)[idx].numpy())


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_scores_match_transformers_with_and_without_shared_prefixes(ckpt, chunk_size):
    path, hf = ckpt
    s = scorer(path, chunk_size=chunk_size)
    profile = rand_tokens(29, seed=1)  # shared by rows 0..3 (one group)
    prompts = [profile + rand_tokens(n, seed=10 + n) for n in (3, 8, 1, 12)]
    prompts += [rand_tokens(33, seed=2), rand_tokens(16, seed=3)]  # unrelated rows
    choices = [5, 17, 300]
    outs = s.score(prompts, choices)
    assert s.score_stats.num_prefix_misses == 1 and s.score_stats.num_prefix_hits == 3
    assert [o.prefix_len for o in outs] == [29] * 4 + [0, 0]
    # every engine's totals: the shared profile computed once, no steps
    assert s.totals.num_computed_prompt_tokens == sum(map(len, prompts)) - 3 * 29 == s.score_stats.num_computed_tokens
    assert s.totals.num_requests == 6 and s.totals.num_output_tokens == 0 and s.stats == []
    for ids, out in zip(prompts, outs):
        assert out.error is None and out.choice_token_ids == (5, 17, 300)
        probs, logprobs = hf_scores(hf, ids, out.choice_token_ids)
        np.testing.assert_allclose(out.probs, probs, atol=ATOL, rtol=0)
        np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-4, rtol=0)
        assert out.label == str(choices[int(np.argmax(probs))])


def test_string_prompts_and_choices_tokenized_like_the_docs(ckpt):
    path, hf = ckpt
    s = scorer(path, choice_leading_space=True, chunk_size=5)
    text = "Classify the sentiment of the sentence: the screen is bright. Answer:"
    out = s.score([text], ["positive", "negative", "neutral"])[0]
    tok = s.tokenizer
    expected = tuple(tok.encode(" " + c, add_special_tokens=False)[0] for c in ("positive", "negative", "neutral"))
    assert out.choice_token_ids == expected
    probs, _ = hf_scores(hf, tok(text)["input_ids"], expected)
    np.testing.assert_allclose(out.probs, probs, atol=ATOL, rtol=0)
    assert abs(sum(out.probs) - 1) < 1e-6


def test_member_equal_to_the_prefix_and_per_row_choices(ckpt):
    """A prompt that is the whole group prefix still gets its own last-position logits."""
    path, hf = ckpt
    s = scorer(path, chunk_size=6)
    base = rand_tokens(20, seed=4)
    prompts = [base, base + rand_tokens(5, seed=5), base + rand_tokens(2, seed=6)]
    per_row = [[1, 2], [3, 4, 5], [6]]
    outs = s.score(prompts, per_row)
    for ids, out, ch in zip(prompts, outs, per_row):
        assert out.error is None and out.choice_token_ids == tuple(ch)
        np.testing.assert_allclose(out.probs, hf_scores(hf, ids, tuple(ch))[0], atol=ATOL, rtol=0)
    assert outs[2].probs == (1.0,)


def test_bad_rows_get_errors_that_name_the_problem():
    path = tiny_checkpoint_cached("llama", seed=5)
    s = scorer(path)
    tok = s.tokenizer
    a, b = "Yes", "Yes!"
    assert tok.encode(a, add_special_tokens=False)[0] == tok.encode(b, add_special_tokens=False)[0]
    outs = s.score([[5, 6, 7], [5, 6, 8], [], [9, 9]], [[a, b], ["x", "y"], ["x"], []])
    assert "'Yes'" in outs[0].error and "'Yes!'" in outs[0].error and "both start" in outs[0].error
    assert outs[1].error is None and len(outs[1].probs) == 2
    assert "empty" in outs[2].error
    assert "non-empty list" in outs[3].error
    with pytest.raises(ValueError, match="ScoreOptions.chunk_size"):
        ScoreOptions(chunk_size=0)


def test_maximum_input_length_for_a_memory_budget():
    path = tiny_checkpoint_cached("llama", seed=5)
    budget = 2_000_000
    s = scorer(path, max_forward_bytes=budget, chunk_size=32)
    limit = s.max_input_len()
    assert 0 < limit < s.max_model_len
    a = s.args
    assert forward_bytes(a, 4, limit, 0, 32) <= budget < forward_bytes(a, 4, limit + 1, 0, 32)
    # With a cached 100-token prefix, the suffix's tokens are counted as activations and the
    # prefix's as KV only: a prefix token costs less than an activation token.
    with_prefix = max_input_len(a, 4, budget, 100, 32, s.max_model_len)
    assert with_prefix >= limit
    assert forward_bytes(a, 4, with_prefix - 100, 100, 32) <= budget
    assert budget < forward_bytes(a, 4, with_prefix - 99, 100, 32)
    outs = s.score([rand_tokens(limit, 7), rand_tokens(limit + 1, 8)], [3, 4])
    assert outs[0].error is None
    assert f"maximum input length {limit}" in outs[1].error and "max_forward_bytes" in outs[1].error


def _group(gid: int, prefix: list[int], suffixes: dict[int, list[int]]) -> PrefixGroup:
    return PrefixGroup(
        group_id=gid,
        prefix=np.array(prefix),
        row_ids=np.array(list(suffixes)),
        distinct=tuple(np.array(d) for d in suffixes.values()),
    )


@pytest.mark.parametrize("calibrate,hits", [(True, 2), (False, 1)])
def test_continuous_jct_calibration_gets_the_extra_hit_of_fig5(calibrate, hits):
    """PrefillOnly Sec. 6.2/6.3 example: A < C < B < D, A and D share a prefix, B and C share
    another, the cache holds one prefix. Plain SRJF runs A, C, B, D (one hit: B); calibration
    runs A, D, C, B (two hits)."""
    path = tiny_checkpoint_cached("llama", seed=5)
    probe = scorer(path)
    one_prefix = 2 * probe.args.num_layers * probe.args.num_kv_heads * probe.args.head_dim * 4 * 12
    # one request per forward, as the paper schedules them (packing would run A and D together)
    s = scorer(path, prefix_cache_bytes=one_prefix + one_prefix // 2, calibrate=calibrate, lam=0, max_packed_tokens=1)
    p1, p2 = rand_tokens(12, 20), rand_tokens(12, 21)
    groups = [
        _group(0, p1, {0: rand_tokens(2, 22), 3: rand_tokens(8, 23)}),  # A, D
        _group(1, p2, {2: rand_tokens(4, 24), 1: rand_tokens(6, 25)}),
    ]  # C, B
    order = [o.row_id for o in s.score_groups(groups, [1, 2])]
    assert order == ([0, 3, 2, 1] if calibrate else [0, 2, 1, 3])
    assert s.score_stats.num_prefix_hits == hits
    assert s.score_stats.num_prefix_misses == 4 - hits


def test_fcfs_policy_keeps_plan_order_and_zero_cache_recomputes():
    path = tiny_checkpoint_cached("llama", seed=5)
    s = scorer(path, policy="fcfs", prefix_cache_bytes=0, max_packed_tokens=1)
    groups = [
        _group(0, rand_tokens(10, 30), {5: [1, 2], 6: [3]}),
        _group(1, rand_tokens(10, 31), {7: [4, 5, 6], 8: [7]}),
    ]
    assert [o.row_id for o in s.score_groups(groups, [1, 2])] == [5, 6, 7, 8]
    assert s.score_stats.num_prefix_hits == 0 and s.score_stats.num_prefix_misses == 4


def test_virtual_clock_latencies_are_computed_tokens_over_rate():
    """Online studies run on a virtual clock: a request takes its computed tokens / rate, and
    the clock jumps over idle time to the next arrival."""
    path = tiny_checkpoint_cached("llama", seed=5)
    s = scorer(path, max_packed_tokens=1)  # one request per forward: each its own latency
    groups = [
        _group(0, rand_tokens(10, 40), {0: [1, 2], 1: [3, 4, 5, 6]}),  # 12 + 2 + 4
        _group(1, [], {2: rand_tokens(7, 41)}),
    ]
    outs = list(s.score_groups(groups, [1, 2], arrivals={0: 0.0, 1: 0.0, 2: 100.0}, tokens_per_s=2.0))
    assert [o.row_id for o in outs] == [0, 1, 2]
    assert s.score_stats.latency_s == {0: 6.0, 1: 8.0, 2: 3.5}
    with pytest.raises(ValueError, match="tokens_per_s=0"):
        list(s.score_groups(groups, [1, 2], tokens_per_s=0))


@pytest.mark.parametrize("task", ["score", "embed"])
def test_packed_requests_give_what_they_give_one_at_a_time(task):
    """Requests of one prefix (a group's members; rows sharing none) run packed in one forward
    (Prepacking), each attending only to the prefix and itself: the outputs equal those of one
    request per forward, in fewer forwards."""
    from prefixflow.engine.scoring.pooling import Pooling

    path = tiny_checkpoint_cached("qwen2", seed=5)
    groups = [
        _group(0, rand_tokens(20, 50), {0: rand_tokens(3, 51), 1: rand_tokens(9, 52), 2: rand_tokens(1, 53)}),
        _group(1, [], {3: rand_tokens(7, 54)}),
        _group(2, [], {4: rand_tokens(12, 55)}),
    ]
    runs = {}
    for packed in (1, 512):
        s = scorer(path, max_packed_tokens=packed)
        run = s.score_groups(groups, [1, 2]) if task == "score" else s.embed_groups(groups, Pooling("mean"))
        runs[packed] = ({o.row_id: o for o in run}, s.score_stats)
    (alone, one_stats), (packed, packed_stats) = runs[1], runs[512]
    assert one_stats.num_forwards == 5 and packed_stats.num_forwards == 2  # the group's 3; the 2 loose rows
    assert packed_stats.num_computed_tokens == one_stats.num_computed_tokens
    for row, out in packed.items():
        values = out.probs if task == "score" else out.embedding
        np.testing.assert_allclose(values, alone[row].probs if task == "score" else alone[row].embedding, atol=1e-5)
        assert out.num_cached_tokens == alone[row].num_cached_tokens
