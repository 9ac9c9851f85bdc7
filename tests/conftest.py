"""Shared test setup.

TRITON_INTERPRET must be set before anything imports triton: on machines without a GPU the
Triton kernels are checked through Triton's CPU interpreter. On a CUDA machine the real
compiler runs (tests/gpu).
"""

import os

try:
    import torch  # only to ask whether CUDA exists

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
