"""Issue 27, classes 10 and 11: specs that passed `prefixflow validate` and then failed late
(a traceback, every row an error, or a "rerun with output.resume" although nothing ran) are
refused by preflight with one line naming the field and the fix, before Ray starts, by
`validate` and by `run` alike (exit code 2)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
from pathlib import Path

import pytest
import yaml

from prefixflow.cli import main as cli
from prefixflow.jobs.preflight import preflight
from prefixflow.jobs.spec import parse_spec
from support.s3 import s3_bucket

ROWS = [{"id": i, "question": f"why {i}?"} for i in range(6)]


def _job(root: Path, model: Path, **sections) -> dict:
    """A good job over ROWS (root/in.jsonl) into root/out; `sections` replace whole sections."""
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    data = {
        "model": str(model),
        "input": {"path": str(root / "in.jsonl")},
        "prompt": {"template": "Q: {{ question }}"},
        "output": {"path": str(root / "out")},
        "engine": {"device": "cpu"},
    }
    return {**data, **sections}


def _refused(capsys, monkeypatch, root: Path, data: dict) -> str:
    """`validate` and `run` both answer exit 2 with the same one line, and Ray never starts."""
    import prefixflow.jobs.run as run

    def no_ray(*args, **kwargs):
        raise AssertionError("preflight let the job reach ray.init")

    monkeypatch.setattr(run, "ensure_ray", no_ray)
    (root / "job.yaml").write_text(yaml.safe_dump(data))
    lines = []
    for command in ("validate", "run"):
        code = cli([command, str(root / "job.yaml")])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        lines.append(err.strip())
    assert lines[0] == lines[1]
    return lines[0]


def _copy_model(tiny_model: Path, root: Path) -> Path:
    return Path(shutil.copytree(tiny_model, root / "model"))


def _config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))


# --- class 10: the model folder ------------------------------------------------------------


def test_model_folder_without_tokenizer_files(tmp_path, tiny_model, capsys, monkeypatch):
    model = _copy_model(tiny_model, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink()
    line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, model))
    assert ": model: " in line and "has no tokenizer" in line and "tokenizer.json" in line, line
    # tokenizer_config.json alone is no tokenizer either (transformers needs a vocabulary file).
    shutil.copy(tiny_model / "tokenizer_config.json", model)
    line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, model))
    assert "has no tokenizer" in line and "tokenizer.json" in line, line
    # tokenizer.json alone is enough: it is all the tokenizer loader needs.
    (model / "tokenizer_config.json").unlink()
    shutil.copy(tiny_model / "tokenizer.json", model)
    preflight(parse_spec(_job(tmp_path, model)))


@pytest.mark.parametrize("vocab_size", [10**12, 711])
def test_vocab_size_that_disagrees_with_the_weights(tmp_path, tiny_model, capsys, monkeypatch, vocab_size):
    model = _copy_model(tiny_model, tmp_path)
    rows = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    _config(model, vocab_size=vocab_size)
    line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, model))
    assert ": model: " in line and f"vocab_size {vocab_size}" in line, line
    assert f"model.embed_tokens.weight has {rows} rows" in line and "fix vocab_size" in line, line


def test_vocab_size_is_read_from_the_shard_the_index_names(tmp_path, tiny_model, capsys, monkeypatch):
    model = _copy_model(tiny_model, tmp_path)
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    header = _header(model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {k: "model-00001-of-00001.safetensors" for k in header if k != "__metadata__"},
            }
        )
    )
    preflight(parse_spec(_job(tmp_path, model)))
    _config(model, vocab_size=10**12)
    line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, model))
    assert "vocab_size 1000000000000" in line and "model-00001-of-00001.safetensors" in line, line


def test_weights_that_are_not_safetensors(tmp_path, tiny_model, capsys, monkeypatch):
    model = _copy_model(tiny_model, tmp_path)
    (model / "model.safetensors").write_bytes(b"<html>Not Found</html>")
    line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, model))
    assert "model.safetensors' is not a safetensors file" in line, line


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


# --- class 10: S3 paths that cannot be reached -----------------------------------------------


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks (environment, files, instance metadata)."""
    for key in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    s3_bucket(s3_server, "pf-preflight")
    return "pf-preflight"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def test_s3_output_without_credentials(
    tmp_path, tiny_model, s3_server, bucket, no_aws_credentials, capsys, monkeypatch
):
    data = _job(
        tmp_path,
        tiny_model,
        output={"path": f"s3://{bucket}/out/"},
        storage={"endpoint_url": s3_server, "region": "us-east-1"},
    )
    line = _refused(capsys, monkeypatch, tmp_path, data)
    assert ": output.path: " in line and "no AWS credentials" in line, line
    assert "storage.aws_access_key_id" in line and "AWS_ACCESS_KEY_ID" in line, line
    preflight(parse_spec({**data, "storage": {**data["storage"], **KEYS}}))  # with them: fine


