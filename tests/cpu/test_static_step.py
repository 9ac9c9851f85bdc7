"""Decode steps on persistent buffers padded to a ladder (engine/native/static_step.py): the
layer CUDA graphs are captured over, checked on the CPU without the capture.

- the ladder and which steps take a rung;
- the model runner with engine.cuda_graphs (its static buffers here) against the same steps built
  afresh, on the C kernels and on the torch reference, over random decode steps that reuse
  rungs with fewer rows, other table widths and group counts than the step before (what a
  padding row or group left stale would show): the same logits and cache, padding rows writing
  no K/V, the buffers never reallocated; steps run before the buffers exist (the CUDA memory
  profile's) run eagerly;
- the Triton kernels a CUDA graph replays (paged decode, prefix-shared, K/V write), through
  Triton's interpreter on padded rungs against the same rows run one at a time;
- an engine's greedy outputs equal with the switch on and off; the switch refused off the native
  backend.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.native.static_step import PAD_SLOT, StaticDecode, ladder
from prefixflow.engine.native.step import SeqChunk, SharedPrefix, StepInput
from prefixflow.engine.native.step_batch import build_step_batch
from prefixflow.requests import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


def test_ladder_rungs():
    assert ladder(256) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)
    assert ladder(10) == (1, 2, 4, 8, 10)
    assert ladder(1) == (1,)
    assert ladder(300)[-2:] == (288, 300)


def _decode_step(n: int, grouped: bool, first_block: int = 10) -> StepInput:
    """n sequences decoding one token each; with `grouped`, the even ones members of a
    20-token prefix in blocks 1-2. Own KV lengths 6 .. 5 + n."""
    prefixes = (SharedPrefix(length=20, block_table=(1, 2)),) if grouped else ()
    chunks = []
    for i in range(n):
        g = 0 if grouped and i % 2 == 0 else -1
        cached = 5 + i
        blocks = tuple(range(first_block + 3 * i, first_block + 3 * i + -(-(cached + 1) // BLOCK)))
        chunks.append(
            SeqChunk(
                seq_id=i,
                token_ids=(7 + i,),
                start_pos=cached + (20 if g == 0 else 0),
                num_cached_tokens=cached,
                block_table=blocks,
                sample=True,
                sampling_params=GREEDY,
                prefix_index=g,
            )
        )
    return StepInput(chunks=tuple(chunks), prefixes=prefixes)


def _static(max_batch: int = 32) -> StaticDecode:
    return StaticDecode(lambda *a: torch.zeros(0), max_batch, max_blocks=8, device=torch.device("cpu"))


def test_which_steps_take_a_rung():
    static = _static()
    batch = build_step_batch(_decode_step(11, False), BLOCK, 128, 64)
    rung = static.rung_for(batch)
    assert rung is not None and (rung.size, rung.grouped) == (16, False)
    grouped = static.rung_for(build_step_batch(_decode_step(3, True), BLOCK, 128, 64))
    assert grouped is not None and (grouped.size, grouped.grouped) == (4, True)
    assert grouped.meta.prefix_lens.shape == (4,) and not grouped.meta.is_decode_only
    assert static.rung_for(build_step_batch(_decode_step(33, False), BLOCK, 128, 256)) is None  # past the top
    prefill = StepInput(
        chunks=(SeqChunk(0, (1, 2, 3), 0, 0, (4,), sample=True, sampling_params=GREEDY),),
    )
    assert static.rung_for(build_step_batch(prefill, BLOCK, 128, 64)) is None


@pytest.fixture(scope="module")
def runners(tiny_model):
    from prefixflow.engine.native.model_runner import ModelRunner

    def make(**kw):
        return ModelRunner(
            EngineConfig(
                model=str(tiny_model),
                device="cpu",
                dtype="float32",
                kv_cache_bytes=8 << 20,
                max_model_len=512,
                max_num_seqs=16,
                **kw,
            )
        )

    return make


def _random_decode_step(rng: random.Random, num_blocks: int) -> StepInput:
    """3-16 sequences decoding, 0-3 prefix groups of 1-199 tokens, own KV of 1-250 tokens, no
    two sequences writing one slot."""
    prefixes = []
    for _ in range(rng.choice([0, 0, 1, 2, 3])):
        length = rng.randrange(1, 200)
        table = tuple(rng.sample(range(1, num_blocks), -(-length // BLOCK)))
        prefixes.append(SharedPrefix(length=length, block_table=table))
    chunks, used = [], set()
    for i in range(rng.choice([3, 5, 6, 7, 8, 11, 13, 16])):
        g = rng.randrange(-1, len(prefixes)) if prefixes else -1
        cached = rng.randrange(0, 250)
        blocks = tuple(rng.sample(range(1, num_blocks), -(-(cached + 1) // BLOCK)))
        slot = (blocks[cached // BLOCK], cached % BLOCK)
        if slot in used:
            continue
        used.add(slot)
        start = cached + (prefixes[g].length if g >= 0 else 0)
        chunks.append(SeqChunk(i, (rng.randrange(3, 500),), start, cached, blocks, g, True, GREEDY))
    return StepInput(chunks=tuple(chunks), prefixes=tuple(prefixes))


@pytest.mark.parametrize("c_kernels", ["1", "0"])
def test_static_buffers_give_the_fresh_steps_logits(runners, monkeypatch, c_kernels):
    from prefixflow.kernels import cpu_kernels, cpu_linear

    monkeypatch.setenv("PREFIXFLOW_CPU_KERNELS", c_kernels)
    cpu_kernels._library.cache_clear()
    cpu_linear._library.cache_clear()
    try:
        fresh, static = runners(), runners(cuda_graphs=True)
        assert fresh.static is None and static.static is not None and static.static.sizes[-1] == 16
        torch.manual_seed(0)
        static.kv_cache.copy_(torch.randn_like(static.kv_cache))
        fresh.kv_cache.copy_(static.kv_cache)
        buffers = static.static.ids.data_ptr(), static.static.tables.data_ptr()
        rng, rungs = random.Random(0), []
        for _ in range(30):
            step = _random_decode_step(rng, static.num_kv_blocks)
            rung = static.static.rung_for(build_step_batch(step, BLOCK, 512, static.num_kv_blocks))
            assert rung is not None
            rungs.append((rung.size, len(step.chunks)))
            before = static.kv_cache.clone()
            want, got = fresh.execute_logits(step), static.execute_logits(step)
            assert got.shape == want.shape == (len(step.chunks), fresh.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            # Only the real rows' slots were written (padding writes to PAD_SLOT, nowhere).
            changed = (static.kv_cache != before).flatten(4).any(-1).any(0).any(0)  # [blocks, slots]
            written = {(c.block_table[c.num_cached_tokens // BLOCK], c.num_cached_tokens % BLOCK) for c in step.chunks}
            assert set(map(tuple, changed.nonzero().tolist())) <= written
            torch.testing.assert_close(static.kv_cache, fresh.kv_cache, rtol=1e-5, atol=1e-5)
        assert (static.static.ids.data_ptr(), static.static.tables.data_ptr()) == buffers
        # The point of the sequence: rungs run again with fewer rows than they held before.
        assert any(b[0] == a[0] and b[1] < a[1] for a, b in zip(rungs, rungs[1:])), rungs
    finally:
        monkeypatch.undo()
        cpu_kernels._library.cache_clear()
        cpu_linear._library.cache_clear()


def test_steps_before_the_buffers_exist_run_eagerly(tiny_model, monkeypatch):
    """On CUDA the KV budget comes from a profiled step that runs before the static buffers are
    built; that step (here the same call from the CPU budget) runs on the eager path."""
    from prefixflow.engine.native import model_runner
    from prefixflow.engine.native.model_runner import ModelRunner

    def budget(self):
        self.kv_cache = self._allocate_kv_cache(1)
        self.execute_logits(model_runner._warmup_step(8, 2, self.block_size))
        return 8 << 20

    monkeypatch.setattr(ModelRunner, "_kv_budget_bytes", budget)
    runner = ModelRunner(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", cuda_graphs=True))
    assert runner.static is not None


def _attention_forward(cache: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor, scale: float):
    """A model of one attention layer through the Triton launchers (what a captured CUDA step
    launches): each token id's q/k/v rows from `qkv` [V, 3, H, D], its K/V written, then decode
    or prefix-shared attention as the metadata says; -> [T, H * D]."""
    from prefixflow.kernels.kv_write import write_kv_cache_triton
    from prefixflow.kernels.paged_decode import paged_decode_attention_triton
    from prefixflow.kernels.prefix_attention import prefix_shared_attention_triton

    kc, vc = cache

    def forward(ids, positions, meta, logits_indices):
        q, k, v = qkv[ids].unbind(1)
        write_kv_cache_triton(k, v, kc, vc, meta.slot_mapping)
        if meta.is_decode_only:
            o = paged_decode_attention_triton(q, kc, vc, meta.kv_lens, meta.block_tables, scale)
        else:
            o = prefix_shared_attention_triton(
                q,
                kc,
                vc,
                meta.cu_seqlens_q,
                meta.kv_lens,
                meta.block_tables,
                meta.prefix_lens,
                meta.prefix_block_tables,
                meta.prefix_seq_ranges,
                scale,
            )
        return o.flatten(1)[logits_indices]

    return forward


@pytest.mark.skipif("not __import__('prefixflow.kernels._common', fromlist=['x']).interpreting()")
@pytest.mark.parametrize("grouped", [False, True])
def test_triton_kernels_on_padded_rungs_equal_rows_run_alone(grouped):
    """A step of 5 sequences on rung 8 (3 padding rows; grouped: the rung's 8 prefix groups, 7
    of them empty) against each sequence alone on rung 1: the same outputs, the same cache."""
    gen = torch.Generator().manual_seed(1)
    heads, dim, blocks = 2, 32, 64
    qkv = torch.randn(64, 3, heads, dim, generator=gen)
    start = torch.randn(2, blocks, BLOCK, heads, dim, generator=gen)
    batched, alone = start.clone(), start.clone()
    static_b = StaticDecode(_attention_forward(batched.unbind(0), qkv, dim**-0.5), 8, 4, torch.device("cpu"))
    static_a = StaticDecode(_attention_forward(alone.unbind(0), qkv, dim**-0.5), 8, 4, torch.device("cpu"))
    step = _decode_step(5, grouped, first_block=4)
    batch = build_step_batch(step, BLOCK, 4 * BLOCK, blocks)
    rung = static_b.rung_for(batch)
    assert rung is not None and rung.size == 8
    got = static_b.run(batch, rung)
    assert static_b.slots[5:8].tolist() == [PAD_SLOT] * 3
    for i, chunk in enumerate(step.chunks):
        single = build_step_batch(StepInput(chunks=(chunk,), prefixes=step.prefixes), BLOCK, 4 * BLOCK, blocks)
        rung_1 = static_a.rung_for(single)
        assert rung_1 is not None and rung_1.size == 1
        torch.testing.assert_close(got[i], static_a.run(single, rung_1)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched, alone, rtol=0, atol=0)


def test_greedy_outputs_equal_with_the_switch_on_and_off(tiny_model):
    from prefixflow.engine.native.llm_engine import LLMEngine

    rng = random.Random(3)
    prefix = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 4, 9, 2, 6)]
    prompts += [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for graphs in (False, True):
        config = EngineConfig(
            model=str(tiny_model), device="cpu", dtype="float32", kv_cache_bytes=8 << 20, cuda_graphs=graphs
        )
        engine = LLMEngine(config)
        outs.append([list(o.token_ids) for o in engine.generate(prompts, params)])
        if graphs:
            static = engine.runner.static
            assert static is not None and not static.graphs  # no capture on a CPU
            assert static.steps_run > 0 and static.graph_replays == 0  # its decode steps took the buffers
    assert outs[0] == outs[1]


def test_the_switch_is_the_native_engines():
    from prefixflow.operators.config import setting_problems

    problems = setting_problems({"backend": "vllm", "cuda_graphs": True}, "generate", None, "batchllm")
    assert [p[0] for p in problems] == ["engine.cuda_graphs"]
    http = setting_problems({"backend": "http", "cuda_graphs": True}, "generate", None, "batchllm")
    assert "engine.cuda_graphs" in [p[0] for p in http]
    assert not setting_problems({"backend": "native", "cuda_graphs": True}, "generate", None, "batchllm")


def test_unset_the_graphs_follow_the_switch_where_they_can_be_captured(tiny_model, monkeypatch):
    """engine.cuda_graphs unset: off while GRAPHS_BY_DEFAULT is off (on since a GPU verified the
    default engine with graphs); with it on, on for a CUDA device running the Triton kernels of the
    model's head size, off on a CPU, on ROCm and for head sizes the kernels do not take; set, as
    set (true on a CUDA device that cannot capture is refused by the runner)."""
    from prefixflow.engine.native import model_runner
    from prefixflow.engine.native.model_runner import ModelRunner, static_decode_wanted

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(model_runner, "triton_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert model_runner.GRAPHS_BY_DEFAULT  # since a GPU verified the default engine with graphs
    monkeypatch.setattr(model_runner, "GRAPHS_BY_DEFAULT", False)
    assert not static_decode_wanted(None, cuda, 64)
    monkeypatch.setattr(model_runner, "GRAPHS_BY_DEFAULT", True)
    assert static_decode_wanted(None, cuda, 64) and static_decode_wanted(None, cuda, 128)
    assert not static_decode_wanted(None, cuda, 80)  # the torch fallback: a host sync, no capture
    assert not static_decode_wanted(None, cpu, 64)  # buffers that only pad, no graph
    assert static_decode_wanted(True, cpu, 64) and not static_decode_wanted(False, cuda, 64)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: no graph of ours has run there
    assert not static_decode_wanted(None, cuda, 64) and static_decode_wanted(True, cuda, 64)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(model_runner, "triton_available", lambda: False)
    assert not static_decode_wanted(None, cuda, 64)
    # The engine's default on this CPU, the switch on or off: no static buffers.
    runner = ModelRunner(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", kv_cache_bytes=8 << 20))
    assert runner.static is None and runner.cuda_graphs is False
