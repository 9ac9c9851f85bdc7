"""The C CPU kernels (kernels/cpu_kernels.py) against the float64 oracle or torch, and the
dispatch around them: attention over the paged cache (decode and chunked steps, with or without
shared prefixes) and K/V writes take them on the CPU in float32; other dtypes keep torch."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
import torch
from support.kernel_oracles import naive_prefix_attention, rel_error

from prefixflow.bench.kernel_cases import make_prefix_case
from prefixflow.kernels import cpu_kernels
from prefixflow.kernels.kv_write import write_kv_cache, write_kv_cache_ref
from prefixflow.kernels.paged_decode import paged_decode_attention, paged_decode_attention_cpu
from prefixflow.kernels.prefix_attention import (
    prefix_shared_attention,
    prefix_shared_attention_cpu,
    prefix_shared_attention_ref,
)

pytestmark = pytest.mark.skipif(
    not cpu_kernels.supports(torch.zeros(1, 1, 8), torch.zeros(1, 4, 1, 8)),
    reason="no C compiler to build the CPU kernel",
)

# (heads, kv heads, head dim, block size): GQA 2 and 4, MHA, odd sizes, one-token blocks
SHAPES = [(8, 4, 64, 32), (8, 2, 64, 16), (4, 4, 32, 4), (6, 3, 40, 5), (2, 1, 128, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_with_shared_prefixes_matches_the_oracle(shape, threads):
    hq, hkv, d, bs = shape
    # Groups (prefixes of 70, 5 and 40 keys, one with an empty prefix), members of various
    # own lengths (1 key: only its own), and sequences with no prefix. The 40-key group has
    # enough members to be read as one tile of several members' queries (the kernel's group
    # path, up to one vector of rows of query heads at a time; the rest go one by one).
    many = [(1, n) for n in (1, 3, 7, 20, 33, 2, 5, 9, 11, 64, 4)]
    case = make_prefix_case(
        [(70, [(1, 1), (1, 9), (1, 33)]), (5, [(1, 2)]), (0, [(1, 4)]), (40, many)],
        [(1, 1), (1, 50)],
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=torch.float32,
        seed=hq + d + bs,
    )
    _check_the_c_path(case, threads)


def test_decode_without_prefix_matches_the_oracle_and_writes_a_strided_out():
    case = make_prefix_case(
        [],
        [(1, n) for n in (1, 7, 64, 65, 200)],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=3,
    )
    out = torch.zeros(case.q.shape[0], 8, 128)[:, :, ::2]  # last dim strided: rejected
    with pytest.raises(ValueError):
        paged_decode_attention_cpu(case.q, case.k_cache, case.v_cache, case.kv_lens, case.block_tables, case.scale, out)
    out = torch.zeros(8, case.q.shape[0], 64).transpose(0, 1)  # not contiguous, unit stride in D
    paged_decode_attention_cpu(case.q, case.k_cache, case.v_cache, case.kv_lens, case.block_tables, case.scale, out)
    assert rel_error(out, naive_prefix_attention(case)) < 1e-5
    again = paged_decode_attention(case.q, case.k_cache, case.v_cache, case.kv_lens, case.block_tables, case.scale)
    assert torch.equal(again, out)


@pytest.mark.parametrize("shape", SHAPES + [(9, 3, 64, 16), (32, 2, 128, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_steps_with_shared_prefixes_match_the_oracle(shape, threads):
    hq, hkv, d, bs = shape
    # (queries, own keys): chunks that start the sequence (q == own), chunks after cached
    # keys, single queries beside them, chunks longer than one tile of the kernel (64 rows),
    # a prefix's own computation (no prefix, long), and groups whose prefix is empty.
    case = make_prefix_case(
        [(70, [(1, 1), (5, 9), (33, 33), (100, 140)]), (5, [(1, 2), (2, 2)]), (0, [(1, 4), (7, 7)])],
        [(1, 1), (1, 50), (17, 17), (3, 80), (64, 64), (65, 65)],
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        dtype=torch.float32,
        seed=hq + d + bs,
    )
    _check_the_c_path(case, threads)


def _check_the_c_path(case, threads: int) -> None:
    """The C kernel on `threads` threads matches the float64 oracle and the torch path, and
    the public function takes it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = prefix_shared_attention_cpu(*case.args())
    finally:
        torch.set_num_threads(before)
    assert rel_error(out, naive_prefix_attention(case)) < 1e-5
    assert rel_error(out, prefix_shared_attention_ref(*case.args())) < 1e-5
    assert torch.equal(prefix_shared_attention(*case.args()), out)


