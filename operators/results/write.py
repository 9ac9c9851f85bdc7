"""Write stage: output blocks -> committed part files, local or a URL, plus metrics.json.

A part is named after its first row's (replica, rank), which the plan fixes, so a retried
write task writes the same name again: each row lands in exactly one part. Local parts are
written to a temporary name and renamed; an object store's PUT (s3://, gs://, abfss://, ...)
is atomic by itself. After each part its commit record is written (operators/results/commit.py: what
makes resume exactly-once). The driver writes metrics.json (and plot.png, jobs/report.py) and
an empty _SUCCESS marker last.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prefixflow.operators.results.bookkeeping import (
    COMMITS,
    END_FILES,
    JOB_FILE,
    LOCK_FILE,
    PART_NAME,
    TMP_PREFIX,
    basename,
    is_own,
    refuse_links,
)
from prefixflow.operators.results.commit import (
    check_fence,
    commit_bytes,
    commit_record_path,
    read_job_file,
    record_bytes,
)
from prefixflow.operators.results.openai_output import output_line
from prefixflow.operators.results.outputs import COMPUTED, PLAN_REPLICA, RANK
from prefixflow.storage import StorageOptions, cat_each, io_map, is_local, join, masked, normal_path

SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl", "openai": ".jsonl"}


@dataclass(frozen=True)
class WriteOptions:
    path: str
    format: str  # parquet | jsonl | openai
    storage: StorageOptions = StorageOptions()
    model_name: str = "prefixflow"
    created: int = 0  # unix time stamped into OpenAI responses
    model: str = ""  # the model path: its tokenizer spells OpenAI logprobs' tokens
    system_fingerprint: str | None = None  # OpenAI bodies' (openai_output.system_fingerprint)
    # The output lock's token of the job that writes (operators/results/commit.py: fencing); None where
    # no lock is held (the Python API).
    fence: str | None = None


def part_manifest(table: pa.Table, suffix: str = "") -> dict[str, Any]:
    """The manifest row of a part holding `table`'s output rows, made where it is committed."""
    replica = int(table.column("replica")[0].as_py())
    # Named after the first row's place in the plan (its plan replica and rank), whichever
    # replica ran it (work stealing): each row is in one part, so no two parts share a name.
    planned = table.column(PLAN_REPLICA)[0].as_py() if PLAN_REPLICA in table.column_names else None
    first_rank = int(pc.min(table.column(RANK)).as_py())
    # Error records' RANK is their row id (operators/stages/generate.py): "error", not the
    # older "errors" whose number was a place in the error list, so no name can be both.
    tag = "error" if replica < 0 else f"r{replica if planned is None else planned:03d}"
    errors = table.column("error").is_valid()
    return {
        "part": f"part-{tag}-{first_rank:09d}{suffix}",
        "replica": replica,
        "num_rows": table.num_rows,
        "num_errors": int(pc.sum(errors.cast(pa.int64())).as_py() or 0),
        "prompt_tokens": int(pc.sum(table.column("num_input_tokens")).as_py() or 0),
        "computed_prompt_tokens": float(pc.sum(table.column(COMPUTED)).as_py() or 0.0),
        "generated_tokens": int(pc.sum(table.column("num_generated_tokens")).as_py() or 0),
        "written_at": time.time(),
        # Which engine actor wrote it: where to look when a part is wrong, or a worker dies.
        "worker": f"{socket.gethostname()}:{os.getpid()}",
        "node_id": ray_node_id(),
    }


def write_part(table: pa.Table, opts: WriteOptions) -> pa.Table:
    """Write one part, return one manifest row describing it."""
    manifest = part_manifest(table, SUFFIX[opts.format])
    name = manifest["part"]
    data = encode_part(table, opts)
    check_fence(opts.path, opts.storage, opts.fence)  # this job still holds the path
    commit_bytes(join(opts.path, name), data, opts.storage)
    # The record goes second: a part without one is an orphan that resume deletes and redoes.
    # Its size and checksum let a resume notice a part deleted or damaged since, its writer's
    # token a part that a fenced job wrote (operators/results/commit.py).
    record = {**manifest, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "writer": opts.fence}
    commit_bytes(
        commit_record_path(opts.path, name), record_bytes(record, table.column("row_id").to_pylist()), opts.storage
    )
    return pa.table({k: [v] for k, v in manifest.items()})


