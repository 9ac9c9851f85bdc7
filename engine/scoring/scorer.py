"""Prefill-only work: the `score` task (one probability per allowed answer, PrefillOnly) and
the `embed` task (one vector per row).

    scorer = Scorer(EngineConfig(model="path/to/hf_dir", device="cpu"))
    outs = scorer.score(["...Should we recommend it? Answer:"], [" Yes", " No"])
    outs[0].probs, outs[0].logprobs, outs[0].label, outs[0].error
    vecs = scorer.embed(["a passage"], Pooling("mean"))  # None: the checkpoint's pooling
    vecs[0].embedding

Each row is a prompt and its choices; the model runs ONE forward pass over the prompt (hybrid
prefilling, engine/scoring/forward.py) and the last position's logits give, per choice, the
softmax over the choices' first-token logits and the first token's log-probability under the
full vocabulary (engine/scoring/choices.py says how choices are tokenized). To embed, the final
hidden states are pooled instead (engine/scoring/pooling.py: the last token's, or the mean of
every token's, the prefix's part summed once per group). No KV is kept after a request, except
a planned group's shared prefix KV: pinned while the group has members left (Sec. 5.1), then
kept while the budget has room, so that the next unit of a group the plan cut finds it
(engine/scoring/cache.py). Requests are picked one at a time (Sec. 6.1) in the order of
PrefillOnly's SRJF with continuous JCT calibration (Sec. 6.3, `prefixflow.engine.scoring.srjf`):
before each pick, every waiting request is scored by the tokens the prefix cache does not
cover now, minus lam * its queueing time. The picked request runs packed with the waiting
requests of its prefix (its group's members, or rows sharing none) up to
ScoreOptions.max_packed_tokens of their own tokens (Prepacking: one forward, each attending to
the prefix and itself): on a CPU, one short request per forward leaves every matmul small
(max_packed_tokens=1 runs them one by one, as the paper). Rows longer than the maximum input length of the
memory budget (`ScoreOptions.max_forward_bytes`) or than max_model_len get an error.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.outputs import EngineTotals, StepStats
from prefixflow.engine.models.loader import load_model, load_tokenizer, resolve_device, resolve_max_model_len
from prefixflow.engine.models.model_args import read_model_args, require_classifier, require_lm_head
from prefixflow.engine.scoring.cache import PrefixCache
from prefixflow.engine.scoring.choices import (
    Choice,
    ScoreOutput,
    activate,
    choice_token_ids,
    error_output,
    label_output,
    make_output,
)
from prefixflow.engine.scoring.forward import Head, PrefixKV, forward_bytes, hybrid_forward, max_input_len
from prefixflow.engine.scoring.options import ScoreOptions
from prefixflow.engine.scoring.pooling import EmbedOutput, Pooling, error_embedding, model_pooling
from prefixflow.engine.scoring.srjf import CachedLen, SRJFScheduler, take_waiting
from prefixflow.errors import require
from prefixflow.model_source import resolve_model
from prefixflow.pipeline import build_plan
from prefixflow.requests import PrefixGroup

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's from Python 3.13; only annotations use it

Choices = Sequence[Choice] | Mapping[int, Sequence[Choice]]
PromptChoices = Choices | Sequence[Sequence[Choice]]  # `score` also takes one list per prompt
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
Work = Pooling | Literal["score", "classify"]  # what a prefill run gives: a pooled vector, or scores
EMPTY_PROMPT = "the prompt is empty: give at least one token"


@dataclass(slots=True)
class ScoreStats:
    """The last run: prefix hits are members that read their group's prefix KV from the cache;
    misses are prefix computations (a group's first member, or again after an eviction)."""

    num_requests: int = 0
    num_errors: int = 0
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_prefix_hits: int = 0
    num_prefix_misses: int = 0
    num_evictions: int = 0
    num_forwards: int = 0  # forwards of requests' own tokens (packed requests share one)
    wall_time_s: float = 0.0
    latency_s: dict[int, float] = field(default_factory=dict)  # row_id -> finish - arrival


@dataclass(slots=True, eq=False)
class _Req:
    row_id: int
    group: Hashable  # its prefix's cache key (_prefix_key), set with prefix_len
    tokens: np.ndarray  # [prompt_len] int64
    prefix_len: int  # shared prefix computed once per group (0: none)
    choices: Sequence[Choice]
    choice_ids: tuple[int, ...]
    arrival: float


class Scorer:
    """One replica's scoring engine. The last run: `score_stats` (prefix hits and misses,
    latencies), `totals` (every engine's EngineTotals, set when it ends) and `stats`, empty:
    a Scorer runs one forward per row, not steps of a batch."""

    def __init__(self, config: EngineConfig, options: ScoreOptions = ScoreOptions()) -> None:
        self.config, self.options = config, options
        self.device = resolve_device(config.device)
        self.args = read_model_args(config.model)
        self.max_model_len = resolve_max_model_len(config, self.args)
        self.model = load_model(config.model, config.dtype, self.device, self.max_model_len)
        self.tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        self.elem = next(self.model.parameters()).element_size()  # the dtype load_model chose
        budget = options.prefix_cache_bytes
        if budget is None:
            budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_PREFIX_CACHE_BYTES
        self.prefix_cache_bytes = budget
        # Kept for the engine's life: a group the plan cut into units finds its prefix in the
        # next unit's run (engine/scoring/cache.py).
        self.prefix_cache = PrefixCache(budget)
        self.score_stats = ScoreStats()
        self.stats: list[StepStats] = []
        self.totals: EngineTotals | None = None

    def max_input_len(self, prefix_len: int = 0) -> int:
        """Longest prompt one forward can take within max_forward_bytes (and max_model_len)
        when its first `prefix_len` tokens come from a group's prefix KV."""
        if self.options.max_forward_bytes is None:
            return self.max_model_len
        return max_input_len(
            self.args,
            self.elem,
            self.options.max_forward_bytes,
            prefix_len,
            self.options.chunk_size,
            self.max_model_len,
        )

    # ------------------------------------------------------------------ public API

    def score(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        choices: PromptChoices,
        *,
        row_ids: Sequence[int] | None = None,
        order: str = "batchllm",
    ) -> list[ScoreOutput]:
        """Score each prompt (a string or token ids); outputs in input order. choices: one
        list for every row, or one list per row. Prompts are planned (build_plan) so that
        shared prefixes are computed once."""
        ids = _row_ids(prompts, row_ids)
        by_row = _per_row_choices(choices, ids)
        return self._planned(
            prompts,
            ids,
            order,
            lambda i, why: error_output(i, by_row.get(i, ()), 0, why),
            lambda groups: self.score_groups(groups, by_row),
        )

    def embed(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        pooling: Pooling | None = None,
        *,
        row_ids: Sequence[int] | None = None,
        order: str = "batchllm",
    ) -> list[EmbedOutput]:
        """Embed each prompt (a string or token ids); outputs in input order. pooling: None
        for the checkpoint's own (`pooling.model_pooling`). Planned as `score` is."""
        chosen = self.model_pooling() if pooling is None else pooling
        return self._planned(
            prompts,
            _row_ids(prompts, row_ids),
            order,
            lambda i, why: error_embedding(i, 0, why),
            lambda groups: self.embed_groups(groups, chosen),
        )

    def model_pooling(self) -> Pooling:
        """The checkpoint's pooling (its sentence-transformers files, else last token normalized)."""
        return model_pooling(resolve_model(self.config.model))

    def _planned(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        ids: list[int],
        order: str,
        error: Callable[[int, str], Any],
        run: Callable[[Iterable[PrefixGroup]], Iterator[Any]],
    ) -> list[Any]:
        """`run` over the planned groups of the non-empty prompts; `error` for the empty ones."""
        tokens = [self._encode(p) for p in prompts]
        outs = {i: error(i, EMPTY_PROMPT) for i, t in zip(ids, tokens) if not t}
        kept = [(i, t) for i, t in zip(ids, tokens) if t]
        if kept:
            plan = build_plan([t for _, t in kept], row_ids=[i for i, _ in kept], order=order)
            outs.update((o.row_id, o) for o in run(plan.groups(0)))
        return [outs[i] for i in ids]

    def score_groups(
        self,
        groups: Iterable[PrefixGroup],
        choices: Choices,
        *,
        arrivals: Mapping[int, float] | None = None,
        tokens_per_s: float | None = None,
    ) -> Iterator[ScoreOutput]:
        """Score planned groups; yields each row's output when done (bad rows first).
        choices: one list for all rows or a mapping row_id -> list. arrivals: optional
        row_id -> seconds after the start at which the row arrives (online benchmarks); the
        clock jumps over idle time. tokens_per_s: run the scheduler on a virtual clock that
        advances by computed tokens / tokens_per_s per request (the JCT proxy of Sec. 6.3)
        instead of the wall clock, so that online studies do not depend on the machine's
        load; latencies are then in virtual seconds."""
        return self._prefill_groups(groups, choices, "score", arrivals, tokens_per_s)

    def classify_groups(
        self,
        groups: Iterable[PrefixGroup],
        *,
        arrivals: Mapping[int, float] | None = None,
        tokens_per_s: float | None = None,
    ) -> Iterator[ScoreOutput]:
        """Classify planned groups (the `classify` task) with a sequence classifier's head on
        each row's last token: ScoreOutputs over the checkpoint's labels (config.json id2label),
        probs their softmax, in score_groups' order and with its prefix sharing."""
        require_classifier(self.args)
        return self._prefill_groups(groups, list(self.args.labels), "classify", arrivals, tokens_per_s)

    def embed_groups(
        self,
        groups: Iterable[PrefixGroup],
        pooling: Pooling,
        *,
        arrivals: Mapping[int, float] | None = None,
        tokens_per_s: float | None = None,
    ) -> Iterator[EmbedOutput]:
        """Embed planned groups (the `embed` task): each row's final hidden states pooled as
        `pooling` says (engine/scoring/pooling.py), in score_groups' order and with its
        prefix sharing; yields each row's output when done (bad rows first)."""
        return self._prefill_groups(groups, {}, pooling, arrivals, tokens_per_s)

    def _prefill_groups(
        self,
        groups: Iterable[PrefixGroup],
        choices: Choices,
        work: Work,
        arrivals: Mapping[int, float] | None,
        tokens_per_s: float | None,
    ) -> Iterator[Any]:
        """score_groups, classify_groups and embed_groups: one prefill per row, SRJF order."""
        if work == "score":
            require_lm_head(self.args, "score")
        require(
            tokens_per_s is None or tokens_per_s > 0,
            "Scorer.score_groups",
            "tokens_per_s",
            tokens_per_s,
            "use None or a rate > 0",
        )
        start, skipped = time.perf_counter(), 0.0
        virtual = 0.0
        clock: Callable[[], float] = (
            (lambda: virtual + skipped) if tokens_per_s else (lambda: time.perf_counter() - start + skipped)
        )
        self.score_stats = stats = ScoreStats()
        self.totals = None
        cache, evicted = self.prefix_cache, self.prefix_cache.num_evictions
        reqs = yield from self._admit_groups(groups, choices, work, arrivals, stats, cache)
        # SRJFScheduler hands back the very array it was given (np.asarray of an int64 array
        # is that array), so its id() finds the request and its group's cached prefix.
        by_array: dict[Hashable, _Req] = {id(r.tokens): r for r in reqs}  # the queue's request ids

        def cached_len(toks: np.ndarray) -> int:
            return by_array[id(toks)].prefix_len if by_array[id(toks)].group in cache else 0

        queue = _make_queue(self.options)
        waiting = deque(reqs)
        while waiting or len(queue):
            now = clock()
            if not len(queue) and waiting[0].arrival > now:
                skipped += waiting[0].arrival - now  # idle: jump to the next arrival
                now = waiting[0].arrival
            while waiting and waiting[0].arrival <= now:
                r = waiting.popleft()
                queue.add(id(r.tokens), r.tokens, now, cached_len)
            batch = self._mates(by_array[queue.pick(cached_len, now)], queue, by_array)
            computed = stats.num_computed_tokens
            outs = self._run(batch, cache, stats, work)
            if tokens_per_s:
                virtual += (stats.num_computed_tokens - computed) / tokens_per_s
            for req, out in zip(batch, outs):
                stats.latency_s[req.row_id] = clock() - req.arrival
                yield out
        stats.num_evictions = cache.num_evictions - evicted
        stats.wall_time_s = time.perf_counter() - start
        self.totals = _engine_totals(stats)

    # ------------------------------------------------------------------ internals

    def _admit_groups(
        self,
        groups: Iterable[PrefixGroup],
        choices: Choices,
        work: Work,
        arrivals: Mapping[int, float] | None,
        stats: ScoreStats,
        cache: PrefixCache,
    ) -> Generator[Any, None, list[_Req]]:
        """Every group's valid members as requests, in arrival order (plan order on ties);
        yields the bad rows' errors as each group is read, counts rows in `stats`, and tells
        the cache how many members will read each shared prefix."""
        reqs: list[_Req] = []
        for i, g in enumerate(groups):
            members, errors = self._group_requests(g, choices, work, arrivals)
            stats.num_requests += len(members) + len(errors)
            stats.num_errors += len(errors)
            yield from errors
            reqs += members
            if members and members[0].prefix_len > 0:
                cache.expect(members[0].group, len(members))
        reqs.sort(key=lambda r: r.arrival)  # stable: plan order on ties
        return reqs

    def _mates(self, req: _Req, queue: SRJFScheduler | _Fifo, by_array: Mapping[Hashable, _Req]) -> list[_Req]:
        """`req` and the waiting requests that share its prefix (all of its group's members
        waiting, or requests with no shared prefix), in queue order, while their own tokens
        fit ScoreOptions.max_packed_tokens and the forward's memory budget: one packed
        forward runs them (Prepacking)."""
        p = req.prefix_len
        budget = min(self.options.max_packed_tokens, self.max_input_len(p) - p) - (len(req.tokens) - p)
        if budget <= 0:
            return [req]

        def mate(rid: Hashable) -> bool:
            other = by_array[rid]
            return other.group == req.group and other.prefix_len == p

        taken = queue.take(mate, lambda rid: len(by_array[rid].tokens) - p, budget)
        return [req, *(by_array[rid] for rid in taken)]

    @torch.inference_mode()
    def _run(self, reqs: list[_Req], cache: PrefixCache, stats: ScoreStats, work: Work) -> list[Any]:
        """Score, classify or embed requests of one prefix (one request, or several packed),
        reading or computing the prefix."""
        req, p = reqs[0], reqs[0].prefix_len
        mean = isinstance(work, Pooling) and work.kind == "mean"
        prefix, cached = self._prefix(req, torch.from_numpy(req.tokens).to(self.device), cache, stats, mean)
        stats.num_prefix_hits += (len(reqs) - 1) * (p > 0)  # the others read what the first found
        own = [torch.from_numpy(r.tokens[p:]) for r in reqs]
        head: Head = "logits" if work == "score" else ("sum" if mean else "last")
        lengths = [len(t) for t in own] if len(reqs) > 1 else None
        out, _ = hybrid_forward(
            self.model, torch.cat(own).to(self.device), prefix, self.options.chunk_size, head=head, lengths=lengths
        )
        assert out is not None, "hybrid_forward answers every head but 'none'"
        stats.num_forwards += 1
        rows = out if lengths is not None else out.unsqueeze(0)
        outs = []
        for i, r in enumerate(reqs):
            stats.num_prompt_tokens += len(r.tokens)
            stats.num_computed_tokens += len(r.tokens) - p
            if p > 0:
                cache.finished(r.group)
            outs.append(self._finish(r, rows[i], prefix, work, cached if i == 0 else p))
        return outs

    def _finish(self, req: _Req, out: torch.Tensor, prefix: PrefixKV | None, work: Work, num_cached: int) -> Any:
        """One request's output from its head's answer (`out`: logits, or hidden state / sum)."""
        p, mean = req.prefix_len, isinstance(work, Pooling) and work.kind == "mean"
        if work == "classify":  # the classifier's head on the last token: one logit per label
            assert self.model.score is not None, "classify_groups checked the checkpoint has a score head"
            logits = self.model.score(out.to(self.model.score.weight.dtype))
            values = activate(logits, self.args.activation).tolist()
            return label_output(
                req.row_id, self.args.labels, values, self.args.activation, len(req.tokens), p, num_cached
            )
        if not isinstance(work, Pooling):
            return make_output(req.row_id, req.choices, req.choice_ids, out, len(req.tokens), p, num_cached)
        if mean and prefix is not None and prefix.hidden_sum is not None:
            out = out + prefix.hidden_sum
        if mean:
            out = out / len(req.tokens)
        if work.normalize:
            out = torch.nn.functional.normalize(out, dim=-1)
        return EmbedOutput(req.row_id, tuple(out.tolist()), len(req.tokens), p, num_cached)

    def _prefix(
        self, req: _Req, ids: torch.Tensor, cache: PrefixCache, stats: ScoreStats, mean: bool
    ) -> tuple[PrefixKV | None, int]:
        """The request's group prefix KV (None: it has none) and the tokens read from the
        cache: computed and kept when the cache lacks it (or, for mean pooling, its sum)."""
        p = req.prefix_len
        if p == 0:
            return None, 0
        prefix = cache.get(req.group)
        if prefix is not None and (prefix.hidden_sum is not None or not mean):
            stats.num_prefix_hits += 1
            return prefix, p
        hidden, prefix = hybrid_forward(
            self.model, ids[:p], None, self.options.chunk_size, keep_kv=True, head="sum" if mean else "none"
        )
        assert prefix is not None, "hybrid_forward(keep_kv=True) returns the prefix's KV"
        prefix = replace(prefix, hidden_sum=hidden)
        cache.put(req.group, prefix)  # kept for the members left, if it fits
        stats.num_prefix_misses += 1
        stats.num_computed_tokens += p
        return prefix, 0

    def _group_requests(
        self,
        g: PrefixGroup,
        choices: Choices,
        work: Work,
        arrivals: Mapping[int, float] | None,
    ) -> tuple[list[_Req], list[Any]]:
        """Valid members as requests (sharing the prefix when it pays and fits), and errors
        (ScoreOutputs, or EmbedOutputs when embedding)."""
        members: list[_Req] = []
        errors: list[Any] = []

        def error(row: int, row_choices: Sequence[Choice], n: int, why: str) -> Any:
            return error_embedding(row, n, why) if isinstance(work, Pooling) else error_output(row, row_choices, n, why)

        for i in range(g.num_members):
            row = int(g.row_ids[i])
            row_choices = choices.get(row, ()) if isinstance(choices, Mapping) else choices
            tokens = np.ascontiguousarray(g.prompt(i), dtype=np.int64)
            try:
                ids = self._choice_ids(row_choices) if work == "score" else tuple(range(len(row_choices)))
                _check_prompt_ids(tokens, self.args.vocab_size)
            except ValueError as e:
                errors.append(error(row, row_choices, len(tokens), str(e)))
                continue
            arrival = float(arrivals.get(row, 0.0)) if arrivals is not None else 0.0
            members.append(_Req(row, None, tokens, 0, row_choices, ids, arrival))
        p = self._shared_prefix_len(g, members)
        kept = []
        key = _prefix_key(np.ascontiguousarray(g.prefix[:p], dtype=np.int64))  # the members' first p tokens
        limit = self.max_input_len(p)
        for r in members:
            r.prefix_len, r.group = p, key
            if len(r.tokens) > limit:
                errors.append(error(r.row_id, r.choices, len(r.tokens), self._too_long(len(r.tokens), limit, p)))
                continue
            kept.append(r)
        return kept, errors

    def _choice_ids(self, row_choices: Sequence[Choice]) -> tuple[int, ...]:
        return choice_token_ids(row_choices, self.tokenizer, self.args.vocab_size, self.options.choice_leading_space)

    def _shared_prefix_len(self, g: PrefixGroup, members: list[_Req]) -> int:
        """The group prefix computed once: one token shorter when a member's prompt is the
        whole prefix (its last position must be computed by the member itself to give
        logits); 0 when the prefix's own forward exceeds the budget. A lone member with a
        prefix is a piece of a larger run that a unit boundary cut: it shares the prefix with
        the run's other pieces, through the cache, as a group does."""
        if not members or g.prefix_len == 0:
            return 0
        p = g.prefix_len
        if any(len(r.tokens) == p for r in members):
            p -= 1
        if p == 0:
            return 0
        budget = self.options.max_forward_bytes
        if (
            budget is not None
            and forward_bytes(self.args, self.elem, p, 0, self.options.chunk_size, keep_kv=True) > budget
        ):
            return 0
        return p

    def _too_long(self, n: int, limit: int, p: int) -> str:
        if self.options.max_forward_bytes is None or limit == self.max_model_len:
            return (
                f"the prompt has {n} tokens, more than max_model_len={self.max_model_len}; "
                "shorten it or raise EngineConfig.max_model_len"
            )
        return (
            f"the prompt has {n} tokens, more than the maximum input length {limit} that "
            f"ScoreOptions.max_forward_bytes={self.options.max_forward_bytes} allows "
            f"(shared prefix {p} tokens); shorten it or raise max_forward_bytes"
        )

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=self.options.add_special_tokens)["input_ids"])
        return [int(t) for t in prompt]


