"""The Triton kernels (through the CPU interpreter here, the compiler on CUDA) against float64
per-token loops. Launchers are called directly so the Triton path runs without a GPU. Outputs
are poisoned with NaN first: every element must be written. Shapes are tiny (the interpreter
costs ~0.4 ms per program instance)."""

import random

import pytest
import torch

from prefixflow.kernels._common import interpreting
from prefixflow.bench.kernel_cases import make_prefix_case
from support.kernel_oracles import naive_packed_prefill, naive_prefix_attention, rel_error
from prefixflow.kernels.kv_write import write_kv_cache_triton
from prefixflow.kernels.packed_prefill import packed_prefill_attention_triton
from prefixflow.kernels.paged_decode import paged_decode_attention_triton
from prefixflow.kernels.prefix_attention import prefix_shared_attention_triton

# tests/conftest.py sets TRITON_INTERPRET only without CUDA; with CUDA, tests/gpu runs these
# kernels compiled, and CPU tensors cannot go to a compiled kernel.
pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (no CUDA)")

TOL = {torch.float16: 1e-3, torch.float32: 1e-5, torch.bfloat16: 1e-2}

PREFIX_CASES = {
    # name: (groups [(prefix_len, [(q_len, kv_len) per member])], solo [(q_len, kv_len)])
    "decode_two_groups": ([(7, [(1, 3), (1, 1), (1, 5)]), (4, [(1, 2)])], [(1, 6)]),
    "mixed_prefill_decode": ([(5, [(3, 3), (1, 9), (2, 6)]), (8, [(1, 4)])], [(4, 4), (1, 2)]),
    "empty_prefix_and_group_of_one": ([(0, [(2, 5), (1, 1)]), (9, [(2, 2)])], [(1, 3)]),
    "no_groups": ([], [(3, 7), (1, 1)]),
    "split_prefix_and_own": ([(1100, [(1, 3), (2, 2)])], [(1, 600)]),
}


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("name", sorted(PREFIX_CASES))
def test_prefix_shared_triton(name, ratio, dtype):
    groups, solo = PREFIX_CASES[name]
    seed = sorted(PREFIX_CASES).index(name) * 10 + ratio
    c = make_prefix_case(
        groups, solo, num_heads=ratio, num_kv_heads=1, head_dim=32, block_size=4, dtype=dtype, seed=seed
    )
    out = _poisoned(c.q)
    assert prefix_shared_attention_triton(*c.args(), out=out) is out
    assert rel_error(out, naive_prefix_attention(c)) < TOL[dtype]


def test_prefix_shared_triton_bf16_gqa_two_kv_heads():
    c = make_prefix_case(
        [(6, [(1, 2), (3, 5)])],
        [(2, 2)],
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=8,
        dtype=torch.bfloat16,
        seed=99,
    )
    out = _poisoned(c.q)
    prefix_shared_attention_triton(*c.args(), out=out)
    assert rel_error(out, naive_prefix_attention(c)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_paged_decode_triton(ratio, dtype, num_splits):
    c = make_prefix_case(
        [],
        [(1, n) for n in (1, 5, 40, 17)],
        num_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        dtype=dtype,
        seed=ratio + (num_splits or 0),
    )
    out = _poisoned(c.q)
    paged_decode_attention_triton(
        c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale, out=out, num_splits=num_splits
    )
    assert rel_error(out, naive_prefix_attention(c)) < TOL[dtype]


def _prefill_inputs(ratio: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 5, 5, 6, 26], dtype=torch.int32)  # includes an empty prompt
    q = torch.randn(26, 2 * ratio, 32, generator=gen).to(dtype)
    k, v = torch.randn(2, 26, 2, 32, generator=gen).to(dtype)
    return q, k, v, cu, gen


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_packed_prefill_triton(ratio, dtype):
    q, k, v, cu, _ = _prefill_inputs(ratio, dtype, seed=ratio)
    out = _poisoned(q)
    packed_prefill_attention_triton(q, k, v, cu, 0.2, out=out)
    assert rel_error(out, naive_packed_prefill(q, k, v, cu, 0.2)) < TOL[dtype]


def test_packed_prefill_triton_writes_cache():
    q, k, v, cu, gen = _prefill_inputs(1, torch.float16, seed=7)
    k_cache, v_cache = torch.zeros(2, 10, 4, 2, 32, dtype=torch.float16)
    slots = torch.randperm(40, generator=gen)[:26]
    slots[3] = -1
    out = _poisoned(q)
    packed_prefill_attention_triton(q, k, v, cu, 0.2, out=out, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert rel_error(out, naive_packed_prefill(q, k, v, cu, 0.2)) < 1e-3
    ok = slots >= 0
    assert torch.equal(k_cache.view(-1, 2, 32)[slots[ok]], k[ok])
    assert torch.equal(v_cache.view(-1, 2, 32)[slots[ok]], v[ok])
    assert int((k_cache.view(-1, 2, 32).abs().sum((1, 2)) > 0).sum()) == 25


def test_write_kv_cache_triton_strided_input_and_cast():
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 3, 2, 16, generator=gen)  # k, v are strided views of it
    k, v = qkv[:, 1], qkv[:, 2]
    k_cache, v_cache = torch.zeros(2, 3, 4, 2, 16, dtype=torch.float16)
    slots = torch.tensor([11, -1, 0, 4, 5])
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    ok = slots >= 0
    assert torch.equal(k_cache.view(-1, 2, 16)[slots[ok]], k[ok].half())
    assert torch.equal(v_cache.view(-1, 2, 16)[slots[ok]], v[ok].half())
    assert k_cache.view(-1, 2, 16).abs().sum((1, 2)).count_nonzero() == 4


