"""Read a job's input into a Ray Dataset of rows: JSONL, CSV, Parquet or OpenAI batch JSONL.

Every row gets two bookkeeping columns (their names: operators/columns.py):
  _pf_source  where it came from ("file.jsonl:17"), for error messages;
  _pf_error   None for a good row, else why the row cannot run. A bad row is kept (it becomes
              an error record in the output) so that the job goes on and no row disappears.

JSONL, CSV and OpenAI files are parsed by our own per-file task instead of Ray's JSON reader,
which fails the whole job on one broken line or one non-UTF-8 byte. Parquet is typed, so
Ray's reader is used as it is, unless the files' schemas clash. Nothing here evaluates data:
JSON is parsed, never executed.

Types are kept. A column is converted only where Arrow cannot hold its values as one type, and
then by one documented rule (`to_text`): strings stay exactly as they are, any other value
becomes its compact JSON text (42 -> "42", {"a": "é"} -> '{"a": "é"}'). That happens
  - inside one file, for a column whose rows disagree (1 in one row, "a" in the next);
  - across files (or byte ranges of one large file), for a column int in one and string in
    another: the parquet files' footers, or a first pass over the JSONL/CSV ranges
    (`clashing_columns`), name such columns, and every file reads them as text.
Integers beyond int64 are kept exactly as decimal128(38, 0). Column names that start with
`_pf_` are reserved for the bookkeeping columns: a row that has one becomes an error record
(those columns dropped, the others kept), and so does every row of a CSV file whose header
names one column twice.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

import logging

import pyarrow as pa

from prefixflow.operators.columns import ERROR, RESERVED, SOURCE
from prefixflow.operators.stages.openai_batch import parse_requests
from prefixflow.operators.stages.read_table import TableInput, read_table
from prefixflow.retry import with_retries
from prefixflow.storage import (
    StorageOptions,
    io_map,
    list_input_files,
    listed_entries,
    masked,
    same_filesystem,
)

Format = Literal["jsonl", "csv", "parquet", "openai"]
_log = logging.getLogger(__name__)
# A JSON escape of a UTF-16 surrogate (half of a pair, or a lone one the line cannot store).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
SUFFIXES = {
    "jsonl": (".jsonl", ".json", ".ndjson"),
    "csv": (".csv",),
    "parquet": (".parquet",),
    "openai": (".jsonl", ".json"),
}


@dataclass(frozen=True)
class ReadOptions:
    """What to read. `path` is a file, a directory, a glob or a list of them."""

    path: str | tuple[str, ...]
    format: Format
    storage: StorageOptions = StorageOptions()
    limit: int | None = None
    chunk_bytes: int = 64 << 20  # JSONL files larger than this are read by several tasks
    min_tasks: int = 1  # split JSONL input into at least this many reads (> 1 MiB each)
    # A table instead of files (path: its location; format: parquet, as its rows come typed)
    table: TableInput | None = None


def infer_format(path: str | list[str] | tuple[str, ...]) -> Format:
    first = path if isinstance(path, str) else path[0]
    name = first.rstrip("/").lower()
    fmt: Format
    for fmt in ("parquet", "csv"):
        if name.endswith(SUFFIXES[fmt]):
            return fmt
    if name.endswith(SUFFIXES["jsonl"]):
        return "jsonl"
    raise ValueError(
        f"input.format cannot be inferred from input.path={first!r}: set "
        "input.format to one of jsonl, csv, parquet, openai"
    )


def read_dataset(opts: ReadOptions) -> Any:
    """A lazy ray.data.Dataset of the input rows, with _pf_source and _pf_error columns."""
    import ray.data

    if opts.table is not None:
        ds = read_table(opts.table, opts.storage).map_batches(_add_bookkeeping, batch_format="pyarrow", batch_size=None)
        return ds.limit(opts.limit) if opts.limit is not None else ds
    files = input_files(opts)
    items = file_ranges(files, opts) if opts.format != "parquet" else []
    clash = clashing_columns(files, opts.storage, opts.format, items)
    if clash:
        _log.info(
            "input: column(s) %s have different types in different files (or parts of a "
            "file): read as text (strings as they are, other values as JSON)",
            ", ".join(map(repr, clash)),
        )
    if opts.format == "parquet" and not clash and same_filesystem(files):
        # Ray's reader gets the files' fsspec filesystem (wrapped for pyarrow), whatever the scheme.
        paths, fs = opts.storage.arrow_filesystem(files)
        with _footer_readers(len(files)):
            ds = ray.data.read_parquet(paths, filesystem=fs).map_batches(
                _add_bookkeeping, batch_format="pyarrow", batch_size=None
            )
    else:
        # Parquet files whose schemas clash, or that lie on different filesystems, are read one
        # by one here (Ray's reader fails on the first and takes one filesystem).
        items = items or file_ranges(files, opts)
        ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            parse_files,
            fn_kwargs={"fmt": opts.format, "storage": opts.storage, "text_columns": clash},
            batch_size=1,
            batch_format="pyarrow",
        )
    if opts.limit is not None:
        ds = ds.limit(opts.limit)
    return ds


FOOTER_READERS = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"


@contextlib.contextmanager
def _footer_readers(num_files: int):
    """Ray 2.60's parquet reader reads the files' footers on a pool of actors, 32 of them
    whatever the number of files (read_parquet builds the pool's settings, from this variable,
    when it is called). Each actor is a worker process of its own: a job of one parquet file
    started 32 (15 CPU-seconds, most of its reading). At most one per file here; a value the
    user set is kept."""
    if FOOTER_READERS in os.environ:
        yield
        return
    os.environ[FOOTER_READERS] = str(max(1, min(32, num_files)))
    try:
        yield
    finally:
        os.environ.pop(FOOTER_READERS, None)


def input_files(opts: ReadOptions) -> list[str]:
    """The files the job reads: `opts.path` expanded, a folder's files of the format's suffixes."""
    path = list(opts.path) if not isinstance(opts.path, str) else opts.path
    return list_input_files(path, opts.storage, SUFFIXES[opts.format])


def _add_bookkeeping(table: pa.Table) -> pa.Table:
    """A typed (parquet) table with the bookkeeping columns added. Input columns named `_pf_*`
    are dropped and make every row an error record that says so."""
    reserved = [c for c in table.column_names if c.startswith(RESERVED)]
    why = _reserved_error(reserved, "the file")
    table = table.drop_columns(reserved)
    table = table.append_column(SOURCE, pa.nulls(table.num_rows, pa.string()))
    return table.append_column(ERROR, pa.array([why] * table.num_rows, pa.string()))


def _reserved_error(names: list[str], where: str) -> str | None:
    if not names:
        return None
    return (
        f"{where} has column(s) {', '.join(map(repr, names))}: names starting with {RESERVED} "
        "are reserved for prefixflow's bookkeeping columns; rename them"
    )


def clashing_columns(
    files: list[str], storage: StorageOptions, fmt: Format = "parquet", items: list[dict[str, Any]] | None = None
) -> list[str]:
    """Columns whose type differs between files (or byte ranges) beyond what Arrow can promote
    (int in one, string in another): every file reads them as text (`to_text`).

    Parquet: only the files' footers are read. JSONL and CSV carry no schema, so each of their
    work items (`items`, file_ranges()) is parsed once by a Ray task that returns only its
    schema: the job reads such input twice, and only when it has more than one work item.
    """
    if fmt == "parquet":
        schemas = [footer.schema.to_arrow_schema() for footer in parquet_footers(files, storage)]
    elif fmt in ("jsonl", "csv") and items is not None and len(items) > 1:
        schemas = _parsed_schemas(items, fmt, storage)
    else:  # one work item cannot clash with itself; OpenAI rows have one fixed schema
        return []
    fields: dict[str, list[pa.Schema]] = {}
    for s in schemas:
        for field in s:
            fields.setdefault(field.name, []).append(pa.schema([field]))
    clash = []
    for name, alone in fields.items():
        try:
            pa.unify_schemas(alone, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            clash.append(name)
    return clash


def parquet_footers(files: list[str], storage: StorageOptions) -> list[Any]:
    """Each parquet file's footer (pyarrow's FileMetaData: its schema, its rows), read with
    retries, FETCH_THREADS at once (threads on a local path too: NFS, FUSE mounts of buckets)."""
    import pyarrow.parquet as pq

    def footer(path: str) -> Any:
        def read() -> Any:
            with storage.filesystem(path).open(path, "rb") as f:
                return pq.read_metadata(f)

        return with_retries(read, f"read the footer of {masked(path)}", storage.retry)

    return io_map(footer, files, local=False)


def _parsed_schemas(items: list[dict[str, Any]], fmt: Format, storage: StorageOptions) -> list[pa.Schema]:
    """The schema each work item parses to, from one small Ray task per item (no rows return)."""
    import ray

    @ray.remote(num_cpus=1)
    def schema(item: dict[str, Any]) -> pa.Schema:
        return parse_file(item["path"], fmt, storage, item["start"], item["end"]).schema

    return ray.get([schema.remote(item) for item in items])


def to_text(value: Any) -> str | None:
    """The text form of a value in a column Arrow cannot type (see the module docstring):
    None and strings as they are; anything else as compact JSON with its characters kept."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def as_text(table: pa.Table, names: list[str]) -> pa.Table:
    """The columns `names` as text (`to_text`); string columns stay as they are."""
    for name in names:
        if name not in table.column_names or pa.types.is_string(table.schema.field(name).type):
            continue
        values = [to_text(v) for v in table.column(name).to_pylist()]
        table = table.set_column(table.column_names.index(name), name, pa.array(values, pa.string()))
    return table


