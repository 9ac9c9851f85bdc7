"""Read a table (Delta Lake, Iceberg, Lance, Unity Catalog) at one version, through Ray's readers.

A job reads a table as it was at one version: the one the spec names (`input.version`: a Delta
or Lance version, an Iceberg snapshot id), else the newest when the job starts (`pinned`), so
that rows added while the job runs are not half read. The version read is part of what a resume
must find unchanged (`identity`, in `_job.json`): a resume whose spec names no version reads the
newest again, and when the table has moved on the resume is refused by name (the message gives
the version to pin to finish the first run's rows). A resume never pins silently: the rows added
since would be left out without a word.

`columns` and `filter` are pushed down to the reader. A filter is data, never code: a list of
[column, operator, value] triples that must all hold, turned into Ray Data expressions
(`filter_expression`). Unity Catalog tables are read by Ray's `read_unity_catalog` (credential
vending); its token comes from the environment variable the spec names, never from the spec.
Its server is not reachable from the machines this project is tested on: only the reader's
arguments are tested (`unity_catalog_arguments`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

from prefixflow.errors import did_you_mean
from prefixflow.storage import StorageOptions, iceberg_catalog, masked

TableFormat = Literal["delta", "iceberg", "lance", "unity_catalog"]  # config.INPUT_TABLE_FORMATS
# Formats whose table is a path or URL; the others name a table in a catalog.
PATH_TABLES = ("delta", "lance")
FILTER_OPERATORS = ("=", "!=", "<", "<=", ">", ">=", "in", "not in")


@dataclass(frozen=True)
class TableInput:
    """A table to read. `location`: the table's path or URL (delta, lance) or its name
    (iceberg: namespace.table; unity_catalog: catalog.schema.table)."""

    format: TableFormat
    location: str
    version: int | None = None  # Delta/Lance version, Iceberg snapshot id; None: the newest
    columns: tuple[str, ...] | None = None
    filter: tuple[tuple[str, str, Any], ...] = ()
    catalog: dict[str, str] = field(default_factory=dict, repr=False)  # iceberg: pyiceberg's properties
    url: str | None = None  # unity_catalog: the workspace URL
    token_env: str = "DATABRICKS_TOKEN"  # unity_catalog: where the token is
    region: str | None = None  # unity_catalog: the storage's region, where it needs one

    @property
    def name(self) -> str:
        """How messages and `_job.json` name the table (a URL without its credentials)."""
        return f"{self.format}:{masked(self.location)}"

    def identity(self) -> list[list[Any]]:
        """What a resume must find unchanged: the table and the version read (`pinned` first)."""
        return [[self.name, self.version]]


def pinned(table: TableInput, storage: StorageOptions) -> TableInput:
    """`table` with its version fixed: the one given, else the newest now. A Unity Catalog
    table's version is not known before Ray's reader asks the server: None (a resume then
    relies on the input's content digest alone)."""
    if table.version is not None or table.format == "unity_catalog":
        return table
    if table.format == "delta":
        return _replace_version(table, _delta(table, storage).version())
    if table.format == "lance":
        return _replace_version(table, _lance(table, storage).version)
    snapshot = _iceberg_table(table, storage).current_snapshot()
    if snapshot is None:
        raise ValueError(f"input: the Iceberg table {table.location!r} has no snapshot (no rows were ever added)")
    return _replace_version(table, snapshot.snapshot_id)


def _replace_version(table: TableInput, version: int) -> TableInput:
    import dataclasses

    return dataclasses.replace(table, version=int(version))


def read_table(table: TableInput, storage: StorageOptions) -> Any:
    """A lazy ray.data.Dataset of the table's rows at `table.version` (its columns and filter
    applied), before the bookkeeping columns are added."""
    import ray.data

    wanted = list(table.columns) if table.columns else None
    # The filter's columns are read too (then dropped): a reader that cannot push the filter
    # down filters after the read, which needs them.
    extra = [name for name, _, _ in table.filter if wanted is not None and name not in wanted]
    columns = None if wanted is None else wanted + list(dict.fromkeys(extra))
    if table.format == "delta":
        uri, options = storage.table_location(table.format, table.location)
        ds = ray.data.read_delta(uri, version=table.version, storage_options=options, columns=columns)
    elif table.format == "lance":
        uri, options = storage.table_location(table.format, table.location)
        ds = ray.data.read_lance(uri, version=table.version, columns=columns, storage_options=options)
    elif table.format == "iceberg":
        ds = ray.data.read_iceberg(
            table_identifier=table.location,
            snapshot_id=table.version,
            selected_fields=tuple(columns) if columns else ("*",),
            catalog_kwargs=storage.iceberg_catalog_properties(table.catalog),
        )
    else:
        ds = ray.data.read_unity_catalog(**unity_catalog_arguments(table))
        if columns:
            ds = ds.select_columns(columns)
    if table.filter:
        ds = ds.filter(expr=filter_expression(table.filter))
    if extra and wanted is not None:
        ds = ds.select_columns(wanted)
    return ds


def sample_table(table: TableInput, storage: StorageOptions, n: int) -> list[dict[str, Any]]:
    """The first n rows of the table (its columns and filter applied), read on this machine
    without Ray, for the job's checks before it starts. Unity Catalog: none (only Ray's reader
    asks its server for credentials)."""
    if table.format == "unity_catalog":
        return []
    columns = list(table.columns) if table.columns else None
    expr = arrow_filter(table.filter) if table.filter else None
    if table.format == "delta":
        dataset = _delta(table, storage).to_pyarrow_dataset()
    elif table.format == "lance":
        dataset = _lance(table, storage)
    else:
        return _iceberg_sample(table, storage, n, columns, expr)
    return dataset.head(n, columns=columns, filter=expr).to_pylist()


def _iceberg_sample(table: TableInput, storage: StorageOptions, n: int, columns: list[str] | None, expr: Any) -> list:
    """The first n rows that pass the filter, read batch by batch (never the whole table)."""
    scan = _iceberg_table(table, storage).scan(snapshot_id=table.version, limit=n if expr is None else None)
    rows: list[dict[str, Any]] = []
    for batch in scan.to_arrow_batch_reader():
        got = pa.Table.from_batches([batch])
        got = got.filter(expr) if expr is not None else got
        rows += got.select(columns or got.column_names).slice(0, n - len(rows)).to_pylist()
        if len(rows) >= n:
            break
    return rows


def table_columns(table: TableInput, storage: StorageOptions) -> list[str] | None:
    """The table's column names at its version (None: a Unity Catalog table, whose schema only
    its server knows)."""
    if table.format == "unity_catalog":
        return None
    if table.format == "delta":
        return list(pa.schema(_delta(table, storage).schema().to_arrow()).names)
    if table.format == "lance":
        return list(_lance(table, storage).schema.names)
    return [f.name for f in _iceberg_table(table, storage).schema().fields]


def column_problems(table: TableInput, names: list[str]) -> list[tuple[str, str]]:
    """(field, why) for each column that `columns` or `filter` names and the table lacks."""

    def why(name: str) -> str:
        hint = did_you_mean(name, names)
        return f"{name!r} is not a column of the table{'; ' + hint if hint else ''} (columns: {', '.join(names)})"

    asked = [("columns", c) for c in table.columns or ()] + [("filter", n) for n, _, _ in table.filter]
    return [(field, why(name)) for field, name in asked if name not in names]


def filter_expression(triples: tuple[tuple[str, str, Any], ...]) -> Any:
    """The Ray Data expression that holds where every [column, operator, value] holds."""
    from ray.data.expressions import col

    def one(name: str, op: str, value: Any) -> Any:
        c = col(name)
        return {
            "=": lambda: c == value,
            "!=": lambda: c != value,
            "<": lambda: c < value,
            "<=": lambda: c <= value,
            ">": lambda: c > value,
            ">=": lambda: c >= value,
            "in": lambda: c.is_in(list(value)),
            "not in": lambda: c.not_in(list(value)),
        }[op]()

    exprs = [one(*t) for t in triples]
    out = exprs[0]
    for e in exprs[1:]:
        out = out & e
    return out


def arrow_filter(triples: tuple[tuple[str, str, Any], ...]) -> Any:
    """The same filter as a pyarrow compute expression (the driver's sample)."""
    import pyarrow.parquet as pq

    return pq.filters_to_expression([[(n, op, list(v) if op in ("in", "not in") else v) for n, op, v in triples]])


def filter_problems(triples: Any) -> str | None:
    """Why `triples` is not a filter (None: it is one)."""
    if not isinstance(triples, (list, tuple)) or not triples:
        return 'give a list of [column, operator, value] triples, e.g. [["split", "=", "test"]]'
    for t in triples:
        if not isinstance(t, (list, tuple)) or len(t) != 3 or not isinstance(t[0], str):
            return f"{t!r} is not a [column, operator, value] triple"
        if t[1] not in FILTER_OPERATORS:
            return f"{t[1]!r} is not an operator: use one of {', '.join(FILTER_OPERATORS)}"
        many = t[1] in ("in", "not in")
        values = t[2] if many and isinstance(t[2], (list, tuple)) else [t[2]]
        if many and not isinstance(t[2], (list, tuple)):
            return f"{t[1]!r} takes a list of values, e.g. [{t[0]!r}, {t[1]!r}, [1, 2]]"
        if any(not isinstance(v, (str, int, float, bool)) for v in values):
            return f"{t[2]!r}: compare with a string, a number or true/false"
    return None


# The environment variables a spec may name as its Databricks token: a spec must not send the
# machine's other secrets (AWS_SECRET_ACCESS_KEY, ...) to the URL it names.
TOKEN_ENV = re.compile(r"^(DATABRICKS_[A-Z0-9_]+|[A-Z0-9_]*DATABRICKS[A-Z0-9_]*TOKEN[A-Z0-9_]*)$")


def token_env_problem(name: str) -> str | None:
    """Why `name` may not be a spec's token_env (None: it may)."""
    if TOKEN_ENV.match(name):
        return None
    return f"{name!r} is not a Databricks variable: name one that starts with DATABRICKS_ (e.g. DATABRICKS_TOKEN)"


def unity_catalog_arguments(table: TableInput) -> dict[str, Any]:
    """Ray's read_unity_catalog arguments: the token from the environment variable named."""
    problem = token_env_problem(table.token_env)
    if problem:
        raise ValueError(f"input.token_env: {problem}")
    token = os.environ.get(table.token_env)
    if not token:
        raise ValueError(
            f"input.token_env: the environment variable {table.token_env!r} is not set: set it to "
            "a Databricks token (a personal access token or a service principal's) for the workspace"
        )
    url = table.url or os.environ.get("DATABRICKS_HOST")
    if not url:
        raise ValueError(
            "input.url: give the workspace URL (https://<workspace>.cloud.databricks.com) or set DATABRICKS_HOST"
        )
    args: dict[str, Any] = {"table": table.location, "url": url, "token": token}
    if table.region:
        args["region"] = table.region
    return args


def _delta(table: TableInput, storage: StorageOptions) -> Any:
    from deltalake import DeltaTable

    uri, options = storage.table_location(table.format, table.location)
    return DeltaTable(uri, version=table.version, storage_options=options)


def _lance(table: TableInput, storage: StorageOptions) -> Any:
    import lance

    uri, options = storage.table_location(table.format, table.location)
    return lance.dataset(uri, version=table.version, storage_options=options)


def _iceberg_table(table: TableInput, storage: StorageOptions) -> Any:
    return iceberg_catalog(table.catalog, storage).load_table(table.location)
