"""Linear layers whose CPU matmuls run on weights prepacked once for oneDNN.

MKL's sgemm (what `F.linear` calls on the CPU) reads the plain [out, in] weight every call.
oneDNN can reorder a weight once into the blocked layout its GEMM kernels stream, which is
what vLLM's CPU build does for every linear layer (`create_onednn_mm`). Measured on peer_bench's
tiny llama, fp32, 2 threads, same steps in one process: 12-request decode steps 10-25% faster,
prefill steps about the same, outputs identical (issue 17; see bench/results/native_profile.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The batch (tokens) the blocked layout is tuned for; vLLM's CPU build uses 32 too. Any batch
# size runs; 1, 32, 128 and 512 measured within noise of each other on decode and prefill steps.
PACK_BATCH_HINT = 32


class Linear(nn.Linear):
    """nn.Linear with `prepack_for_cpu()`: after it, forward runs oneDNN on the packed weight
    and `weight` is an empty placeholder (the dense copy is freed: weights are not held twice)."""

    packed: torch.Tensor | None = None

    def prepack_for_cpu(self) -> bool:
        """Pack a float32 CPU weight for oneDNN; False (nothing changed) where this torch build
        or dtype has no such path."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not cpu_prepack_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
        except RuntimeError:
            return False
        self.packed = packed
        self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def cpu_prepack_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack_linears(model: nn.Module) -> int:
    """Prepack every `Linear` of a loaded CPU model; returns how many were packed."""
    return sum(m.prepack_for_cpu() for m in model.modules() if isinstance(m, Linear))
