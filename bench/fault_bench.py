"""Faults under load: what a prefixflow job loses (nothing) and redoes (little) when engine
actors, the driver or the object store fail, next to the same job without faults.

Every job runs as its own driver process on one local Ray (as under `ray job submit`), with
the demo's tiny model on the CPU. Scenarios, each on the same rows:

  clean         no fault: the baseline wall time
  engine_kills  the engine actor that wrote the latest part is SIGKILLed (by the pid in its
                commit record) when 20%, 45% and 70% of the rows are committed
  driver_kill   the driver is SIGKILLed at 50%; the same spec is run again (output.resume)
  s3            input and output on moto's S3 server behind the fault proxy, which lets every
                request through: the baseline for flaky_s3
  flaky_s3      the same, with the proxy answering every 4th request with 503 SlowDown and
                delaying every 5th by 0.2 s

For each: rows, replicas, faults injected, engine failures seen by the driver, rows committed
when each attempt started, rows lost (input ids missing from the output), rows duplicated, and
wall time.

    .venv/bin/python -m prefixflow.bench.fault_bench [--num-docs 75 --questions 8 --replicas 2]

Writes bench/results/fault_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypedDict

import yaml

RESULTS = Path(__file__).resolve().parent / "results"
TEMPLATE = "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"


def job_spec(
    model: Path, inp: str, out: str, args: argparse.Namespace, storage: dict[str, Any] | None = None
) -> dict[str, Any]:
    spec = {
        "model": str(model),
        "input": {"path": inp, "format": "jsonl"},
        "prompt": {"template": TEMPLATE},
        "sampling": {"temperature": 0, "max_tokens": args.max_tokens},
        "engine": {"device": "cpu", "kv_cache_bytes": 64 << 20, "max_num_seqs": args.max_num_seqs},
        "replicas": args.replicas,
        "output": {"path": out, "format": "jsonl", "rows_per_part": args.rows_per_part, "resume": True},
    }
    if storage:
        spec["storage"] = storage
    return spec


class S3Credentials(TypedDict):
    """StorageOptions fields that reach moto's server (its test credentials)."""

    region: str
    aws_access_key_id: str
    aws_secret_access_key: str


class Driver:
    """`python -m prefixflow.cli run SPEC` as its own process, joined to the bench's Ray."""

    def __init__(self, spec: dict[str, Any], root: Path, name: str, address: str):
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        self.log = root / f"{name}.log"
        env = {**os.environ, "RAY_ADDRESS": address}
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixflow.cli", "run", str(path)],
            env=env,
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
        )

    def wait(self) -> float:
        rc = self.proc.wait(timeout=1800)
        if rc != 0:
            raise RuntimeError(f"job failed (exit {rc}):\n{self.log.read_text()[-3000:]}")
        return time.perf_counter() - self.started


def local_records(out: Path) -> list[dict[str, Any]]:
    """The commit records under a local output path, read while the job writes them."""
    from prefixflow.operators.results.commit import COMMITS

    records = []
    for p in sorted((out / COMMITS).glob("part-*.json")) if (out / COMMITS).exists() else []:
        try:
            records.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):  # being renamed into place
            pass
    return records


def worker_pid(record: dict[str, Any]) -> int:
    """The pid of the engine actor that wrote a part (its commit record's host:pid)."""
    return int(record["worker"].rsplit(":", 1)[1])


def wait_until(cond: Callable[[], bool], driver: Driver, what: str) -> None:
    while not cond():
        if driver.proc.poll() is not None:
            raise RuntimeError(f"the job ended before {what}:\n{driver.log.read_text()[-3000:]}")
        time.sleep(0.02)