# Bytes read from the start of the first file to estimate a line format's rows from its size.
ROWS_SAMPLE_BYTES = 1 << 20


def estimated_rows(opts: ReadOptions) -> int | None:
    """About how many rows the input holds, known before it is read: parquet's exactly, from
    its footers (read at once on object storage); JSONL's and CSV's from the files' sizes and
    the lines in the first ROWS_SAMPLE_BYTES of the first file. None for a table (its own
    metadata counts it) or where a file has no size (an HTTP server that sends none)."""
    if opts.table is not None:
        return None
    files = input_files(opts)
    if opts.format == "parquet":
        rows = sum(int(footer.num_rows) for footer in parquet_footers(files, opts.storage))
    else:
        sizes = [int(e["size"]) for e in listed_entries(files, opts.storage) if e.get("size") is not None]
        if not files or len(sizes) < len(files):  # a file without a size
            return None
        first = next((f for f, size in zip(files, sizes) if size), None)
        if first is None:  # every file empty
            return 0

        def read_head() -> bytes:  # one range request, not the reader's read-ahead block
            data: bytes = opts.storage.filesystem(first).cat_file(first, start=0, end=ROWS_SAMPLE_BYTES)
            return data

        head = with_retries(read_head, f"read the start of {masked(first)}", opts.storage.retry)
        lines = head.count(b"\n") + (1 if head and not head.endswith(b"\n") else 0)
        rows = round(sum(sizes) * lines / len(head)) if head else 0
    return min(rows, opts.limit) if opts.limit is not None else rows


