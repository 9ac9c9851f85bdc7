"""A job planned in windows: the sizes of the windows, and the job's plan seen whole.

A job of any size is read, tokenized and planned a window of rows at a time (operators/stages/
window_plans.plan_windows: each window planned by a Ray task), each window a Plan of its own
(plan.build_plan), dispatched while the next is read. The first windows are small, so that the
engines get work within seconds; later ones grow to the cap. What the windows cost: two rows
that share a prefix but fall into different windows are grouped apart, so the prefix is computed
once per window it appears in (and per replica) where one global plan computes it once, unless
the replica that runs the later window's rows still holds it in its prefix cache
(bench/stream_bench.py measures both bounds).

`WindowedPlan` is what the report and the plot read of such a job: the windows' summaries
summed, the rows of every group, and (where asked: `prefixflow plan`, a dry run) the windows'
plan tables joined (group ids and ranks continued across windows, as the engines and part names
saw them). A running job keeps no table: its driver holds a window's plan at a time, and 8
bytes a group for the plot.
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
    "home_hit_tokens",
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
    """The plan of a job planned in windows (or of one window), as the report reads a Plan:
    `summary` (merge_summaries), `group_sizes` (rows of each group, window after window) and
    `table` (every window's plan table, group ids and ranks continued across windows; None
    where it was not kept). Its units ran from the windows' own plans."""

    table: pa.Table | None
    summary: dict[str, Any]
    group_sizes: np.ndarray

    @property
    def num_replicas(self) -> int:
        return int(self.summary["num_replicas"])

    def replica_table(self, replica: int) -> pa.Table:
        if self.table is None:
            raise ValueError("this windowed plan kept no table")
        return self.table.filter(pc.equal(self.table.column("replica"), replica))

    @staticmethod
    def join(windows: Sequence["WindowedPlan"]) -> "WindowedPlan":
        """One plan of the windows' (each its own WindowedPlan; tables, where kept, already in
        the job's numbering: continued_table)."""
        tables = [w.table for w in windows if w.table is not None]
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) == len(windows) else None
        sizes = np.concatenate([w.group_sizes for w in windows]) if windows else np.zeros(0, np.int64)
        return WindowedPlan(table, merge_summaries([w.summary for w in windows]), sizes)


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