def ray_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): which node wrote a part or ran a
    replica, on a cluster where every node has the same host name."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def encode_part(table: pa.Table, opts: WriteOptions) -> bytes:
    if opts.format == "openai":
        lines = [
            json.dumps(output_line(r, opts.created, opts.model_name, opts.model, opts.system_fingerprint))
            for r in table.to_pylist()
        ]
        return ("\n".join(lines) + "\n").encode("utf-8")
    table = table.drop_columns([c for c in table.column_names if c.startswith("_pf_")])
    if opts.format == "jsonl":
        lines = [json.dumps(json_value(r), ensure_ascii=False, allow_nan=False, default=str) for r in table.to_pylist()]
        return ("\n".join(lines) + "\n").encode("utf-8")
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def json_value(value: Any) -> Any:
    """`value` as strict JSON can hold it (JSONL output; parquet keeps every type as it is):
    NaN and infinities become null (JSON has no such numbers), decimals numbers (integral ones,
    such as integers beyond int64, exactly), bytes base64 text; dates and times are written by
    json.dumps' default (str)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else json_value(float(value))
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return value


def prepare_output(opts: WriteOptions, overwrite: bool, resume: bool = False) -> None:
    """Create the output directory; refuse to mix with an earlier job's parts unless asked.

    resume: keep everything (the run skips the committed rows; a refused resume loses nothing).
    overwrite: delete the earlier job's own files, and only those (`_delete_own_files`). A folder
    that holds files but no `_job.json` that prefixflow wrote is refused either way (its files
    are not ours to keep or delete), and so is a symbolic link under one of the job's names
    (operators/bookkeeping.refuse_links). The caller holds the path's OutputLock
    (operators/results/commit.py), which stays.
    """
    if overwrite and resume:
        raise ValueError(
            f"output.overwrite=True and output.resume=True for {masked(opts.path)!r}: "
            "overwrite deletes the committed parts that resume would keep; set one"
        )
    fs = opts.storage.filesystem(opts.path)
    names = [basename(p) for p in fs.ls(opts.path, detail=False)] if fs.exists(opts.path) else []
    names = [n for n in names if n != LOCK_FILE and not n.startswith(".")]
    refuse_links(opts.path, fs)
    if (resume or overwrite) and names and JOB_FILE not in names:
        flag = "resume" if resume else "overwrite"
        raise ValueError(
            f"output.{flag}=True but output.path={masked(opts.path)!r} holds no "
            f"prefixflow job (files such as {names[0]!r}, no {JOB_FILE}), so none of "
            "its files are a job's to keep or delete: choose a new path"
        )
    if overwrite and names:  # its _job.json must be one prefixflow wrote (resume: check_job_file)
        read_job_file(
            opts.path,
            fs,
            "it is not one prefixflow wrote, and none of the folder's "
            "files are a job's to delete (output.overwrite=True): choose a new path, "
            "or empty the folder yourself",
        )
    own = [n for n in names if is_own(n)]
    if not (resume or overwrite) and (own or any(n.startswith("part-") for n in names)):
        # (another tool's part-* files too: a fresh job's parts beside them would be read as one output)
        raise ValueError(
            f"output.path={masked(opts.path)!r} already holds a job's output: choose "
            "a new path, set output.resume: true to finish it, or output.overwrite: true"
        )
    if overwrite:  # (resume: the end markers go once the job file matches: clear_end_markers)
        _delete_own_files(opts.path, fs, own)
    if is_local(opts.path):  # object stores have no folders (gcsfs would create a bucket)
        fs.makedirs(opts.path, exist_ok=True)


def _delete_own_files(out: str, fs: Any, own: list[str]) -> None:
    """What overwrite deletes, in a folder whose _job.json prefixflow wrote: the files of the
    names a job writes (bookkeeping.is_own: its parts by their exact names, their commit records,
    its bookkeeping and end files, temporary files of the commit protocol), the records first;
    nothing else, and never through a link (refuse_links ran)."""
    records = join(out, COMMITS)
    if COMMITS in own and fs.isdir(records):
        names = [basename(p) for p in fs.ls(records, detail=False)]
        mine = [
            join(records, n)
            for n in names
            if n.startswith(TMP_PREFIX) or (n.endswith(".json") and PART_NAME.match(n.removesuffix(".json")))
        ]
        if mine:
            fs.rm(mine)  # one request per batch on an object store
        if is_local(out) and len(mine) == len(names):
            fs.rmdir(records)
    files = [join(out, n) for n in own if n not in (COMMITS, JOB_FILE)]
    if files:
        fs.rm(files)
    if JOB_FILE in own:  # last: until it goes, a rerun still knows the folder is a job's
        fs.rm(join(out, JOB_FILE))


def clear_end_markers(opts: WriteOptions) -> None:
    """Before a resume writes: the old `_SUCCESS` and summaries no longer describe the output."""
    fs = opts.storage.filesystem(opts.path)
    paths = [join(opts.path, name) for name in END_FILES]  # _SUCCESS first
    there = [p for p, found in zip(paths, io_map(fs.exists, paths, is_local(opts.path))) if found]
    if there:
        fs.rm(there)  # one request on an object store


def write_json(path: str, value: Any, storage: StorageOptions) -> None:
    commit_bytes(path, (json.dumps(value, indent=2, default=str) + "\n").encode("utf-8"), storage)


def read_output(path: str, storage: StorageOptions = StorageOptions()) -> pa.Table | list[dict]:
    """All parts of a job's output: a table for parquet, a list of records for JSONL."""
    path = normal_path(path)
    fs = storage.filesystem(path)
    parts = sorted(p for p in fs.ls(path, detail=False) if PART_NAME.match(basename(p)))
    if parts and parts[0].endswith(".parquet"):
        import pyarrow.parquet as pq

        tables = [pq.read_table(io.BytesIO(data)) for data in cat_each(fs, parts)]
        return pa.concat_tables(tables, promote_options="permissive")
    records: list[dict] = []
    for data in cat_each(fs, parts):
        records.extend(json.loads(line) for line in data.decode().splitlines() if line)
    return records