def file_ranges(files: list[str], opts: ReadOptions) -> list[dict[str, Any]]:
    """Work items: whole files, or byte ranges of large JSONL files (read in parallel)."""
    whole = opts.format in ("csv", "parquet")  # only JSONL lines can be split by byte ranges
    # An HTTP server may send no size (no Content-Length): such a file is read whole.
    sizes = [0] * len(files) if whole else [e.get("size") or 0 for e in listed_entries(files, opts.storage)]
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


def parse_files(
    batch: pa.Table, fmt: Format, storage: StorageOptions, text_columns: list[str] | None = None
) -> pa.Table:
    """map_batches function: each input row is one file (or byte range) -> its rows.
    text_columns: parquet columns to read as text (clashing_columns)."""
    tables = [
        parse_file(item["path"], fmt, storage, item["start"], item["end"], text_columns) for item in batch.to_pylist()
    ]
    return pa.concat_tables(tables, promote_options="permissive")


def parse_file(
    path: str,
    fmt: Format,
    storage: StorageOptions,
    start: int = 0,
    end: int = -1,
    text_columns: list[str] | None = None,
) -> pa.Table:
    source = masked(path)  # rows are named by it, in messages and error records
    data, begin = with_retries(lambda: _read_bytes(path, storage, start, end), f"read {source}", storage.retry)
    if fmt == "csv":
        table = parse_csv(data, source)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        table = _add_bookkeeping(pq.read_table(io.BytesIO(data)))
    else:
        records = parse_jsonl(data, source, byte_offset=begin)
        if fmt == "openai":
            records = parse_requests(records)
        table = rows_to_table(records)
    return as_text(table, text_columns or [])


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
        records.append(_parse_line(raw, where, name))
    return records


