"""Read a job's input into a Ray Dataset of rows: JSONL, CSV, Parquet or OpenAI batch JSONL.

Every row gets two bookkeeping columns:
  _pf_source  where it came from ("file.jsonl:17"), for error messages;
  _pf_error   None for a good row, else why the row cannot run. A bad row is kept (it becomes
              an error record in the output) so that the job goes on and no row disappears.

JSONL, CSV and OpenAI files are parsed by our own per-file task instead of Ray's JSON reader,
which fails the whole job on one broken line or one non-UTF-8 byte. Parquet is typed, so
Ray's reader is used as it is. Nothing here evaluates data: JSON is parsed, never executed.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa

from prefixflow.operators.retry import with_retries
from prefixflow.operators.storage import StorageOptions, is_s3, list_input_files

Format = Literal["jsonl", "csv", "parquet", "openai"]
SOURCE, ERROR = "_pf_source", "_pf_error"
SUFFIXES = {"jsonl": (".jsonl", ".json", ".ndjson"), "csv": (".csv",),
            "parquet": (".parquet",), "openai": (".jsonl", ".json")}


@dataclass(frozen=True)
class ReadOptions:
    """What to read. `path` is a file, a directory, a glob or a list of them."""

    path: str | tuple[str, ...]
    format: Format
    storage: StorageOptions = StorageOptions()
    limit: int | None = None
    chunk_bytes: int = 64 << 20  # JSONL files larger than this are read by several tasks
    min_tasks: int = 1           # split JSONL input into at least this many reads (> 1 MiB each)


def infer_format(path: str | list[str] | tuple[str, ...]) -> Format:
    first = path if isinstance(path, str) else path[0]
    name = first.rstrip("/").lower()
    for fmt in ("parquet", "csv"):
        if name.endswith(SUFFIXES[fmt]):
            return fmt  # type: ignore[return-value]
    if name.endswith(SUFFIXES["jsonl"]):
        return "jsonl"
    raise ValueError(f"input.format cannot be inferred from input.path={first!r}: set "
                     "input.format to one of jsonl, csv, parquet, openai")


def read_dataset(opts: ReadOptions) -> Any:
    """A lazy ray.data.Dataset of the input rows, with _pf_source and _pf_error columns."""
    import ray.data

    files = list_input_files(list(opts.path) if not isinstance(opts.path, str) else opts.path,
                             opts.storage, SUFFIXES[opts.format])
    if opts.format == "parquet":
        fs = opts.storage.filesystem(files[0]) if is_s3(files[0]) else None
        ds = ray.data.read_parquet(files, filesystem=fs).map_batches(
            _add_bookkeeping, batch_format="pyarrow", batch_size=None)
    else:
        items = file_ranges(files, opts)
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            parse_files, fn_kwargs={"fmt": opts.format, "storage": opts.storage},
            batch_size=1, batch_format="pyarrow")
    if opts.limit is not None:
        ds = ds.limit(opts.limit)
    return ds


def _add_bookkeeping(table: pa.Table) -> pa.Table:
    n = table.num_rows
    if SOURCE not in table.column_names:
        table = table.append_column(SOURCE, pa.nulls(n, pa.string()))
    if ERROR not in table.column_names:
        table = table.append_column(ERROR, pa.nulls(n, pa.string()))
    return table


def file_ranges(files: list[str], opts: ReadOptions) -> list[dict[str, Any]]:
    """Work items: whole files, or byte ranges of large JSONL files (read in parallel)."""
    sizes = [opts.storage.filesystem(p).size(p) if opts.format != "csv" else 0 for p in files]
    # Enough reads to keep every tokenizer busy (a fused read -> tokenize task per range).
    chunk = min(opts.chunk_bytes, max(1 << 20, -(-sum(sizes) // max(opts.min_tasks, 1))))
    items = []
    for path, size in zip(files, sizes):
        if size <= chunk:
            items.append({"path": path, "start": 0, "end": -1})
            continue
        for start in range(0, size, chunk):
            items.append({"path": path, "start": start, "end": min(start + chunk, size)})
    return items


def parse_files(batch: pa.Table, fmt: Format, storage: StorageOptions) -> pa.Table:
    """map_batches function: each input row is one file (or byte range) -> its rows."""
    tables = [parse_file(item["path"], fmt, storage, item["start"], item["end"])
              for item in batch.to_pylist()]
    return pa.concat_tables(tables, promote_options="permissive")


def parse_file(path: str, fmt: Format, storage: StorageOptions, start: int = 0, end: int = -1) -> pa.Table:
    data, begin = with_retries(lambda: _read_bytes(path, storage, start, end), f"read {path}",
                               storage.retry)
    if fmt == "csv":
        return parse_csv(data, path)
    records = parse_jsonl(data, path, byte_offset=begin)
    if fmt == "openai":
        from prefixflow.operators.openai_batch import parse_requests

        records = parse_requests(records)
    return rows_to_table(records)


def _read_bytes(path: str, storage: StorageOptions, start: int, end: int) -> tuple[bytes, int | None]:
    """The whole file (end < 0), or the lines of a byte range; read again from the start on a
    retry, so a dropped connection halfway through never yields half a file."""
    with storage.filesystem(path).open(path, "rb") as f:
        return (f.read(), None) if end < 0 else _read_lines_in_range(f, start, end)


def _read_lines_in_range(f: Any, start: int, end: int) -> tuple[bytes, int]:
    """The lines whose first byte lies in [start, end), and where they begin: each line of
    the file belongs to exactly one range."""
    if start > 0:
        f.seek(start - 1)
        f.readline()  # skip the line that began before `start` (unless byte start-1 ended one)
    begin = f.tell()
    if begin >= end:
        return b"", begin
    data = f.read(end - begin)
    if not data.endswith(b"\n"):
        data += f.readline()  # finish the last line that began inside the range
    return data, begin


def parse_jsonl(data: bytes, source: str, byte_offset: int | None = None) -> list[dict[str, Any]]:
    """One record per non-blank line; a broken line becomes a record with only _pf_error.

    byte_offset: where `data` starts in the file when it is a byte range (line numbers are
    then unknown and lines are named by their byte position).
    """
    records: list[dict[str, Any]] = []
    pos = 0
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line_start, pos = pos, pos + len(raw) + 1
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        if byte_offset is None:
            where, name = f"{source}:{number}", f"line {number}"
        else:
            where = f"{source}@{byte_offset + line_start}"
            name = f"the line at byte {byte_offset + line_start}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            records.append({SOURCE: where, ERROR: f"{name} is not valid UTF-8 "
                            f"(byte {raw[e.start]:#04x} at column {e.start + 1}): re-encode the "
                            "file as UTF-8", "_pf_raw": raw.decode("utf-8", "replace")})
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            records.append({SOURCE: where, ERROR: f"{name} is not valid JSON ({e.msg} at "
                            f"column {e.colno}): fix or remove the line", "_pf_raw": text})
            continue
        if not isinstance(value, dict):
            records.append({SOURCE: where, ERROR: f"{name} is a JSON {type(value).__name__},"
                            " not an object: each line must be one JSON object", "_pf_raw": text})
            continue
        value[SOURCE], value[ERROR] = where, None
        records.append(value)
    return records


def parse_csv(data: bytes, source: str) -> pa.Table:
    """A CSV file with a header; malformed rows become error records instead of failing."""
    from pyarrow import csv

    bad: list[dict[str, Any]] = []

    def on_invalid(row: Any) -> str:
        line = row.number if row.number is not None else "?"
        bad.append({SOURCE: f"{source}:{line}", "_pf_raw": row.text,
                    ERROR: f"CSV line {line} has {row.actual_columns} fields, the header has "
                           f"{row.expected_columns}: quote fields that contain commas"})
        return "skip"

    table = csv.read_csv(io.BytesIO(data),
                         parse_options=csv.ParseOptions(invalid_row_handler=on_invalid))
    sources = [f"{source}:row {i + 1}" for i in range(table.num_rows)]
    table = table.append_column(SOURCE, pa.array(sources, pa.string()))
    table = table.append_column(ERROR, pa.nulls(table.num_rows, pa.string()))
    if bad:
        table = pa.concat_tables([table, rows_to_table(bad)], promote_options="permissive")
    return table


def rows_to_table(records: list[dict[str, Any]]) -> pa.Table:
    """Build a table from dicts whose keys and value types may differ from row to row.

    A column whose values have no common Arrow type (1 in one row, "a" in the next) is kept as
    JSON text rather than failing the file.
    """
    names: dict[str, None] = {}
    for r in records:
        names.update(dict.fromkeys(r))
    for required in (SOURCE, ERROR):
        names.setdefault(required, None)
    columns: dict[str, pa.Array] = {}
    for name in names:
        values = [r.get(name) for r in records]
        if name in (SOURCE, ERROR, "_pf_raw"):
            columns[name] = pa.array(values, pa.string())
            continue
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            columns[name] = pa.array([None if v is None else json.dumps(v) for v in values],
                                     pa.string())
    return pa.table(columns)
