"""Images to ask the tiny vision-language checkpoint about (engine/models/tiny.py
`make_tiny_vlm_checkpoint`, re-exported here as make_tiny_vlm), and transformers' answers:
Idefics3ForConditionalGeneration on the same files is the oracle.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from prefixflow.engine.models.tiny import make_tiny_vlm_checkpoint as make_tiny_vlm
from prefixflow.engine.models.tiny import png_image as png_bytes

__all__ = ["make_tiny_vlm", "png_bytes", "data_url", "image_message", "transformers_answers"]


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
