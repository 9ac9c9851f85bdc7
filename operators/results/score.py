"""Score stage: the `score` task's output rows (PrefillOnly).

A replica's planned groups go through `engine.scoring.Scorer` instead of the generating engine;
each row gets one probability per allowed answer. The rows keep every output column of the
generate task (empty generation fields), so parts of both tasks read the same way, plus:

    choices   list<string>   the labels the row was scored on
    probs     list<double>   softmax over the choices' first-token logits
    logprobs  list<double>   each choice's first-token log-probability over the whole vocabulary
    label     string         the most probable choice
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from prefixflow.operators.config import ScoreConfig

SCORE_FIELDS = [
    pa.field("choices", pa.list_(pa.string())),
    pa.field("probs", pa.list_(pa.float64())),
    pa.field("logprobs", pa.list_(pa.float64())),
    pa.field("label", pa.string()),
]


def row_choices(config: ScoreConfig, rows: pa.Table, row_ids: np.ndarray) -> Any:
    """One list for every row, or row_id -> list from `choices_column` (a missing or empty
    value leaves the row without choices, which the Scorer reports as that row's error)."""
    if config.choices_column is None:
        return list(config.choices)
    if config.choices_column not in rows.column_names:
        return {int(r): [] for r in row_ids}
    values = rows.column(config.choices_column).to_pylist()
    return {int(r): list(v) if isinstance(v, (list, tuple)) else [] for r, v in zip(row_ids, values)}


def with_score_fields(table: pa.Table, outs: list[Any] | None) -> pa.Table:
    """Append the score columns; `outs` None gives nulls (error records of a score job)."""
    n = table.num_rows
    values = {
        "choices": [None] * n if outs is None else [list(o.choices) for o in outs],
        "probs": [None] * n if outs is None else [None if o.error else list(o.probs) for o in outs],
        "logprobs": [None] * n if outs is None else [None if o.error else list(o.logprobs) for o in outs],
        "label": [None] * n if outs is None else [o.label for o in outs],
    }
    for f in SCORE_FIELDS:
        table = table.append_column(f, pa.array(values[f.name], f.type))
    return table
