"""VllmEngine: one replica's engine on vLLM (engine.backend=vllm), with LLMEngine's interface.

    engine = VllmEngine(EngineConfig(model=path, device="cpu"), {"enforce_eager": True})
    for out in engine.run(plan.groups(0), SamplingParams(temperature=0)): ...

vLLM's engine is built once (import 15-50 s, start 10-90 s on a small CPU box). `run` adds the
planner's groups in plan order as vLLM requests (one per member, prompt = prefix + distinct; vLLM
finds the shared prefix by its block hashes) and streams outputs as they finish. vLLM's own
scheduler runs them: fed in plan order, its queue keeps each group's members together (why no
scheduling of our own: engine/vllm_backend/scheduler.py). With GroupScheduling each request carries its
group's plan rank as its priority and the request cap is lifted (max_num_seqs =
max_num_batched_tokens); the benchmark's ablation runs vLLM with and without them. On a CPU,
EngineConfig.max_model_len is kept as given or refused (cpu_context), never lowered.
"""

from __future__ import annotations

import enum
import itertools
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from prefixflow.engine.config import CPU_KV_CACHE_BYTES, VLLM_SEQS_CAP, EngineConfig
from prefixflow.engine.intake import IDLE_POLL_S, NOT_READY, OutputFraction, group_rows, wants_more
from prefixflow.engine.outputs import (
    EngineTotals,
    RequestOutput,
    SampleOutput,
    StepStats,
    TokenLogprob,
    decode_output,
    error_output,
    greedy_copies,
    request_totals,
    sampled_output,
)
from prefixflow.engine.models.model_args import read_model_args, require_classifier
from prefixflow.engine.scoring.choices import Choice, ScoreOutput, choice_token_ids, label_output
from prefixflow.engine.scoring.choices import error_output as score_error
from prefixflow.engine.scoring.options import ScoreOptions
from prefixflow.engine.scoring.pooling import EmbedOutput, Pooling
from prefixflow.engine.vllm_backend.args import check_vllm_args
from prefixflow.errors import require
from prefixflow.images import decode_image
from prefixflow.lora import LoraAdapters
from prefixflow.model_source import resolve_model
from prefixflow.requests import PrefixGroup, Params, SamplingParams

Choices = Sequence[Choice] | Mapping[int, Sequence[Choice]]
SCHEDULER = "prefixflow.engine.vllm_backend.scheduler"
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention wants blocks of a multiple of 32 tokens


class _End(enum.Enum):
    END = enum.auto()


_END: Final = _End.END  # the groups' iterator is exhausted


@dataclass(frozen=True, slots=True)
class GroupScheduling:
    """BatchLLM's group scheduling as vLLM engine arguments, each part switchable (ablation).

    priority: priority = the group's plan rank (vLLM's "priority" policy); else FCFS in the
        order given. no_cap: max_num_seqs = max_num_batched_tokens (memory-centric token
        batching); else EngineConfig.max_num_seqs or 256. kv_room: a group is added only while
        the KV cache keeps room for it and for what running rows are expected to grow to
        (VllmEngine._has_room); else as vLLM's queue has room, as vLLM itself admits.
    """

    priority: bool = True
    no_cap: bool = True
    kv_room: bool = True


ALL_PARTS, NO_PARTS = GroupScheduling(), GroupScheduling(False, False, False)


@dataclass(slots=True)
class _Req:
    """One member: its full prompt, its group's prefix length, and what to ask vLLM."""

    row_id: int
    prompt: list[int]
    prefix_len: int
    params: SamplingParams
    options: dict[str, Any]  # more vLLM SamplingParams fields (scoring's logprob_token_ids)
    error: str | None = None  # known before the run: the row is not sent
    copies: int = 1  # a greedy row asking n > 1: run once, its answer n times
    pooling_task: str | None = None  # a pooling request ("embed" or "classify"), not a generation


