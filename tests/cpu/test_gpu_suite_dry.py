"""`gpu_suite --dry-run` on the CPU (issue 42): every section of what a GPU session runs, at tiny
shapes, to its end, so that a lent GPU's 15 minutes are not spent on a crash. It runs as the GPU
machine runs it: through bench/gpu_device.sh, in a copy of the checkout, with `python3` as the
interpreter and without the modules that machine lacks."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# What the GPU machine does not have (../shared/NOTES.md): the suite runs there without them. A
# module the engine imports at load time from one of these (tenacity, through model_source and
# storage) cost a lent GPU's first run every engine number.
NOT_ON_THE_GPU_MACHINE = ("ray", "pydantic", "vllm", "tenacity", "fsspec", "s3fs", "boto3", "botocore", "numba", "moto")


REPO = Path(__file__).resolve().parents[2]
# What gpu_device.sh needs of the checkout: the package's folders (pyproject's package-dir) and the
# tests (tests/gpu, and tests/ on the path).
CHECKOUT = ("prefixflow", "pipeline", "engine", "kernels", "operators", "jobs", "bench", "tests")


def test_the_gpu_suite_runs_to_its_end_on_the_cpu(tmp_path):
    checkout, out = tmp_path / "checkout", tmp_path / "out"
    skip = shutil.ignore_patterns("__pycache__", "results", "*.pyc")
    for folder in CHECKOUT:
        shutil.copytree(REPO / folder, checkout / folder, ignore=skip)
    # A sitecustomize that makes importing those modules fail, in every process the script starts,
    # and `python3` the interpreter running this test (the script calls python3, as there).
    blocker, bin_dir = tmp_path / "blocker", tmp_path / "bin"
    blocker.mkdir()
    bin_dir.mkdir()
    (blocker / "sitecustomize.py").write_text(
        f"import sys\nfor _m in {NOT_ON_THE_GPU_MACHINE!r}:\n    sys.modules[_m] = None\n"
    )
    python3 = bin_dir / "python3"  # a script, not a link: a venv's python finds its venv by its own path
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": str(blocker),
        "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
        "OUT": str(out),
    }
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_device.sh"), "--dry-run"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The package the script assembled ran, not this checkout's install, and the checkout's own
    # prefixflow/ is back where it was.
    imported = (out / "imports.txt").read_text()
    assert "prefixflow/bench/gpu_suite.py" in imported and str(REPO) not in imported, imported
    assert (checkout / "prefixflow" / "__init__.py").exists() and not (checkout / "prefixflow_src").exists()
    report = json.loads((out / "gpu_suite.json").read_text())
    # The GPU tests were collected and each skipped itself (no CUDA), none failed.
    tests = report["gpu_tests"]
    assert tests["failed"] == tests["errors"] == 0 and tests["skipped"] > 0, tests
    # Every kernel benchmark ran once, each sweep config too (a dry run raises on a failing one).
    bench = report["kernel_bench"]
    kernels = {r["kernel"] for r in bench["results"]}
    assert kernels == {
        "paged_decode",
        "prefix_shared_decode",
        "prefix_shared_mixed",
        "packed_prefill",
        "write_kv_cache",
        "rms_norm_residual",
        "rotary_qk",
    }, kernels
    assert all(r["ours_ms"] > 0 for r in bench["results"])
    assert all(row["ms"] > 0 for rows in bench["sweeps"].values() for row in rows)
    prefix = next(r for r in bench["results"] if r["kernel"] == "prefix_shared_decode")
    assert prefix["max_abs_diff_vs_paged_decode"] < 1e-4  # the two kernels agree (float32)
    engine = report["engine"]
    # Each engine part ran (gpu_engine records a failing part's error and goes on).
    failed = {name: part["error"] for name, part in engine.items() if isinstance(part, dict) and "error" in part}
    assert not failed, failed
    # The native engine matched transformers token for token (float32, on the CPU here).
    assert engine["parity"]["exact"], engine["parity"]
    decode = engine["decode"]
    for batch in ("2", "4"):
        got = decode[batch]
        # A difference of two wall times: its sign is noise on a busy CPU (it came out -13 ms
        # at a load average of 12), so only that it was measured is checked here.
        assert isinstance(got["decode_step_s"], float) and got["torch_ops_per_decode_step"] > 0, got
        # The run asking for more tokens took more steps: its decode steps.
        assert got["runs"]["first_token"]["steps"] < got["runs"]["with_decode"]["steps"]
        assert got["device_busy_share"] is None  # nothing on a device to measure
        # The graphs' run took its decode steps on the static buffers (no graph on a CPU); eager's did not.
        graphs = engine["decode_cuda_graphs"][batch]
        assert graphs["static_steps"] >= 4 and graphs["graph_replays"] == 0, graphs
        assert got["static_steps"] is None, got
        assert got["device_ms_per_decode_step_by_kernel"] == {}  # no device kernels on a CPU
        # The runner's phases were profiled (engine/native/phases.py); per decode step they are a
        # difference of two runs, whose sign is noise as above: the runs' own totals are checked.
        phases = got["runs"]["with_decode"]["host_phases_s"]
        assert all(phases[name] > 0 for name in ("prefixflow.prepare", "prefixflow.forward", "prefixflow.sample"))
        assert set(got["host_ms_per_decode_step"]) >= {"prepare", "forward", "sample", "scheduler_and_engine"}
        # and the host's Python by function (file:line(name)), each run's 40 largest kept
        functions = got["runs"]["with_decode"]["python_s_by_function"]
        assert len(functions) == 40 and all(re.fullmatch(r".+:\d+\(.+\)", name) for name in functions), functions
        assert len(got["python_ms_per_decode_step_by_function"]) == 25
    assert decode["weights_floor_s"] > 0
    assert all(engine["parity_cuda_graphs"][arch]["static_steps"] > 0 for arch in ("llama", "qwen2"))
    # One decode step's logits three ways: on a CPU the static buffers compute what eager does.
    same = engine["graphs_vs_eager"]
    assert same["batch"] == 2 and same["graph_vs_eager"]["equal"] and same["eager_vs_eager_wide_tables"]["equal"], same
    # The engine with graphs as a job builds it decoded at the top rung on its buffers.
    budget = engine["default_budget"]
    assert budget["batch"] == 4 and budget["static_steps"] >= 4 and budget["num_kv_blocks"] > 0, budget
    warm = engine["warmup"]
    assert warm["cold"]["total_s"] > 0 and warm["cached"]["total_s"] > 0, warm
    assert set(engine["goals"]) >= {"float32_parity_exact", "decode_step_64_at_most_2ms", "warmup_cached_at_most_5s"}


def test_the_busy_share_counts_device_work_not_the_hosts_named_ranges():
    """torch's profiler lists a host range (engine/native/phases.py) on CUDA as a device event too,
    spanning its first kernel to its last: counted, it would fill the gaps it spans."""
    from types import SimpleNamespace

    import torch

    from prefixflow.bench.gpu_engine import _by_kernel, _per_step_ms, device_kernels
    from prefixflow.bench.record import covered_length

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(start, end, device=cuda, annotation=False):
        return SimpleNamespace(
            device_type=device, is_user_annotation=annotation, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [event(0, 10), event(30, 40), event(0, 40, annotation=True), event(0, 100, device=cpu)]
    kernels = device_kernels(events)
    assert kernels == events[:2]
    assert covered_length([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e6 == 20e-6
    # and by kernel name, per decode step: the run with 2 decode steps less the run with none
    for e, name in zip(kernels, ("gemm", "attention")):
        e.name = name
    first = {"device_s_by_kernel": _by_kernel(kernels[:1])}
    full = {"device_s_by_kernel": _by_kernel(kernels + kernels)}
    assert _per_step_ms(first, full, "device_s_by_kernel", 2) == {"attention": 0.01, "gemm": 0.005}


def test_a_run_of_some_sections_keeps_the_others_in_the_report(tmp_path):
    """gpu_suite --sections: a second run in one lease rewrites its sections only."""
    from prefixflow.bench.gpu_suite import write_section

    path = tmp_path / "gpu_suite.json"
    write_section(path, "tests", {"passed": 1}, fresh=True)
    write_section(path, "engine", {"step": 1}, fresh=False)
    write_section(path, "engine", {"step": 2}, fresh=False)  # the second run's
    report = json.loads(path.read_text())
    assert report["tests"] == {"passed": 1} and report["engine"] == {"step": 2}
    assert set(report["written"]) == {"tests", "engine"}
    write_section(path, "tests", {"passed": 3}, fresh=True)  # a run of every section starts afresh
    assert set(json.loads(path.read_text())) == {"tests", "written"}
