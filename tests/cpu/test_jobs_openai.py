"""OpenAI batch round trip: every custom_id of the input appears in the output, with a
response or an error, in OpenAI's batch output format: every line parses with the OpenAI
SDK's own types (ChatCompletion, Completion, ErrorObject; the line itself with a model of the
batch output line as OpenAI documents it, since the SDK has none)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from prefixflow.jobs.demo import example_path
from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.operators.results.write import read_output

pytestmark = pytest.mark.slow  # end to end on a real local Ray


def test_openai_batch_round_trip(ray_local, tiny_model, tmp_path):
    lines = example_path("openai_batch.jsonl").read_bytes().splitlines()
    requests = [json.loads(line) for line in lines]
    extra = [
        json.dumps({**requests[0], "body": {**requests[0]["body"], "max_tokens": 3}}).encode(),  # duplicate id
        b'{"custom_id": "broken-1", "method": "POST", "url": "/v1/chat/completions", "body": {',
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}).encode(),
        json.dumps(
            {
                "custom_id": "bad-temp",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "hi", "temperature": -3},
            }
        ).encode(),
        # Wrong types fail their request only; null logprobs mean off.
        json.dumps(
            {
                "custom_id": "lp-null",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                    "logprobs": None,
                    "top_logprobs": None,
                },
            }
        ).encode(),
        json.dumps(
            {
                "custom_id": "lp-list",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "hi", "logprobs": [1]},
            }
        ).encode(),
        json.dumps(
            {
                "custom_id": "seed-str",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "hi", "seed": "abc"},
            }
        ).encode(),
        json.dumps(
            {
                "custom_id": "stop-int",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], "stop": [1]},
            }
        ).encode(),
    ] + [
        json.dumps({"custom_id": cid, "method": "POST", "url": f"/v1/{url}", "body": body}).encode()
        for cid, url, body in NEW_CASES
    ]
    (tmp_path / "batch.jsonl").write_bytes(b"\n".join(lines + extra) + b"\n")
    spec = parse_spec(
        {
            "model": str(tiny_model),
            "input": {"path": str(tmp_path / "batch.jsonl"), "format": "openai"},
            "sampling": {"temperature": 0, "max_tokens": 16},
            "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
            "output": {"path": str(tmp_path / "out"), "resume": True, "error_file": True},
        }
    )
    assert spec.output_format() == "openai"
    run_job(spec, quiet=True)
    out = read_output(str(tmp_path / "out"))
    results, errors = ((tmp_path / "out" / name).read_text().splitlines() for name in ("results.jsonl", "errors.jsonl"))
    expected = (
        [r["custom_id"] for r in requests]
        + [requests[0]["custom_id"], "broken-1", "bad-url", "bad-temp", "lp-null", "lp-list", "seed-str", "stop-int"]
        + [cid for cid, _, _ in NEW_CASES]
    )
    # error_file: the failed requests in errors.jsonl, the others in results.jsonl, each file in
    # input order (the broken line's id recovered in place), every request once in all
    ok, failed = ([json.loads(line) for line in part] for part in (results, errors))
    assert {r["response"]["status_code"] for r in ok} == {200} and len(failed) == 11
    assert all(r["response"]["status_code"] == 400 for r in failed)
    for part in (ok, failed):
        assert _in_order([r["custom_id"] for r in part], expected)
    assert sorted(map(json.dumps, out)) == sorted(map(json.dumps, ok + failed))
    assert sorted(r["custom_id"] for r in out) == sorted(expected)  # every custom_id kept, the duplicate twice
    for r in out:
        _parses_with_the_sdk(r)
    _check_new_cases({r["custom_id"]: r for r in out})
    for name in ("results.jsonl", "errors.jsonl"):
        (tmp_path / "out" / name).unlink()
    run_job(spec, quiet=True)  # a rerun of the completed job writes the files again
    assert (tmp_path / "out" / "results.jsonl").read_text().splitlines() == results
    assert (tmp_path / "out" / "errors.jsonl").read_text().splitlines() == errors
    by_id: dict[str, list[dict]] = {}
    for r in out:
        by_id.setdefault(r["custom_id"], []).append(r)
        assert r["id"].startswith("batch_req_") and r["error"] is None
    message = {cid: rs[0]["response"]["body"].get("error", {}).get("message", "") for cid, rs in by_id.items()}
    dup = by_id[requests[0]["custom_id"]]
    assert sorted(r["response"]["status_code"] for r in dup) == [200, 400]
    assert (
        "duplicate custom_id"
        in next(r for r in dup if r["response"]["status_code"] == 400)["response"]["body"]["error"]["message"]
    )
    assert "not valid JSON" in message["broken-1"] and "/v1/embeddings" in message["bad-url"]
    assert by_id["bad-temp"][0]["response"]["body"]["error"] == {
        "message": message["bad-temp"],
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }
    assert by_id["lp-null"][0]["response"]["status_code"] == 200
    assert "body.logprobs" in message["lp-list"] and "seed" in message["seed-str"] and "stop" in message["stop-int"]
    bodies = [r["response"]["body"] for r in out if r["response"]["status_code"] == 200]
    assert len({b["system_fingerprint"] for b in bodies}) == 1 and bodies[0]["system_fingerprint"].startswith("fp_")
    # cached_tokens: what the engine found computed; the requests share a system prompt and a
    # document, and the group's first member computed the part they share
    cached = [(b["usage"]["prompt_tokens_details"]["cached_tokens"], b["usage"]["prompt_tokens"]) for b in bodies]
    assert all(0 <= c <= p for c, p in cached) and sum(c > 0 for c, _ in cached) >= 3
    for req in requests:
        (res,) = [r for r in by_id[req["custom_id"]] if r["response"]["status_code"] == 200]
        body = res["response"]["body"]
        usage = body["usage"]
        assert 1 <= usage["completion_tokens"] <= req["body"]["max_tokens"]  # per-request max_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if req["url"] == "/v1/chat/completions":
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"]["role"] == "assistant"
            assert body["choices"][0]["message"]["refusal"] is None
        else:
            assert body["object"] == "text_completion" and "text" in body["choices"][0]


def _in_order(ids: list[str], expected: list[str]) -> bool:
    """`ids` is `expected` with some entries left out (the same order)."""
    left = iter(expected)
    return all(any(cid == e for e in left) for cid in ids)


def _parses_with_the_sdk(line: dict) -> None:
    """One output line through the OpenAI SDK's pydantic types, with nothing left over that
    they do not know (the SDK's models accept extra keys: each level is checked)."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from openai.types.shared import ErrorObject

    parsed = BatchOutputLine.model_validate(line)
    if parsed.response is None:
        return
    body = parsed.response.body
    if parsed.response.status_code != 200:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        _no_extra(ErrorObject.model_validate(body["error"]))
        return
    model = ChatCompletion if body["object"] == "chat.completion" else Completion
    _no_extra(model.model_validate(body))


def _no_extra(model: Any) -> None:
    assert not model.model_extra, f"{type(model).__name__} does not know {sorted(model.model_extra)}"
    for name in type(model).model_fields:
        for value in _values(getattr(model, name)):
            if isinstance(value, BaseModel):
                _no_extra(value)


def _values(value: Any) -> list[Any]:
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        return list(value.values())
    return [value]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BatchResponse(_Strict):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchError(_Strict):
    code: str | None
    message: str | None


class BatchOutputLine(_Strict):
    """A batch output line as OpenAI documents it (the SDK has no type for it):
    {id, custom_id, response: {status_code, request_id, body} | null, error: {code, message} | null}."""

    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


HI = [{"role": "user", "content": "hi"}]
# Issue 15: every body field honoured or an error record naming it.
NEW_CASES = [
    (
        "chat-lp",
        "chat/completions",
        {
            "messages": HI,
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "user": "u1",
            "metadata": {"k": "v"},
            "stream": False,
            "store": False,
        },
    ),
    ("cmpl-lp", "completions", {"prompt": "The sky is", "max_tokens": 3, "logprobs": 2, "echo": False}),
    ("n-2", "chat/completions", {"messages": HI, "max_tokens": 3, "n": 2, "temperature": 1, "seed": 7}),
    ("n-greedy", "chat/completions", {"messages": HI, "max_tokens": 3, "n": 2, "temperature": 0}),
    ("json-object", "chat/completions", {"messages": HI, "max_tokens": 3, "response_format": {"type": "json_object"}}),
    ("unknown-field", "chat/completions", {"messages": HI, "max_tokens": 3, "frobnicate": 1}),
    ("logit-bias", "completions", {"prompt": "hi", "max_tokens": 3, "logit_bias": {"5": 10}}),
    ("stream-true", "chat/completions", {"messages": HI, "max_tokens": 3, "stream": True}),
    ("penalty", "chat/completions", {"messages": HI, "max_tokens": 3, "presence_penalty": 0.5}),
]


def _check_new_cases(by_id: dict[str, dict]) -> None:
    from prefixflow.requests import SamplingParams

    has = set(SamplingParams.__dataclass_fields__)
    error = {cid: (r["response"]["body"].get("error") or {}).get("message") for cid, r in by_id.items()}
    chat = by_id["chat-lp"]["response"]["body"]["choices"][0]
    content = chat["logprobs"]["content"]
    assert len(content) == by_id["chat-lp"]["response"]["body"]["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"} and item["logprob"] <= 0
        assert bytes(item["bytes"]).decode("utf-8", "backslashreplace") == item["token"]
        assert len(item["top_logprobs"]) == 2
    legacy = by_id["cmpl-lp"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) > 0
    assert legacy["text_offset"][0] == 0 and all(len(t) == 2 for t in legacy["top_logprobs"])
    choices = by_id["n-2"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["content"] is not None for c in choices)
    # greedy n = 2: one answer twice, as OpenAI returns it
    greedy = by_id["n-greedy"]["response"]["body"]
    assert [c["index"] for c in greedy["choices"]] == [0, 1]
    assert greedy["choices"][0]["message"] == greedy["choices"][1]["message"]
    assert greedy["usage"]["completion_tokens"] % 2 == 0
    # the native backend cannot run structured outputs: an error record that says so
    assert by_id["json-object"]["response"]["status_code"] == 400
    assert "response_format" in error["json-object"] or "engine.backend" in error["json-object"]
    assert "body.frobnicate" in error["unknown-field"]
    assert by_id["logit-bias"]["response"]["body"]["error"]["param"] == "logit_bias"
    assert "body.stream" in error["stream-true"]
    assert by_id["penalty"]["response"]["status_code"] == 200 and "presence_penalty" in has


def test_a_body_is_checked_against_its_own_fields_not_a_made_up_default():
    """min_tokens beyond SamplingParams' default max_tokens is fine when the body sets no
    max_tokens (the job's own max_tokens decides, in the tokenize stage); a body whose own
    min_tokens exceeds its own max_tokens is an error record naming the field."""
    from prefixflow.operators.stages.openai_batch import parse_requests

    chat = {
        "custom_id": "a",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 100},
    }
    both = {
        "custom_id": "b",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 9, "max_tokens": 4},
    }
    rows = parse_requests(
        [{**chat, "_pf_source": "f:1", "_pf_error": None}, {**both, "_pf_source": "f:2", "_pf_error": None}]
    )
    assert rows[0]["_pf_error"] is None and json.loads(rows[0]["_pf_sampling"]) == {"min_tokens": 100}
    assert "min_tokens" in rows[1]["_pf_error"]


