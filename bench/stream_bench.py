"""What planning in windows costs in prompt tokens, against one global plan (issue 39), from the
plans alone (no engine runs: the tokens each plan computes, as its summary counts them).

    python -m prefixflow.bench.stream_bench [--rows 3000] [--replicas 4] [--out bench/results/stream_bench.json]

On two simulated workloads of shuffled rows (bench/sim_workloads.py: documents x questions, and
multi-turn conversations), the rows are planned as a windowed job plans them
(pipeline/windows.window_sizes over the rows in arrival order: the first window 1/16 of the cap,
doubling up to it; each window its own build_plan from block hashes, the stealing plan) with
windows capped at 1/16, 1/4 and all of the rows (1/1: windows of 1/16, 1/8, 1/4, 1/2 and the
rest), on the rows as they come (shuffled) and sorted by prompt first (a document's rows
together, as a careful user's input), against one global plan of every row. For each: the prompt tokens the windows' plans
compute (`computed`: engines that keep no prefix from one window to the next), and the tokens
engines compute whose prefix caches keep every whole block they computed
(`computed_if_cached`, ReplicaCaches: a prefix an earlier window computed on the same replica
is not computed again; a real cache keeps some, so a real engine's count lies between the two),
each as a ratio of the global plan's under the same model; the windows' sizes and the planning
time. Token counts are deterministic; times are this machine's.

Each window's plan knows which replica computed which blocks in the windows before
(pipeline/homes.py, what a windowed job's plan does): a unit goes to the replica that holds its
prefix, within that replica's share of the window, and `computed` counts what the rows find
there as not computed (an engine whose prefix cache holds `cache_blocks` blocks, Llama-3.1-8B's
KV on an H100 by the cost model). The cells marked "no affinity" plan each window alone (this
bench's figures before homes) for the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from prefixflow.bench.sim_engines import trie_tokens
from prefixflow.bench.sim_workloads import conversations, docs_questions
from prefixflow.pipeline import build_plan
from prefixflow.pipeline.block_hash import HashedPrompts, block_hashes
from prefixflow.pipeline.homes import PrefixHomes, estimated_cache_blocks, homes_of
from prefixflow.pipeline.ragged import RaggedTokens
from prefixflow.pipeline.windows import window_sizes

BLOCK_SIZE = 16
FRACTIONS = {"1/16": 16, "1/4": 4, "1/1": 1}  # the window cap, a share of the rows


def workloads(rows: int) -> dict[str, list[list[int]]]:
    """Token ids of the two workloads, rows shuffled (arrival order)."""
    docs = docs_questions(rows, seed=11, doc_len=(300, 2000), max_questions=200)
    chats = conversations(rows, seed=12)
    return {"docs_questions": trie_tokens(docs, seed=13), "conversations": trie_tokens(chats, seed=14)}


class ReplicaCaches:
    """Each replica's engine as a prefix cache that keeps every whole KV block it computed (an
    unbounded vLLM prefix cache): a row computes the blocks its replica never computed, and its
    short last block. Order within a replica does not matter to it; which replica does."""

    def __init__(self, replicas: int, block_size: int = BLOCK_SIZE):
        self.seen: list[set[int]] = [set() for _ in range(replicas)]
        self.block_size = block_size
        self.computed = 0

    def run(self, hashes: RaggedTokens, lengths: np.ndarray, replica_of_row: np.ndarray) -> None:
        for i in range(len(lengths)):
            seen = self.seen[int(replica_of_row[i])]
            whole = int(lengths[i]) // self.block_size
            row = hashes[i][:whole].tolist()
            new = [h for h in row if h not in seen]
            seen.update(new)
            self.computed += len(new) * self.block_size + int(lengths[i]) - whole * self.block_size


def _plan(prompts: list[list[int]], replicas: int, homes: PrefixHomes | None = None) -> tuple[Any, HashedPrompts]:
    hashed = HashedPrompts.from_tokens(prompts, BLOCK_SIZE)
    return build_plan(hashed, num_replicas=replicas, min_prefix_len=BLOCK_SIZE, stealing=True, homes=homes), hashed


def _rows_on(plan: Any, unit_replica: list[int], n: int) -> np.ndarray:
    """The replica each prompt (by index) runs on, its unit placed on unit_replica[unit]."""
    out = np.zeros(n, dtype=np.int64)
    units = np.repeat(np.arange(plan.num_units), np.diff(plan.unit_starts))
    out[plan.seq_index] = np.asarray(unit_replica, dtype=np.int64)[units]
    return out


def global_plan(prompts: list[list[int]], replicas: int) -> dict[str, Any]:
    """One plan of every row: the tokens it computes, and under ReplicaCaches."""
    plan, _ = _plan(prompts, replicas)
    caches = ReplicaCaches(replicas)
    ragged = RaggedTokens.from_sequences(prompts)
    unit_replica = plan.table.column("replica").to_numpy()[plan.unit_starts[:-1]].tolist()
    caches.run(block_hashes(ragged, BLOCK_SIZE), ragged.lengths, _rows_on(plan, unit_replica, len(prompts)))
    return {"computed": int(plan.summary["computed_prompt_tokens"]), "computed_if_cached": caches.computed}


def plan_in_windows(prompts: list[list[int]], window_rows: int, replicas: int, affinity: bool = True) -> dict[str, Any]:
    """The windowed job's plans over `prompts` in arrival order (module docstring); affinity:
    each window's plan knows the replicas' blocks from the windows before (homes.py)."""
    caches = ReplicaCaches(replicas)
    sizes = window_sizes(window_rows)
    homes = PrefixHomes.empty(replicas, estimated_cache_blocks(BLOCK_SIZE)) if affinity else None
    computed, windows, at, imbalance = 0, [], 0, []
    started = time.perf_counter()
    while at < len(prompts):
        rows = prompts[at : at + next(sizes)]
        plan, hashed = _plan(rows, replicas, homes)
        homes = homes_of(plan, homes) if homes is not None else None
        imbalance.append(round(float(plan.summary["predicted_seconds_max_over_mean"]), 3))
        placed = plan.table.column("replica").to_numpy()[plan.unit_starts[:-1]].tolist()
        ragged = RaggedTokens.from_sequences(rows)
        caches.run(block_hashes(ragged, BLOCK_SIZE), ragged.lengths, _rows_on(plan, placed, len(rows)))
        computed += int(plan.summary["computed_prompt_tokens"])
        windows.append(len(rows))
        at += len(rows)
    return {
        "window_rows": window_rows,
        "num_windows": len(windows),
        "windows": windows,
        "computed": computed,
        "computed_if_cached": caches.computed,
        "predicted_max_over_mean": imbalance,  # per window: the plan's slowest replica / the mean
        "planning_s": round(time.perf_counter() - started, 2),
    }


def run(rows: int, replicas: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": rows, "replicas": replicas, "block_size": BLOCK_SIZE, "workloads": {}}
    out["cache_blocks"] = estimated_cache_blocks(BLOCK_SIZE)
    for name, prompts in workloads(rows).items():
        whole = global_plan(prompts, replicas)
        cells = {}
        # The rows as they come, and sorted first (a careful user's input, a document's rows together).
        for ordered, label in ((prompts, ""), (sorted(prompts), ", rows sorted")):
            for f, d in FRACTIONS.items():
                cells[f + label] = plan_in_windows(ordered, max(len(prompts) // d, 1), replicas)
                cells[f + label + ", no affinity"] = plan_in_windows(
                    ordered, max(len(prompts) // d, 1), replicas, False
                )
        for cell in cells.values():
            cell["ratio_to_global"] = round(cell["computed"] / whole["computed"], 4)
            cell["ratio_to_global_if_cached"] = round(cell["computed_if_cached"] / whole["computed_if_cached"], 4)
        prompt_tokens = int(sum(len(p) for p in prompts))
        out["workloads"][name] = {"prompt_tokens": prompt_tokens, "global_plan": whole, "windows": cells}
        print(
            f"{name}: {len(prompts)} rows, {prompt_tokens} prompt tokens, global plan computes "
            f"{whole['computed']} ({whole['computed_if_cached']} cached); "
            + "; ".join(
                f"windows of {f}: {c['ratio_to_global']:.3f}x ({c['ratio_to_global_if_cached']:.3f}x cached)"
                for f, c in cells.items()
            ),
            flush=True,
        )
    out["load_average"] = list(os.getloadavg())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--out", default="bench/results/stream_bench.json")
    args = parser.parse_args(argv)
    result = run(args.rows, args.replicas)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
