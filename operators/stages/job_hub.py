"""The job's one small actor on the driver's node: its MetricsSink (operators/results/sink.py),
which the engines report to, and the WorkQueue (operators/stages/work_queue.py) of each of its
runs, which the engines take units from. One actor, not two: every Ray actor is a process of
its own (about 1 CPU-s to start on a 2-core machine, and its threads' polling while it lives:
the two actors of a job took 1.3-1.8 CPU-s in their first 20 s, the one 0.7-0.9), and both are
small and on the driver's node for the same reason (they live as long as the driver). The
queues answer on a thread of their own (concurrency group "queue"), so an engine asking for its
next unit never waits behind the sink's work (a Python API block being stored, a resume's
committed rows). Like the sink's module, this one imports neither pyarrow nor the config.

    sink = start_sink("my-job")                      # before the plan: engines load meanwhile
    queue = open_queue(sink, WorkQueue-arguments...)  # the run's queue, once the plan is made
    ray.get(queue.take(replica, token))               # an engine's next unit
    queue.close()                                     # no more units will come (windows)
    status = ray.get(queue.end())                     # the run ended: its queue goes
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray

from prefixflow.operators.results.sink import MetricsSink
from prefixflow.operators.stages.work_queue import DONE, Take, WorkQueue

QUEUE = "queue"  # the queues' concurrency group: one thread, apart from the sink's
# What an engine's call (RunQueue's) is answered for a run whose queue has ended (an engine
# still asking after the driver stopped): an empty queue's answers.
ENDED_ANSWERS: dict[str, Any] = {"take": Take(DONE), "ran": None, "finished": None, "held": []}


class JobHub(MetricsSink):
    """A MetricsSink that also holds its job's work queues, one per run (a Python API
    processor's sink outlives each run; two Datasets of one processor may run at once)."""

    def __init__(self, job: str = "prefixflow") -> None:
        super().__init__(job)
        self.queues: dict[str, WorkQueue] = {}

    @ray.method(concurrency_group=QUEUE)
    def open_queue(self, run: str, *args: Any, **kwargs: Any) -> None:
        self.queues[run] = WorkQueue(*args, **kwargs)

    @ray.method(concurrency_group=QUEUE)
    def queue_call(self, run: str, method: str, *args: Any) -> Any:
        """WorkQueue.<method>(*args) on the run's queue (RunQueue's calls). Where it has ended,
        an engine's calls get ENDED_ANSWERS; the driver's own (add, close, release, drop,
        counts) expect it: its absence is a bug."""
        if run not in self.queues and method in ENDED_ANSWERS:
            return ENDED_ANSWERS[method]
        return getattr(self.queues[run], method)(*args)

    @ray.method(concurrency_group=QUEUE)
    def end_queue(self, run: str) -> dict:
        """The run's queue goes (with the payload refs it held); returns its status ({} if it
        had gone already)."""
        queue = self.queues.pop(run, None)
        return {} if queue is None else queue.status()

    @ray.method(concurrency_group=QUEUE)
    def queue_runs(self) -> list[str]:
        """The runs whose queues are open."""
        return list(self.queues)


class RunQueue:
    """One run's work queue in the job's JobHub, as the driver and the engines call it: each
    method sends the call and returns its object ref (fire and forget, or ray.get it)."""

    def __init__(self, hub: Any, run: str):
        self.hub, self.run = hub, run

    def take(self, replica: int, token: str) -> Any:
        return self._call("take", replica, token)

    def ran(self, token: str, shares: Mapping[int, float]) -> Any:
        return self._call("ran", token, shares)

    def finished(self, unit: int, token: str) -> Any:
        return self._call("finished", unit, token)

    def add(
        self,
        unit_replica: Sequence[int],
        unit_seconds: Sequence[float],
        payloads: Sequence[Any],
        rows_left: Mapping[int, Sequence[int]],
        done_units: Iterable[int],
        unit_shared: Sequence[int] = (),
    ) -> Any:
        return self._call("add", unit_replica, unit_seconds, payloads, rows_left, done_units, unit_shared)

    def close(self) -> Any:
        return self._call("close")

    def release(self, token: str, rows_left: Mapping[int, Sequence[int]], replica: int) -> Any:
        return self._call("release", token, rows_left, replica)

    def drop(self, replica: int) -> Any:
        return self._call("drop", replica)

    def held(self, token: str) -> Any:
        return self._call("held", token)

    def counts(self) -> Any:
        return self._call("counts")

    def end(self) -> Any:
        return self.hub.end_queue.remote(self.run)

    def _call(self, method: str, *args: Any) -> Any:
        return self.hub.queue_call.remote(self.run, method, *args)


def open_queue(hub: Any, *args: Any, **kwargs: Any) -> RunQueue:
    """A new run's WorkQueue (WorkQueue's arguments) in the job's hub."""
    run = uuid.uuid4().hex
    ray.get(hub.open_queue.remote(run, *args, **kwargs))  # before any engine asks it for a unit
    return RunQueue(hub, run)


def start_sink(job: str = "prefixflow", name: str | None = None) -> Any:
    """The job's JobHub actor on the driver's own node: it lives as long as the driver does (on
    another node it would die with that node, and take the job with it). name: for another
    process to find it (namespace "prefixflow"; results/sink.sink_name)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    named = {"namespace": "prefixflow", "name": name} if name is not None else {}
    return hub_actor().options(num_cpus=0, scheduling_strategy=here, **named).remote(job)


def hub_actor() -> Any:
    """JobHub as a Ray actor class, its queues answering on their own thread."""
    return ray.remote(concurrency_groups={QUEUE: 1})(JobHub)
