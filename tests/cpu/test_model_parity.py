"""Our model through ModelRunner.execute vs Hugging Face transformers (the oracle), fp32 CPU.

Every check compares the logits at each sampled position with HF's forward of the full
sequence: whole prompts, prompts chunked across steps, decode steps, and groups that share a
prefix computed once (BatchLLM) next to unrelated sequences in the same step.
"""

from __future__ import annotations

import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.native.model_runner import ModelRunner
from prefixflow.engine.native.step import SeqChunk, SharedPrefix, StepInput
from prefixflow.engine.models.tiny import make_tiny_checkpoint
from prefixflow.requests import SamplingParams

BLOCK = 4  # small blocks: prefixes and chunks end in the middle of blocks
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3_rope_tied": dict(arch="llama", llama3_rope=True, tie_word_embeddings=True),
    "mistral": dict(arch="mistral"),
    "qwen2_bias_tied": dict(arch="qwen2", tie_word_embeddings=True),
    # head_dim set apart from hidden / heads, as Qwen3 checkpoints set it
    "qwen3_qk_norm_tied": dict(arch="qwen3", tie_word_embeddings=True, head_dim=64),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(our runner, HF model) on the same tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(VARIANTS[request.param])
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), kwargs.pop("arch"), seed=3, **kwargs)
    runner = ModelRunner(
        EngineConfig(model=str(path), device="cpu", block_size=BLOCK, kv_cache_bytes=256 * BLOCK * 2048)
    )
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return runner, hf


class Blocks:
    """Hands out fresh block ids (the block manager's job in the engine)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, num_tokens: int) -> tuple[int, ...]:
        n = -(-num_tokens // BLOCK)
        self.next += n
        return tuple(range(self.next - n, self.next))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def chunk(seq_id, tokens, start, cached, table, prefix_index=-1, sample=True):
    return SeqChunk(
        seq_id=seq_id,
        token_ids=tuple(tokens),
        start_pos=start,
        num_cached_tokens=cached,
        block_table=table,
        prefix_index=prefix_index,
        sample=sample,
        sampling_params=GREEDY if sample else None,
    )


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 600, (n,), generator=g).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max abs logit error {err:.2e}"


def test_whole_prompt_one_chunk(pair):
    runner, hf = pair
    ids = tokens(13, seed=1)
    logits = runner.execute_logits(StepInput((chunk(0, ids, 0, 0, Blocks().take(13)),)))
    assert_close(logits[0], hf_logits(hf, ids)[-1])


def test_chunked_prompt_then_decode(pair):
    runner, hf = pair
    ids = tokens(23, seed=2)
    ref = hf_logits(hf, ids)
    table = Blocks().take(len(ids))
    done = 0
    for size in (6, 5, 7):  # chunk boundaries inside blocks; KV of earlier chunks from the cache
        step = StepInput((chunk(0, ids[done : done + size], done, done, table),))
        assert_close(runner.execute_logits(step)[0], ref[done + size - 1])
        done += size
    for pos in range(done, len(ids)):  # decode steps, one token each
        step = StepInput((chunk(0, ids[pos : pos + 1], pos, pos, table),))
        assert_close(runner.execute_logits(step)[0], ref[pos])


def test_shared_prefixes_mixed_with_unrelated_sequences(pair):
    """Two groups, each prefix computed once (prefix_index -1 into its own blocks), then the
    members (own KV in fresh blocks although the prefix ends mid-block) with an unrelated
    sequence in the same steps; chunks are given out of prefix order."""
    runner, hf = pair
    blocks = Blocks()
    prefixes = [tokens(10, seed=10), tokens(7, seed=11)]
    members = {1: (0, tokens(5, 12)), 2: (0, tokens(3, 13)), 3: (1, tokens(6, 14))}
    lone = tokens(9, seed=15)
    p_tables = [blocks.take(len(p)) for p in prefixes]
    own = {s: blocks.take(len(d) + 4) for s, (_, d) in members.items()}
    lone_table = blocks.take(len(lone) + 4)
    shared = tuple(SharedPrefix(block_table=t, length=len(p)) for p, t in zip(prefixes, p_tables))
    full = {s: prefixes[g] + d for s, (g, d) in members.items()}

    # Step 1: both prefixes (no sampling) and the first part of the unrelated prompt.
    step1 = StepInput(
        (
            chunk(100, prefixes[1], 0, 0, p_tables[1], sample=False),
            chunk(9, lone[:4], 0, 0, lone_table),
            chunk(101, prefixes[0], 0, 0, p_tables[0], sample=False),
        ),
        shared,
    )
    assert_close(runner.execute_logits(step1)[0], hf_logits(hf, lone)[3])

    # Step 2: members' first chunks (member 1 chunked in two), the rest of the lone prompt.
    first = {1: 3, 2: 3, 3: 6}
    step2 = StepInput(
        tuple(
            [chunk(9, lone[4:], 4, 4, lone_table)]
            + [
                chunk(s, members[s][1][: first[s]], len(prefixes[members[s][0]]), 0, own[s], prefix_index=members[s][0])
                for s in (3, 2, 1)
            ]
        ),
        shared,
    )
    logits = runner.execute_logits(step2)
    assert_close(logits[0], hf_logits(hf, lone)[-1])
    for row, s in enumerate((3, 2, 1), start=1):
        p_len = len(prefixes[members[s][0]])
        assert_close(logits[row], hf_logits(hf, full[s])[p_len + first[s] - 1])

    # Step 3: rest of member 1, and one decode token for members 2 and 3 and the lone sequence.
    extra = {s: tokens(1, 20 + s) for s in members}
    lone_next = tokens(1, 30)
    chunks = [chunk(1, members[1][1][3:], len(prefixes[0]) + 3, 3, own[1], prefix_index=0)]
    for s in (2, 3):
        g, d = members[s]
        chunks.append(chunk(s, extra[s], len(prefixes[g]) + len(d), len(d), own[s], prefix_index=g))
    chunks.append(chunk(9, lone_next, len(lone), len(lone), lone_table))
    logits = runner.execute_logits(StepInput(tuple(chunks), shared))
    assert_close(logits[0], hf_logits(hf, full[1])[-1])
    assert_close(logits[1], hf_logits(hf, full[2] + extra[2])[-1])
    assert_close(logits[2], hf_logits(hf, full[3] + extra[3])[-1])
    assert_close(logits[3], hf_logits(hf, lone + lone_next)[-1])


def test_greedy_loop_matches_hf_generate(pair):
    runner, hf = pair
    prompt = tokens(11, seed=40)
    new = 10
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    table = Blocks().take(len(prompt) + new)
    params = SamplingParams(temperature=0.0, logprobs=3)
    out_ids, out_lp = [], []
    step_tokens, pos = prompt, 0
    for _ in range(new):
        c = SeqChunk(
            seq_id=0,
            token_ids=tuple(step_tokens),
            start_pos=pos,
            num_cached_tokens=pos,
            block_table=table,
            sample=True,
            sampling_params=params,
            num_generated=len(out_ids),
        )
        (tok,) = runner.execute(StepInput((c,))).sampled
        assert len(tok.top_logprobs) == 3 and tok.top_logprobs[0][0] == tok.token_id
        out_ids.append(tok.token_id)
        out_lp.append(tok.logprob)
        pos += len(step_tokens)
        step_tokens = [tok.token_id]
    assert out_ids == ref
    ref_lp = torch.log_softmax(hf_logits(hf, prompt + ref), dim=-1)
    for i, t in enumerate(ref):
        assert abs(out_lp[i] - ref_lp[len(prompt) - 1 + i, t].item()) < ATOL
