"""The native engine's per-token finishing rules (EOS, stop token ids, stop strings, lengths)
and the incremental detokenizer they need (torch-free).
"""

from __future__ import annotations

from typing import Any

from prefixflow.engine.native.sequence import Sequence
from prefixflow.engine.outputs import RequestOutput, decode_output


def finished_output(seq: Sequence, tokenizer: Any, drop_last_from_text: bool) -> RequestOutput:
    """The output of a finished sequence; text is the stop-string-cut text when one matched."""
    out_ids = seq.output_token_ids
    if seq.finish_reason == "stop" and not drop_last_from_text:
        text = seq.text  # cut at the stop string by check_stop_string
    else:
        text = decode_output(out_ids, seq.params, tokenizer, drop_last_from_text)
    logprobs = tuple(seq.logprobs) if seq.params.logprobs is not None else None
    return RequestOutput(
        row_id=seq.row_id,
        prompt_token_ids=tuple(seq.token_ids[: seq.num_prompt_tokens]),
        token_ids=tuple(out_ids),
        text=text,
        finish_reason=seq.finish_reason or "length",
        logprobs=logprobs,
        prefix_len=seq.prefix_len,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
    )


def check_finish(seq: Sequence, eos_token_ids: tuple[int, ...], max_model_len: int) -> tuple[str, bool] | None:
    """After a token was appended: (finish_reason, last token is a stop/EOS id) or None.

    min_tokens holds back EOS, stop token ids and stop strings (as vLLM). Stop strings need
    `seq.text`, kept up to date by `append_text` before this is called.
    """
    params = seq.params
    token = seq.token_ids[-1]
    n = seq.num_output_tokens
    if n >= params.min_tokens:
        if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop", True
        if params.stop and cut_at_stop_string(seq):
            return "stop", False
    if n >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length", False
    return None


def append_text(seq: Sequence, tokenizer: Any) -> None:
    """Incremental detokenization (as Hugging Face TGI / vLLM): decode a small window of
    recent tokens and append only text that is complete (no partial UTF-8 character)."""
    ids = seq.output_token_ids
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    new_text = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        seq.text += new_text[len(prefix_text) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)


def cut_at_stop_string(seq: Sequence) -> bool:
    """If a stop string appears in the text, cut the text before it (after it with
    include_stop_str_in_output) and return True."""
    cut, end = -1, -1
    for stop in seq.params.stop:
        i = seq.text.find(stop)
        if i >= 0 and (cut < 0 or i < cut):
            cut, end = i, i + len(stop)
    if cut < 0:
        return False
    seq.text = seq.text[: end if seq.params.include_stop_str_in_output else cut]
    return True
