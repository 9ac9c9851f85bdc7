"""engine.vllm is an allow-list (issue 27, classes 6 and 10) and generation_config.json problems
name the file (class 11).

A job spec must never make vLLM import code: the settings vLLM resolves by name
(compilation_config.inductor_passes and .backend, distributed_executor_backend,
kv_transfer_config.kv_connector_module_path) are refused by `prefixflow validate`, and a module
they name is never imported (a temporary module that writes a file when imported proves it).
Wrongly typed values are refused there too, one line each naming the full field path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from prefixflow.jobs.spec import SpecError, parse_spec
from prefixflow.operators.config import ProcessorConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="the allow-list checks names against the installed vLLM"
)

TRACE = "pf_trace_allowlist"
# Each setting vLLM resolves as a module/class/function name, naming the trace module.
CODE_SETTINGS = {
    "compilation_config": {"inductor_passes": {"p": f"{TRACE}.f"}, "backend": f"{TRACE}.f"},
    "distributed_executor_backend": f"{TRACE}.Executor",
    "kv_transfer_config": {"kv_connector": "X", "kv_connector_module_path": TRACE},
}
CODE_PATHS = [
    "engine.vllm.compilation_config.inductor_passes",
    "engine.vllm.compilation_config.backend",
    "engine.vllm.distributed_executor_backend",
    "engine.vllm.kv_transfer_config",
]


def _spec(vllm: dict, **more) -> dict:
    return {
        "model": "m",
        "input": {"path": "in.jsonl"},
        "output": {"path": "out"},
        "prompt": {"template": "Q: {{ q }}"},
        "engine": {"backend": "vllm", "vllm": vllm},
        **more,
    }


def _problems(vllm: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_spec(_spec(vllm))
    return dict(e.value.problems)


def _api_lines(vllm: dict) -> list[str]:
    with pytest.raises(ValueError) as e:
        ProcessorConfig(model="smollm2-135m-instruct", engine={"backend": "vllm", "vllm": vllm})
    return str(e.value).splitlines()


@pytest.fixture
def trace_module(tmp_path) -> tuple[Path, Path]:
    """(folder holding the module, the file it writes when imported)."""
    folder, marker = tmp_path / "trace", tmp_path / "imported.txt"
    folder.mkdir()
    (folder / f"{TRACE}.py").write_text(
        textwrap.dedent(f"""
        open({str(marker)!r}, "w").write("imported")
        def f(graph): return graph
        class Executor: pass
    """)
    )
    return folder, marker


def test_validate_refuses_settings_that_name_code_and_imports_nothing(tiny_model, tmp_path, trace_module):
    folder, marker = trace_module
    (tmp_path / "in.jsonl").write_text('{"q": "What is a river?"}\n')
    spec = _spec(CODE_SETTINGS)
    spec.update(
        model=str(tiny_model), input={"path": str(tmp_path / "in.jsonl")}, output={"path": str(tmp_path / "out")}
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "prefixflow.cli", "validate", str(tmp_path / "job.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    lines = [line.strip() for line in done.stderr.splitlines()]
    for path in CODE_PATHS:
        assert any(line.startswith(f"{path}:") for line in lines), (path, done.stderr)
    assert "load code named in the job spec" in done.stderr and "'mp', 'ray', 'uni'" in done.stderr
    assert not marker.exists()


def test_the_engine_refuses_them_before_vllm_is_imported(tiny_model, trace_module):
    """VllmEngine checks again (the Python API reaches it directly): a ValueError naming each
    setting, before vLLM (whose argument classes would import the module) is imported."""
    folder, marker = trace_module
    code = textwrap.dedent("""
        import json, sys
        folder, model, settings, trace = sys.argv[1:]
        sys.path.insert(0, folder)
        from prefixflow.engine.config import EngineConfig
        from prefixflow.engine.vllm_backend.engine import VllmEngine
        try:
            VllmEngine(EngineConfig(model=model, device="cpu"), json.loads(settings))
        except ValueError as e:
            print(e)
        print("vllm imported:", "vllm" in sys.modules, "trace imported:", trace in sys.modules)
    """)
    argv = [str(folder), str(tiny_model), json.dumps(CODE_SETTINGS), TRACE]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vllm imported: False trace imported: False" in done.stdout, done.stdout[-3000:]
    for path in CODE_PATHS:
        assert f"{path}=" in done.stdout, done.stdout[-3000:]
    assert not marker.exists()


def test_arguments_off_the_list_are_refused_by_name():
    p = _problems(
        {
            "hf_overrides": {"architectures": ["X"]},
            "worker_cls": "evil.Worker",
            "tokenizer": "/elsewhere",
            "compilation_config": {"levl": 3, "pass_config": {}},
            "enforce_eagr": True,
            "max_num_seqs": 8,
        }
    )
    assert "not among the vLLM arguments a job may set" in p["engine.vllm.hf_overrides"]
    assert "enforce_eager" in p["engine.vllm.hf_overrides"]  # the fix lists what is allowed
    assert "not among the vLLM arguments a job may set" in p["engine.vllm.tokenizer"]
    assert "load code named in the job spec" in p["engine.vllm.worker_cls"]
    assert "not among the compilation_config keys" in p["engine.vllm.compilation_config.levl"]
    assert "not among the compilation_config keys" in p["engine.vllm.compilation_config.pass_config"]
    assert "did you mean 'enforce_eager'" in p["engine.vllm.enforce_eagr"]
    assert "use engine.max_num_seqs" in p["engine.vllm.max_num_seqs"]


def test_wrong_types_are_refused_one_line_each_naming_path_value_and_type():
    bad = {
        "max_logprobs": "many",
        "enforce_eager": 1,
        "tensor_parallel_size": True,
        "cpu_offload_gb": "4",
        "kv_cache_dtype": "int3",
        "compilation_config": {"mode": True, "cudagraph_capture_sizes": [1, "2"], "cudagraph_mode": "sometimes"},
    }
    p = _problems(bad)
    assert p["engine.vllm.max_logprobs"] == "'many' is invalid: use an integer from -1 to 2147483647, not a string"
    assert p["engine.vllm.enforce_eager"] == "1 is invalid: use true or false, not an integer"
    assert "not a boolean" in p["engine.vllm.tensor_parallel_size"]  # a bool is no int
    assert "use a number >= 0, not a string" in p["engine.vllm.cpu_offload_gb"]
    assert "'auto'" in p["engine.vllm.kv_cache_dtype"]
    assert "'VLLM_COMPILE'" in p["engine.vllm.compilation_config.mode"]
    assert "list of integers" in p["engine.vllm.compilation_config.cudagraph_capture_sizes"]
    assert "'FULL_AND_PIECEWISE'" in p["engine.vllm.compilation_config.cudagraph_mode"]
    assert len(p) == 8
    # The Python API: the same check, a line each, named from ProcessorConfig.
    lines = _api_lines({"max_logprobs": "many", "compilation_config": {"mode": "fast"}})
    assert lines[0] == (
        "ProcessorConfig.engine.vllm.max_logprobs='many' is invalid: use an integer from -1 to 2147483647, not a string"
    )
    assert lines[1].startswith("ProcessorConfig.engine.vllm.compilation_config.mode='fast' is invalid")


def test_allowed_settings_pass_unchanged():
    from prefixflow.engine.vllm_backend.args import ALLOWED, check_vllm_args

    good = {
        "enforce_eager": True,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "distributed_executor_backend": "mp",
        "max_logprobs": -1,
        "enable_chunked_prefill": False,
        "cpu_offload_gb": 4,
        "kv_cache_dtype": "fp8",
        "quantization": "awq",
        "tokenizer_mode": "hf",
        "disable_log_stats": False,
        "cudagraph_capture_sizes": [1, 2, 4],
        "compilation_config": {
            "mode": "vllm_compile",
            "cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": [1, 2],
            "max_cudagraph_capture_size": 2,
        },
    }
    assert set(good) <= set(ALLOWED)
    assert parse_spec(_spec(good)).engine.vllm == good
    checked = check_vllm_args(good)
    assert checked == good and checked["compilation_config"] is not good["compilation_config"]


def test_ray_data_llm_engine_kwargs_still_map(tiny_model):
    from prefixflow import vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source=str(tiny_model),
        engine_kwargs=dict(
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=4096,
            max_model_len=256,
            tensor_parallel_size=1,
            enforce_eager=True,
        ),
    )
    ours = config.processor_config()
    assert ours.vllm_args == {
        "enable_chunked_prefill": True,
        "tensor_parallel_size": 1,
        "enforce_eager": True,
        "disable_log_stats": False,
    }  # log_engine_metrics (Ray's default True)
    with pytest.raises(ValueError, match="engine.vllm.compilation_config.inductor_passes"):
        vLLMEngineProcessorConfig(
            model_source=str(tiny_model), engine_kwargs={"compilation_config": {"inductor_passes": {"p": "os.system"}}}
        )


def test_an_allowed_name_the_installed_vllm_lacks_is_named(monkeypatch):
    from prefixflow.engine.vllm_backend import args as vllm_args

    real = vllm_args._vllm_class_fields

    def older(relative: str, class_name: str) -> frozenset[str]:
        return real(relative, class_name) - {"enforce_eager", "cudagraph_mode"}

    monkeypatch.setattr(vllm_args, "_vllm_class_fields", older)
    args = {"enforce_eager": True, "compilation_config": {"cudagraph_mode": "FULL"}}
    p = {path: fix for path, _, fix in vllm_args.vllm_arg_problems(args)}
    assert "the installed vLLM's EngineArgs has no such argument" in p["engine.vllm.enforce_eager"]
    assert "CompilationConfig has no such field" in p["engine.vllm.compilation_config.cudagraph_mode"]


# ---- generation_config.json (class 11) -------------------------------------------------------


def _model_with(tiny_model: Path, tmp_path: Path, text: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(text)
    return model


def test_invalid_json_in_generation_config_names_the_file(tiny_model, tmp_path):
    model = _model_with(tiny_model, tmp_path, '{\n  "temperature": 0.7,\n  top_p: 2\n}')
    with pytest.raises(ValueError) as e:
        ProcessorConfig(model=str(model)).sampling_params
    message = str(e.value)
    assert str(model / "generation_config.json") in message and "line 3 column 3" in message
    assert "fix the file" in message and "\n" not in message


def test_a_bad_value_in_generation_config_is_blamed_on_the_file(tiny_model, tmp_path):
    model = _model_with(tiny_model, tmp_path, json.dumps({"top_p": 2, "max_new_tokens": 5}))
    path = model / "generation_config.json"
    with pytest.raises(ValueError) as e:
        ProcessorConfig(model=str(model)).sampling_params
    assert str(e.value) == (
        f"{path}: top_p=2 is invalid: use a value in (0, 1]; fix the file or set sampling.top_p in the spec"
    )
    spec = parse_spec({**_spec({}), "model": str(model), "engine": {}})
    with pytest.raises(ValueError, match=f"^{path}: top_p=2 is invalid"):
        spec.to_config().sampling_params
    # set by the user, the file's value is not used, so not refused
    assert ProcessorConfig(model=str(model), sampling={"top_p": 0.5}).sampling_params.top_p == 0.5
    # a bad value the user set is still named as theirs
    with pytest.raises(ValueError, match=r"^SamplingParams\.top_p=3\.0 is invalid"):
        ProcessorConfig(model=str(model), sampling={"top_p": 3})
    # each valid alone, together not: the file's share is named
    with pytest.raises(ValueError, match=r"min_tokens=9 .*max_tokens=5 taken from .*generation_config"):
        ProcessorConfig(model=str(model), sampling={"top_p": 0.5, "min_tokens": 9}).sampling_params


def test_validate_names_a_bad_generation_config(tiny_model, tmp_path, capsys):
    """`prefixflow validate` reads the model's generation_config.json as the job will (it
    passed, and the job failed later)."""
    import yaml

    from prefixflow.cli import main as cli

    model = _model_with(tiny_model, tmp_path, json.dumps({"top_p": 2}))
    (tmp_path / "in.jsonl").write_text('{"q": "hi"}\n')
    spec = {
        "model": str(model),
        "input": {"path": str(tmp_path / "in.jsonl")},
        "prompt": {"template": "{{ q }}"},
        "output": {"path": str(tmp_path / "out")},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert cli(["validate", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"model: {model / 'generation_config.json'}: top_p=2 is invalid" in err, err


def test_a_cpu_context_past_the_kv_cache_is_refused_at_validate_time(tiny_model, tmp_path):
    """engine.max_model_len with backend vllm on a CPU is kept as given or refused when the job
    is validated, naming the field, the limit and the fix (vLLM's CPU engine used to lower it
    silently); unset, the engine takes the most that fits."""
    from prefixflow.jobs.preflight import preflight

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"q": "hi"}) + "\n")

    def spec(**engine):
        return parse_spec(
            {
                "model": str(tiny_model),
                "input": {"path": str(data)},
                "output": {"path": str(tmp_path / "out")},
                "prompt": {"template": "{{ q }}"},
                "engine": {"backend": "vllm", "kv_cache_bytes": 1 << 20, **engine},
            }
        )

    with pytest.raises(SpecError) as e:
        preflight(spec(max_model_len=1024))
    message = dict(e.value.problems)["engine.max_model_len"]
    assert message.startswith("1024 is invalid: it does not fit the CPU KV cache (")
    assert "raise engine.kv_cache_bytes" in message
    preflight(spec())  # unset: what fits
    preflight(spec(max_model_len=64))  # fits: kept


def test_validate_and_the_job_agree_on_row_overrides_over_generation_config(tiny_model, tmp_path, capsys):
    """A row's sampling overrides apply over the same defaults in `prefixflow validate` as in the
    job: the model's generation_config.json sets max_new_tokens 8, so a row asking min_tokens 16
    fails in both (validate used to check it over the spec's max_tokens alone and pass it)."""
    import pyarrow as pa
    import yaml

    from prefixflow.cli import main as cli
    from prefixflow.jobs.preflight import preflight, row_report
    from prefixflow.operators.columns import ERROR
    from prefixflow.operators.stages.tokenize import Tokenize

    model = _model_with(tiny_model, tmp_path, json.dumps({"max_new_tokens": 8}))
    rows = [
        {"q": "fine"},
        {"q": "long", "sampling_params": {"min_tokens": 16}},
        {"q": "short", "sampling_params": {"min_tokens": 4}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {
        "model": str(model),
        "input": {"path": str(tmp_path / "in.jsonl")},
        "prompt": {"template": "{{ q }}"},
        "output": {"path": str(tmp_path / "out")},
    }
    spec = parse_spec(raw)

    report = row_report(spec, preflight(spec))
    assert report.num_bad == 1 and "min_tokens" in report.reasons[0], report
    # the job's own tokenize stage, with the options the job builds
    table = pa.table(
        {
            "q": [r["q"] for r in rows],
            "sampling_params": [json.dumps(r["sampling_params"]) if "sampling_params" in r else None for r in rows],
            ERROR: pa.nulls(len(rows), pa.string()),
        }
    )
    errors = Tokenize(spec.to_config().tokenize_options())(table).column(ERROR).to_pylist()
    assert [e is not None for e in errors] == [False, True, False], errors
    assert "min_tokens" in errors[1]

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    assert cli(["validate", str(tmp_path / "job.yaml")]) == 0
    assert "1 of the first 3 rows would become error records" in capsys.readouterr().out
