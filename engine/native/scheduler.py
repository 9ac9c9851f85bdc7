"""Grouped scheduling and memory-centric token batching (BatchLLM Sec. 3.3), torch-free.

The scheduler owns the queues of one replica: planned groups waiting in plan order, and the
active groups (admitted, in admission order) with their pending and running members. Each
`schedule()` forms one token batch; `update()` records what the model computed and sampled.
With `EngineConfig.aligned_decode_batch`, the decode queue serves batches of similar KV length
(AlignedServe Sec. 3.3, engine/native/alignedserve.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from prefixflow.engine.native.alignedserve import DensityFirstBatcher
from prefixflow.engine.native.block_manager import BlockManager
from prefixflow.engine.config import EngineConfig
from prefixflow.engine.intake import OutputFraction
from prefixflow.engine.native.sequence import GroupState, KVOwner, Sequence, SeqStatus
from prefixflow.engine.native.step import KVCopy, SampledToken, SeqChunk, SharedPrefix, StepInput

# AlignedServe's starvation guard (Sec. 3.5), counted in steps: a KV-length range whose ready
# requests were passed over for this many steps is served next.
ALIGNED_STARVATION_STEPS = 64


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_tokens` own tokens of `owner` from own index `start`; sample the next token."""

    owner: KVOwner
    start: int
    num_tokens: int
    sample: bool
    kind: str  # "decode" | "prefill" | "prefix"


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    scheduled: set[int] = field(default_factory=set)  # seq_ids in this batch
    token_budget: int = 0
    block_size: int = 16
    blocked: bool = False  # a start failed for memory: no later start in this step (FIFO)
    growth_blocks: int = 0  # blocks the running requests are expected to grow into
    completing: set[int] = field(default_factory=set)  # prefixes this step computes to the end
    num_preemptions: int = 0
    copies: list[KVCopy] = field(default_factory=list)  # members' prefix tails, before the model runs

    def add(self, owner: KVOwner, num_tokens: int, sample: bool, kind: str) -> None:
        assert 0 < num_tokens <= self.token_budget
        self.chunks.append(ScheduledChunk(owner, owner.num_computed_tokens, num_tokens, sample, kind))
        self.scheduled.add(owner.seq_id)
        self.token_budget -= num_tokens

    def num_tokens(self, kind: str | None = None) -> int:
        return sum(c.num_tokens for c in self.chunks if kind is None or c.kind == kind)

    def to_step_input(self) -> StepInput:
        """The model runner's view (engine/native/step.py); call before `update()`."""
        prefixes: list[SharedPrefix] = []
        index: dict[tuple[int, int], int] = {}
        chunks = []
        for c in self.chunks:
            owner, prefix_index, start_pos = c.owner, -1, c.owner.own_start + c.start
            if isinstance(owner, Sequence) and owner.own_start > 0:
                # A member attends its prefix's whole blocks (own_start is a block boundary).
                key = (id(owner.group), owner.own_start)  # plan pieces of one run share its id
                if key not in index:
                    assert owner.group is not None, "a member with a prefix belongs to a group"
                    prefix = owner.group.prefix
                    assert prefix is not None and (prefix.is_complete or prefix.seq_id in self.completing)
                    index[key] = len(prefixes)
                    blocks = tuple(prefix.block_table[: owner.own_start // self.block_size])
                    prefixes.append(SharedPrefix(blocks, owner.own_start))
                prefix_index = index[key]
            seq = owner if isinstance(owner, Sequence) else None
            # penalties count the prompt's and output's tokens: only those rows carry them
            penalised = seq is not None and c.sample and seq.params.has_penalties
            chunks.append(
                SeqChunk(
                    seq_id=owner.seq_id,
                    token_ids=tuple(owner.own_token_ids(c.start, c.start + c.num_tokens)),
                    start_pos=start_pos,
                    num_cached_tokens=c.start,
                    block_table=tuple(owner.block_table),
                    prefix_index=prefix_index,
                    sample=c.sample,
                    sampling_params=seq.params if seq is not None else None,
                    num_generated=seq.num_output_tokens if seq is not None else 0,
                    history=_history(seq) if seq is not None and penalised else (),
                )
            )
        return StepInput(tuple(chunks), tuple(prefixes), tuple(self.copies))


def _history(seq: Sequence) -> tuple[int, ...]:
    """The tokens a request's penalties count: prompt and output for repetition_penalty, the
    output alone for frequency and presence penalties (a step copies it for every row)."""
    if seq.params.repetition_penalty != 1.0:
        return tuple(seq.token_ids)
    return tuple(seq.token_ids[seq.num_prompt_tokens :])


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int | None = None) -> None:
        self.bm = block_manager
        self.max_model_len = max_model_len or config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.effective_max_num_seqs
        # Room kept free for decode growth when admitting new work while others run.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        # New groups also keep room for what running requests will still decode and for one
        # member of their own (`_kept_from_new_groups`); not the vLLM-like baseline, which
        # admits optimistically and preempts, as vLLM does.
        self.reserve_growth = config.policy == "batchllm"
        self.output_fraction = OutputFraction()
        self.waiting: deque[GroupState] = deque()
        self.active: list[GroupState] = []
        self.num_running = 0
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0  # first computations only (token saving)
        self.num_recomputed_tokens = 0  # prefill work redone after preemption
        self._order = itertools.count()
        self.aligned = aligned_batcher(config, block_manager.block_size)
        self._num_steps = 0  # the aligned batcher's clock (deterministic, unlike wall time)

    def add_group(self, group: GroupState) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    def pending_work(self) -> tuple[int, int]:
        """(rows not started: waiting groups' and active groups' pending members, prompt tokens
        they will compute: their own parts, and the prefixes of groups not admitted yet). What
        the engine's intake weighs (engine/intake.py)."""
        rows = tokens = 0
        for group in itertools.chain(self.waiting, self.active):
            rows += len(group.pending)
            tokens += sum(s.num_prompt_tokens - s.prefix_len for s in group.pending)
            if not group.active and group.prefix is not None:
                tokens += group.prefix.num_own_tokens
        return rows, tokens

    def schedule(self) -> SchedulerOutput:
        # BatchLLM Sec. 3.3: one step is one token batch of at most max_num_batched_tokens.
        # 1. decode queue: each decoding request, oldest group first, gets one token. One that
        #    needs a block and finds none preempts (recompute) the most recently admitted
        #    group's members first, or itself when nothing younger runs.
        # 2. distinct queue: members of active groups whose prefix is complete: partial
        #    prefills continue, then pending members start, chunked to the token budget.
        # 3. common prefix queue: active groups' prefix computations continue, then waiting
        #    groups are admitted in plan order (a prefix must be complete before its members).
        # Admission is memory-centric (Sec. 3.3.3): a start needs KV blocks for its whole
        # prompt (a new group's prefix also room to run: `_kept_from_new_groups`) and the
        # token budget, with no cap on the number of requests unless max_num_seqs (the vLLM-like baseline's 256). Starts are FIFO: the first one that does
        # not fit stops all later starts in this step.
        # With aligned_decode_batch N, the decode queue serves at most N requests: when more
        # are ready, a batch of similar KV lengths (AlignedServe Sec. 3.3).
        out = SchedulerOutput(token_budget=self.max_num_batched_tokens, block_size=self.bm.block_size)
        self._num_steps += 1
        self._schedule_decodes(self._decode_batch(), out)
        if self.reserve_growth:
            out.growth_blocks = sum(self._growth_blocks(seq) for group in self.active for seq in group.running)
        for group in list(self.active):
            self._schedule_members(group, out)
        for group in list(self.active):
            self._schedule_prefix(group, out)
        while self.waiting and out.token_budget > 0 and not out.blocked and self._below_seq_cap():
            self._admit_group(out)
        return out

    # ---- the three queues ---------------------------------------------------------------------

    def _decode_batch(self) -> list[Sequence]:
        """The requests ready to decode, in the order the decode queue tries them.

        Oldest group first; with aligned_decode_batch and more ready than that, the batch of
        similar KV lengths Density First Search picks comes first (in that order: the plan's
        order also breaks its ties), then the others, which only stand in for picked ones
        that memory preempts (without them a step could be left with nothing to run).
        """
        ready = [seq for group in self.active for seq in group.running if seq.is_decoding]
        if self.aligned is None or len(ready) <= self.aligned.max_requests:
            return ready
        kv_lens = np.array([len(seq.token_ids) for seq in ready], dtype=np.int64)
        picked = set(self.aligned.select(kv_lens, now=float(self._num_steps)).tolist())
        order = sorted(range(len(ready)), key=lambda i: i not in picked)  # stable: plan order
        return [ready[i] for i in order]

    def _schedule_decodes(self, ready: list[Sequence], out: SchedulerOutput) -> None:
        limit = len(ready) if self.aligned is None else self.aligned.max_requests
        for seq in ready:
            if out.token_budget == 0 or limit == 0:
                return
            # An earlier reservation may have preempted it.
            if seq.status is SeqStatus.RUNNING and seq.is_decoding and self._reserve(seq, 1, out):
                out.add(seq, 1, sample=True, kind="decode")
                limit -= 1

    def _schedule_members(self, group: GroupState, out: SchedulerOutput) -> None:
        if not group.active or not self._prefix_usable(group, out):
            return
        for seq in list(group.running):  # partial prefills (and recomputes) continue first
            if out.token_budget == 0:
                return
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in out.scheduled or seq.is_decoding:
                continue
            n = min(seq.num_uncomputed_tokens, out.token_budget)
            if self._reserve(seq, n, out):
                self._add_prompt_chunk(out, seq, n, sample=n == seq.num_uncomputed_tokens, kind="prefill")
        while group.pending and out.token_budget > 0 and not out.blocked and self._below_seq_cap():
            if group.pending[0].tail_len and not group.prefix_ready:
                return  # its tail's K/V are copied before the step: the prefix's last block must hold them
            if not self._start_member(group, group.pending[0], out):
                out.blocked = True

    def _schedule_prefix(self, group: GroupState, out: SchedulerOutput) -> None:
        prefix = group.prefix
        if prefix is None or prefix.is_complete or prefix.seq_id in out.scheduled or not group.active:
            return
        n = min(prefix.num_uncomputed_tokens, out.token_budget)
        if n == 0:
            return
        if not self.bm.can_allocate(self.bm.num_new_blocks(prefix, n)):
            out.blocked = True
            return
        self.bm.allocate(prefix, n)
        self._add_prompt_chunk(out, prefix, n, sample=False, kind="prefix")
        if n == prefix.num_uncomputed_tokens:
            # Its members start in this step: each layer writes the prefix's K/V before
            # their attention reads it (engine/native/step.py), so the budget left is not lost.
            out.completing.add(prefix.seq_id)
            self._schedule_members(group, out)

    @staticmethod
    def _shared_tokens(group: GroupState, seq: Sequence) -> int:
        """Prefix tokens `seq` finds computed at its first start (its num_cached_tokens less its
        own cache hits): the prefix it reads, except for the group's first member to start,
        which carries the prefix's computation and finds only the prefix's cache hits. So the
        requests' counts add up to the engine's computed tokens, as vLLM's do."""
        if group.prefix is None or group.prefix_carried or seq.prefix_len == 0:
            return seq.prefix_len
        group.prefix_carried = True
        return min(max(group.prefix.num_cached_tokens, 0), seq.prefix_len)

    @staticmethod
    def _prefix_usable(group: GroupState, out: SchedulerOutput) -> bool:
        """Members may run: no prefix, or complete before or by this step."""
        return group.prefix_ready or (group.prefix is not None and group.prefix.seq_id in out.completing)

    # ---- admission ----------------------------------------------------------------------------

    def _admit_group(self, out: SchedulerOutput) -> None:
        """Activate the next planned group and schedule its prefix, or its members if none."""
        group = self.waiting[0]
        prefix = group.prefix
        if prefix is not None:
            hits = self.bm.lookup(prefix, prefix.num_own_tokens // self.bm.block_size)
            need = (
                self.bm.blocks_for(prefix.num_own_tokens)
                - len(hits)
                + self.bm.num_reclaimed(hits)
                + self._watermark()
                + self._kept_from_new_groups(group, out)
            )
            if not self.bm.can_allocate(need):
                out.blocked = True
                return
            self.bm.take_cached(prefix, hits)
            prefix.prompt_high_water = max(prefix.prompt_high_water, prefix.num_computed_tokens)
            if prefix.num_cached_tokens < 0:
                prefix.num_cached_tokens = prefix.num_computed_tokens
        self.waiting.popleft()
        group.active = True
        group.admit_order = next(self._order)
        self.active.append(group)
        if group.prefix_ready:
            self._schedule_members(group, out)
        else:
            self._schedule_prefix(group, out)

    def _start_member(self, group: GroupState, seq: Sequence, out: SchedulerOutput) -> bool:
        """Start (or restart after preemption) a pending member if its whole prompt fits."""
        hits = self.bm.lookup(seq, (seq.num_own_tokens - 1) // self.bm.block_size)  # >= 1 token left
        while not self.bm.can_allocate(
            self.bm.blocks_for(seq.num_own_tokens) - len(hits) + self.bm.num_reclaimed(hits) + self._watermark()
        ):
            victim = self._idle_group_victim(group, out)
            if victim is None:
                return False
            self._preempt_group(victim)  # may free some of `hits`: the cost is recounted
        self.bm.take_cached(seq, hits)
        copy_tail = seq.num_computed_tokens < seq.tail_len  # no own block found: the prefix has them
        if copy_tail:
            seq.num_computed_tokens = seq.tail_len
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = self._shared_tokens(group, seq) + seq.num_computed_tokens - seq.tail_len
        seq.prompt_high_water = max(seq.prompt_high_water, seq.num_computed_tokens)
        n = min(seq.num_uncomputed_tokens, out.token_budget)
        self.bm.allocate(seq, n)
        if copy_tail:
            assert group.prefix is not None and group.prefix.is_complete
            src = group.prefix.block_table[seq.own_start // self.bm.block_size]
            out.copies.append(KVCopy(src, seq.block_table[0], seq.tail_len))
        group.pending.remove(seq)
        group.running.append(seq)
        seq.status = SeqStatus.RUNNING
        self.num_running += 1
        seq.admit_order = next(self._order)
        self._add_prompt_chunk(out, seq, n, sample=n == seq.num_uncomputed_tokens, kind="prefill")
        if self.reserve_growth:
            out.growth_blocks += self._growth_blocks(seq, n)
        return True

    def _add_prompt_chunk(self, out: SchedulerOutput, owner: KVOwner, n: int, sample: bool, kind: str) -> None:
        # Hashed now, not after the step: a prefix admitted later in this step reuses them.
        self.bm.hash_ahead(owner, n)
        out.add(owner, n, sample=sample, kind=kind)

    def _watermark(self) -> int:
        return self.watermark_blocks if self.num_running > 0 else 0

    def _kept_from_new_groups(self, group: GroupState, out: SchedulerOutput) -> int:
        """Blocks a new group's prefix must leave free (BatchLLM's KV threshold, Sec. 3.3.3):
        what the running requests are expected to decode into and what one member of the new
        group needs to run. A prefix is the costly thing to lose: admitted without that room,
        its members get preempted by older work as it grows, then the prefix with them (no
        member left), and it is computed again (peer_bench two_level, small cache: 748 tokens
        recomputed). Older groups' members need no share: when a new group is admitted, every
        older prefix completes by this step (a prefix chunk that stops short uses up the token
        budget, which ends admission) and its members start in the step that completes it."""
        if not self.reserve_growth:
            return 0
        first_member = self._growth_blocks(group.pending[0]) if group.pending else 0
        return out.growth_blocks + first_member

    def _growth_blocks(self, seq: Sequence, scheduled: int = 0) -> int:
        """Blocks `seq` is expected to add beyond those it holds (with `scheduled` more own
        tokens allocated this step; all of them for a member not started): the rest of its
        prompt and its remaining max_tokens scaled by the fraction of max_tokens that finished
        requests used."""
        expected = self.output_fraction.expected_length(
            len(seq.token_ids), seq.num_prompt_tokens, seq.params.max_tokens, self.max_model_len
        )
        held = max(len(seq.block_table), self.bm.blocks_for(seq.num_computed_tokens + scheduled))
        return max(0, self.bm.blocks_for(expected - seq.own_start) - held)

    def _below_seq_cap(self) -> bool:
        return self.max_num_seqs is None or self.num_running < self.max_num_seqs

    # ---- preemption (recompute) ---------------------------------------------------------------

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for a running seq's next chunk, preempting younger work if needed.

        Returns False when the seq itself had to be preempted.
        """
        need = self.bm.num_new_blocks(seq, num_tokens)
        while not self.bm.can_allocate(need):
            out.blocked = True  # a step that preempts starts nothing new
            victim = self._victim_younger_than(seq, out)
            if victim is None:
                self._preempt_seq(seq)
                out.num_preemptions += 1
                return False
            if isinstance(victim, GroupState):
                self._preempt_group(victim)
            else:
                self._preempt_seq(victim)
                out.num_preemptions += 1
        self.bm.allocate(seq, num_tokens)
        return True

    def _victim_younger_than(self, seq: Sequence, out: SchedulerOutput) -> Sequence | GroupState | None:
        """The most recently admitted group's youngest unscheduled member, or an idle group."""
        for group in reversed(self.active):
            members = [s for s in reversed(group.running) if s.seq_id not in out.scheduled]
            if group is seq.group:
                younger = [s for s in members if s.admit_order > seq.admit_order]
                return younger[0] if younger else None
            if members:
                return members[0]
            if not group.running and group.prefix is not None and group.prefix.seq_id not in out.scheduled:
                return group
        return None

    def _idle_group_victim(self, starting: GroupState, out: SchedulerOutput) -> GroupState | None:
        """A younger active group that runs no member: its prefix blocks are only waiting."""
        for group in reversed(self.active):
            if group is starting:
                return None
            prefix = group.prefix
            if not group.running and prefix is not None and prefix.block_table and prefix.seq_id not in out.scheduled:
                return group
        return None

    def _preempt_seq(self, seq: Sequence) -> None:
        group = seq.group
        assert group is not None, "a running request belongs to a group"
        self.bm.free(seq)
        seq.status = SeqStatus.WAITING
        self.num_running -= 1
        self.num_preemptions += 1
        group.running.remove(seq)
        # Restart before never-started members, after older preempted ones (admission order).
        i = 0
        while i < len(group.pending) and 0 <= group.pending[i].admit_order < seq.admit_order:
            i += 1
        group.pending.insert(i, seq)
        if not group.running:
            self._preempt_group(group)

    def _preempt_group(self, group: GroupState) -> None:
        """No member holds the prefix any more: free it and requeue the group in front."""
        assert not group.running
        if group.prefix is not None:
            self.bm.free(group.prefix)
        group.active = False
        self.active.remove(group)
        self.waiting.appendleft(group)

    # ---- after the step -----------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: tuple[SampledToken, ...]) -> list[tuple[Sequence, SampledToken]]:
        """Commit the computed KV and append sampled tokens; returns (seq, token) pairs."""
        by_id = {s.seq_id: s for s in sampled}
        results: list[tuple[Sequence, SampledToken]] = []
        for c in out.chunks:
            self._count_prompt_work(c)
            self.bm.commit(c.owner, c.start + c.num_tokens)
            if c.sample:
                assert isinstance(c.owner, Sequence), "only requests sample (a prefix chunk does not)"
                token = by_id[c.owner.seq_id]
                c.owner.token_ids.append(token.token_id)
                results.append((c.owner, token))
        self.bm.commit_ahead()
        return results

    def _count_prompt_work(self, c: ScheduledChunk) -> None:
        owner = c.owner
        if c.kind == "decode":
            return
        num_prompt = owner.num_own_tokens
        if isinstance(owner, Sequence):
            num_prompt = owner.num_prompt_tokens - owner.own_start
        end = min(c.start + c.num_tokens, num_prompt)
        first = max(0, end - max(c.start, owner.prompt_high_water))
        owner.prompt_high_water = max(owner.prompt_high_water, end)
        self.num_computed_prompt_tokens += first
        self.num_recomputed_tokens += c.num_tokens - first

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished request (a run was abandoned or failed); returns them."""
        dropped = []
        for group in list(self.active) + list(self.waiting):
            for seq in list(group.running):
                self.bm.free(seq)
                self.num_running -= 1
            if group.prefix is not None and group.prefix.block_table:
                self.bm.free(group.prefix)
            dropped += group.running + group.pending
            group.running, group.pending, group.active = [], [], False
        self.active.clear()
        self.waiting.clear()
        assert self.num_running == 0
        return dropped

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request: free its blocks, and its group's prefix if it was the last member."""
        group = seq.group
        assert group is not None, "a running request belongs to a group"
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.output_fraction.add_finished(
            seq.num_output_tokens, seq.num_prompt_tokens, seq.params.max_tokens, self.max_model_len
        )
        self.num_running -= 1
        group.running.remove(seq)
        if group.is_done:
            if group.prefix is not None:
                self.bm.free(group.prefix)
            group.active = False
            self.active.remove(group)


def aligned_batcher(config: EngineConfig, block_size: int) -> DensityFirstBatcher | None:
    """AlignedServe's batcher for decode steps of exactly N requests (aligned_decode_batch).

    Its memory threshold never binds: running requests keep their KV in the cache whether or
    not they decode this step (the cache is the KV pool of AlignedServe Sec. 3.2), so what
    limits a batch is N. Without N no batch is ever chosen: as long as every ready request
    decodes first in each step, the ready ones cannot outnumber the token budget (each became
    ready by a prefill token of the step before, next to the decodes of that step).
    """
    if config.aligned_decode_batch is None:
        return None
    n = min(config.aligned_decode_batch, config.max_num_batched_tokens)
    return DensityFirstBatcher(
        max_blocks=np.iinfo(np.int64).max // 2,
        min_requests=n,
        max_requests=n,
        block_size=block_size,
        max_len=config.max_model_len or 65536,
        starvation_s=ALIGNED_STARVATION_STEPS,
    )
