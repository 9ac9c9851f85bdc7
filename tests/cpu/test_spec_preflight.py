"""Issue 12, part A: a bad spec, a bad --set, or a spec that cannot work with its input, model
or cluster fails up front with one line naming the field (exit code 2), never a traceback, a
hang, or a silent pick; and nothing in a spec or a --set value is executed."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from prefixflow.cli import main as cli
from prefixflow.jobs.preflight import check_resources, preflight, resource_problems, row_report, sample_rows
from prefixflow.jobs.spec import SpecError, parse_spec

TEMPLATE = "Document: {{ document }}\nQuestion: {{ question }}"
ROWS = [{"id": i, "document": f"doc {i % 3}", "question": f"why {i}?"} for i in range(12)]
BASE = "model: m\ninput: {path: in.jsonl}\nprompt: {template: 'Q: {{ q }}'}\noutput: {path: out}\n"


def _one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process: exit code 2 and one line on stderr, no traceback."""
    code = cli(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _job(root: Path, model: Path, rows: list[dict] = ROWS, **changes) -> dict:
    """A good job over `rows` (in.jsonl) into root/out; `changes` as section__key=value."""
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data: dict = {
        "model": str(model),
        "input": {"path": str(root / "in.jsonl")},
        "prompt": {"template": TEMPLATE},
        "output": {"path": str(root / "out")},
        "engine": {"device": "cpu"},
    }
    for dotted, value in changes.items():
        section, _, key = dotted.rpartition("__")
        (data.setdefault(section, {}) if section else data)[key] = value
    return data


def _problems(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        preflight(parse_spec(data))
    return dict(e.value.problems)


# --- the spec file and --set: cases 1-6 --------------------------------------------------------


@pytest.mark.parametrize(
    "text, words",
    [
        (BASE.replace("{path: in.jsonl}", "{path: []}"), "input.path: [] is empty: give at least one file"),
        (BASE + "replicas: 1\nreplicas: 2\n", "replicas: duplicate key (lines 5 and 6)"),
        (BASE + "sampling: {temperature: 0}\nsampling:\n  max_tokens: 3\n", "sampling: duplicate key (lines 5 and 6)"),
        ("a: " + "[" * 10000, "nested more than 32 levels deep"),
        (
            BASE.replace("{path: out}", "{path: out, overwrite: true, resume: true}"),
            "output: output.overwrite and output.resume are both true: choose one: resume keeps committed parts",
        ),
        (BASE + "engine: {device: cuda}\n", "set resources.num_gpus_per_replica"),
    ],
)
def test_bad_spec_file_is_one_line(tmp_path, capsys, text, words):
    (tmp_path / "job.yaml").write_text(text)
    assert words in _one_line_error(capsys, ["validate", str(tmp_path / "job.yaml")])


@pytest.mark.parametrize(
    "pair, words",
    [
        ("model.x=1", "model: is 'm', not a mapping: --set model.x cannot set a key under it"),
        ("input.path.0=b.jsonl", "input.path: is a list: --set input.path.0 cannot set a key"),
        ("model", "--set: 'model' is not KEY=VALUE"),
        ("sampling..top_k=1", "is not KEY=VALUE"),
        ("sampling.stop=" + "[" * 10000 + "]" * 10000, "sampling.stop.0.0...: nested more than 32 levels"),
        ("sampling={temperature: 0, temperature: 1}", "sampling.temperature: duplicate key"),
    ],
)
def test_bad_set_is_one_line(tmp_path, capsys, pair, words):
    (tmp_path / "job.yaml").write_text(BASE.replace("{path: in.jsonl}", "{path: [in.jsonl]}"))
    assert words in _one_line_error(capsys, ["run", str(tmp_path / "job.yaml"), "--set", pair])


def test_python_tags_in_spec_or_set_execute_nothing(tmp_path, capsys):
    pwned = tmp_path / "pwned"
    attack = f'!!python/object/apply:os.system ["echo pwned > {pwned}"]'
    (tmp_path / "job.yaml").write_text(BASE)
    line = _one_line_error(capsys, ["validate", str(tmp_path / "job.yaml"), "--set", f"model={attack}"])
    assert line.startswith("error: --set: model: not valid YAML") and "python" in line
    (tmp_path / "job.yaml").write_text(BASE.replace("model: m", f"model: {attack}"))
    assert "not valid YAML" in _one_line_error(capsys, ["validate", str(tmp_path / "job.yaml")])
    assert not pwned.exists()


def test_alias_bomb_is_answered_short(tmp_path, capsys):
    # 9 levels of 9 aliases: 9**9 strings if anything walked it whole (a repr in a message did).
    # The loader refuses it while reading, at the first anchor past 100,000 values (issue 27).
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (tmp_path / "job.yaml").write_text(
        "\n".join(lines) + "\nmodel: *a8\ninput: {path: x.jsonl}\noutput: {path: o}\nprompt: {template: '{{ q }}'}\n"
    )
    line = _one_line_error(capsys, ["validate", str(tmp_path / "job.yaml")])
    assert "job.yaml: a5: expands to more than 100,000 values (line 6;" in line and len(line) < 300


def test_set_still_builds_missing_sections(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(BASE + "sampling:\n")  # an empty section is None in YAML
    from prefixflow.jobs.spec import load_spec, parse_overrides

    spec = load_spec(tmp_path / "job.yaml", parse_overrides(["sampling.max_tokens=3", "engine.seed=4"]))
    assert spec.sampling.max_tokens == 3 and spec.engine.seed == 4


# --- preflight: output path, context length, columns (cases 7, 9, 10) -----------------------


def test_output_must_not_be_or_hold_the_input(tmp_path, tiny_model):
    data = _job(tmp_path, tiny_model)
    inp = tmp_path / "in.jsonl"
    for out in (inp, tmp_path, tmp_path / "in.jsonl" / ".."):  # the file; the folder holding it
        assert "output.path" in _problems({**data, "output": {"path": str(out)}})
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text(inp.read_text())
    for path, out in ((str(folder), folder / "out"), (str(folder / "*"), folder / "out")):
        got = _problems({**data, "input": {"path": path, "format": "jsonl"}, "output": {"path": str(out)}})
        assert "inside the input" in got["output.path"]
    # An output next to its input file (the demo's layout) is fine.
    preflight(parse_spec({**data, "output": {"path": str(tmp_path / "out")}}))


def test_output_and_input_on_s3_compare_keys():
    from prefixflow.jobs.preflight import _output_problems

    spec = parse_spec(_job_dict("s3://b/data/", "s3://b/data/out"))
    assert "inside the input" in dict(_output_problems(spec, []))["output.path"]
    spec = parse_spec(_job_dict("s3://b/data/x.jsonl", "s3://b/out"))
    assert _output_problems(spec, ["s3://b/data/x.jsonl"]) == []
    spec = parse_spec(_job_dict("s3://b/out/in/x.jsonl", "s3a://b/out/"))
    assert "holds the input file" in dict(_output_problems(spec, ["s3://b/out/in/x.jsonl"]))["output.path"]


def _job_dict(inp: str, out: str) -> dict:
    return {
        "model": "m",
        "input": {"path": inp, "format": "jsonl"},
        "prompt": {"template": "{{ q }}"},
        "output": {"path": out},
    }


def test_max_model_len_above_the_model_fails_in_preflight(tmp_path, tiny_model):
    limit = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    got = _problems(_job(tmp_path, tiny_model, engine__max_model_len=100000))
    assert f"100000 is more than the model allows ({limit}" in got["engine.max_model_len"]
    preflight(parse_spec(_job(tmp_path, tiny_model, engine__max_model_len=limit)))


def test_template_column_no_row_has_is_a_spec_error(tmp_path, tiny_model, capsys):
    got = _problems(_job(tmp_path, tiny_model, prompt={"template": "{{ documnet }}: {{ question }}"}))
    assert got == {
        "prompt.template": "names column 'documnet', which the input does not have "
        "(columns: document, id, question); did you mean 'document'?"
    }
    got = _problems(_job(tmp_path, tiny_model, prompt={"system": "{{ sys }}", "user": "{{ question }}"}))
    assert "names column 'sys'" in got["prompt.system"] and "prompt.user" not in got
    got = _problems(_job(tmp_path, tiny_model, prompt={"messages_column": "messages"}))
    assert "names column 'messages'" in got["prompt.messages_column"]
    # An optional column (`is defined`) and Jinja's own names are not columns a row must have.
    preflight(
        parse_spec(
            _job(
                tmp_path,
                tiny_model,
                prompt={
                    "template": "{% if extra is defined %}{{ extra }}{% endif %}{% for i in range(2) %}{{ question }}{% endfor %}"
                },
            )
        )
    )
    data = _job(tmp_path, tiny_model, prompt={"template": "{{ documnet }}"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    line = _one_line_error(capsys, ["validate", str(tmp_path / "job.yaml")])
    assert "prompt.template: names column 'documnet'" in line and "did you mean 'document'?" in line


def test_unknown_sampling_keys_in_every_row_are_a_spec_error(tmp_path, tiny_model):
    rows = [{**r, "sampling_params": {"temprature": 0}} for r in ROWS]
    got = _problems(_job(tmp_path, tiny_model, rows))
    assert "column 'sampling_params' has keys SamplingParams does not know" in got["input"]
    assert "'temprature'" in got["input"] and "did you mean 'temperature'?" in got["input"]
    # One row with a bad key among rows without overrides: that row becomes an error record.
    preflight(parse_spec(_job(tmp_path, tiny_model, [*ROWS[:11], rows[11]])))


def test_validate_reports_rows_that_would_partly_fail(tmp_path, tiny_model, capsys):
    rows = [
        *ROWS[:9],
        {"id": 9, "question": "no document"},
        {**ROWS[10], "sampling_params": {"top_p": 5}},
        {**ROWS[11], "sampling_params": {"temprature": 0}},
    ]
    data = _job(tmp_path, tiny_model, rows)
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write('{"id": 12, "document": broken\n')
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    assert cli(["validate", str(tmp_path / "job.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ok (" in out and "4 of the first 13 rows would become error records" in out
    assert "in.jsonl:10: prompt.template failed" in out and "top_p" in out
    report = row_report(parse_spec(data), sample_rows(parse_spec(data), 32))
    assert report.num_rows == 13 and report.num_bad == 4 and len(report.reasons) == 3


def test_sample_rows_reads_each_format_without_ray(tmp_path, tiny_model):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    (tmp_path / "in.csv").write_text(
        "id,document,question\n" + "".join(f"{r['id']},{r['document']},{r['question']}\n" for r in ROWS)
    )
    for name in ("in.jsonl", "in.parquet", "in.csv"):
        data = _job(tmp_path, tiny_model, input={"path": str(tmp_path / name), "limit": 5})
        rows = sample_rows(parse_spec(data), 32)
        assert [r["question"] for r in rows] == [r["question"] for r in ROWS[:5]], name


# --- resources (case 8): checked on the real cluster right after ray.init ------------------


def test_resources_the_cluster_cannot_place_fail_before_any_work(ray_local, tmp_path, tiny_model, capsys):
    for changes, field in (
        (dict(resources__num_gpus_per_replica=1), "resources.num_gpus_per_replica"),
        (dict(resources__num_cpus_per_replica=64), "resources.num_cpus_per_replica"),
        (dict(engine__device="cuda", resources__num_gpus_per_replica=1), "engine.device"),
    ):
        with pytest.raises(SpecError) as e:
            check_resources(parse_spec(_job(tmp_path, tiny_model, **changes)))
        assert field in dict(e.value.problems), e.value.problems
    check_resources(parse_spec(_job(tmp_path, tiny_model, resources__num_cpus_per_replica=2)))
    # Through `prefixflow run`: refused before the output is touched (it used to wait forever).
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_job(tmp_path, tiny_model)))
    line = _one_line_error(capsys, ["run", str(tmp_path / "job.yaml"), "--set", "resources.num_gpus_per_replica=1"])
    assert "resources.num_gpus_per_replica: 1 but no node of the Ray cluster has more than 0 GPU" in line
    assert not (tmp_path / "out").exists()


def test_resource_problems_per_node():
    spec = parse_spec(
        {
            **_job_dict("in.jsonl", "out"),
            "engine": {"device": "cuda"},
            "resources": {"num_gpus_per_replica": 1, "num_cpus_per_replica": 8},
        }
    )
    # Enough CPUs and GPUs in the cluster, but never on one node.
    got = dict(resource_problems(spec, [{"CPU": 8.0}, {"CPU": 2.0, "GPU": 4.0}]))
    assert "no node of the Ray cluster has both 8 CPU(s) and 1 GPU(s)" in got["resources"]
    assert resource_problems(spec, [{"CPU": 8.0}, {"CPU": 16.0, "GPU": 1.0}]) == []


def test_models_the_engine_resolves_are_left_to_it(tmp_path, tiny_model):
    # prefixflow.model_source copies an s3:// folder on each node: not refused up front any more.
    preflight(parse_spec({**_job(tmp_path, tiny_model), "model": "s3://bucket/models/tiny"}))
    got = _problems({**_job(tmp_path, tiny_model), "model": str(tmp_path / "no-such-folder")})
    assert "does not exist" in got["model"]


def test_huge_sampling_integers_name_the_field():
    with pytest.raises(SpecError) as e:
        parse_spec({**_job_dict("in.jsonl", "out"), "sampling": {"top_k": 1e20}})
    assert str(e.value) == "<spec>: sampling.top_k: 1e+20 is too large for an integer: use a smaller value"
    with pytest.raises(SpecError) as e:  # fits in 64 bits, not in the engine's int32
        parse_spec({**_job_dict("in.jsonl", "out"), "sampling": {"top_k": 1e10}})
    assert str(e.value).startswith("<spec>: sampling.top_k: 10000000000 is invalid: an integer in [-1, ")


def test_validate_reads_the_columns_of_an_s3_input(tmp_path, tiny_model, s3_server, capsys):
    """`prefixflow validate` samples the first rows of the first s3:// input file too: a template
    column the input lacks is one line naming prompt.template, the column and the columns."""
    import boto3

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket="validate-in")
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").put_object(
        Bucket="validate-in", Key="in/a.jsonl", Body="".join(json.dumps(r) + "\n" for r in ROWS).encode()
    )
    data = {
        **_job(tmp_path, tiny_model, prompt={"template": "{{ questoin }}"}),
        "input": {"path": "s3://validate-in/in/", "format": "jsonl"},
        "storage": {"endpoint_url": s3_server, "region": "us-east-1"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    line = _one_line_error(capsys, ["validate", str(tmp_path / "job.yaml")])
    assert line.endswith(
        "prompt.template: names column 'questoin', which the input does not have "
        "(columns: document, id, question); did you mean 'question'?"
    ), line


def test_lora_needs_the_vllm_backend_and_a_folder_of_adapters(tmp_path, tiny_model):
    """A `lora` section: refused by name on the native backend (which runs no adapters), and
    its folder checked before any work (prefixflow/lora.py)."""
    with pytest.raises(SpecError, match="lora: LoRA adapters run with task: generate on engine.backend: vllm"):
        parse_spec(_job(tmp_path, tiny_model, lora={"path": str(tmp_path)}))
    empty = tmp_path / "adapters"
    empty.mkdir()
    got = _problems(_job(tmp_path, tiny_model, lora={"path": str(empty)}, engine__backend="vllm"))
    assert "holds no adapter: give one subfolder per adapter" in got["lora.path"]
    with pytest.raises(SpecError, match="lora.max_lora_rank"):
        parse_spec(_job(tmp_path, tiny_model, lora={"path": str(empty), "max_lora_rank": 7}, engine__backend="vllm"))


def test_http_servers_are_asked_for_the_model_before_any_work(tmp_path, tiny_model):
    """engine.backend http: validate asks each endpoint's /v1/models once: a server that does
    not serve the job's model and one that does not answer are named; engine.http's own
    settings are checked by name when the spec is read."""
    from support.openai_server import ScriptedServer
    from prefixflow.bench.fault_proxy import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    with ScriptedServer(default={"object": "list", "data": [{"id": "tiny"}]}) as server:
        http = {"endpoints": [server.url, closed], "model": "other", "max_retries": 0}
        got = _problems(_job(tmp_path, tiny_model, engine__backend="http", engine__http=http))
        assert (
            got["engine.http.model"]
            == f"{server.url}/v1 serves tiny, not 'other': set engine.http.model to the served name"
        )
        assert got["engine.http.endpoints[1]"].endswith("after 1 attempt")
        assert got["engine.http.endpoints[1]"].startswith(f"{closed}/v1/models failed (no answer")
        assert server.requests == [("/v1/models", None)]
        ok = {"endpoints": [server.url], "model": "tiny"}
        assert preflight(parse_spec(_job(tmp_path, tiny_model, engine__backend="http", engine__http=ok))) is not None
    with pytest.raises(SpecError, match="engine.http.qsp: .*did you mean 'qps'"):
        parse_spec(_job(tmp_path, tiny_model, engine__backend="http", engine__http={"endpoints": [closed], "qsp": 1}))
