"""Fixtures shared by the CPU tests: one real local Ray for the session, an S3 server (moto) on
loopback, and the tiny demo checkpoint. Ray starts in about 8 s, so tests share one instance
(and subprocesses such as the notebook join it through RAY_ADDRESS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixflow.bench.fault_proxy import start_moto_server
from prefixflow.jobs.run import LOCAL_CLUSTER_SYSTEM_CONFIG

# Every Ray cluster the tests start (the session's, Ray's multi-node test cluster, a run's own)
# keeps idle workers as the local cluster of `prefixflow run` does: a node reads RAY_<setting>
# from its environment when it starts. At Ray's default a job's bursts of small tasks start
# their workers anew each time; it cut these modules' CPU time by 9% (test_zero_good_rows,
# test_resume_safety and test_api_processor: 118 -> 107 CPU-s).
for _key, _value in LOCAL_CLUSTER_SYSTEM_CONFIG.items():
    os.environ.setdefault(f"RAY_{_key}", str(_value))
# ... and lets those idle workers go (after that threshold) however many CPUs are free: at Ray's
# default up to one per CPU stays for good, each polling at ~0.7 CPU-s a minute, and the pytest
# process's own job (its in-process Python API jobs) kept 2-4 such workers on each xdist
# worker's cluster for the whole suite (an idle cluster: 3.9 -> 2.5 CPU-s a minute). A job's
# workers still serve its next burst of tasks within the threshold.
os.environ.setdefault("RAY_num_workers_soft_limit", "0")
# Each node's log monitor looks for new worker log files every 0.1 s while it follows fewer than
# this many (Ray's default 1,000), every 0.5 s above: a suite's clusters hold hundreds, each
# look a listing of the whole folder (an idle node with 200 such files: 0.30 -> 0.09 CPU-s in
# 20 s). A worker's lines still reach its driver, found up to 0.5 s later.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray (4 CPU slots on this 2-core machine, loopback only) shared by every test
    that asks for it. 4, not 2: a job's pipeline holds an actor per stage (tokenize, engine) and
    needs a slot for its small tasks besides; with 2, an actor pool a finished test left behind
    for a moment can hold the slot that the next job's engine waits for, and that job waits forever."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            address="local",
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The demo's tiny Llama checkpoint (written once per session)."""
    from prefixflow.jobs.demo import demo_checkpoint

    return demo_checkpoint(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1; yields its endpoint URL. Dummy credentials are set in
    the environment (before any Ray worker that needs them starts) and passed explicitly."""
    proc, endpoint = start_moto_server()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(key, value)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def start_driver(ray_local, tmp_path):
    """Starts `python -m prefixflow.cli run SPEC` as its own Ray driver on the session's
    cluster and returns the process (output in tmp_path/driver-N.log). A driver in its own
    process takes its engine actors with it when it exits, however it ends, so a failed or
    killed job never holds the CPUs that later tests need."""
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}

    def start(spec: Path) -> subprocess.Popen:
        log = open(tmp_path / f"driver-{len(procs)}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixflow.cli", "run", str(spec)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def vector_floats(request, monkeypatch):
    """The C kernels rebuilt in another vector width (request.param: 4, 8 or 16) for one test,
    since every CPU builds its own (kernels/cpu_build.vector_floats); then the machine's own."""
    from prefixflow.kernels import cpu_kernels, cpu_linear

    def clear() -> None:
        cpu_kernels._library.cache_clear()
        cpu_linear._library.cache_clear()

    monkeypatch.setenv("PREFIXFLOW_CPU_VECTOR_FLOATS", str(request.param))
    clear()
    yield request.param
    monkeypatch.undo()
    clear()
