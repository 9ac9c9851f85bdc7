"""The `classify` task: a sequence classification checkpoint's label probabilities (its `score`
head on the last token), on the native engine against transformers (fp32 CPU) with shared
prefixes computed once, through a whole job on local Ray, and through ray.data.llm's
task_type="classify" on vLLM's pooling runner; a cross-encoder's one-label relevance score
(sigmoid) natively and as ray.data.llm's task_type="score"; checkpoints without the head are
refused."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.models.tiny import tiny_checkpoint_cached
from prefixflow.engine.scoring.scorer import Scorer

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def classifier_checkpoint(
    folder: Path, arch: str = "llama", labels: dict[int, str] = LABELS, **config_fields: object
) -> tuple[Path, object]:
    """A random-weight sequence classifier of the tiny `arch` (transformers writes it, with its
    `score` head and id2label, and `config_fields` in its config.json), the tiny checkpoint's
    tokenizer beside it; and the HF model."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    causal = tiny_checkpoint_cached(arch, seed=5)
    config = AutoConfig.from_pretrained(
        str(causal), num_labels=len(labels), id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    torch.manual_seed(0)
    hf = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(str(folder))
    if config_fields:  # written as a checkpoint carries them (transformers drops fields it does not know)
        written = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**written, **config_fields}))
    for f in causal.iterdir():
        if "token" in f.name:
            shutil.copy(f, folder / f.name)
    return folder, hf


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def classifier(request, tmp_path_factory):
    return classifier_checkpoint(tmp_path_factory.mktemp(f"cls-{request.param}"), request.param)


def ray_pooling_processor(path: Path, task_type: str, **stages: object) -> object:
    """ray.data.llm's processor as its docs build one, import line changed: vLLM's pooling
    runner on the CPU (eager, one CPU bundle), prompts given by the rows."""
    from prefixflow import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=str(path),
        task_type=task_type,
        engine_kwargs=dict(enforce_eager=True, max_model_len=256),
        chat_template_stage=False,
        detokenize_stage=False,
        placement_group_config={"bundles": [{"CPU": 1}]},
        log_engine_metrics=False,
    )
    return build_processor(config, **stages)


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(hf(torch.tensor([ids])).logits[0].float(), -1).numpy()


def test_label_probabilities_match_transformers_with_shared_prefixes(classifier):
    from prefixflow.pipeline import build_plan

    path, hf = classifier
    s = Scorer(EngineConfig(model=str(path), device="cpu"))
    profile = rand_tokens(29, seed=1)
    prompts = [profile + rand_tokens(n, seed=10 + n) for n in (3, 8, 1, 12)] + [rand_tokens(20, seed=2)]
    plan = build_plan(prompts, row_ids=list(range(len(prompts))), order="batchllm", min_prefix_len=8)
    outs = {o.row_id: o for o in s.classify_groups(plan.groups(0))}
    assert s.score_stats.num_prefix_misses == 1 and s.score_stats.num_prefix_hits == 3
    for i, ids in enumerate(prompts):
        out = outs[i]
        assert out.error is None and out.choices == ("negative", "neutral", "positive")
        np.testing.assert_allclose(out.probs, reference(hf, ids), atol=1e-5)
        np.testing.assert_allclose(np.exp(out.logprobs), out.probs, atol=1e-6)
        assert out.label == LABELS[int(np.argmax(out.probs))]


def cross_encoder(folder: Path, **config_fields: object) -> tuple[Path, object]:
    """A reranker's shape: one label, its logit the relevance of the prompt's document."""
    return classifier_checkpoint(folder, "qwen3", {0: "relevance"}, **config_fields)


def test_a_cross_encoders_score_is_the_sigmoid_of_its_one_label_and_queries_share_their_prefix(tmp_path):
    """Reranking: one query, several documents after it; each row's relevance is the sigmoid
    of the one-label head (transformers' and vLLM's rule), the query computed once. A
    regression head's value comes back raw (no logprobs); config.json's sentence-transformers
    activation_fn is followed when it names Identity (a null one means the default, as vLLM
    reads it), and an activation outside the known torch.nn modules is refused by name when the
    checkpoint is asked to classify, never imported."""
    from prefixflow.engine.models.model_args import read_model_args
    from prefixflow.pipeline import build_plan

    path, hf = cross_encoder(tmp_path / "ce")
    s = Scorer(EngineConfig(model=str(path), device="cpu"))
    query = rand_tokens(24, seed=4)
    prompts = [query + rand_tokens(n, seed=20 + n) for n in (5, 9, 2, 14)]
    plan = build_plan(prompts, row_ids=list(range(len(prompts))), order="batchllm", min_prefix_len=8)
    outs = {o.row_id: o for o in s.classify_groups(plan.groups(0))}
    assert s.score_stats.num_prefix_misses == 1 and s.score_stats.num_prefix_hits == 3
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            logit = hf(torch.tensor([ids])).logits[0].float()
        out = outs[i]
        assert out.error is None and out.choices == ("relevance",) and out.label == "relevance"
        np.testing.assert_allclose(out.probs, torch.sigmoid(logit).numpy(), atol=1e-5)
        np.testing.assert_allclose(np.exp(out.logprobs), out.probs, atol=1e-6)
    assert len({round(outs[i].probs[0], 6) for i in outs}) == len(prompts)  # the documents differ

    regression, hf_regression = cross_encoder(tmp_path / "reg", problem_type="regression")
    (raw,) = Scorer(EngineConfig(model=str(regression), device="cpu")).classify_groups(
        build_plan([query], row_ids=[0]).groups(0)
    )
    with torch.no_grad():
        np.testing.assert_allclose(raw.probs, hf_regression(torch.tensor([query])).logits[0].numpy(), atol=1e-5)
    assert raw.logprobs == ()
    identity, _ = cross_encoder(
        tmp_path / "id", sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"}
    )
    assert read_model_args(identity).activation == "identity" and read_model_args(path).activation == "sigmoid"
    unsafe, _ = cross_encoder(tmp_path / "bad", sbert_ce_default_activation_function="os.system")
    assert read_model_args(unsafe).activation == "os.system"  # read, never imported; it still embeds
    with pytest.raises(ValueError, match="names the cross-encoder activation 'os.system'"):
        list(Scorer(EngineConfig(model=str(unsafe), device="cpu")).classify_groups([]))
    null, _ = cross_encoder(
        tmp_path / "null",
        sentence_transformers={"activation_fn": None},
        sbert_ce_default_activation_function="torch.nn.modules.linear.Identity",
    )
    assert read_model_args(null).activation == "sigmoid"  # a null activation_fn: vLLM's default


