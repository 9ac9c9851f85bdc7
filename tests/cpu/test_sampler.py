"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, raw logprobs."""

from __future__ import annotations

import torch

from prefixflow.engine.native.sampler import Sampler, apply_top_k_top_p
from prefixflow.requests import SamplingParams

V = 300


def random_logits(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_seeded_request_same_tokens_alone_or_in_a_batch_of_five():
    logits = random_logits(5)
    mine = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, seed=99),
        SamplingParams(temperature=1.0, top_k=5),
    ]
    alone, batched = [], []
    for step in range(30):
        alone.append(Sampler(seed=0).sample(logits[2:3], [mine], [step]).token_ids[0])
        params = others[:2] + [mine] + others[2:]
        out = Sampler(seed=step + 7).sample(logits, params, [0, 3, step, 9, 1])
        batched.append(out.token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # num_generated changes the draw


def test_unseeded_requests_reproducible_for_the_same_sampler_seed():
    logits = random_logits(4, seed=1)
    params = [SamplingParams(temperature=1.0)] * 4
    a = Sampler(seed=5).sample(logits, params, [0] * 4).token_ids
    b = Sampler(seed=5).sample(logits, params, [0] * 4).token_ids
    assert a == b


def test_greedy_top_k_one_and_tiny_top_p_all_pick_the_argmax():
    logits = random_logits(8, seed=2)
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler(seed=0)
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
    ):
        assert sampler.sample(logits, [params] * 8, list(range(8))).token_ids == argmax


def test_temperature_spreads_or_sharpens_the_distribution():
    logits = random_logits(1, seed=3).expand(400, V).contiguous()
    sampler = Sampler(seed=0)
    cold = sampler.sample(logits, [SamplingParams(temperature=0.05)] * 400, [0] * 400).token_ids
    hot = sampler.sample(logits, [SamplingParams(temperature=5.0)] * 400, [0] * 400).token_ids
    assert len(set(cold)) <= 3 < 50 < len(set(hot))


def test_samples_stay_inside_top_k_and_nucleus():
    logits = random_logits(1, seed=4).expand(300, V).contiguous()
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1)[order]
    nucleus = order[: int((probs.cumsum(0) < 0.5).sum()) + 1]
    sampler = Sampler(seed=0)
    top3 = sampler.sample(logits, [SamplingParams(top_k=3)] * 300, [0] * 300).token_ids
    top_p = sampler.sample(logits, [SamplingParams(top_p=0.5)] * 300, [0] * 300).token_ids
    assert set(top3) == set(order[:3])
    assert set(top_p) <= set(nucleus) and len(set(top_p)) > 1


def test_top_k_top_p_mask_per_row():
    logits = random_logits(3, seed=5)
    masked = apply_top_k_top_p(logits, [2, -1, 0], [1.0, 1.0, 1e-9])
    kept = torch.isfinite(masked).sum(-1).tolist()
    assert kept == [2, V, 1]
    assert torch.equal(masked[1], logits[1])


def test_logprobs_are_raw_and_counted_as_asked():
    logits = random_logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.5, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=2.0, top_k=4),
    ]
    out = Sampler(seed=0).sample(logits, params, [0, 0, 0])
    raw = torch.log_softmax(logits, -1)
    assert [len(t) for t in out.top_logprobs] == [5, 0, 0]
    for i, tok in enumerate(out.token_ids):
        assert abs(out.logprobs[i] - raw[i, tok].item()) < 1e-6
    ids, values = zip(*out.top_logprobs[0])
    assert list(ids) == raw[0].topk(5).indices.tolist()
    assert torch.allclose(torch.tensor(values), raw[0].topk(5).values)


def test_top_k_beyond_the_vocabulary_is_clamped_and_unbounded_top_k_is_rejected():
    import pytest

    logits = random_logits(2, seed=7)
    big = SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=3)
    full = SamplingParams(temperature=1.0, top_k=V, seed=3)
    assert (
        Sampler(0).sample(logits, [big, full], [0, 0]).token_ids[0]
        == Sampler(0).sample(logits, [full, big], [0, 0]).token_ids[0]
    )
    assert torch.isfinite(apply_top_k_top_p(logits, [2**31 - 1, V], [1.0, 1.0])).all()
    for top_k in (1e30, 2**31, 2.5, True):  # would reach torch.tensor as overflowing or float k
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(top_k=top_k)


def test_penalties_of_a_batch_equal_each_row_penalised_alone():
    """apply_penalties scores every penalised row at once; each row equals vLLM's definition
    applied to that row alone (a history holds the prompt only with a repetition penalty)."""
    from prefixflow.engine.native.sampler import apply_penalties

    gen = torch.Generator().manual_seed(0)
    vocab, n = 50, 7
    logits = torch.randn(n, vocab, generator=gen)
    params = [
        SamplingParams(),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=1.0),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.2, repetition_penalty=0.8),
        SamplingParams(presence_penalty=0.3, frequency_penalty=-0.4),
        SamplingParams(frequency_penalty=1.0),
    ]
    histories, generated = [], []
    for p in params:
        prompt = torch.randint(0, vocab, (12,), generator=gen).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 9, (1,), generator=gen)),), generator=gen).tolist()
        histories.append(prompt + output if p.repetition_penalty != 1.0 else output)
        generated.append(len(output))
    got = apply_penalties(logits, params, histories, generated)
    for i, p in enumerate(params):
        row = logits[i].clone()
        if p.has_penalties:
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool)
                seen[torch.tensor(histories[i], dtype=torch.long)] = True
                row = torch.where(
                    seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row
                )
            output = torch.tensor(histories[i][len(histories[i]) - generated[i] :], dtype=torch.long)
            counts = torch.bincount(output, minlength=vocab).float()
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        assert torch.allclose(got[i], row), i
