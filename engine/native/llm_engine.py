"""LLMEngine: one replica's step loop: schedule -> run the model -> update -> emit finished.

`run(groups, params)` takes the planner's PrefixGroups (BatchLLM Sec. 3.2 / 3.3.2 order) and
streams RequestOutputs as requests finish; `generate(prompts, params)` plans internally and
returns outputs in input order.
"""

from __future__ import annotations

import enum
import gc
import itertools
import time
from dataclasses import replace
from collections.abc import Generator, Iterable, Iterator, Sequence as Seq
from typing import Any, Final

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.intake import IDLE_POLL_S, NOT_READY, every_group, wants_more
from prefixflow.engine.native.block_manager import BlockManager
from prefixflow.engine.native.finish import append_text, check_finish, finished_output
from prefixflow.engine.native.scheduler import Scheduler
from prefixflow.engine.native.sequence import ROOT_HASH_SEED, GroupState, PrefixSeq, Sequence, chain_hash
from prefixflow.engine.native.step import SampledToken
from prefixflow.engine.outputs import (
    EngineTotals,
    RequestOutput,
    StepStats,
    TokenLogprob,
    error_output,
    greedy_copies,
    with_samples,
)
from prefixflow.pipeline import build_plan
from prefixflow.requests import PrefixGroup, Params, SamplingParams

Member = tuple[int, list[int], list[int], SamplingParams, int]  # row, prefix, distinct, params, sample
Made = tuple[GroupState | None, list[RequestOutput]]  # a group (None: no row can run) and its rows' errors


class _End(enum.Enum):
    END = enum.auto()


_END: Final = _End.END  # the groups' iterator is exhausted


