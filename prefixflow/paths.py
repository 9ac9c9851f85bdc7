"""Where prefixflow keeps what it builds once per machine (torch-free, imports nothing of ours).

$PREFIXFLOW_CACHE, by default ~/.cache/prefixflow: converted and copied models (models/), the
generated test checkpoints (tiny/) and compiled CPU kernels (kernels/).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXFLOW_CACHE") or "~/.cache/prefixflow").expanduser()
