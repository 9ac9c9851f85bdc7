"""BatchLLM's group scheduling inside vLLM, through vLLM's own extension points.

vLLM loads this module by name (EngineArgs.scheduler_cls, "pkg.mod.Class") in its engine-core
process, in-process or not, so nothing here refers to a prefixflow object: everything a request
says about its group rides in public request fields that vLLM carries into the scheduler:

- `priority` = the group's plan rank, with `scheduling_policy="priority"`: vLLM's waiting queue
  is a heap on (priority, arrival), so members of groups already in flight are admitted before
  later groups, and preemption picks the latest group's members first.
- `SamplingParams.extra_args["pf"] = {"g": group key "run.rank", "p": prefix_len, "n": members,
  "pin": bool}` (plain JSON: it crosses to a multiprocess engine core).

Pins: once a member has computed its group's whole prefix blocks, the scheduler takes one extra
reference on them (BlockPool.touch, as a prefix-cache hit does) and drops it (free_blocks) when
the group's last member leaves. A referenced block is never in vLLM's free queue, so it is never
evicted: later members always find the prefix, even when a tight cache evicts everything else.
Pins take at most MAX_PINNED_SHARE of the cache, so the queue head keeps room. (With the engine
core in another process, members are added while it steps: a pin may end early, never late.)

The request-count cap is not lifted here: VllmEngine sets max_num_seqs = max_num_batched_tokens
(vLLM sizes its buffers from max_num_seqs), which leaves the token budget and KV memory as the
only limits (memory-centric token batching).

Uses scheduler internals vLLM calls "not public" (`self.running`, `self.requests`,
`kv_cache_manager`): pinned to vllm 0.32 (`check_internals` fails loudly otherwise).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

MAX_PINNED_SHARE = 0.5


class _GroupMixin:
    """Pins per group, released when the group's last member finishes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        check_internals(self)
        self.pf_pins: dict[str, list] = {}        # group key -> its pinned prefix blocks
        self.pf_left: dict[str, int] = {}         # group key -> members in vLLM, not finished
        self.pf_group_of: dict[str, str] = {}     # request id -> group key, until it finishes
        self.pf_num_pins = 0                      # counters, for tests and the benchmark
        self.pf_num_unpins = 0
        self.pf_max_pinned_blocks = 0
        self.pf_num_preemptions = 0
        self.pf_last_step: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.pf_last_step = self._step_counts(out)
        self.pf_num_preemptions += self.pf_last_step[2]
        return out

    def _step_counts(self, out: Any) -> tuple[int, int, int, int, int]:
        """(prefill tokens, decode tokens, preemptions, running requests, used blocks) of the
        step just scheduled; a request with output tokens is decoding."""
        requests = self.requests  # type: ignore[attr-defined]
        decode = sum(n for rid, n in out.num_scheduled_tokens.items()
                     if rid in requests and requests[rid].num_output_tokens > 0)
        pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
        used = pool.num_gpu_blocks - pool.get_num_free_blocks()
        return (out.total_num_scheduled_tokens - decode, decode, len(out.preempted_req_ids or ()),
                len(self.running), used)  # type: ignore[attr-defined]

    @property
    def pf_pinned_blocks(self) -> int:
        return sum(len(b) for b in self.pf_pins.values())

    def add_request(self, request: Any) -> None:
        pf = _group_info(request)
        if pf is not None:
            # Members added and not finished: vLLM gets a group's members together (before the
            # next step in this process), so the count falls to 0 only after its last member,
            # and a member refused before it got here cannot keep a pin forever.
            self.pf_left[pf["g"]] = self.pf_left.get(pf["g"], 0) + 1
            self.pf_group_of[request.request_id] = pf["g"]
        super().add_request(request)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        self._pin_new_prefixes()
        self._release([o.request_id for batch in outputs.values() for o in batch.outputs
                       if o.finish_reason is not None])
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        aborted = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        self._release([r.request_id for r in aborted])
        return aborted

    def _pin_new_prefixes(self) -> None:
        manager = self.kv_cache_manager  # type: ignore[attr-defined]
        limit = int(MAX_PINNED_SHARE * manager.block_pool.num_gpu_blocks)
        for req in self.running:  # type: ignore[attr-defined]
            pf = _group_info(req)
            if pf is None or not pf.get("pin") or pf["g"] in self.pf_pins or pf["n"] < 2:
                continue
            num = int(pf["p"]) // self.block_size  # type: ignore[attr-defined]
            if num == 0 or req.num_computed_tokens < num * self.block_size:  # type: ignore[attr-defined]
                continue
            if self.pf_pinned_blocks + num > limit:
                continue  # leave room for the queue head
            blocks = manager.get_blocks(req.request_id).blocks[0][:num]
            if any(b.block_hash is None for b in blocks):
                continue
            manager.block_pool.touch(blocks)
            self.pf_pins[pf["g"]] = list(blocks)
            self.pf_num_pins += 1
        self.pf_max_pinned_blocks = max(self.pf_max_pinned_blocks, self.pf_pinned_blocks)

    def _release(self, finished: list[str]) -> None:
        """Count finished members; unpin a group's prefix when its last member is done."""
        pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
        for request_id in finished:
            g = self.pf_group_of.pop(request_id, None)
            if g is None:
                continue
            self.pf_left[g] -= 1
            if self.pf_left[g] > 0:
                continue
            del self.pf_left[g]
            blocks = self.pf_pins.pop(g, None)
            if blocks is not None:
                pool.free_blocks(reversed(blocks))  # tail first, as vLLM frees
                self.pf_num_unpins += 1


class GroupScheduler(_GroupMixin, Scheduler):
    """For synchronous scheduling (vLLM's CPU backend always; GPU with async_scheduling off)."""


class AsyncGroupScheduler(_GroupMixin, AsyncScheduler):
    """For vLLM's default async scheduling on GPUs (not run on a GPU yet)."""


def _group_info(request: Any) -> dict | None:
    sp = request.sampling_params
    return (sp.extra_args or {}).get("pf") if sp is not None else None


def check_internals(scheduler: Any) -> None:
    """The scheduler internals the pins use exist (they are not a public vLLM interface)."""
    missing = [name for name in ("running", "requests", "kv_cache_manager", "block_size")
               if not hasattr(scheduler, name)]
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    missing += [f"block_pool.{n}" for n in ("touch", "free_blocks", "num_gpu_blocks")
                if not hasattr(pool, n)]
    if missing:
        raise RuntimeError(f"this vLLM's scheduler lacks {', '.join(missing)}: prefixflow's group "
                           "scheduler supports vllm 0.32; use engine.policy=vllm or that version")
