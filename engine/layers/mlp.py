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
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, :self.intermediate_size], gate_up[:, self.intermediate_size:]
        # silu in place in the gate_up buffer, the product into a new contiguous [T, I]: the
        # down projection copies a strided input first (oneDNN's CPU matmul calls contiguous(),
        # 9 MB a layer in a 1456-token prefill), so the product is what gets written once.
        return self.down_proj(torch.mul(F.silu(gate, inplace=True), up))
