"""The Triton kernels compile for an H100 (sm_90) on this CPU machine: Triton's ahead-of-time
path runs the real compiler and the wheel's ptxas, which catches what the CPU interpreter
cannot (loop-carried types, layouts, shared memory). Runs in a subprocess because the kernels
must be imported without TRITON_INTERPRET."""

import os
import subprocess
import sys

import pytest

CODE = """
from prefixflow.kernels._aot_check import compile_all
rows = compile_all(90, ("bfloat16",))
print(max(r["shared_bytes"] for r in rows), len(rows))
"""

A100_MAX_SHARED = 166912  # bytes per block (opt-in); every config must fit the smaller GPU


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    max_shared, num_configs = map(int, proc.stdout.split()[-2:])
    assert num_configs >= 12
    assert 0 < max_shared <= A100_MAX_SHARED
