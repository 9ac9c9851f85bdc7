"""RMSNorm and rotary kernels: the references against engine-equivalent torch code in float64
and HF's rounding, the Triton launchers (interpreter here) against the references."""

import pytest
import torch

from prefixflow.kernels._common import interpreting
from prefixflow.kernels.norm import rms_norm_ref, rms_norm_triton
from prefixflow.kernels.rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton, triton_takes

triton_only = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
# bf16 is left to tests/gpu: these kernels round intermediates to the model dtype (as HF does)
# and the interpreter's bf16 casts are wrong (see /work/shared/NOTES.md).
DTYPES = [torch.float16, torch.float32]


def _cos_sin(positions: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(positions).float(), inv).repeat(1, 2)  # [P, D]
    return torch.stack([emb.cos(), emb.sin()], dim=1)  # [P, 2, D]


def test_rms_norm_ref_matches_formula():
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 5, 48, generator=gen, dtype=torch.float64)
    w = torch.randn(48, generator=gen, dtype=torch.float64)
    y, new_res = rms_norm_ref(x, w, 1e-6, residual=res)
    s = x + res
    assert torch.allclose(new_res, s)
    assert torch.allclose(y, w * s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6))


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton(dtype, with_residual):
    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(2, 6, 80, generator=gen).to(dtype)  # hidden not a power of two
    w = torch.randn(80, generator=gen).to(dtype)
    res = res if with_residual else None
    got, want = rms_norm_triton(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)
    if not with_residual:
        got, want = (got, x), (want, x)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    for g, r in zip(got, want):
        assert g.dtype == dtype and torch.allclose(g.float(), r.float(), rtol=tol, atol=tol)


