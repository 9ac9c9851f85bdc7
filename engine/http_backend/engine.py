"""One replica's engine on an OpenAI-compatible server (engine.backend: http), with LLMEngine's
interface: `run` over planned groups, `reset`, `stats` (empty: the server's steps are its own)
and `totals`.

The members of the planned groups are sent in plan order, at most max_concurrency in flight,
each as a /v1/completions request whose prompt is the row's token ids (the plan's tokens, so
the server computes exactly what was planned and its prefix cache sees the plan's sharing: the
members of a group go out together, after the group before). A group is taken from the feed
only when the requests before it have all been sent, so work stealing sees what this replica
has not started. The answer's token ids come from vLLM's `return_token_ids` (token_ids: true),
its cached prompt tokens from `usage.prompt_tokens_details` where the server reports them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.intake import IDLE_POLL_S, NOT_READY, group_rows
from prefixflow.engine.http_backend.client import Endpoint, RequestFailed
from prefixflow.engine.http_backend.config import HttpConfig
from prefixflow.engine.outputs import (
    EngineTotals,
    RequestOutput,
    SampleOutput,
    StepStats,
    TokenLogprob,
    error_output,
    greedy_copies,
    request_totals,
    sampled_output,
)
from prefixflow.requests import Params, SamplingParams

_END = object()  # the feed is exhausted
TOKEN_ID_PREFIX = "token_id:"  # vLLM's logprobs tokens with return_tokens_as_token_ids


@dataclass
class _Member:
    """One request: its row, full prompt, its group's prefix length, its parameters."""

    row_id: int
    prompt: list[int]
    prefix_len: int
    params: SamplingParams
    copies: int = 1  # a greedy row asking n > 1: sent once, its answer n times (asked_once)


class HttpEngine:
    """One replica's engine on the server at `http.endpoints[replica % len]`. One `run` at a time.

    config: the job's EngineConfig (its max_tokens cap and model); http: the servers and how to
    talk to them. `close()` when done with it (its request threads)."""

    def __init__(self, config: EngineConfig, http: HttpConfig, replica: int = 0):
        self.config, self.http = config, http
        self.endpoint = Endpoint(http.endpoints[replica % len(http.endpoints)], http)
        self.model = http.model or config.model
        self.stats: list[StepStats] = []
        self.totals: EngineTotals | None = None
        self._pool = ThreadPoolExecutor(http.max_concurrency, thread_name_prefix="prefixflow-http")
        self._in_flight: dict[Future[dict[str, Any]], _Member] = {}

    def run(self, groups: Iterable[Any], params: Params = SamplingParams()) -> Iterator[RequestOutput]:
        """Send planned groups' members in plan order; yield each row's output as its answer
        comes (an error record for a row the server refused). Raises EndpointDown (an
        EngineUnavailable) when the server refuses the key or the model, or stops answering.
        params: one SamplingParams for all, or row_id -> SamplingParams."""
        self.reset()  # nothing of an abandoned run comes out of this one
        start, counts = time.perf_counter(), dict(requests=0, prompt=0, cached=0, output=0)
        waiting: deque[_Member] = deque()
        source, exhausted = iter(groups), False
        try:
            while True:
                exhausted, turn_s = self._send(source, waiting, params, exhausted)
                if not self._in_flight:
                    if exhausted and not waiting:
                        return
                    time.sleep(turn_s if waiting and turn_s > 0 else IDLE_POLL_S)  # qps, or no group yet
                    continue
                idle = not exhausted and not waiting  # the feed may have a group later
                timeout = turn_s if waiting and turn_s > 0 else IDLE_POLL_S if idle else None
                done, _ = wait(list(self._in_flight), timeout=timeout, return_when=FIRST_COMPLETED)
                for future in done:
                    yield self._finish(self._in_flight.pop(future), future, counts)
        finally:
            self.totals = request_totals(counts, time.perf_counter() - start)
            if self._in_flight:  # the caller stopped iterating, or the server went down
                self.reset()

    def reset(self) -> None:
        """Forget what is in flight (after a failed or abandoned run): requests not started are
        cancelled, the answers still to come are dropped (the server finishes those on its own)."""
        for future in self._in_flight:
            future.cancel()
        self._in_flight.clear()

    def close(self) -> None:
        """Stop the request threads: waits end at once, requests not started are cancelled."""
        self.endpoint.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _send(
        self, source: Iterator[Any], waiting: deque[_Member], params: Params, exhausted: bool
    ) -> tuple[bool, float]:
        """Hand members to the request threads while fewer than max_concurrency are in flight,
        each when qps lets it start (a request is sent as soon as it is handed over), taking the
        feed's next group only when the members before it are sent. Returns (the feed is
        exhausted, seconds until qps lets the next member start: 0 when none waits for it)."""
        while len(self._in_flight) < self.http.max_concurrency:
            if not waiting and not exhausted:
                exhausted = self._take(source, waiting, params)
            if not waiting:
                return exhausted, 0.0
            turn_s = self.endpoint.take_turn()
            if turn_s > 0:
                return exhausted, turn_s
            m = waiting.popleft()
            future = self._pool.submit(self.endpoint.post, "/completions", self._body(m), True)
            self._in_flight[future] = m
        return exhausted, 0.0

    def _take(self, source: Iterator[Any], waiting: deque[_Member], params: Params) -> bool:
        """The feed's next group's members into `waiting`; True when the feed is exhausted."""
        g: Any = next(source, _END)
        if g is _END:
            return True
        if g is NOT_READY:
            return False
        for row, prompt, prefix_len in group_rows(g):
            asked, copies = self.config.row_params(params, row).asked_once()
            waiting.append(_Member(row, prompt, prefix_len, asked, copies))
        return False

    def _body(self, m: _Member) -> dict[str, Any]:
        return completion_body(self.model, m.prompt, m.params, self.http.token_ids)

    def _finish(self, m: _Member, future: Future[dict[str, Any]], counts: dict[str, int]) -> RequestOutput:
        """The row's output from the server's answer: its error record when the server refused
        the request or answered what is not a completion (EndpointDown is raised)."""
        counts["requests"] += 1
        counts["prompt"] += len(m.prompt)
        try:
            answer = future.result()
            out = completion_output(answer, m)
        except (RequestFailed, ValueError, KeyError, TypeError, AttributeError) as e:
            return error_output(
                m.row_id, m.prompt, f"{type(e).__name__}: {e}" if not isinstance(e, RequestFailed) else str(e)
            )
        counts["cached"] += out.num_cached_tokens
        counts["output"] += int((answer.get("usage") or {}).get("completion_tokens") or 0)
        return greedy_copies(out, m.copies)