def test_launchers_reject_bad_arguments():
    c = make_prefix_case(
        [(4, [(1, 2)])], [], num_heads=2, num_kv_heads=1, head_dim=32, block_size=4, dtype=torch.float16, seed=0
    )
    with pytest.raises(ValueError, match="head_dim"):
        prefix_shared_attention_triton(c.q[..., :24], c.k_cache[..., :24], c.v_cache[..., :24], *c.args()[3:])
    with pytest.raises(ValueError, match="q has dtype"):
        prefix_shared_attention_triton(c.q.double(), *c.args()[1:])
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention_triton(c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables.repeat(2, 1), c.scale)
    strided = c.block_tables.repeat(1, 2)[:, ::2]
    with pytest.raises(ValueError, match="block_tables must have stride 1"):
        paged_decode_attention_triton(c.q, c.k_cache, c.v_cache, c.kv_lens, strided, c.scale)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention_triton(c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale, num_splits=0)
    with pytest.raises(ValueError, match="q must have stride 1"):
        paged_decode_attention_triton(
            c.q.transpose(1, 2).contiguous().transpose(1, 2), c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale
        )


def test_decode_and_prefill_triton_bf16():
    c = make_prefix_case(
        [],
        [(1, n) for n in (3, 33)],
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        block_size=16,
        dtype=torch.bfloat16,
        seed=11,
    )
    out = _poisoned(c.q)
    paged_decode_attention_triton(c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale, out=out, num_splits=2)
    assert rel_error(out, naive_prefix_attention(c)) < TOL[torch.bfloat16]
    q, k, v, cu, _ = _prefill_inputs(1, torch.bfloat16, seed=12)
    out = _poisoned(q)
    packed_prefill_attention_triton(q, k, v, cu, 0.2, out=out)
    assert rel_error(out, naive_packed_prefill(q, k, v, cu, 0.2)) < TOL[torch.bfloat16]


def test_public_functions_keep_triton_off_the_cpu():
    from prefixflow.kernels import cpu_kernels, prefix_shared_attention, prefix_shared_attention_ref
    from prefixflow.kernels.prefix_attention import prefix_shared_attention_cpu

    # float32 takes the C kernel where it is built, float64 the torch reference.
    for dtype in (torch.float32, torch.float64):
        c = make_prefix_case(
            [(5, [(2, 3)])], [(1, 2)], num_heads=2, num_kv_heads=1, head_dim=32, block_size=4, dtype=dtype, seed=13
        )
        cpu_path = prefix_shared_attention_cpu if cpu_kernels.supports(c.q, c.k_cache) else prefix_shared_attention_ref
        assert torch.equal(prefix_shared_attention(*c.args()), cpu_path(*c.args()))


def test_prefix_shared_triton_group_of_seven_heads():
    # Qwen2.5-7B packs 7 query heads per kv head: rows that are not a power of two.
    groups, solo = PREFIX_CASES["mixed_prefill_decode"]
    c = make_prefix_case(
        groups, solo, num_heads=14, num_kv_heads=2, head_dim=32, block_size=4, dtype=torch.float16, seed=21
    )
    out = _poisoned(c.q)
    prefix_shared_attention_triton(*c.args(), out=out)
    assert rel_error(out, naive_prefix_attention(c)) < TOL[torch.float16]


def _random_step(rng: random.Random) -> tuple[list, list]:
    groups = []
    for _ in range(rng.randint(0, 3)):
        members = [
            (q, q + rng.randint(0, 6))
            for q in (rng.choice([1, 1, 1, rng.randint(2, 6)]) for _ in range(rng.randint(1, 3)))
        ]
        groups.append((rng.choice([0, rng.randint(1, 40), rng.randint(1, 700)]), members))
    solo = [
        (q, q + rng.randint(0, 30))
        for q in (rng.choice([1, rng.randint(1, 5)]) for _ in range(rng.randint(0 if groups else 1, 3)))
    ]
    return groups, solo


@pytest.mark.parametrize("seed", range(6))
def test_prefix_shared_triton_random_steps(seed):
    rng = random.Random(seed)
    groups, solo = _random_step(rng)
    ratio = rng.choice([1, 2, 3, 4])
    c = make_prefix_case(
        groups,
        solo,
        num_heads=ratio * 2,
        num_kv_heads=2,
        head_dim=32,
        block_size=rng.choice([1, 2, 16]),
        dtype=torch.float32,
        seed=seed,
    )
    out = _poisoned(c.q)
    prefix_shared_attention_triton(*c.args(), out=out)
    assert rel_error(out, naive_prefix_attention(c)) < TOL[torch.float32], (groups, solo)


def test_prefix_shared_triton_config_override_splits():
    groups, solo = PREFIX_CASES["mixed_prefill_decode"]
    c = make_prefix_case(
        groups, solo, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32, seed=31
    )
    out = _poisoned(c.q)
    prefix_shared_attention_triton(*c.args(), out=out, config=dict(NSP=3, NSO=2, BN_P=32, BM_O=32))
    assert rel_error(out, naive_prefix_attention(c)) < TOL[torch.float32]
    with pytest.raises(ValueError, match="NSP"):
        prefix_shared_attention_triton(*c.args(), config=dict(NSP=0))
