"""scale_bench's workload: documents x questions under one system prompt, and its two output
length models.

- rows (`make_rows`): at least 2,048 chat rows; documents of 200-2,000 tokens (log-uniform)
  whose question counts follow a Zipf law (the first asked hundreds of times, most one to
  five); rows shuffled. Each row has its own max_tokens, 8-128.
- "fixed": every row makes exactly its max_tokens (ignore_eos), what the planner is told;
- "model_decided": the model decides: greedy outputs end at the checkpoint's EOS, whose id is
  chosen once (`choose_eos`) among the tokens the bench model emits so that lengths spread from
  a few tokens to the cap (MODEL_DECIDED_CAP, every row's max_tokens: the planner sees only the
  cap). A random-weight model's greedy output soon repeats one token for ever (the median row
  uses 4 distinct tokens in 160), which no EOS ends at varied lengths: the rows sample with
  frequency_penalty 0.5 (greedy still), which both systems apply alike. The bench records the
  chosen id and the length distribution.

The bench model is a random-weight Llama (4 layers, hidden 256, 4k context): big enough that
prefill compute, not per-step overhead, sets a prompt's pace.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

SYSTEM = (
    "You are a careful reader working through a large batch of documents. Read the document "
    "below and answer the question about it in one short sentence, using only what the "
    "document says."
)
USER = "Document: {{ document }}\n\nQuestion: {{ question }}"
BLOCK = 32  # vLLM's CPU attention wants multiples of 32; every system uses 32
KV_CACHE_BYTES = 64 << 20  # per replica: about 16k tokens of the bench model (fp32)
MODEL_SHAPE = dict(
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
WORKLOADS = ("fixed", "model_decided")
MODEL_DECIDED_CAP = 160  # every row's max_tokens in the model-decided workload
MODEL_DECIDED_SAMPLING = {"temperature": 0.0, "max_tokens": MODEL_DECIDED_CAP, "frequency_penalty": 0.5}


def zipf_counts(num_rows: int, top: int, exponent: float) -> list[int]:
    """Questions per document: round(top / rank^exponent), at least one, until num_rows."""
    counts: list[int] = []
    while sum(counts) < num_rows:
        counts.append(max(1, round(top / (len(counts) + 1) ** exponent)))
    counts[-1] -= sum(counts) - num_rows
    return [c for c in counts if c > 0]


def make_rows(tokenizer: Any, num_rows: int, seed: int = 0, top: int | None = None) -> list[dict[str, Any]]:
    """The bench's rows (module docstring), shuffled: id, doc_id, document, question, max_tokens."""
    from prefixflow.jobs.demo import _OBJECTS, _QUESTIONS, _SUBJECTS, _VERBS

    rng = random.Random(seed)
    counts = zipf_counts(num_rows, top or max(8, num_rows * 3 // 10), 1.3)
    rows = []
    for doc_id, count in enumerate(counts):
        target = int(math.exp(rng.uniform(math.log(200), math.log(2000))))
        sentences: list[str] = []
        while len(tokenizer.encode(" ".join(sentences))) < target:
            sentences += [
                f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
                for _ in range(max(1, (target - len(tokenizer.encode(" ".join(sentences)))) // 12))
            ]
        document = " ".join(sentences)
        for q in range(count):
            rows.append(
                {
                    "doc_id": doc_id,
                    "document": document,
                    "question": f"{rng.choice(_QUESTIONS)} (ask {q}, part {rng.randint(1, 99)})",
                    "max_tokens": rng.randint(8, 128),
                }
            )
    rng.shuffle(rows)
    return [{"id": i, **r} for i, r in enumerate(rows)]


def messages(row: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document: {row['document']}\n\nQuestion: {row['question']}"},
    ]


def chat_tokens(tokenizer: Any, row: dict[str, Any]) -> tuple[str, list[int]]:
    """A row's prompt as prefixflow's chat tokenizing makes it (the template holds the BOS):
    (text, token ids). The ray.data.llm runs tokenize the same way, inside their pipeline."""
    text = tokenizer.apply_chat_template(messages(row), add_generation_prompt=True, tokenize=False)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def sampling(row: dict[str, Any], workload: str) -> dict[str, Any]:
    """A row's sampling parameters in a workload."""
    if workload == "fixed":
        return {"temperature": 0.0, "max_tokens": row["max_tokens"], "ignore_eos": True}
    return dict(MODEL_DECIDED_SAMPLING)


def write_input(rows: list[dict[str, Any]], workload: str, path: Path) -> Path:
    """Both systems' input: one JSONL file of the rows with their `sampling_params`."""
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "sampling_params": sampling(r, workload)}) + "\n")
    return path


def bench_model(folder: Path) -> Path:
    """The random-weight Llama every system runs (module docstring)."""
    from prefixflow.engine.models.tiny import make_tiny_checkpoint

    path = folder / "scale-llama"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch="llama", seed=0, llama3_rope=False, **MODEL_SHAPE)
    return path


