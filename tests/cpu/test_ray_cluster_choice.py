"""Which Ray cluster a run uses (issue 27, class 12): the one named by --address or
RAY_ADDRESS, else a new local one, never a cluster that happens to run on the machine; the run
says which on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow


def _spec(tmp_path, model) -> str:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(3)))
    spec = {
        "model": str(model),
        "input": {"path": str(tmp_path / "in.jsonl")},
        "prompt": {"template": "Q: {{ q }}"},
        "engine": {"device": "cpu"},
        "output": {"path": str(tmp_path / "out")},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return str(tmp_path / "job.yaml")


def _plan(spec: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefixflow.cli", "plan", spec], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_run_without_an_address_starts_its_own_cluster(ray_local, tiny_model, tmp_path):
    import ray._private.state

    spec = _spec(tmp_path, tiny_model)
    drivers_before = len(ray._private.state.jobs())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = _plan(spec, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Ray: started a local cluster for this run" in proc.stderr
    # The session's cluster runs on this machine, and the run did not join it. (A run given
    # RAY_ADDRESS joins that cluster and says so: every `start_driver` job does, and
    # tests/cpu/test_resume_safety.py's lock test asserts the line.)
    assert len(ray._private.state.jobs()) == drivers_before
