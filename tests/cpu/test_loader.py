"""Loader: Hugging Face folders (single file or sharded) -> our model; clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixflow.engine.config import EngineConfig
from prefixflow.engine.models.loader import load_model, read_eos_token_ids
from prefixflow.engine.models.model_args import SUPPORTED_ARCHITECTURES, read_model_args
from prefixflow.engine.native.model_runner import ModelRunner
from prefixflow.engine.native.step import SeqChunk, StepInput
from prefixflow.engine.models.tiny import make_tiny_checkpoint
from prefixflow.requests import SamplingParams

PROMPT = (5, 17, 99, 4, 250, 31, 8, 77, 140, 61, 3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", seed=1)


def last_logits(path, dtype: str = "float32") -> torch.Tensor:
    runner = ModelRunner(EngineConfig(model=str(path), dtype=dtype, device="cpu", kv_cache_bytes=1 << 20))
    step = StepInput((SeqChunk(0, PROMPT, 0, 0, (0,), sample=True, sampling_params=SamplingParams(temperature=0.0)),))
    return runner.execute_logits(step)[0]


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_architecture_lists_the_supported_ones(ckpt, tmp_path):
    bad = edit_config(ckpt, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        read_model_args(bad)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_missing_folder_config_or_weights(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(ckpt, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(no_weights)
    with pytest.raises(ValueError, match="dtype"):
        load_model(ckpt, dtype="int8")


def test_missing_or_unexpected_weight(ckpt, tmp_path):
    weights = load_file(ckpt / "model.safetensors")
    missing = tmp_path / "missing"
    shutil.copytree(ckpt, missing)
    save_file(
        {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k},
        missing / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(missing)
    extra = tmp_path / "extra"
    shutil.copytree(ckpt, extra)
    save_file(
        dict(weights, **{"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
        extra / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match="extra"):
        load_model(extra)


def test_sharded_checkpoint_gives_the_same_logits(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(ckpt, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(str(ckpt)).save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert torch.equal(last_logits(sharded), last_logits(ckpt))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_runs(ckpt, dtype):
    model = load_model(ckpt, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    ref, half = last_logits(ckpt), last_logits(ckpt, dtype)
    assert torch.isfinite(half).all()
    assert (half - ref).abs().max() < 0.1 * ref.abs().max()


def test_config_parsing_old_and_new_rope_fields(ckpt, tmp_path):
    args = read_model_args(ckpt)
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (2, 4, 2, 32)
    assert args.rope.rope_type == "default"
    old = edit_config(
        ckpt, tmp_path / "v4", rope_parameters=None, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}
    )
    rope = read_model_args(old).rope
    assert (rope.theta, rope.rope_type, rope.factor) == (500000.0, "linear", 2.0)
    yarn = edit_config(ckpt, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type"):
        read_model_args(yarn)


def test_eos_ids(ckpt):
    assert read_eos_token_ids(ckpt) == (2,)