def test_checkpoints_without_the_head_are_refused(classifier):
    from prefixflow.engine.native.llm_engine import LLMEngine

    path, _ = classifier
    causal = Scorer(EngineConfig(model=str(tiny_checkpoint_cached("llama", seed=5)), device="cpu"))
    with pytest.raises(ValueError, match="task classify needs a sequence classification checkpoint"):
        list(causal.classify_groups([]))
    with pytest.raises(ValueError, match=r"a sequence classifier \(.*\) without an LM head: it can embed"):
        LLMEngine(EngineConfig(model=str(path), device="cpu"))
    # a classifier embeds like its body: the last token's final hidden state
    (vec,) = Scorer(EngineConfig(model=str(path), device="cpu")).embed([rand_tokens(6, seed=3)])
    assert vec.error is None and len(vec.embedding) > 0


@pytest.mark.slow
def test_a_classify_job_on_local_ray(ray_local, tmp_path):
    import ray

    import prefixflow

    path, hf = classifier_checkpoint(tmp_path / "cls")
    rows = [{"k": i, "text": f"Review of the product: item {i} was {'great' if i % 2 else 'awful'}."} for i in range(8)]
    config = prefixflow.ProcessorConfig(
        model=str(path), task="classify", prompt={"template": "{{ text }}"}, engine={"device": "cpu"}, replicas=2
    )
    out = sorted(prefixflow.build_processor(config)(ray.data.from_items(rows)).take_all(), key=lambda r: r["k"])
    from prefixflow.tokenizer import load_tokenizer

    tok = load_tokenizer(str(path))
    for r, row in zip(out, rows):
        assert r["error"] is None and list(r["choices"]) == list(LABELS.values())
        np.testing.assert_allclose(r["probs"], reference(hf, list(tok(row["text"])["input_ids"])), atol=1e-5)
        assert r["label"] in LABELS.values()


@needs_vllm
@pytest.mark.slow
def test_rays_classify_example_runs_on_vllms_pooling_runner(ray_local, tmp_path):
    """ray.data.llm's task_type="classify", import line changed: vLLM's label probabilities
    in `embeddings`, as Ray's rows carry them, equal to the native engine's."""
    import ray

    path, hf = classifier_checkpoint(tmp_path / "cls")
    processor = ray_pooling_processor(
        path,
        "classify",
        preprocess=lambda row: dict(prompt=f"Review: item {row['id']} works."),
        postprocess=lambda row: dict(prompt=row["prompt"], probs=row["embeddings"], ids=row["prompt_token_ids"]),
    )
    out = processor(ray.data.range(6)).take_all()
    assert len(out) == 6
    for r in out:
        np.testing.assert_allclose(r["probs"], reference(hf, list(r["ids"])), atol=1e-4)


@needs_vllm
@pytest.mark.slow
def test_rays_cross_encoder_score_runs_on_vllms_pooling_runner(ray_local, tmp_path):
    """ray.data.llm's task_type="score" on a cross-encoder, import line changed: each row's
    relevance (vLLM's sigmoid of the one-label head) in `embeddings`, equal to transformers'."""
    import ray

    path, hf = cross_encoder(tmp_path / "ce")
    processor = ray_pooling_processor(
        path,
        "score",
        preprocess=lambda row: dict(prompt=f"Query: is it cheap? Document: item {row['id']} costs {row['id']}."),
        postprocess=lambda row: dict(score=row["embeddings"], ids=row["prompt_token_ids"]),
    )
    out = processor(ray.data.range(5)).take_all()
    assert len(out) == 5
    for r in out:
        with torch.no_grad():
            logit = hf(torch.tensor([list(r["ids"])])).logits[0].float()
        assert len(r["score"]) == 1
        np.testing.assert_allclose(r["score"], torch.sigmoid(logit).numpy(), atol=1e-4)
