"""The `embed` task's output column: each row's embedding (engine/scoring/pooling.py).

The rows keep every output column of the generate task (empty generation fields), so parts of
every task read the same way, plus ray.data.llm's name for the vector:

    embeddings   list<float>   the row's pooled (and, as configured, normalized) hidden states
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

EMBED_FIELDS = [pa.field("embeddings", pa.list_(pa.float32()))]


def with_embed_fields(table: pa.Table, outs: list[Any] | None) -> pa.Table:
    """Append the embeddings column; `outs` None gives nulls (error records of an embed job)."""
    values = [None] * table.num_rows if outs is None else [None if o.error else list(o.embedding) for o in outs]
    return table.append_column(EMBED_FIELDS[0], pa.array(values, EMBED_FIELDS[0].type))
