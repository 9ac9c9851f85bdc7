"""prefixflow/tokenizer.py: the prompt tokenizer read from tokenizer.json alone gives exactly the
tokens and chat text transformers' AutoTokenizer gives, and anything it cannot vouch for goes
through transformers."""

from __future__ import annotations

import json
import shutil

import pytest

from prefixflow.engine.models.tiny import tiny_checkpoint_cached
from prefixflow.tokenizer import FastTokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    "",
    "  leading and trailing  ",
    "tabs\tand\nnew lines\n\n",
    "Ünïcödé — ✓ 日本語 🚀",
    "a" * 300,
    "<s> looks special </s> <pad>",
    "Document: the ship sailed.\nQuestion: where?\nAnswer:",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": 'Document: {"a": 1} <b>bold</b>\n\nQuestion: why?'},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again ✓"},
    ],
]


def _models():
    from prefixflow.model_source import resolve_model

    models = {arch: tiny_checkpoint_cached(arch) for arch in ("llama", "mistral", "qwen2")}
    try:
        models["smollm2"] = resolve_model("smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 - the packaged real model is installed by `make install` (not `make test-floor`)
        models["smollm2"] = f"smollm2-135m-instruct not available: {e}"
    return models


@pytest.fixture(scope="module")
def models():
    return _models()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "smollm2"])
def test_fast_tokenizer_equals_transformers(models, name):
    from transformers import AutoTokenizer

    folder = models[name]
    if isinstance(folder, str):
        pytest.skip(folder)
    ours = load_tokenizer(folder)
    assert isinstance(ours, FastTokenizer), f"{name}: expected the tokenizer.json path"
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for special in (True, False):
        assert (
            ours(TEXTS, add_special_tokens=special)["input_ids"]
            == theirs(TEXTS, add_special_tokens=special)["input_ids"]
        )
    ids = theirs("Ünïcödé ✓ text, with <s> specials </s>")["input_ids"] + [theirs.eos_token_id]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.encode(TEXTS[-1]) == theirs.encode(TEXTS[-1])
    assert ours(TEXTS[-1])["input_ids"] == theirs(TEXTS[-1])["input_ids"]
    assert ours.eos_token_id == theirs.eos_token_id
    assert len(ours) == len(theirs)
    if getattr(theirs, "chat_template", None):
        for messages in CHATS:
            for add in (True, False):
                assert ours.apply_chat_template(
                    messages, add_generation_prompt=add, tokenize=False
                ) == theirs.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)


def test_a_tokenizer_transformers_rebuilds_goes_through_transformers(models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(models["llama"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["add_eos_token"] = True  # transformers rewrites the post-processor at load time
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    assert not isinstance(tok, FastTokenizer)
    assert type(tok).__module__.startswith("transformers.")


def test_template_errors_are_template_errors(models, tmp_path):
    import jinja2

    folder = tmp_path / "model"
    shutil.copytree(models["llama"], folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ m.content | tojson }}{% endfor %}"
    )
    tok = load_tokenizer(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == '"<é>"'
    with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
