"""Tables in and out: Delta Lake (delta-rs), Iceberg (pyiceberg, a SQL catalog on sqlite) and Lance,
on local disk and on S3 (moto's server on 127.0.0.1); Unity Catalog's reader arguments only (its
server cannot be reached here).

The fast tests check the spec, the reader's version pin and sample, and the table commit's
idempotency with the formats' own libraries; the slow ones run whole jobs on the session's
local Ray, with real kills and resumes, and read the table back with its own reader.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from prefixflow.jobs.demo import demo_rows
from prefixflow.jobs.spec import SpecError, parse_spec
from prefixflow.operators.results.commit import _what_changed
from prefixflow.operators.results.table_commit import (
    TableOutput,
    commit_to_table,
    job_id,
    output_table_problem,
)
from prefixflow.operators.stages.read_table import (
    TableInput,
    pinned,
    sample_table,
    unity_catalog_arguments,
)
from prefixflow.storage import StorageOptions
from support.s3 import CREDENTIALS, s3_bucket

LOCAL = StorageOptions()
TEMPLATE = "{% if question.strip() %}Document: {{ document }}\nQuestion: {{ question }}\nAnswer:{% endif %}"


def _spec(**over) -> dict:
    spec = {"model": "m", "prompt": {"template": "{{ q }}"}, "input": {"path": "in.jsonl"}, "output": {"path": "out"}}
    spec.update(over)
    return spec


def _problems(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    return dict(e.value.problems)


def test_spec_names_each_format_fields():
    got = _problems(_spec(input={"format": "iceberg", "path": "x"}))
    assert "not used by format iceberg" in got["input.path"]
    assert "required field is missing for format iceberg" in got["input.table"]
    assert "catalog's properties" in got["input.catalog"]
    got = _problems(_spec(input={"path": "in.jsonl", "version": 3, "filter": [["a", "=", 1]]}))
    assert "not used by file input" in got["input.version"] and "not used by file input" in got["input.filter"]
    got = _problems(_spec(input={"format": "delta", "path": "t", "filter": [["a", "~", 1]]}))
    assert "'~' is not an operator" in got["input.filter"]
    got = _problems(_spec(input={"format": "lance", "path": ["a", "b"]}))
    assert "reads one table" in got["input.path"]
    got = _problems(_spec(output={"path": "out", "format": "delta"}))
    assert "required for format delta" in got["output.table"]
    got = _problems(_spec(output={"path": "out", "table": "t"}))
    assert "is for table output" in got["output.table"]
    got = _problems(_spec(input={"format": "iceberg", "table": "q", "catalog": {"py-catalog-impl": "os.system"}}))
    assert "has no namespace" in got["input.table"] and "import Python code" in got["input.catalog"]
    got = _problems(_spec(input={"format": "unity_catalog", "table": "a.b.c", "token_env": "AWS_SECRET_ACCESS_KEY"}))
    assert "not a Databricks variable" in got["input.token_env"]
    got = _problems(_spec(input={"format": "delta", "path": "t"}, output={"path": "out", "format": "openai"}))
    assert "openai output needs input.format: openai" in got["output.format"]
    spec = parse_spec(
        _spec(
            input={"format": "delta", "path": "t", "version": 2, "columns": ["q"], "filter": [["s", "in", ["a"]]]},
            output={"path": "out", "format": "iceberg", "table": "ns.answers", "catalog": {"type": "sql"}},
        )
    )
    job = spec.to_job()
    assert job.read.table == TableInput("delta", "t", 2, ("q",), (("s", "in", ["a"]),))
    assert job.read.format == "parquet" and job.write.format == "parquet"
    assert job.table_out == TableOutput("iceberg", "ns.answers", {"type": "sql"}, "table")
    # The version is in the input's identity as read, not in the spec's: a resume may name it.
    other = parse_spec({**spec.model_dump(), "input": {**spec.input.model_dump(exclude_none=True), "version": 5}})
    assert other.to_job().identity_key == job.identity_key
    # A catalog's properties (its credentials) may change between attempts too.
    rotated = {**spec.output.model_dump(exclude_none=True), "catalog": {"type": "sql", "token": "new"}}
    assert parse_spec({**spec.model_dump(), "output": rotated}).to_job().identity_key == job.identity_key


def _delta(path: Path, rows: list[dict]) -> None:
    from deltalake import write_deltalake

    write_deltalake(str(path), pa.Table.from_pylist(rows), mode="append")


def _iceberg_catalog(root: Path) -> dict[str, str]:
    (root / "warehouse").mkdir(exist_ok=True)
    return {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/warehouse"}


def test_reader_pins_the_newest_version_and_samples_with_columns_and_filter(tmp_path):
    import lance

    from prefixflow.storage import iceberg_catalog

    rows = [{"q": f"q{i}", "split": "test" if i % 2 else "train", "n": i} for i in range(6)]
    _delta(tmp_path / "d", rows[:3])
    _delta(tmp_path / "d", rows[3:])
    lance.write_dataset(pa.Table.from_pylist(rows), str(tmp_path / "l"))
    props = _iceberg_catalog(tmp_path)
    catalog = iceberg_catalog(props, LOCAL)
    catalog.create_namespace("ns")
    catalog.create_table("ns.q", schema=pa.Table.from_pylist(rows).schema).append(pa.Table.from_pylist(rows))
    tables = [
        TableInput("delta", str(tmp_path / "d")),
        TableInput("lance", str(tmp_path / "l")),
        TableInput("iceberg", "ns.q", catalog=props),
    ]
    snapshot = catalog.load_table("ns.q").current_snapshot().snapshot_id
    assert [pinned(t, LOCAL).version for t in tables] == [1, 1, snapshot]
    for table in tables:
        table = TableInput(table.format, table.location, columns=("q", "n"), filter=(("split", "=", "test"),))
        table = TableInput(**{**table.__dict__, "catalog": props if table.format == "iceberg" else {}})
        got = sample_table(pinned(table, LOCAL), LOCAL, 10)
        assert sorted(r["n"] for r in got) == [1, 3, 5] and set(got[0]) == {"q", "n"}, table
    first = sample_table(TableInput("delta", str(tmp_path / "d"), version=0), LOCAL, 10)
    assert sorted(r["n"] for r in first) == [0, 1, 2]


def test_validate_names_columns_the_table_lacks(tiny_model, tmp_path):
    from prefixflow.jobs.preflight import preflight

    _delta(tmp_path / "d", [{"q": "a", "n": 1}])
    spec = _spec(
        model=str(tiny_model),
        input={"format": "delta", "path": str(tmp_path / "d"), "columns": ["qq"], "filter": [["nn", ">", 0]]},
        output={"path": str(tmp_path / "out")},
    )
    with pytest.raises(SpecError) as e:
        preflight(parse_spec(spec))
    got = dict(e.value.problems)
    assert got["input.columns"] == "'qq' is not a column of the table; did you mean 'q'? (columns: q, n)"
    assert got["input.filter"].startswith("'nn' is not a column of the table; did you mean 'n'?")
    ok = {**spec, "input": {**spec["input"], "columns": ["q"], "filter": [["n", ">", 0]]}}
    assert preflight(parse_spec(ok)) == [{"q": "a"}]  # the sample, as the job reads it


def test_unity_catalog_reader_arguments(monkeypatch):
    table = TableInput(
        "unity_catalog", "main.default.q", url="https://x.cloud.databricks.com", token_env="DATABRICKS_MY_TOKEN"
    )
    monkeypatch.delenv("DATABRICKS_MY_TOKEN", raising=False)
    with pytest.raises(ValueError, match="'DATABRICKS_MY_TOKEN' is not set"):
        unity_catalog_arguments(table)
    monkeypatch.setenv("DATABRICKS_MY_TOKEN", "dapi-secret")
    assert unity_catalog_arguments(table) == {
        "table": "main.default.q",
        "url": "https://x.cloud.databricks.com",
        "token": "dapi-secret",
    }
    spec = parse_spec(_spec(input={"format": "unity_catalog", "table": "main.default.q", "url": "https://x"}))
    assert spec.to_job().read.table.token_env == "DATABRICKS_TOKEN"
    assert pinned(spec.to_job().read.table, LOCAL).version is None  # known only to the server


def _parts(folder: Path, tables: list[pa.Table]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, table in enumerate(tables):
        names.append(f"part-r000-{i:09d}.parquet")
        pq.write_table(table, folder / names[-1])
    return names


@pytest.mark.parametrize("fmt", ["delta", "iceberg", "lance"])
def test_table_commit_is_once_per_job(tmp_path, fmt):
    # Two parts, the second with a column that is null in all its rows (Arrow's null type there).
    first = pa.table({"row_id": [0, 1], "answer": ["a", "b"], "error": pa.array([None, "bad"], pa.string())})
    second = pa.table({"row_id": [2], "answer": ["c"], "error": pa.nulls(1)})
    parts = _parts(tmp_path / "out", [first, second])
    location = "ns.answers" if fmt == "iceberg" else str(tmp_path / "answers")
    out = TableOutput(fmt, location, _iceberg_catalog(tmp_path) if fmt == "iceberg" else {})
    assert output_table_problem(out, LOCAL) is None
    job = job_id("ab" * 32)
    done = commit_to_table(out, str(tmp_path / "out"), parts, job, LOCAL)
    assert done["rows_appended"] == 3 and not done["already_committed"]
    again = commit_to_table(out, str(tmp_path / "out"), parts, job, LOCAL)
    assert again == {**done, "rows_appended": 0, "already_committed": True}
    other = commit_to_table(
        TableOutput(fmt, location, out.catalog, "folder"), str(tmp_path / "out"), parts, "cd" * 16, LOCAL
    )
    assert other["rows_appended"] == 2 and other["version"] != done["version"]  # a new job; its errors left out
    rows = _read_back(out)
    assert sorted(r["row_id"] for r in rows) == [0, 0, 1, 2, 2] and sum(r["error"] == "bad" for r in rows) == 1
    if fmt == "iceberg":  # one snapshot per job, whatever its number of parts
        from prefixflow.storage import iceberg_catalog

        assert len(iceberg_catalog(out.catalog, LOCAL).load_table(location).snapshots()) == 2


def test_a_column_null_in_every_row_takes_the_tables_type(tmp_path):
    from deltalake import DeltaTable

    out = TableOutput("delta", str(tmp_path / "answers"))
    first = _parts(tmp_path / "a", [pa.table({"row_id": [0], "score": [0.5], "error": pa.nulls(1, pa.string())})])
    commit_to_table(out, str(tmp_path / "a"), first, "aa" * 16, LOCAL)
    second = _parts(tmp_path / "b", [pa.table({"row_id": [1], "score": pa.nulls(1), "error": pa.nulls(1)})])
    assert commit_to_table(out, str(tmp_path / "b"), second, "bb" * 16, LOCAL)["rows_appended"] == 1
    table = DeltaTable(out.location).to_pyarrow_table()
    assert table.schema.field("score").type == pa.float64() and sorted(table.column("row_id").to_pylist()) == [0, 1]


def test_a_job_without_rows_makes_no_commit(tmp_path):
    out = TableOutput("delta", str(tmp_path / "answers"))
    done = commit_to_table(out, str(tmp_path / "out"), [], "ab" * 16, LOCAL)
    assert done["version"] is None and done["rows_appended"] == 0 and not (tmp_path / "answers").exists()


def _read_back(out: TableOutput, storage: StorageOptions = LOCAL) -> list[dict]:
    if out.format == "delta":
        from deltalake import DeltaTable

        return (
            DeltaTable(out.location, storage_options=storage.object_store_options(out.location) or None)
            .to_pyarrow_table()
            .to_pylist()
        )
    if out.format == "lance":
        import lance

        return (
            lance.dataset(out.location, storage_options=storage.object_store_options(out.location) or None)
            .to_table()
            .to_pylist()
        )
    from prefixflow.storage import iceberg_catalog

    return iceberg_catalog(out.catalog, storage).load_table(out.location).scan().to_arrow().to_pylist()


def test_output_table_problem_names_a_folder_that_is_not_a_table(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "notes.txt").write_text("x")
    assert "exists and is not a delta table" in output_table_problem(TableOutput("delta", str(tmp_path / "t")), LOCAL)
    assert "exists and is not a lance table" in output_table_problem(TableOutput("lance", str(tmp_path / "t")), LOCAL)
    bad = TableOutput("iceberg", "ns.t", {"type": "nope"})
    assert "cannot reach the iceberg table" in output_table_problem(bad, LOCAL)


def test_a_table_read_at_another_version_is_named_on_resume():
    old = {"spec": "s", "model": {}, "inputs": [["delta:/data/q", 3]], "input_content": "c"}
    new = {**old, "inputs": [["delta:/data/q", 5]]}
    why = _what_changed(old, new)
    assert "this run reads the table delta:/data/q at version 5, and the first run read version 3" in why
    assert "input.version: 3" in why


# Whole jobs on the session's local Ray. The driver runs in its own process (start_driver), so
# that a SIGKILL is a real one.
def _rows(seed: int) -> list[dict]:
    rows = demo_rows(num_docs=5, questions_per_doc=6, sentences_per_doc=4, seed=seed)  # 30 rows
    for bad in (4, 19):  # blank questions: the template renders nothing, the row is an error record
        rows[bad]["question"] = "   "
    return rows


def _job_spec(root: Path, model: Path, input_: dict, output: dict) -> Path:
    spec = {
        "model": str(model),
        "input": input_,
        "prompt": {"template": TEMPLATE},
        "sampling": {"temperature": 0, "max_tokens": 24},
        # Few sequences at a time, so that parts commit one after another.
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20, "max_num_seqs": 2},
        "output": {"path": str(root / "out"), "rows_per_part": 2, "resume": True, **output},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _records(out: Path) -> list[dict]:
    folder = out / "_commits"
    return [json.loads(p.read_text()) for p in folder.glob("*.json")] if folder.is_dir() else []


def _wait_for(cond, proc, what: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the driver ended before {what}:\n{proc.log_path.read_text()[-3000:]}"
        assert time.time() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def _kill_after_two_parts(start_driver, job: Path, out: Path) -> None:
    """Run `job` and SIGKILL its driver once two parts are committed."""
    proc = start_driver(job)
    _wait_for(lambda: len(_records(out)) >= 2, proc, "two committed parts")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _resume_whose_commit_fails(start_driver, job: Path, out: Path, block_commit) -> None:
    """Resume `job`; once it has committed a part of its own (it is past its checks and its
    reading), `block_commit()` makes its table commit fail: the resume ends in an error after
    its last part, with every row committed and no _SUCCESS."""
    before = len(_records(out))
    proc = start_driver(job)
    _wait_for(lambda: len(_records(out)) > before, proc, "a part of the resume")
    block_commit()
    assert proc.wait(timeout=300) != 0
    assert not (out / "_SUCCESS").exists()


def _run(start_driver, job: Path, ok: bool = True) -> str:
    proc = start_driver(job)
    rc = proc.wait(timeout=300)
    log = proc.log_path.read_text(errors="replace")
    assert (rc == 0) == ok, f"exit {rc}:\n{log[-4000:]}"
    return log


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _exactly_once(rows: list[dict], got: list[dict]) -> None:
    ids = sorted(r["id"] for r in got)
    assert ids == sorted(r["id"] for r in rows), f"{len(ids)} table rows for {len(rows)} input rows"
    assert sorted(r["id"] for r in got if r["error"] is not None) == sorted([rows[4]["id"], rows[19]["id"]])
    assert all(r["generated_text"] for r in got if r["error"] is None)


@pytest.mark.slow
def test_delta_in_delta_out_exactly_once_through_kills_resumes_and_a_changed_table(start_driver, tiny_model, tmp_path):
    from deltalake import DeltaTable

    rows = _rows(seed=21)
    _delta(tmp_path / "questions", rows)
    table = tmp_path / "answers"
    job = _job_spec(
        tmp_path,
        tiny_model,
        {"format": "delta", "path": str(tmp_path / "questions")},
        {"format": "delta", "table": str(table)},
    )
    out = tmp_path / "out"
    # 1. A kill between parts.
    _kill_after_two_parts(start_driver, job, out)
    # 2. The resume dies between its last part and the table commit: the table's path is taken
    # by a plain file (a real failure of the commit, at that point; nothing in the job is stubbed).
    _resume_whose_commit_fails(start_driver, job, out, lambda: table.write_text("in the way"))
    assert sorted(r for rec in _records(out) for r in rec["row_ids"]) == list(range(len(rows)))
    # 3. The next resume runs no row and commits every row to the table, once.
    table.unlink()
    log = _run(start_driver, job)
    assert f"{len(rows)} rows appended in one commit (version 0)" in log
    metrics = _metrics(out)
    assert metrics["fault_tolerance"]["rows_written"] == 0
    assert metrics["table"]["rows_appended"] == len(rows) and not metrics["table"]["already_committed"]
    _exactly_once(rows, DeltaTable(str(table)).to_pyarrow_table().to_pylist())
    # 4. The same job again from scratch (overwrite): the table already holds its rows.
    job.write_text(job.read_text().replace("resume: true", "overwrite: true"))
    log = _run(start_driver, job)
    assert "already held this job's rows (version 0): nothing appended" in log
    assert _metrics(out)["table"]["already_committed"] and _metrics(out)["table"]["rows_appended"] == 0
    _exactly_once(rows, DeltaTable(str(table)).to_pyarrow_table().to_pylist())
    # 5. The input table changed under a resume: refused by name.
    _delta(tmp_path / "questions", rows[:1])
    job.write_text(job.read_text().replace("overwrite: true", "resume: true"))
    (out / "_SUCCESS").unlink()
    # In this process (the session's Ray): the refusal comes before any engine starts, and the
    # CLI prints the same message (a driver process would only add its start-up).
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import load_spec

    with pytest.raises(ValueError, match="at version 1, and the first run read version 0") as refused:
        run_job(load_spec(job), quiet=True)
    assert "input.version: 0" in str(refused.value)
    assert DeltaTable(str(table)).version() == 0


@pytest.mark.slow
def test_iceberg_in_iceberg_out_exactly_once_through_kills_and_resumes(start_driver, tiny_model, tmp_path):
    from prefixflow.storage import iceberg_catalog

    rows = _rows(seed=22)
    props = _iceberg_catalog(tmp_path)
    catalog = iceberg_catalog(props, LOCAL)
    catalog.create_namespace("jobs")
    data = pa.Table.from_pylist(rows)
    catalog.create_table("jobs.questions", schema=data.schema).append(data)
    out_table = TableOutput("iceberg", "jobs.answers", props)
    job = _job_spec(
        tmp_path,
        tiny_model,
        {"format": "iceberg", "table": "jobs.questions", "catalog": props},
        {"format": "iceberg", "table": "jobs.answers", "catalog": props},
    )
    out = tmp_path / "out"
    _kill_after_two_parts(start_driver, job, out)
    # The resume loses its catalog once it is past reading the input (the sqlite file moved
    # away, a folder in its place): its table commit fails after the last part.
    db = tmp_path / "catalog.db"

    def move_the_catalog_away() -> None:
        db.rename(tmp_path / "catalog.db.away")
        db.mkdir()

    _resume_whose_commit_fails(start_driver, job, out, move_the_catalog_away)
    assert sorted(r for rec in _records(out) for r in rec["row_ids"]) == list(range(len(rows)))
    db.rmdir()
    (tmp_path / "catalog.db.away").rename(db)
    assert not catalog.table_exists("jobs.answers")
    _run(start_driver, job)
    assert _metrics(out)["fault_tolerance"]["rows_written"] == 0
    _exactly_once(rows, _read_back(out_table))
    # A resume of the finished job would find the job's snapshot and append nothing:
    # test_table_commit_is_once_per_job[iceberg] checks that without a whole job.


@pytest.mark.slow
def test_lance_in_parquet_out_with_columns_a_filter_and_a_kill(start_driver, tiny_model, tmp_path):
    import lance

    from prefixflow.operators.results.write import read_output

    rows = [{**r, "split": "test" if r["id"] % 3 else "train", "extra": "x" * 10} for r in _rows(seed=23)]
    lance.write_dataset(pa.Table.from_pylist(rows), str(tmp_path / "questions.lance"))
    job = _job_spec(
        tmp_path,
        tiny_model,
        {
            "format": "lance",
            "path": str(tmp_path / "questions.lance"),
            "columns": ["id", "document", "question"],
            "filter": [["split", "=", "test"]],
        },
        {"format": "parquet"},
    )
    out = tmp_path / "out"
    _kill_after_two_parts(start_driver, job, out)
    _run(start_driver, job)
    assert 0 < _metrics(out)["fault_tolerance"]["rows_committed_before"]
    got = read_output(str(out)).to_pylist()
    wanted = [r for r in rows if r["split"] == "test"]
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in wanted)  # each once
    assert "extra" not in got[0] and "split" not in got[0]
    assert sorted(r["id"] for r in got if r["error"]) == sorted(r["id"] for r in wanted if not r["question"].strip())


@pytest.mark.slow
def test_delta_on_s3_in_and_out_once(ray_local, tiny_model, s3_server):
    from deltalake import DeltaTable, write_deltalake

    from prefixflow.jobs.run import run_job

    storage = s3_bucket(s3_server, "pf-tables")
    rows = _rows(seed=24)
    options = storage.object_store_options("s3://pf-tables/questions")
    write_deltalake("s3://pf-tables/questions", pa.Table.from_pylist(rows), storage_options=options)
    spec = {
        "model": str(tiny_model),
        "input": {"format": "delta", "path": "s3://pf-tables/questions"},
        "prompt": {"template": TEMPLATE},
        "sampling": {"temperature": 0, "max_tokens": 4},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
        "output": {"path": "s3://pf-tables/out/", "format": "delta", "table": "s3://pf-tables/answers"},
        "storage": {"endpoint_url": s3_server, **CREDENTIALS},
    }
    first = run_job(parse_spec(spec), quiet=True)["table"]
    assert first["rows_appended"] == len(rows) and first["version"] == 0
    spec["output"]["resume"] = True  # the finished job again: its rows are in the table already
    again = run_job(parse_spec(spec), quiet=True)["table"]
    assert again == {**first, "rows_appended": 0, "already_committed": True}
    _exactly_once(rows, DeltaTable("s3://pf-tables/answers", storage_options=options).to_pyarrow_table().to_pylist())
