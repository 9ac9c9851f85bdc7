"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixflow.kernels import cpu_exact
from prefixflow.kernels.norm import rms_norm, triton_takes


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (like HF Llama)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] in the model dtype
        if x.dtype == torch.float32:
            # One fused kernel instead of five elementwise passes (5x faster on a CPU); in fp32
            # it rounds as the path below, which half precision needs (its cast comes before
            # the weight multiply).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the new
        residual stream (written into `residual` except on CUDA: pass one not needed after, and
        use the one returned); the add happens in the model dtype, as in HF's decoder layer. On
        a CPU, one C call does the add and the norm with torch's rounding (kernels/cpu_exact.py);
        on CUDA one Triton kernel (kernels/norm.py: close to torch's, not bit for bit) where
        torch launches nine."""
        if cpu_exact.supports_norm(x, residual, self.weight):
            out = cpu_exact.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if kernel_norm_applies(x, self.weight, residual):
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual


def kernel_norm_applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether kernels/norm.py's rms_norm (Triton where it is installed) runs this norm: CUDA
    tensors that its kernel takes."""
    return x.is_cuda and triton_takes(x, weight, residual)
