"""OpenAI Batch API input: request lines -> request rows (their output lines: openai_output.py).

Input line:  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "...", "messages": [...], "max_tokens": 64, ...}}
             (or url "/v1/completions" with body.prompt, or url "/v1/embeddings" with
             body.input, one string, for a job with task: embed)
Output lines (operators/results/openai_output.py): {"id": "batch_req_...", "custom_id": "r1",
              "response": {"status_code": 200, "request_id": "...", "body": {chat.completion}},
              "error": null}; a failed request has status_code 400 (500: the engine failed)
              and body {"error": {message, type, param, code}}. Every custom_id of the input
              appears in the output: the parts (the commit unit, kept for resume) in no
              particular order, and `results.jsonl` (once the job completes) in input order.

Body fields: each is honoured or the request becomes an error record naming it.
  - honoured: messages (chat; content parts of type text, and image_url on a vision-language
    job of engine.backend vllm (prefixflow/images.py): any other part (input_audio, file), or an
    image elsewhere, makes the request an error record) / prompt (completions); the SamplingParams fields in `_SAMPLING`
    (max_tokens / max_completion_tokens: one limit, both given they must be equal, else the
    request is an error record; temperature, top_p, top_k, min_p, seed, stop,
    stop_token_ids, min_tokens, ignore_eos, n, presence_penalty, frequency_penalty,
    repetition_penalty, include_stop_str_in_output, skip_special_tokens); logprobs and
    top_logprobs (filled in as the API shapes them: chat's content list, completions' legacy
    tokens/token_logprobs/top_logprobs/text_offset); n > 1 (one choice per sample; a greedy
    request's one answer n times);
    response_format json_object / json_schema -> SamplingParams.structured_outputs (vLLM
    backend; the native engine answers such a request with an error record).
  - accepted, no meaning for generation: `NO_MEANING` (model, user, metadata, store,
    service_tier, ...), and `NEUTRAL` fields at the value that changes nothing (stream: false,
    echo: false, logit_bias: {}, tools: [], best_of: 1, ...).
  - anything else, e.g. `logit_bias` with entries or `stream: true`: an error record naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefixflow.errors import invalid
from prefixflow.operators.columns import ERROR
from prefixflow.operators.results.openai_output import EMBEDDINGS
from prefixflow.operators.template import content_value
from prefixflow.requests import INT32_MAX, SamplingParams

# The urls read, and the task each asks for (the tokenize stage makes a request of another
# task's url an error record: one job runs one task).
URL_TASK = {"/v1/chat/completions": "generate", "/v1/completions": "generate", EMBEDDINGS: "embed"}
URLS = tuple(URL_TASK)
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')
# body field -> SamplingParams field (tests/cpu/test_jobs_openai.py checks each exists).
_SAMPLING = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens",
}
# Fields that say nothing about what is generated: accepted with any value.
NO_MEANING = (
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "parallel_tool_calls",
    "request_id",
)
# Fields accepted only at a value that changes nothing (what a client sends by default).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "stream_options": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "best_of": (None, 1),
}
_ROUTED = {
    "/v1/chat/completions": ("messages", "logprobs", "top_logprobs", "response_format"),
    "/v1/completions": ("prompt", "logprobs", "response_format"),
    EMBEDDINGS: ("input", "encoding_format", "dimensions"),
}


def parse_requests(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn parsed JSONL records into request rows; a bad request keeps its error."""
    out = []
    for rec in records:
        row = {
            "custom_id": None,
            "_pf_url": None,
            "_pf_model": None,
            "_pf_encoding": None,
            "_pf_messages": None,
            "_pf_prompt_text": None,
            "_pf_sampling": None,
            "_pf_source": rec.get("_pf_source"),
            ERROR: rec.get(ERROR),
        }
        if row[ERROR] is not None:  # broken line: recover the custom_id if it is readable
            row["custom_id"] = _recover_custom_id(rec.get("_pf_raw") or "")
            out.append(row)
            continue
        try:
            row.update(_request(rec))
        except ValueError as e:
            row["custom_id"] = rec.get("custom_id") if isinstance(rec.get("custom_id"), str) else None
            row[ERROR] = str(e)
        out.append(row)
    return out


def _recover_custom_id(raw: str) -> str | None:
    """The custom_id of a line that failed to parse, if it can be found in the text."""
    found = _CUSTOM_ID.search(raw)
    if found is None:
        return None
    try:
        cid = json.loads(f'"{found.group(1)}"')
        cid.encode("utf-8")
    except (ValueError, UnicodeEncodeError):  # a bad escape, or half a surrogate pair
        return found.group(1)  # as the line spells it
    return cid


