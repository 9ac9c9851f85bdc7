"""Scheduler and engine loop with a fake model runner (no torch, no model).

The fake runner keeps a paged "KV cache" of (position, token) pairs in the block ids the
scheduler hands it, and samples token f(context) where the context is read back from those
blocks (shared prefix blocks + the chunk's own blocks). A scheduling or block-table bug
(a block freed while in use, a prefix read before it is complete, a wrong position) changes
the context and so the tokens, which are compared with f applied to the plain prompt.
"""

from __future__ import annotations

import gc
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.native.llm_engine import LLMEngine
from prefixflow.engine.intake import OutputFraction
from prefixflow.engine.native.scheduler import SchedulerOutput
from prefixflow.engine.native.sequence import SeqStatus
from prefixflow.engine.native.step import SampledToken, StepInput, StepOutput
from prefixflow.requests import PrefixGroup, SamplingParams

VOCAB = 97
EOS = 1


def next_token(context: list[int]) -> int:
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % VOCAB


class FakeRunner:
    """Implements the ModelRunner interface over a fake paged cache."""

    tokenizer = None
    eos_token_ids = (EOS,)
    vocab_size = VOCAB

    def __init__(self, num_kv_blocks: int, block_size: int = 4, max_model_len: int = 4096) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv: dict[int, list] = {}
        self.steps: list[StepInput] = []

    def _read(self, table: tuple[int, ...], n: int, first_pos: int) -> list[int]:
        bs = self.block_size
        assert len(table) * bs >= n, "block table too short"
        out = []
        for j in range(n):
            slot = self.kv.get(table[j // bs], [None] * bs)[j % bs]
            assert slot is not None and slot[0] == first_pos + j, f"KV slot {j} missing or misplaced: {slot}"
            out.append(slot[1])
        return out

    def execute(self, step: StepInput) -> StepOutput:
        self.steps.append(step)
        bs = self.block_size
        for copy in step.copies:  # before any chunk runs (engine/native/step.py)
            src = self.kv.get(copy.src, [None] * bs)[: copy.num_tokens]
            assert None not in src, "a copy of K/V slots never written"
            self.kv.setdefault(copy.dst, [None] * bs)[: copy.num_tokens] = src
        written: dict[int, int] = {}
        for c in step.chunks:
            plen = step.prefixes[c.prefix_index].length if c.prefix_index >= 0 else 0
            assert c.start_pos == plen + c.num_cached_tokens
            assert len(c.block_table) * bs >= c.num_cached_tokens + len(c.token_ids)
            for i, t in enumerate(c.token_ids):
                j = c.num_cached_tokens + i
                block = c.block_table[j // bs]
                assert 0 <= block < self.num_kv_blocks
                assert written.setdefault(block, c.seq_id) == c.seq_id, "two chunks wrote one block"
                # Only a prefix's own computation writes its blocks (members never do).
                assert c.prefix_index < 0 or all(block not in p.block_table for p in step.prefixes), (
                    "a member wrote a shared block"
                )
                self.kv.setdefault(block, [None] * bs)[j % bs] = (c.start_pos + i, t)
        # Shared prefixes are complete once the step's K/V are written (engine/native/step.py).
        prefix_ctx = [self._read(p.block_table, p.length, 0) for p in step.prefixes]
        sampled = []
        for c in step.chunks:
            if not c.sample:
                continue
            assert c.sampling_params is not None
            ctx = []
            if c.prefix_index >= 0:
                ctx = self._read(step.prefixes[c.prefix_index].block_table, step.prefixes[c.prefix_index].length, 0)
                assert ctx == prefix_ctx[c.prefix_index], "a shared prefix changed during the step"
            n = c.num_cached_tokens + len(c.token_ids)
            ctx = ctx + self._read(c.block_table, n, c.start_pos - c.num_cached_tokens)
            sampled.append(SampledToken(c.seq_id, next_token(ctx), -0.5, ((next_token(ctx), -0.5),)))
        return StepOutput(tuple(sampled))


def reference(prompt: list[int], p: SamplingParams, max_model_len: int = 4096) -> tuple[list[int], str]:
    out: list[int] = []
    while True:
        t = next_token(prompt + out)
        out.append(t)
        if len(out) >= p.min_tokens and ((t == EOS and not p.ignore_eos) or t in p.stop_token_ids):
            return out, "stop"
        if len(out) >= p.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, "length"


def make_group(gid: int, prefix: list[int], distinct: list[list[int]], row0: int) -> PrefixGroup:
    return PrefixGroup(
        group_id=gid,
        prefix=np.array(prefix, dtype=np.int64),
        row_ids=np.arange(row0, row0 + len(distinct), dtype=np.int64),
        distinct=tuple(np.array(d, dtype=np.int64) for d in distinct),
    )


def random_workload(
    rng: random.Random, num_groups: int, max_prefix: int = 40, max_distinct: int = 20, max_members: int = 5
) -> list[PrefixGroup]:
    groups, row = [], 0
    for g in range(num_groups):
        members = rng.randint(1, max_members)
        prefix = [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, max_prefix))] if members > 1 else []
        distinct = [
            [rng.randrange(2, VOCAB) for _ in range(rng.randint(0 if prefix else 1, max_distinct))]
            for _ in range(members)
        ]
        groups.append(make_group(g, prefix, distinct, row))
        row += members
    return groups


def make_engine(num_blocks: int, block_size: int = 4, **cfg) -> LLMEngine:
    config = EngineConfig(model="fake", block_size=block_size, **cfg)
    return LLMEngine(config, model_runner=FakeRunner(num_blocks, block_size))


def check_block_accounting(engine: LLMEngine) -> None:
    """Every block's ref count equals the live tables holding it; free list = unreferenced."""
    bm, sched = engine.block_manager, engine.scheduler
    refs = [0] * bm.num_blocks
    for group in sched.active:
        owners = list(group.running) + ([group.prefix] if group.prefix else [])
        for owner in owners:
            for b in owner.block_table:
                refs[b] += 1
        for seq in group.pending:
            assert not seq.block_table
    for group in sched.waiting:  # requeued or not yet admitted: holds nothing
        assert not group.running and (group.prefix is None or not group.prefix.block_table)
    assert refs == [b.ref_count for b in bm.blocks]
    assert set(bm.free_ids) == {i for i, r in enumerate(refs) if r == 0}


def instrumented_run(engine: LLMEngine, groups, params, kinds_log: list | None = None) -> dict[int, object]:
    """engine.run with per-step checks of the queue order, the limits and the accounting."""
    sched = engine.scheduler
    original = sched.schedule
    cap = engine.config.aligned_decode_batch or engine.config.max_num_batched_tokens

    def checked_schedule() -> SchedulerOutput:
        decoding = [s for g in sched.active for s in g.running if s.is_decoding]
        partial = [s for g in sched.active if g.prefix_ready for s in g.running if not s.is_decoding]
        out = original()
        assert out.num_tokens() <= engine.config.max_num_batched_tokens
        assert engine.block_manager.num_used_blocks <= engine.block_manager.num_blocks
        kinds = {c.kind for c in out.chunks}
        scheduled_or_preempted = lambda s: s.seq_id in out.scheduled or s.status is SeqStatus.WAITING  # noqa: E731
        if kinds & {"prefill", "prefix"}:  # decode queue first (BatchLLM Sec. 3.3.1), up to the cap
            assert sum(map(scheduled_or_preempted, decoding)) >= min(len(decoding), cap)
        if "prefix" in kinds:  # distinct queue before common prefix queue
            assert all(scheduled_or_preempted(s) for s in partial)
        check_block_accounting(engine)
        if kinds_log is not None:
            kinds_log.append([c.kind for c in out.chunks])
        return out

    sched.schedule = checked_schedule
    try:
        outs = {o.row_id: o for o in engine.run(groups, params)}
    finally:
        sched.schedule = original
    assert not sched.active and not sched.waiting
    assert engine.block_manager.num_used_blocks == 0
    return outs


def assert_matches_reference(outs, groups, params: SamplingParams) -> None:
    for g in groups:
        for i, row in enumerate(g.row_ids):
            tokens, reason = reference(g.prompt(i).tolist(), params)
            assert outs[int(row)].error is None
            assert list(outs[int(row)].token_ids) == tokens, f"row {row}"
            assert outs[int(row)].finish_reason == reason


# ---- tests ------------------------------------------------------------------------------------


def test_scheduler_and_block_manager_import_without_torch():
    code = (
        "import sys; import prefixflow.engine.native.scheduler, prefixflow.engine.native.block_manager, "
        "prefixflow.engine.outputs; import prefixflow.engine; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'transformers')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_requests_finish_with_reference_tokens():
    groups = random_workload(random.Random(0), 12)
    params = SamplingParams(temperature=0, max_tokens=12)
    engine = make_engine(num_blocks=400, max_num_batched_tokens=64)
    outs = instrumented_run(engine, groups, params)
    assert_matches_reference(outs, groups, params)
    totals = engine.totals
    assert totals.num_requests == sum(g.num_members for g in groups)
    assert totals.num_preemptions == 0
    # Each prefix computed once, then distinct parts (a member equal to the prefix computes
    # the prefix's last token itself); the block cache may save more.
    most = sum(g.computed_tokens() + sum(len(d) == 0 for d in g.distinct) for g in groups)
    assert totals.num_computed_prompt_tokens <= most
    assert totals.token_saving_ratio > 0


def test_tiny_kv_budget_preempts_and_gives_the_same_tokens():
    groups = random_workload(random.Random(1), 10)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = instrumented_run(make_engine(num_blocks=1000, max_num_batched_tokens=32), groups, params)
    engine = make_engine(num_blocks=30, max_num_batched_tokens=32)
    tight = instrumented_run(engine, groups, params)
    assert engine.totals.num_preemptions > 0
    assert engine.totals.num_recomputed_tokens > 0
    assert {r: o.token_ids for r, o in tight.items()} == {r: o.token_ids for r, o in roomy.items()}
    assert_matches_reference(tight, groups, params)
    assert max(s.num_used_blocks for s in engine.stats) <= 30


def test_a_new_group_waits_for_room_to_run_and_its_prefix_is_computed_once():
    # Four groups: prefix 24 tokens (6 blocks of 4), 4 members of 4 tokens, 16 output tokens:
    # one group holds 6 + 4 * 5 = 26 blocks at the end. In 40 blocks the next group's prefix
    # fits next to a running group, but admitted before there is room for its members to run
    # (the prefix alone fitted at first), older members' growth preempts them and then the
    # prefix with them, which is computed again.
    rng = random.Random(3)
    groups = [
        make_group(
            g,
            [rng.randrange(2, VOCAB) for _ in range(24)],
            [[rng.randrange(2, VOCAB) for _ in range(4)] for _ in range(4)],
            4 * g,
        )
        for g in range(4)
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = make_engine(num_blocks=40, max_num_batched_tokens=64)
    log: list = []
    outs = instrumented_run(engine, groups, params, log)
    assert_matches_reference(outs, groups, params)
    assert sum(s.num_prefix_tokens for s in engine.stats) == 4 * 24  # each prefix once
    # Not one group at a time: a group's prefix was computed while another group decoded.
    assert any("prefix" in kinds and "decode" in kinds for kinds in log)
    assert max(s.num_used_blocks for s in engine.stats) <= 40


def test_members_start_in_the_step_that_completes_their_prefix():
    # The prefix (12 tokens) and all three members fit one 64-token step: the members attend
    # the prefix K/V written earlier in the same step, as vLLM's same-step prefix-cache hits do.
    groups = [
        make_group(0, list(range(10, 22)), [[40, 41], [42], [43, 44, 45]], 0),
        make_group(1, list(range(2, 50)), [[3], [4]], 3),
    ]  # 18 + 48: past the budget
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = make_engine(num_blocks=100, max_num_batched_tokens=64)
    outs = instrumented_run(engine, groups, params)
    assert_matches_reference(outs, groups, params)
    first = engine.runner.steps[0]
    assert [c.prefix_index for c in first.chunks] == [-1, 0, 0, 0, -1]  # group 1's prefix: a chunk
    assert first.prefixes[0].length == 12 and sum(len(c.token_ids) for c in first.chunks) == 64
    second = engine.runner.steps[1]  # group 1's prefix ends: its members start next to the decodes
    assert sorted(c.prefix_index for c in second.chunks) == [-1, 0, 0, 0, 1, 1]


def test_members_that_copy_their_prefixs_last_block_start_once_it_is_computed():
    # A 10-token prefix ends inside its third block: the K/V its members copy from that block
    # exist only after the step that computes them, so the members start in the next step.
    g = make_group(0, list(range(2, 12)), [[40, 41], [42]], 0)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine = make_engine(num_blocks=100, max_num_batched_tokens=64)
    outs = instrumented_run(engine, [g], params)
    assert_matches_reference(outs, [g], params)
    first, second = engine.runner.steps[:2]
    assert [len(c.token_ids) for c in first.chunks] == [10] and not first.copies
    assert [c.num_tokens for c in second.copies] == [2, 2]
    assert [c.token_ids for c in second.chunks] == [(40, 41), (42,)]
    assert [p.length for p in second.prefixes] == [8]  # the whole blocks, attended in place


def test_the_expected_output_share_comes_from_finished_requests():
    share = OutputFraction()
    assert (share.numerator, share.denominator) == (1, 1)  # nothing finished: all of max_tokens
    share.add(4, 16)
    share.add(20, 16)  # capped at max_tokens
    assert (share.numerator, share.denominator) == (20, 32)


def test_group_prefix_blocks_freed_exactly_when_last_member_finishes():
    prefix = list(range(10, 30))  # 20 tokens = 5 blocks of 4
    group = make_group(0, prefix, [[40, 41], [42], [43, 44, 45]], row0=0)
    lens = {0: 3, 1: 9, 2: 5}
    params = {r: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for r, n in lens.items()}
    engine = make_engine(num_blocks=100)
    ((state, errors),) = list(engine._make_groups([group], params))
    assert not errors and state.prefix is not None
    engine.scheduler.add_group(state)
    prefix_owner, prefix_blocks, finished = state.prefix, None, []
    while engine.scheduler.has_unfinished():
        finished += [o.row_id for o in engine.step()]
        if prefix_owner.is_complete and prefix_blocks is None:
            prefix_blocks = list(prefix_owner.block_table)
            assert len(prefix_blocks) == 5
        if prefix_blocks is not None:
            refs = [engine.block_manager.blocks[b].ref_count for b in prefix_blocks]
            if len(finished) < 3:
                assert refs == [1] * 5, "prefix freed before the group's last member finished"
            else:
                assert refs == [0] * 5 and not prefix_owner.block_table
    assert finished == [0, 2, 1]
    # Members attended the shared prefix: no member computed prefix tokens itself.
    member_chunks = [c for s in engine.runner.steps for c in s.chunks if c.prefix_index >= 0]
    assert member_chunks and all(c.start_pos >= 20 for c in member_chunks)


def test_queue_order_decode_then_distinct_then_prefix():
    # Group 0 (prefix 8) runs first; group 1's long prefix must wait for leftover budget.
    g0 = make_group(0, list(range(2, 10)), [[50, 51, 52], [53, 54, 55, 56, 57, 58, 59, 60, 61, 62]], 0)
    g1 = make_group(1, list(range(60, 90)), [[3], [4]], 2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = make_engine(num_blocks=200, max_num_batched_tokens=8)
    kinds_per_step: list[list[str]] = []
    outs = instrumented_run(engine, [g0, g1], params, kinds_per_step)
    assert_matches_reference(outs, [g0, g1], params)
    # Step 0: group 0's prefix (8 tokens) fills the budget. Step 1: its members' distinct parts.
    assert kinds_per_step[0] == ["prefix"]
    assert kinds_per_step[1][0] == "prefill"
    # Whenever a prefix chunk shares a step with decodes, the decodes come first in the batch.
    for kinds in kinds_per_step:
        if "decode" in kinds and "prefix" in kinds:
            assert kinds.index("decode") < kinds.index("prefix")


def test_vllm_policy_caps_running_requests_and_uses_arrival_order():
    rng = random.Random(3)
    rows = list(range(300))
    rng.shuffle(rows)
    prompts = {r: [2 + r % 90, 2 + r // 90, 3] for r in rows}
    groups = [
        PrefixGroup(
            group_id=i, prefix=np.zeros(0, dtype=np.int64), row_ids=np.array([r]), distinct=(np.array(prompts[r]),)
        )
        for i, r in enumerate(rows)
    ]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = make_engine(num_blocks=4000, policy="vllm", max_num_batched_tokens=2048)
    outs = instrumented_run(engine, groups, params)
    assert len(outs) == 300
    assert max(s.num_running_seqs for s in engine.stats) == 256
    # The first step starts requests in row (arrival) order: rows 0..255.
    row_of = {tuple(p): r for r, p in prompts.items()}
    first = engine.runner.steps[0]
    assert [row_of[c.token_ids] for c in first.chunks] == list(range(256))
    batchllm = make_engine(num_blocks=4000, max_num_batched_tokens=2048)
    instrumented_run(batchllm, groups, params)
    assert max(s.num_running_seqs for s in batchllm.stats) == 300  # no request cap


def test_vllm_policy_shares_only_through_the_block_cache():
    g = make_group(0, list(range(2, 34)), [[40, 41], [42, 43], [44]], 0)  # prefix 32 = 8 blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = make_engine(num_blocks=200, policy="vllm", max_num_batched_tokens=128)
    outs = instrumented_run(engine, [g], params)
    assert_matches_reference(outs, [g], params)
    # Admitted in the same step, the later two find the first one's 8 prompt blocks: they are
    # hashed when scheduled (as vLLM does), and written before any attention reads them.
    assert engine.totals.num_computed_prompt_tokens == 34 + 2 + 1
    again = instrumented_run(engine, [g], params)
    assert all(again[r].num_cached_tokens == 32 for r in range(3))
    assert engine.totals.num_computed_prompt_tokens == 2 + 2 + 1


def test_prefix_cache_reuses_blocks_across_runs_and_groups():
    g = make_group(0, list(range(2, 22)), [[40, 41, 42, 43, 44, 45, 46, 47, 48], [42]], 0)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine = make_engine(num_blocks=200)
    first = instrumented_run(engine, [g], params)
    computed_first = engine.totals.num_computed_prompt_tokens
    assert computed_first == 20 + 9 + 1
    # The member that started first carries the prefix's computation; the other found it
    # computed: the requests' cached counts add up to the engine's (as vLLM's do).
    assert sorted(o.num_cached_tokens for o in first.values()) == [0, 20]
    assert sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in first.values()) == computed_first
    second = instrumented_run(engine, [g], params)
    assert engine.totals.num_computed_prompt_tokens < computed_first
    assert second[0].num_cached_tokens >= 20 + 8
    assert {r: o.token_ids for r, o in first.items()} == {r: o.token_ids for r, o in second.items()}


def test_members_own_blocks_line_up_with_the_prompt_so_a_later_prompt_finds_them():
    # A prefix of 10 tokens (2 whole blocks of 4 and 2 more): each member attends the 2 whole
    # blocks and copies the other 2 tokens' K/V into its first own block, which then lines up
    # with the prompt's third block.
    prefix, q1, q2 = list(range(2, 12)), list(range(40, 49)), [50, 51, 52]
    g = make_group(0, prefix, [q1, q2], 0)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = make_engine(num_blocks=200)
    first = instrumented_run(engine, [g], params)
    assert_matches_reference(first, [g], params)
    copies = [c for step in engine.runner.steps for c in step.copies]
    assert [c.num_tokens for c in copies] == [2, 2]
    assert engine.totals.num_computed_prompt_tokens == 10 + 9 + 3  # copied tokens are not computed
    assert sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in first.values()) == 10 + 9 + 3
    assert first[1].prefix_len == 10
    # A prompt run alone later finds row 0's member blocks, not only the prefix's 2 whole ones:
    # 16 tokens (2 of the prefix, then the tail and q1 in row 0's own blocks).
    later = make_group(1, [], [prefix + q1 + [60, 61, 62]], 2)
    again = instrumented_run(engine, [later], params)
    assert again[2].num_cached_tokens == 16
    assert_matches_reference(again, [later], params)


def test_member_equal_to_prefix_and_errors_do_not_stop_the_run():
    prefix = [5, 6, 7, 8, 9]
    groups = [
        make_group(0, prefix, [[], [11, 12]], 0),
        make_group(1, [], [list(range(2, 80))], 2),
        make_group(2, [], [[3, 4]], 3),
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model="fake", block_size=4), model_runner=FakeRunner(200, 4, max_model_len=64))
    outs = {o.row_id: o for o in engine.run(groups, params)}
    assert outs[2].error is not None and "max_model_len" in outs[2].error and outs[2].finish_reason == "abort"
    assert outs[0].prefix_len == 4 and outs[1].prefix_len == 5
    for row, prompt in ((0, prefix), (1, prefix + [11, 12]), (3, [3, 4])):
        assert list(outs[row].token_ids) == reference(prompt, params)[0]


def test_finish_rules_eos_stop_ids_min_tokens_max_model_len():
    prompt = [7, 8, 9]
    free, _ = reference(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stop_id = free[5]
    first = free.index(stop_id)
    groups = [make_group(i, [], [prompt], i) for i in range(4)]
    params = {
        0: SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=(stop_id,)),
        1: SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=first + 2
        ),
        2: SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
        3: SamplingParams(temperature=0, max_tokens=2),
    }
    engine = LLMEngine(EngineConfig(model="fake", block_size=4), model_runner=FakeRunner(200, 4, max_model_len=20))
    outs = {o.row_id: o for o in engine.run(groups, params)}
    assert list(outs[0].token_ids) == free[: first + 1] and outs[0].finish_reason == "stop"
    later = free.index(stop_id, first + 1) if stop_id in free[first + 1 : 17] else None
    if later is not None:
        assert list(outs[1].token_ids) == free[: later + 1]
    else:
        assert len(outs[1].token_ids) == 17 and outs[1].finish_reason == "length"
    assert len(outs[2].token_ids) == 17 and outs[2].finish_reason == "length"  # 3 + 17 = max_model_len
    assert len(outs[2].logprobs) == 17 and outs[2].logprobs[0].top[0][0] == free[0]
    assert outs[0].logprobs is None
    assert len(outs[3].token_ids) <= 2


def test_stats_record_every_step():
    groups = random_workload(random.Random(5), 6)
    engine = make_engine(num_blocks=300, max_num_batched_tokens=16)
    instrumented_run(engine, groups, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [s.step for s in engine.stats] == list(range(len(engine.stats)))
    for s in engine.stats:
        assert s.num_tokens == s.num_prefill_tokens + s.num_decode_tokens + s.num_prefix_tokens <= 16
        assert s.num_total_blocks == 300
    assert engine.totals.num_output_tokens == 8 * sum(g.num_members for g in groups)
    assert engine.totals.num_steps == len(engine.stats)


def test_params_mapping_must_cover_every_row():
    engine = make_engine(num_blocks=50)
    with pytest.raises(ValueError, match="row_id=1"):
        list(engine.run([make_group(0, [], [[3]], 1)], {0: SamplingParams()}))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(24, 120),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_tokens=st.integers(1, 12),
    token_limit=st.integers(4, 48),
    policy=st.sampled_from(["batchllm", "vllm"]),
    cache=st.booleans(),
    aligned=st.sampled_from([None, None, 1, 3]),
)
def test_random_workloads_finish_with_reference_tokens(
    seed, num_blocks, block_size, max_tokens, token_limit, policy, cache, aligned
):
    rng = random.Random(seed)
    groups = random_workload(rng, rng.randint(1, 6), max_prefix=24, max_distinct=12, max_members=4)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
    engine = LLMEngine(
        EngineConfig(
            model="fake",
            block_size=block_size,
            max_num_batched_tokens=token_limit,
            policy=policy,
            enable_prefix_cache=cache,
            aligned_decode_batch=aligned,
        ),
        model_runner=FakeRunner(num_blocks * 4 // block_size, block_size),
    )
    outs = instrumented_run(engine, groups, params)
    assert_matches_reference(outs, groups, params)


def test_an_abandoned_run_frees_everything_and_the_next_run_works():
    groups = random_workload(random.Random(7), 5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = make_engine(num_blocks=300, max_num_batched_tokens=16)
    stream = engine.run(groups, params)
    next(stream)
    stream.close()
    assert not engine.scheduler.has_unfinished() and engine.scheduler.num_running == 0
    assert engine.block_manager.num_used_blocks == 0
    outs = instrumented_run(engine, groups, params)
    assert_matches_reference(outs, groups, params)


def test_a_run_freezes_the_collector_only_while_it_runs_and_only_if_nothing_else_did():
    groups = random_workload(random.Random(8), 3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = make_engine(num_blocks=300)
    assert gc.get_freeze_count() == 0
    stream = engine.run(groups, params)
    next(stream)
    assert gc.get_freeze_count() > 0  # the objects alive before the run
    list(stream)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the application's own freeze is left alone
    try:
        list(engine.run(groups, params))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def aligned_workload(num: int = 24) -> list[PrefixGroup]:
    """Single requests whose prompt lengths alternate between two far apart clusters in plan
    order (4-8 and 80-88 tokens: KV lengths up to 16 and 97), so that plan order mixes them."""
    rng = random.Random(3)
    lens = [rng.randint(4, 8) if i % 2 == 0 else rng.randint(80, 88) for i in range(num)]
    return [make_group(i, [], [[rng.randrange(2, VOCAB) for _ in range(n)]], i) for i, n in enumerate(lens)]


def decode_plans(engine: LLMEngine, groups, params) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """engine.run, recording per step (KV lengths of the requests ready to decode, of its decodes)."""
    sched, plans = engine.scheduler, []
    original = sched.schedule

    def recording_schedule() -> SchedulerOutput:
        ready = [len(s.token_ids) for g in sched.active for s in g.running if s.is_decoding]
        out = original()
        plans.append((ready, [len(c.owner.token_ids) for c in out.chunks if c.kind == "decode"]))
        return out

    sched.schedule = recording_schedule
    try:
        outs = {o.row_id: o for o in engine.run(groups, params)}
    finally:
        sched.schedule = original
    return plans, outs


def test_aligned_decode_batches_hold_similar_kv_lengths_and_keep_the_tokens():
    groups, params = aligned_workload(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plans = {}
    for n in (None, 4):
        engine = make_engine(num_blocks=400, max_num_batched_tokens=64, aligned_decode_batch=n)
        plans[n], outs = decode_plans(engine, groups, params)
        assert_matches_reference(outs, groups, params)
    short = lambda lens: sum(k < 40 for k in lens)  # noqa: E731
    # Off: every ready request decodes in every step, short and long ones together.
    assert all(len(lens) == len(ready) for ready, lens in plans[None])
    assert any(0 < short(lens) < len(lens) for _, lens in plans[None])
    # On: with more than 4 ready, 4 decode, all of one cluster whenever one has 4 ready.
    chosen = [(ready, lens) for ready, lens in plans[4] if len(ready) > 4]
    assert len(chosen) >= 8
    for ready, lens in chosen:
        assert len(lens) == 4
        if short(ready) >= 4 or len(ready) - short(ready) >= 4:
            assert short(lens) in (0, 4), (ready, lens)
    assert all(sorted(lens) == sorted(ready) for ready, lens in plans[4] if len(ready) <= 4)


def test_aligned_decode_step_is_never_empty_when_its_pick_preempts_itself():
    # A full cache, a cap of 1: the request Density First Search picks needs a block, finds
    # none and nothing younger to preempt, so it preempts itself; another ready request must
    # decode in its place (this step used to come out empty: "made no progress").
    rng = random.Random(52)
    block_size, num_blocks = rng.choice([1, 2, 4, 8]), rng.randint(24, 120)
    groups = random_workload(rng, rng.randint(1, 8), max_prefix=24, max_distinct=12, max_members=5)
    params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)
    assert (block_size, num_blocks) == (4, 30)
    engine = LLMEngine(
        EngineConfig(
            model="fake",
            block_size=4,
            max_num_batched_tokens=8,
            policy="vllm",
            enable_prefix_cache=False,
            aligned_decode_batch=1,
        ),
        model_runner=FakeRunner(30, 4),
    )
    outs = instrumented_run(engine, groups, params)
    assert_matches_reference(outs, groups, params)
    assert engine.totals.num_preemptions > 0


def test_groups_are_taken_lazily_as_the_scheduler_has_room():
    """The engine takes a group only when the work waiting to start is short (engine/intake.py):
    the groups not taken yet stay the caller's to hand to another replica (work stealing)."""
    rng = random.Random(11)
    groups = random_workload(rng, 60, max_members=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = make_engine(num_blocks=400, max_num_batched_tokens=64)
    taken_at: list[int] = []  # engine steps done when each group was taken

    def source():
        for g in groups:
            taken_at.append(len(engine.stats))
            yield g

    outs = {o.row_id: o for o in engine.run(source(), params)}
    assert_matches_reference(outs, groups, params)
    assert taken_at.count(0) < len(groups) // 2 and len(set(taken_at)) > 5  # taken over many steps


def test_not_ready_means_ask_again_later():
    """NOT_READY (None) from the source: the engine runs what it has and asks again; with
    nothing to run it waits, and it ends only when the source does."""
    from prefixflow.engine.intake import NOT_READY

    rng = random.Random(12)
    groups = random_workload(rng, 6)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine = make_engine(num_blocks=400)

    def source():
        yield NOT_READY  # nothing at first: the engine waits
        yield from groups[:3]
        for _ in range(30):
            yield NOT_READY  # the first groups run meanwhile
        yield from groups[3:]

    outs = list(engine.run(source(), params))
    assert_matches_reference(outs, groups, params)
