"""OpenAI batch output: the line of each output row, the results file and the error file.

A request that ran:
    {"id": "batch_req_...", "custom_id": "r1", "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": {chat.completion}}}
    body: id, object, created, model, system_fingerprint, choices (message with role, content
    and refusal: null; logprobs; finish_reason) and usage (prompt_tokens, completion_tokens,
    total_tokens, prompt_tokens_details.cached_tokens: the prompt tokens the engine found
    computed, by the request's prefix group or its prefix cache).
A request that failed, as OpenAI writes one that its endpoint refused:
    {"id": ..., "custom_id": "r2", "error": null,
     "response": {"status_code": 400, "request_id": ..., "body": {"error": {"message": ...,
                  "type": "invalid_request_error", "param": "temperature", "code": null}}}}
    (500 and "server_error" where the engine failed on the row). The top-level `error` is for
    requests that never ran (OpenAI: an expired batch); a finished job has none.

`write_results` writes `results.jsonl` in input order from the committed parts once the job
completes, and with output.error_file the failed requests to `errors.jsonl` instead (as OpenAI
splits its output and error files).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import struct
from typing import Any, Callable

from prefixflow.operators.results.bookkeeping import COMMITS, ERRORS_FILE, RESULTS_FILE
from prefixflow.operators.results.commit import commit_bytes, load_committed
from prefixflow.operators.results.outputs import CACHED
from prefixflow.operators.results.part_rows import batch_line_id, request_digest
from prefixflow.storage import cat_all, cat_each, join
from prefixflow.tokenizer import load_tokenizer, token_bytes

# The message isolate.py and operators/stages/supervise.py give a row the engine failed on: our failure
# (500), not the request's.
ENGINE_FAILED = "the engine failed on this row"
EMBEDDINGS = "/v1/embeddings"  # the url of an embeddings request (operators/stages/openai_batch.py reads them)
_PARAM = re.compile(r"\bbody\.(\w+)|\bSamplingParams\.(\w+)=")


def output_line(
    row: dict[str, Any], created: int, default_model: str, model: str = "", fingerprint: str | None = None
) -> dict[str, Any]:
    """The OpenAI batch output record of one output row. model: the model path, whose tokenizer
    spells the tokens of `logprobs` (needed only when the row has logprobs); fingerprint: the
    body's system_fingerprint (`system_fingerprint`)."""
    cid = row.get("custom_id")
    digest = request_digest(cid, row["row_id"])  # the line's ids prove its row (part_rows.py)
    rec: dict[str, Any] = {"id": batch_line_id(digest), "custom_id": cid}
    request_id = f"req_{digest[24:48]}"
    url = row.get("_pf_url")
    chat = url != "/v1/completions"
    if row.get("error"):
        status, error = error_body(row["error"], chat, embeddings=url == EMBEDDINGS)
        rec["response"] = {"status_code": status, "request_id": request_id, "body": {"error": error}}
        rec["error"] = None
        return rec
    if url == EMBEDDINGS:
        rec["response"] = {"status_code": 200, "request_id": request_id, "body": _embedding_body(row, default_model)}
        rec["error"] = None
        return rec
    samples = _samples(row)
    generated = sum(len(s["token_ids"] or []) for s in samples) if row.get("samples") else row["num_generated_tokens"]
    usage = {
        "prompt_tokens": row["num_input_tokens"],
        "completion_tokens": generated,
        "total_tokens": row["num_input_tokens"] + generated,
        "prompt_tokens_details": {"cached_tokens": int(row.get(CACHED) or 0)},
    }
    choices = [_choice(s, chat, model) for s in samples]
    body: dict[str, Any] = (
        {"id": f"chatcmpl-{digest[:24]}", "object": "chat.completion"}
        if chat
        else {"id": f"cmpl-{digest[:24]}", "object": "text_completion"}
    )
    body.update(
        {
            "created": created,
            "model": row.get("_pf_model") or default_model,
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": usage,
        }
    )
    rec["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    rec["error"] = None
    return rec


def _embedding_body(row: dict[str, Any], default_model: str) -> dict[str, Any]:
    """An embeddings response body (OpenAI's CreateEmbeddingResponse): one vector, as floats
    or, for encoding_format base64, as OpenAI encodes it: little-endian float32 bytes."""
    tokens = row["num_input_tokens"]
    vector: Any = [float(x) for x in row["embeddings"]]
    if row.get("_pf_encoding") == "base64":
        vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": row.get("_pf_model") or default_model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def error_body(message: str, chat: bool = True, embeddings: bool = False) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI's error object) for an error row's message: 500 where the engine
    failed, else 400 (the request: a bad line or field, a prompt too long for the model)."""
    if ENGINE_FAILED in message:
        return 500, {"message": message, "type": "server_error", "param": None, "code": None}
    if "max_model_len" in message and "the prompt has" in message:
        return 400, {
            "message": message,
            "type": "invalid_request_error",
            "param": "input" if embeddings else "messages" if chat else "prompt",
            "code": "context_length_exceeded",
        }
    named = _PARAM.search(message)
    param = (named.group(1) or named.group(2)) if named else None
    return 400, {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def system_fingerprint(model: dict[str, str], engine: dict[str, Any]) -> str:
    """A body's system_fingerprint: the same while the model's files (their sha256,
    prefixflow/model_source.model_fingerprint) and the engine settings stay the same."""
    key = json.dumps({"model": model, "engine": engine}, sort_keys=True, default=str)
    return f"fp_{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _samples(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's answers: its `samples` (n > 1) or the one generated text."""
    if row.get("samples"):
        return sorted(row["samples"], key=lambda s: s["index"])
    return [
        {
            "index": 0,
            "text": row["generated_text"],
            "token_ids": row.get("generated_tokens"),
            "finish_reason": row["finish_reason"],
            "logprobs": row.get("logprobs"),
        }
    ]


def _choice(sample: dict[str, Any], chat: bool, model: str) -> dict[str, Any]:
    logprobs = sample.get("logprobs")
    if isinstance(logprobs, str):  # the `logprobs` output column holds JSON text
        logprobs = json.loads(logprobs)
    if logprobs is not None:
        logprobs = (chat_logprobs if chat else completion_logprobs)(logprobs, _token_bytes(model))
    choice: dict[str, Any] = {"index": sample["index"]}
    if chat:
        choice["message"] = {"role": "assistant", "content": sample["text"], "refusal": None}
    else:
        choice["text"] = sample["text"]
    choice.update({"logprobs": logprobs, "finish_reason": sample["finish_reason"]})
    return choice


def token_text(data: bytes) -> str:
    r"""A token's text: its bytes as UTF-8, where a token holding only part of a character
    shows those bytes escaped (b"\xe2\x80" -> the 8 characters \xe2\x80); `bytes` has them."""
    return data.decode("utf-8", errors="backslashreplace")


def chat_logprobs(entries: list[dict[str, Any]], to_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}
    from the engine's per-token entries ({token_id, logprob, top: [[token_id, logprob], ...]})."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        data = to_bytes(token_id)
        return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}

    return {
        "content": [
            {**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e.get("top") or []]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[dict[str, Any]], to_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """The completions API's legacy shape: tokens, token_logprobs, top_logprobs, text_offset
    (each token's offset in the text: where its first whole character starts)."""
    data = [to_bytes(e["token_id"]) for e in entries]
    offsets = [len(b"".join(data[:i]).decode("utf-8", errors="ignore")) for i in range(len(data))]
    return {
        "tokens": [token_text(d) for d in data],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{token_text(to_bytes(t)): lp for t, lp in e.get("top") or []} for e in entries],
        "text_offset": offsets,
    }


@functools.lru_cache(maxsize=4)
def _token_bytes(model: str) -> Callable[[int], bytes]:
    """token id -> its bytes, by the model's tokenizer (loaded once per process)."""
    if not model:
        raise ValueError("logprobs need the model's tokenizer: output_line was given no model path")
    return token_bytes(load_tokenizer(model))


def write_results(out: str, storage: Any, error_file: bool = False) -> str:
    """Write `<out>/results.jsonl`: every output line of the job's committed parts, in input
    order (as vLLM's run-batch writes its one file), all at once (commit_bytes: a temporary
    file renamed, or one PUT); with error_file, the failed requests' lines go to
    `<out>/errors.jsonl` instead. The parts stay the commit unit a resume works
    from; a rerun of a completed job writes the files again. Each part's commit record lists
    its row ids in the part's line order, and row ids are input positions. Returns the path."""
    fs = storage.filesystem(out)
    keyed: list[tuple[int, bytes]] = []
    parts = [m["part"] for m in load_committed(out, storage, clean=False).manifests]
    records = cat_all(fs, [join(out, COMMITS, f"{part}.json") for part in parts])
    for part, raw, data in zip(parts, records, cat_each(fs, [join(out, part) for part in parts])):
        record = json.loads(raw)
        lines = [line for line in data.splitlines() if line]
        if len(lines) != len(record["row_ids"]):
            raise RuntimeError(
                f"{part} in {out!r} has {len(lines)} lines but its commit "
                f"record {len(record['row_ids'])} rows: rerun with output.resume: true"
            )
        keyed.extend(zip(record["row_ids"], lines))
    keyed.sort(key=lambda pair: pair[0])
    failed = [error_file and (json.loads(line).get("response") or {}).get("status_code") != 200 for _, line in keyed]
    path = join(out, RESULTS_FILE)
    commit_bytes(path, b"".join(line + b"\n" for (_, line), bad in zip(keyed, failed) if not bad), storage)
    if error_file:
        commit_bytes(
            join(out, ERRORS_FILE), b"".join(line + b"\n" for (_, line), bad in zip(keyed, failed) if bad), storage
        )
    return path
