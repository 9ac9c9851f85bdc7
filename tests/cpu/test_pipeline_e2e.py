"""The whole job on a real local Ray: read -> tokenize -> plan -> generate -> write.

One job runs on a JSONL file that mixes good rows with bad ones of several kinds; the tests
check that every row comes out exactly once, that bad rows become error records, and that
the outputs equal the engine run directly on the same requests.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefixflow.jobs.demo import demo_rows
from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.write import read_output

USER = "{{ document }}\n\n{{ question }}"
SYSTEM = "Answer the question about the document."
MAX_MODEL_LEN = 256

pytestmark = pytest.mark.slow  # end to end on a real local Ray


def _bad_lines(doc: str) -> dict[str, bytes]:
    """One line per kind of bad row, keyed by the text its error must contain."""
    return {
        "not valid JSON": b'{"id": 1000, "document": "x", "question": \n',
        "not valid UTF-8": b'{"id": 1001, "document": "caf\xe9", "question": "q"}\n',
        "not an object": b"[1001, 2]\n",
        "undefined": json.dumps({"id": 1003, "document": doc}).encode() + b"\n",  # no question
        "empty prompt": json.dumps({"id": 1004, "document": " ", "question": ""}).encode() + b"\n",
        "context": json.dumps({"id": 1005, "document": doc * 4, "question": "Why?"}).encode() + b"\n",
    }


@pytest.fixture(scope="module")
def job(ray_local, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    good = demo_rows(num_docs=4, questions_per_doc=3, sentences_per_doc=8, seed=1)
    bad = _bad_lines(good[0]["document"])
    with open(root / "in.jsonl", "wb") as f:
        for i, row in enumerate(good):
            f.write(json.dumps(row).encode() + b"\n")
            if i % 2 == 0 and bad:  # interleave the bad lines with the good ones
                f.write(bad.pop(next(iter(bad))))
    spec = parse_spec(
        {
            "model": str(tiny_model),
            "input": {"path": str(root / "in.jsonl")},
            "prompt": {"system": SYSTEM, "user": USER},
            "sampling": {"temperature": 0, "max_tokens": 8},
            "engine": {"device": "cpu", "max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": 16 << 20},
            "replicas": 2,
            "output": {"path": str(root / "out"), "rows_per_part": 5},
        }
    )
    metrics = run_job(spec, quiet=True)
    table = read_output(str(root / "out"))
    return {"good": good, "metrics": metrics, "rows": table.to_pylist(), "root": root, "model": tiny_model}


def test_every_row_exactly_once(job):
    rows = job["rows"]
    assert sorted(r["row_id"] for r in rows) == list(range(len(rows)))
    good_ids = sorted(r["id"] for r in rows if r["error"] is None)
    assert good_ids == sorted(g["id"] for g in job["good"])  # no good row lost or duplicated
    assert len(rows) == len(job["good"]) + len(_bad_lines("d"))
    for col in (
        "generated_text",
        "generated_tokens",
        "num_input_tokens",
        "num_generated_tokens",
        "finish_reason",
        "error",
        "document",
        "question",
    ):
        assert col in rows[0]
    m = job["metrics"]
    assert m["rows"] == len(rows) and m["rows_error"] == len(_bad_lines("d"))
    assert 0 < m["token_saving_ratio"] <= m["optimal_token_saving_ratio"] + 1e-9
    assert (job["root"] / "out" / "metrics.json").exists() and (job["root"] / "out" / "_SUCCESS").exists()
    # Two engines; which ran how many rows is decided as they go (a replica that runs dry, or
    # loads first, takes the others' units: work stealing; one still loading when the work ran
    # out is stopped and ran none), every good row by one of them.
    per = m["per_replica"]
    assert 1 <= len(per) <= 2 and sum(r["num_rows"] for r in per) == len(job["good"])


def test_bad_rows_become_error_records(job):
    errors = [r["error"] for r in job["rows"] if r["error"] is not None]
    for needle in _bad_lines("d"):
        assert sum(needle in e for e in errors) == 1, (needle, errors)
    assert all(r["generated_text"] is None for r in job["rows"] if r["error"] is not None)


def test_outputs_equal_the_engine_run_directly(job):
    from transformers import AutoTokenizer

    from prefixflow.engine import EngineConfig, LLMEngine, SamplingParams

    tok = AutoTokenizer.from_pretrained(job["model"])
    good = sorted((r for r in job["rows"] if r["error"] is None), key=lambda r: r["id"])
    prompts = []
    for r in good:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{r['document']}\n\n{r['question']}"},
        ]
        prompts.append(
            list(
                tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
        )
    engine = LLMEngine(
        EngineConfig(model=str(job["model"]), device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=16 << 20)
    )
    direct = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for r, p, d in zip(good, prompts, direct):
        assert r["num_input_tokens"] == len(p)
        assert r["generated_tokens"] == list(d.token_ids)
        assert r["generated_text"] == d.text and r["finish_reason"] == d.finish_reason


def test_parts_are_committed_and_named_by_plan_position(job):
    parts = sorted(p.name for p in (job["root"] / "out").iterdir() if p.name.startswith("part-"))
    assert parts == job["metrics"]["parts"]
    assert not [p for p in (job["root"] / "out").iterdir() if ".tmp-" in p.name]
    assert any(p.startswith("part-error-") for p in parts)
    assert np.mean([r["num_generated_tokens"] for r in job["rows"] if r["error"] is None]) > 0
