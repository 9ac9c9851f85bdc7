"""Commit protocol for output parts: exactly-once output and resume after a failure.

A part becomes visible only when complete: locally (a plain path or file://) it is written to
a temporary name and renamed; on an object store (s3://, gs://, abfss://: any fsspec scheme
whose filesystem is not local) it is one PUT, visible complete or not at all. Right after its
part, the writer puts a commit record `_commits/<part>.json` holding the part's manifest row
and its row ids (both written by `commit_bytes`, which every other file of the output folder
goes through too). A part counts as committed only when its record exists, so on resume:

  - rows named by commit records are skipped (they are in the output already);
  - parts without a record (the job died between the two writes) are deleted, and their rows
    run again; temporary files left by a killed writer are deleted too.

A record also holds its part's size and sha256: a record whose part is missing or has another
size does not count, and its rows run again; a resume also reads every part once and drops the
ones whose content no longer matches (a part damaged or replaced by hand) or that do not hold
exactly the rows their record names (a record edited to claim rows: operators/results/part_rows.py
reads the row ids from the part itself). A record that is not valid JSON, or whose fields do
not have their types, counts as missing too. Names read from a record must be plain part names
of this folder (never a path that leads elsewhere): anything else is refused.

Nothing in the output folder is trusted that a hand could have changed: its bookkeeping files
(`_lock.json`, `_job.json`, the commit records) are read by one strict reader, which names a
damaged file and what to do, and a symbolic link among the names the job reads, writes or
deletes is refused by name, never followed (operators/results/bookkeeping.py).

Fencing: a job's parts are written under its lock (OutputLock). Each writer checks, before a
part, that the lock is still its job's (`check_fence`), and signs its records with the lock's
token; a driver that took the lock over from a dead job drops, before its final count, every
record that the dead job's actors still signed after the takeover (`drop_fenced`).

Part names are fixed by the plan (replica, plan rank of the first row), and the plan of the
same input is the same on a rerun; `_job.json` holds a fingerprint of the spec, the model's
content (prefixflow/model_source.model_fingerprint: a digest of its weight, config and tokenizer
files), the input files (path and size), the input's content (a digest of every column the
output carries) and the plan, so that a rerun over changed input, a changed model or a changed
spec refuses to mix its rows with the old ones.

One job at a time writes to an output path: its `_lock.json` (OutputLock) is taken before
anything is written or deleted there.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixflow.errors import short
from prefixflow.operators.config import INPUT_TABLE_FORMATS
from prefixflow.operators.results.bookkeeping import (
    COMMITS,
    JOB_FIELDS,
    JOB_FILE,
    LOCK_FIELDS,
    LOCK_FILE,
    PART_NAME,
    RECORD_FIELDS,
    TMP_PREFIX,
    Damaged,
    basename,
    check_fields,
    read_bookkeeping,
    read_bookkeeping_files,
    refuse_links,
)
from prefixflow.operators.results.part_rows import holds_rows
from prefixflow.retry import with_retries
from prefixflow.storage import (
    StorageOptions,
    cat_whole,
    io_map,
    is_local,
    is_s3,
    join,
    listed_entries,
    local_path,
    masked,
)

_log = logging.getLogger(__name__)
# How a table input names itself in _job.json's inputs (read_table.TableInput.name).
TABLE_PREFIXES = tuple(f"{fmt}:" for fmt in INPUT_TABLE_FORMATS)
HEARTBEAT_S = 60.0  # how often a running job refreshes its lock
STALE_S = 300.0  # a lock not refreshed for this long belongs to a job that is gone


@dataclass(frozen=True)
class Committed:
    """What earlier runs of this job committed to the output path."""

    row_ids: np.ndarray  # int64, sorted, unique
    manifests: list[dict[str, Any]]
    removed: list[str]  # orphan parts and temporary files deleted

    @property
    def num_rows(self) -> int:
        return int(len(self.row_ids))


def commit_record_path(out: str, part: str) -> str:
    return join(out, COMMITS, f"{part}.json")


def record_bytes(manifest: dict[str, Any], row_ids: list[int]) -> bytes:
    return json.dumps({**manifest, "row_ids": [int(r) for r in row_ids]}).encode("utf-8")


def job_identity(
    planned: Any, num_replicas: int, spec_key: str, inputs: list[list[Any]], model: dict[str, str] | None = None
) -> dict[str, Any]:
    """What a resume must find unchanged, part by part (named in the refusal), and their hash.

    planned: the job's one plan (a PlannedJob); None for a job planned in windows, whose
    windows are checked one by one as they are planned (check_window).
    inputs: input_listing() of the job's input files; model: model_fingerprint() of the model."""
    parts: dict[str, Any] = {
        "spec": hashlib.sha256(spec_key.encode("utf-8")).hexdigest(),
        "model": model or {},
        "inputs": inputs,
    }
    if planned is not None:
        parts["input_content"] = planned.content_digest
        parts["plan"] = plan_digest(planned, num_replicas)
    fingerprint = hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()
    return {"fingerprint": fingerprint, **parts}


