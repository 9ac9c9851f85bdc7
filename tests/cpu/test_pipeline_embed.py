"""The `embed` task through the pipeline: every row once, each with the embedding the engine
gives for the same prompt (native engine; vLLM's pooling runner where vLLM is installed), bad
rows as error records, a job killed between parts resumed with every row once, ray.data.llm's
task_type="embed", and the job spec's checks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import prefixflow
from prefixflow.jobs.spec import SpecError, parse_spec

SHARED = "Represent this product review for retrieval. Review: "
ENGINE = {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_model_len": 64}
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _rows(n: int = 10) -> list[dict]:
    rows = [{"k": i, "text": f"{SHARED}item {i} arrived on time and works well."} for i in range(n)]
    rows[4]["text"] = "far too long " * 40  # past max_model_len: an error record
    return rows


def _direct(model: Path, texts: list[str], pooling) -> list:
    from prefixflow.engine import EngineConfig, Scorer

    return Scorer(EngineConfig(model=str(model), **ENGINE)).embed(texts, pooling)


def _check(out: list[dict], model: Path, pooling) -> None:
    assert [r["k"] for r in out] == list(range(10))
    assert out[4]["error"] and "max_model_len" in out[4]["error"] and out[4]["embeddings"] is None
    direct = _direct(model, [r["text"] for r in _rows()], pooling)
    for row, ref in zip(out, direct):
        if row["k"] == 4:
            continue
        assert row["error"] is None and row["generated_text"] is None
        assert row["num_input_tokens"] == ref.prompt_len
        np.testing.assert_allclose(row["embeddings"], ref.embedding, atol=1e-5)


@pytest.mark.slow
def test_embed_task_matches_the_engine(ray_local, tiny_model):
    import ray

    from prefixflow.engine.scoring.pooling import Pooling

    config = prefixflow.ProcessorConfig(
        model=str(tiny_model),
        task="embed",
        embed={"pooling": "mean"},
        prompt={"template": "{{ text }}"},
        engine=ENGINE,
        replicas=2,
    )
    processor = prefixflow.build_processor(config)
    out = sorted(processor(ray.data.from_items(_rows())).take_all(), key=lambda r: r["k"])
    _check(out, tiny_model, Pooling("mean", True))
    assert all(abs(np.linalg.norm(r["embeddings"]) - 1) < 1e-5 for r in out if r["k"] != 4)
    # The rows share their instruction: each replica computes it once, not once per row or per
    # plan unit (before, 384 of 384 tokens were computed; the plan's own count is 272, 0.71, and
    # a unit stolen by the other replica has its prefix computed again there).
    totals = [m["engine_totals"] for m in processor.metrics()]
    prompt = sum(t["num_prompt_tokens"] for t in totals)
    assert sum(t["num_computed_prompt_tokens"] for t in totals) < 0.85 * prompt


def _spec(root: Path, model: Path, **more) -> dict:
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return {
        "model": str(model),
        "task": "embed",
        "input": {"path": str(root / "in.jsonl")},
        "prompt": {"template": "{{ text }}"},
        "engine": ENGINE,
        "output": {"path": str(root / "out"), "format": "parquet", "rows_per_part": 3},
        **more,
    }


@pytest.mark.slow
def test_an_embed_job_killed_between_parts_resumes_with_every_row_once(ray_local, tiny_model, tmp_path):
    from prefixflow.engine.scoring.pooling import Pooling
    from prefixflow.jobs.run import run_job
    from prefixflow.operators.results.commit import COMMITS
    from prefixflow.operators.results.write import read_output

    spec = _spec(tmp_path, tiny_model, embed={"normalize": False})
    run_job(parse_spec(spec))
    out = tmp_path / "out"
    first = {r["k"]: r for r in read_output(str(out)).to_pylist()}
    _check([first[k] for k in sorted(first)], tiny_model, Pooling("last", False))
    # as a driver killed mid-job leaves it: the first two parts committed, the rest never written
    parts = sorted(p.name for p in out.glob("part-*"))
    assert len(parts) >= 4
    for name in parts[2:]:
        (out / name).unlink()
        (out / COMMITS / f"{name}.json").unlink()
    for name in ("_SUCCESS", "metrics.json", "_manifest.json", "plot.png"):
        (out / name).unlink(missing_ok=True)
    run_job(parse_spec({**spec, "output": {**spec["output"], "resume": True}}))
    again = read_output(str(out)).to_pylist()
    assert sorted(r["k"] for r in again) == list(range(10))  # every row once: 0 lost, 0 twice
    for r in again:
        if r["k"] != 4:
            np.testing.assert_allclose(r["embeddings"], first[r["k"]]["embeddings"], atol=1e-6)


def test_embed_spec_is_checked_before_anything_starts(tmp_path):
    base = {"model": "m", "input": {"path": "x.jsonl"}, "prompt": {"template": "{{ q }}"}, "output": {"path": "o"}}
    spec = parse_spec({**base, "task": "embed", "embed": {"pooling": "mean"}})
    assert spec.to_config().embed_config.pooling == "mean"
    with pytest.raises(SpecError, match="embed.pooling"):
        parse_spec({**base, "task": "embed", "embed": {"pooling": "cls"}})
    with pytest.raises(SpecError, match="embed.polling"):
        parse_spec({**base, "task": "embed", "embed": {"polling": "mean"}})
    with pytest.raises(SpecError, match="need task: embed"):
        parse_spec({**base, "embed": {"pooling": "mean"}})
    # OpenAI batch files hold chat/completion or embeddings requests: an embed job reads them,
    # a classify job cannot
    parse_spec({**base, "task": "embed", "input": {"path": "x.jsonl", "format": "openai"}})
    with pytest.raises(SpecError, match="task: classify cannot read OpenAI batch files"):
        parse_spec({**base, "task": "classify", "input": {"path": "x.jsonl", "format": "openai"}})
    with pytest.raises(ValueError, match="ProcessorConfig.embed"):
        prefixflow.ProcessorConfig(model="m", embed={"pooling": "mean"})


@needs_vllm
@pytest.mark.slow
def test_rays_embed_example_runs_on_vllms_pooling_runner(ray_local, tiny_model):
    """ray.data.llm's embedding example, import line changed: task_type="embed" on the vLLM
    backend, its `embeddings` column equal to the native engine's for the same prompts."""
    import ray

    from prefixflow import build_processor, vLLMEngineProcessorConfig
    from prefixflow.engine.scoring.pooling import Pooling

    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_model),
        task_type="embed",
        engine_kwargs=dict(enable_prefix_caching=True, enforce_eager=True, max_model_len=64),
        batch_size=4,
        concurrency=1,
        chat_template_stage=False,
        detokenize_stage=False,
        should_continue_on_error=True,
        placement_group_config={"bundles": [{"CPU": 1}]},
        log_engine_metrics=False,
    )
    processor = build_processor(
        config,
        preprocess=lambda row: dict(prompt=row["text"], k=row["k"]),
        postprocess=lambda row: dict(k=row["k"], text=row["prompt"], embedding=row["embeddings"]),
    )
    out = sorted(processor(ray.data.from_items(_rows())).take_all(), key=lambda r: r["k"])
    assert [r["k"] for r in out] == list(range(10))
    assert out[4]["__inference_error__"] and "max_model_len" in out[4]["__inference_error__"]
    direct = _direct(tiny_model, [r["text"] for r in _rows()], Pooling("last", True))
    for row, ref in zip(out, direct):
        if row["k"] != 4:
            np.testing.assert_allclose(row["embedding"], ref.embedding, atol=1e-4)


