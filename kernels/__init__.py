"""Attention kernels: one file per kernel, each with its Triton kernel, a launcher that checks
shapes, strides and dtypes, and a torch reference of the same signature (used on the CPU).

This package must be imported as `prefixflow.kernels`. When the repository root is on
sys.path, transformers' probe for Hugging Face's `kernels` distribution can import this folder
as a top-level `kernels`; under that name it exposes nothing and imports nothing.

Public functions dispatch on q's device: CUDA tensors (with triton importable) run the Triton
launcher `*_triton`, anything else the torch reference `*_ref` of the same signature.
"""

if __name__ == "prefixflow.kernels":
    from prefixflow.kernels.kv_write import write_kv_cache, write_kv_cache_ref
    from prefixflow.kernels.packed_prefill import (packed_prefill_attention,
                                                   packed_prefill_attention_ref)
    from prefixflow.kernels.paged_decode import (paged_decode_attention,
                                                 paged_decode_attention_ref)
    from prefixflow.kernels.prefix_attention import (prefix_shared_attention,
                                                     prefix_shared_attention_ref)

    __all__ = [
        "packed_prefill_attention",
        "packed_prefill_attention_ref",
        "paged_decode_attention",
        "paged_decode_attention_ref",
        "prefix_shared_attention",
        "prefix_shared_attention_ref",
        "write_kv_cache",
        "write_kv_cache_ref",
    ]
