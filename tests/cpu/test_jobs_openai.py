"""OpenAI batch round trip: every custom_id of the input appears in the output, with a
response or an error, in OpenAI's batch output format."""

from __future__ import annotations

import json

import pytest

from prefixflow.jobs.demo import example_path
from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.write import read_output

pytestmark = pytest.mark.slow  # end to end on a real local Ray


def test_openai_batch_round_trip(ray_local, tiny_model, tmp_path):
    lines = example_path("openai_batch.jsonl").read_bytes().splitlines()
    requests = [json.loads(line) for line in lines]
    extra = [
        json.dumps({**requests[0], "body": {**requests[0]["body"], "max_tokens": 3}}).encode(),  # duplicate id
        b'{"custom_id": "broken-1", "method": "POST", "url": "/v1/chat/completions", "body": {',
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}).encode(),
        json.dumps({"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "hi", "temperature": -3}}).encode(),
        # Wrong types fail their request only; null logprobs mean off.
        json.dumps({"custom_id": "lp-null", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                             "logprobs": None, "top_logprobs": None}}).encode(),
        json.dumps({"custom_id": "lp-list", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "hi", "logprobs": [1]}}).encode(),
        json.dumps({"custom_id": "seed-str", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "hi", "seed": "abc"}}).encode(),
        json.dumps({"custom_id": "stop-int", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}], "stop": [1]}}).encode(),
    ] + [json.dumps({"custom_id": cid, "method": "POST", "url": f"/v1/{url}", "body": body}).encode()
         for cid, url, body in NEW_CASES]
    (tmp_path / "batch.jsonl").write_bytes(b"\n".join(lines + extra) + b"\n")
    spec = parse_spec({
        "model": str(tiny_model), "input": {"path": str(tmp_path / "batch.jsonl"), "format": "openai"},
        "sampling": {"temperature": 0, "max_tokens": 16},
        "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
        "output": {"path": str(tmp_path / "out"), "resume": True},
    })
    assert spec.output_format() == "openai"
    run_job(spec, quiet=True)
    out = read_output(str(tmp_path / "out"))
    results = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    # one file, every request once, in input order (the broken line's id recovered in place)
    assert [json.loads(line)["custom_id"] for line in results] == \
        [r["custom_id"] for r in requests] + [requests[0]["custom_id"], "broken-1", "bad-url",
                                              "bad-temp", "lp-null", "lp-list", "seed-str", "stop-int"] + \
        [cid for cid, _, _ in NEW_CASES]
    assert sorted(map(json.dumps, out)) == sorted(map(json.dumps, map(json.loads, results)))
    _check_new_cases({r["custom_id"]: r for r in out})
    (tmp_path / "out" / "results.jsonl").unlink()
    run_job(spec, quiet=True)  # a rerun of the completed job writes the file again
    assert (tmp_path / "out" / "results.jsonl").read_text().splitlines() == results
    ids = [r["custom_id"] for r in out]
    expected = [r["custom_id"] for r in requests] + [requests[0]["custom_id"], "broken-1", "bad-url", "bad-temp",
                                                     "lp-null", "lp-list", "seed-str", "stop-int"] + \
        [cid for cid, _, _ in NEW_CASES]
    assert sorted(ids) == sorted(expected)  # every custom_id kept, the duplicate twice
    by_id: dict[str, list[dict]] = {}
    for r in out:
        by_id.setdefault(r["custom_id"], []).append(r)
        assert r["id"].startswith("batch_req_") and set(r) == {"id", "custom_id", "response", "error"}
    dup = by_id[requests[0]["custom_id"]]
    assert sorted(r["error"] is None for r in dup) == [False, True]
    assert "duplicate custom_id" in next(r for r in dup if r["error"])["error"]["message"]
    assert "not valid JSON" in by_id["broken-1"][0]["error"]["message"]
    assert "/v1/embeddings" in by_id["bad-url"][0]["error"]["message"]
    assert "temperature" in by_id["bad-temp"][0]["error"]["message"]
    assert by_id["lp-null"][0]["error"] is None and by_id["lp-null"][0]["response"]["status_code"] == 200
    assert "body.logprobs" in by_id["lp-list"][0]["error"]["message"]
    assert "seed" in by_id["seed-str"][0]["error"]["message"]
    assert "stop" in by_id["stop-int"][0]["error"]["message"]
    for req in requests:
        (res,) = by_id[req["custom_id"]] if req is not requests[0] else [r for r in dup if r["error"] is None]
        body = res["response"]["body"]
        assert res["response"]["status_code"] == 200
        usage = body["usage"]
        assert 1 <= usage["completion_tokens"] <= req["body"]["max_tokens"]  # per-request max_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if req["url"] == "/v1/chat/completions":
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["role"] == "assistant"
        else:
            assert body["object"] == "text_completion" and "text" in body["choices"][0]


