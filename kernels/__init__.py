"""Attention kernels: one file per kernel, each with its Triton kernel, a launcher that checks
shapes, strides and dtypes, and a torch reference of the same signature (used on the CPU).

This package must be imported as `prefixflow.kernels`. When the repository root is on
sys.path, transformers' probe for Hugging Face's `kernels` distribution can import this folder
as a top-level `kernels`; under that name it exposes nothing and imports nothing.

Public functions dispatch on q's device: CUDA tensors (with triton importable) run the Triton
launcher `*_triton`, anything else the torch reference `*_ref` of the same signature. KV cache
layout everywhere: [num_blocks, block_size, num_kv_heads, head_dim]; block tables int32.

- prefix_shared_attention(q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables,
  prefix_lens, prefix_block_tables, prefix_seq_ranges, scale, out=None): mixed steps with
  shared prefixes, one horizontally fused launch (BatchLLM Sec. 4.3.3).
- paged_decode_attention(q, k_cache, v_cache, kv_lens, block_tables, scale, out=None,
  num_splits=None): one query per sequence, split-K.
- packed_prefill_attention(q, k, v, cu_seqlens, scale, out=None, k_cache=None, v_cache=None,
  slot_mapping=None): packed prompts, causal per prompt, optional cache write.
- write_kv_cache(k, v, k_cache, v_cache, slot_mapping): scatter a step's K/V into the cache.
- rms_norm(x, weight, eps, residual=None), apply_rotary(x, cos, sin): the layer's elementwise
  ops; the torch versions round as Hugging Face's, the Triton ones close to it (their modules).
- TRITON_HEAD_DIMS, triton_available(): when a CUDA tensor takes the Triton kernels (other head
  sizes fall back to the torch references, which read values on the host).
"""

if __name__ == "prefixflow.kernels":
    from prefixflow.kernels._common import TRITON_HEAD_DIMS, triton_available
    from prefixflow.kernels.kv_write import write_kv_cache, write_kv_cache_ref
    from prefixflow.kernels.norm import rms_norm, rms_norm_ref
    from prefixflow.kernels.packed_prefill import packed_prefill_attention, packed_prefill_attention_ref
    from prefixflow.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
    from prefixflow.kernels.prefix_attention import prefix_shared_attention, prefix_shared_attention_ref
    from prefixflow.kernels.rotary import apply_rotary, apply_rotary_ref

    __all__ = [
        "TRITON_HEAD_DIMS",
        "triton_available",
        "packed_prefill_attention",
        "packed_prefill_attention_ref",
        "paged_decode_attention",
        "paged_decode_attention_ref",
        "prefix_shared_attention",
        "prefix_shared_attention_ref",
        "rms_norm",
        "rms_norm_ref",
        "apply_rotary",
        "apply_rotary_ref",
        "write_kv_cache",
        "write_kv_cache_ref",
    ]