def plan_digest(planned: Any, num_replicas: int) -> str:
    """sha256 of a plan's rows, error rows and each replica's order, groups and prefixes (the
    plan table: no token ids fetched)."""
    plan = hashlib.sha256(np.int64(planned.rows.num_rows).tobytes())
    plan.update(np.asarray(planned.error_row_ids, np.int64).tobytes())
    for r in range(num_replicas):
        table = planned.plan.replica_table(r)
        plan.update(np.asarray(table.column("row_id").to_numpy(), np.int64).tobytes())
        plan.update(np.asarray(table.column("group_id").to_numpy(), np.int64).tobytes())
        plan.update(np.asarray(table.column("prefix_len").to_numpy(), np.int64).tobytes())
    return plan.hexdigest()


def check_window(
    out: str,
    identity: dict[str, Any],
    recorded: list[dict[str, Any]],
    window: Any,
    num_replicas: int,
    storage: StorageOptions,
) -> None:
    """A window of a job planned in windows, before any of its rows run: on a resume, refused
    unless it is the window the first run planned (its rows, content and plan; `recorded`: the
    windows in the first run's _job.json, which this extends); then written into _job.json."""
    mine = {
        "first_row": window.rows.first_row,
        "num_rows": window.rows.num_rows,
        "input_content": window.content_digest,
        "plan": plan_digest(window, num_replicas),
    }
    k = int(window.window)
    if k < len(recorded) and recorded[k] != mine:
        was = recorded[k]
        same_rows = (was.get("first_row"), was.get("num_rows")) == (mine["first_row"], mine["num_rows"])
        if same_rows and was.get("input_content") == mine["input_content"]:
            # Same rows, another plan: the plan settings changed, or the planner did (another version).
            raise ValueError(
                f"output.path={masked(out)!r} holds parts of another plan of this input: window {k} is not planned "
                "as the first run planned it (other plan settings, or another version of prefixflow); resume needs "
                "the same plan: run it with the first run's settings and version, or choose a new path or set "
                "output.overwrite: true"
            )
        what = (
            "its content changed"
            if same_rows
            else f"it held rows {was.get('first_row')}.. ({was.get('num_rows')} rows), now {mine['first_row']}.. "
            f"({mine['num_rows']} rows)"
        )
        raise ValueError(
            f"output.path={masked(out)!r} holds parts of a different input: window {k} of the input is not the one "
            f"the first run planned ({what}); resume needs the same input: choose a new path or set "
            "output.overwrite: true"
        )
    recorded[k : k + 1] = [mine]
    commit_bytes(join(out, JOB_FILE), json.dumps({**identity, "windows": recorded}).encode("utf-8"), storage)


def input_listing(files: list[str], storage: StorageOptions) -> list[list[Any]]:
    """[path, size] of each input file, from one listing of each folder (paths masked: no
    password or token is written into _job.json). A changed size names the file in a refused
    resume; any other change of content is caught by the content digest
    (PlannedJob.content_digest). Modification times and ETags are left out on purpose where
    there is a size: a copy of the same data (to another node, or re-uploaded) must still
    resume. An http(s) file is asked for its own (HTTP has no folder listing); a server that
    sends no Content-Length is identified by its ETag or Last-Modified header instead."""
    entries = listed_entries(files, storage)
    return sorted([masked(f), _file_identity(f, e)] for f, e in zip(files, entries))