HI = [{"role": "user", "content": "hi"}]
# Issue 15: every body field honoured or an error record naming it.
NEW_CASES = [
    ("chat-lp", "chat/completions", {"messages": HI, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
                                     "user": "u1", "metadata": {"k": "v"}, "stream": False, "store": False}),
    ("cmpl-lp", "completions", {"prompt": "The sky is", "max_tokens": 3, "logprobs": 2, "echo": False}),
    ("n-2", "chat/completions", {"messages": HI, "max_tokens": 3, "n": 2, "temperature": 1, "seed": 7}),
    ("json-object", "chat/completions", {"messages": HI, "max_tokens": 3,
                                         "response_format": {"type": "json_object"}}),
    ("unknown-field", "chat/completions", {"messages": HI, "max_tokens": 3, "frobnicate": 1}),
    ("logit-bias", "completions", {"prompt": "hi", "max_tokens": 3, "logit_bias": {"5": 10}}),
    ("stream-true", "chat/completions", {"messages": HI, "max_tokens": 3, "stream": True}),
    ("penalty", "chat/completions", {"messages": HI, "max_tokens": 3, "presence_penalty": 0.5}),
]


def _check_new_cases(by_id: dict[str, dict]) -> None:
    from prefixflow.requests import SamplingParams

    has = set(SamplingParams.__dataclass_fields__)
    chat = by_id["chat-lp"]["response"]["body"]["choices"][0]
    content = chat["logprobs"]["content"]
    assert len(content) == by_id["chat-lp"]["response"]["body"]["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"} and item["logprob"] <= 0
        assert item["bytes"] == list(item["token"].encode()) and len(item["top_logprobs"]) == 2
    legacy = by_id["cmpl-lp"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) > 0
    assert legacy["text_offset"][0] == 0 and all(len(t) == 2 for t in legacy["top_logprobs"])
    if "n" in has:
        choices = by_id["n-2"]["response"]["body"]["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(c["message"]["content"] is not None for c in choices)
    else:
        assert "body.n" in by_id["n-2"]["error"]["message"]
    # the native backend cannot run structured outputs: an error record that says so
    assert by_id["json-object"]["response"] is None
    assert "response_format" in by_id["json-object"]["error"]["message"] or \
        "engine.backend" in by_id["json-object"]["error"]["message"]
    assert "body.frobnicate" in by_id["unknown-field"]["error"]["message"]
    assert "body.logit_bias" in by_id["logit-bias"]["error"]["message"]
    assert "body.stream" in by_id["stream-true"]["error"]["message"]
    if "presence_penalty" in has:
        assert by_id["penalty"]["error"] is None
    else:
        assert "body.presence_penalty" in by_id["penalty"]["error"]["message"]


def test_a_body_is_checked_against_its_own_fields_not_a_made_up_default():
    """min_tokens beyond SamplingParams' default max_tokens is fine when the body sets no
    max_tokens (the job's own max_tokens decides, in the tokenize stage); a body whose own
    min_tokens exceeds its own max_tokens is an error record naming the field."""
    from prefixflow.operators.openai_batch import parse_requests

    chat = {"custom_id": "a", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 100}}
    both = {"custom_id": "b", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 9, "max_tokens": 4}}
    rows = parse_requests([{**chat, "_pf_source": "f:1", "_pf_error": None},
                           {**both, "_pf_source": "f:2", "_pf_error": None}])
    assert rows[0]["_pf_error"] is None and json.loads(rows[0]["_pf_sampling"]) == {"min_tokens": 100}
    assert "min_tokens" in rows[1]["_pf_error"]


def test_every_mapped_body_field_is_a_sampling_field():
    """A body field is honoured through SamplingParams: each one mapped must exist there."""
    from dataclasses import fields

    from prefixflow.operators.openai_batch import _SAMPLING
    from prefixflow.requests import SamplingParams

    names = {f.name for f in fields(SamplingParams)}
    assert set(_SAMPLING.values()) | {"logprobs", "structured_outputs"} <= names
