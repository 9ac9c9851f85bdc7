"""Issue 15's sampling fields: n, penalties, min_p, stop-string / special-token / detokenize
switches and structured_outputs; their checks, the native engine against transformers, and
the `samples` output column."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from prefixflow.engine.outputs import RequestOutput, with_samples
from prefixflow.operators.results.outputs import output_chunk, output_names
from prefixflow.requests import SamplingParams


@pytest.mark.parametrize(
    "field,value,message",
    [
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
    ],
)
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
    q = SamplingParams().with_overrides(
        {"detokenize": False, "structured_outputs": {"json": '{"type": "object"}'}, "n": 2.0, "min_p": 0}
    )
    assert q.n == 2 and hash(q) == hash(
        SamplingParams(detokenize=False, n=2, structured_outputs={"json": '{"type": "object"}'})
    )


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
    table = output_chunk(
        [with_samples([first, second]), single, failed],
        rows,
        np.array([2, 1, 1]),
        np.array([2.0, 1.0, 1.0]),
        np.arange(3),
        replica=0,
        plan_replica=0,
    )
    assert "samples" in output_names("generate", False)
    assert table.column("input_samples").to_pylist() == ["mine", "also mine", "too"]
    assert table.column("generated_text").to_pylist() == ["ab", "x", None]  # sample 0
    samples = table.column("samples").to_pylist()
    assert [(s["index"], s["text"], s["token_ids"], s["finish_reason"]) for s in samples[0]] == [
        (0, "ab", [3, 4], "stop"),
        (1, "c", [5], "length"),
    ]
    assert samples[1] == [{"index": 0, "text": "x", "token_ids": [7], "finish_reason": "length", "logprobs": None}]
    assert samples[2] is None
    plain = output_chunk(
        [single], rows.slice(1, 1), np.array([1]), np.array([1.0]), np.array([0]), replica=0, plan_replica=0
    )
    assert "samples" not in plain.column_names  # no row asked n > 1


# ---- the native engine ----------------------------------------------------------------------

PROMPT = list(range(5, 26))  # 21 tokens


@pytest.fixture(scope="module")
def native():
    """(engine, HF model) on the tiny Llama checkpoint, shared by this module's tests."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixflow.engine import EngineConfig, LLMEngine
    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    path = str(tiny_checkpoint_cached("llama", seed=1))
    engine = LLMEngine(EngineConfig(model=path, device="cpu", block_size=4, kv_cache_bytes=16 << 20))
    return engine, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_penalty_and_min_p_masks_match_transformers_processors():
    import torch
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    from prefixflow.engine.native.sampler import apply_min_p, apply_penalties

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 3
    history = [[1, 7, 7, 30], [4, 4, 9]]
    ours = apply_penalties(
        logits, [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6)], history, [2, 1]
    )
    for i, rp in enumerate((1.7, 0.6)):
        theirs = RepetitionPenaltyLogitsProcessor(rp)(torch.tensor([history[i]]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i], theirs[0])
    theirs = MinPLogitsWarper(0.2)(None, logits.clone())
    assert torch.equal(apply_min_p(logits, [0.2, 0.2]).isinf(), theirs.isinf())
    # presence / frequency count the output only (the last num_generated tokens), once / per copy
    pf = apply_penalties(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)] * 2, history, [2, 0])
    assert torch.allclose(pf[0, 7], logits[0, 7] - 0.5 - 0.25) and torch.allclose(pf[0, 30], logits[0, 30] - 0.75)
    assert torch.equal(pf[1], logits[1])  # nothing generated yet


@pytest.mark.parametrize("penalty", [1.8, 0.5])
def test_greedy_repetition_penalty_matches_transformers_generate(native, penalty):
    import torch

    engine, hf = native
    ours = engine.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=penalty)
    )[0]
    theirs = hf.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        repetition_penalty=penalty,
        pad_token_id=0,
    )[0, len(PROMPT) :].tolist()
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert list(ours.token_ids) == theirs and ours.token_ids != plain.token_ids


def test_n_samples_share_the_prompt_kv_greedy_equal_seeded_reproducible(native):
    engine, _ = native
    engine.reset_prefix_cache()  # earlier tests cached this prompt's blocks
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, n=2))[0]
    # greedy: run once, its answer n times (as OpenAI returns it)
    assert engine.totals.num_computed_prompt_tokens == len(PROMPT)
    assert engine.totals.num_output_tokens == 6 and engine.totals.num_requests == 1
    assert [s.index for s in greedy.samples] == [0, 1] and greedy.num_cached_tokens == 0
    assert greedy.samples[0].token_ids == greedy.samples[1].token_ids == greedy.token_ids
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=6, n=2)
    engine.reset_prefix_cache()
    both = engine.generate([PROMPT], seeded)[0]
    # prompt once (its last token once per sample), not twice; output tokens of both samples;
    # none of the prompt was found computed (the first sample computed it for the other)
    assert engine.totals.num_computed_prompt_tokens == len(PROMPT) - 1 + 2
    assert engine.totals.num_output_tokens == 12 and both.num_cached_tokens == 0
    first = engine.generate([PROMPT, PROMPT[:9]], seeded)
    again = engine.generate([PROMPT[:9], PROMPT], seeded)
    assert [s.token_ids for s in first[0].samples] == [s.token_ids for s in again[1].samples]
    assert first[0].samples[0].token_ids != first[0].samples[1].token_ids
    # sample i is the one request with seed + i would give
    alone = engine.generate([PROMPT], SamplingParams(temperature=1.0, seed=12, max_tokens=6))[0]
    assert alone.token_ids == first[0].samples[1].token_ids


def test_text_switches_and_structured_outputs_on_the_native_engine(native):
    engine, _ = native
    base = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert base.text
    raw = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False))[0]
    assert raw.error is None and raw.text == "" and raw.token_ids == base.token_ids
    stop = base.text[len(base.text) // 2 :][:2]
    cut = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop=(stop,)))[0]
    kept = engine.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, stop=(stop,), include_stop_str_in_output=True)
    )[0]
    assert kept.text == cut.text + stop and base.text.startswith(kept.text)
    bad = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "a+"}))[0]
    assert bad.finish_reason == "abort" and "structured_outputs (regex) needs engine.backend: vllm" in bad.error
