"""A finished job's rows into a table (Delta Lake, Iceberg, Lance) in one atomic, idempotent commit.

A job with table output writes committed parquet parts to `output.path` as any job does
(operators/results/commit.py: a crash between parts loses nothing and a resume redoes only what
was not committed). When every row is committed, the driver appends them to the table in one
table commit, which carries the job's id (`job_id`: from the job's fingerprint, so a rerun of
the same job over the same input has the same id):

  - Delta: an application transaction (`txn` action: appId `prefixflow-<job id>`, version 1) in
    the same commit as the rows; the table's `transaction_version(appId)` says it happened;
  - Iceberg: a snapshot summary property `prefixflow.job-id`, looked up among the current
    snapshot's ancestors (a rolled-back commit does not count); the parts are one append (one
    snapshot, one catalog commit);
  - Lance: a transaction property `prefixflow.job-id` on the append, looked up in the
    dataset's transactions, newest first.

Before it appends, the driver looks for its id in the table: found, it appends nothing and says
which version holds the rows. So a crash before the table commit (a resume commits), in it (the
format's commit is atomic: nothing or everything), or after it (a resume or an overwrite rerun
finds the id) never writes a row twice or drops one, as long as the table keeps that commit's
record: Iceberg's expired snapshots and Lance's cleaned-up versions take the id with them
(Delta's `txn` outlives a log cleanup). The driver holds the output path's lock meanwhile, so no
other run of this job commits at the same time.

Parts are streamed one at a time (memory: one part), their schemas unified first (a column that
is null in every row of one part has Arrow's null type there: it becomes the type other parts
give it, else the existing table's, else text). `errors: folder` leaves error records out of the
table (they stay in the job's parts, readable with read_output); `errors: table` (the default)
appends them with their `error` column set, so that the table has one row per input row.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from prefixflow.storage import StorageOptions, cat_whole, iceberg_catalog, join, masked

JOB_ID_PROPERTY = "prefixflow.job-id"
OutputTableFormat = Literal["delta", "iceberg", "lance"]  # config.OUTPUT_TABLE_FORMATS
Parts = Callable[[], Iterator[pa.Table]]


@dataclass(frozen=True)
class TableOutput:
    """Where a job's rows land: `location` is the table's path or URL (delta, lance) or its
    name, namespace.table (iceberg, in the catalog that `catalog`'s properties describe)."""

    format: OutputTableFormat
    location: str
    catalog: dict[str, str] = field(default_factory=dict, repr=False)  # may hold credentials
    errors: Literal["table", "folder"] = "table"

    @property
    def name(self) -> str:
        return f"{self.format}:{masked(self.location)}"


def job_id(fingerprint: str) -> str:
    return fingerprint[:32]


def commit_to_table(
    out: TableOutput, parts_folder: str, parts: list[str], job: str, storage: StorageOptions
) -> dict[str, Any]:
    """Append the rows of `parts` (committed parquet part names in `parts_folder`) to the table,
    once per job id `job`. Returns what happened: the table's version (Iceberg: snapshot id) that
    holds the rows, how many rows this call appended (0 when the table already had them)."""
    done = {"table": out.name, "job_id": job, "version": None, "rows_appended": 0, "already_committed": False}
    if not parts:  # a job without rows (an empty input): nothing to append, no commit
        return done
    committed, version = committed_version(out, job, storage)
    if committed:
        return {**done, "version": version, "already_committed": True}
    paths = [join(parts_folder, p) for p in sorted(parts)]
    schema = _unified_schema(paths, storage, _table_schema(out, storage))
    appended = [0]

    def tables() -> Iterator[pa.Table]:  # the parts, read as the table's writer takes them
        for table in _tables(paths, schema, storage, keep_errors=out.errors == "table"):
            appended[0] += table.num_rows
            yield table

    _APPEND[out.format](out, tables, schema, job, storage)
    # The version that holds this job's commit (not the newest: another writer may follow).
    _, version = committed_version(out, job, storage)
    return {**done, "version": version, "rows_appended": appended[0]}


def output_table_problem(out: TableOutput, storage: StorageOptions) -> str | None:
    """Why the job could not commit to `out` at its end (None: it could, as far as can be told
    before the job): checked before any work, so that a bad table location does not wait for
    the last row."""
    try:
        if out.format == "iceberg":
            iceberg_catalog(out.catalog, storage)  # reaches the catalog (sqlite, REST, ...)
            return None
        uri, options = storage.table_location(out.format, out.location)
        fs = storage.filesystem(uri)
        if not fs.exists(uri) or (fs.isdir(uri) and not fs.ls(uri)):
            return None  # created by the commit
        if out.format == "delta":
            from deltalake import DeltaTable

            if DeltaTable.is_deltatable(uri, storage_options=options):
                return None
        elif _lance_dataset(out, storage) is not None:
            return None
        return f"{masked(uri)!r} exists and is not a {out.format} table: give a new path or an existing table"
    except Exception as e:  # noqa: BLE001 - each table library raises its own kinds; one line each
        return f"cannot reach the {out.format} table {masked(out.location)!r}: {masked(str(e))[:300]}"


def committed_version(out: TableOutput, job: str, storage: StorageOptions) -> tuple[bool, int | None]:
    """(whether the table holds a commit that carries `job`'s id, that commit's version (Iceberg:
    snapshot id); None where the table's history no longer shows it)."""
    if out.format == "delta":
        from deltalake import DeltaTable

        uri, options = storage.table_location(out.format, out.location)
        if not DeltaTable.is_deltatable(uri, storage_options=options):
            return False, None
        table = DeltaTable(uri, storage_options=options)
        if table.transaction_version(_delta_app_id(job)) is None:
            return False, None
        # newest first; the txn outlives a log cleanup that drops the commit's history entry
        return True, next((int(c["version"]) for c in table.history() if c.get(JOB_ID_PROPERTY) == job), None)
    if out.format == "lance":
        dataset = _lance_dataset(out, storage)
        for version in reversed(dataset.versions() if dataset is not None else []):  # newest first
            transaction = dataset.read_transaction(version["version"])
            if transaction is not None and (transaction.transaction_properties or {}).get(JOB_ID_PROPERTY) == job:
                return True, int(version["version"])
        return False, None
    table = _existing_iceberg_table(out, storage)
    if table is None or table.current_snapshot() is None:
        return False, None
    from pyiceberg.table.snapshots import ancestors_of

    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        if (snapshot.summary.additional_properties if snapshot.summary else {}).get(JOB_ID_PROPERTY) == job:
            return True, int(snapshot.snapshot_id)
    return False, None


def _read_part(path: str, storage: StorageOptions) -> pa.Table:
    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(cat_whole(storage.filesystem(path), path)))