def _parse_line(raw: bytes, where: str, name: str) -> dict[str, Any]:
    """One JSONL line's record (`where` its source, `name` the line in errors): its object, with
    _pf_error set when a reserved key was dropped; or only the error and the raw text when it
    is broken."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return {
            SOURCE: where,
            ERROR: f"{name} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
            f"{e.start + 1}): re-encode the file as UTF-8",
            "_pf_raw": raw.decode("utf-8", "replace"),
        }
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return {
            SOURCE: where,
            ERROR: f"{name} is not valid JSON ({e.msg} at column {e.colno}): fix or remove the line",
            "_pf_raw": text,
        }
    except RecursionError:
        return {
            SOURCE: where,
            ERROR: f"{name} is nested too deeply to read (JSON arrays or objects inside "
            "thousands of others): flatten the value",
            "_pf_raw": text[:1000],
        }
    if _SURROGATE_ESCAPE.search(text) and not _is_unicode(value):
        return {
            SOURCE: where,
            ERROR: f"{name} is not valid Unicode (lone surrogate: a \\uD800-\\uDFFF escape "
            "without its pair): fix the escape",
            "_pf_raw": text,
        }
    if not isinstance(value, dict):
        return {
            SOURCE: where,
            ERROR: f"{name} is a JSON {type(value).__name__}, not an object: each line must be one JSON object",
            "_pf_raw": text,
        }
    reserved = [k for k in value if k.startswith(RESERVED)]
    for k in reserved:  # the row's other columns stay in its error record
        del value[k]
    value[SOURCE], value[ERROR] = where, _reserved_error(reserved, name)
    return value


def _is_unicode(value: Any) -> bool:
    """Whether every string in a parsed JSON value can be encoded as UTF-8 (JSON lets a line
    escape half a surrogate pair, "\\ud800", which Python decodes but Arrow cannot store)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return False
    return True


