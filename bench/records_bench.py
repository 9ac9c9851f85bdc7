"""What a resume (and a job's end) waits for on object storage: reading every commit record of
an output folder, and with verify every part, one request at a time (what prefixflow did
before) against FETCH_THREADS at once (prefixflow.storage.io_map), side by side in one run.

moto's S3 server on 127.0.0.1 stands for the store, behind the fault proxy, which holds every
request `--latency-ms` before it answers (a round trip to an object store in the same region
takes some tens of milliseconds; loopback takes none). The folder holds `--parts` parts of 10
rows with their commit records, as a job writes them.

    .venv/bin/python -m prefixflow.bench.records_bench [--parts 200 --latency-ms 20 --repeats 3]

Writes bench/results/records_bench.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import pyarrow as pa

from prefixflow import storage
from prefixflow.bench.fault_proxy import FaultProxy, start_moto_server
from prefixflow.bench.record import command_line, spread, write_result
from prefixflow.operators.results.commit import load_committed
from prefixflow.operators.results.write import WriteOptions, write_part

BUCKET = "pf-records-bench"


def _bucket(endpoint: str) -> storage.StorageOptions:
    import boto3

    key, secret = "testing", "testing"  # moto's
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key, aws_secret_access_key=secret
    ).create_bucket(Bucket=BUCKET)
    return storage.StorageOptions(
        endpoint_url=endpoint, region="us-east-1", aws_access_key_id=key, aws_secret_access_key=secret
    )


def _write_parts(opts: WriteOptions, parts: int, rows_per_part: int = 10) -> None:
    for p in range(parts):
        ids = list(range(p * rows_per_part, (p + 1) * rows_per_part))
        n = len(ids)
        table = {
            "row_id": ids,
            "replica": [0] * n,
            "_pf_rank": ids,
            "error": pa.nulls(n, pa.string()),
            "num_input_tokens": [3] * n,
            "_pf_computed": [3.0] * n,
            "num_generated_tokens": [1] * n,
            "generated_text": ["an answer"] * n,
        }
        write_part(pa.table(table), opts)


def _timed(out: str, via: storage.StorageOptions, threads: int, verify: bool, parts: int) -> float:
    saved = storage.FETCH_THREADS
    storage.FETCH_THREADS = threads
    try:
        start = time.perf_counter()
        committed = load_committed(out, via, clean=False, verify=verify)
        seconds = time.perf_counter() - start
    finally:
        storage.FETCH_THREADS = saved
    assert len(committed.manifests) == parts, "every committed part counted"
    return seconds


def run(parts: int, latency_ms: float, repeats: int) -> dict[str, Any]:
    proc, endpoint = start_moto_server()
    try:
        bucket = _bucket(endpoint)
        out = f"s3://{BUCKET}/out"
        _write_parts(WriteOptions(path=out, format="jsonl", storage=bucket), parts)
        proxy = FaultProxy(endpoint, delay_every=1, delay_s=latency_ms / 1000)
        via = dataclasses.replace(bucket, endpoint_url=proxy.endpoint)
        cases = [(verify, threads) for verify in (False, True) for threads in (1, storage.FETCH_THREADS)]
        times: dict[tuple[bool, int], list[float]] = {case: [] for case in cases}
        loads = []
        try:
            _timed(out, via, storage.FETCH_THREADS, True, parts)  # a warm-up, not counted
            for _ in range(repeats):  # the cells interleaved: a drift of the server's speed hits all
                for verify, threads in cases:
                    times[verify, threads].append(_timed(out, via, threads, verify, parts))
                loads.append(os.getloadavg()[0])
        finally:
            proxy.close()
        cells: dict[str, Any] = {
            f"{'records_and_parts' if verify else 'records'}_{threads}_at_once": spread(times[verify, threads])
            for verify, threads in cases
        }
    finally:
        proc.kill()
    ratios = {
        kind: cells[f"{kind}_1_at_once"]["seconds_median"]
        / cells[f"{kind}_{storage.FETCH_THREADS}_at_once"]["seconds_median"]
        for kind in ("records", "records_and_parts")
    }
    return {
        "parts": parts,
        "latency_ms": latency_ms,
        "repeats": repeats,
        "cells": cells,
        "speedup": ratios,
        "load_average_per_repeat": loads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=200)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/records_bench.json")
    args = parser.parse_args()
    result = run(args.parts, args.latency_ms, args.repeats)
    result["command"] = command_line("records_bench", args)
    write_result(args.out, result)
    print(result["speedup"])


if __name__ == "__main__":
    main()
