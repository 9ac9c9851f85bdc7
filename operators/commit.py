"""Commit protocol for output parts: exactly-once output and resume after a failure.

A part becomes visible only when complete: locally it is written to a temporary name and
renamed, on S3 it is one PUT. Right after its part, the writer puts a commit record
`_commits/<part>.json` holding the part's manifest row and its row ids. A part counts as
committed only when its record exists, so on resume:

  - rows named by commit records are skipped (they are in the output already);
  - parts without a record (the job died between the two writes) are deleted, and their rows
    run again; temporary files left by a killed writer are deleted too.

Part names are fixed by the plan (replica, plan rank of the first row), and the plan of the
same input is the same on a rerun; `_job.json` holds a fingerprint of the plan so that a
rerun over changed input or a changed spec refuses to mix its rows with the old ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixflow.operators.storage import StorageOptions, join

COMMITS = "_commits"
JOB_FILE = "_job.json"
MANIFEST = "_manifest.json"  # written last by the driver: every committed part and row id
TMP_PREFIX = "_tmp-"


@dataclass(frozen=True)
class Committed:
    """What earlier runs of this job committed to the output path."""

    row_ids: np.ndarray          # int64, sorted, unique
    manifests: list[dict[str, Any]]
    removed: list[str]           # orphan parts and temporary files deleted

    @property
    def num_rows(self) -> int:
        return int(len(self.row_ids))


def commit_record_path(out: str, part: str) -> str:
    return join(out, COMMITS, f"{part}.json")


def record_bytes(manifest: dict[str, Any], row_ids: list[int]) -> bytes:
    return json.dumps({**manifest, "row_ids": [int(r) for r in row_ids]}).encode("utf-8")


def plan_fingerprint(planned: Any, num_replicas: int, spec_key: str) -> str:
    """Same input, same spec -> same rows in the same parts; anything else -> a new value."""
    h = hashlib.sha256(spec_key.encode("utf-8"))
    h.update(np.int64(planned.rows.num_rows).tobytes())
    h.update(np.asarray(planned.error_row_ids, np.int64).tobytes())
    for r in range(num_replicas):
        for g in planned.plan.groups(r):
            h.update(np.asarray(g.row_ids, np.int64).tobytes())
            h.update(np.int64(g.prefix_len).tobytes())
    return h.hexdigest()


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def load_committed(out: str, storage: StorageOptions, clean: bool = True) -> Committed:
    """Read the commit records under `out`; with `clean`, delete parts that have none and
    temporary files. Only clean when no engine actor is writing: a part whose record is on its
    way would be deleted."""
    fs = storage.filesystem(out)
    if not fs.exists(out):
        return Committed(np.zeros(0, np.int64), [], [])
    records_dir = join(out, COMMITS)
    records = []
    if fs.exists(records_dir):
        for p in sorted(fs.ls(records_dir, detail=False)):
            if _name(p).startswith("part-") and _name(p).endswith(".json"):
                records.append(json.loads(fs.cat_file(p)))
    names = {r["part"] for r in records}
    removed = []
    for p in fs.ls(out, detail=False) if clean else []:
        n = _name(p)
        if n.startswith(TMP_PREFIX) or (n.startswith("part-") and n not in names):
            fs.rm(p)
            removed.append(n)
    ids = [np.asarray(r.pop("row_ids"), np.int64) for r in records]
    row_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    unique = np.unique(row_ids)
    assert len(unique) == len(row_ids), "a row id is in two committed parts"
    return Committed(unique, records, removed)


def check_job_file(out: str, fingerprint: str, storage: StorageOptions, resume: bool) -> None:
    """Write `_job.json`, or on resume check that it belongs to the same job and plan."""
    fs = storage.filesystem(out)
    path = join(out, JOB_FILE)
    if resume and fs.exists(path):
        old = json.loads(fs.cat_file(path)).get("fingerprint")
        if old != fingerprint:
            raise ValueError(f"output.path={out!r} holds parts of a different job or input (plan "
                             "fingerprint differs): resume needs the same spec and input; choose "
                             "a new path or set output.overwrite: true")
        return
    from prefixflow.operators.write import commit_bytes

    commit_bytes(path, json.dumps({"fingerprint": fingerprint}).encode("utf-8"), storage)
