"""The fast CPU paths of the attention references (flash kernel with log-sum-exp merges,
block gathers into reusable scratch buffers, batched decode) against a dense float64 oracle,
on engine-like shapes: multi-block prefixes, GQA, chunked prefill over cached keys, decode
padding, sub-batches, and the plain-matmul fallback for torch builds without the CPU kernel."""

import pytest
import torch

from prefixflow.kernels import packed_prefill_attention_ref, paged_decode_attention_ref, prefix_shared_attention_ref
from prefixflow.kernels import _common
from prefixflow.bench.kernel_cases import PrefixCase, make_prefix_case
from support.kernel_oracles import naive_packed_prefill, rel_error

ENGINE_LIKE = (
    # groups [(prefix_len, [(q_len, kv_len)])]: decode members, fresh chunks, a chunk over
    # cached keys, a member with no query this step
    [(40, [(1, 23), (1, 40), (7, 7), (5, 12), (0, 3)]), (33, [(1, 50)])],
    # solo: decode of several lengths, chunked prefill, a fresh prompt
    [(1, 70), (9, 20), (16, 16), (1, 1)],
)


@pytest.fixture(params=[True, False], ids=["flash", "matmul"])
def flash(request, monkeypatch):
    """Runs a test with the CPU flash kernel and again as a torch build without it."""
    if request.param and _common._FLASH_CPU is None:
        pytest.skip("this torch build has no _scaled_dot_product_flash_attention_for_cpu")
    if not request.param:
        monkeypatch.setattr(_common, "_FLASH_CPU", None)
    return request.param


