"""plot.png beside metrics.json: tokens per engine step by kind for each replica, and the
plan's group sizes, readable at a glance. matplotlib is an optional extra (`prefixflow[plot]`):
without it a job still completes and says the plot was skipped."""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixflow.operators.results.commit import commit_bytes


PLOT_MISSING = "plot.png skipped: matplotlib is not installed (pip install 'prefixflow[plot]')"
MAX_PLOTTED_REPLICAS = 8  # one panel each; more would make every panel too thin to read


def write_plot(m: dict[str, Any], group_sizes: np.ndarray, path: str, storage: Any) -> str:
    """plot.png beside metrics.json: tokens per engine step by kind for each replica, and the
    plan's group sizes (rows of each group: Plan.group_sizes). Returns what happened, for
    metrics.json and the summary. matplotlib is an optional extra: without it the job still
    completes and says the plot was skipped."""
    try:
        png = plot_png(m, np.asarray(group_sizes))
    except ImportError:
        return PLOT_MISSING
    commit_bytes(path, png, storage)
    return "plot.png written"


def plot_png(m: dict[str, Any], sizes: np.ndarray) -> bytes:
    """The figure as PNG bytes (matplotlib's Agg canvas: no display, no pyplot state)."""
    import io

    from matplotlib.figure import Figure

    replicas = m["per_replica"][:MAX_PLOTTED_REPLICAS]
    fig = Figure(figsize=(11, 2.6 * (len(replicas) + 1) + 0.6), layout="constrained")
    axes = fig.subplots(len(replicas) + 1, 1, squeeze=False)[:, 0]
    for ax, record in zip(axes, replicas):
        _plot_steps(ax, record)
    _plot_groups(axes[-1], sizes, m)
    shown = (
        ""
        if len(m["per_replica"]) <= len(replicas)
        else f" (first {len(replicas)} of {len(m['per_replica'])} replicas)"
    )
    fig.suptitle(
        f"prefixflow job {m['job']!r}: {m['rows']} rows in {m['wall_seconds']:.1f} s, "
        f"plan's token saving {m['token_saving_ratio']:.1%}{shown}",
        fontsize=13,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _plot_steps(ax: Any, record: dict[str, Any]) -> None:
    """Stacked tokens per engine step: shared prefixes and distinct prompt chunks (prefill),
    then decode tokens (one per running request)."""
    steps = [s for s in record.get("steps", []) if isinstance(s, dict)]
    ax.set_title(
        f"replica {record['replica']}: {record['num_rows']} rows, {len(steps)} engine steps, {record['seconds']:.1f} s",
        loc="left",
        fontsize=11,
    )
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens per step")
    if not steps:
        ax.text(
            0.5,
            0.5,
            "no per-step records (this engine keeps run totals only)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return
    prefill = np.array([s.get("num_prefill_tokens", 0) + s.get("num_prefix_tokens", 0) for s in steps])
    decode = np.array([s.get("num_decode_tokens", 0) for s in steps])
    # step="post" draws step i over [i, i + 1): repeat the last value so the last step shows.
    x = np.arange(len(steps) + 1)
    top, both = np.append(prefill, prefill[-1]), np.append(prefill + decode, (prefill + decode)[-1])
    # Prefill steps can be 100x the decode steps: a log scale keeps the decode tokens visible.
    log = prefill.max() > 20 * max(decode.max(), 1)
    base = 1 if log else 0
    ax.fill_between(
        x,
        base,
        np.maximum(top, base),
        step="post",
        color="tab:blue",
        alpha=0.8,
        label=f"prefill (prompt) tokens: {int(prefill.sum()):,} in all",
    )
    ax.fill_between(
        x,
        np.maximum(top, base),
        np.maximum(both, base),
        step="post",
        color="tab:orange",
        alpha=0.8,
        label=f"decode tokens: {int(decode.sum()):,} in all",
    )
    if log:
        ax.set_yscale("log")
        ax.set_ylabel("tokens per step (log scale)")
    ax.set_xlim(0, len(steps))
    ax.set_ylim(base, None)
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(alpha=0.3)


def _plot_groups(ax: Any, sizes: np.ndarray, m: dict[str, Any]) -> None:
    """How many groups of each size the plan made (a size-1 group shares no prefix)."""
    ax.set_title(
        f"plan: {len(sizes)} prefix groups of {int(sizes.sum()):,} rows, order {m['order']}", loc="left", fontsize=11
    )
    ax.set_xlabel("group size (rows sharing one prompt prefix)")
    ax.set_ylabel("number of groups")
    if not len(sizes):
        ax.text(0.5, 0.5, "no groups (no rows ran)", ha="center", va="center", transform=ax.transAxes)
        return
    values, counts = np.unique(sizes, return_counts=True)
    if len(values) <= 30:  # one labelled bar per size
        ax.bar(values.astype(str), counts, width=0.6, color="tab:green")
        ax.set_xlim(-0.8, len(values) - 0.2)
    else:
        ax.hist(sizes, bins=40, color="tab:green")
    ax.grid(axis="y", alpha=0.3)
