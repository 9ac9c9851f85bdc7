"""A step's host phases, named for torch's profiler: the step's arrays built and copied in
(PREPARE), the forward launched or a graph replayed (FORWARD; on a GPU the host does not wait
for the device here), and sampling (SAMPLE, which waits for it: the sampled ids' copy).
bench/gpu_engine.py reads them per decode step, the rest of a step being the scheduler's and the
engine's. A range costs about 5 us when no profiler runs (a dispatcher call), 25 us a step: so
`phase` opens one only while a profiler records.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.profiler import record_function

PREPARE, FORWARD, SAMPLE = "prefixflow.prepare", "prefixflow.forward", "prefixflow.sample"
PHASES = (PREPARE, FORWARD, SAMPLE)


def phase(name: str) -> AbstractContextManager[object]:
    """The profiler's range `name` while a profiler records, else nothing."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()
