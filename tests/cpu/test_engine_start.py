"""Engines start at job start (issue 39, item 1): each replica's engine actor loads its model
while the job is read, tokenized and planned, and takes its work when the plan is made.

The proof is an ordering, not a time: the job's preprocess (part of what is planned) waits
until it sees this job's engine actor up (loading its model, or done with it). Had the engines
been started only after the plan, the plan would wait for them in vain and the job fail."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

import prefixflow
from prefixflow.operators.stages.supervise import engine_actor_options, start_engines, stop_engines


ENGINE = b"ray::ReplicaGenerator"  # the engine actor's process title (".load" while it loads)


def _engine_up(mark: str) -> bool:
    """Whether a process of this job (its runtime_env's marker) is the engine actor, past its
    constructor: loading its model (title ReplicaGenerator.load) or done with it (the idle
    title; start_engines asks for the load with the actor, so nothing runs before it)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].strip()
            if title in (ENGINE, ENGINE + b".load") and mark.encode() in Path(
                f"/proc/{pid}/environ"
            ).read_bytes().split(b"\0"):
                return True
        except OSError:
            continue
    return False


class WaitForEngine:
    """A preprocess that holds the plan back until the job's engine actor is up."""

    def __init__(self, mark: str, timeout_s: float = 240.0):
        self.mark, self.timeout_s = mark, timeout_s

    def __call__(self, row: dict) -> dict:
        deadline = time.time() + self.timeout_s
        while not _engine_up(self.mark):
            if time.time() > deadline:
                raise RuntimeError("no engine actor of the job was up while the job was planned")
            time.sleep(0.02)
        return {"prompt": f"Question {row['id']}: what comes next?"}


def _wait_for_free_cpus(ray, cpus: int) -> None:
    """Until the session's Ray has `cpus` CPU slots free (an earlier test's actors may still be
    giving theirs back)."""
    deadline = time.time() + 120
    while ray.available_resources().get("CPU", 0) < cpus and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= cpus, (ray.available_resources(), _alive_actors())


def _alive_actors() -> list[tuple[str, str, str]]:
    """(class, name, job) of each live actor of the session's Ray: who holds the CPUs."""
    import ray._private.state

    return [
        (a.get("ActorClassName", ""), a.get("Name", ""), a.get("JobID", ""))
        for a in ray._private.state.actors().values()
        if a.get("State") == "ALIVE"
    ]


def test_cpu_engines_start_early_only_where_the_planning_stages_keep_a_slot(ray_local, tiny_model):
    """On a cluster without GPUs, engines that would leave the tokenize pool no CPU slot start
    after the plan, as before (the session's Ray has 4 CPUs)."""
    _wait_for_free_cpus(ray_local, 4)
    config = prefixflow.ProcessorConfig(model=str(tiny_model), replicas=4)
    assert start_engines(config, engine_actor_options(config)) == {}
    config = prefixflow.ProcessorConfig(model=str(tiny_model), replicas=2)
    engines = start_engines(config, engine_actor_options(config))
    try:
        assert sorted(engines) == [0, 1]
    finally:
        stop_engines(engines)


@pytest.mark.slow
def test_engines_load_while_the_job_is_planned(ray_local, tiny_model):
    mark = f"PF_ENGINE_START={uuid.uuid4().hex}"
    config = prefixflow.ProcessorConfig(
        model=str(tiny_model),
        replicas=1,
        sampling={"max_tokens": 4, "temperature": 0},
        engine={"device": "cpu", "kv_cache_bytes": 16 << 20},
        runtime_env={"env_vars": dict([mark.split("=")])},
    )
    # CPU engines start early where the free CPUs hold them, the tokenize pool and a spare slot
    # (3 here) beside the job's own read task.
    _wait_for_free_cpus(ray_local, 4)
    # The waiting preprocess takes no CPU slot (a Dataset.map argument, as ray.data.llm's): with
    # one each, its tasks could take every free slot before Ray places the engine actor, and
    # wait for an engine that waits for them.
    processor = prefixflow.build_processor(
        config, preprocess=WaitForEngine(mark), preprocess_map_kwargs={"num_cpus": 0}
    )
    rows = processor(ray_local.data.range(6)).take_all()
    assert sorted(r["id"] for r in rows) == list(range(6)) and all(r["error"] is None for r in rows)
    # the engine that was up while the job was planned ran the rows: one actor started, none died
    report = processor.fault_report()
    assert report["actor_starts"] == {0: 1} and report["engine_failures"] == 0