def _file_identity(path: str, entry: dict[str, Any]) -> int | str:
    """A file's size, else (a server that sends none) its ETag or Last-Modified."""
    if isinstance(entry.get("size"), int):
        return int(entry["size"])
    for header in ("ETag", "Last-Modified"):
        if entry.get(header):
            return f"{header}: {entry[header]}"
    raise ValueError(
        f"input.path: {masked(path)!r} has no size, ETag or Last-Modified (its "
        "server sends none), so a resume could not tell that it changed: serve it "
        "with a Content-Length, or copy it to a folder or object storage"
    )


def load_committed(out: str, storage: StorageOptions, clean: bool = True, verify: bool = False) -> Committed:
    """Read the commit records under `out`; a record counts only when its part is there with the
    recorded size (and, with `verify`, the recorded sha256 and exactly the recorded row ids:
    every part is read once). With `clean`, delete records that do not count, parts that have
    no record, and temporary files. Only clean when no engine actor is writing: a part whose
    record is on its way would be deleted. ValueError when a record names something that is not
    a part of this folder, or when one of the job's names there is a symbolic link."""
    fs = storage.filesystem(out)
    if not fs.exists(out):
        return Committed(np.zeros(0, np.int64), [], [])
    refuse_links(out, fs)
    records, unreadable = _read_records(out, fs)
    # Listed after the records are read: a part is written before its record, so every part
    # whose record was read is in this listing.
    sizes = {basename(e["name"]): int(e["size"]) for e in fs.ls(out, detail=True) if e["type"] == "file"}
    kept = [r for r in records if sizes.get(r["part"], -1) == r.get("bytes", sizes.get(r["part"]))]
    if verify:
        matches = io_map(lambda r: _content_matches(fs, out, r), kept, is_local(out))
        kept = [r for r, ok in zip(kept, matches) if ok]
    names = {r["part"] for r in kept}
    removed = []
    for part in [*(r["part"] for r in records if r["part"] not in names), *unreadable] if clean else []:
        fs.rm(commit_record_path(out, part))  # its rows run again; the record goes before its part
        removed.append(f"{COMMITS}/{part}.json")
    for n in sizes if clean else []:
        if n.startswith(TMP_PREFIX) or (PART_NAME.match(n) and n not in names):
            fs.rm(join(out, n))
            removed.append(n)
    ids = [np.asarray(r.pop("row_ids"), np.int64) for r in kept]
    row_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    unique = np.unique(row_ids)
    if len(unique) != len(row_ids):
        raise RuntimeError(
            f"output.path={masked(out)!r}: a row id is in two committed parts; "
            "the commit records were changed by hand: rerun into a new path"
        )
    return Committed(unique, kept, removed)


