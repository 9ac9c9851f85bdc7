"""Whole jobs fuzzed: spec x rows x output format, through the CLI on the session's real Ray.

Every example runs `prefixflow run` in-process and checks what a user relies on:
  - no traceback, ever; exit code 0 unless the spec itself is invalid (then 2, one line per
    problem naming the field, and nothing written), or preflight finds that no sampled row
    can run (a template column or sampling keys that no row has: also the spec's mistake);
  - every input line comes out exactly once, as a result or as an error record;
  - the rows built to be good have text, the rows built to be bad have an error saying why;
  - `_SUCCESS` and `metrics.json` are written, also when no row at all is good.

  - the JSONL output is strict JSON (no NaN), and no file outside the output folder (the
    input, the spec, the model, a file beside them) changes.

Bounded in time: 10 whole jobs (about 10 s each on the tiny model), no shrinking.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from prefixflow.cli import main as cli
from prefixflow.operators.results.write import read_output

pytestmark = pytest.mark.slow

JOBS = settings(
    max_examples=10, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck), derandomize=True
)

# Each kind of line: (is it good?, its bytes given a row number). Bad lines cover what issue 12
# found: missing, null or blank columns, broken or non-object JSON, non-UTF-8 bytes, lone
# surrogates, deep nesting, and per-row sampling values of the wrong type or unknown keys.
LINES = {
    "good": (True, lambda i: json.dumps({"id": i, "q": f"question number {i} about things"})),
    "good_sampled": (
        True,
        lambda i: json.dumps({"id": i, "q": f"row {i}", "sampling_params": {"max_tokens": 2, "temperature": 0}}),
    ),
    "missing": (False, lambda i: json.dumps({"id": i, "other": "x"})),
    "null": (False, lambda i: json.dumps({"id": i, "q": None})),
    "blank": (False, lambda i: json.dumps({"id": i, "q": "   "})),  # see below
    "broken": (False, lambda i: '{"id": %d, "q": "unterminated' % i),
    "array": (False, lambda i: json.dumps([i, "q"])),
    "surrogate": (False, lambda i: '{"id": %d, "q": "\\ud800 lone"}' % i),
    "deep": (False, lambda i: '{"id": %d, "q": %s%s}' % (i, "[" * 3000, "]" * 3000)),
    "stop_int": (False, lambda i: json.dumps({"id": i, "q": "x", "sampling_params": {"stop": [1]}})),
    "seed_text": (False, lambda i: json.dumps({"id": i, "q": "x", "sampling_params": {"seed": "abc"}})),
    "top_k_huge": (False, lambda i: json.dumps({"id": i, "q": "x", "sampling_params": {"top_k": 1e30}})),
    "max_tokens_huge": (False, lambda i: json.dumps({"id": i, "q": "x", "sampling_params": {"max_tokens": 2**70}})),
    "unknown_key": (False, lambda i: json.dumps({"id": i, "q": "x", "sampling_params": {"beam_width": 2}})),
    # Issue 27: values the reader must keep as they are, and reserved column names.
    "int_question": (True, lambda i: json.dumps({"id": i, "q": 40 + i})),
    "accented": (True, lambda i: json.dumps({"id": i, "q": f"Qu'est-ce qu'une \"rivière\" {i}?\nDis."})),
    "nan_and_big": (True, lambda i: '{"id": %d, "q": "row %d", "score": NaN, "n": %d}' % (i, i, 2**70)),
    "reserved": (False, lambda i: json.dumps({"id": i, "q": "x", "_pf_tokens": [1, 2]})),
    "tiny_temperature": (False, lambda i: json.dumps({"id": i, "q": "x", "sampling_params": {"temperature": 1e-40}})),
}
BAD_UTF8 = b'{"id": %d, "q": "caf\xe9"}'

specs = st.fixed_dictionaries(
    {
        "prompt": st.sampled_from(
            [{"template": "Q: {{ q }}"}, {"user": "{{ q }}"}, {"system": "Be brief.", "user": "Answer: {{ q }}"}]
        ),
        "order": st.sampled_from(["fcfs", "dfs", "batchllm", "blendserve"]),
        "replicas": st.integers(1, 2),
        "format": st.sampled_from(["parquet", "jsonl"]),
        "rows_per_part": st.integers(1, 5),
        "sampling": st.sampled_from(
            [{"temperature": 0, "max_tokens": 3}, {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 2}]
        ),
        # One in five specs is broken on purpose: the job must refuse it up front.
        "broken_spec": st.sampled_from(
            [
                None,
                None,
                None,
                None,
                ("sampling.temperature", -1),
                ("output.rows_per_part", 0),
                ("order", "random"),
                ("sampling.top_k", 1e20),
                ("sampling.temperature", 1e-40),
            ]
        ),
    }
)
rows = st.lists(st.sampled_from([*LINES, "bad_utf8"]), max_size=7)


@JOBS
@given(spec=specs, kinds=rows)
def test_fuzzed_jobs_keep_every_row_and_never_crash(ray_local, tiny_model, tmp_path_factory, capsys, spec, kinds):
    root = tmp_path_factory.mktemp("fuzzjob")
    lines, good = [], []
    for i, kind in enumerate(kinds):
        if kind == "bad_utf8":
            lines.append(BAD_UTF8 % i)
            good.append(False)
        else:
            ok, make = LINES[kind]
            lines.append(make(i).encode())
            # A blank column is a blank prompt only when the template adds no text of its own.
            good.append(ok if kind != "blank" else spec["prompt"] != {"user": "{{ q }}"})
    (root / "in.jsonl").write_bytes(b"\n".join(lines) + (b"\n" if lines else b""))
    data = {
        "model": str(tiny_model),
        "input": {"path": str(root / "in.jsonl")},
        "prompt": spec["prompt"],
        "sampling": dict(spec["sampling"]),
        "order": spec["order"],
        "replicas": spec["replicas"],
        "engine": {"device": "cpu", "dtype": "float32", "kv_cache_bytes": 16 << 20},
        "output": {"path": str(root / "out"), "format": spec["format"], "rows_per_part": spec["rows_per_part"]},
    }
    if spec["broken_spec"] is not None:
        field, value = spec["broken_spec"]
        section, _, key = field.rpartition(".")
        (data.setdefault(section, {}) if section else data)[key] = value
    (root / "job.yaml").write_text(yaml.safe_dump(data))
    (root / "beside.txt").write_text("not the job's")
    untouched = _files(root, skip=root / "out") | _files(tiny_model)

    code = cli(["run", str(root / "job.yaml")])
    assert _files(root, skip=root / "out") | _files(tiny_model) == untouched
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    if spec["broken_spec"] is not None:
        assert code == 2, captured.err
        assert spec["broken_spec"][0] in captured.err  # names the field
        assert not (root / "out").exists()
        return
    if code == 2 and not any(good):
        # Preflight reads the first rows: a template column or sampling keys that no sampled
        # row can use is the spec's mistake, refused up front (one line naming it).
        assert "prompt." in captured.err or "input" in captured.err, captured.err
        assert not (root / "out").exists()
        return
    assert code == 0, captured.err
    out = root / "out"
    assert (out / "_SUCCESS").exists() and (out / "metrics.json").exists()
    records = _records(read_output(str(out)))
    assert len(records) == len(lines)
    assert sorted(r["row_id"] for r in records) == list(range(len(lines)))
    if spec["format"] == "jsonl":  # strict JSON: json.loads' NaN/Infinity constants refused
        for part in out.glob("part-*"):
            for line in part.read_text().splitlines():
                json.loads(line, parse_constant=_refuse)
    by_id = {}
    for r in records:
        if isinstance(r.get("id"), int):
            assert r["id"] not in by_id, f"row {r['id']} came out twice"
            by_id[r["id"]] = r
    for i, ok in enumerate(good):
        if ok:
            assert i in by_id and by_id[i]["error"] is None, by_id.get(i)
            assert by_id[i]["generated_text"] is not None and by_id[i]["num_generated_tokens"] >= 1
    num_errors = sum(1 for r in records if r["error"])
    assert num_errors == good.count(False)
    assert all(r["error"].strip() for r in records if r["error"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rows"] == len(lines) and metrics["rows_error"] == good.count(False)


def _refuse(constant: str) -> None:
    raise AssertionError(f"the JSONL output holds {constant}, which is not JSON")


def _files(folder: Path, skip: Path | None = None) -> frozenset[tuple[str, int, int]]:
    """(path, size, mtime) of every file under `folder` but those under `skip`."""
    return frozenset(
        (str(p), p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and (skip is None or not p.is_relative_to(skip))
    )


def _records(output: pa.Table | list[dict]) -> list[dict]:
    return output.to_pylist() if isinstance(output, pa.Table) else output
