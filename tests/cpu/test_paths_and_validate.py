"""Paths and validate-time checks, round three (issue 43, items 3-5, 12 and 14-18):

- one path normaliser for validate, the input/output clash checks and the writers: `..`,
  symbolic links and a scheme's case never hide an output inside the input (globs included),
  `FILE://` is file://, an empty output path is refused;
- http(s) input works end to end (a file's size, else its ETag or Last-Modified, identifies it
  for a resume); output schemes the Ray workers cannot share or write are refused at validate;
- engine.kv_cache_bytes is checked against the model's KV block and the machine's memory;
- a plain file as `model:` is called a file; URLs are echoed without their passwords;
- spec booleans are YAML's (no "yes"), two `<<` merge keys in one mapping are refused, and a
  parquet map column reaches a template as the mapping it holds.

No Ray, except the one whole job over HTTP.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from prefixflow.cli import main as cli
from prefixflow.jobs.preflight import preflight
from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import SpecError, load_yaml, parse_spec
from prefixflow.operators.results.commit import input_listing
from prefixflow.operators.results.write import read_output
from prefixflow.operators.template import PromptTemplate
from prefixflow.storage import StorageOptions

ROWS = [{"id": i, "document": f"doc {i % 3}", "question": f"why {i}?"} for i in range(6)]


def _job(root: Path, model: Path, inp: str | None = None, out: str | None = None, **engine) -> dict:
    (root / "data" / "in").mkdir(parents=True, exist_ok=True)
    (root / "data" / "in" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {
        "model": str(model),
        "input": {"path": inp or str(root / "data" / "in" / "a.jsonl"), "format": "jsonl"},
        "prompt": {"template": "{{ document }}: {{ question }}"},
        "sampling": {"temperature": 0, "max_tokens": 2},
        "engine": {"device": "cpu", **engine},
        "output": {"path": out or str(root / "out"), "format": "jsonl", "rows_per_part": 2},
    }


def _problems(data: dict, **kwargs) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        preflight(parse_spec(data), **kwargs)
    return dict(e.value.problems)


# -- items 3-5: one path normaliser -----------------------------------------------------------


def test_an_output_inside_the_input_is_refused_however_it_is_spelled(tiny_model, tmp_path):
    (tmp_path / "data" / "x").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data" / "in", target_is_directory=True)
    folder = str(tmp_path / "data" / "in")
    for out in (
        f"file://{tmp_path}/data/x/../in/out",  # '..' in a file:// URL
        f"FILE://{tmp_path}/data/x/../in/out",  # ... with the scheme in capitals
        f"file://{tmp_path}/link/out",  # a symbolic link to the input folder
        f"{tmp_path}/data/x/../in",
    ):  # the input folder itself
        problems = _problems(_job(tmp_path, tiny_model, inp=folder, out=out))
        assert "is inside the input" in problems["output.path"], (out, problems)
    # An input glob that would read what the job writes: refused (the first run was accepted,
    # every resume refused as "input that changed").
    glob = _job(tmp_path, tiny_model, inp=f"{tmp_path}/data/**/*.jsonl", out=f"{tmp_path}/data/out")
    assert "would read what the job writes" in _problems(glob)["output.path"]
    # ... and one that cannot match what it writes is no clash.
    (tmp_path / "data" / "b.csv").write_text("document,question\nd,q\n")
    preflight(parse_spec(_job(tmp_path, tiny_model, inp=f"{tmp_path}/data/*.csv", out=f"{tmp_path}/data/out")))


def test_a_scheme_in_capitals_writes_where_it_says(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = parse_spec(_job(tmp_path, tiny_model, out=f"FILE://{tmp_path}/out"))
    preflight(spec)
    assert spec.to_job().write.path == f"file://{tmp_path}/out"  # never ./FILE:/...
    link = tmp_path / "via"
    link.symlink_to(tmp_path, target_is_directory=True)
    spec = parse_spec(_job(tmp_path, tiny_model, out=f"file://{link}/x/../out2"))
    assert spec.to_job().write.path == f"file://{tmp_path}/out2"  # what validate checked


@pytest.mark.parametrize("out", ["", "   "])
def test_an_empty_output_path_is_refused(tiny_model, tmp_path, out):
    with pytest.raises(SpecError, match=r"output.path: '\s*' is empty"):
        parse_spec(_job(tmp_path, tiny_model, out="x") | {"output": {"path": out}})


@pytest.mark.parametrize(
    "out, why",
    [
        ("memory://bucket/out", "inside one process"),
        ("http://127.0.0.1:9/out", "only reads"),
        ("s3:/bucket/out", "a URL needs '//' after its scheme"),
    ],
)
def test_output_schemes_the_workers_cannot_share_or_write_are_refused(tiny_model, tmp_path, out, why):
    problem = _problems(_job(tmp_path, tiny_model, out=out))["output.path"]
    assert why in problem, problem


# -- item 12: http(s) input ----------------------------------------------------------------


class _NoLength(http.server.SimpleHTTPRequestHandler):
    """A server that sends no Content-Length (a stream), only an ETag."""

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() == "content-length":
            return
        super().send_header(keyword, value)

    def end_headers(self) -> None:
        self.send_header("ETag", '"v1"')
        self.close_connection = True
        super().end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _serve(root: Path, handler: type) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    servers = [_serve(root, _Quiet), _serve(root, _NoLength)]
    yield [url for _, url in servers]
    for server, _ in servers:
        server.shutdown()


def test_http_input_is_listed_by_size_or_etag(tiny_model, tmp_path, http_root):
    sized, streamed = http_root
    size = len("".join(json.dumps(r) + "\n" for r in ROWS))
    assert input_listing([f"{sized}/in.jsonl"], StorageOptions()) == [[f"{sized}/in.jsonl", size]]
    assert input_listing([f"{streamed}/in.jsonl"], StorageOptions()) == [[f"{streamed}/in.jsonl", 'ETag: "v1"']]
    for url in (sized, streamed):
        preflight(parse_spec(_job(tmp_path, tiny_model, inp=f"{url}/in.jsonl")))
    missing = _problems(_job(tmp_path, tiny_model, inp=f"{sized}/nothing.jsonl"))["input.path"]
    assert "matches no file" in missing
    folder = _problems(_job(tmp_path, tiny_model, inp=f"{sized}/"))
    assert "HTTP cannot list" in folder["input.path"]


@pytest.mark.slow
def test_a_whole_job_reads_http_input_and_resumes(ray_local, tiny_model, tmp_path, http_root):
    spec = _job(tmp_path, tiny_model, inp=f"{http_root[0]}/in.jsonl")
    run_job(parse_spec(spec), quiet=True)
    out = tmp_path / "out"
    assert sorted(r["id"] for r in read_output(str(out))) == [r["id"] for r in ROWS]
    lost = sorted(out.glob("part-r*"))[0]
    lost.unlink()
    metrics = run_job(parse_spec({**spec, "output": {**spec["output"], "resume": True}}), quiet=True)
    assert metrics["fault_tolerance"]["rows_written"] == 2
    assert sorted(r["id"] for r in read_output(str(out))) == [r["id"] for r in ROWS]


# -- items 14-17: validate-time checks and messages -----------------------------------------


def test_kv_cache_bytes_is_checked_against_the_model_and_the_machine(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the job would start its cluster here
    huge = _problems(_job(tmp_path, tiny_model, kv_cache_bytes=10**13))["engine.kv_cache_bytes"]
    assert "10,000,000,000,000 bytes is more than the memory of any node" in huge
    tiny = _problems(_job(tmp_path, tiny_model, kv_cache_bytes=1))["engine.kv_cache_bytes"]
    assert "1 bytes cannot hold one KV block of this model" in tiny and "use at least" in tiny
    preflight(parse_spec(_job(tmp_path, tiny_model, kv_cache_bytes=16 << 20)))
    # A cluster elsewhere: its nodes are checked after ray.init (check_resources), not this machine.
    preflight(parse_spec(_job(tmp_path, tiny_model, kv_cache_bytes=10**13)), address="ray://far:10001")


def test_a_file_as_model_is_called_a_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"weights")
    problem = _problems(_job(tmp_path, tmp_path / "model.bin"))["model"]
    assert "is a file, not a model folder" in problem and "does not exist" not in problem


def test_passwords_in_urls_are_never_echoed(tiny_model, tmp_path, capsys):
    url = "http://alice:hunter2@127.0.0.1:9/data/in.jsonl?sig=s3cr3t"  # port 9: nothing listens
    spec = _job(tmp_path, tiny_model, inp=url)
    problems = _problems(spec)
    assert "cannot be reached" in problems["input.path"] and "alice:***@" in problems["input.path"]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert cli(["validate", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert "input.path" in err and "hunter2" not in err and "s3cr3t" not in err, err


def test_rows_read_over_a_url_with_a_password_are_named_without_it(tiny_model, tmp_path, http_root, capsys):
    (tmp_path / "www" / "in.jsonl").write_text('{"document": "d", "question": "q"}\n{broken\n')
    url = http_root[0].replace("http://", "http://alice:hunter2@") + "/in.jsonl"
    assert input_listing([url], StorageOptions())[0][0].startswith("http://alice:***@")  # _job.json's
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(_job(tmp_path, tiny_model, inp=url)))
    assert cli(["validate", str(tmp_path / "job.yaml")]) == 0
    out = capsys.readouterr()
    assert "1 of the first 2 rows would become error records" in out.out, out
    assert "alice:***@" in out.out and "hunter2" not in out.out + out.err, out


# -- item 18: strict spec types, merge keys, map columns -------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("output.error_file", "yes"),
        ("output.resume", "true"),
        ("output.include_prompt", 1),
        ("engine.enable_prefix_cache", "off"),
        ("storage.anonymous", "false"),
    ],
)
def test_booleans_are_never_read_from_text_or_numbers(tiny_model, tmp_path, field, value):
    data = _job(tmp_path, tiny_model)
    section, key = field.split(".")
    data.setdefault(section, {})[key] = value
    with pytest.raises(SpecError, match=rf"{field}: .* is not a boolean: write true or false"):
        parse_spec(data)


def test_two_merge_keys_in_one_mapping_are_refused():
    text = "base: &a {x: 1}\nmore: &b {y: 2}\nengine:\n  <<: *a\n  <<: *b\n"
    with pytest.raises(SpecError, match=r"engine: two '<<' merge keys in one mapping \(lines 4 and 5\)"):
        load_yaml(text, "job.yaml")
    assert load_yaml("a: &a {x: 1}\nb: &b {y: 2}\nc: {<<: [*a, *b]}\n", "job.yaml")["c"] == {"x": 1, "y": 2}


def test_a_parquet_map_column_reaches_the_template_as_a_mapping():
    table = pa.table({"m": pa.array([[("k", "v2")]], pa.map_(pa.string(), pa.string())), "s": pa.array([{"k": "v2"}])})
    row = table.to_pylist()[0]
    assert PromptTemplate(template="{{ m.k }} {{ m['k'] }}").render(row) == "v2 v2"
    both = PromptTemplate(template="{{ m }}|{{ s }}").render(row).split("|")
    assert both[0] == both[1] and "('k'" not in both[0]  # as the struct's value, not [('k', 'v2')]
