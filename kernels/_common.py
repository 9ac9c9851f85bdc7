"""Shared helpers of the attention kernels: dispatch, argument checks, torch building blocks.

Cache layout everywhere: `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`.
GQA: query head h reads kv head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REF_FLOAT_DTYPES = FLOAT_DTYPES + (torch.float64,)
TRITON_HEAD_DIMS = (32, 64, 128)


@functools.cache
def triton_available() -> bool:
    """True when triton imports (the CUDA compiler or, with TRITON_INTERPRET=1, the interpreter)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401  (the interpreter/compiler front end)
    except Exception:  # pragma: no cover - triton is optional
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (slow, no autotuning)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(q: torch.Tensor, head_dims: tuple[int, ...] | None = TRITON_HEAD_DIMS) -> bool:
    """Public functions take the Triton path only for CUDA tensors; CPU tensors use `*_ref`.
    A CUDA tensor whose last dim the kernels do not take (`head_dims`; None = any power of
    two) also uses the reference, with a one-time warning, so that unusual models still run."""
    if not (q.is_cuda and triton_available()):
        return False
    d = q.shape[-1]
    if (d in head_dims) if head_dims is not None else (d > 0 and d & (d - 1) == 0):
        return True
    _warn_fallback(d)
    return False


@functools.cache
def _warn_fallback(head_dim: int) -> None:
    warnings.warn(f"head_dim {head_dim} has no Triton kernel (supported: {TRITON_HEAD_DIMS}); "
                  "using the slower torch reference", stacklevel=3)


# ---------------------------------------------------------------------------------------------
# Argument checks. Launchers call these before launching; each raises ValueError naming the
# argument, the offending value and the fix.


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...],
                 device: torch.device | None = None, contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; use one of {names}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move it to {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()}); call .contiguous()")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # Kernels load head_dim vectors with unit stride; other strides are passed explicitly.
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides "
                         f"{t.stride()}; call .contiguous()")


def check_cache(k_cache: object, v_cache: object, num_heads: int, head_dim: int,
                dtypes: tuple[torch.dtype, ...], device: torch.device | None) -> tuple[int, int]:
    """Checks the paged cache pair; returns (block_size, num_kv_heads)."""
    check_tensor("k_cache", k_cache, 4, dtypes, device)
    check_tensor("v_cache", v_cache, 4, dtypes, device)
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} != v_cache shape "
                         f"{tuple(v_cache.shape)}; both are [num_blocks, block_size, Hkv, D]")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} != v_cache strides "
                         f"{v_cache.stride()}; allocate both caches alike")
    _, block_size, num_kv_heads, d = k_cache.shape
    if d != head_dim:
        raise ValueError(f"k_cache head_dim {d} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the cache's "
                         f"{num_kv_heads} kv heads (GQA needs Hq % Hkv == 0)")
    check_last_dim_contiguous("k_cache", k_cache)
    return block_size, num_kv_heads


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Returns `out` after checking it matches q, or a fresh tensor like q."""
    if out is None:
        return torch.empty_like(q)
    check_tensor("out", out, q.dim(), (q.dtype,), q.device)
    check_shape("out", out, tuple(q.shape))
    check_last_dim_contiguous("out", out)
    return out


def check_head_dim_for_triton(head_dim: int) -> None:
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the Triton kernels; "
                         f"use one of {TRITON_HEAD_DIMS} or the *_ref function")


# ---------------------------------------------------------------------------------------------
# Torch building blocks of the references.


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """References accumulate in fp32 (fp64 when given fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one paged KV sequence.

    cache: [num_blocks, block_size, Hkv, D]; block_table_row: [max_blocks] int32.
    Returns [length, Hkv, D].
    """
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def attend_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   keep: torch.Tensor | None, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised softmax attention of a few queries over keys, with GQA (q's dtype).

    q: [Tq, Hq, D]; k, v: [L >= 1, Hkv, D]; keep: [Tq, L] bool (True = attend) or None; every
    query must keep at least one key. Returns (acc [Tq, Hq, D], row max m [Tq, Hq], row sum
    l [Tq, Hq]) with softmax output = acc / l; two parts merge by rescaling with exp(m - max).
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(tq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * tq, d)  # [Hkv, G*Tq, D]
    s = torch.bmm(qg, k.permute(1, 2, 0)) * scale                         # [Hkv, G*Tq, L]
    if keep is not None:
        s = s.view(hkv, g, tq, -1).masked_fill(~keep, float("-inf")).view(hkv, g * tq, -1)
    m = s.amax(dim=-1, keepdim=True)                                     # [Hkv, G*Tq, 1]
    p = torch.exp(s - m)
    acc = torch.bmm(p, v.permute(1, 0, 2))                               # [Hkv, G*Tq, D]
    acc = acc.view(hkv, g, tq, d).permute(2, 0, 1, 3).reshape(tq, hq, d)
    m = m.view(hkv, g, tq).permute(2, 0, 1).reshape(tq, hq)
    l = p.sum(dim=-1).view(hkv, g, tq).permute(2, 0, 1).reshape(tq, hq)
    return acc, m, l


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           keep: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention (see `attend_partial` for shapes); returns [Tq, Hq, D]."""
    acc, _, l = attend_partial(q, k, v, keep, scale)
    return acc / l.unsqueeze(-1)


# Gathered K/V of at most this many elements per batched-decode sub-batch (bounds CPU memory).
_DECODE_MAX_ELEMENTS = 1 << 25


def decode_partial(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kv_lens: torch.Tensor, block_tables: torch.Tensor, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched unnormalised attention of one query per sequence over its kv_lens[b] >= 1 paged
    keys (q's dtype, fp32/fp64). q: [B, Hq, D]; kv_lens: [B]; block_tables: [B, W].
    Returns (acc [B, Hq, D], m [B, Hq], l [B, Hq]) as `attend_partial`; sub-batches gather
    each sequence's blocks padded to the longest one and mask the padding."""
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    lens = kv_lens.tolist()
    step = max(1, _DECODE_MAX_ELEMENTS // max(max(lens, default=1) * hkv * d, 1))
    parts = []
    for lo in range(0, b, step):
        hi = min(b, lo + step)
        num_blocks = -(-max(lens[lo:hi]) // block_size)
        blocks = block_tables[lo:hi, :num_blocks].long()                       # [B', nb]
        length = num_blocks * block_size
        k = k_cache[blocks].reshape(hi - lo, length, hkv, d).to(q.dtype)        # [B', L, Hkv, D]
        v = v_cache[blocks].reshape(hi - lo, length, hkv, d).to(q.dtype)
        qg = q[lo:hi].reshape(hi - lo, hkv, hq // hkv, d)                       # [B', Hkv, G, D]
        s = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale                      # [B', Hkv, G, L]
        pad = torch.arange(length, device=q.device) >= kv_lens[lo:hi, None]      # [B', L]
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        acc = torch.einsum("bhgl,blhd->bhgd", p, v)
        parts.append((acc.reshape(hi - lo, hq, d), m.reshape(hi - lo, hq),
                      p.sum(dim=-1).reshape(hi - lo, hq)))
    return tuple(torch.cat(x) for x in zip(*parts))


def causal_keep(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (the last q_len of kv_len) sees keys 0 .. kv_len-q_len+i."""
    i = torch.arange(q_len, device=device).unsqueeze(1)
    j = torch.arange(kv_len, device=device).unsqueeze(0)
    return j <= (kv_len - q_len) + i
