"""`gpu_suite --dry-run` on the CPU (issue 42): every section of what a GPU session runs, at tiny
shapes, to its end, so that a lent GPU's 15 minutes are not spent on a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# What the GPU machine does not have (../shared/NOTES.md): the suite runs there without them. A
# module the engine imports at load time from one of these (tenacity, through model_source and
# storage) cost a lent GPU's first run every engine number.
NOT_ON_THE_GPU_MACHINE = ("ray", "pydantic", "vllm", "tenacity", "fsspec", "s3fs", "boto3", "botocore", "numba", "moto")


def test_the_gpu_suite_runs_to_its_end_on_the_cpu(tmp_path):
    out = tmp_path / "suite.json"
    # A sitecustomize that makes importing those modules fail, in this process's children too.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        f"import sys\nfor _m in {NOT_ON_THE_GPU_MACHINE!r}:\n    sys.modules[_m] = None\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "prefixflow.bench.gpu_suite", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
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
        # The runner's phases were profiled (engine/native/step.py); per decode step they are a
        # difference of two runs, whose sign is noise as above: the runs' own totals are checked.
        phases = got["runs"]["with_decode"]["host_phases_s"]
        assert all(phases[name] > 0 for name in ("prefixflow.prepare", "prefixflow.forward", "prefixflow.sample"))
        assert set(got["host_ms_per_decode_step"]) >= {"prepare", "forward", "sample", "scheduler_and_engine"}
    assert decode["weights_floor_s"] > 0
    warm = engine["warmup"]
    assert warm["cold"]["total_s"] > 0 and warm["cached"]["total_s"] > 0, warm
    assert set(engine["goals"]) >= {"float32_parity_exact", "decode_step_64_at_most_2ms", "warmup_cached_at_most_5s"}
