"""Writing a step's new K/V into the paged cache (the engine does this before attention).

slot_mapping[t] = block * block_size + offset is where token t's K/V go; -1 skips the token
(padding, or a token whose KV is already cached).
"""

from __future__ import annotations

import torch

from prefixflow.kernels import cpu_kernels
from prefixflow.kernels._common import (
    FLOAT_DTYPES,
    REF_FLOAT_DTYPES,
    check_last_dim_contiguous,
    check_shape,
    check_tensor,
    layer_key,
    once_per_step,
    use_triton,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None


def _check_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    check_tensor("k", k, 3, dtypes)
    dev = k.device
    check_tensor("v", v, 3, dtypes, dev)
    check_shape("v", v, tuple(k.shape))
    t, hkv, d = k.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, 4, dtypes, dev, contiguous=True)
        if tuple(c.shape[2:]) != (hkv, d):
            raise ValueError(
                f"{name} has shape {tuple(c.shape)}; its last two dims must be "
                f"k's (num_kv_heads, head_dim) = {(hkv, d)}"
            )
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), dev)
    check_shape("slot_mapping", slot_mapping, (t,))


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters k, v into the paged cache in place (Triton on CUDA, torch otherwise).

    k, v: [T, Hkv, D] float; k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous;
    slot_mapping: [T] int64 (or int32), slot = block * block_size + offset, -1 = skip.
    k/v are cast to the cache dtype.
    """
    if use_triton(k, head_dims=None):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    elif cpu_kernels.available(k, v, k_cache, v_cache) and k_cache.is_contiguous():
        write_kv_cache_cpu(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)


def write_kv_cache_cpu(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`write_kv_cache` in C on the CPU (kernels/cpu_kernels.py; float32, contiguous caches).
    The checks run once per step (every layer writes alike tensors at the same slots)."""
    slots = once_per_step(
        "kv_write_cpu",
        (slot_mapping,),
        layer_key(k, v, k_cache, v_cache),
        lambda: _checked_slots(k, v, k_cache, v_cache, slot_mapping),
    )
    cpu_kernels.write_kv_cpu(k, v, k_cache, v_cache, slots)


def _checked_slots(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """int64 contiguous slots, after the argument checks and checking that no slot is past the
    cache (the C code trusts them; -1 means skip)."""
    _check_args(k, v, k_cache, v_cache, slot_mapping, (torch.float32,))
    capacity = k_cache.shape[0] * k_cache.shape[1]
    slots = slot_mapping.long().contiguous()
    if slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())}, outside the cache's {capacity} slots")
    return slots


def write_kv_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch version of `write_kv_cache` (same arguments)."""
    _check_args(k, v, k_cache, v_cache, slot_mapping, REF_FLOAT_DTYPES)
    # Which slots to write: once per step for all layers (they share slot_mapping).
    slots, valid = once_per_step("kv_write", (slot_mapping,), (), lambda: _slots(slot_mapping))
    if valid is not None:
        k, v = k[valid], v[valid]
    # Rows of Hkv * D elements: copying whole rows is several times faster than [Hkv, D] ones.
    row = k.shape[1] * k.shape[2]
    k_cache.view(-1, row).index_copy_(0, slots, k.reshape(-1, row).to(k_cache.dtype))
    v_cache.view(-1, row).index_copy_(0, slots, v.reshape(-1, row).to(v_cache.dtype))


def _slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int64 slots to write, mask of the tokens written or None for all of them)."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping.long(), None
    return slot_mapping[valid].long(), valid


# ---------------------------------------------------------------------------------------------
# Triton path.

if triton is not None:

    @triton.jit
    def _write_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        HEAD_DIM: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per token: copies its [Hkv, D] K and V rows into the slot's cache rows.
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, HEAD_DIM)
            mask = (h < NUM_KV_HEADS)[:, None]
            src = h[:, None] * stride_kh + d[None, :]
            dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
            k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + src, mask=mask)
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            src_v = h[:, None] * stride_vh + d[None, :]
            v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + src_v, mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton launcher of `write_kv_cache` (same arguments); head_dim must be a power of two."""
    _check_args(k, v, k_cache, v_cache, slot_mapping, FLOAT_DTYPES)
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    t, hkv, d = k.shape
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two for the Triton kernel")
    if t == 0:
        return
    _write_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HEAD_DIM=d,
        NUM_KV_HEADS=hkv,
        BLOCK_H=triton.next_power_of_2(hkv),
    )
