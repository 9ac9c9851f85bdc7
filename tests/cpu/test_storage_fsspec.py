"""Storage through fsspec for any scheme it knows (issue 29): a whole job on file:// URLs (input,
output, resume and model: Ray workers see the same files), the object-store commit protocol on
a scheme other than S3 (fsspec's memory filesystem, in this one process), and a clear error
before any work for a scheme fsspec does not know or whose driver package is not installed.
The S3 tests (test_jobs_s3.py, test_faults_s3.py) cover s3:// on moto."""

from __future__ import annotations

import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from prefixflow.cli import main as cli
from prefixflow.jobs.demo import demo_rows
from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.commit import COMMITS, LOCK_FILE, OutputLock, commit_bytes, load_committed
from prefixflow.operators.results.write import read_output
from prefixflow.storage import StorageOptions

# A scheme whose driver package is not installed here (gcsfs, adlfs and ocifs are not in .venv).
MISSING = next(
    (
        (scheme, package)
        for scheme, package in (("gs", "gcsfs"), ("abfss", "adlfs"), ("oci", "ocifs"))
        if importlib.util.find_spec(package) is None
    ),
    None,
)


def _spec(root, model, resume: bool = False) -> dict:
    return {
        "model": f"file://{model}",
        "input": {"path": f"file://{root}/in/", "format": "parquet"},
        "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
        "output": {"path": f"file://{root}/out/", "format": "jsonl", "rows_per_part": 2, "resume": resume},
    }


@pytest.mark.slow
def test_file_urls_for_input_output_model_and_resume(ray_local, tiny_model, tmp_path):
    """Input (read by Ray's parquet reader through the fsspec filesystem), output and model as
    file:// URLs; a part deleted by hand after the job ended is redone by a resume, and only
    that part: its orphaned commit record removed, the part written again, the lock released."""
    rows = demo_rows(num_docs=2, questions_per_doc=3, sentences_per_doc=3, seed=4)  # 6 rows
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in" / "part-0.parquet")
    run_job(parse_spec(_spec(tmp_path, tiny_model)), quiet=True)
    out = read_output(f"file://{tmp_path}/out/")
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    assert all(r["error"] is None and r["num_generated_tokens"] > 0 for r in out)
    job = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert [f[0] for f in job["inputs"]] == [f"file://{tmp_path}/in/part-0.parquet"]

    lost = sorted((tmp_path / "out").glob("part-*.jsonl"))[0]
    lost_ids = {json.loads(line)["id"] for line in lost.read_text().splitlines()}
    lost.unlink()
    metrics = run_job(parse_spec(_spec(tmp_path, tiny_model, resume=True)), quiet=True)
    assert metrics["fault_tolerance"]["rows_committed_before"] == len(rows) - len(lost_ids)
    assert metrics["fault_tolerance"]["rows_written"] == len(lost_ids)
    assert f"_commits/{lost.name}.json" in metrics["fault_tolerance"]["orphans_removed"]
    again = read_output(f"file://{tmp_path}/out/")
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in rows)  # each row once
    assert lost.exists() and (tmp_path / "out" / "_SUCCESS").exists()
    assert not (tmp_path / "out" / LOCK_FILE).exists()


def test_object_store_commit_protocol_on_another_scheme(tiny_model, tmp_path, monkeypatch):
    """memory:// is not local, so it takes the object-store path that S3 takes: the lock is an
    exclusive create, parts are one PUT each, and a model folder is copied once into the cache."""
    import fsspec

    from prefixflow.model_source import model_kind, resolve_model

    storage, out = StorageOptions(), "memory://pf-storage-test/out"
    fs = fsspec.filesystem("memory")
    # storage.options reach the filesystem of their scheme only (here the memory one's kwargs).
    spec = parse_spec({**_spec(tmp_path, tiny_model), "storage": {"options": {"memory": {"tag": 7}}}})
    assert StorageOptions(**spec.storage.model_dump()).filesystem(out).storage_options == {"tag": 7}
    try:
        lock = OutputLock(out, storage).acquire()
        with pytest.raises(ValueError, match="is in use by another job"):
            OutputLock(out, storage).acquire()
        commit_bytes(f"{out}/part-r000-000000000.jsonl", b'{"id": 1}\n', storage)
        record = {"part": "part-r000-000000000.jsonl", "bytes": 10, "row_ids": [0]}
        commit_bytes(f"{out}/{COMMITS}/part-r000-000000000.jsonl.json", json.dumps(record).encode(), storage)
        commit_bytes(f"{out}/part-r001-000000000.jsonl", b'{"id": 2}\n', storage)  # no record
        committed = load_committed(out, storage)
        assert committed.row_ids.tolist() == [0] and committed.removed == ["part-r001-000000000.jsonl"]
        lock.release()
        assert not fs.exists(f"{out}/_lock.json")

        monkeypatch.setenv("PREFIXFLOW_CACHE", str(tmp_path / "cache"))
        fs.put(str(tiny_model) + "/", "memory://pf-storage-test/model/", recursive=True)
        assert model_kind("memory://pf-storage-test/model") == "url"
        local = resolve_model("memory://pf-storage-test/model", storage)
        assert (local / "config.json").is_file() and local.parent == tmp_path / "cache" / "models"
        assert resolve_model("memory://pf-storage-test/model/", storage) == local
    finally:  # the memory filesystem lives as long as this process
        if fs.exists("memory://pf-storage-test"):
            fs.rm("memory://pf-storage-test", recursive=True)


@pytest.mark.skipif(MISSING is None, reason="every driver package this test names is installed")
def test_unknown_scheme_or_missing_driver_is_named_by_validate(tiny_model, tmp_path, capsys):
    scheme, package = MISSING
    with pytest.raises(ValueError, match=f"pip install {package}"):
        StorageOptions().filesystem(f"{scheme}://bucket/in.jsonl")
    (tmp_path / "in.jsonl").write_text('{"q": "hi"}\n')
    spec = {
        "model": f"{scheme}://bucket/models/tiny",
        "input": {"path": "nosuchscheme://bucket/in.jsonl", "format": "jsonl"},
        "prompt": {"template": "{{ q }}"},
        "engine": {"device": "cpu"},
        "output": {"path": f"{scheme}://bucket/out/"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert cli(["validate", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert (
        "input.path: 'nosuchscheme://bucket/in.jsonl': nosuchscheme:// is not a storage scheme fsspec knows" in err
    ), err
    for field in ("model", "output.path"):
        assert f"{field}: '{scheme}://bucket/" in err and f"`pip install {package}`" in err, err


def test_an_s3_filesystem_is_made_once_per_arguments_and_aws_environment(monkeypatch):
    """The botocore client is made once per process for the same arguments; credentials taken
    from the environment are part of what makes it the same: an instance made under credentials
    since removed is not handed out again."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    storage = StorageOptions(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    first = storage.filesystem("s3://pf-cache/a")
    assert storage.filesystem("s3://pf-cache/b") is first
    assert first.dircache.use_listings_cache is False  # listings are read fresh: other workers write parts
    assert (
        StorageOptions(endpoint_url="http://127.0.0.1:9", region="us-east-1", max_attempts=2).filesystem(
            "s3://pf-cache/a"
        )
        is not first
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert storage.filesystem("s3://pf-cache/a") is not first
