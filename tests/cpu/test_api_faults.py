"""The Python API runs its replicas under the same driver as a job from a spec
(operators/stages/supervise.py): an engine actor SIGKILLed mid-job is restarted alone, its
uncommitted rows run again, the other replica never stops, and the Dataset holds every row once.
Executed again, the same Dataset runs the job again from nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from prefixflow.bench.fault_bench import worker_pid
from prefixflow.jobs.demo import demo_rows
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.faces.processor import Processor

pytestmark = pytest.mark.slow

TIMEOUT_S = 300


def _kill_first_writer(processor: Processor, killed: dict, stop: threading.Event) -> None:
    """Wait for the job's first committed block, then SIGKILL the engine actor that made it."""
    import ray

    deadline = time.time() + TIMEOUT_S
    while not stop.is_set() and time.time() < deadline:
        runs = ray.get(processor.sink.active_runs.remote()) if processor.sink is not None else []
        for run in runs:
            parts = ray.get(processor.sink.committed_rows.remote(run)).manifests
            if parts:
                killed.update(parts[0])
                os.kill(worker_pid(parts[0]), signal.SIGKILL)
                return
        time.sleep(0.02)


def test_a_python_api_job_survives_a_killed_engine_actor(ray_local, tiny_model):
    rows = demo_rows(num_docs=6, questions_per_doc=6, sentences_per_doc=4, seed=6)  # 36 rows
    config = ProcessorConfig(
        model=str(tiny_model),
        prompt={"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        sampling={"temperature": 0, "max_tokens": 24},
        replicas=2,
        rows_per_chunk=2,
        max_retries_per_row=1,
        # Few sequences at a time, so rows finish (and blocks commit) one after another.
        engine={"device": "cpu", "kv_cache_bytes": 16 << 20, "max_num_seqs": 2},
    )
    processor = Processor(config)
    out = processor(ray_local.data.from_items(rows))  # builds the sink; nothing runs yet
    killed: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_first_writer, args=(processor, killed, stop), daemon=True)
    killer.start()
    try:
        got = out.take_all()
    finally:
        stop.set()
        killer.join(timeout=10)
    assert killed, "no block was committed before the job ended"
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)  # every row, once
    assert all(r["error"] is None for r in got)
    faults = processor.fault_report()
    assert faults is not None and faults["engine_failures"] == 1 and faults["rows_given_up"] == 0, faults
    failure = faults["failures"][0]
    assert failure["item"] == killed["replica"] and failure["engine_loaded"]
    assert failure["item_rows_left"] > 0  # the dead actor held rows that ran again
    # Its replica started again on a new actor; the other one's actor never stopped.
    assert faults["actor_starts"] == {killed["replica"]: 2, 1 - killed["replica"]: 1}, faults
    # The same Dataset executed again runs the job again, from nothing (the first run's commits
    # are its own), without a fault: every row once more, the same answers (greedy decoding).
    again = out.take_all()
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in rows)
    assert {r["id"]: r["generated_text"] for r in got} == {r["id"]: r["generated_text"] for r in again}
    assert ray_local.get(processor.sink.active_runs.remote()) == []  # both runs let their blocks go
    print(
        f"\nPython API engine kill: {len(rows)} rows, 2 replicas, the actor of replica {killed['replica']} "
        f"SIGKILLed holding {failure['item_rows_left']} uncommitted rows; lost 0, repeated 0"
    )
