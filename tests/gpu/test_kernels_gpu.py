"""The Triton attention kernels on CUDA with realistic shapes (fp16, bf16, fp32), against the
torch references run in float64 (the references are checked against per-token loops in
tests/cpu/test_kernels_ref.py). Outputs are poisoned with NaN first: every element must be
written."""

import random

import pytest
import torch

from prefixflow.kernels import (
    packed_prefill_attention,
    packed_prefill_attention_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    prefix_shared_attention,
    prefix_shared_attention_ref,
    write_kv_cache,
)
from prefixflow.bench.kernel_cases import PrefixCase, make_prefix_case
from support.kernel_oracles import rel_error
from prefixflow.kernels.kv_write import write_kv_cache_triton
from prefixflow.kernels.packed_prefill import packed_prefill_attention_triton
from prefixflow.kernels.paged_decode import paged_decode_attention_triton
from prefixflow.kernels.prefix_attention import prefix_shared_attention_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
DTYPE_ID = str  # readable test ids: "torch.float16"
HEADS = {1: (16, 16, 64), 4: (32, 8, 128), 8: (32, 4, 128)}  # ratio: (Hq, Hkv, D)


def _decodes(rng: random.Random, n: int, lo: int, hi: int) -> list[tuple[int, int]]:
    return [(1, rng.randint(lo, hi)) for _ in range(n)]


def _prefix_cases(rng: random.Random) -> dict:
    return {
        "decode_groups": (
            [
                (2000, _decodes(rng, 16, 1, 300)),
                (1037, _decodes(rng, 8, 1, 300)),
                (515, _decodes(rng, 3, 1, 40)),
                (16, _decodes(rng, 1, 1, 5)),
            ],
            _decodes(rng, 20, 1, 1500),
        ),
        "mixed_prefill_decode": (
            [
                (1500, [(256, 256), (128, 700)] + _decodes(rng, 30, 1, 400)),
                (333, [(77, 77)] + _decodes(rng, 5, 1, 100)),
            ],
            [(512, 512), (300, 1000)] + _decodes(rng, 40, 1, 2000),
        ),
        "empty_prefix_and_group_of_one": ([(0, _decodes(rng, 4, 1, 50)), (999, [(5, 9)])], _decodes(rng, 3, 1, 10)),
        "few_long_seqs_no_groups": ([], _decodes(rng, 3, 3000, 9000) + [(200, 5000)]),
    }


def _f64(c: PrefixCase) -> PrefixCase:
    return PrefixCase(c.q.double(), c.k_cache.double(), c.v_cache.double(), *c.args()[3:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_ID)
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize(
    "name", ["decode_groups", "mixed_prefill_decode", "empty_prefix_and_group_of_one", "few_long_seqs_no_groups"]
)
def test_prefix_shared_gpu(name, ratio, dtype):
    groups, solo = _prefix_cases(random.Random(f"{name}{ratio}"))[name]
    hq, hkv, d = HEADS[ratio]
    c = make_prefix_case(
        groups, solo, num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype, seed=ratio, device=DEVICE
    )
    out = torch.full_like(c.q, float("nan"))
    prefix_shared_attention_triton(*c.args(), out=out)
    ref = prefix_shared_attention_ref(*_f64(c).args())
    assert rel_error(out, ref) < TOL[dtype]
    assert torch.equal(prefix_shared_attention(*c.args()), out)  # dispatch takes Triton


def test_prefix_shared_gpu_fp32():
    groups, solo = _prefix_cases(random.Random(0))["mixed_prefill_decode"]
    c = make_prefix_case(
        groups,
        solo,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.float32,
        seed=0,
        device=DEVICE,
    )
    out = torch.full_like(c.q, float("nan"))
    prefix_shared_attention_triton(*c.args(), out=out)
    assert rel_error(out, prefix_shared_attention_ref(*_f64(c).args())) < TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=DTYPE_ID)
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_paged_decode_gpu(ratio, dtype, num_splits):
    rng = random.Random(ratio * 10 + (num_splits or 0))
    hq, hkv, d = HEADS[ratio]
    c = make_prefix_case(
        [],
        _decodes(rng, 64, 1, 4000) + [(1, 16000)],
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=16,
        dtype=dtype,
        seed=ratio,
        device=DEVICE,
    )
    out = torch.full_like(c.q, float("nan"))
    args = (c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale)
    paged_decode_attention_triton(*args, out=out, num_splits=num_splits)
    ref = paged_decode_attention_ref(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args[3:])
    assert rel_error(out, ref) < TOL[dtype]
    assert rel_error(paged_decode_attention(*args), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=DTYPE_ID)
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_packed_prefill_gpu(ratio, dtype):
    hq, hkv, d = HEADS[ratio]
    lens = [1, 17, 300, 1024, 0, 513]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(ratio)
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=gen, device=DEVICE).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen, device=DEVICE).to(dtype)
    k_cache = torch.zeros(200, 16, hkv, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(200 * 16, generator=gen, device=DEVICE)[:t]
    out = torch.full_like(q, float("nan"))
    packed_prefill_attention_triton(q, k, v, cu, d**-0.5, out=out, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    ref = packed_prefill_attention_ref(q.double(), k.double(), v.double(), cu, d**-0.5)
    assert rel_error(out, ref) < TOL[dtype]
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], k)
    assert torch.equal(v_cache.view(-1, hkv, d)[slots], v)
    assert torch.equal(packed_prefill_attention(q, k, v, cu, d**-0.5), out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_ID)
