"""Shared helpers of the attention kernels: dispatch, argument checks, torch building blocks.

Cache layout everywhere: `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`.
GQA: query head h reads kv head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REF_FLOAT_DTYPES = FLOAT_DTYPES + (torch.float64,)
TRITON_HEAD_DIMS = (32, 64, 128)


@functools.cache
def triton_available() -> bool:
    """True when triton imports (the CUDA compiler or, with TRITON_INTERPRET=1, the interpreter)."""
    try:
        import triton
        import triton.language  # noqa: F401  (the interpreter/compiler front end)
    except Exception:  # noqa: BLE001 - triton is optional
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
    warnings.warn(
        f"head_dim {head_dim} has no Triton kernel (supported: {TRITON_HEAD_DIMS}); using the slower torch reference",
        stacklevel=3,
    )


# ---------------------------------------------------------------------------------------------
# Argument checks. Launchers call these before launching; each raises ValueError naming the
# argument, the offending value and the fix.


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
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
        raise ValueError(
            f"{name} must have stride 1 in its last dimension, got strides {t.stride()}; call .contiguous()"
        )


def check_cache(
    k_cache: object,
    v_cache: object,
    num_heads: int,
    head_dim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None,
) -> tuple[int, int]:
    """Checks the paged cache pair; returns (block_size, num_kv_heads)."""
    check_tensor("k_cache", k_cache, 4, dtypes, device)
    check_tensor("v_cache", v_cache, 4, dtypes, device)
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache shape {tuple(k_cache.shape)} != v_cache shape "
            f"{tuple(v_cache.shape)}; both are [num_blocks, block_size, Hkv, D]"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache strides {k_cache.stride()} != v_cache strides {v_cache.stride()}; allocate both caches alike"
        )
    _, block_size, num_kv_heads, d = k_cache.shape
    if d != head_dim:
        raise ValueError(f"k_cache head_dim {d} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads (GQA needs Hq % Hkv == 0)"
        )
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
        raise ValueError(
            f"head_dim {head_dim} is not supported by the Triton kernels; "
            f"use one of {TRITON_HEAD_DIMS} or the *_ref function"
        )


# ---------------------------------------------------------------------------------------------
# Torch building blocks of the references.


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """References accumulate in fp32 (fp64 when given fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# CPU attention with log-sum-exp: PyTorch's flash kernel for the CPU returns the output AND the
# LSE, so the parts of a query's keys (shared prefix, own KV) are attended separately and merged
# exactly (Cascade Inference's merge). Builds without it, and other devices, use plain matmuls.
_FLASH_CPU = (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    else None
)

# Gathered K/V of at most this many elements per batched-decode sub-batch (bounds CPU memory),
# and the largest scratch buffer kept between calls.
_DECODE_MAX_ELEMENTS = 1 << 25
_SCRATCH_MAX_ELEMENTS = 1 << 25


@functools.cache
def flash_cpu_reads_gqa() -> bool:
    """Whether `_FLASH_CPU` maps query head h to kv head h // (Hq // Hkv) itself. torch 2.8's
    does not: it reads kv heads past Hkv (garbage or NaN, no error), where 2.13's is right; so
    one tiny case is asked instead of a version number. Its k/v are views of 2 heads holding NaN
    past the first, so that a kernel reading too far reads NaN inside the allocation."""
    if _FLASH_CPU is None:
        return False
    q = torch.linspace(-1, 1, 2 * 3 * 4).view(1, 2, 3, 4)  # [B, Hq=2, L, D]
    kv = torch.full((1, 2, 3, 4), float("nan"))
    kv[:, 0] = torch.linspace(1, -1, 12).view(3, 4)
    k = v = kv[:, :1]  # [B, Hkv=1, L, D]
    out, _ = _FLASH_CPU(q, k, v, 0.0, False, scale=0.5)
    want, _ = attention_lse(q, k, v, 0.5, use_flash=False)
    return bool(torch.allclose(out, want, atol=1e-5))


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    bias: torch.Tensor | None = None,
    use_flash: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with GQA that also returns the log-sum-exp of the scaled scores.

    q: [B, Hq, Lq >= 1, D]; k, v: [B, Hkv, Lk >= 1, D], q's dtype (fp32/fp64), any strides with
    unit stride in D; query head h reads kv head h // (Hq // Hkv). causal: query i sees keys
    0..i (top-left, so only for Lq == Lk). bias: additive [B or 1, 1, Lq or 1, Lk] of 0 / -inf
    (every query keeps a key) or None. use_flash: None = the CPU flash kernel when it exists and
    q is on the CPU. Returns (out [B, Hq, Lq, D], lse [B, Hq, Lq]).
    """
    if use_flash is None:
        use_flash = _FLASH_CPU is not None and q.device.type == "cpu"
    if use_flash:
        if _FLASH_CPU is None:
            raise ValueError(
                "attention_lse(use_flash=True): this torch build has no CPU flash kernel "
                "(aten._scaled_dot_product_flash_attention_for_cpu); pass use_flash=None"
            )
        # The kernel reads q/k/v through their strides (unit stride in D assumed); Lq = 0
        # crashes it, so callers skip empty query sets.
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        if q.shape[1] != k.shape[1] and not flash_cpu_reads_gqa():
            # an older torch's kernel: one kv head per query head
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    s = torch.matmul(q.reshape(b, hkv, g * lq, d), k.transpose(-1, -2)) * scale
    s = s.view(b, hkv, g, lq, lk)  # [B, Hkv, G, Lq, Lk]
    if causal:
        s = s.masked_fill(~causal_keep(lq, lk, q.device), float("-inf"))
    if bias is not None:
        s = s + bias.unsqueeze(1)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, Lq]
    p = torch.exp(s - lse.unsqueeze(-1)).view(b, hkv, g * lq, lk)
    out = torch.matmul(p, v).view(b, hq, lq, d)
    return out, lse.view(b, hq, lq)


_scratch = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-thread buffer reused across calls, for CPU temporaries that never leave a
    reference call (gathered K/V). A fresh tensor of many megabytes costs more in page faults
    (glibc maps big allocations anew each time) than the copy into it. Holds, per name, the
    largest size asked for so far, up to _SCRATCH_MAX_ELEMENTS (larger ones are not kept)."""
    numel = math.prod(shape)
    if numel > _SCRATCH_MAX_ELEMENTS:
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get((name, dtype, device))
    if buf is None or buf.numel() < numel:
        # A normal tensor even under inference_mode: an inference tensor could not be
        # written by a later call made outside inference_mode.
        with torch.inference_mode(False):
            buf = buffers[(name, dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


@dataclass(frozen=True, slots=True)
class BlockIndex:
    """The cache blocks one gather reads, in order: `blocks` [N] int64, and `run` = (first,
    end) when they are the consecutive ids first .. end-1 on the CPU (read as a view)."""

    blocks: torch.Tensor
    run: tuple[int, int] | None


def block_index(block_tables: torch.Tensor, num_blocks: list[int]) -> BlockIndex:
    """The first num_blocks[r] blocks of each row of block_tables [R, W] int32, row by row."""
    width = max(num_blocks, default=0)
    table = block_tables[:, :width]
    if any(n != width for n in num_blocks):
        keep = torch.arange(width, device=table.device) < torch.tensor(num_blocks, device=table.device)[:, None]
        table = table[keep]  # row-major order
    blocks = table.reshape(-1).long()
    return BlockIndex(blocks, _consecutive_run(blocks) if blocks.device.type == "cpu" else None)


def gather_index(cache: torch.Tensor, index: BlockIndex, dtype: torch.dtype, name: str) -> torch.Tensor:
    """The blocks of `index`, concatenated: [N * block_size, Hkv, D] in `dtype`. Consecutive
    blocks of a contiguous cache (a prefix or a sequence allocated in one go) are a view of
    it; others are gathered in one index_select over whole blocks (memcpy-sized rows: far
    faster than gathering tokens), on the CPU into the scratch buffer `name`. Valid until the
    next gather into that name or the next cache write."""
    n, block_size, hkv, d = cache.shape
    if index.run is not None and cache.is_contiguous():
        return cache[index.run[0] : index.run[1]].view(-1, hkv, d).to(dtype)
    blocks = index.blocks
    if cache.is_contiguous() and cache.device.type == "cpu":
        out = scratch(name, (blocks.numel(), block_size * hkv * d), cache.dtype, cache.device)
        rows = torch.index_select(cache.view(n, -1), 0, blocks, out=out)
    elif cache.is_contiguous():
        rows = cache.view(n, -1).index_select(0, blocks)
    else:
        rows = cache[blocks]
    return rows.view(-1, hkv, d).to(dtype)


def gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: list[int], dtype: torch.dtype, name: str
) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D]; the first num_blocks[r] blocks of each row of
    block_tables [R, W] int32, concatenated: [sum(num_blocks) * block_size, Hkv, D] in `dtype`
    (see gather_index)."""
    return gather_index(cache, block_index(block_tables, num_blocks), dtype, name)


def _consecutive_run(blocks: torch.Tensor) -> tuple[int, int] | None:
    """(first, last + 1) when the CPU block ids are first, first+1, ..., else None."""
    ids = blocks.tolist()
    if ids and ids[-1] - ids[0] == len(ids) - 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return ids[0], ids[-1] + 1
    return None


_step_memo = threading.local()


def once_per_step(name: str, tensors: tuple[torch.Tensor, ...], extra: tuple, build: Callable[[], T]) -> T:
    """build(), reused while the same metadata tensors come back. Every layer of a step passes
    the same objects (built once by the model runner), so host work that depends only on them
    (lists, block indices, masks, value checks) runs once per step instead of once per layer.
    One entry per name and thread; it holds the last step's tensors, so their ids stay unique.
    Tensors that track versions must also be unmodified (inference tensors cannot tell)."""
    entries = _step_memo.__dict__.setdefault("entries", {})
    versions = tuple(None if t.is_inference() else t._version for t in tensors)
    hit = entries.get(name)
    if (
        hit is not None
        and hit[2] == extra
        and hit[1] == versions
        and len(hit[0]) == len(tensors)
        and all(a is b for a, b in zip(hit[0], tensors))
    ):
        return hit[3]
    value = build()
    entries[name] = (tensors, versions, extra, value)
    return value


def layer_key(*tensors: torch.Tensor) -> tuple:
    """What a step's argument checks depend on beyond its metadata (each tensor's shape,
    strides, dtype and device): every layer of a step passes tensors alike in these, so checks
    made for the first layer hold for the others."""
    return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Sequences lo .. hi-1 of a batched decode: `length` keys each (their longest one's blocks),
    read through `index`; `bias` [B', 1, 1, length] masks the padding (None: none)."""

    lo: int
    hi: int
    length: int
    index: BlockIndex
    bias: torch.Tensor | None