def test_every_mapped_body_field_is_a_sampling_field():
    """A body field is honoured through SamplingParams: each one mapped must exist there."""
    from dataclasses import fields

    from prefixflow.operators.stages.openai_batch import _SAMPLING
    from prefixflow.requests import SamplingParams

    names = {f.name for f in fields(SamplingParams)}
    assert set(_SAMPLING.values()) | {"logprobs", "structured_outputs"} <= names


def test_logprob_tokens_carry_the_real_bytes_of_split_characters(tiny_model):
    """A token holding part of a multi-byte character: `bytes` are its real bytes (decode()
    alone gives U+FFFD), its text shows them escaped; byte-level BPE (both tokenizer paths)
    and a SentencePiece-style byte-fallback vocabulary."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from prefixflow.operators.results.openai_output import chat_logprobs, completion_logprobs
    from prefixflow.tokenizer import load_tokenizer, token_bytes

    text = "naïve café — 日本 😀"
    for tokenizer in (
        load_tokenizer(tiny_model),
        AutoTokenizer.from_pretrained(str(tiny_model)),
        SimpleNamespace(backend_tokenizer=_byte_fallback_tokenizer()),
    ):
        backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer.backend
        ids = backend.encode(text, add_special_tokens=False).ids
        to_bytes = token_bytes(tokenizer)
        parts = [to_bytes(i) for i in ids]
        assert b"".join(parts).lstrip(b" ") == text.encode()
        assert any(_partial(p) for p in parts)  # some character is split across tokens
        content = chat_logprobs([{"token_id": i, "logprob": -1.0, "top": [[i, -1.0]]} for i in ids], to_bytes)[
            "content"
        ]
        assert [bytes(c["bytes"]) for c in content] == parts
        assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]
        assert not any("\ufffd" in c["token"] for c in content)
        assert all(c["token"] == p.decode("utf-8", "backslashreplace") for c, p in zip(content, parts))
        legacy = completion_logprobs([{"token_id": i, "logprob": -1.0} for i in ids], to_bytes)
        assert legacy["text_offset"][0] == 0 and legacy["text_offset"] == sorted(legacy["text_offset"])


def _partial(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _byte_fallback_tokenizer():
    """A Llama-2-style vocabulary: SentencePiece pieces with \u2581 for spaces and <0xHH> bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("\u2581", "\u2581na", "ï", "ve", "\u2581caf", "é", "\u2581—", "\u2581日"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def test_error_records_as_openai_writes_them():
    from prefixflow.operators.results.openai_output import error_body, output_line, system_fingerprint

    assert error_body("f.jsonl:3: body.top_k=-7 is invalid: use -1") == (
        400,
        {
            "message": "f.jsonl:3: body.top_k=-7 is invalid: use -1",
            "type": "invalid_request_error",
            "param": "top_k",
            "code": None,
        },
    )
    too_long = "the prompt has 900 tokens but max_model_len is 512: shorten the prompt"
    assert error_body(too_long, chat=False)[1] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    status, body = error_body("f.jsonl:2: the engine failed on this row in every attempt (x): given up")
    assert (status, body["type"]) == (500, "server_error")
    row = {"custom_id": "a", "row_id": 3, "error": too_long, "_pf_url": "/v1/completions"}
    assert output_line(row, 1, "m")["response"]["status_code"] == 400
    from prefixflow.jobs.spec import SpecError

    with pytest.raises(SpecError, match="output.error_file is true but the output format is jsonl"):
        parse_spec(
            {
                "model": "m",
                "input": {"path": "in.jsonl"},
                "prompt": {"template": "{{ q }}"},
                "output": {"path": "out", "format": "jsonl", "error_file": True},
            }
        )
    fp = system_fingerprint({"model.safetensors": "ab"}, {"backend": "native"})
    assert (
        fp
        == system_fingerprint({"model.safetensors": "ab"}, {"backend": "native"})
        != system_fingerprint({"model.safetensors": "ab"}, {"backend": "vllm"})
    )


def test_openai_embeddings_batch_round_trip(ray_local, tiny_model, tmp_path):
    """/v1/embeddings requests in an OpenAI batch file, run with task: embed: each good request
    answered with OpenAI's embeddings body, its vector transformers' last hidden state of the
    input (tokenized with the tokenizer's special tokens, as vLLM's embeddings endpoint does),
    normalized; requests this job cannot answer as asked are error records naming the field."""
    import base64

    import numpy as np
    import torch
    from openai.types import CreateEmbeddingResponse
    from transformers import AutoModel

    from prefixflow.tokenizer import load_tokenizer

    doc = "The river rises in the hills and runs to the sea through three towns. "
    good = {f"e{i}": doc + q for i, q in enumerate(["Where?", "How long?", "Which towns?"])}
    good["e3"] = "A line of its own."
    good["e4-base64"] = doc + "Where?"  # the same input as e0, its vector as OpenAI's base64

    def line(cid: str, url: str, body: dict) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})

    lines = [
        line(
            cid,
            "/v1/embeddings",
            {"model": "m", "input": text, "encoding_format": "base64" if cid.endswith("base64") else "float"},
        )
        for cid, text in good.items()
    ]
    lines += [
        line("two-inputs", "/v1/embeddings", {"input": ["a", "b"]}),
        line("dims", "/v1/embeddings", {"input": "a", "dimensions": 8}),
        line("base16", "/v1/embeddings", {"input": "a", "encoding_format": "base16"}),
        line("temp", "/v1/embeddings", {"input": "a", "temperature": 0}),
        line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    spec = parse_spec(
        {
            "model": str(tiny_model),
            "task": "embed",
            "input": {"path": str(tmp_path / "batch.jsonl"), "format": "openai"},
            "engine": {"device": "cpu", "kv_cache_bytes": 16 << 20},
            "output": {"path": str(tmp_path / "out")},
        }
    )
    run_job(spec, quiet=True)
    results = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [json.loads(x)["custom_id"] for x in lines]  # input order
    by_id = {r["custom_id"]: r["response"] for r in results}
    tokenizer = load_tokenizer(str(tiny_model))
    hf = AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for cid, text in good.items():
        assert by_id[cid]["status_code"] == 200
        raw = json.loads(json.dumps(by_id[cid]["body"]))
        if cid.endswith("base64"):  # decoded as the OpenAI SDK decodes it before its types
            vector = base64.b64decode(raw["data"][0]["embedding"])
            raw["data"][0]["embedding"] = np.frombuffer(vector, dtype="float32").tolist()
        body = CreateEmbeddingResponse.model_validate(raw)
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            want = torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
        assert body.model == "m" and body.usage.prompt_tokens == len(ids) and len(body.data) == 1
        assert torch.allclose(torch.tensor(body.data[0].embedding), want, atol=1e-4), cid
    errors = {cid: by_id[cid]["body"]["error"] for cid in ("two-inputs", "dims", "base16", "temp", "chat")}
    assert all(by_id[cid]["status_code"] == 400 for cid in errors)
    assert errors["two-inputs"]["param"] == "input" and "one line per input" in errors["two-inputs"]["message"]
    assert errors["dims"]["param"] == "dimensions" and errors["base16"]["param"] == "encoding_format"
    assert errors["temp"]["param"] == "temperature"
    assert "asks for task generate, but this job's task is embed" in errors["chat"]["message"]
