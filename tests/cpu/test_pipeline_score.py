"""The `score` task through the pipeline (PrefillOnly): every row once, each with one
probability per allowed answer, equal to running the Scorer directly on the same prompts."""

from __future__ import annotations

import numpy as np
import pytest

import prefixflow
from prefixflow.jobs.spec import SpecError, parse_spec

SHARED = "Profile: likes hiking, cooking and old films. Post: "


def _rows():
    return [
        {
            "k": i,
            "post": f"{SHARED}item {i} of the feed. Would the user click it? Answer:",
            "labels": ["Yes", "No"] if i != 3 else ["Yes", "Yes"],
        }
        for i in range(8)
    ]


@pytest.mark.slow
def test_score_task_matches_the_scorer(ray_local, tiny_model):
    import ray

    from prefixflow.engine import EngineConfig, Scorer

    engine = {"device": "cpu", "kv_cache_bytes": 16 << 20}
    config = prefixflow.ProcessorConfig(
        model=str(tiny_model),
        task="score",
        score={"choices_column": "labels", "chunk_size": 7},
        prompt={"template": "{{ post }}"},
        engine=engine,
        replicas=2,
    )
    out = sorted(prefixflow.build_processor(config)(ray.data.from_items(_rows())).take_all(), key=lambda r: r["k"])
    assert [r["k"] for r in out] == list(range(8))
    # Row 3's two labels are the same token: an error record naming them; the others are scored.
    assert out[3]["error"] and "Yes" in out[3]["error"] and out[3]["probs"] is None
    direct = Scorer(EngineConfig(model=str(tiny_model), **engine)).score(
        [r["post"] for r in _rows()], [r["labels"] for r in _rows()]
    )
    for row, ref in zip(out, direct):
        if row["k"] == 3:
            continue
        assert row["error"] is None and list(row["choices"]) == ["Yes", "No"]
        assert sum(row["probs"]) == pytest.approx(1.0)
        np.testing.assert_allclose(row["probs"], ref.probs, atol=1e-6)
        np.testing.assert_allclose(row["logprobs"], ref.logprobs, atol=1e-5)
        assert row["label"] == ref.label
        assert row["generated_text"] is None and row["num_input_tokens"] == ref.prompt_len


def test_score_spec_is_checked_before_anything_starts():
    base = {"model": "m", "input": {"path": "x.jsonl"}, "prompt": {"template": "{{ q }}"}, "output": {"path": "o"}}
    spec = parse_spec({**base, "task": "score", "score": {"choices": ["Yes", "No"]}})
    assert spec.score is not None and list(spec.score.choices) == ["Yes", "No"]
    with pytest.raises(SpecError, match="needs a score section"):
        parse_spec({**base, "task": "score"})
    with pytest.raises(SpecError, match="exactly one of choices"):
        parse_spec({**base, "task": "score", "score": {"choices": ["a"], "choices_column": "c"}})
    with pytest.raises(SpecError, match="score.polcy"):
        parse_spec({**base, "task": "score", "score": {"choices": ["a"], "polcy": "srjf"}})
    with pytest.raises(ValueError, match="ProcessorConfig.score"):
        prefixflow.ProcessorConfig(model="m", task="score")
