#!/usr/bin/env bash
# gpu_suite on the lent GPU machine, run from the checkout's root by the device tool:
#     bash bench/gpu_device.sh [gpu_suite args]
# That machine has torch, triton and transformers but not the project installed, and the
# checkout's prefixflow/ holds only the top-level modules (pyproject maps engine/, kernels/, ...
# into the package). So the package is assembled from symbolic links in a folder of its own, and
# the checkout's prefixflow/ moved aside (the current directory comes first on sys.path). Links,
# not copies: each module's file resolves into the checkout, where gpu_suite finds tests/gpu and
# bench/results. The report and log go to $OUT (the device tool brings it back).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
ROOT=$PWD
PKG=$(mktemp -d)/prefixflow
mkdir -p "$PKG"
[ -d prefixflow ] && mv prefixflow prefixflow_src
for f in prefixflow_src/*; do ln -s "$ROOT/$f" "$PKG/"; done
for d in pipeline engine kernels operators jobs bench; do ln -s "$ROOT/$d" "$PKG/$d"; done
export PYTHONPATH=$(dirname "$PKG"):$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}
# Which package runs (the links', not an install) and on what: a check that costs a second.
python3 -c "import prefixflow.bench.gpu_suite as m, torch; print(m.__file__, torch.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" | tee "$OUT/imports.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/nvidia_smi.csv" 2>&1
timeout "${GPU_SUITE_TIMEOUT:-540}" python3 -u -m prefixflow.bench.gpu_suite --out "$OUT/gpu_suite.json" "$@" 2>&1 | grep -v '^USDT:' | tee "$OUT/gpu_suite.log"
rc=${PIPESTATUS[0]}
cp bench/results/kernel_bench_*.json "$OUT/" 2>/dev/null
mv prefixflow_src prefixflow
exit "$rc"
