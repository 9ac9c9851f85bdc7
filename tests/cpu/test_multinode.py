"""Jobs across the nodes of a real multi-node Ray cluster (issue 28).

One `ray.cluster_utils.Cluster` for the module: a head node (1 CPU: tokenizing, planning, the
job drivers) and three worker nodes (1 CPU each), each its own raylet and object store on this
machine, each node with its own prefixflow cache (as separate machines would have). The nodes
share nothing but object storage: the model, the input and the output are on S3 (moto's
server on 127.0.0.1). Every address is the loopback one.

- `ray job submit` to the head of a job with `replicas: 3` puts one replica on each of three
  nodes, writes every row once, plans from metadata (the driver receives a fraction of the token
  ids' bytes) and copies the model once per node that runs an engine;
- a worker node removed mid-job while its replica holds uncommitted rows, and a node added: the
  others take the lost replica's units (work stealing), a replica that waited for resources
  starts on the new node and takes units, and the job ends in one run with every row exactly
  once. One job for both (a lost machine replaced, as an autoscaler does): each job on this
  cluster costs a minute of the suite's 15.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from prefixflow.bench.fault_proxy import free_port
from prefixflow.jobs.demo import demo_rows

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 400
# Ray rewrites 127.0.0.1 in a cluster address to the machine's own IP unless clusters are off
# "for Windows/OSX": with this, drivers and nodes reach one another on the loopback address.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server, tiny_model):
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("cluster")
    env = {**LOOPBACK, "AWS_ENDPOINT_URL": s3_server}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the nodes' processes (and the job drivers they start) inherit it
    dashboard = free_port()
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard,
            # Each node's agent on a port the OS gives it when it binds (0): the session's Ray holds
            # the default one, and a port picked beforehand can be taken by then, which leaves the
            # agent without its HTTP server, unregistered, and `ray job submit` (which talks to the
            # head's agent) answering "No available agent" for good.
            "dashboard_agent_listen_port": 0,
            "env_vars": {"PREFIXFLOW_CACHE": str(root / "head-cache")},
        },
    )
    workers = [_add_worker(c, root / f"node{k}-cache") for k in range(3)]
    c.wait_for_nodes()
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    for bucket in ("pf-models", "pf-data", "pf-out"):
        client.create_bucket(Bucket=bucket)
    s3 = _s3(s3_server)
    s3.put(str(tiny_model) + "/", "pf-models/tiny/", recursive=True)
    try:
        yield SimpleNamespace(cluster=c, workers=workers, root=root, s3=s3, endpoint=s3_server, dashboard=dashboard)
    finally:
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _add_worker(c, cache: Path):
    return c.add_node(
        num_cpus=1,
        node_ip_address="127.0.0.1",
        dashboard_agent_listen_port=0,
        env_vars={"PREFIXFLOW_CACHE": str(cache)},
    )


def _s3(endpoint: str):
    from prefixflow.storage import StorageOptions

    return StorageOptions(endpoint_url=endpoint).filesystem("s3://pf-data")


def _job(cl, name: str, rows: list[dict], **extra) -> dict:
    cl.s3.pipe_file(f"pf-data/{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = {
        "name": name,
        "model": "s3://pf-models/tiny",
        "input": {"path": f"s3://pf-data/{name}.jsonl"},
        "prompt": {"template": "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_tokens": 8},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
        "replicas": 3,
        "storage": {"endpoint_url": cl.endpoint},
        "output": {"path": f"s3://pf-out/{name}", "format": "jsonl", "rows_per_part": 4},
    }
    for key, value in extra.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return spec


def _driver(cl, spec: dict, log: Path) -> subprocess.Popen:
    """`prefixflow run` as a driver process of the cluster (it runs on the head's machine)."""
    path = cl.root / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "RAY_ADDRESS": cl.cluster.address, "PREFIXFLOW_CACHE": str(cl.root / "head-cache")}
    return subprocess.Popen(
        [sys.executable, "-m", "prefixflow.cli", "run", str(path)],
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )


