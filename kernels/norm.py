"""RMSNorm, optionally fused with the residual add before it (pre-norm decoder layers).

The torch version rounds as Hugging Face Llama and engine/models/layers/norm.py do: the residual
add in the model dtype, the normalisation in fp32, the result cast to the model dtype and
multiplied by the weight in the model dtype. The Triton kernel is written the same way but sums
the squares in its own order, and compiled for CUDA it may round otherwise, as the rotary's did
(kernels/rotary.py): tests/gpu holds it to a relative and absolute 2e-2 of torch's in half
precision and 1e-5 in float32, not to equality.
"""

from __future__ import annotations

import torch

from prefixflow.kernels._common import FLOAT_DTYPES, REF_FLOAT_DTYPES, check_shape, check_tensor, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None


def _check_args(x, weight, residual, dtypes) -> None:
    check_tensor("x", x, 2, dtypes, contiguous=True)
    check_tensor("weight", weight, 1, (x.dtype,), x.device, contiguous=True)
    check_shape("weight", weight, (x.shape[1],))
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,), x.device, contiguous=True)
        check_shape("residual", residual, tuple(x.shape))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] float, contiguous; weight: [H] in x's dtype; residual: optional [T, H].

    Without residual returns norm(x) [T, H]; with it returns (norm(x + residual), x + residual).
    Triton on CUDA where the kernel takes the tensors (`triton_takes`), torch otherwise.
    """
    if x.is_cuda and triton_available() and triton_takes(x, weight, residual):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def triton_takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether `rms_norm_triton` takes these tensors (its checks, as a question): [T, H] in a
    float dtype it computes in, H up to 65536, contiguous, weight and residual alike."""
    return (
        x.dim() == 2
        and x.dtype in FLOAT_DTYPES
        and x.shape[1] <= 65536
        and x.is_contiguous()
        and weight.dtype == x.dtype
        and tuple(weight.shape) == (x.shape[1],)
        and weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape and residual.is_contiguous()))
    )


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `rms_norm` (same arguments)."""
    _check_args(x, weight, residual, REF_FLOAT_DTYPES)
    if residual is not None:
        x = x + residual
    xf = x.float() if x.dtype != torch.float64 else x
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, y_ptr, new_res_ptr, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
    ):
        # One program per row; the row fits one block (hidden <= BLOCK).
        row = tl.program_id(0).to(tl.int64) * hidden
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden
        x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(new_res_ptr + row + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)  # cast like HF, then * weight
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row + offs, (w * normed).to(x.dtype), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `rms_norm` (same arguments); hidden size up to 65536."""
    _check_args(x, weight, residual, FLOAT_DTYPES)
    t, hidden = x.shape
    if hidden > 65536:
        raise ValueError(f"x has hidden size {hidden}; the Triton kernel takes up to 65536")
    y = torch.empty_like(x)
    new_res = torch.empty_like(x) if residual is not None else y
    if t > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(t,)](
            x,
            residual if residual is not None else x,
            weight,
            y,
            new_res,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return y if residual is None else (y, new_res)
