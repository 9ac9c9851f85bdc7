"""`prefixflow demo`: the quickstart job end to end on local Ray, with nothing downloaded.

Writes a tiny random-weight checkpoint and a deterministic dataset (documents, each asked
several questions, under one shared system prompt: the prefix-sharing pattern the planner is
for), then runs jobs/examples/quickstart.yaml against them and prints the plan and metrics.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

_SUBJECTS = ("The model", "A student", "The scheduler", "My friend", "The engine", "A small cat",
             "The teacher", "Our team", "The river", "This system")
_VERBS = ("reads", "writes", "computes", "finds", "shares", "answers", "likes", "builds", "plans",
          "sees")
_OBJECTS = ("the long document", "a simple question", "every prefix", "the next token",
            "a cached block", "the blue sky", "many requests", "the final answer",
            "some numbers 1 2 3 42 2024", "an email to the user")
_QUESTIONS = ("What is the document about?", "Who reads the long document?",
              "Summarize the document in one sentence.", "What does the engine compute?",
              "Is the sentiment positive, negative or neutral?", "What is the final answer?",
              "Which numbers appear in the document?", "Translate the first sentence into French.",
              "What does the scheduler plan?", "Write a short title for the document.")


def demo_rows(num_docs: int = 12, questions_per_doc: int = 4, sentences_per_doc: int = 12,
              seed: int = 0) -> list[dict[str, Any]]:
    """Deterministic rows {id, doc_id, document, question}; same arguments -> same rows."""
    rng = random.Random(seed)
    rows = []
    for d in range(num_docs):
        sentences = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
                     for _ in range(sentences_per_doc)]
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
    from prefixflow.engine.tiny import make_tiny_checkpoint

    path = Path(directory) / "tiny-llama"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch="llama", seed=0)
    return path


def example_path(name: str) -> Path:
    return Path(__file__).parent / "examples" / name


def demo_spec(directory: str | Path) -> Any:
    """quickstart.yaml with its paths pointed into `directory`."""
    import yaml

    from prefixflow.jobs.spec import parse_spec

    directory = Path(directory).resolve()
    data = yaml.safe_load(example_path("quickstart.yaml").read_text())
    overrides = {"model": str(directory / "tiny-llama"), "input.path": str(directory / "demo.jsonl"),
                 "output.path": str(directory / "output"), "output.overwrite": True}
    return parse_spec(data, "quickstart.yaml", overrides)


def run_demo(directory: str | Path = "demo_output", plan_only: bool = False) -> dict[str, Any]:
    """Prepare the demo files, then run (or only plan) the quickstart job; returns the result."""
    from prefixflow.jobs.run import run_job

    directory = Path(directory)
    print(f"prefixflow demo: writing the tiny checkpoint and dataset under {directory}/")
    demo_checkpoint(directory)
    data = write_demo_data(directory)
    print(f"  dataset: {data} ({sum(1 for _ in open(data))} rows)")
    spec = demo_spec(directory)
    return run_job(spec, dry_run=plan_only or not engine_available())


def engine_available() -> bool:
    """Whether prefixflow.engine exports LLMEngine yet (the demo then only plans)."""
    try:
        from prefixflow.engine import LLMEngine  # noqa: F401
    except ImportError:
        return False
    return True
