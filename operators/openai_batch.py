"""OpenAI Batch API files: request lines in, output lines out.

Input line:  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "...", "messages": [...], "max_tokens": 64, ...}}
             (or url "/v1/completions" with body.prompt)
Output line: {"id": "batch_req_...", "custom_id": "r1",
              "response": {"status_code": 200, "request_id": "...", "body": {chat.completion}},
              "error": null}
A failed request has "response": null and "error": {"code": ..., "message": ...}. Every
custom_id of the input appears in the output: the parts (the commit unit, kept for resume) in
no particular order, and `results.jsonl` (`write_results`, once the job completes) in input
order, one line per request, as vLLM's run-batch writes its output file.

Body fields: each is honoured or the request becomes an error record naming it.
  - honoured: messages (chat; content parts of type text only: an image_url, input_audio or
    file part makes the request an error record) / prompt (completions); the SamplingParams fields in `_SAMPLING`
    (max_tokens / max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop,
    stop_token_ids, min_tokens, ignore_eos, n, presence_penalty, frequency_penalty,
    repetition_penalty, include_stop_str_in_output, skip_special_tokens); logprobs and
    top_logprobs (filled in as the API shapes them: chat's content list, completions' legacy
    tokens/token_logprobs/top_logprobs/text_offset); n > 1 (one choice per sample);
    response_format json_object / json_schema -> SamplingParams.structured_outputs (vLLM
    backend; the native engine answers such a request with an error record).
  - accepted, no meaning for generation: `NO_MEANING` (model, user, metadata, store,
    service_tier, ...), and `NEUTRAL` fields at the value that changes nothing (stream: false,
    echo: false, logit_bias: {}, tools: [], best_of: 1, ...).
  - anything else, e.g. `logit_bias` with entries or `stream: true`: an error record naming it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any, Callable

from prefixflow.operators.read import ERROR
from prefixflow.operators.template import content_text

URLS = ("/v1/chat/completions", "/v1/completions")
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')
# body field -> SamplingParams field (tests/cpu/test_jobs_openai.py checks each exists).
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
             "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
             "stop": "stop", "stop_token_ids": "stop_token_ids", "min_tokens": "min_tokens",
             "ignore_eos": "ignore_eos", "n": "n", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
             "min_p": "min_p", "include_stop_str_in_output": "include_stop_str_in_output",
             "skip_special_tokens": "skip_special_tokens"}
# Fields that say nothing about what is generated: accepted with any value.
NO_MEANING = ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key",
              "safety_identifier", "parallel_tool_calls", "request_id")
# Fields accepted only at a value that changes nothing (what a client sends by default).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (None, False), "stream_options": (None,), "echo": (None, False), "suffix": (None, ""),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "best_of": (None, 1)}
_ROUTED = {"/v1/chat/completions": ("messages", "logprobs", "top_logprobs", "response_format"),
           "/v1/completions": ("prompt", "logprobs", "response_format")}


def parse_requests(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn parsed JSONL records into request rows; a bad request keeps its error."""
    out = []
    for rec in records:
        row = {"custom_id": None, "_pf_url": None, "_pf_model": None, "_pf_messages": None,
               "_pf_prompt_text": None, "_pf_sampling": None,
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
    _check_fields(body, url)
    row: dict[str, Any] = {"custom_id": cid, "_pf_url": url, "_pf_model": body.get("model")}
    if url == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            raise ValueError("body.messages must be a list of chat messages for /v1/chat/completions")
        for i, message in enumerate(body["messages"]):
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                content_text(message["content"], i)  # an image or audio part: this request's error
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


def _check_fields(body: dict[str, Any], url: str) -> None:
    """ValueError naming the first body field that would change the answer but is not honoured."""
    for name, value in body.items():
        if name in NO_MEANING or name in _ROUTED[url] or name in _SAMPLING:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise ValueError(f"body.{name}={value!r} is not supported: remove it (accepted only "
                                 f"as {' or '.join(json.dumps(v) for v in NEUTRAL[name])})")
            continue
        other = {"/v1/chat/completions": "/v1/completions"}.get(url, "/v1/chat/completions")
        where = f" (it belongs to {other})" if name in _ROUTED[other] else ""
        raise ValueError(f"body.{name} is not a field prefixflow honours for {url}{where}: remove "
                         f"it (the sampling fields are {', '.join(sorted(_SAMPLING))})")


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
    raise ValueError(f"body.response_format={fmt!r} is invalid: use {{\"type\": \"text\"}}, "
                     "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                     "{\"name\": ..., \"schema\": {...}}}")


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


def output_line(row: dict[str, Any], created: int, default_model: str, model: str = "") -> dict[str, Any]:
    """The OpenAI batch output record of one output row. model: the model path, whose tokenizer
    spells the tokens of `logprobs` (needed only when the row has logprobs)."""
    cid = row.get("custom_id")
    digest = hashlib.sha256(f"{cid}:{row['row_id']}".encode()).hexdigest()
    rec: dict[str, Any] = {"id": f"batch_req_{digest[:24]}", "custom_id": cid}
    if row.get("error"):
        rec["response"] = None
        rec["error"] = {"code": "invalid_request", "message": row["error"]}
        return rec
    samples = _samples(row)
    generated = (sum(len(s["token_ids"] or []) for s in samples) if row.get("samples")
                 else row["num_generated_tokens"])
    usage = {"prompt_tokens": row["num_input_tokens"], "completion_tokens": generated,
             "total_tokens": row["num_input_tokens"] + generated}
    chat = row.get("_pf_url") != "/v1/completions"
    choices = [_choice(s, chat, model) for s in samples]
    body = ({"id": f"chatcmpl-{digest[:24]}", "object": "chat.completion"} if chat
            else {"id": f"cmpl-{digest[:24]}", "object": "text_completion"})
    body.update({"created": created, "model": row.get("_pf_model") or default_model,
                 "choices": choices, "usage": usage})
    rec["response"] = {"status_code": 200, "request_id": f"req_{digest[24:48]}", "body": body}
    rec["error"] = None
    return rec


def _samples(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's answers: its `samples` (n > 1) or the one generated text."""
    if row.get("samples"):
        return sorted(row["samples"], key=lambda s: s["index"])
    return [{"index": 0, "text": row["generated_text"], "token_ids": row.get("generated_tokens"),
             "finish_reason": row["finish_reason"], "logprobs": row.get("logprobs")}]


def _choice(sample: dict[str, Any], chat: bool, model: str) -> dict[str, Any]:
    logprobs = sample.get("logprobs")
    if isinstance(logprobs, str):  # the `logprobs` output column holds JSON text
        logprobs = json.loads(logprobs)
    if logprobs is not None:
        logprobs = (chat_logprobs if chat else completion_logprobs)(logprobs, _decoder(model))
    choice: dict[str, Any] = {"index": sample["index"]}
    if chat:
        choice["message"] = {"role": "assistant", "content": sample["text"]}
    else:
        choice["text"] = sample["text"]
    choice.update({"logprobs": logprobs, "finish_reason": sample["finish_reason"]})
    return choice


def chat_logprobs(entries: list[dict[str, Any]], decode: Callable[[int], str]) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]} from the engine's
    per-token entries ({token_id, logprob, top: [[token_id, logprob], ...]})."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t, lp) for t, lp in e.get("top") or []]}
                        for e in entries]}


