"""A job planned in windows: the sizes of the windows, and the job's plan seen whole.

A job of any size is read, tokenized and planned a window of rows at a time (operators/stages/
plan.plan_windows), each window a Plan of its own (plan.build_plan), dispatched while the next is
read. The first windows are small, so that the engines get work within seconds; later ones grow
to the cap. What the windows cost: two rows that share a prefix but fall into different windows
are grouped apart, so the prefix is computed once per window it appears in (and per replica) where
one global plan computes it once, unless the replica that runs the later window's rows still holds
it in its prefix cache (bench/stream_bench.py measures both bounds).

`WindowedPlan` is what the report and the plot read of such a job: the windows' plan tables
joined (group ids and ranks continued across windows, as the engines and part names saw them)
and their summaries summed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Summary counts that add up over windows; the ratios are recomputed or weighted by prompt tokens.
_SUMMED = (
    "num_rows",
    "num_groups",
    "num_shared_groups",
    "prompt_tokens",
    "computed_prompt_tokens",
    "num_units",
    "lost_saving_tokens",
    "tree_nodes",
    "planning_seconds",
)
_WEIGHTED = ("single_level_token_saving_ratio", "first_level_token_saving_ratio", "optimal_token_saving_ratio")
_REPLICA_SUMMED = (
    "num_rows",
    "num_groups",
    "computed_prompt_tokens",
    "predicted_seconds",
    "predicted_compute_seconds",
    "predicted_memory_seconds",
    "lost_saving_tokens",
)


def window_sizes(window_rows: int) -> Iterator[int]:
    """Rows of each window: window_rows / 16, doubling up to window_rows (at least 1 row)."""
    if window_rows < 1:
        raise ValueError(f"window_rows={window_rows} is invalid: use at least 1")
    size = max(window_rows // 16, 1)
    while True:
        yield size
        size = min(size * 2, window_rows)


def merge_summaries(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary of a job planned in windows (Plan.summary of each, in window order): counts
    summed; token_saving_ratio from the sums; the other saving ratios weighted by prompt tokens
    (each window's optimum: one global plan's may be higher); per replica, counts and predicted
    seconds summed; num_windows and each window's rows."""
    if not summaries:
        raise ValueError("no windows to merge")
    first = summaries[0]
    out: dict[str, Any] = {k: v for k, v in first.items() if k not in _SUMMED and k not in _WEIGHTED}
    for key in _SUMMED:
        out[key] = sum(s.get(key, 0) for s in summaries)
    prompt = out["prompt_tokens"]
    out["token_saving_ratio"] = 1.0 - out["computed_prompt_tokens"] / prompt if prompt else 0.0
    for key in _WEIGHTED:
        weighted = [(s[key], s["prompt_tokens"]) for s in summaries if key in s and s["prompt_tokens"]]
        out[key] = sum(v * w for v, w in weighted) / prompt if prompt and weighted else first.get(key, 0.0)
    replicas = []
    for r, rep in enumerate(first["replicas"]):
        merged = dict(rep)
        for key in _REPLICA_SUMMED:
            if key in rep:
                merged[key] = sum(s["replicas"][r][key] for s in summaries)
        replicas.append(merged)
    out["replicas"] = replicas
    predicted = np.array([rep.get("predicted_seconds", 0.0) for rep in replicas], dtype=np.float64)
    mean = float(predicted.mean()) if len(predicted) else 0.0
    out["predicted_seconds_max_over_mean"] = float(predicted.max() / mean) if mean > 0 else 1.0
    out["num_windows"] = len(summaries)
    out["window_rows"] = [int(s["num_rows"]) for s in summaries]
    return out


@dataclass(frozen=True, slots=True, eq=False)
class WindowedPlan:
    """The plan of a job planned in windows, as the report reads a Plan: `table` (every
    window's plan table, group ids and ranks continued across windows, window order) and
    `summary` (merge_summaries). Its units ran from the windows' own plans."""

    table: pa.Table
    summary: dict[str, Any]

    @property
    def num_replicas(self) -> int:
        return int(self.summary["num_replicas"])

    def replica_table(self, replica: int) -> pa.Table:
        return self.table.filter(pc.equal(self.table.column("replica"), replica))

    @staticmethod
    def join(tables: Sequence[pa.Table], summaries: Sequence[dict[str, Any]]) -> "WindowedPlan":
        """tables: each window's plan table, its group ids and ranks already in the job's
        numbering (continued); summaries: each window's Plan.summary."""
        table = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
        return WindowedPlan(table, merge_summaries(summaries))


def continued_table(table: pa.Table, first_group: int, first_ranks: Sequence[int]) -> pa.Table:
    """A window's plan table with group ids from `first_group` and each replica's ranks from
    first_ranks[replica] (the job's numbering, as its engines and part names used them)."""
    if not table.num_rows:
        return table
    replica = table.column("replica").to_numpy()
    rank = table.column("rank").to_numpy() + np.asarray(first_ranks, dtype=np.int64)[replica]
    group = table.column("group_id").to_numpy() + first_group
    table = table.set_column(table.schema.get_field_index("rank"), "rank", pa.array(rank, pa.int64()))
    return table.set_column(table.schema.get_field_index("group_id"), "group_id", pa.array(group, pa.int64()))