def test_s3_output_bucket_that_does_not_exist(tmp_path, tiny_model, s3_server, bucket, capsys, monkeypatch):
    data = _job(
        tmp_path,
        tiny_model,
        output={"path": "s3://pf-no-such-bucket/out/"},
        storage={"endpoint_url": s3_server, "region": "us-east-1", **KEYS},
    )
    line = _refused(capsys, monkeypatch, tmp_path, data)
    assert ": output.path: " in line and "bucket 'pf-no-such-bucket' does not exist" in line, line


def test_s3_output_endpoint_that_cannot_be_reached(tmp_path, tiny_model, capsys, monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    data = _job(
        tmp_path,
        tiny_model,
        output={"path": "s3://pf-preflight/out/"},
        storage={"endpoint_url": endpoint, "region": "us-east-1", "max_attempts": 1, **KEYS},
    )
    line = _refused(capsys, monkeypatch, tmp_path, data)
    assert ": output.path: " in line and f"cannot reach the S3 endpoint {endpoint}" in line, line
    assert "storage.endpoint_url" in line, line


def test_s3_input_without_credentials_or_endpoint(
    tmp_path, tiny_model, s3_server, bucket, no_aws_credentials, capsys, monkeypatch
):
    """The input listing raised botocore's own errors: a traceback from `validate`."""
    data = _job(
        tmp_path,
        tiny_model,
        input={"path": f"s3://{bucket}/in/", "format": "jsonl"},
        storage={"endpoint_url": s3_server, "region": "us-east-1"},
    )
    line = _refused(capsys, monkeypatch, tmp_path, data)
    assert ": input.path: " in line and "no AWS credentials" in line, line
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    data["storage"] = {"endpoint_url": endpoint, "region": "us-east-1", "max_attempts": 1, **KEYS}
    line = _refused(capsys, monkeypatch, tmp_path, data)
    assert ": input.path: " in line and f"cannot reach the S3 endpoint {endpoint}" in line, line


# --- class 11: a chat prompt for a model without a chat template ------------------------------


def _without_chat_template(tiny_model: Path, root: Path) -> Path:
    model = _copy_model(tiny_model, root)
    (model / "chat_template.jinja").unlink()
    return model


def test_chat_prompt_for_a_model_without_chat_template(tmp_path, tiny_model, capsys, monkeypatch):
    model = _without_chat_template(tiny_model, tmp_path)
    line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, model, prompt={"user": "{{ question }}"}))
    assert ": prompt.user: " in line and "has no chat template" in line and "prompt.template" in line, line
    (tmp_path / "msgs.jsonl").write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": r["question"]}]}) + "\n" for r in ROWS)
    )
    data = _job(tmp_path, model, prompt={"messages_column": "messages"}, input={"path": str(tmp_path / "msgs.jsonl")})
    line = _refused(capsys, monkeypatch, tmp_path, data)
    assert ": prompt.messages_column: " in line and "has no chat template" in line, line
    # A plain template needs none; a template in tokenizer_config.json counts.
    preflight(parse_spec(_job(tmp_path, model)))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (tiny_model / "chat_template.jinja").read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    preflight(parse_spec(_job(tmp_path, model, prompt={"user": "{{ question }}"})))


