"""Hostile input fuzzed straight through the reader and the resume checks (issue 27), no Ray:

- rows whose columns mix types keep every string exactly and every other value either typed
  or as its documented text (read.to_text); no row is lost;
- CSV files with any header (names twice, reserved names, blanks) read into one row or one
  error record per data line;
- any output folder a hostile hand can leave (commit records naming paths outside, records
  that do not parse or name another part, damaged parts, junk `_job.json`) makes
  load_committed and check_job_file either refuse by name (ValueError) or count only parts
  whose content matches their record, and nothing outside the output folder is touched.

About 150 generated cases per run, each in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixflow.operators.columns import ERROR, SOURCE
from prefixflow.operators.results.commit import COMMITS, check_job_file, load_committed
from prefixflow.operators.stages.read import parse_csv, parse_jsonl, rows_to_table, to_text
from prefixflow.storage import StorageOptions

FAST = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

scalars = st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=False) | st.text(max_size=12)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(string.ascii_lowercase, max_size=3), c, max_size=3),
    max_leaves=6,
)
rows = st.lists(st.dictionaries(st.sampled_from(["q", "id", "n", "_pf_x"]), values, max_size=4), min_size=1, max_size=8)


@FAST
@given(rows)
def test_fuzzed_rows_keep_their_strings_and_every_row(records):
    lines = b"\n".join(json.dumps(r, ensure_ascii=False).encode() for r in records)
    parsed = parse_jsonl(lines, "f.jsonl")
    assert len(parsed) == len(records)  # one record per line, good or error
    table = rows_to_table(parsed).to_pylist()
    for given_row, got in zip(records, table):
        if any(k.startswith("_pf_") for k in given_row):
            assert "reserved" in got[ERROR]
        for key, value in given_row.items():
            if key.startswith("_pf_"):
                continue
            if isinstance(value, str):
                assert got[key] == value  # never quoted or escaped
            elif _typed(got[key]) != _typed(value):
                assert got[key] == to_text(value)


def _typed(value: object) -> object:
    """A value as a typed column gives it back: Arrow's structs give every row each key of the
    column (null where a row had none), ints beyond int64 come back as exact decimals."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if type(value).__name__ == "Decimal" and value == int(value):  # type: ignore[call-overload]
        return int(value)  # type: ignore[call-overload]
    return value


names = st.sampled_from(["q", "a", "_pf_error", "_pf_x", "id", ""])


@FAST
@given(
    st.lists(names, min_size=1, max_size=4).filter(lambda h: h != [""]),  # a blank line is no header
    st.lists(st.lists(st.text(string.ascii_letters + ' ,"', max_size=6), min_size=1, max_size=4), max_size=5),
)
def test_fuzzed_csv_headers_give_one_record_per_line(header, body):
    text = (
        ",".join(header) + "\n" + "".join(",".join(f'"{v.replace(chr(34), "")}"' for v in row) + "\n" for row in body)
    )
    table = parse_csv(text.encode(), "f.csv")  # never raises
    assert all(parse_csv(empty, "f.csv").num_rows == 0 for empty in (b"", b"\n\n", b"\xef\xbb\xbf"))
    (broken,) = parse_csv(b'q,"a\n1,2\n', "f.csv").column(ERROR).to_pylist()
    assert "cannot be read as CSV" in broken
    assert table.num_rows == len(body)
    assert not [c for c in table.column_names if c.startswith("_pf_") and c not in (SOURCE, ERROR, "_pf_raw")]
    if len(set(header)) < len(header) or any(h.startswith("_pf_") for h in header):
        assert all(e for e in table.column(ERROR).to_pylist())


part_names = st.sampled_from(
    [
        "part-r000-000000000.jsonl",
        "part-r001-000000004.jsonl",
        "../victim",
        "../../victim",
        "/etc/passwd",
        "part-x/../../victim",
        "part-r000-000000008.parquet",
        "victim",
    ]
)
record_kinds = st.sampled_from(
    ["good", "junk_json", "other_part", "wrong_size", "wrong_sha", "no_sha", "not_a_dict", "missing_part"]
)


@FAST
@given(
    st.lists(st.tuples(part_names, record_kinds), max_size=5),
    st.sampled_from(["{}", "{bad", "[]", '{"fingerprint": "x"}', None]),
)
def test_fuzzed_output_folders_never_reach_outside(tmp_path_factory, entries, job_file):
    root = tmp_path_factory.mktemp("hostile")
    out, victim = root / "job" / "out", root / "victim"
    victim.write_text("keep me")
    (out / COMMITS).mkdir(parents=True)
    for i, (part, kind) in enumerate(entries):
        _plant(out, part, kind, row_ids=[2 * i, 2 * i + 1])
    if job_file is not None:
        (out / "_job.json").write_text(job_file)
    outside = _snapshot(root, out)
    try:
        done = load_committed(str(out), StorageOptions(), verify=True)
    except ValueError as e:
        assert str(out) in str(e)
    except RuntimeError as e:  # a row id in two parts: refused by name, nothing deleted
        assert "two committed parts" in str(e)
    else:
        for m in done.manifests:  # only parts whose bytes match their record count
            data = (out / m["part"]).read_bytes()
            assert m.get("sha256") in (None, hashlib.sha256(data).hexdigest())
            assert len(data) == m["bytes"]
    if job_file is not None:
        with pytest.raises(ValueError, match=str(out)):
            check_job_file(str(out), {"fingerprint": "y"}, StorageOptions(), resume=True)
    assert victim.read_text() == "keep me"
    assert _snapshot(root, out) == outside


def _plant(out: Path, part: str, kind: str, row_ids: list[int]) -> None:
    data = b"".join(json.dumps({"id": r}).encode() + b"\n" for r in row_ids)
    record = {
        "part": part,
        "replica": 0,
        "num_rows": len(row_ids),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "row_ids": row_ids,
    }
    target = out / part
    if kind != "missing_part" and target.resolve().is_relative_to(out.resolve()) and "/" not in part:
        target.write_bytes(data if kind != "wrong_sha" else bytes(reversed(data)))
    name = (part if "/" not in part else part.replace("/", "_")) + ".json"
    if kind == "junk_json":
        payload = b'{"part": "' + part.encode()
    elif kind == "not_a_dict":
        payload = json.dumps([record]).encode()
    else:
        changes = {
            "other_part": {"part": "part-r009-000000000.jsonl"},
            "wrong_size": {"bytes": 1},
            "no_sha": {"sha256": None},
        }.get(kind, {})
        payload = json.dumps({**record, **changes}).encode()
    (out / COMMITS / name).write_bytes(payload)


def _snapshot(root: Path, out: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_relative_to(out)}