class VllmEngine:
    """One replica's engine on vLLM. Not thread-safe; one `run` at a time.

    config: the same EngineConfig as the native engine (model, dtype, block_size,
        kv_cache_bytes, max_num_batched_tokens, max_num_seqs, max_model_len,
        enable_prefix_cache, seed); on a CPU block_size is raised to a multiple of 32.
    vllm_args: more vLLM engine arguments, from the allow-list engine/vllm_backend/args.ALLOWED (checked
        again here by check_vllm_args, before vLLM is imported).
    group_scheduler: True (all parts), False (vLLM's stock scheduler) or a GroupScheduling.
    pooling: an embedding engine (the embed task: vLLM's pooling runner, the model converted to
        an embedding model, pooled and normalized as this says); None: a generating one.
    classify: a classifying engine (the classify task: vLLM's pooling runner on a sequence
        classification checkpoint, softmax over its labels).
    lora: the job's LoRA adapters (prefixflow/lora.py): a row whose SamplingParams name one
        (`lora_adapter`) runs with it, the others on the base model. vLLM keys its prefix cache
        by adapter too, so rows of two adapters never share KV there either.
    in_process: run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0;
        the scheduler object is then `self.scheduler`, and step statistics come from it), else
        in a child process. In-process by default: a child engine core outlives a SIGKILLed
        parent (seen: an orphaned VLLM::EngineCore still running), so it would not die with a
        killed Ray actor, and bench/peer_bench measured no consistent gain from the child
        process on a 2-core CPU box (0.4x-3x, noise-dominated).
    """

    def __init__(
        self,
        config: EngineConfig,
        vllm_args: Mapping[str, Any] | None = None,
        group_scheduler: bool | GroupScheduling = True,
        *,
        in_process: bool = True,
        pooling: Pooling | None = None,
        classify: bool = False,
        lora: LoraAdapters | None = None,
    ) -> None:
        extra = check_vllm_args(vllm_args or {})
        self.config, self.pooling, self.classify, self.lora = config, pooling, classify, lora
        self.parts = ALL_PARTS if group_scheduler is True else NO_PARTS if group_scheduler is False else group_scheduler
        self.model_path = str(resolve_model(config.model))
        _set_env(in_process)
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine as VLLM

        self.is_cpu = current_platform.is_cpu()
        kwargs = self._engine_kwargs(extra)
        self.engine = VLLM.from_engine_args(EngineArgs(**kwargs))
        self.block_size = kwargs["block_size"]
        vconfig = self.engine.vllm_config
        self.max_num_seqs = vconfig.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = vconfig.scheduler_config.max_num_batched_tokens
        self.num_kv_blocks = vconfig.cache_config.num_gpu_blocks
        self.max_model_len = vconfig.model_config.max_model_len
        self.vocab_size = vconfig.model_config.get_vocab_size()
        self.tokenizer = self.engine.get_tokenizer()
        # lazy: loader imports torch; this module is imported on the driver (processor.cpu_context)
        from prefixflow.engine.models.loader import read_eos_token_ids

        self.eos_token_ids = tuple(read_eos_token_ids(self.model_path, self.tokenizer))
        self.stats: list[StepStats] = []
        self.totals: EngineTotals | None = None
        self._runs = itertools.count()
        # request id -> (vLLM's id for it, its group's prefix length); vLLM 0.32 adds a random
        # suffix to the ids its scheduler knows requests by, and returns that id.
        self._in_flight: dict[str, tuple[str, int]] = {}
        self._output_fraction = OutputFraction()  # of finished requests: how long running ones get
        self._lora_requests = _lora_requests(lora)

    @property
    def scheduler(self) -> Any:
        """vLLM's scheduler object when the engine core runs in this process, else None."""
        core = getattr(self.engine.engine_core, "engine_core", None)
        return getattr(core, "scheduler", None)

    # ---- public API ---------------------------------------------------------------------------

    def run(self, groups: Iterable[PrefixGroup], params: Params = SamplingParams()) -> Iterator[RequestOutput]:
        """Run planned groups (in plan order); yield each request's output when it finishes.

        params: one SamplingParams for all, or a mapping row_id -> SamplingParams (every
        field maps onto vLLM's SamplingParams; n > 1 is vLLM's own n, except that a greedy
        row, which vLLM refuses with n > 1, runs once and gets its answer n times).
        """
        members = (
            NOT_READY
            if g is NOT_READY
            else [_member(row, prompt, p, self.config.row_params(params, row)) for row, prompt, p in group_rows(g)]
            for g in groups
        )
        for out, m in self._execute(members):
            yield (
                error_output(m.row_id, m.prompt, m.error)
                if m.error is not None
                else greedy_copies(_to_output(out, m, self.tokenizer), m.copies)
            )

    def reset(self) -> None:
        """Abort whatever is in flight (after a failed or abandoned run). vLLM's prefix cache
        and its scheduler stay; aborted requests free their blocks."""
        if self._in_flight:
            self.engine.abort_request(list(self._in_flight))
            self._in_flight.clear()
        while self.engine.has_unfinished_requests():  # let aborts land (multiprocess core)
            self.engine.step()

    def reset_prefix_cache(self) -> None:
        """Forget vLLM's cached blocks (benchmarks start cold)."""
        self.engine.reset_prefix_cache()

    def score_groups(
        self, groups: Iterable[PrefixGroup], choices: Choices, options: ScoreOptions = ScoreOptions()
    ) -> Iterator[ScoreOutput]:
        """Score planned groups, as Scorer.score_groups: per row, the choices' first-token
        log-probabilities after the prompt, from one greedy token with vLLM's
        logprob_token_ids (raw log-softmax; prefix caching stays on). Bad rows come first."""
        members = (
            NOT_READY
            if g is NOT_READY
            else [self._score_member(row, prompt, p, choices, options) for row, prompt, p in group_rows(g)]
            for g in groups
        )
        for out, m in self._execute(members):
            row_choices = _row_choices(choices, m.row_id)
            if m.error is not None:
                yield score_error(m.row_id, row_choices, len(m.prompt), m.error)
            else:
                yield _score_output(out, m, row_choices)

    def embed_groups(self, groups: Iterable[PrefixGroup], pooling: Pooling) -> Iterator[EmbedOutput]:
        """Embed planned groups, as Scorer.embed_groups, with vLLM's pooling runner (the engine
        must have been built with this pooling: vLLM pools as its model was built). Prefix
        caching stays on: a member's last-token embedding reads its group's cached prefix
        (mean pooling needs every token's hidden state, so vLLM computes the whole prompt)."""
        require(
            pooling == self.pooling,
            "VllmEngine.embed_groups",
            "pooling",
            pooling,
            f"this engine was built to pool as {self.pooling}: build a VllmEngine(pooling=...) for it",
        )
        for embedding, m, cached in self._pooled(groups, "embed"):
            if m.error is not None:
                yield EmbedOutput(m.row_id, prompt_len=len(m.prompt), error=m.error)
            else:
                yield EmbedOutput(m.row_id, embedding, len(m.prompt), min(m.prefix_len, cached), cached)

    def classify_groups(self, groups: Iterable[PrefixGroup]) -> Iterator[ScoreOutput]:
        """Classify planned groups, as Scorer.classify_groups, with vLLM's pooling runner on the
        sequence classifier (the engine must have been built with classify=True): per row the
        checkpoint's label logits through its activation (softmax, or sigmoid for a
        cross-encoder's one label), read from its last token (prefix caching on)."""
        require(self.classify, "VllmEngine.classify_groups", "classify", False, "build VllmEngine(classify=True)")
        args = read_model_args(self.model_path, vision=True)
        require_classifier(args)
        for values, m, cached in self._pooled(groups, "classify"):
            if m.error is not None:
                yield score_error(m.row_id, args.labels, len(m.prompt), m.error)
                continue
            # vLLM's pooler applied the activation (chosen from config.json as ModelArgs' is)
            yield label_output(
                m.row_id, args.labels, values, args.activation, len(m.prompt), min(m.prefix_len, cached), cached
            )

    # ---- internals ------------------------------------------------------------------------------

    def _pooled(self, groups: Iterable[PrefixGroup], task: str) -> Iterator[tuple[tuple[float, ...], _Req, int]]:
        """vLLM's pooling outputs for the groups' members (task "embed" or "classify"): (the
        values, the member, its prompt tokens read from the prefix cache); () and 0 for a
        member that could not run (its error set)."""
        members = (
            NOT_READY
            if g is NOT_READY
            else [_Req(row, prompt, p, SamplingParams(), {}, pooling_task=task) for row, prompt, p in group_rows(g)]
            for g in groups
        )
        for out, m in self._execute(members):
            if m.error is not None:
                yield (), m, 0
            else:
                yield tuple(float(v) for v in out.outputs.data.float().tolist()), m, int(out.num_cached_tokens or 0)

    def _execute(self, groups: Iterable[list[_Req] | None]) -> Iterator[tuple[Any, _Req]]:
        """Add the groups' members (priority = plan rank) as vLLM has room for them
        (engine/intake.py: a group not taken yet stays the caller's; one taken waits, `held`,
        until the KV cache has room for it: _has_room), and step vLLM; yields
        (None, m) for a member that cannot run (m.error set) and (vLLM's output, m) as members
        finish. Fills `stats` and `totals`."""
        self.stats, start = [], time.perf_counter()
        run, reqs = next(self._runs), {}
        counts = dict(requests=0, prompt=0, cached=0, output=0)
        source, rank = iter(groups), 0
        held: list[_Req] | None = None
        exhausted = completed = False
        try:
            while True:
                while not exhausted:
                    if held is None:
                        taken = next(source, _END) if self._wants_more() else NOT_READY
                        if taken is _END or taken is NOT_READY:
                            exhausted = taken is _END
                            break
                        held = taken
                    if not self._has_room(held):
                        break
                    members, held = held, None
                    counts["requests"] += len(members)
                    for m in members:
                        rid = f"{run}-{m.row_id}"
                        m.error = m.error or self._add(rid, m, rank)
                        if m.error is not None:
                            yield None, m
                            continue
                        reqs[rid] = m
                        counts["prompt"] += len(m.prompt)
                    rank += 1
                if not self.engine.has_unfinished_requests():
                    if exhausted:
                        break
                    time.sleep(IDLE_POLL_S)  # the source has nothing ready now
                    continue
                for out in self._step():
                    self._in_flight.pop(out.request_id, None)
                    counts["cached"] += int(out.num_cached_tokens or 0)
                    m = reqs[out.request_id]
                    if m.pooling_task is None:
                        counts["output"] += sum(len(c.token_ids) for c in out.outputs)
                        longest = max((len(c.token_ids) for c in out.outputs), default=0)
                        self._output_fraction.add_finished(
                            longest, len(m.prompt), m.params.max_tokens, self.max_model_len
                        )
                    yield out, reqs.pop(out.request_id)
            completed = True
        finally:
            if not completed:  # the caller stopped iterating, or adding or a step raised
                self.reset()
        self.totals = request_totals(
            counts, time.perf_counter() - start, len(self.stats), sum(s.num_preemptions for s in self.stats)
        )

    def _wants_more(self) -> bool:
        """engine/intake.wants_more over vLLM's queue: its requests not running yet (read from
        the scheduler in this process; with the core in a child process, every request past
        max_num_seqs counts as waiting)."""
        sched = self.scheduler
        if sched is None:
            unfinished = len(self._in_flight)
            running = min(unfinished, self.max_num_seqs)
            return wants_more(unfinished - running, 0, running, self.max_num_batched_tokens, self.max_num_seqs)
        running, waiting = _queues(sched)
        tokens = sum(r.num_prompt_tokens - r.num_computed_tokens for r in waiting)
        return wants_more(len(waiting), tokens, len(running), self.max_num_batched_tokens, self.max_num_seqs)

    def _has_room(self, members: list[_Req]) -> bool:
        """Whether vLLM's KV cache keeps room for a group's members besides the running and
        waiting requests' (_kv_room); always with nothing running or waiting, and with the core
        in a child process, whose cache is not read here."""
        sched = self.scheduler
        if sched is None or not self.parts.kv_room:
            return True
        running, waiting = _queues(sched)
        return not (running or waiting) or self._kv_room(sched, running, waiting) >= self._group_blocks(members)

    def _group_blocks(self, members: list[_Req]) -> int:
        """KV blocks a group's members are expected to take (OutputFraction), its prefix once."""
        expect, need = self._output_fraction.expected_length, 0
        for i, m in enumerate(m for m in members if m.error is None):
            grows = 0 if m.pooling_task is not None else m.params.max_tokens
            shared = m.prefix_len // self.block_size if i else 0
            need += self._blocks(expect(len(m.prompt), len(m.prompt), grows, self.max_model_len)) - shared
        return need

    def _kv_room(self, sched: Any, running: list[Any], waiting: list[Any]) -> int:
        """KV blocks still free once the running requests grow to the lengths they are expected
        to reach (engine/intake.OutputFraction) and the waiting ones start (their group's
        prefix blocks counted as shared). vLLM admits whatever fits now; rows that then outgrow
        the cache preempt the latest admitted, whose prompts are computed again (at 4 replicas
        of scale_bench's model-decided workload, 8-227 preemptions per engine and 1% more
        prompt tokens, and rows admitted that another replica could have taken). The native scheduler keeps the
        same room for new groups (its reserve_growth)."""
        expect, mml = self._output_fraction.expected_length, self.max_model_len
        room = int(sched.kv_cache_manager.block_pool.get_num_free_blocks())
        for r in running:
            room -= self._blocks(expect(r.num_tokens, r.num_prompt_tokens, r.max_tokens, mml)) - self._blocks(
                r.num_computed_tokens
            )
        prefix_lens = dict(self._in_flight.values())
        for r in waiting:
            shared = prefix_lens.get(r.request_id, 0) // self.block_size
            room -= self._blocks(expect(r.num_tokens, r.num_prompt_tokens, r.max_tokens, mml)) - shared
        return room

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // int(self.block_size))

    def _add(self, request_id: str, m: _Req, rank: int) -> str | None:
        """Add one request of the group of this plan rank; an error message when it cannot run."""
        error = self._check_prompt(m.prompt)
        if error is not None:
            return error
        adapter = m.params.lora_adapter
        if adapter is not None and adapter not in self._lora_requests:
            return f"LoRA adapter {adapter!r} is not one of this engine's (lora.path)"
        try:
            params = _vllm_params(m) if m.pooling_task is None else _pooling_params(m.pooling_task)
            prompt = _prompt(m)  # ValueError for an image that does not decode
            vllm_id = self.engine.add_request(
                request_id,
                prompt,
                params,
                lora_request=None if adapter is None else self._lora_requests[adapter],
                priority=rank if self.parts.priority else 0,
            )
        except Exception as e:
            if not _refused(e):
                raise
            return f"vLLM refused the request: {e}"
        self._in_flight[request_id] = (vllm_id if isinstance(vllm_id, str) else request_id, m.prefix_len)
        return None

    def _check_prompt(self, prompt: list[int]) -> str | None:
        if not prompt:
            return "the prompt is empty: give at least one token"
        if len(prompt) >= self.max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len} "
                "(the model's, EngineConfig.max_model_len or what the KV cache holds): shorten "
                "the prompt or raise EngineConfig.max_model_len / kv_cache_bytes"
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary [0, {self.vocab_size}): check the tokenizer"
        return None

    def _score_member(
        self, row: int, prompt: list[int], prefix_len: int, choices: Choices, options: ScoreOptions
    ) -> _Req:
        m = _Req(row, prompt, prefix_len, SamplingParams(temperature=0, max_tokens=1), {})
        try:
            ids = choice_token_ids(
                _row_choices(choices, row), self.tokenizer, self.vocab_size, options.choice_leading_space
            )
            m.options["logprob_token_ids"] = list(ids)
        except ValueError as e:
            m.error = str(e)
        return m

    def _step(self) -> list[Any]:
        """One vLLM step; its StepStats from the counting scheduler when it runs in this process
        (token counts, preemptions, used blocks), else only the time and unfinished requests."""
        t0 = time.perf_counter()
        unfinished = self.engine.get_num_unfinished_requests()
        outs = self.engine.step()
        counts = getattr(self.scheduler, "pf_last_step", None)
        prefill, decode, preempted, running, used = counts or (0, 0, 0, unfinished, 0)
        self.stats.append(
            StepStats(
                step=len(self.stats),
                num_tokens=prefill + decode,
                num_prefill_tokens=prefill,
                num_decode_tokens=decode,
                num_prefix_tokens=0,
                num_running_seqs=running,
                num_used_blocks=used,
                num_total_blocks=self.num_kv_blocks or 0,
                num_preemptions=preempted,
                duration_s=time.perf_counter() - t0,
            )
        )
        return [o for o in outs if o.finished]

    def _engine_kwargs(self, extra: dict[str, Any]) -> dict[str, Any]:
        c, parts = self.config, self.parts
        block = cpu_block_size(c) if self.is_cpu else c.block_size
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            dtype="float32" if c.dtype == "auto" and self.is_cpu else c.dtype,
            block_size=block,
            seed=c.seed,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_num_seqs=c.max_num_batched_tokens if parts.no_cap else (c.max_num_seqs or VLLM_SEQS_CAP),
            enable_prefix_caching=c.enable_prefix_cache,
            gpu_memory_utilization=c.gpu_memory_utilization,
            trust_remote_code=c.trust_remote_code,
            disable_log_stats=True,
            scheduling_policy="priority" if parts.priority else "fcfs",
        )
        kwargs["scheduler_cls"] = f"{SCHEDULER}.{'CountingScheduler' if self.is_cpu else 'AsyncCountingScheduler'}"
        if self.pooling is not None:
            kwargs.update(runner="pooling", convert="embed", pooler_config=_pooler_config(self.pooling))
        if self.classify:  # a sequence classifier: vLLM pools its last token through the score head
            kwargs.update(runner="pooling")
        if self.lora is not None:
            kwargs.update(self.lora.vllm_args(cpu=self.is_cpu))
        if self.pooling is not None and self.pooling.kind == "mean":
            # vLLM's mean pooling needs every token's hidden state in one step: it turns prefix
            # caching and chunked prefill off for it by default, and fails a request without
            kwargs.update(enable_prefix_caching=False, enable_chunked_prefill=False)
        if self.is_cpu:
            args = read_model_args(self.model_path, vision=True)
            blocks = _cpu_kv_blocks(c, block, args.kv_bytes_per_token_per_elem)
            kwargs["num_gpu_blocks_override"] = blocks
            # An explicit KV size: vLLM's CPU worker otherwise reserves gpu_memory_utilization of
            # its NUMA node's memory, and refuses to start where that much is not free (a 10 GiB
            # node with 7 GiB free failed at the default 0.85).
            kwargs["kv_cache_memory_bytes"] = blocks * block * args.kv_bytes_per_token_per_elem * _elem_size(c.dtype)
            kwargs["max_model_len"] = cpu_context(c, self.model_path)  # as given, or refused
        else:  # GPU: kv_cache_memory_bytes when a budget is given, else memory utilization
            kwargs["kv_cache_memory_bytes"] = c.kv_cache_bytes
            if c.max_model_len is not None:
                kwargs["max_model_len"] = c.max_model_len
        return {**kwargs, **extra}


