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

# Seeds of the block hash chains (engine/native/block_manager.py). KV at an own index depends on every
# earlier token and on the positions, so a chain's seed names what comes before own index 0.
ROOT_HASH_SEED = 0x5EED


def member_hash_seed(prefix_token_ids: list[int]) -> int:
    """Seed of the own-KV chain of a member whose own KV follows `prefix_token_ids`."""
    if not prefix_token_ids:
        return ROOT_HASH_SEED
    return hash((ROOT_HASH_SEED, 1, tuple(prefix_token_ids)))


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
    """One request. own_start == its prefix_len (the shared prefix it attends to)."""

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

    @property
    def prefix_len(self) -> int:
        return self.own_start

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
