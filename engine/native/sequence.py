"""Per-request and per-prefix state of one engine replica (torch-free).

Both a request (`Sequence`) and a group's shared prefix computation (`PrefixSeq`) own a paged
KV range, the "own KV" of `engine/native/step.py`: token_ids[own_start:]. They share the `KVOwner`
fields the block manager works on. `GroupState` ties a prefix to its members (BatchLLM
Sec. 3.3.1: a group is scheduled as a unit and its prefix KV lives exactly as long as it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from prefixflow.requests import SamplingParams

# Seed of the block hash chains (engine/native/block_manager.py). Every chain starts at a prompt's
# first token: KV at an own index depends on every earlier token and on the positions, so an
# owner's own blocks are root-aligned and its seed is the chain's hash of what comes before them.
ROOT_HASH_SEED = 0x5EED


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Hash of one full KV block: its tokens and the hash of the block before it."""
    return hash((parent, tokens))


def chain_hash(token_ids: list[int], block_size: int) -> int:
    """The chain's hash after the whole blocks of token_ids (from the prompt's start): the
    seed of an owner whose own KV starts at len(token_ids), a multiple of block_size."""
    assert len(token_ids) % block_size == 0, "own KV starts at a block boundary"
    parent = ROOT_HASH_SEED
    for i in range(0, len(token_ids), block_size):
        parent = block_hash(parent, tuple(token_ids[i : i + block_size]))
    return parent


class SeqStatus(Enum):
    WAITING = "waiting"  # not started, or preempted (holds no blocks)
    RUNNING = "running"  # holds own blocks: prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class KVOwner:
    """Something that owns paged KV: own tokens are token_ids[own_start:].

    num_computed_tokens counts own tokens whose KV is in the cache; block_hashes[i] is the
    hash of own block i once it is full and computed (prefix cache), else absent.
    """

    seq_id: int
    token_ids: list[int]
    own_start: int
    hash_seed: int
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Highest own index ever computed among prompt tokens: separates first computations from
    # recomputations after preemption in the token-saving statistics.
    prompt_high_water: int = 0

    @property
    def num_own_tokens(self) -> int:
        return len(self.token_ids) - self.own_start

    def own_token_ids(self, start: int, end: int) -> list[int]:
        return self.token_ids[self.own_start + start : self.own_start + end]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_own_tokens - self.num_computed_tokens


@dataclass(eq=False)
class PrefixSeq(KVOwner):
    """The chunked computation of a group's shared prefix (a chunk with prefix_index -1)."""

    num_cached_tokens: int = -1  # hashed-cache hits at first admission; -1: unset

    @property
    def is_complete(self) -> bool:
        return self.num_computed_tokens == self.num_own_tokens


@dataclass(eq=False)
class Sequence(KVOwner):
    """One request. It shares prefix_len tokens with its group's prefix: it attends the
    prefix's first own_start tokens (whole blocks) in the prefix's blocks, and its own KV starts
    with the other tail_len (the prefix's partial last block), whose K/V it copies from the
    prefix's block instead of computing them (`KVCopy`). So a member's own blocks line up with
    the prompt's blocks from its start, as every other owner's, and any later request whose
    prompt starts with the same tokens finds them in the block cache."""

    row_id: int = -1
    num_prompt_tokens: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    group: GroupState | None = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_cached_tokens: int = -1  # prompt tokens not computed at first admission; -1: unset
    logprobs: list = field(default_factory=list)
    text: str = ""  # incremental detokenization state (engine/outputs.py)
    prefix_offset: int = 0
    read_offset: int = 0
    admit_order: int = -1  # scheduler's start counter; -1: never started
    sample_index: int = 0  # which of the row's SamplingParams.n samples this is
    num_samples: int = 1
    tail_len: int = 0  # own tokens at the start whose K/V the group's prefix computed

    @property
    def prefix_len(self) -> int:
        """Tokens it shares with its group's prefix (computed there, once)."""
        return self.own_start + self.tail_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        """Prefill done: exactly the last token (just sampled) still needs its KV."""
        return self.status is SeqStatus.RUNNING and self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0


@dataclass(eq=False)
class GroupState:
    """A planned PrefixGroup inside the engine.

    pending: members not started (or preempted), in the order they start. running: members
    that hold own blocks, in admission order. The prefix blocks are held while the group is
    active; they are freed when the last member finishes, or when preemption takes the group
    back to the waiting queue (no member holds them any more).
    """

    group_id: int
    prefix: PrefixSeq | None
    pending: list[Sequence]
    running: list[Sequence] = field(default_factory=list)
    active: bool = False
    admit_order: int = -1
    prefix_carried: bool = False  # a member has started: it carries the prefix's computation

    @property
    def prefix_ready(self) -> bool:
        return self.prefix is None or self.prefix.is_complete

    @property
    def is_done(self) -> bool:
        return not self.pending and not self.running