def test_openai_chat_requests_for_a_model_without_chat_template(tmp_path, tiny_model, capsys, monkeypatch):
    model = _without_chat_template(tiny_model, tmp_path)
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
        }
        for i in range(3)
    ]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = {**_job(tmp_path, model), "input": {"path": str(tmp_path / "batch.jsonl"), "format": "openai"}}
    del data["prompt"]
    line = _refused(capsys, monkeypatch, tmp_path, data)
    assert ": input: " in line and "has no chat template" in line and "/v1/completions" in line, line
    for x in lines:  # completions requests need no chat template
        x.update(url="/v1/completions", body={"prompt": "hi", "max_tokens": 2})
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    preflight(parse_spec(data))


# --- class 11: output paths that cannot be written --------------------------------------------


def test_output_path_that_is_a_file(tmp_path, tiny_model, capsys, monkeypatch):
    (tmp_path / "taken").write_text("not a folder")
    line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, tiny_model, output={"path": str(tmp_path / "taken")}))
    assert ": output.path: " in line and "is a file" in line, line
    line = _refused(
        capsys, monkeypatch, tmp_path, _job(tmp_path, tiny_model, output={"path": str(tmp_path / "taken" / "out")})
    )
    assert ": output.path: " in line and "is a file" in line, line
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_read_only_output_folder(tmp_path, tiny_model, capsys, monkeypatch):
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        # root writes into a 0o555 folder; what stops it is a read-only mount, which access(2)
        # reports as well (EROFS): stand in for one.
        real = os.access
        monkeypatch.setattr(
            os, "access", lambda p, mode, **kw: False if Path(p) == folder and mode & os.W_OK else real(p, mode, **kw)
        )
    try:
        for out in (folder, folder / "sub" / "out"):  # the folder, or its nearest existing parent
            line = _refused(capsys, monkeypatch, tmp_path, _job(tmp_path, tiny_model, output={"path": str(out)}))
            assert ": output.path: " in line and f"{str(folder)!r} is not writable" in line, line
        assert not (folder / "sub").exists()
    finally:
        folder.chmod(0o755)


# --- the CLI: "committed rows are kept" only once the job generates ---------------------------


def test_storage_error_before_generation_is_one_line(tmp_path, tiny_model, capsys, monkeypatch):
    """An OSError before generation (here the output became a file after preflight) is exit 2,
    without the resume advice: nothing was committed."""
    import prefixflow.jobs.run as run

    for name in ("preflight", "ensure_ray", "check_resources"):
        monkeypatch.setattr(run, name, lambda *a, **k: None)
    (tmp_path / "taken").write_text("not a folder")
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(_job(tmp_path, tiny_model, output={"path": str(tmp_path / "taken")}))
    )
    code = cli(["run", str(tmp_path / "job.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "taken" in err and "resume" not in err and "Committed" not in err, err


def test_storage_error_while_generating_keeps_the_resume_advice(tmp_path, tiny_model, capsys, monkeypatch):
    import prefixflow.jobs.run as run

    def generate(*args, **kwargs):
        raise OSError("storage: write s3://b/out/part-1.jsonl failed 5 times")

    monkeypatch.setattr(run, "_generate", generate)
    monkeypatch.setattr(run, "run_job", lambda spec, **kw: run._generate(spec))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_job(tmp_path, tiny_model)))
    code = cli(["run", str(tmp_path / "job.yaml")])
    err = capsys.readouterr().err
    assert code == 1 and "the job stopped: storage: write s3://b/out/part-1.jsonl" in err, err
    assert "rerun with output.resume: true" in err, err
