"""Readers and templates without Ray: bad lines become error records, templates run sandboxed."""

from __future__ import annotations

import json
import os

import pytest

from prefixflow.operators.results.openai_output import output_line
from prefixflow.operators.stages.openai_batch import parse_requests
from prefixflow.operators.stages.read import infer_format, parse_csv, parse_jsonl, rows_to_table
from prefixflow.operators.template import PromptTemplate, RowError, messages_from_value


def test_jsonl_bad_lines_are_kept_as_errors():
    data = b'{"a": 1}\r\n\n{"a": \n\xff\xfe{"a": 3}\n"just a string"\n{"a": 5}'
    recs = parse_jsonl(data, "f.jsonl")
    assert [r.get("a") for r in recs] == [1, None, None, None, 5]
    errs = [r["_pf_error"] for r in recs]
    assert errs[0] is None and errs[4] is None
    assert "line 3 is not valid JSON" in errs[1]
    assert "line 4 is not valid UTF-8" in errs[2] and "0xff" in errs[2]
    assert "not an object" in errs[3]
    assert [r["_pf_source"] for r in recs] == ["f.jsonl:1", "f.jsonl:3", "f.jsonl:4", "f.jsonl:5", "f.jsonl:6"]


def test_rows_to_table_mixed_types_become_text_leaving_strings_as_they_are():
    """A column Arrow cannot type is text by one rule: strings unchanged (not JSON-quoted, no
    escaped newlines or accents), other values as their JSON (issue 27, class 1)."""
    table = rows_to_table(
        [
            {"x": 1, "y": "a"},
            {"x": "two", "z": [1, 2]},
            {"x": "Qu'est-ce qu'une \"rivière\"?\nDis-moi."},
            {"x": {"k": "é"}},
        ]
    )
    assert table.column("x").to_pylist() == ["1", "two", "Qu'est-ce qu'une \"rivière\"?\nDis-moi.", '{"k": "é"}']
    assert table.column("y").to_pylist() == ["a", None, None, None]
    assert table.column("z").to_pylist() == [None, [1, 2], None, None]
    big = rows_to_table([{"n": 2**70}, {"n": 3}])  # beyond int64: kept exactly, not as text
    assert [int(v) for v in big.column("n").to_pylist()] == [2**70, 3]


def test_csv_malformed_rows_become_errors():
    table = parse_csv(b"q,a\nhello,1\nbad,row,extra\nbye,2\n", "f.csv")
    rows = table.to_pylist()
    assert [r["q"] for r in rows if r["_pf_error"] is None] == ["hello", "bye"]
    (bad,) = [r for r in rows if r["_pf_error"]]
    assert "3 fields" in bad["_pf_error"] and bad["_pf_raw"] == "bad,row,extra"


def test_infer_format():
    assert infer_format("x/data.parquet") == "parquet" and infer_format(["a.jsonl"]) == "jsonl"
    with pytest.raises(ValueError, match="input.format"):
        infer_format("s3://bucket/folder/")


def test_template_missing_or_null_column_is_a_row_error():
    t = PromptTemplate(template="Q: {{ question }}")
    assert t.render({"question": "why?"}) == "Q: why?"
    for row in ({}, {"question": None}):
        with pytest.raises(RowError, match="undefined"):
            t.render(row)


def test_template_sandbox_blocks_code():
    for source in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ question.__init__.__globals__ }}",
        "{% set x = [] %}{{ x.append(1) }}",
    ):
        with pytest.raises(RowError):
            PromptTemplate(template=source).render({"question": "q"})


def test_chat_templates_and_messages():
    t = PromptTemplate(system="Be brief.", user="{{ q }}")
    assert t.render({"q": "hi"}) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    with pytest.raises(RowError, match="empty prompt"):
        t.render({"q": "   "})
    assert messages_from_value(json.dumps([{"role": "user", "content": "x"}]), "m")[0]["content"] == "x"
    for bad in (None, [], [{"content": "x"}], [{"role": "user", "content": ""}]):
        with pytest.raises(RowError):
            messages_from_value(bad, "m")


