"""Shared test setup.

TRITON_INTERPRET must be set before anything imports triton: on machines without a GPU the
Triton kernels are checked through Triton's CPU interpreter. On a CUDA machine the real
compiler runs (tests/gpu).
"""

import importlib
import os

try:
    import torch  # only to ask whether CUDA exists

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray, Ray Data, transformers and huggingface_hub give their loggers a stream handler bound to
# the sys.stderr of the moment they are first imported (or configured). Imported first inside
# a test that captures output (capsys), that is the test's capture, closed when the test ends:
# every later record of theirs in this process prints '--- Logging error ---' with a traceback
# (test_fuzz_jobs, which asserts a run prints none, saw one in a full run). Imported here, at
# collection, they bind to the session's own capture instead.
for _module in ("ray.data", "transformers"):
    try:
        importlib.import_module(_module)
    except ImportError:  # the lent GPU machine has no Ray (../shared/NOTES.md)
        pass