def _read_records(out: str, fs: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """(the commit records that read, the part names of those that do not: damaged records,
    whose parts are as good as uncommitted). A record must name its own part
    (`_commits/<part>.json` says part <part>) and that part a plain file here."""
    records_dir = join(out, COMMITS)
    records: list[dict[str, Any]] = []
    unreadable: list[str] = []
    if not fs.exists(records_dir):
        return records, unreadable
    paths = []
    for p in sorted(fs.ls(records_dir, detail=False)):
        name = basename(p)
        if not (name.startswith("part-") and name.endswith(".json")):
            continue
        if not PART_NAME.match(name.removesuffix(".json")):
            raise ValueError(
                f"output.path={masked(out)!r}: {COMMITS}/{name} is not a commit "
                "record this job writes (a part name with a path or odd characters "
                "in it); the folder was changed by hand: rerun into a new path"
            )
        paths.append(p)
    names = [f"{COMMITS}/{basename(p)}" for p in paths]
    for name, record in zip(names, read_bookkeeping_files(fs, paths, {}, names)):
        part = basename(name).removesuffix(".json")
        try:
            if isinstance(record, Damaged):
                raise record
            if record is not None and record.get("part") == part:
                check_fields(record, RECORD_FIELDS, name)
        except Damaged as e:
            _log.warning("%s: %s: its part's rows run again", masked(out), e)
            unreadable.append(part)
            continue
        if record is None:  # deleted since the listing
            continue
        if record.get("part") != part:
            raise ValueError(
                f"output.path={masked(out)!r}: {name} names part "
                f"{short(record.get('part'))}, not {part!r}; the commit records "
                "were changed by hand: rerun into a new path"
            )
        records.append(record)
    return records, unreadable


def _content_matches(fs: Any, out: str, record: dict[str, Any]) -> bool:
    """Whether the part still holds what its writer committed: the recorded sha256 (records of
    an older prefixflow have none) and exactly the rows the record names, read from the part
    itself (the sha256 covers the part, not what the record claims about it)."""
    data = cat_whole(fs, join(out, record["part"]))
    want = record.get("sha256")
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        _log.warning(
            "%s/%s does not match the checksum in its commit record (changed since it was written): its rows run again",
            masked(out),
            record["part"],
        )
        return False
    row_ids = record["row_ids"]
    if record.get("num_rows", len(row_ids)) != len(row_ids) or not holds_rows(record["part"], data, row_ids):
        _log.warning(
            "%s/%s/%s.json names rows that its part does not hold (the record was "
            "changed since it was written): its rows run again",
            masked(out),
            COMMITS,
            record["part"],
        )
        return False
    return True


def check_fence(out: str, storage: StorageOptions, token: str | None) -> None:
    """Before a writer commits a part: the output's lock must still be `token`'s (None: no lock,
    as for the Python API). Raises JobFenced when another job took the path over."""
    if token is None:
        return
    try:
        held = read_bookkeeping(storage.filesystem(out), join(out, LOCK_FILE), LOCK_FIELDS)
    except Damaged:  # changed by hand: not this job's lock any more
        held = None
    if held is None or held.get("token") != token:
        raise JobFenced(
            f"output.path={masked(out)!r} was taken over by another job (its lock "
            "is no longer this job's): this job's writers stop"
        )


class JobFenced(RuntimeError):
    """This job's lock on its output path is gone: another job took the path over."""


def drop_fenced(
    out: str, storage: StorageOptions, token: str, before: Committed, final: Committed
) -> tuple[Committed, list[str]]:
    """`final` (this job's last read of the commit records) without the parts a job other than
    `token`'s committed since `before`: a dead job's actor that committed after this job took
    its lock over. Their records (then the parts) are deleted; this job ran every row that
    `before` did not hold, so nothing is lost. Returns the counted parts and the names dropped."""
    old = {m["part"] for m in before.manifests}
    fenced = [m["part"] for m in final.manifests if m["part"] not in old and m.get("writer") not in (None, token)]
    if not fenced:
        return final, []
    fs = storage.filesystem(out)
    for part in fenced:
        fs.rm(commit_record_path(out, part))
        if fs.exists(join(out, part)):
            fs.rm(join(out, part))
    return load_committed(out, storage), fenced


def commit_bytes(path: str, data: bytes, storage: StorageOptions) -> None:
    """Make `path` hold `data`, all or nothing, retrying transient storage errors."""
    with_retries(lambda: _put(path, data, storage), f"write {masked(path)}", storage.retry)


def _put(path: str, data: bytes, storage: StorageOptions) -> None:
    fs = storage.filesystem(path)
    if not is_local(path):
        fs.pipe_file(path, data)  # one PUT: visible complete or not at all
        return
    head, name = os.path.split(local_path(path))
    fs.makedirs(head, exist_ok=True)
    # Same directory (atomic rename on POSIX); the prefix keeps readers from taking it for a part.
    tmp = os.path.join(head, f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def check_job_file(out: str, identity: dict[str, Any], storage: StorageOptions, resume: bool) -> dict[str, Any] | None:
    """Write `_job.json` (job_identity()), or on resume check that it is the same job and input
    and return the first run's (whose windows check_window checks)."""
    fs = storage.filesystem(out)
    path = join(out, JOB_FILE)
    old = (
        read_job_file(
            out,
            fs,
            "this cannot be checked to be the same job: choose a new path, "
            "or set output.overwrite: true to start again",
        )
        if resume
        else None
    )
    if old is not None:
        if old["fingerprint"] != identity["fingerprint"]:
            raise ValueError(
                f"output.path={masked(out)!r} holds parts of a different job or "
                f"input: {_what_changed(old, identity)}; resume needs the same spec "
                "and input: choose a new path or set output.overwrite: true"
            )
        return old
    commit_bytes(path, json.dumps(identity).encode("utf-8"), storage)
    return None


def read_job_file(out: str, fs: Any, fix: str) -> dict[str, Any] | None:
    """`out`'s _job.json (None when there is none); ValueError naming it, and `fix`, when it is
    not one that prefixflow wrote (not JSON, no sha256 fingerprint, a link)."""
    try:
        return read_bookkeeping(fs, join(out, JOB_FILE), JOB_FIELDS)
    except Damaged as e:
        raise ValueError(f"output.path={masked(out)!r}: its {e}, so {fix}") from None


def _what_changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    if "spec" not in old:
        return f"its {JOB_FILE} was written by an older prefixflow, whose fingerprint covers less"
    if old["spec"] != new["spec"]:
        return "the spec changed since the first run"
    if old.get("model") != new["model"]:
        return _model_changed(old.get("model") or {}, new["model"])
    if old.get("inputs") != new["inputs"]:
        table = _table_changed(old.get("inputs") or [], new["inputs"])
        if table:
            return table
        before = {f[0]: f for f in old.get("inputs") or []}
        changed = [f[0] for f in new["inputs"] if before.pop(f[0], None) != f] + sorted(before)
        return (
            f"input files changed since the first run (size or modification time): "
            f"{', '.join(changed[:5]) or 'the list of files'}"
        )
    if ("plan" in old) != ("plan" in new):  # one planned whole (its plan digest), one in windows
        was, now = ("whole", "in windows") if "plan" in old else ("in windows", "whole")
        fix = (
            "set window_rows: 0 to plan it whole as it did (a spec that leaves window_rows unset plans "
            "an input of more than 4,000,000 rows in windows)"
            if "plan" in old
            else "set window_rows as it was, or leave it unset as it was"
        )
        return f"the first run planned the job {was} and this run plans it {now}: {fix}"
    if old.get("input_content") != new.get("input_content"):
        return "the input's content changed since the first run"
    return "the plan differs from the first run's"


def _table_changed(old: list[list[Any]], new: list[list[Any]]) -> str | None:
    """The message for a table input read at another version than the first run's (inputs of
    one [table name, version] entry: operators/stages/read_table.TableInput.identity)."""
    if len(old) != 1 or len(new) != 1 or old[0][0] != new[0][0] or not str(new[0][0]).startswith(TABLE_PREFIXES):
        return None
    name, was, now = new[0][0], old[0][1], new[0][1]
    return (
        f"this run reads the table {name} at version {now}, and the first run read version {was}: set "
        f"input.version: {was} to finish the first run's rows on the table as it read it (rows added since are "
        f"not in it), or run version {now} into a new output path"
    )


def _model_changed(old: dict[str, str], new: dict[str, str]) -> str:
    if not old:
        return "the first run recorded no model fingerprint (an older prefixflow)"
    changed = sorted(n for n in old.keys() | new.keys() if old.get(n) != new.get(n))
    return f"the model's files changed since the first run ({', '.join(changed[:5])}): its answers would mix two models"


class OutputLock:
    """`_lock.json`: one job at a time on an output path (two would replace each other's parts).

    Taken atomically before anything is written or deleted there (locally a hard link, which
    fails when the name exists; on S3 a PUT with If-None-Match: *; on other object stores
    fsspec's exclusive create, atomic where the driver offers one, else a check then a PUT:
    a job that lost such a race is stopped by fencing before its first part), refreshed by a
    thread while the job runs, deleted at the end, success or failure. A lock whose holder is
    gone (on this host and its pid dead, or no heartbeat for STALE_S) is taken over, so that a
    rerun after a killed driver needs no wait.
    """

    def __init__(self, out: str, storage: StorageOptions):
        self.out, self.storage, self.path = out, storage, join(out, LOCK_FILE)
        now = time.time()
        self.holder: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": now,
            "heartbeat": now,
            "token": uuid.uuid4().hex,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> OutputLock:
        if not self._create():
            held = self._read()
            mine = held is not None and held.get("token") == self.holder["token"]
            if not mine:  # (mine: a retried PUT whose first try got through)
                self._take_over(held)
        self._thread = threading.Thread(target=self._beat, name="prefixflow-lock", daemon=True)
        self._thread.start()
        return self

    def _take_over(self, held: dict[str, Any] | None) -> None:
        if held is not None and not _stale(held):
            raise ValueError(
                f"output.path={masked(self.out)!r} is in use by another job "
                f"({_describe(held)}): wait for it to end, or choose another path"
            )
        self._remove(held)  # its holder is gone
        if not self._create():
            raise ValueError(
                f"output.path={masked(self.out)!r} is in use by another job "
                f"({_describe(self._read())}): wait for it to end, or choose "
                "another path"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._remove(self.holder)
        except Exception as e:  # noqa: BLE001 - storage down: keep the job's own error; a rerun takes it over
            _log.warning(
                "could not delete %s (%s): the next job on this path takes it over "
                "(at once on this host, else after %.0f s)",
                self.path,
                e,
                STALE_S,
            )

    def _create(self) -> bool:
        """Create the lock file holding self.holder; False when it exists."""
        data = json.dumps(self.holder).encode("utf-8")
        fs = self.storage.filesystem(self.out)
        try:
            if is_s3(self.path):
                bucket, key, _ = fs.split_path(self.path)
                fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
            if not is_local(self.path):
                _create_object(fs, self.path, data)
                return True
            os.makedirs(local_path(self.out), exist_ok=True)
            _link_new(self._local_tmp(data), local_path(self.path), data)
            return True
        except FileExistsError:  # s3fs raises it for 412 Precondition Failed
            return False

    def _local_tmp(self, data: bytes) -> str:
        # Hidden, not TMP_PREFIX: load_committed's cleaning must not take it for a part's.
        tmp = os.path.join(local_path(self.out), f".{LOCK_FILE}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp

    def _read(self) -> dict[str, Any] | None:
        try:
            return read_bookkeeping(self.storage.filesystem(self.out), self.path, LOCK_FIELDS)
        except Damaged as e:
            raise ValueError(
                f"output.path={masked(self.out)!r}: its {e}, so it is not a lock "
                f"prefixflow took: if no job is writing to this path, delete "
                f"{masked(self.path)} and run again"
            ) from None

    def _remove(self, held: dict[str, Any] | None) -> None:
        """Delete the lock if it still is `held` (not someone's who took it over meanwhile)."""
        current = self._read()
        if held is not None and current is not None and current.get("token") == held.get("token"):
            try:
                self.storage.filesystem(self.out).rm(self.path)
            except FileNotFoundError:
                pass

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (self._read() or {}).get("token") != self.holder["token"]:
                    return  # taken over (this job looked dead): leave the new holder's lock alone
                self.holder["heartbeat"] = time.time()
                data = json.dumps(self.holder).encode("utf-8")
                if not is_local(self.path):
                    self.storage.filesystem(self.out).pipe_file(self.path, data)
                else:
                    os.replace(self._local_tmp(data), local_path(self.path))
            except Exception as e:  # noqa: BLE001 - a missed beat is only late: STALE_S leaves room for many
                _log.debug(
                    "output lock %s: a heartbeat failed (%s: %s); the next one is in %s s",
                    self.path,
                    type(e).__name__,
                    e,
                    HEARTBEAT_S,
                )


def _create_object(fs: Any, path: str, data: bytes) -> None:
    """Write `path` on an object store unless it exists (FileExistsError)."""
    try:
        fs.pipe_file(path, data, mode="create")
    except TypeError:  # a driver older than fsspec's `mode`: check, then write
        if fs.exists(path):
            raise FileExistsError(path) from None
        fs.pipe_file(path, data)


def _link_new(tmp: str, path: str, data: bytes) -> None:
    """Give the complete file `tmp` the name `path` unless that exists (FileExistsError); `tmp`
    is removed. A hard link is atomic; file systems without hard links (some FUSE mounts, such
    as /dbfs) get an exclusive create instead, which a reader may see empty for a moment."""
    try:
        os.link(tmp, path)  # atomic, and fails when the lock exists
    except FileExistsError:
        raise
    except OSError:
        with open(path, "xb") as f:
            f.write(data)
    finally:
        os.unlink(tmp)


def _stale(held: dict[str, Any]) -> bool:
    """Whether the holder of a lock (read_bookkeeping: every field typed) is gone."""
    if held["host"] == socket.gethostname() and not _pid_alive(held["pid"]):
        return True
    return time.time() - held["heartbeat"] > STALE_S


def _pid_alive(pid: int) -> bool:
    if not 0 < pid < 2**31:  # os.kill(0 or -1, ...) asks about process groups; no pid is larger
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _describe(held: dict[str, Any] | None) -> str:
    if held is None:
        return "its lock just changed hands"
    age = time.time() - held["heartbeat"]
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["started"]))
    except (OverflowError, OSError, ValueError):  # a time no calendar holds
        started = short(held["started"])
    return (
        f"{LOCK_FILE} held by host {held['host'][:100]} pid {held['pid']}, started "
        f"{started}, last heartbeat {age:.0f} s ago"
    )
