"""vLLM's own scheduler, observed: per-step token counts for our StepStats.

vLLM loads this module by name (EngineArgs.scheduler_cls, "pkg.mod.Class") in its engine-core
process, so nothing here refers to a prefixflow object. The subclass schedules exactly as vLLM
does and records, after each `schedule`, the step's prefill and decode tokens, preemptions,
running requests and used KV blocks (metrics.json, plot.png, the benchmarks), which vLLM's
public outputs do not give per step.

Why no scheduling of our own: fed in plan order, vLLM's queue already runs each group's members
together. The group scheduler built for issue 13 (plan rank as priority, a group's prefix blocks
pinned until its last member finished, no request cap) computed exactly as many prompt tokens as
plan order alone on every peer_bench workload, and the pins added preemptions under a small
cache (bench/results/peer_bench.json): its parts were dropped, as the issue asked of any part
without an effect.

Reads scheduler internals vLLM calls "not public" (`self.running`, `self.requests`,
`kv_cache_manager.block_pool`): every release in versions.SUPPORTED has them (versions.USED,
checked against each release's source), and `check_internals` fails loudly on one that does not.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from prefixflow.engine.vllm_backend.versions import SUPPORTED


class _StepCounts:
    """Records the counts of the step just scheduled in `pf_last_step`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_internals(self)
        self.pf_last_step: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]  # vLLM's Scheduler, mixed in below
        self.pf_last_step = self._step_counts(out)
        return out

    def _step_counts(self, out: Any) -> tuple[int, int, int, int, int]:
        """(prefill tokens, decode tokens, preemptions, running requests, used blocks) of the
        step just scheduled; a request with output tokens is decoding."""
        requests = self.requests  # type: ignore[attr-defined]  # vLLM's Scheduler's, mixed in below
        decode = sum(
            n for rid, n in out.num_scheduled_tokens.items() if rid in requests and requests[rid].num_output_tokens > 0
        )
        pool = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]  # vLLM's Scheduler's, mixed in
        used = pool.num_gpu_blocks - pool.get_num_free_blocks()
        running = self.running  # type: ignore[attr-defined]  # vLLM's Scheduler's, mixed in below
        return (out.total_num_scheduled_tokens - decode, decode, len(out.preempted_req_ids or ()), len(running), used)


class CountingScheduler(_StepCounts, Scheduler):
    """For synchronous scheduling (vLLM's CPU backend always; GPU with async_scheduling off)."""


class AsyncCountingScheduler(_StepCounts, AsyncScheduler):
    """For vLLM's default async scheduling on GPUs (not run on a GPU yet)."""


def check_internals(scheduler: Any) -> None:
    """The scheduler internals the counts read exist (they are not a public vLLM interface)."""
    missing = [name for name in ("running", "requests", "kv_cache_manager") if not hasattr(scheduler, name)]
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    missing += [f"block_pool.{n}" for n in ("get_num_free_blocks", "num_gpu_blocks") if not hasattr(pool, n)]
    if missing:
        raise RuntimeError(
            f"this vLLM's scheduler lacks {', '.join(missing)}: prefixflow's step counts support vllm "
            f"{SUPPORTED[0]} to {SUPPORTED[-1]}"
        )
