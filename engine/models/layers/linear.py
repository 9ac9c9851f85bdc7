"""Linear layers whose CPU matmuls run on weights prepacked once for oneDNN.

MKL's sgemm (what `F.linear` calls on the CPU) reads the plain [out, in] weight every call.
oneDNN can reorder a weight once into the blocked layout its GEMM kernels stream, which is
what vLLM's CPU build does for every linear layer (`create_onednn_mm`). Measured on peer_bench's
tiny llama, fp32, 2 threads, A/B in one process: 12-request decode steps 10-25% faster, prefill
steps about the same, outputs identical (issue 17's session note; the side-by-side result is
bench/results/peer_bench_native_issue17.json).

At decode sizes (a few rows) oneDNN streams the weights at about half the memory's speed, so
each layer also keeps the weight in the layout of kernels/cpu_linear.py, which runs products of
up to `cpu_linear.MAX_ROWS` rows near the weights-read floor (SmolLM2-135M's projections at
8 rows: 66 -> 39 ms a step). That is a second copy of every weight, the price of a decode step
that reads its weights once at full speed; PREFIXFLOW_CPU_KERNELS=0 turns both copies off.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from prefixflow.kernels import cpu_linear

# The batch (tokens) the blocked layout is tuned for; vLLM's CPU build uses 32 too. Any batch
# size runs; 1, 32, 128 and 512 measured within noise of each other on decode and prefill steps.
PACK_BATCH_HINT = 32


@runtime_checkable
class CpuPrepackable(Protocol):
    """A layer with `prepack_for_cpu()` (`Linear`, the LM head): True when it packed."""

    def prepack_for_cpu(self) -> bool: ...


class Linear(nn.Linear):
    """nn.Linear with `prepack_for_cpu()`: after it, forward runs oneDNN on the packed weight,
    or the skinny kernel on its blocked copy for a few rows, and `weight` is an empty
    placeholder (the dense copy is freed)."""

    packed: torch.Tensor | None = None
    blocked: torch.Tensor | None = None

    def prepack_for_cpu(self) -> bool:
        self.packed = packed_for_cpu(self.weight)
        if self.packed is None:
            return False
        self.blocked = cpu_linear.blocked_weight(self.weight)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_linear.supports(x, self.blocked):
            assert self.blocked is not None
            return cpu_linear.skinny_linear(x, self.blocked, self.out_features, self.bias)
        return linear(x, self.weight, self.packed, self.bias)


def packed_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] reordered for oneDNN's GEMM, for a float32 CPU weight where this
    torch build has the path; else None."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        return packed
    except RuntimeError:
        return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T + bias, on the packed weight when there is one."""
    if packed is not None:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


def prepack_linears(model: nn.Module) -> int:
    """Prepack every layer of a loaded CPU model that can be (`prepack_for_cpu`, the `Linear`s
    and the LM head); returns how many were packed."""
    return sum(m.prepack_for_cpu() for m in model.modules() if isinstance(m, CpuPrepackable))
