"""A tiny random vision-language checkpoint that vLLM's CPU build runs, and images to ask about.

Idefics3 (SmolVLM's architecture: a SigLIP-style vision tower, pixel shuffle, a Llama text
model): vLLM 0.32's Llava family imports torchvision, which cannot be installed beside this
torch, but its Idefics3 runs. 64x64 images of 16x16 patches, pixel shuffle 2: four image tokens
per image, no image splitting. The text model is the demo's tiny Llama with the tokenizer's
image tokens added; the chat template writes `<image>` for each image part, which vLLM and
transformers' processor both expand to `<fake_token_around_image><global-img><image>x4
<fake_token_around_image>`. transformers' Idefics3ForConditionalGeneration on the same files
is the oracle.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")

CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tiny_vlm(path: Path) -> Path:
    """Write the tiny Idefics3 checkpoint (weights, config, tokenizer, processor) into `path`."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    base = tiny_checkpoint_cached("llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = json.loads((base / "config.json").read_text())
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
    text_config = LlamaConfig(**{**text, "vocab_size": len(tokenizer)})
    vision = Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text_config.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=False,
        pad_token_id=text["pad_token_id"],
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.text_model.norm.weight.fill_(4.0)  # peaked logits, as the tiny text checkpoints
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 64}, max_image_size={"longest_edge": 64}
    )
    Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def png_bytes(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    """A deterministic random RGB image, PNG-encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(question: str, source: str) -> dict[str, Any]:
    """A user message asking `question` about the image `source` (OpenAI content parts)."""
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": source}}, {"type": "text", "text": question}],
    }


def transformers_answers(
    model: Path, messages: list[list[dict[str, Any]]], max_tokens: int, images_root: Path | None = None
) -> list[list[int]]:
    """Greedy answers of transformers' Idefics3 to each conversation (the oracle); image paths
    are read from `images_root`."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from prefixflow.images import ImageConfig, load_image, part_image

    config = ImageConfig(root=None if images_root is None else str(images_root))
    processor = AutoProcessor.from_pretrained(model)
    hf = Idefics3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    answers = []
    for conversation in messages:
        parts = [p for m in conversation if isinstance(m["content"], list) for p in m["content"]]
        images = [
            Image.open(io.BytesIO(load_image(part_image(p), config))).convert("RGB")
            for p in parts
            if p["type"] == "image_url"
        ]
        chat = [
            {
                "role": m["role"],
                "content": m["content"]
                if isinstance(m["content"], str)
                else [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
            }
            for m in conversation
        ]
        text = processor.apply_chat_template(chat, add_generation_prompt=True)
        enc = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = hf.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
        answers.append(out[0, enc["input_ids"].shape[1] :].tolist())
    return answers