def _request(rec: dict[str, Any]) -> dict[str, Any]:
    cid = rec.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise ValueError("custom_id is missing or not a string: every request needs a unique custom_id")
    url = rec.get("url")
    if url not in URLS:
        raise ValueError(f"url={url!r} is not supported: use {' or '.join(URLS)}")
    if rec.get("method", "POST") != "POST":
        raise ValueError(f"method={rec.get('method')!r} is not supported: use POST")
    body = rec.get("body")
    if not isinstance(body, dict):
        raise ValueError("body is missing or not an object")
    _check_fields(body, url)
    _check_max_tokens(body)
    row: dict[str, Any] = {"custom_id": cid, "_pf_url": url, "_pf_model": body.get("model")}
    if url == EMBEDDINGS:
        row["_pf_prompt_text"] = _embedding_input(body)
        row["_pf_encoding"] = body.get("encoding_format")  # float (None) or base64
        return row
    if url == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            raise ValueError("body.messages must be a list of chat messages for /v1/chat/completions")
        for i, message in enumerate(body["messages"]):
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                # An audio or file part is this request's error; an image part is checked where the
                # row is tokenized (a vision-language job on engine.backend vllm takes it).
                content_value(message["content"], i, images=[])
        row["_pf_messages"] = json.dumps(body["messages"])
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("body.prompt must be one string for /v1/completions")
        row["_pf_prompt_text"] = prompt
    overrides = _overrides(body, url)
    _check_sampling(overrides)
    row["_pf_sampling"] = json.dumps(overrides) if overrides else None
    return row


def _embedding_input(body: dict[str, Any]) -> str:
    """The one text an embeddings request embeds. A list of several inputs would be several
    answers in one output line, and token-id inputs skip our tokenizer: both refused by name."""
    given = body.get("input")
    if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str):
        given = given[0]
    if not isinstance(given, str) or not given:
        raise invalid("body", "input", given, f"give one non-empty string for {EMBEDDINGS} (one line per input)")
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise invalid("body", "encoding_format", body["encoding_format"], 'use "float" or "base64"')
    if body.get("dimensions") is not None:
        raise invalid("body", "dimensions", body["dimensions"], "remove it: the vector has the model's own size")
    return given


def _check_fields(body: dict[str, Any], url: str) -> None:
    """ValueError naming the first body field that would change the answer but is not honoured."""
    for name, value in body.items():
        if name in NO_MEANING or name in _ROUTED[url] or (name in _SAMPLING and url != EMBEDDINGS):
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise ValueError(
                    f"body.{name}={value!r} is not supported: remove it (accepted only "
                    f"as {' or '.join(json.dumps(v) for v in NEUTRAL[name])})"
                )
            continue
        other = {"/v1/chat/completions": "/v1/completions"}.get(url, "/v1/chat/completions")
        where = f" (it belongs to {other})" if name in _ROUTED[other] else ""
        fields = ", ".join(_ROUTED[url] if url == EMBEDDINGS else sorted(_SAMPLING))
        kind = "fields" if url == EMBEDDINGS else "sampling fields"
        raise ValueError(
            f"body.{name} is not a field prefixflow honours for {url}{where}: remove it (the {kind} are {fields})"
        )


def _check_max_tokens(body: dict[str, Any]) -> None:
    """max_tokens and max_completion_tokens name one limit: both given, they must agree. Taking
    either one (or the smaller) would answer a request its sender did not make."""
    given = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    if len(given) == 2 and given["max_tokens"] != given["max_completion_tokens"]:
        raise ValueError(
            f"body.max_tokens={given['max_tokens']!r} and body.max_completion_tokens="
            f"{given['max_completion_tokens']!r} disagree: they are one limit, give one of "
            "them (max_completion_tokens is the current name) or the same value in both"
        )


def _overrides(body: dict[str, Any], url: str) -> dict[str, Any]:
    """SamplingParams overrides of a body (their values are checked by SamplingParams)."""
    overrides = {ours: body[theirs] for theirs, ours in _SAMPLING.items() if body.get(theirs) is not None}
    top = _logprobs(body, url)
    if top is not None:
        overrides["logprobs"] = top
    structured = structured_outputs(body.get("response_format"))
    if structured is not None:
        overrides["structured_outputs"] = structured
    return overrides


def structured_outputs(fmt: Any) -> dict[str, Any] | None:
    """SamplingParams.structured_outputs for an OpenAI response_format (None: plain text).
    Only engine.backend: vllm runs them; the native engine makes such a row an error record."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    schema = (fmt.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if kind == "json_schema" and isinstance(schema, dict):
        return {"json": schema}
    raise invalid(
        "body",
        "response_format",
        fmt,
        'use {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
    )


def _logprobs(body: dict[str, Any], url: str) -> Any:
    """How many top log-probabilities the body asks for; None (or false) means none.

    Chat: `logprobs` is a bool and `top_logprobs` the count. Completions: `logprobs` is the
    count (0 and false: none, as before). The count's range is SamplingParams' to check."""
    asked = body.get("logprobs")
    if url == "/v1/chat/completions":
        if asked is not None and not isinstance(asked, bool):
            raise invalid("body", "logprobs", asked, "use true, false or null (the count goes in body.top_logprobs)")
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, (int, float))):
            raise invalid("body", "top_logprobs", top, "use an integer in [0, 20] or null")
        return (0 if top is None else top) if asked else None
    if asked is not None and not isinstance(asked, (bool, int, float)):
        raise invalid("body", "logprobs", asked, "use an integer in [0, 20] or null")
    return (0 if asked is True else asked) if asked else None


def _check_sampling(overrides: dict[str, Any]) -> Any:
    """Fail this request now (not the replica later) when its sampling fields are invalid.

    The job's own defaults are not known here, so a body without max_tokens is checked against
    the largest max_tokens (a min_tokens of 100 is no error on its own); the tokenize stage
    checks each request again against the job's sampling settings."""
    try:
        return SamplingParams(max_tokens=INT32_MAX).with_overrides(overrides)
    except ValueError as e:
        raise ValueError(f"body has invalid sampling parameters: {e}") from None