def test_openai_request_parsing():
    recs = parse_jsonl(
        b"\n".join(
            [
                json.dumps(
                    {
                        "custom_id": "a",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "seed": 3},
                    }
                ).encode(),
                json.dumps({"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}}).encode(),
                json.dumps({"url": "/v1/completions", "body": {"prompt": "x"}}).encode(),
                b'{"custom_id": "c\\"q", "body": ',
            ]
        ),
        "b.jsonl",
    )
    rows = parse_requests(recs)
    assert rows[0]["_pf_error"] is None and json.loads(rows[0]["_pf_sampling"]) == {"max_tokens": 5, "seed": 3}
    assert rows[1]["_pf_error"] is None and json.loads(rows[1]["_pf_sampling"]) == {"n": 2}  # n honoured
    assert "custom_id is missing" in rows[2]["_pf_error"]
    assert rows[3]["custom_id"] == 'c"q' and "not valid JSON" in rows[3]["_pf_error"]


def test_openai_output_lines():
    ok = {
        "custom_id": "a",
        "row_id": 0,
        "error": None,
        "generated_text": "hi",
        "num_input_tokens": 3,
        "num_generated_tokens": 1,
        "finish_reason": "stop",
        "_pf_url": "/v1/chat/completions",
    }
    line = output_line(ok, created=1, default_model="m")
    assert line["error"] is None and line["response"]["body"]["choices"][0]["message"]["content"] == "hi"
    bad = output_line({**ok, "error": "boom"}, created=1, default_model="m")
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["message"] == "boom"
    assert output_line(ok, 1, "m")["id"] == line["id"]  # deterministic ids


def test_byte_ranges_cover_every_line_once(tmp_path):
    import random

    from prefixflow.operators.stages.read import ReadOptions, file_ranges, parse_file
    from prefixflow.storage import StorageOptions

    rng = random.Random(0)
    lines = [json.dumps({"i": i, "pad": "x" * rng.randrange(0, 40)}) for i in range(300)]
    lines[17] = '{"i": 17, broken'
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for chunk in (1, 7, 64, 1000, 10**6):
        opts = ReadOptions(path=str(path), format="jsonl", chunk_bytes=chunk)
        items = file_ranges([str(path)], opts)
        rows = [
            r
            for it in items
            for r in parse_file(str(path), "jsonl", StorageOptions(), it["start"], it["end"]).to_pylist()
        ]
        assert sorted(r["i"] for r in rows if r["_pf_error"] is None) == [i for i in range(300) if i != 17]
        assert sum(r["_pf_error"] is not None for r in rows) == 1


def test_parquet_clashing_columns_are_read_as_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prefixflow.operators.stages.read import clashing_columns, parse_file
    from prefixflow.storage import StorageOptions

    files = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(pa.table({"q": [1, 2], "n": pa.array([1, 2], pa.int32()), "s": [{"x": 1}, None]}), files[0])
    pq.write_table(pa.table({"q": ["x", None], "n": pa.array([3, 4], pa.int64()), "s": ["t", "u"]}), files[1])
    clash = clashing_columns(files, StorageOptions())
    assert clash == ["q", "s"]  # int32 and int64 promote; int and string do not
    tables = [parse_file(f, "parquet", StorageOptions(), text_columns=clash) for f in files]
    table = pa.concat_tables(tables, promote_options="permissive")  # one schema again
    assert table.column("q").to_pylist() == ["1", "2", "x", None]
    assert table.column("s").to_pylist() == ['{"x": 1}', None, "t", "u"]
    assert table.column("n").type == pa.int64() and table.column("_pf_error").null_count == 4


def test_parquet_footer_readers_at_most_one_per_file(monkeypatch):
    """Ray 2.60's parquet reader sizes its footer-reader actor pool from the environment when
    read_parquet is called (32 by default, whatever the file count): a job's read asks for one
    per file, at most 32, and keeps a value the user set."""
    from ray.data._internal.datasource_v2.formats.parquet.footer_file_indexer import FooterFileIndexer

    from prefixflow.operators.stages.read import FOOTER_READERS, _footer_readers

    monkeypatch.delenv(FOOTER_READERS, raising=False)
    for files, actors in ((1, 1), (3, 3), (500, 32)):
        with _footer_readers(files):
            assert FooterFileIndexer(ignore_missing_paths=False)._num_actors == actors
        assert FOOTER_READERS not in os.environ
    monkeypatch.setenv(FOOTER_READERS, "7")
    with _footer_readers(1):
        assert FooterFileIndexer(ignore_missing_paths=False)._num_actors == 7
