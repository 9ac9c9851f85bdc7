"""S3 input and output against moto's S3 server on 127.0.0.1 (no internet)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.jobs.demo import demo_rows
from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.write import read_output
from prefixflow.operators.stages.read import ReadOptions, read_dataset
from support.s3 import s3_bucket

pytestmark = pytest.mark.slow  # end to end on a real local Ray


@pytest.fixture(scope="module")
def bucket(s3_server):
    storage = s3_bucket(s3_server, "pf-test")
    return storage, storage.filesystem("s3://pf-test")


def test_s3_parquet_in_jsonl_out(ray_local, tiny_model, bucket):
    storage, fs = bucket
    rows = demo_rows(num_docs=2, questions_per_doc=3, sentences_per_doc=4, seed=2)
    with fs.open("s3://pf-test/in/part-0.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(rows), f)
    spec = parse_spec(
        {
            "model": str(tiny_model),
            "input": {"path": "s3://pf-test/in/", "format": "parquet"},
            "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
            "sampling": {"temperature": 0, "max_tokens": 4, "logprobs": 1},
            "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
            "output": {"path": "s3://pf-test/out/", "format": "jsonl", "include_prompt": True},
            "storage": {
                "endpoint_url": storage.endpoint_url,
                "region": "us-east-1",
                "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing",
            },
        }
    )
    metrics = run_job(spec, quiet=True)
    out = read_output("s3://pf-test/out/", storage)
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    assert all(r["error"] is None and r["num_generated_tokens"] > 0 for r in out)
    for r in out:  # include_prompt and logprobs columns
        assert r["prompt"].startswith("Document: ") and r["prompt"].endswith("Answer:")
        assert len(json.loads(r["logprobs"])) == r["num_generated_tokens"]
    saved = json.loads(fs.cat_file("s3://pf-test/out/metrics.json"))
    assert saved["rows"] == len(rows) == metrics["rows"]
    assert fs.exists("s3://pf-test/out/_SUCCESS")


def test_s3_jsonl_reader_keeps_bad_lines(ray_local, bucket):
    storage, fs = bucket
    fs.pipe_file("s3://pf-test/raw/a.jsonl", b'{"q": "one"}\n{broken\n{"q": "three"}\n')
    got = read_dataset(ReadOptions(path="s3://pf-test/raw/a.jsonl", format="jsonl", storage=storage)).take_all()
    assert [r["q"] for r in got] == ["one", None, "three"]
    assert "not valid JSON" in got[1]["_pf_error"] and got[1]["_pf_source"].endswith("a.jsonl:2")
