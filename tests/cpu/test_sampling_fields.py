"""Issue 15's sampling fields: n, penalties, min_p, stop-string / special-token / detokenize
switches and structured_outputs; their checks, the native engine against transformers, and
the `samples` output column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from prefixflow.engine.outputs import RequestOutput, with_samples
from prefixflow.operators.outputs import output_chunk, output_names
from prefixflow.requests import SamplingParams


@pytest.mark.parametrize("field,value,message", [
    ("n", 0, "SamplingParams.n=0 is invalid: an integer in [1, 1024]"),
    ("presence_penalty", 2.5, "SamplingParams.presence_penalty=2.5 is invalid: use a value in [-2, 2]"),
    ("frequency_penalty", "x", "SamplingParams.frequency_penalty='x' is invalid: a finite number"),
    ("repetition_penalty", 0, "SamplingParams.repetition_penalty=0 is invalid: a finite number|above 0"),
    ("min_p", -0.1, "SamplingParams.min_p=-0.1 is invalid: use a value in [0, 1]"),
    ("include_stop_str_in_output", 1, "SamplingParams.include_stop_str_in_output=1 is invalid: use true"),
    ("skip_special_tokens", "no", "SamplingParams.skip_special_tokens='no' is invalid: use true"),
    ("detokenize", None, None),  # null keeps the default (as every override)
    ("structured_outputs", "json", "give a mapping with one key among json, json_object"),
    ("structured_outputs", {"json": {}, "regex": "a+"}, "give exactly one key among"),
    ("structured_outputs", {"xml": "x"}, "give exactly one key among"),
    ("structured_outputs", {"json": "[1]"}, "structured_outputs.json needs a JSON schema object"),
    ("structured_outputs", {"json_object": False}, "structured_outputs.json_object needs true"),
    ("structured_outputs", {"choice": ["a", ""]}, "structured_outputs.choice needs a non-empty list"),
    ("structured_outputs", {"regex": " "}, "structured_outputs.regex needs a non-empty regular"),
])
def test_each_new_field_names_field_value_and_fix(field, value, message):
    if message is None:
        assert getattr(SamplingParams().with_overrides({field: value}), field) is True
        return
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams().with_overrides({field: value})


def test_detokenize_false_refuses_stop_strings_and_the_fields_keep_vllm_defaults():
    with pytest.raises(ValueError, match="SamplingParams.detokenize=False .*stop strings need the text"):
        SamplingParams(stop=("x",), detokenize=False)
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (1, 0, 0, 1, 0)
    assert (p.include_stop_str_in_output, p.skip_special_tokens, p.detokenize) == (False, True, True)
    # Ray's own example (detokenize=False) and structured outputs are fine values, and hashable.
    q = SamplingParams().with_overrides({"detokenize": False, "structured_outputs": {"json": '{"type": "object"}'},
                                         "n": 2.0, "min_p": 0})
    assert q.n == 2 and hash(q) == hash(SamplingParams(detokenize=False, n=2,
                                                       structured_outputs={"json": '{"type": "object"}'}))


def test_sample_i_of_a_seeded_request_uses_seed_plus_i():
    p = SamplingParams(seed=2**63 - 1, n=3)
    assert [p.sample_params(i).seed for i in range(3)] == [2**63 - 1, 0, 1]
    assert SamplingParams(n=3).sample_params(2) == SamplingParams()


def test_samples_column_lists_each_rows_samples_and_keeps_an_input_samples_column():
    first = RequestOutput(0, (1, 2), (3, 4), "ab", "stop")
    second = RequestOutput(0, (1, 2), (5,), "c", "length")
    single = RequestOutput(1, (1,), (7,), "x", "length")
    failed = RequestOutput(2, (1,), (), "", "abort", error="bad row")
    rows = pa.table({"samples": ["mine", "also mine", "too"]})
    table = output_chunk([with_samples([first, second]), single, failed], rows, {0: 0, 1: 1, 2: 2},
                         np.array([2, 1, 1]), np.array([2.0, 1.0, 1.0]), replica=0)
    assert "samples" in output_names(False, False)
    assert table.column("input_samples").to_pylist() == ["mine", "also mine", "too"]
    assert table.column("generated_text").to_pylist() == ["ab", "x", None]  # sample 0
    samples = table.column("samples").to_pylist()
    assert [(s["index"], s["text"], s["token_ids"], s["finish_reason"]) for s in samples[0]] == \
        [(0, "ab", [3, 4], "stop"), (1, "c", [5], "length")]
    assert samples[1] == [{"index": 0, "text": "x", "token_ids": [7], "finish_reason": "length", "logprobs": None}]
    assert samples[2] is None
    plain = output_chunk([single], rows.slice(1, 1), {1: 0}, np.array([1]), np.array([1.0]), replica=0)
    assert "samples" not in plain.column_names  # no row asked n > 1