def greedy_outputs(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's output in the model-decided workload, run to the cap (ignore_eos), from
    the native engine."""
    from prefixflow.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model), device="cpu", dtype="float32", block_size=BLOCK, kv_cache_bytes=4 * KV_CACHE_BYTES
        )
    )
    outs = engine.generate(prompts, SamplingParams(**MODEL_DECIDED_SAMPLING, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def choose_eos(outputs: list[list[int]], cap: int, also: tuple[int, ...] = ()) -> tuple[int, list[int]]:
    """The EOS id whose first appearance in the greedy outputs spreads the output lengths most
    widely over 1..cap: the largest interquartile range of log lengths among tokens that end at
    least 80% of the rows before the cap and leave the median between cap/8 and cap/2. `also`:
    ids that end a row too (the tokenizer's own EOS, which the model keeps beside the chosen one).
    Returns (id, each row's length with it: the tokens up to and with the first of them, or cap)."""
    first: dict[int, np.ndarray] = {}  # token -> each row's length if it were the EOS
    for r, out in enumerate(outputs):
        seen: dict[int, int] = {}
        for i, t in enumerate(out):
            seen.setdefault(t, i + 1)
        for t, n in seen.items():
            first.setdefault(t, np.full(len(outputs), cap, np.int64))[r] = min(n, cap)
    always = np.full(len(outputs), cap, np.int64)
    for t in also:
        always = np.minimum(always, first.get(t, always))
    best, score = -1, -1.0
    for t, ends in first.items():
        if t in also:
            continue
        lengths = np.minimum(ends, always)
        median = float(np.median(lengths))
        if float(np.mean(lengths < cap)) < 0.8 or not cap / 8 <= median <= cap / 2:
            continue
        q1, q3 = np.percentile(np.log(lengths), [25, 75])
        if q3 - q1 > score:
            best, score = t, float(q3 - q1)
    if best < 0:
        raise RuntimeError(
            "no token of the bench model's greedy outputs spreads the lengths: change "
            "MODEL_DECIDED_CAP or the model's seed"
        )
    return best, np.minimum(first[best], always).tolist()


def with_eos(model: Path, eos_id: int, folder: Path) -> Path:
    """A copy of `model` that also ends a row at `eos_id`: config.json and
    generation_config.json list it beside the tokenizer's EOS (vLLM stops at both, and so does
    prefixflow, which reads generation_config.json). The tokenizer is left as it is: its EOS
    text appears in the chat template's prompts, which stay those of the fixed workload."""
    out = folder / f"scale-llama-eos{eos_id}"
    if (out / "config.json").exists():
        return out
    shutil.copytree(model, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        data = json.loads(path.read_text()) if path.exists() else {}
        own = data.get("eos_token_id")
        own = own if isinstance(own, list) else [] if own is None else [own]
        data["eos_token_id"] = [eos_id, *[e for e in own if e != eos_id]]
        path.write_text(json.dumps(data, indent=2))
    return out


def length_summary(lengths: list[int], cap: int) -> dict[str, Any]:
    """The output length distribution the bench records."""
    arr = np.asarray(lengths)
    return {
        "cap": cap,
        "min": int(arr.min()),
        "p10": float(np.percentile(arr, 10)),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90)),
        "max": int(arr.max()),
        "mean": float(arr.mean()),
        "at_cap": float(np.mean(arr >= cap)),
        "total": int(arr.sum()),
        "histogram_bins": (bins := [b for b in (1, 5, 10, 20, 40, 80, 120) if b < cap] + [cap, cap + 1]),
        "histogram": np.histogram(arr, bins=bins)[0].tolist(),
    }


def prompt_token_floors(prompts: list[list[int]], block: int = BLOCK) -> dict[str, int]:
    """The fewest prompt tokens any system can compute on these prompts, with a cache as large as
    it likes and any order: every distinct token once (the prefix tree's tokens), and, with a
    cache that reuses whole blocks only (vLLM's), every distinct whole block once plus each
    prompt's tokens past its last shared whole block (a prompt met whole still computes its last
    token). In sorted order each prompt shares the most with the one before it, so the sum over
    sorted neighbours is that floor."""
    from prefixflow.pipeline.prefix_tree import PrefixTree, sort_with_lcp
    from prefixflow.pipeline.ragged import RaggedTokens

    tokens = RaggedTokens.from_sequences(prompts)
    order, lcp = sort_with_lcp(tokens, block)
    lens = tokens.lengths[order]
    shared = np.minimum(np.r_[0, lcp], np.maximum(lens - 1, 0)) // block * block
    return {
        "prompt_tokens": int(lens.sum()),
        "distinct_prompt_tokens": PrefixTree.from_sorted(order, lcp, tokens.lengths).tree_tokens(),
        "whole_block_floor": int((lens - shared).sum()),
    }