def completion_logprobs(entries: list[dict[str, Any]], decode: Callable[[int], str]) -> dict[str, Any]:
    """The completions API's legacy shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [decode(e["token_id"]) for e in entries]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{decode(t): lp for t, lp in e.get("top") or []} for e in entries],
            "text_offset": offsets}


@functools.lru_cache(maxsize=4)
def _decoder(model: str) -> Callable[[int], str]:
    """token id -> its text, by the model's tokenizer (loaded once per process)."""
    if not model:
        raise ValueError("logprobs need the model's tokenizer: output_line was given no model path")
    from prefixflow.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    return lambda token_id: tokenizer.decode([int(token_id)])


def write_results(out: str, storage: Any) -> str:
    """Write `<out>/results.jsonl`: every output line of the job's committed parts, in input
    order (as vLLM's run-batch writes its one file), all at once (commit_bytes: a temporary
    file renamed, or one PUT). The parts stay the commit unit a resume works from; a rerun of a
    completed job writes this file again. Each part's commit record lists its row ids in the
    part's line order, and row ids are input positions. Returns the file's path."""
    from prefixflow.operators.commit import COMMITS, load_committed
    from prefixflow.operators.storage import join
    from prefixflow.operators.write import RESULTS_FILE, commit_bytes

    fs = storage.filesystem(out)
    keyed: list[tuple[int, bytes]] = []
    for manifest in load_committed(out, storage, clean=False).manifests:
        record = json.loads(fs.cat_file(join(out, COMMITS, f"{manifest['part']}.json")))
        lines = [line for line in fs.cat_file(join(out, manifest["part"])).splitlines() if line]
        if len(lines) != len(record["row_ids"]):
            raise RuntimeError(f"{manifest['part']} in {out!r} has {len(lines)} lines but its commit "
                               f"record {len(record['row_ids'])} rows: rerun with output.resume: true")
        keyed.extend(zip(record["row_ids"], lines))
    keyed.sort(key=lambda pair: pair[0])
    path = join(out, RESULTS_FILE)
    commit_bytes(path, b"".join(line + b"\n" for _, line in keyed), storage)
    return path