def _queues(sched: Any) -> tuple[list[Any], list[Any]]:
    """(running, waiting) requests of vLLM's scheduler: waiting are those not running (new,
    preempted or paused)."""
    running = list(sched.running)
    ids = {id(r) for r in running}
    return running, [r for r in sched.requests.values() if id(r) not in ids]


def cpu_block_size(config: EngineConfig) -> int:
    """The KV block size vLLM runs with on a CPU: EngineConfig.block_size where it is a multiple
    of CPU_BLOCK_MULTIPLE, else that multiple (vLLM's CPU attention needs it)."""
    return config.block_size if config.block_size % CPU_BLOCK_MULTIPLE == 0 else CPU_BLOCK_MULTIPLE


def cpu_context(config: EngineConfig, model_path: str) -> int:
    """max_model_len of a vLLM engine on a CPU. EngineConfig.max_model_len is kept as given, or
    refused: a ValueError naming engine.max_model_len, the limit it passes and the fix, never a
    silent lower value (vLLM on a GPU refuses such a value too). None: the most the model
    (max_position_embeddings) and the KV cache (EngineConfig.kv_cache_bytes, less vLLM's one
    reserved block) allow. Checked in the driver before a job starts (Processor.plan,
    jobs/preflight) and again where the engine starts. Reads config.json only."""
    args = read_model_args(model_path, vision=True)
    block = cpu_block_size(config)
    fits = (_cpu_kv_blocks(config, block, args.kv_bytes_per_token_per_elem) - 1) * block
    wanted = config.max_model_len
    if wanted is None:
        return min(fits, args.max_position_embeddings)
    require(
        wanted <= args.max_position_embeddings,
        "engine",
        "max_model_len",
        wanted,
        f"it is past the model's max_position_embeddings ({args.max_position_embeddings}): "
        "lower it, or leave it unset for the most that fits",
    )
    budget = config.kv_cache_bytes or f"{CPU_KV_CACHE_BYTES} (the CPU default)"
    require(
        wanted <= fits,
        "engine",
        "max_model_len",
        wanted,
        f"it does not fit the CPU KV cache ({fits} tokens in engine.kv_cache_bytes={budget}): "
        "raise engine.kv_cache_bytes (ray.data.llm: engine_kwargs kv_cache_memory_bytes), or "
        "lower max_model_len, or leave it unset for the most that fits",
    )
    return wanted


