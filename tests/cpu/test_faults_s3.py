"""Object storage faults: a tiny proxy on 127.0.0.1 in front of moto's S3 server answers a
share of requests with 503 SlowDown and delays others. A job through it completes with every
row once; a storage that keeps failing fails the job with a clear message, leaves committed
parts intact, and the same job resumed afterwards (through the flaky proxy) finishes exactly
once. Each job runs as its own driver process (the `start_driver` fixture), as under
`ray job submit`."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from prefixflow.bench.fault_proxy import FaultProxy
from prefixflow.jobs.demo import demo_rows
from prefixflow.operators.results.commit import load_committed
from prefixflow.operators.results.write import WriteOptions, read_output, write_part
from prefixflow.storage import StorageOptions
from support.output_folders import part_table
from support.s3 import s3_bucket

pytestmark = pytest.mark.slow
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def bucket(s3_server):
    return s3_bucket(s3_server, "pf-faults")


def _spec(root, model, endpoint: str, prefix: str, fmt: str, max_attempts: int, resume: bool = False):
    spec = {
        "model": str(model),
        "input": {"path": f"s3://pf-faults/{prefix}/in/", "format": fmt},
        "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_num_seqs": 2},
        "output": {"path": f"s3://pf-faults/{prefix}/out/", "format": "jsonl", "rows_per_part": 2, "resume": resume},
        "storage": {
            "endpoint_url": endpoint,
            "region": "us-east-1",
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
            "max_attempts": max_attempts,
            "retry_base_delay_s": 0.05,
        },
    }
    path = root / f"{prefix}-{len(list(root.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _put_input(storage: StorageOptions, prefix: str, fmt: str) -> list[dict]:
    rows = demo_rows(num_docs=3, questions_per_doc=4, sentences_per_doc=3, seed=9)  # 12 rows
    fs = storage.filesystem("s3://pf-faults")
    if fmt == "parquet":
        with fs.open(f"s3://pf-faults/{prefix}/in/part-0.parquet", "wb") as f:
            pq.write_table(pa.Table.from_pylist(rows), f)
    else:
        for i in range(0, len(rows), 4):  # a few files: several reads go through the proxy
            body = "".join(json.dumps(r) + "\n" for r in rows[i : i + 4]).encode()
            fs.pipe_file(f"s3://pf-faults/{prefix}/in/part-{i}.jsonl", body)
    return rows


def _run(proc) -> tuple[int, str]:
    rc = proc.wait(timeout=JOB_TIMEOUT_S)
    return rc, proc.log_path.read_text(errors="replace")


def _exactly_once(storage: StorageOptions, prefix: str, rows: list[dict]) -> None:
    out = read_output(f"s3://pf-faults/{prefix}/out/", storage)
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    assert len(out) == len(rows) and all(r["error"] is None for r in out)
    manifest = json.loads(storage.filesystem("s3://pf-faults").cat_file(f"pf-faults/{prefix}/out/_manifest.json"))
    assert manifest["row_ids"] == list(range(len(rows)))


def _metrics(storage: StorageOptions, prefix: str) -> dict:
    return json.loads(storage.filesystem("s3://pf-faults").cat_file(f"pf-faults/{prefix}/out/metrics.json"))


def test_flaky_s3_job_completes_with_nothing_lost(start_driver, tiny_model, bucket, tmp_path):
    """Our JSONL reader through the flaky proxy; Ray's parquet reader meets the same faults in
    the resume of test_persistent_s3_failure_fails_clearly_and_resumes (one job fewer)."""
    storage = bucket
    fmt = "jsonl"
    prefix = f"flaky-{fmt}"
    rows = _put_input(storage, prefix, fmt)
    # Every 4th request answers 503 and every 5th waits first: listing, reads, part and
    # commit-record PUTs and the manifest all meet faults.
    proxy = FaultProxy(storage.endpoint_url, fail_every=4, delay_every=5, delay_s=0.3)
    try:
        rc, log = _run(start_driver(_spec(tmp_path, tiny_model, proxy.endpoint, prefix, fmt, max_attempts=5)))
    finally:
        proxy.close()
    assert rc == 0, log[-4000:]
    metrics = _metrics(storage, prefix)
    assert metrics["rows"] == len(rows) and metrics["rows_error"] == 0
    _exactly_once(storage, prefix, rows)
    assert proxy.failed > 0 and proxy.delayed > 0
    print(
        f"\nflaky S3 ({fmt} input): {len(rows)} rows, {proxy.requests} requests, {proxy.failed} "
        f"answered 503, {proxy.delayed} delayed {proxy.delay_s}s, lost 0"
    )


def test_persistent_s3_failure_fails_clearly_and_resumes(start_driver, tiny_model, bucket, tmp_path):
    storage = bucket
    rows = _put_input(storage, "down", "parquet")
    # _lock.json, _job.json and a few parts with their commit records get through, then every
    # PUT fails.
    proxy = FaultProxy(storage.endpoint_url, puts_ok=8)
    try:
        rc, log = _run(start_driver(_spec(tmp_path, tiny_model, proxy.endpoint, "down", "parquet", max_attempts=2)))
    finally:
        proxy.close()
    assert rc != 0, "the job succeeded although the storage refused every write"
    assert "storage: write s3://pf-faults/down/out/" in log, log[-4000:]
    assert "output.resume: true" in log
    fs = storage.filesystem("s3://pf-faults")
    assert not fs.exists("pf-faults/down/out/_SUCCESS")
    records = fs.ls("pf-faults/down/out/_commits/", detail=False)
    committed = [json.loads(fs.cat_file(p)) for p in records]
    assert committed, "no part was committed before the storage went down"
    for rec in committed:  # committed parts are intact: their rows are all there
        part = read_output_part(fs, f"pf-faults/down/out/{rec['part']}")
        assert [r["row_id"] for r in part] == rec["row_ids"]
    refused = proxy.failed
    # The resume goes through a flaky storage (storage settings are not the job's identity):
    # Ray's parquet reader, the listing, the commit records the resume loads, its parts and the
    # manifest all meet 503s and delays, and nothing is lost.
    flaky = FaultProxy(storage.endpoint_url, fail_every=4, delay_every=5, delay_s=0.3)
    try:
        rc, log = _run(
            start_driver(_spec(tmp_path, tiny_model, flaky.endpoint, "down", "parquet", max_attempts=5, resume=True))
        )
    finally:
        flaky.close()
    assert rc == 0, log[-4000:]
    assert flaky.failed > 0 and flaky.delayed > 0
    metrics = _metrics(storage, "down")
    ft = metrics["fault_tolerance"]
    assert ft["rows_committed_before"] == sum(len(r["row_ids"]) for r in committed)
    assert ft["rows_written"] == len(rows) - ft["rows_committed_before"]
    assert metrics["rows"] == len(rows) and metrics["rows_error"] == 0
    _exactly_once(storage, "down", rows)
    print(
        f"\nS3 down: {len(rows)} rows, {refused} PUTs refused, committed before "
        f"{ft['rows_committed_before']}, redone {ft['rows_written']} through a flaky S3 "
        f"({flaky.failed} of {flaky.requests} requests answered 503), lost 0"
    )


def read_output_part(fs, path: str) -> list[dict]:
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines() if line]


def test_commit_records_and_parts_are_read_at_once_on_object_storage(bucket):
    """A resume (and a job's end) reads every commit record, and with verify every part: on
    object storage, requests at once, not one round trip after another (a job of thousands of
    parts would wait minutes). What is read is the same."""
    out = "s3://pf-faults/many/out"
    opts = WriteOptions(path=out, format="jsonl", storage=bucket)
    for k in range(0, 48, 2):
        write_part(part_table([k, k + 1]), opts)
    for verify in (False, True):  # the records alone; then the parts too
        proxy = FaultProxy(bucket.endpoint_url, delay_every=1, delay_s=0.05)
        try:
            via = dataclasses.replace(bucket, endpoint_url=proxy.endpoint)
            committed = load_committed(out, via, clean=False, verify=verify)
        finally:
            proxy.close()
        assert committed.row_ids.tolist() == list(range(48)) and len(committed.manifests) == 24
        assert committed.removed == []
        assert proxy.max_in_flight > 1, (verify, proxy.max_in_flight)