def completion_body(model: str, prompt: list[int], p: SamplingParams, token_ids: bool) -> dict[str, Any]:
    """The /v1/completions request of one row: OpenAI's fields, and vLLM's own sampling fields
    only where the row sets them (an OpenAI server refuses fields it does not know)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "n": p.n,
    }
    optional: dict[str, tuple[Any, Any]] = {
        "seed": (p.seed, None),
        "stop": (list(p.stop), []),
        "presence_penalty": (p.presence_penalty, 0.0),
        "frequency_penalty": (p.frequency_penalty, 0.0),
        "logprobs": (p.logprobs, None),
        # vLLM's
        "top_k": (p.top_k, -1),
        "min_p": (p.min_p, 0.0),
        "min_tokens": (p.min_tokens, 0),
        "repetition_penalty": (p.repetition_penalty, 1.0),
        "ignore_eos": (p.ignore_eos, False),
        "stop_token_ids": (list(p.stop_token_ids), []),
        "include_stop_str_in_output": (p.include_stop_str_in_output, False),
        "skip_special_tokens": (p.skip_special_tokens, True),
        "structured_outputs": (p.structured_outputs, None),
    }
    body.update({k: v for k, (v, default) in optional.items() if v != default})
    if p.logprobs is not None:
        body["return_tokens_as_token_ids"] = True  # vLLM's: the logprobs name token ids
    if token_ids:
        body["return_token_ids"] = True
    return body


def completion_output(answer: dict[str, Any], m: _Member) -> RequestOutput:
    """A /v1/completions answer as the row's RequestOutput (sample 0's fields; with n > 1
    every sample). num_cached_tokens: usage.prompt_tokens_details.cached_tokens, else 0."""
    choices = sorted(answer["choices"], key=lambda c: int(c.get("index", 0)))
    if not choices:
        raise ValueError(f"the server answered without choices: {str(answer)[:200]}")
    samples = [_sample(c, m.params) for c in choices]
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return sampled_output(m.row_id, m.prompt, m.prefix_len, samples, m.params.n, int(details.get("cached_tokens") or 0))


def _sample(c: dict[str, Any], p: SamplingParams) -> SampleOutput:
    """One choice of a completion answer. ValueError for a choice that did not finish (vLLM's
    "abort", or none given): the row's error record."""
    finish = c.get("finish_reason")
    if finish not in ("stop", "length"):
        raise ValueError(f"the server ended the completion with finish_reason={finish!r}, not 'stop' or 'length'")
    ids = tuple(int(t) for t in c.get("token_ids") or ())
    text = str(c.get("text") or "") if p.detokenize else ""
    logprobs = None
    if p.logprobs is not None and c.get("logprobs"):
        lp = c["logprobs"]
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        logprobs = tuple(
            TokenLogprob(_token_id(token), float(value if value is not None else float("-inf")), _top(top, p.logprobs))
            for token, value, top in zip(lp["tokens"], lp["token_logprobs"], tops)
        )
        ids = ids or tuple(t.token_id for t in logprobs)
    return SampleOutput(int(c.get("index", 0)), ids, text, str(finish), logprobs)


def _top(top: dict[str, float] | None, k: int) -> tuple[tuple[int, float], ...]:
    """The k most probable alternatives, most probable first (vLLM lists the sampled token
    first, then the top k, so the sampled one may be an extra)."""
    ranked = sorted(((_token_id(t), float(v)) for t, v in (top or {}).items()), key=lambda item: -item[1])
    return tuple(ranked[:k])


def _token_id(token: str) -> int:
    """A token of vLLM's logprobs with return_tokens_as_token_ids ("token_id:42") as its id."""
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"the server's logprobs name tokens as text ({token!r}), not as token ids")
    return int(token[len(TOKEN_ID_PREFIX) :])