def _cpu_kv_blocks(config: EngineConfig, block: int, kv_bytes_per_token_per_elem: int) -> int:
    """Blocks of the CPU KV budget (EngineConfig.kv_cache_bytes, default 1 GiB)."""
    per_token = kv_bytes_per_token_per_elem * _elem_size(config.dtype)
    return max(2, (config.kv_cache_bytes or CPU_KV_CACHE_BYTES) // (block * per_token))


def _set_env(in_process: bool) -> None:
    """vLLM reads these from the environment; set before its engine starts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _thread_bind())


def _thread_bind() -> str:
    """vLLM's CPU thread binding for this process: its CPUs, or "nobind" when it may use only
    part of them (OMP_NUM_THREADS, which Ray sets to an actor's num_cpus, below the CPUs it
    sees): binding the first n would put every actor of a node on the same cores."""
    cpus = sorted(os.sched_getaffinity(0))
    threads = int(os.environ.get("OMP_NUM_THREADS") or len(cpus))
    if threads < len(cpus):
        return "nobind"
    return ",".join(str(c) for c in cpus)


def _elem_size(dtype: str) -> int:
    return 4 if dtype in ("auto", "float32") else 2


def _member(row: int, prompt: list[int], prefix_len: int, p: SamplingParams) -> _Req:
    """One member to generate for; a greedy one asking n > 1 samples is asked once."""
    asked, copies = p.asked_once()
    return _Req(row, prompt, prefix_len, asked, {}, copies=copies)


def _row_choices(choices: Choices, row: int) -> Sequence[Choice]:
    return choices.get(row, ()) if isinstance(choices, Mapping) else choices


def _lora_requests(lora: LoraAdapters | None) -> dict[str, Any]:
    """vLLM's LoRARequest of each adapter, by name; its id (from 1) is its place in the sorted
    names, the same in every replica."""
    if lora is None:
        return {}
    from vllm.lora.request import LoRARequest

    return {
        a.name: LoRARequest(lora_name=a.name, lora_int_id=i + 1, lora_path=a.path) for i, a in enumerate(lora.adapters)
    }


def _pooling_params(task: str) -> Any:
    """A pooling request's vLLM parameters ("embed": its pooling is the engine's pooler_config;
    "classify": the label probabilities)."""
    from vllm import PoolingParams

    return PoolingParams(task=task)


def _pooler_config(pooling: Pooling) -> Any:
    """Our Pooling as vLLM's pooler config: which token(s), and whether to normalize."""
    from vllm.config import PoolerConfig

    return PoolerConfig(pooling_type=pooling.kind.upper(), use_activation=pooling.normalize)


