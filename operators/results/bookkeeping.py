"""A job's output folder: the names a job writes there, and the one strict reader of its
bookkeeping files.

Nothing in an output folder is trusted that a hand could have changed (operators/results/commit.py):
  - `_lock.json`, `_job.json` and the commit records are read by `read_bookkeeping`, which
    checks each field's type and names a damaged file (a symbolic link, a folder, bytes that
    are not JSON, `[]`, `null`, `{"pid": "abc"}`) instead of failing later with a traceback;
  - a symbolic link under one of the job's names (`is_own`), or in its `_commits` folder, is
    refused by name (`refuse_links`): a job never reads, writes or deletes through one;
  - a part is only a file of exactly the writer's names (`PART_NAME`), so another tool's
    `part-00000.parquet` is never taken for one, nor deleted.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from prefixflow.errors import short
from prefixflow.storage import cat_whole, io_map, is_local, local_path, masked, on_local_disk

COMMITS = "_commits"
JOB_FILE = "_job.json"
MANIFEST = "_manifest.json"  # written last by the driver: every committed part and row id
TMP_PREFIX = "_tmp-"
LOCK_FILE = "_lock.json"
RESULTS_FILE = "results.jsonl"  # format openai: every line in input order (openai_output.write_results)
ERRORS_FILE = "errors.jsonl"  # format openai with output.error_file: the failed requests' lines


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


# What a part may be called: exactly the writer's names (operators/results/write.py: the plan
# replica and the plan rank of its first row; or "error" and its first row id, error records),
# nothing with a path in it. "errors" and a rank in the error list: error parts of an older
# prefixflow, still read. A file whose name only starts with "part-" (another tool's
# part-00000.parquet) is never taken for one.
PART_NAME = re.compile(r"^part-(r[0-9]{3,}|errors?)-[0-9]{9,}\.(parquet|jsonl)$")


# -- the one strict reader of the output folder's bookkeeping files ---------------------------

Kind = tuple[str, Any]  # (what the field must be, in words; a test of a value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


TEXT: Kind = ("text", lambda v: isinstance(v, str))
INT: Kind = ("an integer", _is_int)
NUMBER: Kind = ("a number", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v))
SHA256: Kind = ("a sha256 in hex", lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None)
ROW_IDS: Kind = (
    "a list of row ids (integers from 0)",
    lambda v: isinstance(v, list) and all(_is_int(x) and 0 <= x < 2**63 for x in v),
)


def maybe(kind: Kind) -> Kind:
    """`kind`, or null, or left out."""
    return f"{kind[0]} or null", lambda v: v is None or kind[1](v)


# What each bookkeeping file holds, field by field (written by OutputLock, check_job_file and
# operators/write.write_part). _job.json's other fields are compared, not read.
LOCK_FIELDS = {"host": TEXT, "pid": INT, "started": NUMBER, "heartbeat": NUMBER, "token": TEXT}
JOB_FIELDS = {"fingerprint": SHA256}
RECORD_FIELDS = {
    "part": TEXT,
    "row_ids": ROW_IDS,
    "num_rows": maybe(INT),
    "bytes": maybe(INT),
    "sha256": maybe(SHA256),
    "writer": maybe(TEXT),
}


class Damaged(ValueError):
    """A bookkeeping file that is not as prefixflow writes it; the message names the file and
    what is wrong with it (callers add what to do)."""


def read_bookkeeping(fs: Any, path: str, fields: dict[str, Kind], name: str | None = None) -> dict[str, Any] | None:
    """The JSON object in the bookkeeping file `path` (_lock.json, _job.json, a commit record),
    each of `fields` checked; None when there is no such file. Damaged, naming the file (as
    `name`, default its base name), for a symbolic link, a folder, bytes that are not JSON, or
    an object without a field of its type: never an AttributeError or a traceback later."""
    value = read_bookkeeping_files(fs, [path], fields, [name or basename(path)])[0]
    if isinstance(value, Damaged):
        raise value
    return value


def read_bookkeeping_files(
    fs: Any, paths: list[str], fields: dict[str, Kind], names: list[str]
) -> list[dict[str, Any] | None | Damaged]:
    """read_bookkeeping of each of `paths` (named `names`), a Damaged in the place of a damaged
    file. The files are fetched at once, concurrently on object storage: a resume of a job of
    thousands of parts reads thousands of commit records, one round trip each when read in turn."""
    # A symbolic link is never read (refuse_links says why).
    local = on_local_disk(fs)
    links = {p: os.readlink(local_path(p)) for p in paths if local and os.path.islink(local_path(p))}
    fetched = iter(_cat_files(fs, [p for p in paths if p not in links], local))
    values: list[dict[str, Any] | None | Damaged] = []
    for path, name in zip(paths, names):
        try:
            if path in links:
                raise Damaged(
                    f"{name} is a symbolic link (to {links[path]!r}), which prefixflow never "
                    "follows in an output folder"
                )
            values.append(_parse_bookkeeping(next(fetched), fields, name))
        except Damaged as e:
            values.append(e)
    return values


def _cat_files(fs: Any, paths: list[str], local: bool) -> list[bytes | OSError]:
    """The bytes of each of `paths`, in order, or where one is missing or a folder the error
    that says so."""

    def cat(path: str) -> bytes | OSError:
        try:
            return cat_whole(fs, path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:  # this file's answer
            return e  # (any other error, a storage that is down, ends the reads at once)

    return io_map(cat, paths, local)


def _parse_bookkeeping(raw: bytes | OSError, fields: dict[str, Kind], name: str) -> dict[str, Any] | None:
    """What read_bookkeeping says of a file that read as `raw` (its bytes, or the error that
    says it is missing or a folder)."""
    if isinstance(raw, FileNotFoundError):
        return None
    if isinstance(raw, OSError):  # IsADirectoryError, NotADirectoryError (_cat_files)
        raise Damaged(f"{name} is a folder, not a file prefixflow wrote")
    try:
        value = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise Damaged(f"{name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        kind = "null" if value is None else f"a JSON {type(value).__name__}"
        raise Damaged(f"{name} holds {kind}, not the JSON object prefixflow writes")
    check_fields(value, fields, name)
    return value


def check_fields(value: dict[str, Any], fields: dict[str, Kind], name: str) -> None:
    """Damaged, naming the file and the field, unless each of `fields` has its kind."""
    for field, (want, ok) in fields.items():
        if not ok(value.get(field)):
            got = f"no {field!r} field" if field not in value else f"{field}={short(value[field])}"
            raise Damaged(f"{name} has {got}, where prefixflow writes {want}")


# Names in an output folder that a job reads, writes or deletes; a symbolic link under one of
# them would make it read, write or delete elsewhere (another job's records, a user's file).
# Written when a job completes; a resume deletes them before it writes (write.clear_end_markers).
END_FILES = ("_SUCCESS", "metrics.json", "plot.png", MANIFEST, RESULTS_FILE, ERRORS_FILE)
OWN_NAMES = (*END_FILES, JOB_FILE, LOCK_FILE, COMMITS)


def is_own(name: str) -> bool:
    """Whether a file of an output folder has a name the job writes (a part, a commit record's
    folder, a bookkeeping or end file, a temporary file of the commit protocol)."""
    return name in OWN_NAMES or PART_NAME.match(name) is not None or name.startswith(TMP_PREFIX)


def refuse_links(out: str, fs: Any) -> None:
    """Raise ValueError, naming it and what to do, when one of the job's own names in `out` or
    in its `_commits` folder is a symbolic link (only local folders have links)."""
    if not is_local(out):
        return
    folder = local_path(out)
    for where in (folder, os.path.join(folder, COMMITS)):
        try:
            entries = list(os.scandir(where))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            inside = where != folder
            if entry.is_symlink() and (inside or is_own(entry.name)):
                name = f"{COMMITS}/{entry.name}" if inside else entry.name
                raise ValueError(
                    f"output.path={masked(out)!r}: {name} is a symbolic link (to "
                    f"{os.readlink(entry.path)!r}); prefixflow never follows a link "
                    "in its output folder (it would read, write or delete where it "
                    f"points): remove the link ({entry.path}) or choose a new path"
                )