def _unified_schema(paths: list[str], storage: StorageOptions, table: pa.Schema | None) -> pa.Schema:
    """One schema for every part: Arrow's permissive promotion. A column null in every row of
    every part (Arrow's null type, which the table formats cannot store) takes the existing
    table's type, else text."""
    import pyarrow.parquet as pq

    schemas = []
    for path in paths:
        with storage.filesystem(path).open(path, "rb") as f:
            schemas.append(pq.read_schema(f))
    schema = pa.unify_schemas(schemas, promote_options="permissive") if schemas else pa.schema([])
    existing = {f.name: f.type for f in table} if table is not None else {}
    return pa.schema(
        [pa.field(f.name, existing.get(f.name, pa.string())) if pa.types.is_null(f.type) else f for f in schema]
    )


def _table_schema(out: TableOutput, storage: StorageOptions) -> pa.Schema | None:
    """The output table's Arrow schema (None: no table yet)."""
    if out.format == "delta":
        from deltalake import DeltaTable

        uri, options = storage.table_location(out.format, out.location)
        if not DeltaTable.is_deltatable(uri, storage_options=options):
            return None
        return pa.schema(DeltaTable(uri, storage_options=options).schema().to_arrow())
    if out.format == "lance":
        dataset = _lance_dataset(out, storage)
        return None if dataset is None else dataset.schema
    table = _existing_iceberg_table(out, storage)
    return None if table is None else table.schema().as_arrow()


def _tables(paths: list[str], schema: pa.Schema, storage: StorageOptions, keep_errors: bool) -> Iterator[pa.Table]:
    for path in paths:
        table = _read_part(path, storage)
        if not keep_errors:
            table = table.filter(pc.is_null(table.column("error")))
        columns = [
            table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
            for f in schema
        ]
        yield pa.table(columns, schema=schema)


def _reader(tables: Iterator[pa.Table], schema: pa.Schema) -> pa.RecordBatchReader:
    return pa.RecordBatchReader.from_batches(schema, (b for t in tables for b in t.to_batches()))


def _delta_app_id(job: str) -> str:
    return f"prefixflow-{job}"


def _append_delta(out: TableOutput, tables: Parts, schema: pa.Schema, job: str, storage: StorageOptions) -> None:
    from deltalake import CommitProperties, Transaction, write_deltalake

    uri, options = storage.table_location(out.format, out.location)
    properties = CommitProperties(
        app_transactions=[Transaction(_delta_app_id(job), 1)], custom_metadata={JOB_ID_PROPERTY: job}
    )
    write_deltalake(
        uri, _reader(tables(), schema), mode="append", storage_options=options, commit_properties=properties
    )


def _lance_dataset(out: TableOutput, storage: StorageOptions) -> Any:
    """The output Lance dataset, None where there is none yet."""
    import lance

    uri, options = storage.table_location(out.format, out.location)
    try:
        return lance.dataset(uri, storage_options=options)
    except (ValueError, FileNotFoundError):  # no dataset there yet
        return None


def _append_lance(out: TableOutput, tables: Parts, schema: pa.Schema, job: str, storage: StorageOptions) -> None:
    import lance

    uri, options = storage.table_location(out.format, out.location)
    lance.write_dataset(
        _reader(tables(), schema),
        uri,
        schema=schema,
        mode="create" if _lance_dataset(out, storage) is None else "append",
        storage_options=options,
        transaction_properties={JOB_ID_PROPERTY: job},
    )


def _existing_iceberg_table(out: TableOutput, storage: StorageOptions) -> Any:
    """The output Iceberg table, None where it does not exist yet."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        return iceberg_catalog(out.catalog, storage).load_table(out.location)
    except NoSuchTableError:
        return None


def _append_iceberg(out: TableOutput, tables: Parts, schema: pa.Schema, job: str, storage: StorageOptions) -> None:
    catalog = iceberg_catalog(out.catalog, storage)
    catalog.create_namespace_if_not_exists(out.location.rsplit(".", 1)[0])
    table = catalog.create_table_if_not_exists(out.location, schema=schema)
    # One append of the parts' stream: one snapshot, one catalog commit (all rows or none).
    table.append(_reader(tables(), schema), snapshot_properties={JOB_ID_PROPERTY: job})


_APPEND = {"delta": _append_delta, "lance": _append_lance, "iceberg": _append_iceberg}
