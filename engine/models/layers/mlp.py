"""The gated SiLU MLP of Llama-family models, gate and up projections fused in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixflow.engine.models.layers.linear import Linear


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `gate_up_proj` holds [gate; up] stacked on the output dim."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> gate_up: [T, 2I] -> [T, H]
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        act = F.silu(gate, inplace=True)  # in place in the gate_up buffer
        # On a CPU the product goes into a new contiguous [T, I]: oneDNN's matmul copies a
        # strided input first (9 MB a layer in a 1456-token prefill). cuBLAS reads the strided
        # view as it is, so on a GPU it stays in place (no [T, I] temporary at the peak).
        out: torch.Tensor = self.down_proj(torch.mul(act, up) if x.is_cpu else act.mul_(up))
        return out
