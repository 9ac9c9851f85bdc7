"""Resume and exactly-once safety: what a rerun on an existing output path may trust.

- a commit record counts only when its part is there with the recorded size;
- the fingerprint covers the input's content, not only the prompts and counts;
- resume never deletes files of a folder that holds no prefixflow job, nor with overwrite;
- one job at a time on an output path (`_lock.json`); a dead job's lock is taken over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.commit import (
    LOCK_FILE,
    STALE_S,
    OutputLock,
    commit_bytes,
    commit_record_path,
    load_committed,
    record_bytes,
)
from prefixflow.operators.results.write import WriteOptions, prepare_output, read_output
from prefixflow.storage import StorageOptions

TEMPLATE = "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"
JOB_TIMEOUT_S = 300


def _rows(n: int = 12, tag: str = "a") -> list[dict]:
    return [{"id": i, "tag": tag, "document": f"doc {i % 3} tells a story", "question": f"why {i}?"} for i in range(n)]


def _spec_dict(root: Path, model: Path, rows: list[dict], **output) -> dict:
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": str(model),
        "input": {"path": str(root / "in.jsonl")},
        "prompt": {"template": TEMPLATE},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
        "output": {"path": str(root / "out"), "format": "jsonl", "rows_per_part": 4, **output},
    }


def _resume(spec: dict) -> object:
    return parse_spec({**spec, "output": {**spec["output"], "resume": True}})


# -- commit records and their parts (no Ray) ------------------------------------------------


def _commit(out: Path, part: str, data: bytes, rows: list[int]) -> None:
    commit_bytes(str(out / part), data, StorageOptions())
    manifest = {"part": part, "replica": 0, "num_rows": len(rows), "bytes": len(data)}
    commit_bytes(commit_record_path(str(out), part), record_bytes(manifest, rows), StorageOptions())


def test_a_record_counts_only_with_its_part_at_the_recorded_size(tmp_path):
    _commit(tmp_path, "part-r000-000000000.jsonl", b"0\n1\n", [0, 1])
    _commit(tmp_path, "part-r000-000000002.jsonl", b"2\n3\n", [2, 3])
    _commit(tmp_path, "part-r000-000000004.jsonl", b"4\n5\n", [4, 5])
    (tmp_path / "part-r000-000000002.jsonl").unlink()  # deleted by hand
    (tmp_path / "part-r000-000000004.jsonl").write_bytes(b"4\n")  # damaged by hand
    seen = load_committed(str(tmp_path), StorageOptions(), clean=False)
    assert seen.row_ids.tolist() == [0, 1] and not seen.removed
    done = load_committed(str(tmp_path), StorageOptions())
    assert done.row_ids.tolist() == [0, 1]
    assert sorted(done.removed) == [
        "_commits/part-r000-000000002.jsonl.json",
        "_commits/part-r000-000000004.jsonl.json",
        "part-r000-000000004.jsonl",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_commits", "part-r000-000000000.jsonl"]


# -- what resume and overwrite may delete (no Ray) ------------------------------------------


def test_resume_refuses_a_folder_without_a_prefixflow_job(tmp_path):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"someone else's")
    opts = WriteOptions(path=str(out), format="parquet")
    with pytest.raises(ValueError, match="holds no prefixflow job.*choose a new path"):
        prepare_output(opts, overwrite=False, resume=True)
    assert (out / "part-00000.parquet").read_bytes() == b"someone else's"
    for fresh in (tmp_path / "missing", tmp_path / "empty"):  # nothing there: starts fresh
        if fresh.name == "empty":
            fresh.mkdir()
        prepare_output(WriteOptions(path=str(fresh), format="parquet"), overwrite=False, resume=True)
        assert fresh.is_dir()


def test_overwrite_and_resume_together_are_refused(tmp_path):
    (tmp_path / "_job.json").write_text("{}")
    (tmp_path / "part-r000-000000000.parquet").write_bytes(b"committed")
    with pytest.raises(ValueError, match="output.overwrite=True and output.resume=True"):
        prepare_output(WriteOptions(path=str(tmp_path), format="parquet"), overwrite=True, resume=True)
    assert (tmp_path / "part-r000-000000000.parquet").exists()


# -- the output lock (no Ray) ---------------------------------------------------------------


def _lock_path(out: str) -> str:
    return out.rstrip("/") + "/" + LOCK_FILE


@pytest.mark.parametrize("where", ["local", "s3"])
def test_one_job_at_a_time_holds_an_output_path(where, tmp_path, request):
    if where == "s3":
        import boto3

        endpoint = request.getfixturevalue("s3_server")
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="locks")
        out, storage = f"s3://locks/{tmp_path.name}/out", StorageOptions(endpoint_url=endpoint)
    else:
        out, storage = str(tmp_path / "out"), StorageOptions()
    fs = storage.filesystem(out)
    first = OutputLock(out, storage).acquire()
    with pytest.raises(ValueError, match=f"in use by another job .*pid {os.getpid()}"):
        OutputLock(out, storage).acquire()
    first.release()
    assert not fs.exists(_lock_path(out))
    # Gone holders are taken over: a dead pid on this host, or a heartbeat too old.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for held in (
        {"host": os.uname().nodename, "pid": dead.pid, "heartbeat": time.time()},
        {"host": "elsewhere", "pid": 1, "heartbeat": time.time() - STALE_S - 1},
    ):
        fs.pipe_file(_lock_path(out), json.dumps({**held, "started": 0, "token": "old"}).encode())
        lock = OutputLock(out, storage).acquire()
        assert json.loads(fs.cat_file(_lock_path(out)))["token"] == lock.holder["token"]
        lock.release()
    # A live holder elsewhere, with a fresh heartbeat, is not.
    fs.pipe_file(
        _lock_path(out),
        json.dumps({"host": "elsewhere", "pid": 1, "started": 0, "heartbeat": time.time(), "token": "live"}).encode(),
    )
    with pytest.raises(ValueError, match="host elsewhere pid 1"):
        OutputLock(out, storage).acquire()


# -- whole jobs -----------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_refuses_an_input_whose_content_changed(ray_local, tiny_model, tmp_path):
    spec = _spec_dict(tmp_path, tiny_model, _rows())
    run_job(parse_spec(spec), quiet=True)
    out, inp = tmp_path / "out", tmp_path / "in.jsonl"
    before = sorted(p.name for p in out.iterdir())
    # Only content counts: the same bytes with a new modification time (a copy to another node,
    # a re-upload) resume.
    os.utime(inp, (inp.stat().st_atime + 3600, inp.stat().st_mtime + 3600))
    assert run_job(_resume(spec), quiet=True)["fault_tolerance"]["rows_written"] == 0
    stat = inp.stat()
    # The same prompts and size, another value in a column that is not in the prompt.
    inp.write_text(inp.read_text().replace('"tag": "a"', '"tag": "b"', 1))
    os.utime(inp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert inp.stat().st_size == stat.st_size
    with pytest.raises(ValueError, match="the input's content changed"):
        run_job(_resume(spec), quiet=True)
    with inp.open("a") as f:  # one more row: the size names the file
        f.write(json.dumps({"id": 999, "q": "one more", "tag": "c"}) + "\n")
    with pytest.raises(ValueError, match=f"input files changed .*{inp.name}"):
        run_job(_resume(spec), quiet=True)
    assert sorted(p.name for p in out.iterdir()) == before  # a refused resume deletes nothing


def _driver_spec(root: Path, model: Path, rows: int) -> Path:
    spec = _spec_dict(root, model, _rows(rows), resume=True)
    spec["engine"]["max_num_seqs"] = 2  # rows finish one after another: the job runs a while
    (root / "job.yaml").write_text(yaml.safe_dump(spec))
    return root / "job.yaml"


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + JOB_TIMEOUT_S
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.log_path.read_text()[-3000:]
        time.sleep(0.02)


@pytest.mark.slow
def test_a_second_job_is_refused_and_a_killed_drivers_lock_is_taken_over_by_the_resume(
    ray_local, start_driver, tiny_model, tmp_path
):
    """One output path: while a job holds it, a second job on it is refused, naming the holder;
    the holder SIGKILLed leaves its lock behind, and the resume takes the lock over, finishes
    every row once and releases it."""
    job = _driver_spec(tmp_path, tiny_model, 12)
    out = tmp_path / "out"
    first = start_driver(job)
    _wait_for(out / LOCK_FILE, first)
    second = start_driver(job)
    assert second.wait(timeout=JOB_TIMEOUT_S) != 0
    log = second.log_path.read_text()
    assert "is in use by another job" in log and f"pid {first.pid}" in log
    assert first.poll() is None, "the first job ended before it could be killed holding its lock"
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == first.pid  # left behind
    rerun = start_driver(job)
    assert rerun.wait(timeout=JOB_TIMEOUT_S) == 0, rerun.log_path.read_text()[-3000:]
    # RAY_ADDRESS named the session's cluster: the run joined it and said so.
    address = ray_local.get_runtime_context().gcs_address
    assert f"Ray: joined the cluster at {address}: 1 node(s)" in rerun.log_path.read_text()
    assert sorted(r["id"] for r in read_output(str(out))) == list(range(12))
    assert not (out / LOCK_FILE).exists()


def test_a_running_job_refreshes_its_lock(tmp_path, monkeypatch):
    import prefixflow.operators.results.commit as commit

    monkeypatch.setattr(commit, "HEARTBEAT_S", 0.05)  # the interval only, not the lock
    lock = OutputLock(str(tmp_path), StorageOptions()).acquire()
    first = json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"]
    deadline = time.time() + 30
    while json.loads((tmp_path / LOCK_FILE).read_text())["heartbeat"] == first:
        assert time.time() < deadline, "the heartbeat was never refreshed"
        time.sleep(0.02)
    lock.release()
    assert list(tmp_path.iterdir()) == []
