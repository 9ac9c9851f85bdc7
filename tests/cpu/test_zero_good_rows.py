"""Jobs with few or no good rows end like any other: `_SUCCESS`, `metrics.json`, every row in
the output once (bad ones as error records), no traceback. Also OpenAI batch files whose
bodies omit max_tokens (most real files)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.write import read_output
from prefixflow.pipeline import RaggedTokens, build_plan

TEMPLATE = "Document: {{ document }}\nQuestion: {{ question }}\nAnswer:"
ROWS = [{"id": i, "document": f"doc {i % 3} is about things", "question": f"why {i}?"} for i in range(4)]


def _lines(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


# name -> (input bytes, template, rows expected, good rows expected)
INPUTS = {
    # (A column that no row has, or sampling keys unknown in every row, are refused up front by
    # preflight: tests/cpu/test_spec_preflight.py. Here every row fails on its own.)
    # Half the rows lack the template's column, half ask for sampling they cannot have (a key
    # that does not exist, a top_p above 1).
    "no_row_renders_or_samples": (
        _lines(
            [{**r, "document": None} for r in ROWS]
            + [
                {**r, "id": 4 + r["id"], "sampling_params": {"beam_width": 2} if r["id"] < 2 else {"top_p": 5}}
                for r in ROWS
            ]
        ),
        TEMPLATE,
        8,
        0,
    ),
    "no_line_parses": (b'{"id": 1, "document": \n' * 3 + b"[1, 2]\n", TEMPLATE, 4, 0),
    "empty_file": (b"", TEMPLATE, 0, 0),
    "one_good_row": (_lines(ROWS[:1]), TEMPLATE, 1, 1),
}


def test_planner_accepts_zero_prompts():
    for order in ("fcfs", "dfs", "batchllm", "blendserve"):
        plan = build_plan(
            RaggedTokens(np.zeros(0, np.int32), np.zeros(1, np.int64)),
            row_ids=np.zeros(0, np.int64),
            order=order,
            num_replicas=2,
        )
        assert plan.table.num_rows == 0 and plan.groups(0) == [] and plan.groups(1) == []
        assert plan.summary["num_rows"] == 0 and plan.summary["token_saving_ratio"] == 0.0


def _spec(root: Path, data: bytes, template: str, fmt: str, **extra) -> object:
    (root / "in.jsonl").write_bytes(data)
    return parse_spec(
        {
            "model": str(extra.pop("model")),
            "input": {"path": str(root / "in.jsonl"), **extra.pop("input", {})},
            **({"prompt": {"template": template}} if template else {}),
            "sampling": {"temperature": 0, "max_tokens": 4},
            "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
            "replicas": 2,
            "output": {"path": str(root / "out"), "format": fmt},
            **extra,
        }
    )


# Each case in one output format, both formats covered: a whole job costs seconds, and the
# whole-job fuzz (test_fuzz_jobs.py) mixes cases and formats further.
CASES = [
    ("no_row_renders_or_samples", "parquet"),
    ("no_line_parses", "jsonl"),
    ("empty_file", "jsonl"),
    ("one_good_row", "parquet"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "fmt"), CASES)
def test_job_with_few_or_no_good_rows_finishes(ray_local, tiny_model, tmp_path, case, fmt):
    data, template, num_rows, num_good = INPUTS[case]
    metrics = run_job(_spec(tmp_path, data, template, fmt, model=tiny_model), quiet=True)
    out = tmp_path / "out"
    assert (out / "_SUCCESS").exists() and (out / "metrics.json").exists()
    assert metrics["rows"] == num_rows and metrics["rows_error"] == num_rows - num_good
    got = read_output(str(out))
    rows = got.to_pylist() if hasattr(got, "to_pylist") else got
    assert sorted(r["row_id"] for r in rows) == list(range(num_rows))
    assert sum(r["error"] is None for r in rows) == num_good
    assert all(r["error"] for r in rows if r["generated_text"] is None)
    assert json.loads((out / "_manifest.json").read_text())["row_ids"] == list(range(num_rows))


@pytest.mark.slow
def test_openai_bodies_without_max_tokens(ray_local, tiny_model, tmp_path):
    def request(i: int, **body) -> dict:
        return {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Say {i} things"}], **body},
        }

    # Rows without max_tokens use the job's default (4) as the planner's output-length hint.
    requests = [request(0, max_tokens=2), request(1), request(2, max_tokens=3), request(3)]
    spec = _spec(tmp_path, _lines(requests), "", "openai", model=tiny_model, input={"format": "openai"})
    run_job(spec, quiet=True)
    out = read_output(str(tmp_path / "out"))
    assert sorted(r["custom_id"] for r in out) == [f"req-{i}" for i in range(4)]
    tokens = {r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"] for r in out}
    assert all(r["error"] is None for r in out)
    assert tokens["req-0"] <= 2 and tokens["req-2"] <= 3 and max(tokens.values()) <= 4


def test_a_block_whose_max_tokens_are_all_null():
    """No request has max_tokens: the column is Arrow's null type; every row is 'unknown' (-1)
    to the planner, which plan_dataset fills with the job's default (the job above)."""
    import pyarrow as pa

    from prefixflow.operators.columns import ERROR
    from prefixflow.operators.stages.plan import MAX_TOKENS, _block_meta
    from prefixflow.operators.stages.tokenize import TOKENS

    block = pa.table(
        {
            TOKENS: pa.array([[1, 2], [3]], pa.list_(pa.int32())),
            ERROR: pa.nulls(2, pa.string()),
            MAX_TOKENS: pa.nulls(2),
        }
    )
    assert _block_meta(block, custom_ids=False)["max_tokens"].tolist() == [-1, -1]
