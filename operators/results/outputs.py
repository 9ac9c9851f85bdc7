"""Output rows: the typed columns every engine's outputs become, beside the input columns.

One definition for every path (the job driver of every face, batch_generator.Generator)
and both backends: the output columns (`OUTPUT_FIELDS`, `output_chunk`, `with_outputs`) and the
names input columns keep when an output column takes theirs (`input_name`). A row's sampling
overrides are operators/row_sampling.py's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pyarrow as pa

from prefixflow.operators.results.embed import EMBED_FIELDS, with_embed_fields
from prefixflow.operators.results.score import SCORE_FIELDS, with_score_fields

RANK, COMPUTED = "_pf_rank", "_pf_computed"
# The replica the plan gave a row to, where another replica ran it (work stealing): with RANK,
# the row's place in the plan, which names its part (operators/results/write.py); null: `replica`.
PLAN_REPLICA = "_pf_plan_replica"
# Prompt tokens the engine found computed (RequestOutput.num_cached_tokens; OpenAI's
# usage.prompt_tokens_details.cached_tokens); null on rows that did not run (error records). Internal, as COMPUTED: the OpenAI writer reads it, the other formats drop it.
CACHED = "_pf_cached"
# Output columns added to every row (names follow ray.data.llm where it has one).
OUTPUT_FIELDS = [
    pa.field("row_id", pa.int64()),
    pa.field("generated_text", pa.string()),
    pa.field("generated_tokens", pa.list_(pa.int32())),
    pa.field("num_input_tokens", pa.int32()),
    pa.field("num_generated_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("replica", pa.int32()),
    pa.field(RANK, pa.int64()),
    pa.field(COMPUTED, pa.float64()),
    pa.field(CACHED, pa.int32()),
    pa.field(PLAN_REPLICA, pa.int32()),
]
OPTIONAL = (CACHED, PLAN_REPLICA)  # with_outputs fills them with nulls where a caller has no value
# The bookkeeping output columns, which the rows a user gets back drop (the writers drop every _pf_).
INTERNAL = tuple(f.name for f in OUTPUT_FIELDS if f.name.startswith("_pf_"))
# With SamplingParams.n > 1 (any row of a chunk): every sample of each row, in index order
# (OpenAI batch `choices` are built from it: keep the names).
SAMPLE_TYPE = pa.struct(
    [
        pa.field("index", pa.int32()),
        pa.field("text", pa.string()),
        pa.field("token_ids", pa.list_(pa.int32())),
        pa.field("finish_reason", pa.string()),
        pa.field("logprobs", pa.string()),  # JSON, null unless asked
    ]
)
SAMPLES_FIELD = pa.field("samples", pa.list_(SAMPLE_TYPE))
KEEP_INTERNAL = ("_pf_url", "_pf_model", "_pf_prompt", "_pf_encoding")  # needed by the writers


def output_chunk(
    outs: list[Any],
    rows: pa.Table,
    prompt_len: np.ndarray,
    computed: np.ndarray,
    ranks: np.ndarray,
    replica: int,
    plan_replica: int,
    task: str = "generate",
) -> pa.Table:
    """Output rows for finished requests: their input columns plus the output columns.

    rows, prompt_len, computed, ranks: per output, in `outs` order (its input row, prompt
    tokens, prompt tokens computed with the prefix amortized, rank in its plan replica's order).
    replica: the replica that ran them; plan_replica: the one the plan gave them to.
    task: "generate" (`outs` are RequestOutputs), "score" or "classify" (ScoreOutputs,
    operators/results/score.py) or "embed" (EmbedOutputs, operators/results/embed.py).
    """
    n = len(outs)
    common = {
        "num_input_tokens": prompt_len.tolist(),
        "replica": [replica] * n,
        RANK: ranks.tolist(),
        COMPUTED: computed.tolist(),
        PLAN_REPLICA: [plan_replica] * n,
    }
    errors = [getattr(o, "error", None) for o in outs]
    if task != "generate":  # a prefill task: no text, no tokens
        columns = {
            **common,
            **no_generation(len(outs)),
            "row_id": [int(o.row_id) for o in outs],
            "error": errors,
            CACHED: [None if e else o.num_cached_tokens for o, e in zip(outs, errors)],
        }
        return with_task_fields(with_outputs(rows, columns, task), task, outs)
    columns = {
        **common,
        "row_id": [int(o.row_id) for o in outs],
        "generated_text": [None if e else o.text for o, e in zip(outs, errors)],
        "generated_tokens": [[] if e else [int(t) for t in o.token_ids] for o, e in zip(outs, errors)],
        "num_generated_tokens": [0 if e else len(o.token_ids) for o, e in zip(outs, errors)],
        "finish_reason": [None if e else o.finish_reason for o, e in zip(outs, errors)],
        "error": errors,
        CACHED: [None if e else o.num_cached_tokens for o, e in zip(outs, errors)],
    }
    table = with_outputs(rows, columns)
    if any(getattr(o, "logprobs", None) is not None for o in outs):
        table = table.append_column(
            "logprobs",
            pa.array([None if o.logprobs is None else json.dumps(plain(o.logprobs)) for o in outs], pa.string()),
        )
    if any(getattr(o, "samples", ()) for o in outs):
        table = table.append_column(
            SAMPLES_FIELD, pa.array([sample_rows(o, e) for o, e in zip(outs, errors)], SAMPLES_FIELD.type)
        )
    return table


def sample_rows(out: Any, error: str | None) -> list[dict[str, Any]] | None:
    """A row's `samples` value: its samples (one, sample 0, when it asked n = 1); null for an error."""
    if error:
        return None
    samples = out.samples or (out.as_sample(0),)
    return [
        {
            "index": s.index,
            "text": s.text,
            "token_ids": [int(t) for t in s.token_ids],
            "finish_reason": s.finish_reason,
            "logprobs": None if s.logprobs is None else json.dumps(plain(s.logprobs)),
        }
        for s in samples
    ]


def token_counts(group: Any, prefix_counted: bool) -> tuple[list[int], list[float]]:
    """Per member of `group`: prompt length, and prompt tokens computed with the prefix
    amortized over the members (not counted again where the engine computed it already: a
    later piece of a run cut between units)."""
    prefix = 0 if prefix_counted else group.prefix_len / max(group.num_members, 1)
    return ([group.prefix_len + len(d) for d in group.distinct], [prefix + len(d) for d in group.distinct])


def no_generation(n: int) -> dict[str, list[Any]]:
    """The generation columns of `n` rows that generated nothing (prefill tasks, error records)."""
    return {
        "generated_text": [None] * n,
        "generated_tokens": [[]] * n,
        "num_generated_tokens": [0] * n,
        "finish_reason": [None] * n,
    }


def error_records(rows: pa.Table, row_ids: list[int], errors: list[str], replica: int, task: str) -> pa.Table:
    """Output rows for rows that did not run (`rows`: their input rows, in `row_ids` order): the
    error, empty outputs, no tokens computed; a row's rank is its id."""
    n = len(row_ids)
    columns = {
        **no_generation(n),
        "row_id": row_ids,
        "num_input_tokens": [0] * n,
        "error": errors,
        "replica": [replica] * n,
        RANK: row_ids,
        COMPUTED: [0.0] * n,
    }
    return with_task_fields(with_outputs(rows, columns, task), task, None)


def task_fields(task: str) -> list[pa.Field]:
    """The output columns a task adds to the generate task's."""
    return SCORE_FIELDS if task in ("score", "classify") else EMBED_FIELDS if task == "embed" else []


def with_task_fields(table: pa.Table, task: str, outs: list[Any] | None) -> pa.Table:
    """Append the task's own columns; `outs` None gives nulls (error records)."""
    if task in ("score", "classify"):  # classify: the labels are the choices
        return with_score_fields(table, outs)
    if task == "embed":
        return with_embed_fields(table, outs)
    return table


def with_outputs(rows: pa.Table, columns: dict[str, list[Any]], task: str = "generate") -> pa.Table:
    """Input columns (bookkeeping dropped) followed by the typed output columns.

    An input column whose name an output column takes (`error`, `row_id`, ..., `prompt` with
    include_prompt, the task's own columns) is kept as `input_<name>`, never replaced.
    """
    user = [c for c in rows.column_names if not c.startswith("_pf_") or c in KEEP_INTERNAL]
    table = rows.select(user)
    ours = output_names(task, include_prompt="_pf_prompt" in user)
    table = table.rename_columns([input_name(c, user) if c in ours else c for c in user])
    for f in OUTPUT_FIELDS:
        values = columns.get(f.name, [None] * table.num_rows) if f.name in OPTIONAL else columns[f.name]
        table = table.append_column(f, pa.array(values, f.type))
    if "_pf_prompt" in table.column_names:  # include_prompt
        table = table.rename_columns(["prompt" if c == "_pf_prompt" else c for c in table.column_names])
    return table


def output_names(task: str, include_prompt: bool) -> set[str]:
    """Every column name the output rows may have besides the input's (part to part alike)."""
    names = {f.name for f in OUTPUT_FIELDS if not f.name.startswith("_pf_")} | {"logprobs", SAMPLES_FIELD.name}
    names |= {f.name for f in task_fields(task)}
    return names | ({"prompt"} if include_prompt else set())


def input_name(name: str, taken: list[str]) -> str:
    """The name an input column `name` is kept under when an output column takes its name."""
    new = f"input_{name}"
    while new in taken:  # the input has `input_error` too: `input_input_error`
        new = f"input_{new}"
    return new


def plain(obj: Any) -> Any:
    """Stats records and logprobs as JSON-friendly values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: plain(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return obj
