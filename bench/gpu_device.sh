#!/usr/bin/env bash
# gpu_suite on the lent GPU machine, run from the checkout's root by the device tool:
#     bash bench/gpu_device.sh [gpu_suite args]
# That machine has torch, triton and transformers but not the project installed, and the
# checkout's prefixflow/ holds only the top-level modules (pyproject maps engine/, kernels/, ...
# into the package). So the package is assembled from symbolic links in a folder of its own, and
# the checkout's prefixflow/ moved aside while it runs (the current directory comes first on
# sys.path), then back, however the script ends. Links, not copies: each module's file resolves
# into the checkout, where gpu_suite finds tests/gpu and bench/results. The report, the log and
# the kernel benchmark this run wrote go to $OUT (the device tool brings it back).
# tests/cpu/test_gpu_suite_dry.py runs this script with --dry-run.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
ROOT=$PWD
if [ -e prefixflow_src ]; then
    echo "prefixflow_src exists: a run of this script was cut off; move it back to prefixflow/ first" >&2
    exit 2
fi
PKG=$(mktemp -d)/prefixflow
mkdir -p "$PKG"
mv prefixflow prefixflow_src
trap 'mv "$ROOT/prefixflow_src" "$ROOT/prefixflow"' EXIT
for f in prefixflow_src/*; do ln -s "$ROOT/$f" "$PKG/"; done
for d in pipeline engine kernels operators jobs bench; do ln -s "$ROOT/$d" "$PKG/$d"; done
export PYTHONPATH=$(dirname "$PKG"):$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}
# Which package runs (the links', not an install) and on what: a check that costs a second.
python3 -c "import prefixflow.bench.gpu_suite as m, torch; print(m.__file__, torch.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" | tee "$OUT/imports.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/nvidia_smi.csv" 2>&1
STARTED=$(mktemp)
timeout "${GPU_SUITE_TIMEOUT:-540}" python3 -u -m prefixflow.bench.gpu_suite --out "$OUT/gpu_suite.json" "$@" 2>&1 \
    | grep --line-buffered -v '^USDT:' | tee "$OUT/gpu_suite.log"
rc=${PIPESTATUS[0]}
find bench/results -maxdepth 1 -name 'kernel_bench_*.json' -newer "$STARTED" -exec cp {} "$OUT/" \;
exit "$rc"