def test_write_kv_cache_gpu(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    qkv = torch.randn(1000, 3, 8, 128, generator=gen, device=DEVICE).to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views
    k_cache = torch.zeros(100, 16, 8, 128, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(1600, generator=gen, device=DEVICE)[:1000]
    slots[::7] = -1
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    ok = slots >= 0
    assert torch.equal(k_cache.view(-1, 8, 128)[slots[ok]], k[ok])
    assert torch.equal(v_cache.view(-1, 8, 128)[slots[ok]], v[ok])
    written = k_cache.view(-1, 8, 128).abs().sum((1, 2)) > 0
    assert int(written.sum()) == int(ok.sum())
    k_cache2, v_cache2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv_cache(k, v, k_cache2, v_cache2, slots)
    assert torch.equal(k_cache2, k_cache) and torch.equal(v_cache2, v_cache)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=DTYPE_ID)
def test_rms_norm_gpu(dtype):
    from prefixflow.kernels import rms_norm, rms_norm_ref

    gen = torch.Generator(device=DEVICE).manual_seed(4)
    x = torch.randn(333, 4096, generator=gen, device=DEVICE).to(dtype)
    res = torch.randn(333, 4096, generator=gen, device=DEVICE).to(dtype)
    w = torch.randn(4096, generator=gen, device=DEVICE).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # relative and absolute, on values of order 1-10
    for got, want in zip(rms_norm(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)):
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=DTYPE_ID)
def test_the_models_rotary_on_triton_is_close_to_torch(dtype):
    """apply_rotary (the model's rotary: Triton on CUDA) against its torch version on the model's
    layout: within two roundings of the larger term, not equal. Compiled, the kernel
    does not round as it is written (on an H200, 2026-12-04, this test asking equality failed in
    every dtype: 8.8% of float16 elements differed, 7.7% of bfloat16, 25% of float32: Triton's
    default multiply-add fusion, which the launcher now turns off, kernels/rotary.py). This
    bound has not yet run on a GPU; with the fusion off the kernel may well equal torch."""
    from prefixflow.kernels.rotary import apply_rotary, apply_rotary_ref

    gen = torch.Generator(device=DEVICE).manual_seed(5)
    qkv = torch.randn(333, 48, 64, generator=gen, device=DEVICE).to(dtype)
    qk = qkv[:, :40]  # 32 query and 8 key heads of the fused projection
    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    emb = torch.outer(torch.arange(4096, device=DEVICE).float(), inv).repeat(1, 2)
    pos = torch.randint(0, 4096, (333,), generator=gen, device=DEVICE)
    cs = torch.stack([emb.cos(), emb.sin()], dim=1)[pos].to(dtype)  # [T, 2, D], as RotaryEmbedding gives
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    got, want = apply_rotary(qk, cos, sin), apply_rotary_ref(qk, cos, sin)
    assert got.is_contiguous() and got.shape == want.shape
    # A rounding more or less of either product: an ulp of the larger term, not of the result
    # (the two terms can cancel).
    x, half = qk.float(), qk.shape[-1] // 2
    terms = x.abs() * cos.float().abs() + torch.cat([x[..., half:], x[..., :half]], -1).abs() * sin.float().abs()
    assert bool(((got.float() - want.float()).abs() <= 2 * torch.finfo(dtype).eps * terms).all())
