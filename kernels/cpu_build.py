"""Builds and loads the C libraries of the CPU kernels (kernels/cpu_kernels.py, cpu_exact.py).

Each library is compiled once per machine with the system C compiler (well under a second) into
$PREFIXFLOW_CACHE/kernels/, keyed by its source, the compiler, the flags and the CPU's feature
flags (-march=native code is only valid on CPUs that have them). It links the libgomp that
torch has already loaded, so its OpenMP loops share torch's thread pool. Without a compiler, or
with PREFIXFLOW_CPU_KERNELS=0, `load` returns None and callers keep their torch code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from prefixflow.paths import cache_root

log = logging.getLogger(__name__)


# On x86, 512-bit vectors where the CPU has them (GCC picks 256 by default even then): decode
# steps of peer_bench's shapes took 21-27% less time in the attention kernel (Sapphire Rapids).
NATIVE_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",
    *(["-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []),
]


def vector_floats() -> int:
    """Floats in one of this CPU's vector registers, the width the C kernels are written in:
    16 with AVX-512, 8 with AVX, else 4 (SSE, NEON). A wider vector type than the CPU has is
    legal C, but GCC lowers it through the stack: 16-float vectors on an AVX2 CPU (this
    project's CI machines) made the attention kernel 3-6x slower than 8-float ones (SmolLM2
    shapes, batch 1 to 256). PREFIXFLOW_CPU_VECTOR_FLOATS=4|8|16 overrides (the tests build
    every width)."""
    forced = os.environ.get("PREFIXFLOW_CPU_VECTOR_FLOATS")
    if forced:
        if forced not in ("4", "8", "16"):
            raise ValueError(f"PREFIXFLOW_CPU_VECTOR_FLOATS={forced!r}: expected 4, 8 or 16")
        return int(forced)
    flags = set(_cpu_flags().split())
    if "avx512f" in flags:
        return 16
    return 8 if "avx" in flags else 4


def enabled() -> bool:
    return os.environ.get("PREFIXFLOW_CPU_KERNELS", "1") != "0"


def load(name: str, source: str, flags: list[str], signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The library `name` built from `source` with `flags` (built on first use), its functions
    given `signatures` (argtypes; they return nothing); None where no C compiler can build it."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.info("no C compiler: the CPU kernels run as torch code")
        return None
    key = hashlib.sha256("\0".join([source, cc, *flags, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    path = kernel_dir() / f"{name}_{key}.so"
    try:
        if not path.exists():
            _compile(cc, source, flags, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        log.warning("could not build the CPU kernels %s (%s); using the torch code", name, e)
        return None
    for fn_name, argtypes in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def kernel_dir() -> Path:
    """Where the built libraries are kept, one file per source, compiler, flags and CPU."""
    return cache_root() / "kernels"


def _compile(cc: str, source: str, flags: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / f"{path.stem}.c", Path(tmp) / f"{path.stem}.so"
        src.write_text(source)
        subprocess.run(
            [cc, *flags, "-shared", "-fPIC", str(src), "-o", str(lib), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(lib, path)  # atomic: processes building at once each install a whole file


def _cpu_flags() -> str:
    """The CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