def _finish(proc: subprocess.Popen, log: Path) -> int:
    try:
        return proc.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the job did not end within {JOB_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _output(cl, name: str) -> list[dict]:
    from prefixflow.operators.results.write import read_output
    from prefixflow.storage import StorageOptions

    return read_output(f"s3://pf-out/{name}", StorageOptions(endpoint_url=cl.endpoint))


def _metrics(cl, name: str) -> dict:
    return json.loads(_s3(cl.endpoint).cat_file(f"pf-out/{name}/metrics.json"))  # no stale listing


def _model_copies(cl) -> dict[str, int]:
    caches = {"head": cl.root / "head-cache"} | {f"node{k}": cl.root / f"node{k}-cache" for k in range(3)}
    return {
        name: len(list((cache / "models").glob("s3-*"))) if (cache / "models").is_dir() else 0
        for name, cache in caches.items()
    }


def test_three_replicas_on_three_nodes_by_ray_job_submit(cluster, tmp_path):
    """`ray job submit` of a spec to the head: one replica on each of three nodes, every row
    once, a plan from metadata, the model copied once per node."""
    rows = demo_rows(num_docs=6, questions_per_doc=4, sentences_per_doc=48, seed=5)
    spec = _job(cluster, "spread", rows)
    result = _submit(cluster, spec, tmp_path / "work")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "joined the cluster" in result.stdout + result.stderr
    out = _output(cluster, "spread")
    assert sorted(r["row_id"] for r in out) == list(range(len(rows)))
    assert all(r["error"] is None and r["num_generated_tokens"] >= 1 for r in out)
    metrics = _metrics(cluster, "spread")
    # One engine per node (an engine still loading when the others had run every unit is
    # stopped and has no record: work stealing).
    nodes = [r["node_id"] for r in metrics["per_replica"]]
    assert 1 <= len(nodes) <= 3 and len(set(nodes)) == len(nodes), nodes
    # Planning brought metadata to the driver, not the prompts' token ids (4 bytes a token).
    assert 0 < metrics["plan_driver_bytes"] < metrics["prompt_tokens"] * 4 / 4, metrics["plan_driver_bytes"]
    # The model came from S3 once per node: the driver's (the head, where `ray job submit`
    # runs the entrypoint) and each engine's node.
    copies = _model_copies(cluster)
    assert copies["head"] == 1 and sorted(copies.values()).count(1) >= 3, copies
    assert set(copies.values()) <= {0, 1}, copies


def _submit(cl, spec: dict, work: Path) -> subprocess.CompletedProcess:
    """`ray job submit` of `spec` to the head's job agent (the working dir holds job.yaml)."""
    work.mkdir()
    (work / "job.yaml").write_text(yaml.safe_dump(spec))
    submit = [
        str(Path(sys.executable).parent / "ray"),
        "job",
        "submit",
        "--address",
        f"http://127.0.0.1:{cl.dashboard}",
        "--working-dir",
        str(work),
        "--",
        sys.executable,
        "-m",
        "prefixflow.cli",
        "run",
        "job.yaml",
    ]
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    deadline = time.time() + 180
    while True:  # the head's job agent comes up a while after the dashboard (longer under load)
        result = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        if "No available agent" not in result.stdout + result.stderr or time.time() > deadline:
            return result
        time.sleep(3)


def test_a_node_lost_and_a_node_added_mid_job(cluster, tmp_path):
    """More replicas than the cluster holds engines, so the last waits for resources. Mid-job
    the node of a replica that still holds uncommitted rows is removed and a new node joins (an
    autoscaler replacing a lost machine): the units the lost replica held go back to the work
    queue, a replica starts on the new node and takes units, and the job ends in one run (no
    resume) with every row exactly once."""
    rows = demo_rows(num_docs=20, questions_per_doc=4, seed=11)
    slots = 1 + len(cluster.workers)  # the head's CPU and each worker's hold one engine
    # One sequence at a time and small parts: commits come one after another for a while. Long
    # answers (EOS ignored): the rows left when the node joins must outlast a replica's start on
    # it (about 25 s here when the machine is otherwise idle: the node's worker, imports, the
    # model from S3), or the others, stealing, rightly run every unit before it is up.
    spec = _job(
        cluster,
        "replaced",
        rows,
        replicas=slots + 1,
        sampling={"max_tokens": 384, "ignore_eos": True},
        engine={"max_num_seqs": 1},
        output={"rows_per_part": 2},
    )
    log = tmp_path / "driver.log"
    proc = _driver(cluster, spec, log)
    victim = _first_committing_worker(cluster, "replaced", proc, log)
    victim_replicas = _replicas_on(cluster, "replaced", victim)
    removed_at = time.time()
    cluster.cluster.remove_node(victim)
    cluster.workers.remove(victim)
    added = _add_worker(cluster.cluster, cluster.root / "node-new-cache")
    added_at = time.time()
    cluster.workers.append(added)  # three workers again for the next test
    assert _finish(proc, log) == 0, log.read_text()[-4000:]  # no resume needed
    out = _output(cluster, "replaced")
    assert sorted(r["row_id"] for r in out) == list(range(len(rows))), "rows lost or repeated"
    assert all(r["error"] is None for r in out)
    metrics = _metrics(cluster, "replaced")
    faults = metrics["fault_tolerance"]
    assert faults["rows_committed_before"] == 0 and faults["rows_given_up"] == 0, faults
    # The victim's engine died holding units with uncommitted rows (what the driver found when
    # it handed them back); the others committed them.
    dead = [f for f in faults["failures"] if f["item"] in victim_replicas and f["engine_loaded"]]
    assert dead and dead[0]["units_held"] >= 1 and dead[0]["item_rows_left"] > 0, faults
    # A replica started on the node that joined mid-job and ran rows: its own queue's remains
    # or units taken from the others.
    late = [r for r in metrics["per_replica"] if r["node_id"] == added.node_id]
    assert late and late[0]["num_rows"] > 0, _since(added_at, removed_at, metrics["per_replica"])


def _since(added_at: float, removed_at: float, per_replica: list[dict]) -> str:
    """When each replica's engine was ready and ended, in seconds since the node joined."""
    times = [
        f"replica {r['replica']} ({r['num_rows']} rows): ready {r['engine_ready_s'] - added_at:.1f} s, "
        f"ended {r['end_s'] - added_at:.1f} s"
        for r in per_replica
    ]
    return f"node removed {removed_at - added_at:.1f} s; " + "; ".join(times)


def _replicas_on(cl, name: str, node) -> set[int]:
    """The replicas whose engines committed parts from `node` so far."""
    found = set()
    for path in cl.s3.ls(f"pf-out/{name}/_commits/", refresh=True):
        record = json.loads(cl.s3.cat_file(path))
        if record.get("node_id") == node.node_id:
            found.add(int(record["replica"]))
    return found


def _first_committing_worker(cl, name: str, proc: subprocess.Popen, log: Path):
    """The worker node whose engine commits first (it runs a replica, and has rows left)."""
    by_id = {n.node_id: n for n in cl.workers}
    deadline = time.time() + JOB_TIMEOUT_S
    while time.time() < deadline:
        assert proc.poll() is None, f"the job ended before any commit:\n{log.read_text()[-4000:]}"
        try:
            records = cl.s3.ls(f"pf-out/{name}/_commits/", refresh=True)
        except FileNotFoundError:
            records = []
        for path in records:
            node = json.loads(cl.s3.cat_file(path)).get("node_id")
            if node in by_id:
                return by_id[node]
        time.sleep(0.2)
    pytest.fail(f"no part committed by a worker node within {JOB_TIMEOUT_S} s")
