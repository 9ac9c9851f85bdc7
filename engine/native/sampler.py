"""Next-token sampling: penalties, greedy, temperature, min-p, top-k, top-p, per-request
seeds, logprobs.

The order is vLLM's: presence / frequency / repetition penalties on the raw logits (so greedy
sees them too), then temperature, min_p, top-k and top-p for sampled rows.

Sampling draws one exponential variate E_v per vocabulary entry and takes argmax(p_v / E_v),
which picks v with probability p_v (the exponential race; vLLM samples the same way). It needs
no cumulative sums over the vocabulary and makes seeding simple:

- a request with a seed gets its noise from a torch.Generator seeded with a mix of
  (seed, num_generated), so its tokens depend on nothing else in the batch (two requests with
  the same seed and the same logits draw the same tokens, as in vLLM);
- requests without a seed share one generator seeded from EngineConfig.seed (reproducible for
  the same sequence of steps, not across batch compositions).

Log-probabilities are always those of the RAW logits (log_softmax before temperature, top-k
and top-p), as the contract in engine/native/step.py says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixflow.requests import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Per row: the token, its raw logprob, and the asked-for top (token, logprob) pairs."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, tokens generated so far) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """sample(logits, params, num_generated) -> SamplerOutput, vectorised over the batch."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)  # shared by requests without a seed
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_generated: list[int],
        histories: list[list[int]] | None = None,
    ) -> SamplerOutput:
        """logits: [N, V] fp32 raw next-token logits; params, num_generated: one per row.
        histories: per row, its prompt + generated tokens (needed by rows with penalties)."""
        n = logits.shape[0]
        assert len(params) == n == len(num_generated), "one SamplingParams per logits row"
        if n == 0:
            return SamplerOutput([], [], [])
        logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
        if any(p.has_penalties for p in params):
            assert histories is not None, "rows with penalties need their token histories"
            logits = apply_penalties(logits, params, histories, num_generated)
        token_ids = logits.argmax(dim=-1)  # greedy for all rows
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            token_ids[idx] = self._sample_rows(logits[idx], [params[i] for i in rows], [num_generated[i] for i in rows])
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
        k_max = min(max((p.logprobs or 0) for p in params), logprobs.shape[1])
        top_values, top_ids = logprobs.topk(k_max, dim=-1)  # [N, k_max]
        # One device->host copy for everything (fp64 holds token ids exactly).
        host = torch.cat(
            [token_ids.unsqueeze(1).double(), chosen.double(), top_ids.double(), top_values.double()], dim=1
        ).tolist()
        return SamplerOutput(
            token_ids=[int(row[0]) for row in host],
            logprobs=[row[1] for row in host],
            top_logprobs=[_top_pairs(row[2:], k_max, p.logprobs or 0) for row, p in zip(host, params)],
        )

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]
    ) -> torch.Tensor:
        # logits: [M, V] -> sampled token ids [M]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, [p.min_p for p in params])
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        probs = torch.softmax(logits, dim=-1)  # [M, V]
        noise = self._exponential_noise(probs.shape, params, num_generated)
        # A zero variate would turn 0/0 into NaN, which argmax would pick.
        return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)

    def _exponential_noise(
        self, shape: torch.Size, params: list[SamplingParams], num_generated: list[int]
    ) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            block = torch.empty(len(unseeded), shape[1], device=self.device)
            block.exponential_(generator=self.generator)
            noise[torch.tensor(unseeded, device=self.device)] = block
        for i, p in enumerate(params):
            if p.seed is not None:
                g = torch.Generator(self.device)
                g.manual_seed(mix_seed(p.seed, num_generated[i]))
                noise[i].exponential_(generator=g)
        return noise


def _top_pairs(row: list[float], k_max: int, k: int) -> tuple[tuple[int, float], ...]:
    """row: k_max ids then k_max logprobs -> the first k (id, logprob) pairs."""
    return tuple((int(row[i]), row[k_max + i]) for i in range(min(k, k_max)))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) all but each row's top-k tokens, then all but the smallest set whose
    probability (renormalised after top-k) reaches top_p. k <= 0 and p = 1 disable.

    logits: [M, V] fp32 (already divided by the temperature). Returns a new [M, V] tensor.
    """
    m, v = logits.shape
    dev = logits.device
    # A top_k beyond the vocabulary keeps it all (clamped here, before it reaches a tensor).
    k = torch.tensor([min(kk, v) if kk > 0 else v for kk in top_k], device=dev)  # [M]
    # p = 1 must keep everything, even when rounding makes the cumulative mass reach 1 early.
    p = torch.tensor([pp if pp < 1.0 else float("inf") for pp in top_p], device=dev)  # [M]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [M, V]
    ranks = torch.arange(v, device=dev).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better-ranked tokens
    # The best token is always kept (mass_before == 0), so no row is left empty.
    sorted_logits = sorted_logits.masked_fill(mass_before >= p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]], num_generated: list[int]
) -> torch.Tensor:
    """vLLM's penalties (OpenAI's definition for presence / frequency), on a copy of logits [N, V]:
    repetition_penalty divides the positive logits (multiplies the negative ones) of tokens seen
    in the prompt or the output; frequency_penalty * count and presence_penalty * (count > 0)
    are subtracted, counting output tokens only (each history's last num_generated tokens).
    Every row with penalties at once: one scatter of token counts, no loop over the vocabulary."""
    logits = logits.clone()
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    device, dtype = logits.device, logits.dtype
    idx = torch.tensor(rows, device=device)
    counts = _token_counts(
        [histories[i][len(histories[i]) - num_generated[i] :] for i in rows], logits.shape[1], device, dtype
    )  # [R, V]
    sub = logits[idx]
    repeat = [k for k, i in enumerate(rows) if params[i].repetition_penalty != 1.0]
    if repeat:
        seen = _token_counts([histories[rows[k]] for k in repeat], logits.shape[1], device, dtype) > 0
        scale = torch.tensor([params[rows[k]].repetition_penalty for k in repeat], device=device, dtype=dtype)[:, None]
        part = sub[repeat]
        penalised = torch.where(part > 0, part / scale, part * scale)
        sub[repeat] = torch.where(seen, penalised, part)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device, dtype=dtype)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=device, dtype=dtype)[:, None]
    logits[idx] = sub - freq * counts - pres * (counts > 0).to(dtype)
    return logits


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[len(seqs), vocab] how many times each token occurs in each sequence."""
    counts = torch.zeros(len(seqs), vocab, device=device, dtype=dtype)
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    if int(lengths.sum()):
        tokens = torch.tensor([t for s in seqs for t in s], device=device, dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
        counts.index_put_((row, tokens), torch.ones_like(tokens, dtype=dtype), accumulate=True)
    return counts


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens whose probability is below min_p times the row's highest.
    logits: [M, V] fp32 (already divided by the temperature); min_p 0 keeps everything."""
    probs = torch.softmax(logits, dim=-1)
    threshold = torch.tensor(min_p, device=logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
