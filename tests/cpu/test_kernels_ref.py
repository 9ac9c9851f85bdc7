"""The torch references of the attention kernels against naive float64 per-token loops."""

import pytest
import torch

from prefixflow.kernels import (
    packed_prefill_attention_ref,
    paged_decode_attention_ref,
    prefix_shared_attention_ref,
    write_kv_cache_ref,
)
from prefixflow.bench.kernel_cases import make_prefix_case
from support.kernel_oracles import naive_packed_prefill, naive_prefix_attention, rel_error

PREFIX_CASES = {
    # name: (groups [(prefix_len, [(q_len, kv_len)])], solo [(q_len, kv_len)])
    "decode_two_groups": ([(7, [(1, 3), (1, 1), (1, 5)]), (4, [(1, 2)])], [(1, 6)]),
    "mixed_prefill_decode": ([(5, [(3, 3), (1, 9), (2, 6)])], [(4, 4), (1, 2)]),
    "empty_prefix": ([(0, [(2, 5), (1, 1)])], [(1, 3)]),
    "no_groups": ([], [(3, 7), (1, 1)]),
    "group_of_one_midblock": ([(9, [(2, 2)])], []),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("name", sorted(PREFIX_CASES))
def test_prefix_ref_matches_naive(name, ratio, dtype):
    groups, solo = PREFIX_CASES[name]
    c = make_prefix_case(
        groups,
        solo,
        num_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype=dtype,
        seed=hash(name) % 1000 + ratio,
    )
    out = torch.full_like(c.q, float("nan"))
    got = prefix_shared_attention_ref(*c.args(), out=out)
    assert got is out
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_error(got, naive_prefix_attention(c)) < tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_decode_ref_matches_naive(dtype):
    lens = [(1, n) for n in (1, 5, 12, 4)]
    c = make_prefix_case([], lens, num_heads=8, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype, seed=3)
    got = paged_decode_attention_ref(c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale)
    assert got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-3
    assert rel_error(got, naive_prefix_attention(c)) < tol


def test_packed_prefill_ref_matches_naive_and_writes_cache():
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    q = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 9, 1, 8, generator=gen, dtype=torch.float64)
    k_cache, v_cache = torch.zeros(2, 6, 2, 1, 8, dtype=torch.float64)
    slots = torch.tensor([11, 10, 0, -1, 1, 2, 3, 4, 5])
    got = packed_prefill_attention_ref(q, k, v, cu, 0.4, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert rel_error(got, naive_packed_prefill(q, k, v, cu, 0.4)) < 1e-12
    flat_k, flat_v = k_cache.view(-1, 1, 8), v_cache.view(-1, 1, 8)
    valid = slots >= 0
    assert torch.equal(flat_k[slots[valid]], k[valid])
    assert torch.equal(flat_v[slots[valid]], v[valid])
    assert flat_k[6:10].abs().sum() == 0  # slot -1 wrote nothing


def test_write_kv_cache_ref_casts_to_cache_dtype():
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    k_cache, v_cache = torch.zeros(2, 2, 2, 2, 4, dtype=torch.float16)
    write_kv_cache_ref(k, v, k_cache, v_cache, torch.tensor([3, -1, 0]))
    assert torch.equal(k_cache[1, 1], k[0].half()) and torch.equal(v_cache[0, 0], v[2].half())
    assert k_cache[0, 1].abs().sum() == 0


def test_invalid_arguments_name_the_argument():
    c = make_prefix_case(
        [(4, [(1, 2)])], [], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32, seed=0
    )
    args = list(c.args())
    args[4] = c.kv_lens.long()
    with pytest.raises(ValueError, match="kv_lens"):
        prefix_shared_attention_ref(*args)
    with pytest.raises(ValueError, match="heads"):
        paged_decode_attention_ref(c.q[:, :1].repeat(1, 3, 1), c.k_cache, c.v_cache, c.kv_lens, c.block_tables, 1.0)
    with pytest.raises(ValueError, match="out"):
        prefix_shared_attention_ref(*c.args(), out=torch.empty(5, 2, 8))
    with pytest.raises(ValueError, match="slot_mapping"):
        packed_prefill_attention_ref(
            c.q, c.q, c.q, torch.tensor([0, 1], dtype=torch.int32), 1.0, k_cache=c.k_cache, v_cache=c.v_cache
        )
