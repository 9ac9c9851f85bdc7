"""The `embed` task on the native engine (Scorer.embed, fp32 CPU) against transformers: last-token
and mean pooling, normalized or not, with shared prefixes computed once (their hidden states
summed once for mean pooling); the checkpoint's sentence-transformers pooling read as vLLM reads
it; bad rows as error outputs."""

from __future__ import annotations

import json

import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.models.tiny import make_tiny_checkpoint, tiny_checkpoint_cached
from prefixflow.engine.scoring.pooling import Pooling, model_pooling
from prefixflow.engine.scoring.scorer import Scorer, ScoreOptions

ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def ckpt(request):
    from transformers import AutoModel

    path = tiny_checkpoint_cached(request.param, seed=5)
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()  # the base model: no LM head
    return path, hf


def reference(hf, ids: list[int], pooling: Pooling) -> torch.Tensor:
    """sentence-transformers' pooling of transformers' last_hidden_state (after the final norm)."""
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0].float()  # [T, H]
    v = h[-1] if pooling.kind == "last" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=-1) if pooling.normalize else v


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("pooling", [Pooling("last", True), Pooling("mean", True), Pooling("mean", False)])
@pytest.mark.parametrize("chunk_size", [5, 64])
def test_embeddings_match_transformers_and_share_prefixes(ckpt, pooling, chunk_size):
    path, hf = ckpt
    s = Scorer(EngineConfig(model=str(path), device="cpu"), ScoreOptions(chunk_size=chunk_size))
    profile = rand_tokens(29, seed=1)  # shared by rows 0..3 (one group)
    prompts = [profile + rand_tokens(n, seed=10 + n) for n in (3, 8, 1, 12)]
    prompts += [rand_tokens(33, seed=2), rand_tokens(16, seed=3)]  # unrelated rows
    outs = s.embed(prompts, pooling)
    # the profile is computed once (for mean pooling its hidden states summed once, beside its KV)
    assert s.score_stats.num_prefix_misses == 1 and s.score_stats.num_prefix_hits == 3
    assert s.totals.num_computed_prompt_tokens == sum(map(len, prompts)) - 3 * 29
    assert [o.prefix_len for o in outs] == [29] * 4 + [0, 0]
    assert sorted(o.num_cached_tokens for o in outs) == [0, 0, 0, 29, 29, 29]
    for ids, out in zip(prompts, outs):
        assert out.error is None and out.prompt_len == len(ids)
        got = torch.tensor(out.embedding)
        assert got.shape == (hf.config.hidden_size,)
        torch.testing.assert_close(got, reference(hf, ids, pooling), atol=ATOL, rtol=1e-4)
        if pooling.normalize:
            assert abs(float(got.norm()) - 1.0) < 1e-5


def test_a_member_whose_prompt_is_the_whole_prefix_still_embeds(ckpt):
    path, hf = ckpt
    s = Scorer(EngineConfig(model=str(path), device="cpu"))
    profile = rand_tokens(20, seed=4)
    prompts = [profile, profile + rand_tokens(5, seed=5), profile + rand_tokens(2, seed=6)]
    for pooling in (Pooling("last"), Pooling("mean")):
        for ids, out in zip(prompts, s.embed(prompts, pooling)):
            assert out.prefix_len == 19  # one token short: the whole-prefix row computes its last
            torch.testing.assert_close(torch.tensor(out.embedding), reference(hf, ids, pooling), atol=ATOL, rtol=1e-4)


def test_bad_rows_become_error_outputs_and_the_rest_embed(ckpt):
    path, _ = ckpt
    s = Scorer(EngineConfig(model=str(path), device="cpu", max_model_len=64))
    outs = s.embed([[1, 2, 3], [], [5, 10**7], rand_tokens(80, seed=7), [4, 5]], Pooling("last"))
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "empty" in outs[1].error and "outside the vocabulary" in outs[2].error
    assert "max_model_len=64" in outs[3].error and outs[3].embedding == ()


def write_sentence_transformers(folder, modules: list[dict], pooling_config: dict | None) -> None:
    (folder / "modules.json").write_text(json.dumps(modules))
    if pooling_config is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))


TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def test_the_checkpoints_sentence_transformers_files_choose_the_pooling(tmp_path):
    assert model_pooling(tmp_path) == Pooling("last", True)  # no files: a causal model's default (vLLM's)
    write_sentence_transformers(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_mean_tokens": True})
    assert model_pooling(tmp_path) == Pooling("mean", True)
    assert model_pooling(tmp_path, kind="last", normalize=False) == Pooling("last", False)  # given wins
    other = tmp_path / "other"
    other.mkdir()
    write_sentence_transformers(other, [TRANSFORMER, POOLING], {"pooling_mode": "lasttoken"})
    assert model_pooling(other) == Pooling("last", False)  # no Normalize module: not normalized
    cls = tmp_path / "cls"
    cls.mkdir()
    write_sentence_transformers(cls, [TRANSFORMER, POOLING], {"pooling_mode_cls_token": True})
    with pytest.raises(ValueError, match="pools by cls_token"):
        model_pooling(cls)
    dense = tmp_path / "dense"
    dense.mkdir()
    write_sentence_transformers(
        dense, [TRANSFORMER, POOLING, {**NORMALIZE, "type": "sentence_transformers.models.Dense"}], {}
    )
    with pytest.raises(ValueError, match="Dense module"):
        model_pooling(dense)


def test_the_scorer_embeds_as_the_checkpoint_says(tmp_path):
    from transformers import AutoModel

    path = make_tiny_checkpoint(tmp_path / "st", "llama", seed=2)
    write_sentence_transformers(path, [TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True})
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    s = Scorer(EngineConfig(model=str(path), device="cpu"))
    assert s.model_pooling() == Pooling("mean", False)
    ids = rand_tokens(9, seed=8)
    (out,) = s.embed([ids])
    torch.testing.assert_close(
        torch.tensor(out.embedding), reference(hf, ids, Pooling("mean", False)), atol=ATOL, rtol=1e-4
    )


def test_a_group_cut_into_units_computes_its_prefix_once(ckpt):
    """The plan cuts a large group into units that the engine runs one after another (a lone
    member included): the later units read the prefix the first one left in the cache."""
    import numpy as np

    from prefixflow.requests import PrefixGroup

    path, hf = ckpt
    s = Scorer(EngineConfig(model=str(path), device="cpu"))
    profile = np.array(rand_tokens(24, seed=9), dtype=np.int64)
    tails = [np.array(rand_tokens(n, seed=20 + n), dtype=np.int64) for n in (3, 5, 2)]
    pieces = [
        PrefixGroup(0, profile, np.array([0, 1]), tuple(tails[:2])),
        PrefixGroup(0, profile, np.array([2]), (tails[2],)),
    ]
    for pooling in (Pooling("mean"), Pooling("last")):
        first = list(s.embed_groups([pieces[0]], pooling))
        (lone,) = s.embed_groups([pieces[1]], pooling)
        assert s.score_stats.num_prefix_hits == 1 and s.score_stats.num_computed_tokens == 2  # its tail alone
        assert lone.prefix_len == lone.num_cached_tokens == 24
        for out in [*first, lone]:
            ids = profile.tolist() + tails[out.row_id].tolist()
            torch.testing.assert_close(torch.tensor(out.embedding), reference(hf, ids, pooling), atol=ATOL, rtol=1e-4)


def test_a_base_model_checkpoint_embeds_and_refuses_to_generate(tmp_path):
    """Embedding checkpoints are often the base model alone (e5-mistral's MistralModel): no LM
    head, weights named without "model.". They embed like the causal LM's body; generating
    or scoring, which need the head, is refused by name."""
    import shutil

    from transformers import AutoModel

    from prefixflow.engine.native.llm_engine import LLMEngine

    causal = tiny_checkpoint_cached("qwen2", seed=5)
    base = tmp_path / "base"
    hf = AutoModel.from_pretrained(str(causal), dtype=torch.float32).eval()
    hf.save_pretrained(str(base))
    for f in causal.iterdir():
        if "token" in f.name:
            shutil.copy(f, base / f.name)
    assert json.loads((base / "config.json").read_text())["architectures"] == ["Qwen2Model"]
    s = Scorer(EngineConfig(model=str(base), device="cpu"))
    ids = rand_tokens(11, seed=12)
    for pooling in (Pooling("last"), Pooling("mean", False)):
        (out,) = s.embed([ids], pooling)
        torch.testing.assert_close(torch.tensor(out.embedding), reference(hf, ids, pooling), atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match=r"base model \(Qwen2\) without an LM head: it can embed"):
        s.score([ids], [5, 6])
    with pytest.raises(ValueError, match=r"base model \(Qwen2\).*not generate"):
        LLMEngine(EngineConfig(model=str(base), device="cpu"))