def test_rotary_ref_matches_complex_rotation():
    # Rotate-half RoPE rotates each pair (x_i, x_{i+D/2}) by angle pos * inv_freq_i.
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, 3, 8, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 5, 2, 9])
    cs = _cos_sin(16, 8).double()[pos]  # [T, 2, D]
    q_rot = apply_rotary_ref(q, cs[:, 0:1], cs[:, 1:2])
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).double() / 8))
    angle = pos.double()[:, None] * inv  # [T, D/2]
    z = torch.complex(q[..., :4], q[..., 4:]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    assert torch.allclose(q_rot, torch.cat([z.real, z.imag], dim=-1), atol=1e-6)


def test_rotary_takes_the_triton_kernel_only_for_tensors_it_takes():
    """apply_rotary falls back to torch (on CUDA too) for what the Triton launcher refuses."""
    x = torch.zeros(3, 4, 8)
    cs = torch.zeros(3, 2, 8)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    assert triton_takes(x, cos, sin)
    assert not triton_takes(x.double(), cos.double(), sin.double())  # no float64 kernel
    assert not triton_takes(x.half(), cos, sin)  # cos and sin in another dtype
    assert not triton_takes(x.transpose(1, 2), cos, sin)  # last dim strided
    assert not triton_takes(x, cos, sin.contiguous())  # row strides differ
    assert torch.equal(apply_rotary(x, cos, sin), apply_rotary_ref(x, cos, sin))  # the CPU: torch


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_rotary_on_triton_equals_torch_on_strided_views(dtype):
    """apply_rotary's Triton kernel (CUDA) rounds as its torch version, on the model's layout:
    q and k heads of the fused projection, cos and sin two views of the table's gathered rows."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 4 + 2 * 2, 32, generator=gen).to(dtype)
    qk = qkv[:, :6]  # 4 query and 2 key heads; v left out
    cs = _cos_sin(8, 32)[torch.tensor([3, 0, 7, 7, 1])].to(dtype)  # [T, 2, D]
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    got, want = apply_rotary_triton(qk, cos, sin), apply_rotary_ref(qk, cos, sin)
    assert got.is_contiguous() and got.shape == (5, 6, 32)
    if dtype == torch.float32:  # the interpreter's half-precision casts are not torch's (NOTES.md)
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got.float(), want.float(), rtol=2e-3, atol=2e-3)


def test_engine_layers_round_like_hugging_face():
    """The engine's rotary and fp32 RMSNorm give HF Llama's values bit for bit: a last-bit
    difference (a fused multiply-add) can flip a greedy near-tie of a real run."""
    from prefixflow.engine.models.layers.norm import RMSNorm
    from prefixflow.engine.models.layers.rotary import RopeConfig, RotaryEmbedding
    from prefixflow.kernels.rotary import apply_rotary

    g = torch.Generator().manual_seed(0)
    cos, sin = RotaryEmbedding(64, 2048, RopeConfig())(torch.randint(0, 2048, (300,), generator=g), torch.float32)
    x = torch.randn(300, 12, 64, generator=g) * 3
    hf = x * cos + torch.cat([-x[..., 32:], x[..., :32]], dim=-1) * sin
    assert torch.equal(apply_rotary(x, cos, sin), hf)
    norm = RMSNorm(512, 1e-6)
    norm.weight.data = torch.randn(512, generator=g)
    h = torch.randn(77, 512, generator=g) * 5
    hf = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(h), hf)


@pytest.mark.parametrize("hidden", [64, 576, 1000, 4096, 8200])  # 4096+: torch's cascaded sum
@pytest.mark.parametrize("rows", [1, 7, 130])  # 130: the C loop's threads
def test_c_rms_norm_rounds_like_torch(hidden, rows):
    from prefixflow.kernels import cpu_exact

    g = torch.Generator().manual_seed(hidden + rows)
    x = torch.randn(rows, hidden, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    residual = torch.randn(rows, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    assert cpu_exact.supports_norm(x, residual, weight)
    want_residual = x + residual
    want = torch.nn.functional.rms_norm(want_residual, (hidden,), weight, 1e-5)
    assert torch.equal(cpu_exact.add_rms_norm(x, residual, weight, 1e-5), want)
    assert torch.equal(residual, want_residual)  # the sum, in place
    assert torch.equal(
        cpu_exact.add_rms_norm(x, None, weight, 1e-5), torch.nn.functional.rms_norm(x, (hidden,), weight, 1e-5)
    )


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_c_rotary_rotates_strided_qkv_in_place_like_torch(head_dim):
    from prefixflow.engine.models.layers.rotary import RopeConfig, RotaryEmbedding
    from prefixflow.kernels.rotary import apply_rotary
    from prefixflow.kernels import cpu_exact

    g = torch.Generator().manual_seed(head_dim)
    heads = torch.randn(90, 9 + 2 * 3, head_dim, generator=g) * 4  # a fused qkv, 9 q / 3 kv
    cos, sin = RotaryEmbedding(head_dim, 4096, RopeConfig(theta=1e5))(
        torch.randint(0, 4096, (90,), generator=g), torch.float32
    )
    qk = heads[:, :12]
    want, v = apply_rotary(qk, cos, sin), heads[:, 12:].clone()
    assert cpu_exact.supports_rotary(qk, cos, sin)
    assert cpu_exact.rotary_(qk, cos, sin) is qk
    assert torch.equal(heads[:, :12], want) and torch.equal(heads[:, 12:], v)


def test_layers_keep_torch_where_the_c_norm_would_round_otherwise(monkeypatch):
    """A torch build whose sum runs in another order fails the self-check: RMSNorm then takes
    torch's path and still rounds like Hugging Face."""
    from prefixflow.engine.models.layers.norm import RMSNorm
    from prefixflow.kernels import cpu_exact

    g = torch.Generator().manual_seed(5)
    h, r = torch.randn(2, 9, 320, generator=g)
    norm = RMSNorm(320, 1e-6)
    want = norm.weight * ((h + r) * torch.rsqrt((h + r).pow(2).mean(-1, keepdim=True) + 1e-6))
    monkeypatch.setattr(cpu_exact, "_LANES", (3,))  # no such vector width: never exact
    cpu_exact._norm_lanes.cache_clear()
    try:
        assert not cpu_exact.supports_norm(h, r, norm.weight)
        out, residual = norm(h, r.clone())
        assert torch.equal(out, want) and torch.equal(residual, h + r)
    finally:
        cpu_exact._norm_lanes.cache_clear()
    monkeypatch.setenv("PREFIXFLOW_CPU_KERNELS", "0")
    assert not cpu_exact.supports_norm(h, r, norm.weight)


def test_c_paths_refuse_what_torch_would_broadcast():
    """Broadcast shapes are torch's business: the C loops would read past the smaller tensor."""
    from prefixflow.kernels import cpu_exact

    x, w = torch.randn(4, 64), torch.randn(64)
    assert cpu_exact.supports_norm(x, torch.randn(4, 64), w)
    assert not cpu_exact.supports_norm(x, torch.randn(1, 64), w)
    assert not cpu_exact.supports_norm(x, None, torch.randn(1))
    qk, cs = torch.randn(4, 3, 32), torch.randn(4, 2, 32)
    assert cpu_exact.supports_rotary(qk, cs[:, 0:1], cs[:, 1:2])
    assert not cpu_exact.supports_rotary(qk, cs[:1, 0:1], cs[:1, 1:2])