def test_a_rows_pooling_params_may_ask_only_for_what_the_job_does(tiny_model):
    """ray.data.llm rows carry vLLM PoolingParams fields in `pooling_params`; every row of a job
    is pooled alike, so a row asking for anything else is its error record, never answered
    otherwise (and a generate job does not read the column)."""
    import pyarrow as pa

    from prefixflow.operators.columns import ERROR
    from prefixflow.operators.stages.tokenize import Tokenize

    config = prefixflow.ProcessorConfig(model=str(tiny_model), task="embed")
    opts = config.tokenize_options()
    assert opts.pooling_activation is True  # the tiny checkpoint: last token, normalized
    asks = [None, {}, {"use_activation": True}, {"dimensions": None}, {"dimensions": 8}, {"use_activation": False}, 3]
    # as JSON text: the column as a file stores it (a struct column is read the same way)
    texts = [None if a is None else json.dumps(a) for a in asks]
    rows = pa.Table.from_pylist([{"prompt": "a passage", "pooling_params": t} for t in texts])
    errors = Tokenize(opts)(rows).column(ERROR).to_pylist()
    assert errors[:4] == [None] * 4
    assert "pooling_params.dimensions=8 is not honoured per row" in errors[4]
    assert "pooling_params.use_activation=False is not honoured per row: the job's is True" in errors[5]
    assert "must be a mapping" in errors[6]
    # a struct column (Ray's rows as dicts): each row's missing fields read as null
    structs = pa.Table.from_pylist(
        [{"prompt": "p", "pooling_params": a} for a in ({"use_activation": True}, {"dimensions": 8})]
    )
    assert [e is None for e in Tokenize(opts)(structs).column(ERROR).to_pylist()] == [True, False]
    generate = prefixflow.ProcessorConfig(model=str(tiny_model)).tokenize_options()
    assert Tokenize(generate)(rows).column(ERROR).to_pylist() == [None] * len(asks)
