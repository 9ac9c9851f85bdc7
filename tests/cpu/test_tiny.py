"""Tiny checkpoints: deterministic bytes, loadable by transformers, a working tokenizer."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from prefixflow.engine.models import tiny
from prefixflow.engine.models.tiny import make_tiny_checkpoint, tiny_checkpoint_cached


def digests(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", "qwen2", seed=1)
    b = make_tiny_checkpoint(tmp_path / "b", "qwen2", seed=1)
    c = make_tiny_checkpoint(tmp_path / "c", "qwen2", seed=2)
    files = {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}
    assert files <= set(digests(a))
    assert digests(a) == digests(b)
    assert digests(a)["model.safetensors"] != digests(c)["model.safetensors"]


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_loads_in_transformers_with_peaked_logits(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_checkpoint(tmp_path, arch)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert model.config.vocab_size == len(tok)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    ids = tok("The model reads the next token.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    # Not flat: greedy decoding has clear winners (see _FINAL_NORM_SCALE).
    assert logits.std(-1).min() > 1.0


def test_overrides_and_options(tmp_path):
    cfg = json.loads(
        (
            make_tiny_checkpoint(
                tmp_path / "l",
                "llama",
                llama3_rope=True,
                num_hidden_layers=4,
                hidden_size=256,
                tie_word_embeddings=True,
            )
            / "config.json"
        ).read_text()
    )
    shape = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["tie_word_embeddings"])
    assert shape == (4, 256, True)
    assert (cfg.get("rope_parameters") or cfg["rope_scaling"])["rope_type"] == "llama3"  # transformers 5 or 4
    with pytest.raises(ValueError, match="arch"):
        make_tiny_checkpoint(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="llama3_rope"):
        make_tiny_checkpoint(tmp_path / "y", "qwen2", llama3_rope=True)


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_tokenizer_round_trip_and_chat_template(tmp_path, arch):
    from transformers import AutoTokenizer

    # transformers picks the tokenizer class from the model type (Qwen2Tokenizer for qwen2).
    tok = AutoTokenizer.from_pretrained(str(make_tiny_checkpoint(tmp_path, arch)))
    text = "Hello world, the quick brown fox!\n  Tabs\tand ünïcode 123 ✓"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert chat_ids.count(tok.bos_token_id) == 1  # the template adds BOS, encoding does not again
    assert tok.convert_tokens_to_ids("<|assistant|>") in chat_ids


def test_cached_checkpoint_is_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXFLOW_CACHE", str(tmp_path))
    a = tiny_checkpoint_cached("mistral", seed=4, num_hidden_layers=1)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    b = tiny_checkpoint_cached("mistral", seed=4, num_hidden_layers=1)
    assert a == b and a.parent == tmp_path / "tiny"
    assert (b / "model.safetensors").stat().st_mtime_ns == stamp
    assert tiny_checkpoint_cached("mistral", seed=5, num_hidden_layers=1) != a
    assert [p.name for p in (tmp_path / "tiny").iterdir() if p.name.startswith(".")] == []


def test_command_line(tmp_path):
    tiny.main([str(tmp_path / "m"), "--arch", "qwen2", "--layers", "3", "--tied"])
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_hidden_layers"] == 3
