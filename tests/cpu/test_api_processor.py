"""The Python API: build_processor (global plan) and Generator (per-batch plan in map_batches),
on a real local Ray; importing the API loads neither torch nor ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

import prefixflow


def test_import_is_light():
    code = (
        "import sys, prefixflow\n"
        "prefixflow.build_processor, prefixflow.ProcessorConfig, prefixflow.Generator\n"
        "import prefixflow.cli, prefixflow.jobs.spec\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_errors_name_the_field(tiny_model):
    with pytest.raises(ValueError, match="ProcessorConfig.order"):
        prefixflow.ProcessorConfig(model=str(tiny_model), order="random")
    with pytest.raises(ValueError, match="EngineConfig.block_size"):
        prefixflow.ProcessorConfig(model=str(tiny_model), engine={"block_size": 3})
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        prefixflow.ProcessorConfig(model=str(tiny_model), sampling={"top_p": 0})
    with pytest.raises(ValueError, match="not a valid Jinja"):
        prefixflow.ProcessorConfig(model=str(tiny_model), prompt={"template": "{{ x"})


# The config's own chat template, with a variable from chat_template_kwargs: every face renders
# it (map_batches' Generator once dropped both and used the tokenizer's own template).
TEMPLATE = "{{ greeting }}|{% for m in messages %}{{ m['content'] }}{% endfor %}|"


@pytest.fixture(scope="module")
def config(tiny_model):
    return prefixflow.ProcessorConfig(
        model=str(tiny_model),
        sampling={"temperature": 0, "max_tokens": 5},
        replicas=1,
        engine={"device": "cpu", "kv_cache_bytes": 16 << 20},
        include_prompt=True,
        chat_template=TEMPLATE,
        chat_template_kwargs={"greeting": "hello"},
    )


def _rows():
    shared = "You are a helpful assistant. The quick brown fox jumps over the lazy dog."
    rows = [
        {"k": i, "q": f"{shared} Question {i % 3}: what does the fox do?", "sampling_params": None} for i in range(9)
    ]
    rows[0]["sampling_params"] = {"max_tokens": 2}  # per-row override, as in ray.data.llm
    rows[1]["sampling_params"] = {"bogus": 1}  # invalid: an error record, not a failed job
    return rows


def test_processor_and_generator_agree(ray_local, config):
    import ray

    ds = ray.data.from_items(_rows())
    processor = prefixflow.build_processor(
        config,
        # merged into the row, as in ray.data.llm: `k` and `sampling_params` stay
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["q"]}]},
        postprocess=lambda row: {
            "k": row["k"],
            "tokens": list(row["generated_tokens"]),
            "text": row["generated_text"],
            "error": row["error"],
        },
    )
    out = sorted(processor(ds).take_all(), key=lambda r: r["k"])
    assert [r["k"] for r in out] == list(range(9))
    assert [r["error"] is None for r in out] == [True, False] + [True] * 7
    assert "bogus" in out[1]["error"] and len(out[0]["tokens"]) <= 2 < len(out[2]["tokens"])
    assert processor.plan_summary()["token_saving_ratio"] > 0
    assert processor.metrics()[0]["num_rows"] == 8
    assert ray.get(processor.sink.queue_runs.remote()) == []  # the run's work queue went with it

    # The lighter mode: the same requests through map_batches, one plan per batch.
    ds2 = ray.data.from_items([{**r, "messages": [{"role": "user", "content": r["q"]}]} for r in _rows()])
    batched = ds2.map_batches(
        prefixflow.Generator,
        fn_constructor_kwargs={"config": config},
        batch_size=4,
        concurrency=1,
        batch_format="pyarrow",
    )
    rows = sorted(batched.take_all(), key=lambda r: r["k"])
    assert [r["k"] for r in rows] == list(range(9))
    for a, b in zip(out, rows):
        assert a["tokens"] == list(b["generated_tokens"]) and a["text"] == b["generated_text"]
        assert (a["error"] is None) == (b["error"] is None)
    assert [r["prompt"] for r in rows if r["error"] is None] == [
        f"hello|{r['q']}|" for r in _rows() if r["k"] != 1
    ]  # the config's chat template and its kwargs, in the Generator too


def test_prompt_fields_must_be_text(tiny_model):
    """A number as a template is a ValueError naming the field (before: jinja's TypeError)."""
    with pytest.raises(ValueError, match=r"PromptTemplate\.template=5 is invalid: give text"):
        prefixflow.ProcessorConfig(model=str(tiny_model), prompt={"template": 5})
