"""Exactly-once output under process faults, on the session's real local Ray.

Each job runs as its own driver process (the `start_driver` fixture), as under `ray job
submit`. Faults are real SIGKILLs, aimed by pid:

1. the driver is killed once some parts are committed; the same job run again with the same
   output path finishes it: every row once, and the rerun wrote only the uncommitted rows;
2. the engine actor that wrote a part (its pid is in the commit record) is killed mid-job:
   a new actor runs only that replica's uncommitted rows, the other replica runs on, and the
   job ends with every row once;
3. work stealing under a kill: one engine fits the cluster at a time, so the first one up
   takes the other replica's units too; it is killed after committing a part of a stolen
   unit, and the units it held run once more on the next actor up;
4. the engine actor of a replica keeps dying at work without committing anything: after
   max_retries_per_row + 1 such deaths in a row the replica's rows left become error records,
   and the job still finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from prefixflow.bench.fault_bench import engine_pids, local_records, worker_pid, writers_overlap
from prefixflow.jobs.demo import demo_rows
from prefixflow.operators.results.sink import sink_name
from prefixflow.operators.results.write import read_output

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 300


def _job(
    root: Path,
    model: Path,
    rows: list[dict],
    replicas: int,
    max_retries: int = 1,
    rows_per_part: int = 2,
    cpus_per_replica: int = 1,
) -> Path:
    with open(root / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    spec = {
        "model": str(model),
        "input": {"path": str(root / "in.jsonl")},
        "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_tokens": 24},
        # Few sequences at a time, so rows finish (and parts commit) one after another.
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_num_seqs": 2},
        "replicas": replicas,
        "max_retries_per_row": max_retries,
        "resources": {"num_cpus_per_replica": cpus_per_replica},
        "output": {"path": str(root / "out"), "format": "jsonl", "rows_per_part": rows_per_part, "resume": True},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    return root / "job.yaml"


def _wait(cond: Callable[[], bool], proc: subprocess.Popen, what: str, timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the driver ended before {what}:\n{_log(proc)}"
        assert time.time() < deadline, f"no {what} within {timeout_s} s:\n{_log(proc)}"
        time.sleep(0.02)


def _finish(proc: subprocess.Popen) -> None:
    rc = proc.wait(timeout=JOB_TIMEOUT_S)
    assert rc == 0, f"the job failed (exit {rc}):\n{_log(proc)}"


def _log(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text(errors="replace")[-4000:]  # type: ignore[attr-defined]


def _fault_tolerance(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())["fault_tolerance"]


def _assert_exactly_once(out: Path, rows: list[dict]) -> list[dict]:
    got = read_output(str(out))
    ids = [r["id"] for r in got]
    assert len(ids) == len(rows), f"{len(ids)} output rows for {len(rows)} input rows"
    assert sorted(ids) == sorted(r["id"] for r in rows)
    assert sorted(r["row_id"] for r in got) == list(range(len(rows)))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["row_ids"] == list(range(len(rows))) and (out / "_SUCCESS").exists()
    return got


def test_driver_sigkill_then_rerun_is_exactly_once(start_driver, tiny_model, tmp_path):
    rows = demo_rows(num_docs=6, questions_per_doc=6, sentences_per_doc=4, seed=5)  # 36 rows
    job = _job(tmp_path, tiny_model, rows, replicas=1)
    out = tmp_path / "out"
    before = engine_pids()
    proc = start_driver(job)
    _wait(lambda: len(local_records(out)) >= 2, proc, "two committed parts")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (out / "_SUCCESS").exists()
    # Ray ends a dead driver's actors; wait for that, so the rerun is alone on the output path.
    deadline = time.time() + 60
    while engine_pids() - before and time.time() < deadline:
        time.sleep(0.1)
    committed = {r for rec in local_records(out) for r in rec["row_ids"]}
    rerun = start_driver(job)  # the same job, the same output path
    _finish(rerun)
    ft = _fault_tolerance(out)
    assert ft["rows_committed_before"] == len(committed) and 0 < len(committed) < len(rows)
    # The rerun wrote exactly the rows that were not committed: nothing committed was redone.
    assert ft["rows_written"] == ft["rows_reported"] == len(rows) - len(committed)
    got = _assert_exactly_once(out, rows)
    assert all(r["error"] is None for r in got)
    print(
        f"\ndriver kill: {len(rows)} rows, 1 replica, committed before the kill "
        f"{len(committed)}, redone {ft['rows_written']}, lost 0"
    )


def test_engine_actor_sigkill_reruns_uncommitted_rows(start_driver, tiny_model, tmp_path):
    rows = demo_rows(num_docs=6, questions_per_doc=6, sentences_per_doc=4, seed=6)  # 36 rows
    job = _job(tmp_path, tiny_model, rows, replicas=2)
    out = tmp_path / "out"
    proc = start_driver(job)
    _wait(lambda: len(local_records(out)) >= 1, proc, "a committed part")
    record = local_records(out)[0]
    os.kill(worker_pid(record), signal.SIGKILL)  # the engine actor that wrote this part
    killed = record["replica"]
    _finish(proc)
    ft = _fault_tolerance(out)
    assert ft["engine_failures"] == 1 and ft["rows_given_up"] == 0, ft
    got = _assert_exactly_once(out, rows)
    assert all(r["error"] is None for r in got)
    assert ft["rows_written"] == len(rows)
    failure = ft["failures"][0]
    assert failure["item"] == killed and failure["engine_loaded"]
    # The dead actor held units with uncommitted rows; they went back to the work queue and ran
    # once more, on its replica's new actor or on the other replica (work stealing), whose
    # actor was never stopped.
    assert failure["units_held"] >= 1 and failure["item_rows_left"] > 0
    records = local_records(out)
    workers = {r: {rec["worker"] for rec in records if rec["replica"] == r} for r in (0, 1)}
    assert len(workers[1 - killed]) == 1, workers
    by_others = sum(len(rec["row_ids"]) for rec in records if rec["worker"] != record["worker"])
    by_dead = sum(len(rec["row_ids"]) for rec in records if rec["worker"] == record["worker"])
    assert by_dead + by_others == len(rows) and by_dead < len(rows)
    assert not writers_overlap(records), "two engine actors of one replica wrote parts at once"
    print(
        f"\nengine kill: {len(rows)} rows, 2 replicas, the actor of replica {killed} SIGKILLed "
        f"holding {failure['item_rows_left']} uncommitted rows, which the live actors ran; lost 0"
    )


def test_units_of_a_replica_that_cannot_start_are_taken_and_a_kill_loses_nothing(start_driver, tiny_model, tmp_path):
    rows = demo_rows(num_docs=6, questions_per_doc=6, sentences_per_doc=4, seed=8)  # 36 rows
    # The session's cluster has 4 CPU slots: one engine of 3 at a time, so the other replica's
    # actor waits while the first runs dry and takes its units (a part named after one plan
    # replica, written by the other).
    job = _job(tmp_path, tiny_model, rows, replicas=2, cpus_per_replica=3)
    out = tmp_path / "out"
    proc = start_driver(job)

    def stolen() -> list[dict]:
        return [r for r in local_records(out) if not r["part"].startswith(f"part-r{r['replica']:03d}-")]

    _wait(lambda: bool(stolen()), proc, "a committed part of a stolen unit")
    record = stolen()[0]
    os.kill(worker_pid(record), signal.SIGKILL)
    _finish(proc)
    ft = _fault_tolerance(out)
    got = _assert_exactly_once(out, rows)
    assert all(r["error"] is None for r in got) and ft["rows_written"] == len(rows)
    assert ft["engine_failures"] == 1 and ft["rows_given_up"] == 0, ft
    failure = ft["failures"][0]
    assert failure["item"] == record["replica"] and failure["engine_loaded"] and failure["item_rows_left"] > 0
    steals = ft["work_queue"]["steals"]
    assert steals and all(s["to"] != s["from"] for s in steals)
    assert any(s["to"] == record["replica"] for s in steals)
    assert not writers_overlap(local_records(out)), "two engine actors of one replica wrote parts at once"


def test_engine_that_keeps_dying_gives_its_rows_up_as_errors(start_driver, ray_local, tiny_model, tmp_path):
    rows = demo_rows(num_docs=4, questions_per_doc=6, sentences_per_doc=4, seed=7)  # 24 rows
    job = _job(tmp_path, tiny_model, rows, replicas=1, max_retries=1, rows_per_part=4)
    out = tmp_path / "out"
    proc = start_driver(job)
    # Run 1 commits a part, then its actor is killed; the next two actors are killed as soon as
    # their engine is loaded (the job's sink says so), before they commit anything. With
    # max_retries_per_row: 1, the second death in a row without progress gives the replica up.
    _wait(lambda: len(local_records(out)) >= 1, proc, "a committed part")
    os.kill(worker_pid(local_records(out)[0]), signal.SIGKILL)
    sink = _job_sink(ray_local, out, proc)
    seen = set(ray_local.get(sink.status.remote())["engines_ready"])
    for attempt in (2, 3):

        def loaded() -> dict:
            engines = ray_local.get(sink.status.remote())["engines_ready"]
            return {t: e for t, e in engines.items() if t not in seen}

        _wait(lambda: bool(loaded()), proc, f"run {attempt}'s engine loaded")
        token, engine = next(iter(loaded().items()))
        os.kill(engine["pid"], signal.SIGKILL)
        seen.add(token)
    _finish(proc)
    ft = _fault_tolerance(out)
    assert ft["engine_failures"] == 3, ft
    assert all(f["engine_loaded"] and f["item"] == 0 for f in ft["failures"])
    kept = ft["failures"][1]["rows_committed"]  # what run 1 committed before its kill
    assert kept > 0 and [f["rows_committed"] for f in ft["failures"]][1:] == [kept, kept]
    assert ft["replicas_given_up"] == [0] and ft["rows_given_up"] == len(rows) - kept
    got = _assert_exactly_once(out, rows)
    errors = [r for r in got if r["error"] is not None]
    assert len(errors) == len(rows) - kept
    assert all("the engine failed on this row in every attempt" in r["error"] for r in errors)
    assert all(r["generated_text"] for r in got if r["error"] is None)
    print(
        f"\nengine keeps dying: {len(rows)} rows, 1 replica, 3 actors SIGKILLed, "
        f"{kept} rows done, {ft['rows_given_up']} given up as error rows, lost 0"
    )


def _job_sink(ray, out: Path, proc: subprocess.Popen):
    """The running job's actor (its sink, JobHub), found by its name."""
    fingerprint = json.loads((out / "_job.json").read_text())["fingerprint"]
    name = sink_name(fingerprint, proc.pid)
    deadline = time.time() + 60
    while True:
        try:
            return ray.get_actor(name, namespace="prefixflow")
        except ValueError:
            assert time.time() < deadline, f"no actor {name}"
            time.sleep(0.1)