def engine_pids() -> set[int]:
    """Processes of engine actors on this machine (Ray titles them ray::ReplicaGenerator)."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith("ray::") and "ReplicaGenerator" in cmd:
            pids.add(p.info["pid"])
    return pids


def check_output(out: str, rows: list[dict[str, Any]], storage: Any = None) -> dict[str, Any]:
    from prefixflow.operators.results.write import read_output

    got = read_output(out, storage) if storage is not None else read_output(out)
    ids = [r["id"] for r in got]
    return {
        "output_rows": len(ids),
        "rows_lost": len({r["id"] for r in rows} - set(ids)),
        "rows_duplicated": len(ids) - len(set(ids)),
        "error_rows": sum(r["error"] is not None for r in got),
    }


def summary(metrics: dict[str, Any]) -> dict[str, Any]:
    ft = metrics["fault_tolerance"]
    return {
        "engine_failures": ft["engine_failures"],
        # per death: the replica, the job's rows committed then, the units it held and their
        # rows left (which went back to the queue for a live or new actor)
        "restarts": [
            {k: f[k] for k in ("item", "rows_committed", "units_held", "item_rows_left", "after_s")}
            for f in ft["failures"]
        ],
        "rows_committed_at_failures": ft["rows_committed_at_failures"],
        "rows_committed_before_this_run": ft["rows_committed_before"],
        "rows_written_by_this_run": ft["rows_written"],
        "rows_given_up": ft["rows_given_up"],
        "orphan_parts_removed": len(ft["orphans_removed"]),
        "generated_tokens": metrics.get("generated_tokens"),
    }


def run_clean(model: Path, root: Path, inp: Path, rows: list, args: Any, address: str) -> dict:
    out = root / "clean-out"
    wall = Driver(job_spec(model, str(inp), str(out), args), root, "clean", address).wait()
    metrics = json.loads((out / "metrics.json").read_text())
    return {"faults_injected": [], "wall_s": round(wall, 2), **summary(metrics), **check_output(str(out), rows)}


def run_engine_kills(model: Path, root: Path, inp: Path, rows: list, args: Any, address: str) -> dict:
    out = root / "kills-out"
    driver = Driver(job_spec(model, str(inp), str(out), args), root, "kills", address)
    faults = []
    for share in (0.2, 0.45, 0.7):

        def reached() -> bool:
            return sum(len(r["row_ids"]) for r in local_records(out)) >= share * len(rows)

        wait_until(reached, driver, f"{share:.0%} of the rows committed")
        latest = max(local_records(out), key=lambda r: r["written_at"])
        pid = worker_pid(latest)
        committed = sum(len(r["row_ids"]) for r in local_records(out))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # that replica had just finished: not a fault
            continue
        mine = sum(len(r["row_ids"]) for r in local_records(out) if r["replica"] == latest["replica"])
        faults.append(
            {
                "kill": "engine actor",
                "pid": pid,
                "replica": latest["replica"],
                "rows_committed_at_kill": committed,
                "replica_rows_committed_at_kill": mine,
            }
        )
        # The driver starts a new actor for that replica: wait until it has committed a part,
        # so that every kill hits an actor at work.
        old = engine_pids() | {pid} | {worker_pid(r) for r in local_records(out)}
        wait_until(
            lambda: any(worker_pid(r) not in old for r in local_records(out)), driver, "a part from the next attempt"
        )
    wall = driver.wait()
    for fault in faults:
        # An actor killed just after its replica's last part had no work left: the attempt
        # goes on and nothing is redone (the driver sees no failure for it).
        total = sum(len(r["row_ids"]) for r in local_records(out) if r["replica"] == fault["replica"])
        fault["replica_had_rows_left"] = fault["replica_rows_committed_at_kill"] < total
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "faults_injected": faults,
        "wall_s": round(wall, 2),
        **summary(metrics),
        "replica_writers_overlap": writers_overlap(local_records(out)),
        **check_output(str(out), rows),
    }


def writers_overlap(records: list[dict[str, Any]]) -> bool:
    """Whether two engine actors ever wrote parts of one replica at the same time (an actor
    of a failed attempt still running beside the next attempt's)."""
    spans: dict[tuple[int, str], list[float]] = {}
    for rec in records:
        spans.setdefault((rec["replica"], rec["worker"]), []).append(rec["written_at"])
    by_replica: dict[int, list[tuple[float, float]]] = {}
    for (replica, _), times in spans.items():
        by_replica.setdefault(replica, []).append((min(times), max(times)))
    return any(
        end >= start
        for ranges in by_replica.values()
        for (_, end), (start, _) in zip(sorted(ranges), sorted(ranges)[1:])
    )


def run_driver_kill(model: Path, root: Path, inp: Path, rows: list, args: Any, address: str) -> dict:
    out = root / "driver-out"
    spec = job_spec(model, str(inp), str(out), args)
    before = engine_pids()
    first = Driver(spec, root, "driver-1", address)
    wait_until(
        lambda: sum(len(r["row_ids"]) for r in local_records(out)) >= len(rows) // 2,
        first,
        "half of the rows committed",
    )
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    killed_after = time.perf_counter() - first.started
    deadline = time.time() + 60  # Ray ends the dead driver's actors
    while engine_pids() - before and time.time() < deadline:
        time.sleep(0.1)
    committed = sum(len(r["row_ids"]) for r in local_records(out))
    wall = Driver(spec, root, "driver-2", address).wait()
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "faults_injected": [
            {"kill": "driver", "rows_committed_at_kill": committed, "killed_after_s": round(killed_after, 2)}
        ],
        "wall_s": round(killed_after + wall, 2),
        "rerun_wall_s": round(wall, 2),
        **summary(metrics),
        **check_output(str(out), rows),
    }