class LLMEngine:
    """One replica's engine. Not thread-safe; one `run` at a time.

    model_runner: anything with the ModelRunner interface (num_kv_blocks, block_size,
        tokenizer, eos_token_ids, max_model_len, vocab_size, execute); None builds the real one.
    The block manager (and so the hashed prefix cache) lives as long as the engine; `stats`
    and `totals` describe the last run.
    """

    def __init__(self, config: EngineConfig, model_runner: Any = None) -> None:
        if model_runner is None:
            from prefixflow.engine.native.model_runner import ModelRunner  # torch only from here

            model_runner = ModelRunner(config)
        self.config = config
        self.runner = model_runner
        self.tokenizer = model_runner.tokenizer
        self.eos_token_ids = tuple(model_runner.eos_token_ids)
        self.vocab_size = model_runner.vocab_size
        self.max_model_len = min(config.max_model_len or model_runner.max_model_len, model_runner.max_model_len)
        self.reset()  # the block manager and the scheduler
        self.stats: list[StepStats] = []
        self.totals: EngineTotals | None = None
        self._ids = itertools.count()
        self._samples: dict[int, list[RequestOutput | None]] = {}  # row -> its n samples so far
        self._copies: dict[int, int] = {}  # greedy row asking n > 1 -> n (run once, copied)
        self._open_groups: dict[tuple[int, int], GroupState] = {}  # (group id, prefix) -> this run's

    # ---- public API ---------------------------------------------------------------------------

    def run(self, groups: Iterable[PrefixGroup | None], params: Params = SamplingParams()) -> Iterator[RequestOutput]:
        """Run planned groups (in plan order); yield each request's output when it finishes.

        groups: taken lazily, as the scheduler has room (engine/intake.py), so that groups
            not taken yet stay the caller's (work stealing); NOT_READY (None) from it means no
            group is ready now: the engine runs what it has and asks again.
        params: one SamplingParams for all, or a mapping row_id -> SamplingParams, read when
            a row's group is taken.
        With policy="vllm" the groups are dissolved: requests run alone in row_id (arrival)
        order and share KV only through the hashed prefix cache.
        """
        self.stats, self._samples, self._copies = [], {}, {}
        sched = self.scheduler
        start = time.perf_counter()
        counts = {
            "requests": 0,
            "prompt": 0,
            "output": 0,
            "computed0": sched.num_computed_prompt_tokens,
            "recomputed0": sched.num_recomputed_tokens,
            "preempt0": sched.num_preemptions,
        }
        made = self._make_groups(groups, params)
        self._open_groups = {}
        exhausted = completed = False
        # Everything alive before the run (modules, weights, the imports of torch and
        # transformers) outlives it: frozen out of the collector, whose passes over them cost
        # 5% of a SmolLM2 decode step's main thread (perf samples), and given back after;
        # left alone where the process froze objects itself (or another run is going on).
        thaw = gc.get_freeze_count() == 0
        if thaw:
            gc.freeze()
        try:
            while True:
                if not exhausted:
                    exhausted = yield from self._take(made, counts)
                if not sched.has_unfinished():
                    if exhausted:
                        break
                    time.sleep(IDLE_POLL_S)  # the source has nothing ready now
                    continue
                for out in self.step():
                    counts["output"] += sum(len(s.token_ids) for s in out.samples) or len(out.token_ids)
                    yield greedy_copies(out, self._copies.pop(out.row_id, 1))
            completed = True
        finally:
            if thaw:
                gc.unfreeze()
            if not completed:  # the caller stopped iterating, or a step raised
                sched.abort_all()
        self.totals = EngineTotals(
            num_requests=counts["requests"],
            num_prompt_tokens=counts["prompt"],
            num_computed_prompt_tokens=sched.num_computed_prompt_tokens - counts["computed0"],
            num_recomputed_tokens=sched.num_recomputed_tokens - counts["recomputed0"],
            num_output_tokens=counts["output"],
            num_steps=len(self.stats),
            num_preemptions=sched.num_preemptions - counts["preempt0"],
            wall_time_s=time.perf_counter() - start,
        )

    def _take(self, made: Iterator[Made | None], counts: dict[str, int]) -> Generator[RequestOutput, None, bool]:
        """Add groups from `made` while the scheduler wants more (engine/intake.py; all of
        them under policy "vllm": vLLM's queue holds every request it is given), yielding the
        error outputs of rows that cannot run; returns whether `made` is exhausted."""
        sched = self.scheduler
        while self.config.policy == "vllm" or wants_more(
            *sched.pending_work(), sched.num_running, self.config.max_num_batched_tokens, sched.max_num_seqs
        ):
            item = next(made, _END)
            if item is _END or item is NOT_READY:
                return item is _END
            group, errors = item
            counts["requests"] += len(errors) + (len({s.row_id for s in group.pending}) if group else 0)
            yield from errors
            if group is not None:
                counts["prompt"] += sum(s.num_prompt_tokens for s in group.pending)
                self._add_or_join(group)
        return False

    def _add_or_join(self, group: GroupState) -> None:
        """Queue a group; or, when it is the next piece of a run whose group is still queued or
        running here (the plan cut a large group into units, operators/stages/work_queue.py), add its
        members to that group: they attend to the prefix already computed, as one group."""
        key = (group.group_id, len(group.prefix.token_ids) if group.prefix else 0)
        open_group = self._open_groups.get(key)
        if (
            open_group is not None
            and not open_group.is_done
            and group.prefix is not None
            and open_group.prefix is not None
            and open_group.prefix.token_ids == group.prefix.token_ids
        ):
            for seq in group.pending:
                seq.group = open_group
            open_group.pending.extend(group.pending)
            return
        self._open_groups[key] = group
        self.scheduler.add_group(group)

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] = SamplingParams(),
        *,
        add_special_tokens: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs in input order.

        prompts: token-id lists, or strings. Strings are encoded with the model's tokenizer as
            `tokenizer(text, add_special_tokens=add_special_tokens)`, i.e. with the BOS token
            its post-processor adds, as Hugging Face and vLLM do by default. A string that
            already holds a chat template's BOS needs add_special_tokens=False, or it gets two.
            Chat templates are not applied here.
        params: one SamplingParams for all prompts, or one per prompt.
        """
        token_lists = [self._encode(p, add_special_tokens) for p in prompts]
        if isinstance(params, SamplingParams):
            by_row: Params = params
        else:
            if len(params) != len(token_lists):
                raise ValueError(
                    f"params has {len(params)} entries for {len(token_lists)} prompts: "
                    "give one SamplingParams, or one per prompt"
                )
            by_row = dict(enumerate(params))
        if not token_lists:
            return []
        plan = build_plan(
            token_lists, row_ids=list(range(len(token_lists))), order="batchllm", min_prefix_len=self.runner.block_size
        )
        results = {out.row_id: out for out in self.run(plan.groups(0), by_row)}
        return [results[i] for i in range(len(token_lists))]

    def reset_prefix_cache(self) -> None:
        """Forget the hashed block cache (between runs; benchmarks start cold with it)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("reset_prefix_cache() during a run: call it between runs")
        self.block_manager.reset_cache()

    def reset(self) -> None:
        """A fresh block manager and scheduler, with no request: at start, and after a failed
        run (operators/stages/isolate.py), since a step that raised may have left the KV bookkeeping
        half-updated. The hashed prefix cache is dropped with it; the model stays loaded."""
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, self.runner.block_size, self.config.enable_prefix_cache
        )
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One token batch: schedule, execute, sample, finish; returns finished requests."""
        sched = self.scheduler
        t0 = time.perf_counter()
        out = sched.schedule()
        if not out.chunks:
            raise RuntimeError(
                "internal error: the scheduler made no progress with requests left "
                f"({len(sched.waiting)} waiting groups, {len(sched.active)} active)"
            )
        num_running = sched.num_running
        used_blocks = self.block_manager.num_used_blocks
        try:
            result = self.runner.execute(out.to_step_input())
        except BaseException:
            self.block_manager.forget_ahead()  # blocks hashed for this step were never written
            raise
        finished = [self._on_token(seq, token) for seq, token in sched.update(out, result.sampled)]
        self.stats.append(
            StepStats(
                step=len(self.stats),
                num_tokens=out.num_tokens(),
                num_prefill_tokens=out.num_tokens("prefill"),
                num_decode_tokens=out.num_tokens("decode"),
                num_prefix_tokens=out.num_tokens("prefix"),
                num_running_seqs=num_running,
                num_used_blocks=used_blocks,
                num_total_blocks=self.block_manager.num_blocks,
                num_preemptions=out.num_preemptions,
                duration_s=time.perf_counter() - t0,
            )
        )
        return [f for f in finished if f is not None]

    def _on_token(self, seq: Sequence, token: SampledToken) -> RequestOutput | None:
        if seq.params.logprobs is not None:
            seq.logprobs.append(TokenLogprob(token.token_id, token.logprob, token.top_logprobs))
        if seq.params.stop:
            append_text(seq, self.tokenizer)
        done = check_finish(seq, self.eos_token_ids, self.max_model_len)
        if done is None:
            return None
        reason, drop_last = done
        self.scheduler.finish(seq, reason)
        output = finished_output(seq, self.tokenizer, drop_last)
        if seq.num_samples == 1:
            return output
        samples = self._samples.setdefault(seq.row_id, [None] * seq.num_samples)
        samples[seq.sample_index] = output
        outs = [s for s in samples if s is not None]
        if len(outs) < len(samples):
            return None
        del self._samples[seq.row_id]
        return with_samples(outs)

    # ---- requests in ----------------------------------------------------------------------------

    def _make_groups(self, groups: Iterable[PrefixGroup | None], params: Params) -> Iterator[Made | None]:
        """Our GroupStates in plan order; a row sampling n > 1 times leaves its group for a
        group of its own right after it, whose prefix is its prompt (computed once). A greedy
        row asking n > 1 stays a member and runs once (`_once`). NOT_READY passes through."""
        if self.config.policy == "vllm":  # arrival order: the whole run is taken first
            rows = sorted(
                (int(row_id), g.prompt(i).tolist()) for g in every_group(groups) for i, row_id in enumerate(g.row_ids)
            )
            for row_id, prompt in rows:
                p = self.config.row_params(params, row_id)
                if p.n > 1 and not p.greedy:
                    yield self._sample_group(row_id, prompt, p)
                else:
                    yield self._make_group(next(self._ids), [], [(row_id, [], prompt, self._once(row_id, p), 0)])
            return
        for g in groups:
            if g is NOT_READY:
                yield NOT_READY
                continue
            prefix = g.prefix.tolist()
            members, several = [], []
            for i, r in enumerate(g.row_ids):
                p = self.config.row_params(params, int(r))
                if p.n > 1 and not p.greedy:
                    several.append((int(r), prefix, g.distinct[i].tolist(), p, 0))
                else:
                    members.append((int(r), prefix, g.distinct[i].tolist(), self._once(int(r), p), 0))
            if members:
                yield self._make_group(g.group_id, prefix, members)
            for row_id, _, distinct, p, _ in several:
                yield self._sample_group(row_id, prefix + distinct, p)

    def _once(self, row_id: int, p: SamplingParams) -> SamplingParams:
        """The params a row runs with as one sequence: a greedy row asking n > 1 samples runs
        once, and its output is copied n times when it finishes (greedy_copies)."""
        if p.n == 1:
            return p
        self._copies[row_id] = p.n
        return p.sample_params(0)

    def _sample_group(self, row_id: int, prompt: list[int], p: SamplingParams) -> Made:
        """The n samples of one row as a group: the prompt but its last token is the shared
        prefix, so it is computed once; each sample computes the last token and decodes."""
        if not prompt:
            return None, [error_output(row_id, prompt, "the prompt is empty: give at least one token")]
        prefix, last = prompt[:-1], prompt[-1:]
        group, errors = self._make_group(next(self._ids), prefix, [(row_id, prefix, last, p, 0)])
        if group is not None:
            for i in range(1, p.n):  # the first passed the checks: so do the others
                group.pending.append(
                    replace(
                        group.pending[0],
                        seq_id=next(self._ids),
                        token_ids=list(prompt),
                        block_table=[],
                        block_hashes=[],
                        params=p.sample_params(i),
                        sample_index=i,
                        logprobs=[],
                    )
                )
            group.pending[0].params = p.sample_params(0)
            for s in group.pending:
                s.num_samples = p.n
        return group, errors

    def _make_group(self, group_id: int, prefix: list[int], members: list[Member]) -> Made:
        """Requests of one group; members that cannot run become error outputs."""
        group = GroupState(group_id=group_id, prefix=None, pending=[])
        errors = []
        bs = self.block_manager.block_size
        seeds: dict[int, int] = {}  # own start -> hash seed (one chain walk per group)
        for row_id, member_prefix, distinct, p, index in members:
            prompt = member_prefix + distinct
            # A member needs >= 1 own token to sample from: an empty distinct part attends to
            # the prefix minus its last token and computes that token itself.
            prefix_len = len(member_prefix) if distinct else max(len(member_prefix) - 1, 0)
            own_start = prefix_len - prefix_len % bs  # the rest of the prefix's last block is copied
            error = self._check_request(prompt, own_start, len(prefix) if prefix_len else 0, p)
            if error:
                errors.append(error_output(row_id, prompt, error))
                continue
            if own_start not in seeds:
                seeds[own_start] = chain_hash(prompt[:own_start], bs)
            group.pending.append(
                Sequence(
                    seq_id=next(self._ids),
                    token_ids=prompt,
                    own_start=own_start,
                    tail_len=prefix_len - own_start,
                    hash_seed=seeds[own_start],
                    row_id=row_id,
                    num_prompt_tokens=len(prompt),
                    params=p,
                    group=group,
                    sample_index=index,
                )
            )
        if not group.pending:
            return None, errors
        if any(s.prefix_len > 0 for s in group.pending):
            group.prefix = PrefixSeq(seq_id=next(self._ids), token_ids=prefix, own_start=0, hash_seed=ROOT_HASH_SEED)
        return group, errors

    def _check_request(self, prompt: list[int], own_start: int, group_prefix_len: int, p: SamplingParams) -> str | None:
        """Why the request cannot run, or None. own_start: where its own KV starts in the prompt;
        group_prefix_len: the group's prefix, whose blocks it needs too (0: it shares none)."""
        if not prompt:
            return "the prompt is empty: give at least one token"
        if len(prompt) >= self.max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}: "
                "shorten the prompt or raise EngineConfig.max_model_len"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            return f"token id {bad} is outside the vocabulary [0, {self.vocab_size}): check the tokenizer"
        if p.structured_outputs is not None:
            return (
                f"structured_outputs ({next(iter(p.structured_outputs))}) needs engine.backend: vllm; "
                "the native engine has no structured-output decoding"
            )
        if p.stop and self.tokenizer is None:
            return "stop strings need a tokenizer; the model runner has none: use stop_token_ids"
        bm = self.block_manager
        num_tokens = min(len(prompt) + p.max_tokens, self.max_model_len) - own_start
        need = bm.blocks_for(num_tokens) + bm.blocks_for(group_prefix_len)
        if need > bm.num_blocks:
            return (
                f"the request needs {need} KV blocks (prompt {len(prompt)} + max_tokens {p.max_tokens}) "
                f"but the cache has {bm.num_blocks}: raise EngineConfig.kv_cache_bytes or lower max_tokens"
            )
        return None

    def _encode(self, prompt: str | Seq[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the model runner has no tokenizer: give token ids")
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        return [int(t) for t in prompt]
