"""A row's own sampling parameters: the columns that carry them and the SamplingParams they make.

An OpenAI request body (`_pf_sampling`, filled by operators/stages/openai_batch.py) or ray.data.llm's
`sampling_params` column overrides fields of the job's SamplingParams for its row. The
tokenize stage checks a row's overrides (a bad one makes the row an error record), preflight
checks a sample of rows, and the engine actors build each row's SamplingParams: all from here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from prefixflow.operators.columns import ADAPTER, IMAGES

SAMPLING_COLUMNS = ("_pf_sampling", "sampling_params")


def row_params(default: Any, rows: pa.Table, row_ids: np.ndarray) -> Any:
    """One SamplingParams, or a row_id -> SamplingParams map when rows override fields
    (an OpenAI request body, or ray.data.llm's `sampling_params` column), name LoRA adapters
    (the tokenize stage's `_pf_adapter`) or carry images (`_pf_images`)."""
    column = next((c for c in SAMPLING_COLUMNS if c in rows.column_names), None)
    if column is None and ADAPTER not in rows.column_names and IMAGES not in rows.column_names:
        return default
    n = rows.num_rows
    values = rows.column(column).to_pylist() if column is not None else [None] * n
    adapters = rows.column(ADAPTER).to_pylist() if ADAPTER in rows.column_names else [None] * n
    images = rows.column(IMAGES).to_pylist() if IMAGES in rows.column_names else [None] * n
    return {
        rid: _with_row_fields(row_sampling(default, value), adapter, image)
        for rid, value, adapter, image in zip(row_ids.tolist(), values, adapters, images)
    }


def _with_row_fields(params: Any, adapter: str | None, images: list[bytes] | None) -> Any:
    """`params` with the row's LoRA adapter and images (fields no sampling setting sets)."""
    if adapter is not None:
        params = replace(params, lora_adapter=adapter)
    return replace(params, images=tuple(images)) if images else params


def row_sampling(default: Any, value: Any) -> Any:
    """A row's SamplingParams: `default` with the row's overrides (a mapping, or its JSON text
    when the column was stored as text). ValueError naming the bad key or value."""
    if value is None:
        return default
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(
                f"sampling parameters are not a JSON object ({type(e).__name__}): "
                'give a mapping like {"temperature": 0}'
            ) from None
    return default.with_overrides(value)