def _prefix_key(tokens: np.ndarray) -> Hashable:
    """A prefix's cache key: its tokens (a digest of them, with their count)."""
    return len(tokens), hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()


def _engine_totals(stats: ScoreStats) -> EngineTotals:
    """A scoring run as EngineTotals: every prompt token is prefill; no steps, no outputs."""
    return EngineTotals(
        num_requests=stats.num_requests,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_computed_prompt_tokens=stats.num_computed_tokens,
        num_recomputed_tokens=0,
        num_output_tokens=0,
        num_steps=0,
        num_preemptions=0,
        wall_time_s=stats.wall_time_s,
    )


def _check_prompt_ids(tokens: np.ndarray, vocab_size: int) -> None:
    if not len(tokens):
        raise ValueError(EMPTY_PROMPT)
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if len(bad):
        raise ValueError(
            f"the prompt holds token id {int(bad[0])}, outside the vocabulary "
            f"0..{vocab_size - 1}; tokenize with the model's tokenizer"
        )


class _Fifo:
    """First come, first served, with SRJFScheduler's add/pick interface (the baseline)."""

    def __init__(self) -> None:
        self._queue: deque[Hashable] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, req_id: Hashable, tokens: np.ndarray, now: float, cached_len: CachedLen | None = None) -> None:
        self._queue.append(req_id)

    def pick(self, cached_len: CachedLen, now: float) -> Hashable:
        return self._queue.popleft()

    def take(self, keep: Callable[[Hashable], bool], cost: Callable[[Hashable], int], budget: int) -> list[Hashable]:
        ids = list(self._queue)
        at = set(take_waiting(ids, keep, cost, budget))
        self._queue = deque(rid for i, rid in enumerate(ids) if i not in at)
        return [rid for i, rid in enumerate(ids) if i in at]


def _make_queue(o: ScoreOptions) -> SRJFScheduler | _Fifo:
    return _Fifo() if o.policy == "fcfs" else SRJFScheduler(o.lam, o.calibrate)


def _row_ids(prompts: Sequence[Any], row_ids: Sequence[int] | None) -> list[int]:
    ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
    if len(ids) != len(prompts):
        raise ValueError(f"row_ids has {len(ids)} entries for {len(prompts)} prompts")
    return ids


def _per_row_choices(choices: PromptChoices, row_ids: list[int]) -> Mapping[int, Sequence[Choice]]:
    """One list for all rows, one list per row (in prompt order), or a row_id mapping."""
    if isinstance(choices, Mapping):
        return choices
    if _one_list(choices):
        return {i: choices for i in row_ids}
    if len(choices) != len(row_ids):
        raise ValueError(
            f"choices has {len(choices)} lists for {len(row_ids)} prompts: give "
            "one list of labels for all rows, or one list per row"
        )
    return dict(zip(row_ids, choices))


def _one_list(choices: Sequence[Choice] | Sequence[Sequence[Choice]]) -> TypeIs[Sequence[Choice]]:
    """One list of labels for all rows (else one list per row)."""
    return all(isinstance(c, (str, int)) for c in choices)