@pytest.mark.parametrize("vector_floats", [4, 8, 16], indirect=True)
def test_every_vector_width_matches_the_oracle(vector_floats):
    # Widths other CPUs build (4: SSE and NEON, 8: AVX2, 16: AVX-512; a wider one than the CPU
    # has still runs, slowly): decode with groups read as one tile (GQA 3 and 2) and alone,
    # and chunked steps.
    for hq, hkv, d, bs in [(9, 3, 64, 16), (8, 4, 40, 5), (4, 2, 32, 8)]:
        many = [(1, n) for n in (1, 3, 7, 20, 33, 2, 5, 9)]
        shape = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=torch.float32)
        decode = make_prefix_case([(70, [(1, 1), (1, 9)]), (40, many)], [(1, 50)], **shape, seed=d)
        chunked = make_prefix_case([(37, [(2, 5), (17, 30)]), (0, [(3, 3)])], [(9, 12)], **shape, seed=bs)
        for case in (decode, chunked):
            for threads in (1, 2):
                _check_the_c_path(case, threads)


def test_the_vector_width_follows_the_cpu_and_a_bad_override_is_named(monkeypatch):
    from prefixflow.kernels import cpu_build

    monkeypatch.delenv("PREFIXFLOW_CPU_VECTOR_FLOATS", raising=False)  # set by a user: not the CPU's
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma avx512f")
    assert cpu_build.vector_floats() == 16
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma")
    assert cpu_build.vector_floats() == 8
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "Features : fp asimd")
    assert cpu_build.vector_floats() == 4
    monkeypatch.setenv("PREFIXFLOW_CPU_VECTOR_FLOATS", "32")
    with pytest.raises(ValueError, match="PREFIXFLOW_CPU_VECTOR_FLOATS"):
        cpu_build.vector_floats()


def test_block_ids_outside_the_cache_are_an_error_not_a_crash():
    case = make_prefix_case(
        [(40, [(1, 5)])], [(1, 3)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, seed=6
    )
    bad = case.block_tables.clone()
    bad[0, 0] = case.k_cache.shape[0]
    with pytest.raises(ValueError, match="block table"):
        paged_decode_attention_cpu(case.q, case.k_cache, case.v_cache, case.kv_lens, bad, case.scale)
    bad_prefix = case.prefix_block_tables.clone()
    bad_prefix[0, 0] = -1
    args = list(case.args())
    args[7] = bad_prefix
    with pytest.raises(ValueError, match="block table"):
        prefix_shared_attention_cpu(*args)


def test_other_dtypes_and_the_switch_keep_the_reference(monkeypatch):
    case = make_prefix_case(
        [(9, [(1, 3)])], [], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float64, seed=7
    )
    assert not cpu_kernels.supports(case.q, case.k_cache)
    f32 = make_prefix_case(
        [(9, [(1, 3)])], [], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, seed=7
    )
    monkeypatch.setenv("PREFIXFLOW_CPU_KERNELS", "0")
    assert not cpu_kernels.supports(f32.q, f32.k_cache)


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_the_reference_runs(compiler, monkeypatch, tmp_path):
    case = make_prefix_case(
        [(9, [(1, 3)])], [(1, 2)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, seed=8
    )
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("PREFIXFLOW_CACHE", str(tmp_path))  # nothing built there yet
    cpu_kernels._library.cache_clear()
    try:
        assert not cpu_kernels.supports(case.q, case.k_cache)
        assert rel_error(prefix_shared_attention(*case.args()), naive_prefix_attention(case)) < 1e-5
    finally:
        cpu_kernels._library.cache_clear()


def test_the_kernel_shares_torchs_openmp_runtime():
    # In a fresh process: other libraries the suite imports (sentencepiece) map their own
    # libgomp; what matters is that loading ours adds none next to torch's.
    script = (
        "import torch\n"
        "from prefixflow.kernels import cpu_kernels\n"
        "assert cpu_kernels._library() is not None\n"
        "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    runtimes = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1 and "/torch/lib/" in runtimes[0], runtimes


@pytest.mark.parametrize("tokens", [3, 400])
def test_kv_write_matches_torch_and_skips_negative_slots(tokens):
    gen = torch.Generator().manual_seed(tokens)
    kv = torch.randn(tokens, 2, 3, 16, generator=gen)  # k and v interleaved: strided views
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(40 * 16, generator=gen)[:tokens]
    slots[::5] = -1
    ours = [torch.zeros(40, 16, 3, 16) for _ in range(2)]
    ref = [torch.zeros(40, 16, 3, 16) for _ in range(2)]
    write_kv_cache(k, v, *ours, slots)
    write_kv_cache_ref(k, v, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    with pytest.raises(ValueError, match="slot"):
        write_kv_cache(k, v, *ours, torch.full((tokens,), 40 * 16))


def test_loading_the_kernels_keeps_subnormal_floats():
    # A library linked with -ffast-math would set flush-to-zero for the whole process.
    cpu_kernels._library()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() > 0
    assert float.fromhex("0x0.0000000000001p-1022") * float(len("1")) > 0
