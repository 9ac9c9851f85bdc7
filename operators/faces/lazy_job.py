"""The Python API's job as one lazy read: nothing runs when `processor(ds)` is called; the job
(tokenize, global plan, replicas) runs when the returned Dataset executes, once per execution.

    out = processor(ds)   # read_datasource(JobSource(processor, ds)): a plan of Ray Data, no work
    out.take_all()        # the one read task runs Processor.run(ds) and streams its blocks out

The read task asks for no CPU of its own (it waits on the stages it starts) and is the job's
driver while it runs: its inner Ray Data pipelines tokenize and plan `ds` (the one global
barrier, operators/stages/plan.py), then it runs the replicas' engine actors under the job's one
driver (operators/stages/supervise.py, which restarts a dead actor alone and runs its
uncommitted rows again), and it yields their output blocks as they are committed. Everything
the run makes (the tokenized blocks in the object store, the engine actors, the committed
blocks the processor's sink holds under the run's key) ends with the execution, also one
abandoned after `take(5)`. A second execution (`count()`, then `take_all()`) runs the job
again, as any Ray Dataset and ray.data.llm's processor do; `materialize()` once to reuse rows.
Resources are decided in the task, on the cluster the job runs on (engine_actor_options), not
when the processor was built. Ray Data retries the task only where its own worker died (a
system failure); the job then runs again from the start.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

NAME = "PrefixflowJob"


def job_dataset(processor: Any, ds: Any) -> Any:
    """The lazy Dataset of `processor`'s output rows for the input Dataset `ds`."""
    import ray

    # max_calls=1: the task's worker process exits when the job ends, and with it whatever the
    # job made there and still holds (a failed plan's tokenize actor pool, before the stage ran
    # as tasks, outlived the job in the idle, reused worker that owned it: test_engine_start
    # found the session's Ray a CPU short for minutes after test_ray_llm_compat's failing job).
    return ray.data.read_datasource(
        JobSource(processor, ds),
        override_num_blocks=1,
        num_cpus=0,
        max_calls=1,
        runtime_env=processor.config.runtime_env,
    )


class JobSource(Datasource):
    """One read task: the whole job (see the module docstring). Ray Data asks for the read
    tasks when it builds and optimizes the plan too; making them runs nothing."""

    def __init__(self, processor: Any, ds: Any):
        super().__init__()
        self.processor, self.ds = processor, ds

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_name(self) -> str:
        return NAME

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
        return [ReadTask(partial(run_job, self.processor, self.ds), meta, per_task_row_limit=per_task_row_limit)]


def run_job(processor: Any, ds: Any) -> Iterator[Any]:
    """The read task's body: the job's output blocks, in the order the replicas finish them."""
    yield from processor.run(ds)