def run_s3(model: Path, root: Path, rows: list, args: Any, address: str, fail_every: int, delay_every: int) -> dict:
    import boto3

    from prefixflow.bench.fault_proxy import FaultProxy, start_moto_server
    from prefixflow.storage import StorageOptions

    moto, endpoint = start_moto_server()
    creds = S3Credentials(region="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    try:
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="bench")
        storage = StorageOptions(endpoint_url=endpoint, **creds)
        fs = storage.filesystem("s3://bench")
        for i in range(0, len(rows), 100):
            fs.pipe_file(
                f"s3://bench/in/part-{i:06d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows[i : i + 100]).encode()
            )
        proxy = FaultProxy(endpoint, fail_every=fail_every, delay_every=delay_every, delay_s=0.2)
        try:
            spec = job_spec(
                model,
                "s3://bench/in/",
                "s3://bench/out/",
                args,
                {"endpoint_url": proxy.endpoint, **creds, "max_attempts": 5, "retry_base_delay_s": 0.05},
            )
            wall = Driver(spec, root, f"s3-{fail_every}", address).wait()
        finally:
            proxy.close()
        metrics = json.loads(fs.cat_file("bench/out/metrics.json"))
        return {
            "faults_injected": [
                {
                    "s3_requests": proxy.requests,
                    "answered_503": proxy.failed,
                    "delayed": proxy.delayed,
                    "delay_s": proxy.delay_s,
                }
            ],
            "wall_s": round(wall, 2),
            **summary(metrics),
            **check_output("s3://bench/out/", rows, storage),
        }
    finally:
        moto.terminate()
        moto.wait(timeout=10)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-docs", type=int, default=75)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--rows-per-part", type=int, default=10)
    ap.add_argument("--scenarios", default="clean,engine_kills,driver_kill,s3,flaky_s3")
    ap.add_argument("--out", default=str(RESULTS / "fault_bench.json"))
    args = ap.parse_args(argv)

    import ray

    from prefixflow.jobs.demo import demo_checkpoint, demo_rows

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(key, value)
    root = Path(tempfile.mkdtemp(prefix="fault_bench-"))
    model = demo_checkpoint(root / "model")
    rows = demo_rows(num_docs=args.num_docs, questions_per_doc=args.questions, sentences_per_doc=8, seed=1)
    inp = root / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ray.init(
        address="local",
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    address = ray.get_runtime_context().gcs_address
    runs = {
        "clean": lambda: run_clean(model, root, inp, rows, args, address),
        "engine_kills": lambda: run_engine_kills(model, root, inp, rows, args, address),
        "driver_kill": lambda: run_driver_kill(model, root, inp, rows, args, address),
        "s3": lambda: run_s3(model, root, rows, args, address, fail_every=0, delay_every=0),
        "flaky_s3": lambda: run_s3(model, root, rows, args, address, fail_every=4, delay_every=5),
    }
    scenarios = {}
    for name in args.scenarios.split(","):
        print(f"[fault_bench] {name} ...", flush=True)
        scenarios[name] = {"rows": len(rows), "replicas": args.replicas, **runs[name]()}
        print(json.dumps(scenarios[name]), flush=True)
    ray.shutdown()
    result = {
        "bench": "fault_bench",
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "model": "demo tiny Llama (random weights), CPU",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "scenarios": scenarios,
        "rows_lost_total": sum(s["rows_lost"] for s in scenarios.values()),
        "rows_duplicated_total": sum(s["rows_duplicated"] for s in scenarios.values()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
