"""The gated SiLU MLP of Llama-family models, gate and up projections fused in one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixflow.engine.layers.linear import Linear


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `gate_up_proj` holds [gate; up] stacked on the output dim."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> gate_up: [T, 2I] -> [T, H]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # In place in the gate_up buffer: no [T, I] temporaries (the matmul reads the strided
        # view directly).
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))