def decode_plan(
    kv_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, token_elems: int, dtype: torch.dtype
) -> list[DecodeBatch]:
    """Sub-batches of a batched decode over kv_lens [B] (>= 1) keys, each gathering at most
    _DECODE_MAX_ELEMENTS elements (token_elems = Hkv * D per key); masks in `dtype`."""
    lens = kv_lens.tolist()
    step = max(1, _DECODE_MAX_ELEMENTS // max(max(lens, default=1) * token_elems, 1))
    batches = []
    for lo in range(0, len(lens), step):
        hi = min(len(lens), lo + step)
        nb = -(-max(lens[lo:hi]) // block_size)
        length = nb * block_size
        bias = None
        if min(lens[lo:hi]) < length:
            pad = torch.arange(length, device=kv_lens.device) >= kv_lens[lo:hi, None]  # [B', L]
            bias = torch.zeros(hi - lo, 1, 1, length, dtype=dtype, device=kv_lens.device).masked_fill_(
                pad[:, None, None], float("-inf")
            )
        batches.append(DecodeBatch(lo, hi, length, block_index(block_tables[lo:hi], [nb] * (hi - lo)), bias))
    return batches


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[DecodeBatch], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its paged keys, batched by `plan` (decode_plan of the
    sequences' kv_lens and block tables): each sub-batch gathers the same number of blocks for
    every sequence (one index_select per K and V, or a view) and masks the padding. The query
    heads of one kv head are folded into the query length, so the kernel runs without GQA.
    q: [B, Hq, D] (fp32/fp64). Returns (out [B, Hq, D], lse [B, Hq])."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    outs, lses = [], []
    for p in plan:
        lo, hi, length = p.lo, p.hi, p.length
        k = gather_index(k_cache, p.index, q.dtype, "k")
        v = gather_index(v_cache, p.index, q.dtype, "v")
        qg = q[lo:hi].reshape(hi - lo, hkv, hq // hkv, d)  # [B', Hkv, G, D]
        k = k.view(hi - lo, length, hkv, d).transpose(1, 2)  # [B', Hkv, L, D]
        v = v.view(hi - lo, length, hkv, d).transpose(1, 2)
        o, lse = attention_lse(qg, k, v, scale, bias=p.bias)
        outs.append(o.reshape(hi - lo, hq, d))
        lses.append(lse.reshape(hi - lo, hq))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def causal_keep(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (the last q_len of kv_len) sees keys 0 .. kv_len-q_len+i."""
    i = torch.arange(q_len, device=device).unsqueeze(1)
    j = torch.arange(kv_len, device=device).unsqueeze(0)
    return j <= (kv_len - q_len) + i


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's queries, the last n of its L keys, causally (bottom-right aligned).

    q: [n, Hq, D]; k, v: [L >= n, Hkv, D] (views are fine). Returns (out [n, Hq, D] as a
    transposed view, lse [n, Hq])."""
    n, kv_len = q.shape[0], k.shape[0]
    bias = None
    if n != kv_len:  # the kernel's causal mask is top-left aligned: mask explicitly
        keep = causal_keep(n, kv_len, q.device)
        bias = q.new_zeros(1, 1, n, kv_len).masked_fill_(~keep, float("-inf"))
    o, lse = attention_lse(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, causal=n == kv_len, bias=bias
    )
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)
