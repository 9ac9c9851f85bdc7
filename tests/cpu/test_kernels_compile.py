"""The Triton kernels compile for an H100 (sm_90) on this CPU machine: Triton's ahead-of-time
path runs the real compiler and the wheel's ptxas, which catches what the CPU interpreter
cannot (loop-carried types, layouts, shared memory). Runs in a subprocess because the kernels
must be imported without TRITON_INTERPRET."""

import json
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


PTX_CODE = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prefixflow.kernels import rotary
from prefixflow.kernels._aot_check import _signature
out = {}
for dtype in ("float16", "bfloat16", "float32"):
    for fusion in (True, rotary.FP_FUSION):
        c = dict(HEAD_DIM=128, BLOCK_H=64)
        src = ASTSource(fn=rotary._rotary_kernel, signature=_signature(rotary._rotary_kernel, dtype, c), constexprs=c)
        opts = {"num_warps": 4, "enable_fp_fusion": fusion}
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        out[f"{dtype} {fusion}"] = len(re.findall(r"\\bfma\\.", ptx))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_rotary_kernel_rounds_each_product_before_the_add():
    """sm_90 PTX of the model's rotary: with Triton's default fusion, x*cos and the add become one
    multiply-add (the product unrounded: what made it differ from torch on an H200); as the
    launcher compiles it (rotary.FP_FUSION), none."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", PTX_CODE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    fmas = json.loads(proc.stdout.splitlines()[-1])
    for dtype in ("float16", "bfloat16", "float32"):
        assert fmas[f"{dtype} True"] > 0 and fmas[f"{dtype} False"] == 0, fmas
