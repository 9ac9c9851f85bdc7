"""A native-engine setting reaches the engine from every face (issue 30's acceptance trial).

EngineConfig.max_tokens_cap was added by editing engine/config.py only (the field, its check,
and EngineConfig.row_params, where both backends read a request's parameters): the job spec
mirrors EngineConfig, ProcessorConfig builds its EngineConfig from `engine`, ray.data.llm's
engine_kwargs keys that name an EngineConfig field are that field, and map_batches' Generator
takes a ProcessorConfig. Each face asks 12 tokens of every row and the engine stops at 3.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

import prefixflow
from prefixflow.engine import EngineConfig, LLMEngine, SamplingParams

CAP, ASKED = 3, 12
ENGINE = {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_tokens_cap": CAP}
SAMPLING = {"temperature": 0, "max_tokens": ASKED, "ignore_eos": True}
QUESTIONS = [f"Question {i}: what does the fox do?" for i in range(4)]


def test_the_cap_changes_what_the_engine_makes(tiny_model):
    prompts = [[5, 6, 7, 8], [5, 6, 9]]
    params = SamplingParams(temperature=0, max_tokens=ASKED, min_tokens=ASKED, ignore_eos=True)
    lengths = {}
    for cap in (None, CAP):
        engine = LLMEngine(
            EngineConfig(model=str(tiny_model), device="cpu", kv_cache_bytes=16 << 20, max_tokens_cap=cap)
        )
        outs = engine.generate(prompts, params)
        lengths[cap] = [(len(o.token_ids), o.finish_reason) for o in outs]
    assert lengths == {None: [(ASKED, "length")] * 2, CAP: [(CAP, "length")] * 2}
    with pytest.raises(ValueError, match=r"EngineConfig\.max_tokens_cap=0 is invalid"):
        EngineConfig(model=str(tiny_model), max_tokens_cap=0)


def _spec(ray_local, tiny_model, tmp_path) -> list[tuple[int, str]]:
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import parse_spec
    from prefixflow.operators.results.write import read_output

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": q}) + "\n" for q in QUESTIONS))
    spec = parse_spec(
        {
            "model": str(tiny_model),
            "input": {"path": str(data)},
            "output": {"path": str(tmp_path / "out")},
            "prompt": {"template": "{{ q }}"},
            "sampling": SAMPLING,
            "engine": ENGINE,
        }
    )
    assert spec.to_config().engine_config.max_tokens_cap == CAP
    run_job(spec, quiet=True)
    return [(r["num_generated_tokens"], r["finish_reason"]) for r in read_output(str(tmp_path / "out")).to_pylist()]


def _python_api(ray_local, tiny_model, tmp_path) -> list[tuple[int, str]]:
    import ray

    config = prefixflow.ProcessorConfig(
        model=str(tiny_model), prompt={"template": "{{ q }}"}, sampling=SAMPLING, engine=ENGINE
    )
    rows = prefixflow.build_processor(config)(ray.data.from_items([{"q": q} for q in QUESTIONS])).take_all()
    return [(r["num_generated_tokens"], r["finish_reason"]) for r in rows]


def _map_batches(ray_local, tiny_model, tmp_path) -> list[tuple[int, str]]:
    import ray

    config = prefixflow.ProcessorConfig(
        model=str(tiny_model), prompt={"template": "{{ q }}"}, sampling=SAMPLING, engine=ENGINE
    )
    ds = ray.data.from_items([{"q": q} for q in QUESTIONS])
    rows = ds.map_batches(
        prefixflow.Generator,
        fn_constructor_kwargs={"config": config},
        batch_size=4,
        concurrency=1,
        batch_format="pyarrow",
    ).take_all()
    return [(r["num_generated_tokens"], r["finish_reason"]) for r in rows]


def _ray_data_llm(ray_local, tiny_model, tmp_path) -> list[tuple[int, str]]:
    """ray.data.llm's config carries the cap into its ProcessorConfig, from which its job runs
    as the Python API's does (the python_api face runs that path whole); the vLLM backend, which
    that config selects, honours it: an engine built from that ProcessorConfig, in this process.
    (Run as a whole job, this face cost ~70 s of this 2-core machine's CPU, most of it a second
    vLLM engine start in a Ray actor.)"""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("ray.data.llm's face runs vLLM, which is not installed")
    from prefixflow.engine.vllm_backend.engine import VllmEngine
    from prefixflow.pipeline import build_plan
    from prefixflow.tokenizer import load_tokenizer

    config = prefixflow.vLLMEngineProcessorConfig(
        model_source=str(tiny_model),
        engine_kwargs={"enforce_eager": True, "max_tokens_cap": CAP, "kv_cache_memory_bytes": 16 << 20},
        chat_template_stage=False,
        detokenize_stage=False,
    )
    ours = config.processor_config()
    assert ours.backend == "vllm" and ours.engine_config.max_tokens_cap == CAP
    tokenizer = load_tokenizer(str(tiny_model))
    prompts = [list(tokenizer(q)["input_ids"]) for q in QUESTIONS]
    engine = VllmEngine(ours.engine_config, ours.vllm_args)
    plan = build_plan(prompts, row_ids=list(range(len(prompts))))
    outs = sorted(engine.run(plan.groups(0), SamplingParams(**SAMPLING)), key=lambda o: o.row_id)
    return [(len(o.token_ids), o.finish_reason) for o in outs]


@pytest.mark.parametrize(
    "face",
    [_spec, _python_api, _map_batches, _ray_data_llm],
    ids=["job_spec", "python_api", "map_batches", "ray_data_llm"],
)
def test_the_cap_reaches_the_engine_from_every_face(face, ray_local, tiny_model, tmp_path):
    assert face(ray_local, tiny_model, tmp_path) == [(CAP, "length")] * len(QUESTIONS)