def _refused(error: Exception) -> bool:
    """Whether add_request refused this one request (its row's error), not the engine failing:
    vLLM's request validation raises ValueError, or VLLMValidationError (an image's tokens past
    max_model_len, ...: in vLLM 0.32 no ValueError; matched by name, as releases before it
    lack the class)."""
    return isinstance(error, (ValueError, TypeError)) or any(
        c.__name__ == "VLLMValidationError" for c in type(error).__mro__
    )


def _prompt(m: _Req) -> dict[str, Any]:
    """vLLM's token prompt of a request: its token ids, and its images (vLLM's processor puts
    each image's tokens at its placeholder and keys its prefix cache by the image's hash)."""
    if not m.params.images:
        return {"prompt_token_ids": m.prompt}
    return {"prompt_token_ids": m.prompt, "multi_modal_data": {"image": [decode_image(b) for b in m.params.images]}}


def _vllm_params(m: _Req) -> Any:
    """Our SamplingParams as vLLM's (+ m.options)."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    p = m.params  # vLLM's text is needed only to cut at stop strings: we decode at the end
    structured = None
    if p.structured_outputs is not None:
        structured = StructuredOutputsParams(
            **{k: list(v) if isinstance(v, tuple) else v for k, v in p.structured_outputs.items()}
        )
    return VllmParams(
        n=p.n,
        temperature=p.temperature,
        top_k=max(p.top_k, 0),
        top_p=p.top_p,
        min_p=p.min_p,
        seed=p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        logprobs=p.logprobs,
        detokenize=bool(p.stop),
        structured_outputs=structured,
        output_kind=RequestOutputKind.FINAL_ONLY,
        **m.options,
    )
    # FINAL_ONLY: with n > 1 vLLM hands back one output holding every sample, once all finish.


def _to_output(out: Any, m: _Req, tokenizer: Any) -> RequestOutput:
    """vLLM's output as ours (engine/native/finish.finished_output): sample 0's fields, and with
    n > 1 every sample in `samples`."""
    samples = sorted((_sample(c, m.params, tokenizer) for c in out.outputs), key=lambda s: s.index)
    return sampled_output(m.row_id, m.prompt, m.prefix_len, samples, m.params.n, int(out.num_cached_tokens or 0))


def _sample(c: Any, params: SamplingParams, tokenizer: Any) -> SampleOutput:
    """One of vLLM's completions: the text is vLLM's when a stop string cut it, else the
    decoded tokens (decode_output: vLLM's incremental text can differ on invalid UTF-8
    across the prompt boundary)."""
    ids = tuple(c.token_ids)
    if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
        text = c.text
    else:  # EOS (stop_reason None) or a stop token id ends it
        text = decode_output(ids, params, tokenizer, c.finish_reason == "stop")
    logprobs = None
    if params.logprobs is not None:
        logprobs = tuple(_token_logprob(t, d, params.logprobs) for t, d in zip(ids, c.logprobs or ()))
    return SampleOutput(int(c.index), ids, text, c.finish_reason or "length", logprobs)


def _token_logprob(token: int, entries: Mapping[int, Any], k: int) -> TokenLogprob:
    top = sorted(
        ((t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= k), key=lambda item: item[1].rank
    )
    return TokenLogprob(int(token), float(entries[token].logprob), tuple((int(t), float(lp.logprob)) for t, lp in top))


def _score_output(out: Any, m: _Req, choices: Sequence[Choice]) -> ScoreOutput:
    """vLLM's first-token logprobs of the choice tokens -> probabilities over the choices."""
    ids = tuple(m.options["logprob_token_ids"])
    entries = out.outputs[0].logprobs[0]
    logprobs = [float(entries[t].logprob) for t in ids]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    probs = tuple(w / sum(weights) for w in weights)
    labels = tuple(str(c) for c in choices)
    cached = int(out.num_cached_tokens or 0)
    return ScoreOutput(
        row_id=m.row_id,
        choices=labels,
        choice_token_ids=ids,
        probs=probs,
        logprobs=tuple(logprobs),
        label=labels[probs.index(max(probs))],
        prompt_len=len(m.prompt),
        prefix_len=min(m.prefix_len, cached),
        num_cached_tokens=cached,
    )
