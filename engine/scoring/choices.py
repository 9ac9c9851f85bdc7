"""Choices of a scoring row -> token ids, and logits -> a ScoreOutput (torch only in `make_output`).

How choices are tokenized. A choice is a label the model could answer with, scored by the
probability of its FIRST token after the prompt. A string choice is encoded on its own,
`tokenizer.encode(prefix + choice, add_special_tokens=False)`, where `prefix` is " " when
`choice_leading_space` is set (for prompts such as "Answer:" that a word follows after a space;
byte-level BPE tokenizers fold that space into the word's token, so " Yes" and "Yes" differ).
It is the token the model would emit right after the prompt only when the prompt ends at a token
boundary, which holds for prompts that end in a newline, ":" or a space-free word and for the
chat template's generation prompt. An int choice is a token id used as is. Two choices whose
first tokens are equal cannot be told apart: the row gets an error naming them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixflow.errors import invalid

Choice = str | int


@dataclass(frozen=True, slots=True)
class ScoreOutput:
    """One scored row.

    choices: the labels as given (ints shown as str). choice_token_ids: their first tokens.
    probs: softmax over the choices' first-token logits (sums to 1); for a classifier (the
    classify task), its label logits through its activation (`label_output`).
    logprobs: each first token's log-probability under the full vocabulary (a classifier's:
    the probabilities' logs; none for a regression head).
    label: the most probable choice. prefix_len: prompt tokens of the group's shared prefix.
    num_cached_tokens: prompt tokens read from a cached prefix KV instead of computed.
    error: why the row was not scored (then probs, logprobs and label are empty / None).
    """

    row_id: int
    choices: tuple[str, ...]
    choice_token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    logprobs: tuple[float, ...] = ()
    label: str | None = None
    prompt_len: int = 0
    prefix_len: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


def choice_token_ids(
    choices: Sequence[Choice], tokenizer: Any, vocab_size: int, leading_space: bool
) -> tuple[int, ...]:
    """First token id of each choice; ValueError naming the choice for empty, out-of-vocabulary
    or colliding choices."""
    if isinstance(choices, (str, bytes)) or len(choices) < 1:
        raise invalid(
            "ScoreConfig",
            "choices",
            choices,
            "give a non-empty list of labels (strings or token ids), e.g. ['Yes', 'No']",
        )
    ids: list[int] = []
    for c in choices:
        if isinstance(c, bool) or not isinstance(c, (str, int)):
            raise ValueError(f"choice {c!r} is a {type(c).__name__}: use a string or a token id")
        if isinstance(c, int):
            tok = c
        else:
            toks = tokenizer.encode((" " if leading_space else "") + c, add_special_tokens=False)
            if not toks:
                raise ValueError(f"choice {c!r} encodes to no token: use a non-empty label")
            tok = int(toks[0])
        if not 0 <= tok < vocab_size:
            raise ValueError(f"choice {c!r} is token {tok}, outside the vocabulary 0..{vocab_size - 1}")
        ids.append(tok)
    seen: dict[int, Choice] = {}
    for c, tok in zip(choices, ids):
        if tok in seen:
            raise ValueError(
                f"choices {seen[tok]!r} and {c!r} both start with token {tok} "
                f"({_show(tokenizer, tok)}): their first-token probabilities "
                "are the same number; use labels whose first tokens differ"
            )
        seen[tok] = c
    return tuple(ids)


def _show(tokenizer: Any, tok: int) -> str:
    try:
        return repr(tokenizer.decode([tok]))
    except Exception:  # noqa: BLE001 - only used to improve a message
        return "?"


def make_output(
    row_id: int,
    choices: Sequence[Choice],
    ids: tuple[int, ...],
    logits: Any,
    prompt_len: int,
    prefix_len: int,
    num_cached: int,
) -> ScoreOutput:
    """logits: [V] fp32 next-token logits after the prompt."""
    import torch

    full = torch.log_softmax(logits.float(), dim=-1)  # [V]
    index = torch.tensor(ids, device=logits.device)
    probs = torch.softmax(logits.float()[index], dim=-1)  # [num_choices]
    labels = tuple(str(c) for c in choices)
    return ScoreOutput(
        row_id=row_id,
        choices=labels,
        choice_token_ids=ids,
        probs=tuple(probs.tolist()),
        logprobs=tuple(full[index].tolist()),
        label=labels[int(probs.argmax())],
        prompt_len=prompt_len,
        prefix_len=prefix_len,
        num_cached_tokens=num_cached,
    )


def label_output(
    row_id: int,
    labels: tuple[str, ...],
    values: Sequence[float],
    activation: str,
    prompt_len: int,
    prefix_len: int,
    num_cached: int,
) -> ScoreOutput:
    """A classified row: `values` are the classifier's label logits after its `activation`
    (ModelArgs.activation): probabilities for softmax and sigmoid, whose logs are the logprobs;
    raw outputs for identity (a regression head), which have no logprobs. label: the label of
    the largest value."""
    values = tuple(float(v) for v in values)
    logprobs = () if activation == "identity" else tuple(math.log(v) if v > 0 else -math.inf for v in values)
    return ScoreOutput(
        row_id=row_id,
        choices=labels,
        choice_token_ids=tuple(range(len(labels))),
        probs=values,
        logprobs=logprobs,
        label=labels[values.index(max(values))],
        prompt_len=prompt_len,
        prefix_len=prefix_len,
        num_cached_tokens=num_cached,
    )


def activate(logits: Any, activation: str) -> Any:
    """A classifier's label logits ([labels] tensor) through its activation (ModelArgs.activation)."""
    import torch

    if activation == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(logits.float())
    assert activation == "identity", f"unknown activation {activation!r}"
    return logits.float()


def error_output(row_id: int, choices: Sequence[Choice], prompt_len: int, error: str) -> ScoreOutput:
    labels = tuple(str(c) for c in choices) if not isinstance(choices, str) else (choices,)
    return ScoreOutput(row_id=row_id, choices=labels, prompt_len=prompt_len, error=error)
