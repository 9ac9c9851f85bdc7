"""The prompt tokenizer of a checkpoint, without transformers where that gives the same tokens,
and its chat template rendered in prefixflow's bounded sandbox.

    tokenizer = load_tokenizer("path/to/model")
    text = chat_text(tokenizer, messages, add_generation_prompt=True)
    ids = tokenizer([text], add_special_tokens=False)["input_ids"]

Importing transformers (and through it torch) costs a tokenizer worker about five seconds and
a few hundred MB, which is most of a small job's tokenize stage. A checkpoint whose tokenizer
is fully described by its `tokenizer.json` (the generic fast tokenizer, as transformers saves
ours and the converted GGUF models) is read with the `tokenizers` library directly. Any other
tokenizer (a model-specific class that may rewrite the post-processor or pre-tokenizer at load
time) goes through transformers' AutoTokenizer, so the tokens always equal transformers'
(tests/cpu/test_tokenizer.py checks both paths).

A chat template is the model's code as much as its data: transformers renders it in Jinja's
sandbox with no bound on what it builds or how long it runs (two nested loops of 100,000 hung
the tokenize stage, issue 43). `chat_text` renders it, for either kind of tokenizer, in
prefixflow/sandbox.py's chat environment, set up as transformers sets up its own (the same
variables, trim_blocks and lstrip_blocks, loop controls, `{% generation %}`, a non-escaping
`tojson`, `raise_exception`, `strftime_now`, the named special tokens as variables,
continue_final_message), within the same limits as every prompt template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

# tokenizer_config.json classes whose load does nothing beyond reading tokenizer.json.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Config keys that make transformers rebuild parts of the tokenizer at load time.
REBUILDING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(model: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `model` (anything prefixflow.model_source resolves): a FastTokenizer when
    the checkpoint allows it, else transformers' AutoTokenizer."""
    from prefixflow.model_source import resolve_model  # hub ids, .gguf, s3://, short names

    folder = resolve_model(str(model))
    if not trust_remote_code and FastTokenizer.supports(folder):
        return FastTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)


class FastTokenizer:
    """The subset of a transformers tokenizer that prefixflow uses (batch call, encode, decode,
    eos_token_id, apply_chat_template to text), on `tokenizers` alone."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        config = _read_json(folder / "tokenizer_config.json")
        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        if config is None:
            raise ValueError(f"{folder} has no readable tokenizer_config.json: load the model with load_tokenizer")
        # The named special tokens (bos_token, eos_token, ...), as transformers names them.
        self.special_tokens_map = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        self.chat_template = _chat_template(folder, config)
        self._compiled: Any = None

    @staticmethod
    def supports(folder: Path) -> bool:
        """Whether transformers would load this tokenizer as tokenizer.json alone."""
        config = _read_json(folder / "tokenizer_config.json")
        if config is None or config.get("tokenizer_class") not in GENERIC_CLASSES:
            return False
        if any(k in config for k in REBUILDING_KEYS) or not isinstance(config.get("chat_template", ""), str):
            return False
        if config.get("clean_up_tokenization_spaces"):  # decode would post-process the text
            return False
        spec = _read_json(folder / "tokenizer.json")
        return spec is not None and spec.get("post_processor") is not None

    def __call__(self, texts: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """{"input_ids": ids} for one text, {"input_ids": [ids, ...]} for a list (as transformers)."""
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def __len__(self) -> int:
        """The vocabulary with added tokens, as len() of a transformers tokenizer."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens_map.get("eos_token")
        return None if eos is None else self.backend.token_to_id(eos)

    def get_chat_template(self, chat_template: str | None = None) -> str:
        """`chat_template` if given, else the model's own (transformers' method of that name)."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError("this model has no chat template: use a plain prompt template")
        return source

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, tokenize: bool = False, **kwargs: Any
    ) -> str:
        """chat_text(self, ...): the text only, as transformers' tokenize=False gives it."""
        if tokenize:
            raise ValueError("FastTokenizer.apply_chat_template renders text only: use tokenize=False")
        return chat_text(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)


# What transformers appends to the final message to find where it ends in the rendered chat.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    **variables: Any,
) -> str:
    """`messages` as the chat template of `tokenizer` (a FastTokenizer or a transformers
    tokenizer) writes them, or as `chat_template` does (a template, or the name of one of the
    model's named templates), rendered in the bounded sandbox with transformers'
    apply_chat_template's variables: messages, tools, documents, add_generation_prompt, the
    special tokens and `variables`. continue_final_message leaves the last message open, as
    transformers does. Raises jinja2.TemplateError (TemplateLimitError past a limit) or
    ValueError, as transformers would."""
    from prefixflow.sandbox import render  # jinja2, only where a chat is rendered

    source = tokenizer.get_chat_template(chat_template)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    final = None
    if continue_final_message:
        if "content" not in source:
            raise ValueError('continue_final_message is set but "content" is not a field the chat template reads')
        final = messages[-1].get("content")
        if not isinstance(final, str):
            raise ValueError('continue_final_message is set but the final message has no text "content"')
        messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
    values = {
        "messages": messages,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
        **tokenizer.special_tokens_map,
        **variables,
    }
    text = render(source, values, chat=True)
    return text if final is None else _open_final(text, final)


def _open_final(text: str, final: str) -> str:
    """The rendered chat cut right after the final message's text (transformers' rule)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the "
            "chat after applying the chat template (the template deletes part of it)"
        )
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """token id -> the bytes it stands for in the text, a whole UTF-8 character or part of one
    (OpenAI logprobs' `bytes`): decode() of a token that holds part of a character gives U+FFFD.

    Read from the token's vocabulary entry: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2)
    spells each byte as one printable character (`_byte_level_chars`); byte fallback
    (SentencePiece models such as Llama 2) spells a lone byte `<0xHH>` and a space `\u2581`.
    Added tokens are their own text. Any other tokenizer: the token's decoded text.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers
    if backend is None and hasattr(getattr(tokenizer, "backend", None), "to_str"):
        backend = tokenizer.backend  # FastTokenizer
    if backend is None:
        return lambda token_id: tokenizer.decode([int(token_id)]).encode("utf-8")
    spec = json.loads(backend.to_str())
    added: dict[int, bytes] = {int(a["id"]): a["content"].encode("utf-8") for a in spec.get("added_tokens") or []}
    kinds = _decoder_kinds(spec.get("decoder"))
    chars = _byte_level_chars()

    def piece_bytes(token_id: int) -> bytes:
        piece: str | None = backend.id_to_token(int(token_id))
        if token_id in added or piece is None:
            return added.get(token_id, b"")
        if "ByteLevel" in kinds:
            return b"".join(bytes([chars[c]]) if c in chars else c.encode("utf-8") for c in piece)
        if "ByteFallback" in kinds and (lone := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)):
            return bytes([int(lone.group(1), 16)])
        if kinds & {"ByteFallback", "Metaspace", "Replace"}:
            return piece.replace("\u2581", " ").encode("utf-8")
        text: str = backend.decode([int(token_id)], skip_special_tokens=False)
        return text.encode("utf-8")

    return piece_bytes


def _decoder_kinds(decoder: Any) -> set[str]:
    """The types of a tokenizer.json decoder and of the decoders a Sequence holds."""
    if not isinstance(decoder, dict):
        return set()
    return {str(decoder.get("type"))}.union(*(_decoder_kinds(d) for d in decoder.get("decoders") or []))


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's character for each byte -> the byte: a printable Latin-1 byte is its
    own character; the others, in byte order, take the code points from 256 up."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0x100)}
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    return config.get("chat_template")


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    return value["content"] if isinstance(value, dict) else str(value)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
