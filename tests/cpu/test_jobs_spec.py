"""Job spec validation: unknown keys and bad values fail before anything starts, naming the
field path and the fix; `prefixflow validate` reports them with exit code 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from prefixflow.cli import main as cli
from prefixflow.jobs.demo import example_path
from prefixflow.jobs.run import preflight
from prefixflow.jobs.spec import SpecError, load_spec, parse_spec


def _spec(**changes):
    data = {
        "model": "m",
        "input": {"path": "in.jsonl"},
        "output": {"path": "out"},
        "prompt": {"template": "Q: {{ question }}"},
    }
    for dotted, value in changes.items():
        keys = dotted.split("__")
        d = data
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return data


def _problems(data) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    return dict(e.value.problems)


def test_unknown_key_names_path_and_suggests():
    p = _problems(_spec(input__pathh="x.jsonl"))
    assert "did you mean 'path'" in p["input.pathh"]
    p = _problems(_spec(samplng={"temperature": 0}))
    assert "did you mean 'sampling'" in p["samplng"]


def test_wrong_type_and_bad_values_name_the_field():
    p = _problems(_spec(sampling={"max_tokens": "many"}, replicas=0, order="random", engine={"dtype": "fp8"}))
    assert "wrong type" in p["sampling.max_tokens"]
    assert "0 is invalid: use a positive integer" in p["replicas"]
    assert "'batchllm'" in p["order"]
    assert "'float16'" in p["engine.dtype"]


def test_wrong_shapes_get_one_line_each():
    p = _problems(_spec(input={"path": 5}, prompt="Q: {{ q }}"))
    assert "string or a valid list" in p["input.path"]
    assert "must be a mapping" in p["prompt"] and "messages_column" in p["prompt"]


def test_dataclass_checks_map_to_field_paths():
    assert "(0, 1]" in _problems(_spec(sampling={"top_p": 2.0}))["sampling.top_p"]
    assert "power of two" in _problems(_spec(engine={"block_size": 3}))["engine.block_size"]


def test_missing_input_and_prompt():
    data = _spec()
    del data["input"]
    assert "required" in _problems(data)["input"]
    data = _spec()
    del data["prompt"]
    assert any("prompt is required" in m for m in _problems(data).values())


def test_format_must_be_inferable():
    msg = " ".join(_problems(_spec(input={"path": "s3://bucket/folder/"})).values())
    assert "input.format cannot be inferred" in msg


def test_bad_template_syntax_fails_at_validation():
    msg = " ".join(_problems(_spec(prompt={"template": "{{ question }"})).values())
    assert "not a valid Jinja template" in msg


def test_examples_parse(tmp_path):
    for name in ("quickstart.yaml", "s3.yaml", "openai_batch.yaml", "gpu_cluster.yaml", "score.yaml", "embed.yaml"):
        spec = load_spec(example_path(name))
        assert spec.output.path


def test_yaml_is_safe_loaded(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


def test_preflight_model_and_input_paths(tmp_path):
    spec = parse_spec(_spec(model=str(tmp_path / "nope"), input={"path": str(tmp_path / "none.jsonl")}))
    with pytest.raises(SpecError) as e:
        preflight(spec)
    problems = dict(e.value.problems)
    assert "does not exist" in problems["model"]
    assert "matches no file" in problems["input.path"]


def test_cli_validate_exit_codes(tmp_path, capsys, tiny_model):
    data_file = tmp_path / "in.jsonl"
    data_file.write_text(json.dumps({"question": "hi"}) + "\n")
    good = _spec(model=str(tiny_model), input={"path": str(data_file)}, output={"path": str(tmp_path / "o")})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(good))
    assert cli(["validate", str(path)]) == 0
    assert "ok" in capsys.readouterr().out
    path.write_text(yaml.safe_dump({**good, "replica": 2}))
    assert cli(["validate", str(path)]) == 2
    assert "did you mean 'replicas'" in capsys.readouterr().err
    assert (
        cli(
            [
                "validate",
                str(path),
                "--set",
                "replica=",
            ]
        )
        == 2
    )  # still unknown


def test_set_overrides(tmp_path, tiny_model):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_spec(model=str(tiny_model))))
    spec = load_spec(path, {"sampling.max_tokens": 7, "replicas": 3})
    assert spec.sampling.max_tokens == 7 and spec.replicas == 3


def test_output_format_defaults():
    assert parse_spec(_spec()).output_format() == "parquet"
    spec = parse_spec(_spec(input={"path": "batch.jsonl", "format": "openai"}))
    assert spec.output_format() == "openai"
    assert Path(example_path("quickstart.yaml")).exists()


def test_true_or_false_is_no_number():
    """pydantic would turn `top_k: true` into 1: a mirrored section refuses a bool for a
    number field, naming it; real bool fields still take one."""
    base = {"model": "/m", "input": {"path": "in.jsonl"}, "prompt": {"template": "{{ q }}"}, "output": {"path": "out"}}
    for section, key in (("sampling", "top_k"), ("sampling", "temperature"), ("engine", "block_size")):
        with pytest.raises(SpecError, match=rf"{section}\.{key}: True is invalid: give a number"):
            parse_spec({**base, section: {key: True}})
    spec = parse_spec({**base, "sampling": {"ignore_eos": True}, "engine": {"enable_prefix_cache": False}})
    assert spec.sampling.ignore_eos and not spec.engine.enable_prefix_cache


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's argument names come from vLLM")
def test_engine_backend_and_vllm_arguments_name_the_field():
    from prefixflow.operators.config import ProcessorConfig

    vllm = {"engine": {"backend": "vllm", "vllm": {"enforce_eager": True}}}
    assert parse_spec({**_spec(), **vllm}).engine.vllm == {"enforce_eager": True}
    bad = _problems(_spec(engine__backend="vllm", engine__vllm={"enforce_eagr": True}))
    assert bad == {
        "engine.vllm.enforce_eagr": "True is invalid: not a vLLM engine argument: did "
        "you mean 'enforce_eager'? see vLLM's EngineArgs for the names"
    }
    assert (
        "use engine.dtype instead"
        in _problems(_spec(engine__backend="vllm", engine__vllm={"dtype": "half"}))["engine.vllm.dtype"]
    )
    assert "need engine.backend: vllm" in _problems(_spec(engine__vllm={"enforce_eager": True}))["engine.vllm"]
    assert (
        "use cuda or auto"
        in _problems(_spec(engine__backend="vllm", engine__device="cuda:0", resources__num_gpus_per_replica=1))[
            "engine.device"
        ]
    )
    score = _spec(task="score", score={"choices": ["Yes", "No"], "chunk_size": 64}, engine__backend="vllm")
    assert "only engine.backend: native honours it" in _problems(score)["score.chunk_size"]
    # The Python API checks the same, naming the same field.
    with pytest.raises(ValueError, match=r"ProcessorConfig\.engine\.vllm\.enforce_eagr=True is invalid"):
        ProcessorConfig(model="smollm2-135m-instruct", engine={"backend": "vllm", "vllm": {"enforce_eagr": True}})
    with pytest.raises(ValueError, match=r"ProcessorConfig\.engine\.backend='gpu' is invalid"):
        ProcessorConfig(model="smollm2-135m-instruct", engine={"backend": "gpu"})
    with pytest.raises(ValueError, match=r"ProcessorConfig\.score\.chunk_size=64 is invalid: only"):
        ProcessorConfig(
            model="smollm2-135m-instruct",
            task="score",
            engine={"backend": "vllm"},
            score={"choices": ["Yes", "No"], "chunk_size": 64},
        )


@pytest.mark.parametrize(
    "prompt",
    [
        {"template": "Q: {{ q }}", "user": "{{ q }}"},  # two kinds
        {"add_generation_prompt": False},  # no kind
        {"system": "Be brief.", "messages_column": "m"},  # system without user
        {"user": "{{ q "},  # bad syntax
    ],
)
def test_prompt_python_api_and_spec_refuse_alike(prompt, tiny_model):
    """PromptTemplate itself checks "exactly one of" (the spec is generated from it): the
    Python API and the spec refuse the same prompts with the same message."""
    import prefixflow

    with pytest.raises(ValueError) as api:
        prefixflow.ProcessorConfig(model=str(tiny_model), prompt=prompt)
    ((field, message),) = _problems(_spec(prompt=prompt)).items()
    assert str(api.value) == f"PromptTemplate.{field.removeprefix('prompt.')}={message}"


@pytest.mark.parametrize(
    "score",
    [
        {"choices": ["Yes"], "choices_column": "c"},
        {},
        {"choices": ["Yes"], "chunk_size": 0},
        {"choices": ["Yes"], "lam": -1.0},
    ],
)
def test_score_python_api_and_spec_refuse_alike(score, tiny_model):
    import prefixflow

    with pytest.raises(ValueError) as api:
        prefixflow.ProcessorConfig(model=str(tiny_model), task="score", score=score)
    ((field, message),) = _problems(_spec(task="score", score=score)).items()
    owner = "ScoreConfig" if field == "score.choices" else "ScoreOptions"
    assert str(api.value) == f"{owner}.{field.removeprefix('score.')}={message}"


def test_spec_choices_come_from_the_python_api():
    """order, task and engine.backend accept exactly what ProcessorConfig accepts."""
    from prefixflow.operators.config import BACKENDS, TASKS
    from prefixflow.pipeline.ordering import ORDER_POLICIES

    p = _problems(_spec(order="random", task="summarize", engine={"backend": "tgi"}))
    assert all(repr(name) in p["order"] for name in ORDER_POLICIES)
    assert all(repr(name) in p["task"] for name in TASKS)
    assert all(repr(name) in p["engine.backend"] for name in BACKENDS)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's argument names come from vLLM")
def test_every_bad_vllm_argument_is_reported():
    """Three bad engine.vllm keys: the spec and the Python API name all three (before: the first)."""
    from prefixflow.operators.config import ProcessorConfig

    args = {"enforce_eagr": True, "model": "x", "trust_remote_code": True}
    bad = _problems(_spec(engine__backend="vllm", engine__vllm=args))
    assert sorted(bad) == [f"engine.vllm.{key}" for key in sorted(args)]
    with pytest.raises(ValueError) as api:
        ProcessorConfig(model="smollm2-135m-instruct", engine={"backend": "vllm", "vllm": args})
    assert [line.split("=")[0] for line in str(api.value).splitlines()] == [
        f"ProcessorConfig.engine.vllm.{key}" for key in args
    ]
