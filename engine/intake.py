"""When an engine takes its next planned group: lazily, as its scheduler has room for it.

The native and vLLM engines take the groups of a run from an iterable only while the work
waiting to start is short: fewer rows than are running or than the request cap leaves free
seats (at least INTAKE_MIN_ROWS, at most the engine's request cap) and fewer prompt tokens than
one step may prefill. A group taken is the engine's; one not yet taken is still the caller's to
hand to another replica (work stealing, operators/stages/work_queue.py), so the engine holds as
little unstarted work as keeps its batches full: the next step can admit at most a step's
token budget, into its free seats and those of the rows that finish. (Counting free seats
matters for prefill-only work, embeddings, whose rows all finish in their step: with rows capped
at those running, vLLM's steps held 16 rows of a 4,096-token budget and the embed bench's vLLM
backend took 17.9 s where vLLM's own `embed` took 14.9 s.)

Where vLLM's scheduler runs in this process, the vLLM engine also takes a group only while its
KV cache keeps room for what the running rows are expected to grow to (OutputFraction, below:
VllmEngine._kv_room): vLLM admits whatever fits now and preempts (recomputes) rows that outgrow
the cache later. The native scheduler keeps the same room when it admits a group (reserve_growth).

The iterable may yield NOT_READY: no group is ready now, ask again later (the work queue has
nothing unstarted, while another replica may still hand work back). The engine goes on with
what it has, and when it has nothing, sleeps IDLE_POLL_S before asking again.

Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Final, TypeVar

INTAKE_MIN_ROWS = 16  # rows kept waiting however few run (the first steps, small batches)
IDLE_POLL_S = 0.05  # an engine with nothing to run asks again this often
NOT_READY: Final = None  # what a source of groups yields when none is ready now

T = TypeVar("T")


def wants_more(
    pending_rows: int,
    pending_tokens: int,
    num_running: int,
    max_num_batched_tokens: int,
    max_num_seqs: int | None = None,
) -> bool:
    """Whether the engine takes another group before its next step (module docstring).
    max_num_seqs: the engine's request cap (None: none); rows waiting past it wait anyway."""
    rows = max(INTAKE_MIN_ROWS, num_running)
    if max_num_seqs is not None:  # and as many as the free seats, which the next step may fill
        rows = min(max(rows, max_num_seqs - num_running), max_num_seqs)
    return pending_rows < rows and pending_tokens < max_num_batched_tokens


def group_rows(g: Any) -> list[tuple[int, list[int], int]]:
    """(row_id, full prompt, prefix_len) of each member of a planned group (a PrefixGroup), in
    the plan's member order: what an engine that takes whole prompts sends (vLLM, a server)."""
    prefix = [int(t) for t in g.prefix]
    return [(int(row), prefix + [int(t) for t in g.distinct[i]], g.prefix_len) for i, row in enumerate(g.row_ids)]


def every_group(groups: Iterable[T | None]) -> Iterator[T]:
    """All of a lazy source's groups, skipping NOT_READY (with a pause before asking again):
    for an engine mode that must see the whole run before it starts (arrival order)."""
    for group in groups:
        if group is NOT_READY:
            time.sleep(IDLE_POLL_S)
            continue
        yield group


class OutputFraction:
    """The share of max_tokens that finished requests used (1 before any finished), kept as
    an exact fraction: output lengths of one batch task sit in a narrow range (BatchLLM Fig. 5),
    so a running request is expected to use as much of its remaining max_tokens. What an engine
    keeps KV room for when it admits more work (the native scheduler's growth reserve, the vLLM
    backend's intake)."""

    def __init__(self) -> None:
        self.used = 0  # output tokens of the finished requests
        self.allowed = 0  # their max_tokens

    @property
    def numerator(self) -> int:
        return self.used if self.allowed else 1

    @property
    def denominator(self) -> int:
        return self.allowed or 1

    def add(self, num_output_tokens: int, max_tokens: int) -> None:
        self.used += min(num_output_tokens, max_tokens)
        self.allowed += max(1, max_tokens)

    def add_finished(
        self, num_output_tokens: int, num_prompt_tokens: int, max_tokens: int, max_model_len: int | None
    ) -> None:
        """A finished request, against what it could use: max_tokens, unless max_model_len
        ends it sooner."""
        usable = max_tokens if max_model_len is None else min(max_tokens, max_model_len - num_prompt_tokens)
        self.add(num_output_tokens, usable)

    def expected_length(
        self, num_tokens: int, num_prompt_tokens: int, max_tokens: int, max_model_len: int | None
    ) -> int:
        """The length (prompt and output) a request now `num_tokens` long is expected to end
        at: its remaining max_tokens (ended at max_model_len) scaled by the fraction."""
        final = num_prompt_tokens + max_tokens
        if max_model_len is not None:
            final = min(final, max_model_len)
        remaining = max(0, final - num_tokens)
        return num_tokens + -(-remaining * self.numerator // self.denominator)