def _slots(table: list[int], length: int, block_size: int) -> tuple[list[int], list[int]]:
    return [table[j // block_size] for j in range(length)], [j % block_size for j in range(length)]


def dense_oracle(c: PrefixCase) -> torch.Tensor:
    """Float64 attention per sequence with an explicit mask (no code shared with the refs)."""
    q, kc, vc = c.q.double(), c.k_cache.double(), c.v_cache.double()
    cu, lens = c.cu_seqlens_q.tolist(), c.kv_lens.tolist()
    plens, ranges = c.prefix_lens.tolist(), c.prefix_seq_ranges.tolist()
    bs, ratio = kc.shape[1], q.shape[1] // kc.shape[2]
    out = torch.full_like(q, float("nan"))
    for s, (lo, hi) in enumerate(zip(cu, cu[1:])):
        if hi == lo:
            continue
        g = next((g for g in range(len(plens)) if ranges[g] <= s < ranges[g + 1]), -1)
        p_len = plens[g] if g >= 0 else 0
        pb, po = _slots(c.prefix_block_tables[g].tolist(), p_len, bs) if p_len else ([], [])
        ob, oo = _slots(c.block_tables[s].tolist(), lens[s], bs)
        blocks, offs = torch.tensor(pb + ob, dtype=torch.long), torch.tensor(po + oo)
        k = kc[blocks, offs].repeat_interleave(ratio, dim=1)  # [K, Hq, D]
        v = vc[blocks, offs].repeat_interleave(ratio, dim=1)
        n = hi - lo
        j, i = torch.arange(len(ob)), torch.arange(n)
        keep = torch.cat([torch.ones(n, p_len, dtype=torch.bool), j[None] <= lens[s] - n + i[:, None]], dim=1)  # [n, K]
        scores = torch.einsum("thd,khd->htk", q[lo:hi], k) * c.scale
        p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        out[lo:hi] = torch.einsum("htk,khd->thd", p, v)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_prefix_ref_engine_like(flash, ratio, dtype):
    c = make_prefix_case(
        *ENGINE_LIKE, num_heads=2 * ratio, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=ratio
    )
    out = torch.full_like(c.q, float("nan"))
    assert prefix_shared_attention_ref(*c.args(), out=out) is out
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_error(out, dense_oracle(c)) < tol


def test_decode_ref_padding_and_sub_batches(flash, monkeypatch):
    lens = [1, 17, 64, 3, 100, 33, 16, 250]
    c = make_prefix_case(
        [], [(1, n) for n in lens], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=7
    )
    want = dense_oracle(c)
    args = (c.q, c.k_cache, c.v_cache, c.kv_lens, c.block_tables, c.scale)
    assert rel_error(paged_decode_attention_ref(*args), want) < 1e-5
    # Sub-batches of about three sequences (the memory bound of the gathered K/V).
    monkeypatch.setattr(_common, "_DECODE_MAX_ELEMENTS", 3 * 256 * 2 * 32)
    assert rel_error(paged_decode_attention_ref(*args), want) < 1e-5


def test_refs_on_a_strided_cache_and_in_float16(flash):
    c = make_prefix_case(
        *ENGINE_LIKE, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float16, seed=3
    )
    want = dense_oracle(c)
    got = prefix_shared_attention_ref(*c.args())
    assert got.dtype == torch.float16 and rel_error(got, want) < 2e-3
    # The same cache as a non-contiguous view (unit stride in head_dim only).
    wide_k = torch.zeros(*c.k_cache.shape[:3], 2, 32, dtype=torch.float16)
    wide_v = torch.zeros_like(wide_k)
    wide_k[:, :, :, 1], wide_v[:, :, :, 1] = c.k_cache, c.v_cache
    k_view, v_view = wide_k[:, :, :, 1], wide_v[:, :, :, 1]
    assert not k_view.is_contiguous()
    args = list(c.args())
    args[1], args[2] = k_view, v_view
    assert torch.equal(prefix_shared_attention_ref(*args), got)


def test_outputs_survive_later_calls_that_reuse_the_scratch_buffers():
    big = make_prefix_case(
        [(64, [(1, 90), (3, 30)])],
        [(1, 200)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        seed=11,
    )
    small = make_prefix_case(
        [(5, [(1, 3)])], [(2, 2)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=12
    )
    first = prefix_shared_attention_ref(*big.args())
    kept = first.clone()
    second = prefix_shared_attention_ref(*small.args())
    assert torch.equal(first, kept)
    assert rel_error(first, dense_oracle(big)) < 1e-5
    assert rel_error(second, dense_oracle(small)) < 1e-5
    assert rel_error(prefix_shared_attention_ref(*big.args()), kept) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_prefill_ref_gqa(flash, dtype):
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 5, 5, 45, 46, 70], dtype=torch.int32)
    q = torch.randn(70, 8, 16, generator=gen, dtype=dtype)
    k, v = torch.randn(2, 70, 2, 16, generator=gen, dtype=dtype)
    got = packed_prefill_attention_ref(q, k, v, cu, 0.3)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_error(got, naive_packed_prefill(q, k, v, cu, 0.3)) < tol


@pytest.mark.parametrize("use_flash", [True, False])
def test_attention_lse_returns_the_log_sum_exp(use_flash):
    if use_flash and _common._FLASH_CPU is None:
        pytest.skip("no CPU flash kernel in this torch build")
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 5, 16, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 9, 16, generator=gen, dtype=torch.float64)
    keep = torch.rand(2, 1, 5, 9, generator=gen) < 0.7
    keep[..., 0] = True
    bias = torch.zeros(2, 1, 5, 9, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    out, lse = _common.attention_lse(q, k, v, 0.25, bias=bias, use_flash=use_flash)
    scores = q @ k.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25 + bias
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)
    want = torch.softmax(scores, -1) @ v.repeat_interleave(3, dim=1)
    assert torch.allclose(out, want, atol=1e-12)
    square_k, square_v = k[:, :, :5], v[:, :, :5]
    out, _ = _common.attention_lse(q, square_k, square_v, 0.25, causal=True, use_flash=use_flash)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    scores = (q @ square_k.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.25).masked_fill(~causal, float("-inf"))
    want = torch.softmax(scores, -1) @ square_v.repeat_interleave(3, dim=1)
    assert torch.allclose(out, want, atol=1e-12)


def test_scratch_buffers_work_inside_and_outside_inference_mode(monkeypatch):
    c = make_prefix_case(
        [(40, [(1, 23), (3, 5)])],
        [(1, 70)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        seed=1,
    )
    want = dense_oracle(c)
    with torch.inference_mode():  # the engine's mode: buffers first made here
        assert rel_error(prefix_shared_attention_ref(*c.args()), want) < 1e-5
    assert rel_error(prefix_shared_attention_ref(*c.args()), want) < 1e-5
    monkeypatch.setattr(_common, "_SCRATCH_MAX_ELEMENTS", 1000)  # too big to keep: fresh
    assert rel_error(prefix_shared_attention_ref(*c.args()), want) < 1e-5


def _renumbered(c: PrefixCase) -> PrefixCase:
    """The same case with each table's used blocks renumbered to consecutive ids (a prefix or a
    sequence allocated in one go, as from a fresh cache), in table order; block 0 stays."""
    bs = c.k_cache.shape[1]
    rows = [(c.prefix_block_tables[g], n) for g, n in enumerate(c.prefix_lens.tolist())]
    rows += [(c.block_tables[s], n) for s, n in enumerate(c.kv_lens.tolist())]
    new_of = {0: 0}
    for table, n in rows:
        for b in table[: -(-n // bs)].tolist():
            new_of.setdefault(b, len(new_of))
    for b in range(c.k_cache.shape[0]):
        new_of.setdefault(b, len(new_of))
    old = torch.tensor(sorted(new_of, key=new_of.get))  # old id of each new id
    remap = torch.tensor([new_of[b] for b in range(len(new_of))], dtype=torch.int32)
    return PrefixCase(
        **{
            **c.__dict__,
            "k_cache": c.k_cache[old],
            "v_cache": c.v_cache[old],
            "block_tables": remap[c.block_tables.long()],
            "prefix_block_tables": remap[c.prefix_block_tables.long()],
        }
    )


def test_consecutive_blocks_are_read_in_place(flash):
    c = _renumbered(
        make_prefix_case(
            *ENGINE_LIKE, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=5
        )
    )
    assert rel_error(prefix_shared_attention_ref(*c.args()), dense_oracle(c)) < 1e-5
    # A prefix of consecutive blocks is a view of the cache (no copy at every layer and step).
    nb = -(-int(c.prefix_lens[0]) // c.k_cache.shape[1])
    k = _common.gather_blocks(c.k_cache, c.prefix_block_tables[:1], [nb], torch.float32, "k")
    assert k.data_ptr() == c.k_cache[int(c.prefix_block_tables[0, 0])].data_ptr()


def test_step_host_work_runs_once_for_all_layers(monkeypatch):
    from prefixflow.kernels import prefix_attention

    c = make_prefix_case(
        *ENGINE_LIKE, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=6
    )
    calls = []
    real = prefix_attention._plan
    monkeypatch.setattr(prefix_attention, "_plan", lambda *a: calls.append(1) or real(*a))
    want = dense_oracle(c)
    for _ in range(3):  # three layers of one step: same metadata tensors
        assert rel_error(prefix_shared_attention_ref(*c.args()), want) < 1e-5
    assert len(calls) == 1
    args = list(c.args())
    args[3] = c.cu_seqlens_q.clone()  # the next step's tensors
    prefix_shared_attention_ref(*args)
    assert len(calls) == 2
    bad = list(c.args())
    bad[4] = torch.ones_like(c.kv_lens)  # fewer keys than queries: refused at every call
    for _ in range(2):
        with pytest.raises(ValueError, match="kv_lens"):
            prefix_shared_attention_ref(*bad)


def test_kv_write_works_out_its_slots_once_per_step(monkeypatch):
    from prefixflow.kernels import kv_write

    calls = []
    real = kv_write._slots
    monkeypatch.setattr(kv_write, "_slots", lambda s: calls.append(1) or real(s))
    slots = torch.tensor([5, -1, 0, 9])  # -1: a token whose KV is not written
    for layer in range(2):  # two layers, one step
        k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
        kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
        kv_write.write_kv_cache_ref(k, v, kc, vc, slots)
        flat_k, flat_v = kc.view(12, 2, 8), vc.view(12, 2, 8)
        assert torch.equal(flat_k[[5, 0, 9]], k[[0, 2, 3]])
        assert torch.equal(flat_v[[5, 0, 9]], v[[0, 2, 3]])
        assert int((flat_k != 0).any(-1).any(-1).sum()) == 3
    assert len(calls) == 1


def test_attention_lse_gives_an_older_torchs_flash_kernel_one_kv_head_per_query_head(monkeypatch):
    """torch 2.8's CPU flash kernel reads kv heads past Hkv under GQA (NaN, no error); the probe
    says so there, and attention_lse then repeats the kv heads. Both branches run here."""
    if _common._FLASH_CPU is None:
        pytest.skip("no CPU flash kernel in this torch build")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 3, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, 6, 8, generator=gen, dtype=torch.float64)
    want, want_lse = _common.attention_lse(q, k, v, 0.5, use_flash=False)
    for reads_gqa in (True, False):
        if reads_gqa and not _common.flash_cpu_reads_gqa():
            continue  # this torch's kernel is the older one: only the repeated heads are right
        monkeypatch.setattr(_common, "flash_cpu_reads_gqa", lambda: reads_gqa)
        out, lse = _common.attention_lse(q, k, v, 0.5, use_flash=True)
        assert torch.allclose(out, want, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
