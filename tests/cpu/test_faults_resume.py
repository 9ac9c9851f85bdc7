"""Exactly-once output under faults, on the session's real local Ray.

1. The driver (the CLI in a subprocess) is SIGKILLed once some parts are committed; the same
   job run again with the same output path finishes it: every row once, and the rerun wrote
   only the rows that were not committed.
2. An engine actor is SIGKILLed by its pid mid-job: the job reruns the uncommitted rows and
   still ends with every row once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from prefixflow.jobs.demo import demo_rows
from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import load_spec
from prefixflow.operators.commit import COMMITS
from prefixflow.operators.write import read_output

# End to end on a real local Ray. These fault-injection jobs depend on timing and on Ray
# releasing a failed job's actors; they run with `make test-faults`, outside the CI gate, until
# they are robust (issue 8 stays open for that).
pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _job(root: Path, model: Path, rows: list[dict], replicas: int) -> Path:
    with open(root / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    spec = {
        "model": str(model), "input": {"path": str(root / "in.jsonl")},
        "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_tokens": 24},
        # Few sequences at a time, so rows finish (and parts commit) one after another.
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_num_seqs": 2},
        "replicas": replicas, "max_retries_per_row": 1,
        "output": {"path": str(root / "out"), "format": "jsonl", "rows_per_part": 2, "resume": True},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    return root / "job.yaml"


def _records(out: Path) -> list[dict]:
    d = out / COMMITS
    return [json.loads(p.read_text()) for p in sorted(d.glob("part-*.json"))] if d.exists() else []


def _wait_for_commits(out: Path, n: int, timeout_s: float, alive: callable) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline and alive():
        got = len(_records(out))
        if got >= n:
            return got
        time.sleep(0.05)
    return len(_records(out))


def _assert_exactly_once(out: Path, rows: list[dict]) -> list[dict]:
    got = read_output(str(out))
    ids = [r["id"] for r in got]
    assert len(ids) == len(rows), f"{len(ids)} output rows for {len(rows)} input rows"
    assert sorted(ids) == sorted(r["id"] for r in rows)
    assert sorted(r["row_id"] for r in got) == list(range(len(rows)))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["row_ids"] == list(range(len(rows))) and (out / "_SUCCESS").exists()
    return got


def test_driver_sigkill_then_rerun_is_exactly_once(ray_local, tiny_model, tmp_path):
    rows = demo_rows(num_docs=6, questions_per_doc=6, sentences_per_doc=4, seed=5)  # 36 rows
    job = _job(tmp_path, tiny_model, rows, replicas=1)
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    proc = subprocess.Popen([sys.executable, "-m", "prefixflow.jobs.run", str(job)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen = _wait_for_commits(out, 2, 240, lambda: proc.poll() is None)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    err = proc.stderr.read().decode(errors="replace")[-3000:]
    assert seen >= 2 and not (out / "_SUCCESS").exists(), f"the job ended before it was killed:\n{err}"
    time.sleep(2)  # let Ray reap the dead driver's actors and tasks
    metrics = run_job(load_spec(job), quiet=True)  # the same job, the same output path
    ft = metrics["fault_tolerance"]
    assert 0 < ft["rows_committed_before"] < len(rows)
    # The rerun wrote exactly the rows that were not committed: nothing committed was redone.
    assert ft["rows_written"] == ft["rows_last_attempt"] == len(rows) - ft["rows_committed_before"]
    assert metrics["rows"] == len(rows) and metrics["rows_error"] == 0
    got = _assert_exactly_once(out, rows)
    assert all(r["error"] is None for r in got)
    print(f"\ndriver kill: {len(rows)} rows, 1 replica, committed before kill "
          f"{ft['rows_committed_before']}, redone {ft['rows_written']}, lost 0")


def _engine_pids() -> list[int]:
    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ReplicaGenerator" in cmd and "ray::" in cmd:
            pids.append(p.info["pid"])
    return pids


def test_engine_actor_sigkill_reruns_uncommitted_rows(ray_local, tiny_model, tmp_path):
    rows = demo_rows(num_docs=6, questions_per_doc=6, sentences_per_doc=4, seed=6)  # 36 rows
    job = _job(tmp_path, tiny_model, rows, replicas=2)
    out = tmp_path / "out"
    result: dict = {}

    def run() -> None:
        try:
            result["metrics"] = run_job(load_spec(job), quiet=True)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    seen = _wait_for_commits(out, 1, 240, thread.is_alive)
    pids = _engine_pids()
    killed = False
    if seen and pids and not (out / "_SUCCESS").exists():
        os.kill(pids[0], signal.SIGKILL)
        killed = True
    thread.join(timeout=400)
    assert not thread.is_alive() and "error" not in result, result.get("error")
    assert killed, f"no engine actor to kill (commits seen: {seen}, pids: {pids})"
    ft = result["metrics"]["fault_tolerance"]
    assert ft["engine_failures"] >= 1 and ft["rows_given_up"] == 0
    got = _assert_exactly_once(out, rows)
    assert all(r["error"] is None for r in got)
    assert ft["rows_written"] == len(rows) and result["metrics"]["rows"] == len(rows)
    # The attempt after the kill ran only the rows not committed when the actor died.
    assert ft["rows_last_attempt"] == len(rows) - ft["rows_committed_at_failures"][-1]
    print(f"\nengine kill: {len(rows)} rows, 2 replicas, 1 actor SIGKILLed, failures "
          f"{ft['engine_failures']}, committed at failure {ft['rows_committed_at_failures']}, "
          f"redone {ft['rows_last_attempt']}, lost 0")
