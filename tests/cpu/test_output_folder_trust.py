"""What a job may trust in its output folder, round three (issue 43, items 2, 6, 7 and 13):

- a commit record's row ids are proved from its part (parquet, jsonl and OpenAI lines): a
  record that claims rows its part does not hold is dropped and its rows run again, so the
  manifest never claims rows that the parts do not hold;
- a symbolic link under one of the job's names (`_commits`, a record, a part, `_job.json`,
  `_lock.json`) is refused by name, never followed: nothing outside the folder is touched;
- overwrite deletes only a prefixflow job's own files (its exact part names, records and
  bookkeeping), and nothing in a folder whose `_job.json` prefixflow did not write;
- `_lock.json`, `_job.json` and commit records are read by one strict reader: a damaged one is
  named with what to do, never a traceback or "in use by another job" forever.

All but one test run without Ray, on real files; the whole-job case runs on the session's real
local Ray.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.commit import (
    COMMITS,
    JOB_FILE,
    LOCK_FILE,
    JobFenced,
    OutputLock,
    check_fence,
    check_job_file,
    load_committed,
)
from prefixflow.operators.results.write import WriteOptions, prepare_output, read_output
from prefixflow.storage import StorageOptions
from support.output_folders import FORMATS, committed_job, record, snapshot

# -- item 2: a record's row ids are proved from its part -----------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_record_that_claims_rows_its_part_does_not_hold_is_dropped(tmp_path, fmt):
    out = tmp_path / "out"
    a, b, c = committed_job(out, fmt, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    # The hand: part b and its record deleted, b's row ids appended to a's record (a's
    # part and its sha256 untouched).
    (out / b).unlink()
    record(out, b).unlink()
    moved = json.loads(record(out, a).read_text())
    moved["row_ids"] += [3, 4, 5]
    record(out, a).write_text(json.dumps(moved))
    seen = load_committed(str(out), StorageOptions(), clean=False, verify=True)
    assert seen.row_ids.tolist() == [6, 7, 8]  # rows 0-5 run again; 3-5 are never claimed
    done = load_committed(str(out), StorageOptions(), verify=True)
    assert done.row_ids.tolist() == [6, 7, 8] and f"{COMMITS}/{a}.json" in done.removed
    assert sorted(p.name for p in out.glob("part-*")) == [c]  # a's part went with its record
    # The rows the parts hold are exactly the rows counted, once each.
    got = read_output(str(out))
    held = (
        got.column("row_id").to_pylist()
        if isinstance(got, pa.Table)
        else [r.get("row_id", r.get("custom_id")) for r in got]
    )
    assert held in ([6, 7, 8], ["req-6", "req-7", "req-8"])


def test_a_record_whose_rows_were_swapped_or_recounted_is_dropped(tmp_path):
    out = tmp_path / "out"
    a, b = committed_job(out, "jsonl", [[0, 1], [2, 3]])
    swapped = json.loads(record(out, a).read_text())
    swapped["row_ids"] = [1, 0]  # the same rows, claimed in another order
    record(out, a).write_text(json.dumps(swapped))
    recounted = json.loads(record(out, b).read_text())
    recounted["num_rows"] = 5  # a count the row ids do not have
    record(out, b).write_text(json.dumps(recounted))
    assert load_committed(str(out), StorageOptions(), verify=True).num_rows == 0


@pytest.mark.slow
def test_a_resume_after_ids_moved_between_records_writes_every_row_once(ray_local, tiny_model, tmp_path):
    """The issue's exact case, as a whole job: exit 0 and _SUCCESS, and the manifest claims
    exactly the rows the parts hold (it said 40 while the parts held 32)."""
    rows = [{"id": i, "document": f"doc {i % 3}", "question": f"why {i}?"} for i in range(12)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "model": str(tiny_model),
        "input": {"path": str(tmp_path / "in.jsonl")},
        "prompt": {"template": "{{ document }}: {{ question }}"},
        "sampling": {"temperature": 0, "max_tokens": 2},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
        "output": {"path": str(tmp_path / "out"), "format": "jsonl", "rows_per_part": 4},
    }
    run_job(parse_spec(spec), quiet=True)
    out = tmp_path / "out"
    first, second = sorted(p.name for p in out.glob("part-r*"))[:2]
    moved = json.loads(record(out, second).read_text())["row_ids"]
    (out / second).unlink()
    record(out, second).unlink()
    claim = json.loads(record(out, first).read_text())
    record(out, first).write_text(json.dumps({**claim, "row_ids": claim["row_ids"] + moved}))
    metrics = run_job(parse_spec({**spec, "output": {**spec["output"], "resume": True}}), quiet=True)
    got = read_output(str(out))
    assert sorted(r["id"] for r in got) == list(range(12))  # every row once
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["num_rows"] == len(got) == 12
    assert sorted(manifest["row_ids"]) == sorted(r["row_id"] for r in got)
    assert metrics["fault_tolerance"]["rows_committed_before"] == 12 - len(claim["row_ids"]) - len(moved)
    assert (out / "_SUCCESS").exists()


# -- item 6: links in the output folder are refused by name --------------------------------


@pytest.mark.parametrize(
    "name", [COMMITS, "part-r000-000000000.jsonl", JOB_FILE, "_SUCCESS", f"{COMMITS}/part-r000-000000000.jsonl.json"]
)
def test_a_link_in_the_output_folder_is_refused_by_name(tmp_path, name):
    """A resume or overwrite through `_commits` -> another job's records deleted and rewrote
    them; any of the job's names as a link is now refused, and nothing it points to changes."""
    other, out = tmp_path / "other", tmp_path / "out"
    committed_job(other, "jsonl", [[0, 1], [2, 3]])
    committed_job(out, "jsonl", [[0, 1]])
    (other / "part-r000-000000002.jsonl").write_bytes(b"another job's part, damaged")
    target = out / name
    if target.is_dir():
        import shutil

        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    target.symlink_to(other / name)
    before = snapshot(tmp_path, out)
    shown = name.split("/")[-1] if "/" in name else name
    for step in (
        lambda: load_committed(str(out), StorageOptions(), verify=True),
        lambda: prepare_output(WriteOptions(path=str(out), format="jsonl"), overwrite=True),
        lambda: prepare_output(WriteOptions(path=str(out), format="jsonl"), overwrite=False, resume=True),
    ):
        with pytest.raises(ValueError, match=rf"{shown} is a symbolic link .*remove the link"):
            step()
    assert snapshot(tmp_path, out) == before and target.is_symlink()