def parse_csv(data: bytes, source: str) -> pa.Table:
    """A CSV file with a header; malformed rows become error records instead of failing."""
    from pyarrow import csv

    bad: list[dict[str, Any]] = []

    def on_invalid(row: Any) -> str:
        line = row.number if row.number is not None else "?"
        bad.append(
            {
                SOURCE: f"{source}:{line}",
                "_pf_raw": row.text,
                ERROR: f"CSV line {line} has {row.actual_columns} fields, the header has "
                f"{row.expected_columns}: quote fields that contain commas",
            }
        )
        return "skip"

    if not data.lstrip(b"\xef\xbb\xbf").strip():  # an empty file (a BOM at most): no rows
        return rows_to_table([])
    try:
        table = csv.read_csv(io.BytesIO(data), parse_options=csv.ParseOptions(invalid_row_handler=on_invalid))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # e.g. a header whose quote never closes
        return rows_to_table(
            [
                {
                    SOURCE: source,
                    ERROR: f"{source} cannot be read as CSV ({e}): fix the file",
                    "_pf_raw": data[:1000].decode("utf-8", "replace"),
                }
            ]
        )
    twice = _name_twice(table.column_names, source)
    if twice is not None:  # columns cannot be told apart: every row says why
        table = _rows_as_errors(table, source, twice)
    else:
        table = _with_bookkeeping(table, source)
    if bad:
        table = pa.concat_tables([table, rows_to_table(bad)], promote_options="permissive")
    return table


def _with_bookkeeping(table: pa.Table, source: str) -> pa.Table:
    """A CSV table with its text decoded and the bookkeeping columns; reserved columns dropped
    (their rows become error records)."""
    reserved = [c for c in table.column_names if c.startswith(RESERVED)]
    table, errors = _decode_text_columns(table.drop_columns(reserved))
    why = _reserved_error(reserved, f"the CSV header of {source}")
    sources = [f"{source}:row {i + 1}" for i in range(table.num_rows)]
    table = table.append_column(SOURCE, pa.array(sources, pa.string()))
    return table.append_column(ERROR, pa.array([e or why for e in errors], pa.string()))


def _name_twice(names: list[str], source: str) -> str | None:
    """Why a CSV header cannot name the columns: one name given twice."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names, start=1):
        if name in seen:
            return (
                f"the CSV header of {source} names column {name!r} twice (columns {seen[name]} "
                f"and {i}): rename one of them"
            )
        seen[name] = i
    return None


def _rows_as_errors(table: pa.Table, source: str, why: str) -> pa.Table:
    """Every row of a CSV file an error record (its values kept as text in _pf_raw)."""
    columns = [table.column(i).to_pylist() for i in range(table.num_columns)]
    raw = [json.dumps([to_text(c[r]) for c in columns], ensure_ascii=False, default=str) for r in range(table.num_rows)]
    return rows_to_table(
        [{SOURCE: f"{source}:row {r + 1}", ERROR: why, "_pf_raw": raw[r]} for r in range(table.num_rows)]
    )


def _decode_text_columns(table: pa.Table) -> tuple[pa.Table, list[str | None]]:
    """Arrow reads a CSV column holding one non-UTF-8 value as binary, for every row: decode
    it back to text, and make only the rows with bad bytes error records."""
    errors: list[str | None] = [None] * table.num_rows
    for i, field in enumerate(table.schema):
        if not (pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)):
            continue
        texts: list[str | None] = []
        for row, raw in enumerate(table.column(i).to_pylist()):
            try:
                texts.append(None if raw is None else raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                texts.append(None)
                errors[row] = errors[row] or (
                    f"CSV row {row + 1}, column {field.name!r}, is not valid "
                    f"UTF-8 (byte {raw[e.start]:#04x}): re-encode the file as UTF-8"
                )
        table = table.set_column(i, field.name, pa.array(texts, pa.string()))
    return table, errors


def rows_to_table(records: list[dict[str, Any]]) -> pa.Table:
    """Build a table from dicts whose keys and value types may differ from row to row.

    A column whose values have no common Arrow type (1 in one row, "a" in the next) becomes
    text by `to_text` (its strings unchanged) rather than failing the file; integers beyond
    int64 are kept exactly as decimal128(38, 0).
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
        columns[name] = _typed_column(values)
    return pa.table(columns)


def _typed_column(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except OverflowError:  # an integer beyond int64
        try:
            return pa.array(values, pa.decimal128(38, 0))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
            pass
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    return pa.array([to_text(v) for v in values], pa.string())
