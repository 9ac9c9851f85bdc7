"""OpenAI Batch API files: request lines in, output lines out.

Input line:  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "...", "messages": [...], "max_tokens": 64, ...}}
             (or url "/v1/completions" with body.prompt)
Output line: {"id": "batch_req_...", "custom_id": "r1",
              "response": {"status_code": 200, "request_id": "...", "body": {chat.completion}},
              "error": null}
A failed request has "response": null and "error": {"code": ..., "message": ...}. Every
custom_id of the input appears in the output, in no particular order (as with OpenAI).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from prefixflow.operators.read import ERROR

URLS = ("/v1/chat/completions", "/v1/completions")
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')
# body field -> SamplingParams field; others in the body are accepted and ignored (like vLLM).
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
             "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
             "stop": "stop", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}


def parse_requests(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn parsed JSONL records into request rows; a bad request keeps its error."""
    out = []
    for rec in records:
        row = {"custom_id": None, "_pf_url": None, "_pf_model": None, "_pf_messages": None,
               "_pf_prompt_text": None, "_pf_sampling": None, "_pf_max_tokens": None,
               "_pf_source": rec.get("_pf_source"), ERROR: rec.get(ERROR)}
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
    if body.get("n", 1) != 1:
        raise ValueError(f"body.n={body.get('n')!r} is not supported: send one request per sample")
    row: dict[str, Any] = {"custom_id": cid, "_pf_url": url, "_pf_model": body.get("model")}
    if url == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            raise ValueError("body.messages must be a list of chat messages for /v1/chat/completions")
        row["_pf_messages"] = json.dumps(body["messages"])
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("body.prompt must be one string for /v1/completions")
        row["_pf_prompt_text"] = prompt
    overrides = {ours: body[theirs] for theirs, ours in _SAMPLING.items() if body.get(theirs) is not None}
    top = _logprobs(body, url)
    if top is not None:
        overrides["logprobs"] = top
    params = _check_sampling(overrides)
    row["_pf_sampling"] = json.dumps(overrides) if overrides else None
    row["_pf_max_tokens"] = params.max_tokens if "max_tokens" in overrides else None
    return row


def _logprobs(body: dict[str, Any], url: str) -> Any:
    """How many top log-probabilities the body asks for; None (or false) means none.

    Chat: `logprobs` is a bool and `top_logprobs` the count. Completions: `logprobs` is the
    count (0 and false: none, as before). The count's range is SamplingParams' to check."""
    asked = body.get("logprobs")
    if url == "/v1/chat/completions":
        if asked is not None and not isinstance(asked, bool):
            raise ValueError(f"body.logprobs={asked!r} is invalid: use true, false or null "
                             "(the count goes in body.top_logprobs)")
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, (int, float))):
            raise ValueError(f"body.top_logprobs={top!r} is invalid: use an integer in [0, 20] or null")
        return (0 if top is None else top) if asked else None
    if asked is not None and not isinstance(asked, (bool, int, float)):
        raise ValueError(f"body.logprobs={asked!r} is invalid: use an integer in [0, 20] or null")
    return (0 if asked is True else asked) if asked else None


def _check_sampling(overrides: dict[str, Any]) -> Any:
    """Fail this request now (not the replica later) when its sampling fields are invalid.

    The job's own defaults are not known here, so a body without max_tokens is checked against
    the largest max_tokens (a min_tokens of 100 is no error on its own); the tokenize stage
    checks each request again against the job's sampling settings."""
    from prefixflow.requests import INT32_MAX, SamplingParams

    try:
        return SamplingParams(max_tokens=INT32_MAX).with_overrides(overrides)
    except ValueError as e:
        raise ValueError(f"body has invalid sampling parameters: {e}") from None


def output_line(row: dict[str, Any], created: int, default_model: str) -> dict[str, Any]:
    """The OpenAI batch output record of one output row."""
    cid = row.get("custom_id")
    digest = hashlib.sha256(f"{cid}:{row['row_id']}".encode()).hexdigest()
    rec: dict[str, Any] = {"id": f"batch_req_{digest[:24]}", "custom_id": cid}
    if row.get("error"):
        rec["response"] = None
        rec["error"] = {"code": "invalid_request", "message": row["error"]}
        return rec
    usage = {"prompt_tokens": row["num_input_tokens"], "completion_tokens": row["num_generated_tokens"],
             "total_tokens": row["num_input_tokens"] + row["num_generated_tokens"]}
    model = row.get("_pf_model") or default_model
    if row.get("_pf_url") == "/v1/completions":
        choice = {"index": 0, "text": row["generated_text"], "logprobs": None,
                  "finish_reason": row["finish_reason"]}
        body = {"id": f"cmpl-{digest[:24]}", "object": "text_completion"}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": row["generated_text"]},
                  "logprobs": None, "finish_reason": row["finish_reason"]}
        body = {"id": f"chatcmpl-{digest[:24]}", "object": "chat.completion"}
    body.update({"created": created, "model": model, "choices": [choice], "usage": usage})
    rec["response"] = {"status_code": 200, "request_id": f"req_{digest[24:48]}", "body": body}
    rec["error"] = None
    return rec