def test_a_lock_that_is_a_link_is_refused_by_name(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_FILE).write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(other / LOCK_FILE)
    with pytest.raises(ValueError, match=r"its _lock.json is a symbolic link .*delete .*_lock.json"):
        OutputLock(str(out), StorageOptions()).acquire()
    assert (other / LOCK_FILE).read_text() == "{}"


# -- item 7: overwrite deletes only the job's own files -------------------------------------


def test_overwrite_refuses_a_job_file_that_prefixflow_did_not_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / JOB_FILE).write_text(json.dumps({"tool": "another", "run": 3}))
    (out / "part-r000-000000000.parquet").write_bytes(b"a user's own file")
    (out / "part-00000.parquet").write_bytes(b"another user's file")
    with pytest.raises(
        ValueError,
        match=r"its _job.json has no 'fingerprint' field.*not one "
        r"prefixflow wrote.*choose a new path",
    ):
        prepare_output(WriteOptions(path=str(out), format="parquet"), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [JOB_FILE, "part-00000.parquet", "part-r000-000000000.parquet"]


def test_overwrite_deletes_the_job_files_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    committed_job(out, "parquet", [[0, 1], [2, 3]])
    for name in ("_SUCCESS", "metrics.json", "_manifest.json"):
        (out / name).write_text("{}")
    mine = {
        "part-00000.parquet": b"spark's part",
        "part-r0-1.parquet": b"not our name",
        "notes.txt": b"mine",
        f"{COMMITS}/README": b"my notes on the records",
    }
    for name, data in mine.items():
        (out / name).write_bytes(data)
    prepare_output(WriteOptions(path=str(out), format="parquet"), overwrite=True)
    left = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert left == mine


# -- item 13: one strict reader for bookkeeping files ---------------------------------------


@pytest.mark.parametrize(
    "text, why",
    [
        ("[]", "holds a JSON list"),
        ("null", "holds null"),
        ('"x"', "holds a JSON str"),
        ('{"pid": "abc"}', "has no 'host' field"),
        ('{"host": "h", "pid": "abc", "started": 0, "heartbeat": 0, "token": "t"}', "has pid='abc'"),
        ('{"host": "h", "pid": 1, "started": 0, "heartbeat": "now", "token": "t"}', "has heartbeat='now'"),
        ("{not json", "is not valid JSON"),
    ],
)
def test_a_damaged_lock_is_named_with_what_to_do(tmp_path, text, why):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_text(text)
    with pytest.raises(ValueError) as caught:
        OutputLock(str(out), StorageOptions()).acquire()
    message = str(caught.value)
    assert type(caught.value) is ValueError and f"its {LOCK_FILE} {why}" in message, message
    assert f"delete {out / LOCK_FILE} and run again" in message and "in use" not in message
    with pytest.raises(JobFenced, match="taken over"):  # a writer stops: the lock is not its own
        check_fence(str(out), StorageOptions(), "token")
    (out / LOCK_FILE).unlink()  # what the message says to do
    OutputLock(str(out), StorageOptions()).acquire().release()


def test_a_lock_that_is_a_folder_is_named(tmp_path):
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(ValueError, match=r"its _lock.json is a folder"):
        OutputLock(str(tmp_path), StorageOptions()).acquire()


@pytest.mark.parametrize(
    "text, why", [('{"fingerprint": 5}', "has fingerprint=5"), ("[]", "holds a JSON list"), ("null", "holds null")]
)
def test_a_damaged_job_file_is_named_on_resume(tmp_path, text, why):
    (tmp_path / JOB_FILE).write_text(text)
    with pytest.raises(ValueError, match=rf"its _job.json {why}.*cannot be checked to be the same job"):
        check_job_file(str(tmp_path), {"fingerprint": "ab" * 32}, StorageOptions(), resume=True)


def test_records_with_fields_of_the_wrong_type_count_as_missing(tmp_path):
    out = tmp_path / "out"
    a, b, c = committed_job(out, "jsonl", [[0], [1], [2]])
    for part, change in ((a, {"row_ids": "0"}), (b, {"bytes": "12"}), (c, {"row_ids": [2**70]})):
        record(out, part).write_text(json.dumps({**json.loads(record(out, part).read_text()), **change}))
    done = load_committed(str(out), StorageOptions(), verify=True)  # never a numpy or type error
    assert done.num_rows == 0 and not list(out.glob("part-*"))


def test_the_lock_never_follows_a_pid_no_system_has(tmp_path):
    held = {"host": os.uname().nodename, "pid": 2**70, "started": 0, "heartbeat": 0, "token": "t"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(held))
    OutputLock(str(tmp_path), StorageOptions()).acquire().release()  # its holder is gone: taken over
