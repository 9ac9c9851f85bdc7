"""What every engine hands back: request outputs, per-step statistics, run totals (torch-free).

The native engine and the vLLM backend both build these; the native engine's per-token
finishing rules live in engine/native/finish.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from prefixflow.requests import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token, and the top-n alternatives if asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """Sample `index` of a request with SamplingParams.n > 1 (fields as RequestOutput's)."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One finished request.

    token_ids: generated tokens; a final EOS or stop token id is included, a stop string's
        tokens too (the text is cut before the stop string).
    text: the generated text (special tokens skipped unless skip_special_tokens is False);
        empty when the model has no tokenizer or detokenize is False.
    finish_reason: "stop" (EOS, stop token id or stop string), "length" (max_tokens or
        max_model_len) or "abort" (the request could not run; see `error`).
    logprobs: one entry per token when SamplingParams.logprobs is not None, else None.
    prefix_len: prompt tokens taken from the group's shared prefix KV (BatchLLM grouping).
    num_cached_tokens: prompt tokens found computed at the request's first start, as vLLM's
        num_cached_tokens: hashed-block cache hits, and its group's shared prefix where an
        earlier member had it computed (the group's first member to start carries the
        prefix's computation). With n > 1, what the samples had in common (their minimum).
    samples: with SamplingParams.n > 1, every sample in index order (the fields above are
        sample 0's); else empty. A greedy request's n samples are one answer n times.
    """

    row_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    prefix_len: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    samples: tuple[SampleOutput, ...] = ()

    def as_sample(self, index: int) -> SampleOutput:
        return SampleOutput(index, self.token_ids, self.text, self.finish_reason, self.logprobs)


def sampled_output(
    row_id: int, prompt: Sequence[int], prefix_len: int, samples: Sequence[SampleOutput], n: int, num_cached: int
) -> RequestOutput:
    """A finished request from its samples in index order (what vLLM and a server hand back):
    sample 0's fields, and with n > 1 every sample. prefix_len: the group's shared prefix, as
    far as the cache served it (num_cached prompt tokens)."""
    first = samples[0]
    return RequestOutput(
        row_id=row_id,
        prompt_token_ids=tuple(prompt),
        token_ids=first.token_ids,
        text=first.text,
        finish_reason=first.finish_reason,
        logprobs=first.logprobs,
        prefix_len=min(prefix_len, num_cached),
        num_cached_tokens=num_cached,
        samples=tuple(samples) if n > 1 else (),
    )


def with_samples(outs: list[RequestOutput]) -> RequestOutput:
    """The n sample outputs of one request (index order) as one: sample 0's fields + samples.
    The prompt was computed once for all of them: cached is what none of them computed."""
    return replace(
        outs[0],
        samples=tuple(o.as_sample(i) for i, o in enumerate(outs)),
        num_cached_tokens=min(o.num_cached_tokens for o in outs),
    )


def greedy_copies(out: RequestOutput, n: int) -> RequestOutput:
    """A greedy request that asked n > 1 samples, run once: its answer as n samples (as
    OpenAI's API returns it; n runs would compute the same tokens n times)."""
    if n == 1 or out.error is not None:
        return out
    return replace(out, samples=tuple(out.as_sample(i) for i in range(n)))


@dataclass(frozen=True, slots=True)
class StepStats:
    """One engine step, for plots like BatchLLM Fig. 2 / Fig. 10."""

    step: int
    num_tokens: int
    num_prefill_tokens: int  # distinct prompt chunks (and recomputation after preemption)
    num_decode_tokens: int
    num_prefix_tokens: int  # shared prefix chunks
    num_running_seqs: int
    num_used_blocks: int
    num_total_blocks: int
    num_preemptions: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class EngineTotals:
    num_requests: int
    num_prompt_tokens: int
    num_computed_prompt_tokens: int  # first computations; shared and cached tokens excluded
    num_recomputed_tokens: int  # prefill work redone after preemption
    num_output_tokens: int
    num_steps: int
    num_preemptions: int
    wall_time_s: float

    @property
    def token_saving_ratio(self) -> float:
        """BatchLLM Eq. 1: 1 - computed prompt tokens / prompt tokens."""
        if self.num_prompt_tokens == 0:
            return 0.0
        return 1.0 - self.num_computed_prompt_tokens / self.num_prompt_tokens

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0


class EngineUnavailable(RuntimeError):
    """The engine cannot run any request now (a server that stopped answering, or that refuses
    the key or the model): no row is to blame. The run stops instead of turning rows into
    error records; the committed rows are kept for output.resume."""


def request_totals(
    counts: dict[str, int], wall_time_s: float, num_steps: int = 0, num_preemptions: int = 0
) -> EngineTotals:
    """A run's totals from the request counts an engine that is handed whole prompts keeps
    (vLLM, a server): requests, prompt tokens, of them cached, output tokens."""
    return EngineTotals(
        num_requests=counts["requests"],
        num_prompt_tokens=counts["prompt"],
        num_computed_prompt_tokens=counts["prompt"] - counts["cached"],
        num_recomputed_tokens=0,
        num_output_tokens=counts["output"],
        num_steps=num_steps,
        num_preemptions=num_preemptions,
        wall_time_s=wall_time_s,
    )


def summed_totals(parts: list[EngineTotals]) -> EngineTotals:
    """The totals of a run made of several engine runs (a prefill task runs unit by unit)."""
    return EngineTotals(*(sum(getattr(t, f.name) for t in parts) for f in fields(EngineTotals)))


def error_output(row_id: int, prompt: list[int], error: str) -> RequestOutput:
    return RequestOutput(
        row_id=row_id, prompt_token_ids=tuple(prompt), token_ids=(), text="", finish_reason="abort", error=error
    )


def decode_output(token_ids: Any, params: SamplingParams, tokenizer: Any, ends_with_stop_id: bool) -> str:
    """The text of generated tokens, as vLLM gives it: none without a tokenizer or with
    detokenize False; a final EOS / stop token id left out unless include_stop_str_in_output."""
    if tokenizer is None or not params.detokenize:
        return ""
    ids = list(token_ids)
    if ends_with_stop_id and not params.include_stop_str_in_output:
        ids = ids[:-1]
    text: str = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    return text
