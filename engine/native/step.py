"""The contract between the engine's scheduler side and its model side (torch-free).

The scheduler decides *what* runs in a step and where its KV lives; the model runner turns a
`StepInput` into tensors, runs the model and samples. Neither knows how the other works.

KV layout. Every request owns a block table for its *own* KV: the tokens after its group's
shared prefix (or its whole sequence when it has no shared prefix). A group's shared prefix
lives in blocks of its own (`SharedPrefix.block_table`), computed once by a chunk that has
`prefix_index == -1` and the prefix blocks as its own table, then referenced by every member.
A member attends the prefix's whole blocks only; when the prefix ends in the middle of a block,
that block's K/V are copied into the member's first own block (`KVCopy`, before the step's
model runs), so a member's own blocks line up with its prompt's blocks from the start (the
block cache finds them for any prompt with the same tokens) and shared blocks are never
written by members.

Positions. A chunk's token i has logical position `start_pos + i` (used for rotary
embeddings) and own-KV index `num_cached_tokens + i`. For a member of a group,
`start_pos == prefix.length + num_cached_tokens`.

Attention. Token i of a chunk attends to (a) every token of its shared prefix, if any, and
(b) its own KV indices `0 .. num_cached_tokens + i` (causal). A shared prefix is complete in
the cache once the step's K/V are written: before the step, or by this step's chunk of the
prefix computation (its members then start in the step that completes it). Runners write every
chunk's K/V of a layer before any of that layer's attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixflow.requests import SamplingParams


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A group's shared prefix KV (complete once the step's K/V are written), attended
    non-causally by members."""

    block_table: tuple[int, ...]
    length: int


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's work in a step: compute `token_ids` and write their KV.

    seq_id: the engine's id of the sequence (or of a prefix computation).
    token_ids: tokens fed to the model in this step (a prefill chunk, or one decode token).
    start_pos: logical position of token_ids[0].
    num_cached_tokens: own-KV tokens already in the cache before this step.
    block_table: physical blocks of the own KV; covers num_cached_tokens + len(token_ids).
    prefix_index: index into StepInput.prefixes, or -1 when no shared prefix is attended.
    sample: sample the next token from the logits of the chunk's last token.
    sampling_params: required when sample is True.
    num_generated: tokens this request generated before this step (seeded sampling uses it so
        that a seed gives the same tokens whatever the batch composition).
    history: the tokens its penalties count, set only when its sampling_params have penalties:
        prompt + generated tokens with a repetition_penalty, else the generated ones alone
        (frequency and presence count output tokens only); else empty. Its last num_generated
        tokens are the output.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    num_cached_tokens: int
    block_table: tuple[int, ...]
    prefix_index: int = -1
    sample: bool = False
    sampling_params: SamplingParams | None = None
    num_generated: int = 0
    history: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class KVCopy:
    """Copy the K/V of the first `num_tokens` slots of block `src` to block `dst` (every
    layer), before the step's model runs."""

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class StepInput:
    """All chunks of one step, in any order (the runner groups them by prefix itself), and
    the K/V copies that come first."""

    chunks: tuple[SeqChunk, ...]
    prefixes: tuple[SharedPrefix, ...] = ()
    copies: tuple[KVCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token sampled for one chunk with `sample=True`.

    logprob: log-probability of the token under the model's raw distribution (log_softmax of
        the logits, before temperature / top-k / top-p).
    top_logprobs: the `sampling_params.logprobs` most likely (token_id, logprob) pairs, if asked.
    """

    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutput:
    sampled: tuple[SampledToken, ...]  # one per chunk with sample=True, in chunk order
