"""Input values reach the prompt and the output as they were written (issue 27, classes 1, 5
and 9), in whole jobs on the session's real local Ray:

- a column of mixed types keeps its strings exactly (no JSON quoting, escaped newlines or
  accents), in the prompt and in the output;
- files (or byte ranges of one file) whose column types differ are read, the clashing
  columns by the same text rule, instead of failing the job with an ArrowTypeError;
- a CSV whose header names a column twice, and input columns named `_pf_*`, become error
  records that say why, never a crash or a silently dropped column;
- the JSONL writer writes strict JSON: no NaN or Infinity, integers beyond int64 as numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.write import read_output
from prefixflow.operators.stages.read import ReadOptions, file_ranges, parse_file
from prefixflow.storage import StorageOptions

pytestmark = pytest.mark.slow


def _run(
    tmp_path: Path, model: Path, path: str, prompt: dict, fmt: str = "jsonl", include_prompt: bool = True, **input_extra
) -> list[dict]:
    spec = parse_spec(
        {
            "model": str(model),
            "input": {"path": path, **input_extra},
            "prompt": prompt,
            "sampling": {"temperature": 0, "max_tokens": 2},
            "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
            "output": {
                "path": str(tmp_path / "out"),
                "format": fmt,
                "rows_per_part": 3,
                "include_prompt": include_prompt,
            },
        }
    )
    run_job(spec, quiet=True)
    out = read_output(str(tmp_path / "out"))
    return out.to_pylist() if isinstance(out, pa.Table) else out


def test_a_mixed_column_keeps_its_strings_and_reserved_names_are_refused(ray_local, tiny_model, tmp_path):
    questions = ["What is a river?", "Qu'est-ce qu'une \"rivière\"?\nDis-moi.", 42, "naïve café"]
    lines = [json.dumps({"id": i, "q": q}, ensure_ascii=False) for i, q in enumerate(questions)]
    # sampling_params as JSON text in one row, as an object in the others: both are read.
    lines.append(json.dumps({"id": 4, "q": "text params", "sampling_params": '{"max_tokens": 1}'}))
    lines.append(json.dumps({"id": 5, "q": "object params", "sampling_params": {"max_tokens": 1}}))
    # A reserved column name: the row is an error record that says why; its other columns stay.
    lines.append(json.dumps({"id": 6, "q": "hi", "_pf_note": "mine"}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    rows = {r["id"]: r for r in _run(tmp_path, tiny_model, str(tmp_path / "in.jsonl"), {"template": "Q: {{ q }}"})}
    for i, q in enumerate(questions):
        want = q if isinstance(q, str) else "42"
        assert rows[i]["q"] == want and rows[i]["prompt"] == f"Q: {want}", rows[i]
        assert rows[i]["error"] is None
    for i in (4, 5):
        assert rows[i]["error"] is None and rows[i]["num_generated_tokens"] == 1, rows[i]
    assert "'_pf_note'" in rows[6]["error"] and "reserved" in rows[6]["error"]


def test_files_whose_column_types_differ_are_read(ray_local, tiny_model, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"id": i, "q": f"question {i}"}) + "\n" for i in range(4)))
    (folder / "b.jsonl").write_text("".join(json.dumps({"id": f"x{i}", "q": f"other {i}"}) + "\n" for i in range(3)))
    rows = _run(tmp_path, tiny_model, str(folder), {"template": "Q: {{ q }}"}, format="jsonl")
    assert sorted(r["id"] for r in rows) == ["0", "1", "2", "3", "x0", "x1", "x2"]
    assert all(r["error"] is None and r["num_generated_tokens"] >= 1 for r in rows)
    csv_folder = tmp_path / "csv"
    csv_folder.mkdir()
    (csv_folder / "a.csv").write_text("id,q\n1,one\n2,two\n")
    (csv_folder / "b.csv").write_text("id,q\nx,three\n")
    # A header that names a column twice: that file's row is an error record saying so, the
    # other files are read (in the same job: one whole job fewer).
    (csv_folder / "c.csv").write_text("q,id,q\nfirst,3,second\n")
    rows = _run(tmp_path / "b", tiny_model, str(csv_folder), {"template": "Q: {{ q }}"}, format="csv")
    assert sorted(r["id"] for r in rows if r["error"] is None) == ["1", "2", "x"]
    bad = [r for r in rows if r["error"]]
    assert len(rows) == 4 and len(bad) == 1, rows
    assert "names column 'q' twice (columns 1 and 3)" in bad[0]["error"]


def test_byte_ranges_of_one_file_whose_types_differ_are_read(ray_local, tmp_path):
    """A large JSONL file is read by several tasks (byte ranges): a column int in the first
    range and text in the last is found by the first pass and read as text in every range."""
    from prefixflow.operators.stages.read import clashing_columns

    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"id": i if i < 50 else f"r{i}", "q": "x" * 40}) + "\n" for i in range(100)))
    opts = ReadOptions(path=str(path), format="jsonl", chunk_bytes=1000)
    items = file_ranges([str(path)], opts)
    assert len(items) > 2
    clash = clashing_columns([str(path)], StorageOptions(), "jsonl", items)
    assert clash == ["id"]
    tables = [parse_file(str(path), "jsonl", StorageOptions(), it["start"], it["end"], clash) for it in items]
    table = pa.concat_tables(tables)
    assert table.column("id").to_pylist() == [str(i) if i < 50 else f"r{i}" for i in range(100)]


def test_parquet_values_reach_prompts_as_text_and_jsonl_as_strict_json(ray_local, tiny_model, tmp_path):
    """Binary values reach the prompt as the UTF-8 text they hold (it rendered "b'...'"); bytes
    that are not text fail only a row whose prompt reads them. The JSONL writer writes strict
    JSON: NaN and infinities as null, integers beyond int64 exactly, bytes as base64."""
    import base64

    table = pa.table(
        {
            "q": pa.array(["héllo".encode(), b"\xff\xfe", b"plain"], pa.binary()),
            "blob": pa.array([b"\x00\x01", b"\xff", b""], pa.binary()),
            "score": [float("nan"), float("inf"), 1.5],
            "big": pa.array([2**70, 1, 2], pa.decimal128(38, 0)),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    _run(tmp_path, tiny_model, str(tmp_path / "in.parquet"), {"template": "Q: {{ q }}"})

    def strict(token: str) -> float:
        raise ValueError(f"not JSON: {token}")

    lines = [line for p in sorted((tmp_path / "out").glob("part-*")) for line in p.read_text().splitlines()]
    rows = {r["big"]: r for r in (json.loads(line, parse_constant=strict) for line in lines)}
    hello, bad, plain = rows[2**70], rows[1], rows[2]
    assert hello["prompt"] == "Q: héllo" and plain["prompt"] == "Q: plain" and hello["error"] is None
    assert "column 'q' holds bytes that are not UTF-8 text" in bad["error"]
    assert hello["score"] is None and bad["score"] is None and plain["score"] == 1.5
    assert [base64.b64decode(r["blob"]) for r in (hello, bad, plain)] == [b"\x00\x01", b"\xff", b""]
