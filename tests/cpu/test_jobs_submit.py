"""`ray job submit` of `prefixflow run` to a `ray start --head` on 127.0.0.1, with Ray 2.60's
token authentication on (the secure default; see jobs/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from prefixflow.bench.fault_proxy import free_port
from prefixflow.jobs.demo import write_demo_data

BIN = Path(sys.executable).parent


def _kill_cluster(marker: str) -> None:
    """Stop only the processes of the head we started: they all carry its temp dir."""
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    for pid in map(int, found):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_ray_job_submit(tiny_model, tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    temp_dir = tempfile.mkdtemp(prefix="pfrs", dir="/tmp")  # short: Ray's socket paths are limited
    gcs_port, dash_port = free_port(), free_port()
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--dashboard-host",
            "127.0.0.1",
            "--port",
            str(gcs_port),
            "--dashboard-port",
            str(dash_port),
            "--num-cpus",
            "2",
            # the agent on a port the OS gives it (0): another Ray on this machine (the session's)
            # holds the default one, and a port picked beforehand can be taken before it binds
            "--dashboard-agent-listen-port",
            "0",
            "--disable-usage-stats",
            "--temp-dir",
            temp_dir,
            "--block",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_dashboard(dash_port)
        work = tmp_path / "work"
        work.mkdir()
        data = write_demo_data(tmp_path, num_docs=3, questions_per_doc=2, sentences_per_doc=4)
        spec = yaml.safe_load((Path(__file__).parents[2] / "jobs/examples/quickstart.yaml").read_text())
        spec.update(model=str(tiny_model), input={"path": str(data)}, replicas=1)
        spec["output"].update(path=str(tmp_path / "out"))
        (work / "job.yaml").write_text(yaml.safe_dump(spec))
        submit = [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            f"http://127.0.0.1:{dash_port}",
            "--working-dir",
            str(work),
            "--",
            "prefixflow",
            "run",
            "job.yaml",
        ]
        for _ in range(10):  # the head's job agent comes up a little after the dashboard
            result = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400)
            if "No available agent" not in result.stdout + result.stderr:
                break
            time.sleep(2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "succeeded" in result.stdout + result.stderr
        metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
        assert metrics["rows"] == 6 and metrics["rows_error"] == 0
    finally:
        _kill_cluster(temp_dir)
        try:
            head.wait(timeout=15)
        except subprocess.TimeoutExpired:
            head.kill()  # `ray start --block` can linger after its children are gone
            head.wait(timeout=15)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_dashboard(port: int, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=2)
            return
        except Exception as e:  # noqa: BLE001 - 401 without a token still means it is up
            if getattr(e, "code", None) is not None:
                return
            time.sleep(1)
    pytest.fail("the Ray head's dashboard did not come up")
