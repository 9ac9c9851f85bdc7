"""Tiny, deterministic, randomly initialised checkpoints in Hugging Face format.

Tests, the demo and the benchmarks need real checkpoints without downloading anything, so we
write one: transformers' own config and model classes (the correctness oracle reads the same
files), random weights from `torch.manual_seed(seed)`, and a byte-level BPE tokenizer trained
here on a small built-in English corpus, with a chat template. Same arguments -> same bytes.

    python -m prefixflow.engine.models.tiny PATH --arch llama [--seed 0] [--layers 4 --hidden 512]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixflow.paths import cache_root

if TYPE_CHECKING:  # transformers is imported where it is used (a slow import)
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Bumped whenever the files written change, so cached checkpoints are rebuilt.
_FORMAT_VERSION = 4

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# "<|endoftext|>" is unused by our template, but transformers loads the tokenizer of a "qwen2"
# checkpoint as Qwen2Tokenizer, which adds that token when the vocabulary lacks it (and the
# vocabulary would then outgrow the model's).
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>")
TOKENIZER_VOCAB_SIZE = 1024

# Each turn ends with EOS, so a model that learned the format would stop after its answer.
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# head_dim 32: the smallest the Triton kernels take (kernels/_common.py TRITON_HEAD_DIMS).
_DEFAULTS: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two query heads per KV head
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    # Larger than HF's 0.02 so that the logits of a tiny model are not almost flat: greedy
    # decoding then has clear winners and sampling tests see a peaked distribution.
    initializer_range=0.05,
    tie_word_embeddings=False,
)

_FINAL_NORM_SCALE = 4.0

_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=256,
)


def make_tiny_checkpoint(
    path: str | os.PathLike, arch: str = "llama", seed: int = 0, llama3_rope: bool = False, **config_overrides: Any
) -> Path:
    """Write a random-weight checkpoint of `arch` into `path` (created) and return it.

    arch: "llama", "mistral", "qwen2" (Qwen2 has q/k/v biases) or "qwen3" (RMSNorm on each
        query and key head).
    llama3_rope: use Llama-3.1 rope scaling (rope_type "llama3"); llama only.
    config_overrides: any field of the transformers config, e.g. num_hidden_layers=4,
        hidden_size=512, tie_word_embeddings=True.
    """
    import torch

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported: use one of {', '.join(ARCHS)}")
    if llama3_rope and arch != "llama":
        raise ValueError(f"llama3_rope=True needs arch='llama', got arch={arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    config = _build_config(arch, len(tokenizer), llama3_rope, config_overrides)
    torch.manual_seed(seed)
    model = _model_class(arch)(config)
    with torch.no_grad():
        # The final norm's weight scales the logits: with HF's init (weight 1) a hidden-128
        # model gives logits of std ~0.6, an almost uniform distribution; 4 gives std ~2.3.
        model.model.norm.weight.fill_(_FINAL_NORM_SCALE)
        # HF initialises biases (Qwen2's q/k/v) to zero; random ones make the tests see them.
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3's, 1 at init: vary them
                param.normal_(1.0, 0.3)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    with _quiet_progress_bars():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """transformers draws a progress bar per shard written; tests and the demo need none."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def tiny_checkpoint_cached(
    arch: str = "llama", seed: int = 0, llama3_rope: bool = False, **config_overrides: Any
) -> Path:
    """Like `make_tiny_checkpoint`, written once under `$PREFIXFLOW_CACHE/tiny/` (default
    `~/.cache/prefixflow/tiny/`) in a folder keyed by the arguments, then reused.

    Safe when several processes ask at once: each writes a temporary folder and renames it.
    """
    key = dict(arch=arch, seed=seed, llama3_rope=llama3_rope, overrides=config_overrides)
    return _cached(arch, key, lambda tmp: make_tiny_checkpoint(tmp, arch, seed, llama3_rope, **config_overrides))


