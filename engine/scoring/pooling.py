"""The `embed` task's pooling: which hidden states make a row's embedding, and the output (torch-free).

An embedding is the model's final hidden states (after its last norm) pooled over the prompt:
`last` takes the last token's, `mean` averages every token's; `normalize` scales it to unit
length. A checkpoint says which in sentence-transformers' files, read as vLLM reads them: the
Pooling module named in `modules.json` (its `config.json`'s `pooling_mode_lasttoken` /
`pooling_mode_mean_tokens` or `pooling_mode`) and a Normalize module in the list. Without
those files a decoder model embeds by its last token, normalized (vLLM's default for a causal
model run as an embedding model). Modules that change the vector further (Dense) are not
applied here: such a checkpoint is refused by name rather than embedded differently.

In a causal model the hidden states of a group's shared prefix are the same for every member,
so a group computes them once: `last` needs none of them (a member's last token sees the prefix
through its KV), `mean` keeps their sum beside the prefix KV (engine/scoring/scorer.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from prefixflow.errors import invalid

PoolingKind = Literal["last", "mean"]
POOLING_KINDS: tuple[str, ...] = get_args(PoolingKind)
# sentence-transformers' module types by the last part of their path (it moved between releases)
_ST_KNOWN = ("Transformer", "Pooling", "Normalize")
# Pooling/config.json modes -> ours (the others, cls and max among them, are refused)
_ST_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean"}


@dataclass(frozen=True, slots=True)
class Pooling:
    """How hidden states become an embedding: kind "last" | "mean"; normalize to unit length."""

    kind: PoolingKind = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise invalid("Pooling", "kind", self.kind, f"use one of {', '.join(map(repr, POOLING_KINDS))}")
        if not isinstance(self.normalize, bool):
            raise invalid("Pooling", "normalize", self.normalize, "use true or false")


@dataclass(frozen=True, slots=True)
class EmbedOutput:
    """One embedded row. embedding: the pooled vector (float32 values), empty on an error.
    prompt_len: its tokens; prefix_len: those of its group's shared prefix; num_cached_tokens:
    prompt tokens read from a cached prefix instead of computed; error: why it has none."""

    row_id: int
    embedding: tuple[float, ...] = ()
    prompt_len: int = 0
    prefix_len: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


def model_pooling(model_dir: str | Path, kind: str | None = None, normalize: bool | None = None) -> Pooling:
    """The checkpoint's pooling (its sentence-transformers files, else last token normalized),
    with `kind` / `normalize` given here taking precedence. ValueError for a checkpoint whose
    modules this engine would not apply (a Dense layer) or whose pooling mode it lacks."""
    found_kind, found_norm = _sentence_transformers(Path(model_dir))
    return Pooling(
        kind=kind or found_kind,  # type: ignore[arg-type]  # Pooling checks it
        normalize=found_norm if normalize is None else normalize,
    )


def _sentence_transformers(folder: Path) -> tuple[str, bool]:
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return "last", True
    modules = json.loads(modules_file.read_text())
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} is not a list of modules")
    kind, normalize = "last", False
    for m in modules:
        short = str(m.get("type", "")).rsplit(".", 1)[-1]
        if short not in _ST_KNOWN:
            raise ValueError(
                f"{modules_file} lists a {m.get('type')} module, which prefixflow's engines do not "
                "apply: its embeddings would differ from the model's (use a checkpoint without it)"
            )
        if short == "Normalize":
            normalize = True
        if short == "Pooling":
            kind = _pooling_mode(folder / str(m.get("path", "")) / "config.json")
    return kind, normalize


def _pooling_mode(config_file: Path) -> str:
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    modes = [str(config["pooling_mode"])] if isinstance(config.get("pooling_mode"), str) else []
    modes += [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if not modes:
        return "last"
    if len(modes) > 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{config_file} pools by {' + '.join(modes)}; prefixflow pools by one of lasttoken or "
            "mean_tokens (set embed.pooling to override)"
        )
    return _ST_MODES[modes[0]]


def error_embedding(row_id: int, prompt_len: int, error: str) -> EmbedOutput:
    return EmbedOutput(row_id=row_id, prompt_len=prompt_len, error=error)