def _cached(name: str, key: dict[str, Any], make: Callable[[Path], Path]) -> Path:
    """The checkpoint `make` writes, once under the tiny cache in a folder keyed by `key`
    (tiny_checkpoint_cached's rules: written to a temporary folder, then renamed)."""
    # The transformers version is part of the key: its init and file format may change.
    text = json.dumps(dict(key, v=_FORMAT_VERSION, transformers=version("transformers")), sort_keys=True, default=str)
    root = cache_root() / "tiny"
    final = root / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by processes
    try:
        make(tmp)
        os.replace(tmp, final)  # atomic; fails if another process won the race
    except OSError:
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# The tiny vision-language checkpoint (Idefics3, SmolVLM's architecture: a SigLIP-style vision
# tower, pixel shuffle, a Llama text model). vLLM 0.32's Llava family imports torchvision, which
# cannot be installed beside this torch; its Idefics3 runs. 64x64 images of 16x16 patches, pixel
# shuffle 2: four image tokens per image, no splitting. The chat template writes `<image>` per
# image part, which vLLM and transformers' processor both expand to
# `<fake_token_around_image><global-img><image>x4<fake_token_around_image>`.
VLM_IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
VLM_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tiny_vlm_checkpoint(path: str | os.PathLike) -> Path:
    """Write the tiny Idefics3 checkpoint (weights, config, tokenizer, processor) into `path`:
    the tiny Llama (seed 0) as its text model, with the image tokens added."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers import Idefics3VisionConfig, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VLM_IMAGE_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    text_config = _build_config("llama", len(tokenizer), False, {})
    vision = Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16
    )
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_token, int)
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=LlamaConfig(**text_config.to_dict()).to_dict(),
        image_token_id=image_token,
        scale_factor=2,
        tie_word_embeddings=False,
        pad_token_id=text_config.pad_token_id,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.text_model.norm.weight.fill_(_FINAL_NORM_SCALE)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(path)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 64}, max_image_size={"longest_edge": 64}
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=VLM_CHAT_TEMPLATE
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_vlm_checkpoint_cached() -> Path:
    """`make_tiny_vlm_checkpoint`, written once under the tiny cache (as tiny_checkpoint_cached)."""
    return _cached("idefics3", dict(arch="idefics3"), make_tiny_vlm_checkpoint)


def png_image(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    """A deterministic random RGB picture, PNG-encoded (the vision tests' and bench's images)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _model_class(arch: str) -> type:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[arch]


def _build_config(arch: str, vocab_size: int, llama3_rope: bool, overrides: dict[str, Any]) -> PretrainedConfig:
    import transformers

    fields = dict(
        _DEFAULTS,
        vocab_size=vocab_size,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )
    if llama3_rope and int(version("transformers").split(".")[0]) >= 5:
        fields["rope_parameters"] = dict(_LLAMA3_ROPE)
    elif llama3_rope:  # transformers 4 reads rope_theta beside rope_scaling
        fields["rope_scaling"] = dict(_LLAMA3_ROPE)
        fields["rope_theta"] = fields["rope_scaling"].pop("rope_theta")
    if arch == "mistral":
        fields["sliding_window"] = None  # we attend to the whole context, like HF then
    if arch == "qwen3":  # Qwen3Config's own default is 128, four times the tiny model's heads
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(overrides)
    if fields["vocab_size"] != vocab_size:
        raise ValueError(
            f"vocab_size={fields['vocab_size']} must equal the tokenizer's "
            f"{vocab_size}: leave vocab_size out of the overrides"
        )
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    config: PretrainedConfig = cls(**fields)
    return config


def _build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (like Llama 3's and Qwen2's) wrapped for transformers."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.additional_special_tokens = list(SPECIAL_TOKENS[3:])
    return tok


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    # Like Llama: the tokenizer adds BOS itself when asked for special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))]
    )
    return tok.to_str()


_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Language models read a prompt, one token at a time, and predict the next token.
Offline batch inference runs many prompts together: when prompts share a prefix, the prefix
is computed once and its keys and values are reused by every request of the group. The
scheduler decides which requests run in each step, and the model runner turns that decision
into tensors. Please answer the question below in one short sentence. What is the capital of
France? Paris is the capital of France. Summarize the following review of a product. The
battery lasts all day and the screen is bright, but the speaker is quiet. Translate the text
into French. Classify the sentiment of the sentence as positive, negative or neutral. You are
a helpful assistant. Write a short poem about the sea, the wind and the morning light.
"""

_SUBJECTS = (
    "the model",
    "a student",
    "the scheduler",
    "my friend",
    "the engine",
    "a small cat",
    "the teacher",
    "our team",
    "the river",
    "this system",
)
_VERBS = ("reads", "writes", "computes", "finds", "shares", "answers", "likes", "builds", "plans", "sees")
_OBJECTS = (
    "the long document",
    "a simple question",
    "every prefix",
    "the next token",
    "a cached block",
    "the blue sky",
    "many requests",
    "the final answer",
    "some numbers 1 2 3 42 2024",
    "an email to the user",
)


def _corpus() -> list[str]:
    lines = [line for line in _TEXT.splitlines() if line]
    for i, s in enumerate(_SUBJECTS):
        for j, v in enumerate(_VERBS):
            o = _OBJECTS[(i * 3 + j) % len(_OBJECTS)]
            lines.append(f"{s.capitalize()} {v} {o}, and then {_SUBJECTS[j]} {_VERBS[i]} {o}.")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama3-rope", action="store_true")
    parser.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    args = parser.parse_args(argv)
    overrides = {
        k: v
        for k, v in dict(
            num_hidden_layers=args.layers,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
        ).items()
        if v is not None
    }
    if args.tied:
        overrides["tie_word_embeddings"] = True
    out = make_tiny_checkpoint(args.path, args.arch, args.seed, args.llama3_rope, **overrides)
    print(out)


if __name__ == "__main__":
    main()
