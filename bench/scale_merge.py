"""scale_bench's cells measured apart, joined into one result (issue 38).

A whole scale_bench (N = 1, 2, 4, both workloads, 3 repeats) is about 3 hours of a quiet 2-core
machine (35-45 minutes a workload at N = 4, 85 for N = 1 and 2 together, measured 2026-12-02),
more than one sitting; it is run a cell group at a time (`--replicas 4 --workloads
model_decided`, ...), each group side by side in one run as the bench does it. This joins those
files:

    .venv/bin/python -m prefixflow.bench.scale_merge bench/results/scale_bench_n4_model_decided.json \\
        bench/results/scale_bench_n2_model_decided.json ... [--out bench/results/scale_bench.json]

Every cell is taken as it was measured (its repeats, median, spread, load, outputs compared in its
own run); the goals are recomputed per N with scale_bench's own rule over the joined cells, so a
prefixflow cell is only ever compared with Ray's cells of the same N and workload, which ran in
the same sitting. Refused: files of another workload (rows, documents, EOS, output lengths or
prompt-token floors differ, or other engine settings) and a cell measured in two files (say which
one counts by leaving the other out, or by taking only some N of a file: `FILE:1` takes its
N = 1 cells, where a later sitting measured its N = 2 again). The result keeps, for each cell,
the file it came from, and leaves out the runs' per-row detail (one file given alone is trimmed
so for the repository).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from prefixflow.bench.scale_bench import RESULTS, SYSTEMS, acceptance, plot
from prefixflow.bench.scale_workload import WORKLOADS
from prefixflow.bench.sim_dispatch_check import goal_summary

# Per-row detail a run's record keeps, which the repository's copy leaves out (the work folder's
# summary has it): outputs and their lengths, the row-to-block, -batch and -engine maps and
# Ray's sorted order (sim_dispatch_check's `--extract` keeps what its check reads of them).
PER_ROW = ("outputs", "output_lengths", "block_row_ids", "row_block", "row_engine", "row_batch", "sorted_row_ids")
# Besides the workload, what must be equal for two files to have measured the same job.
SAME_SETTINGS = ("rows", "workers", "kv_cache_bytes", "block_size", "model", "model_config")


def _key_n(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def check_same_job(results: dict[str, dict[str, Any]]) -> None:
    """Raises ValueError naming the first file whose workload or engine settings differ."""
    (first_name, first), *rest = results.items()
    for name, result in rest:
        if result["workload"] != first["workload"]:
            raise ValueError(f"{name}: its workload differs from {first_name}'s: not the same job")
        for field in SAME_SETTINGS:
            if result["args"].get(field) != first["args"].get(field):
                raise ValueError(f"{name}: args.{field} differs from {first_name}'s: not the same job")


def _only_checks(part: dict[str, Any], replicas: set[int]) -> dict[str, Any]:
    """A sitting's (or a result's) dispatch check and note, for only its cells of those N."""
    taken = ", ".join(str(n) for n in sorted(replicas))
    out = {**part, "note": " ".join(filter(None, [part.get("note"), f"only its N = {taken} cells taken"]))}
    check = part.get("dispatch_check")
    if check and "runs" in check:  # not a skipped check
        kept = {k: v for k, v in check["runs"].items() if _key_n(k.split("#")[0]) in replicas}
        held = goal_summary(list(kept.values()), check["goal"])
        out["dispatch_check"] = {
            **check,
            "runs": kept,
            "max_abs_error": held["max_abs_error"],
            "within_goal": held["within_goal"],
        }
    return out


def only_replicas(name: str, result: dict[str, Any], replicas: set[int]) -> dict[str, Any]:
    """A result (a sitting's, or a joined one) with only its cells of those N, and of its
    sittings' dispatch checks only those cells' runs."""
    runs = {k: v for k, v in result["runs"].items() if _key_n(k) in replicas}
    if not runs:
        raise ValueError(f"{name}: no cell with N in {sorted(replicas)}")
    if "merged_from" not in result:
        return {**_only_checks(result, replicas), "runs": runs}
    source = {k: v for k, v in result["cell_source"].items() if k in runs}
    sittings = {
        s: {**_only_checks(sitting, replicas), "cells": [c for c in sitting["cells"] if c in runs]}
        for s, sitting in result["merged_from"].items()
        if s in source.values()
    }
    return {**result, "runs": runs, "cell_source": source, "merged_from": sittings}


def read_file_arg(arg: str) -> tuple[str, dict[str, Any]]:
    """`PATH` or `PATH:N[,N...]` (only those N's cells): the file's name and its result."""
    selector = re.fullmatch(r"(.+):(\d+(?:,\d+)*)", arg)
    path = selector.group(1) if selector else arg
    result = json.loads(Path(path).read_text())
    name = Path(path).name
    if selector:
        result = only_replicas(name, result, {int(n) for n in selector.group(2).split(",")})
    return name, result


def trimmed(cell: dict[str, Any]) -> dict[str, Any]:
    """The cell without its runs' per-row detail (PER_ROW)."""
    repeats = [{k: v for k, v in r.items() if k not in PER_ROW} for r in cell["repeats"]]
    return {**cell, "repeats": repeats}


def _sittings(name: str, result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The sittings a result holds (itself, or those it was joined from) and each cell's."""
    if "merged_from" in result:
        return result["merged_from"], result["cell_source"]
    sitting = {
        "cells": sorted(result["runs"]),
        "repeats": result["args"]["repeats"],
        "machine": result.get("machine"),
        "note": result.get("note", ""),
        "dispatch_check": result.get("dispatch_check"),
    }
    return {name: sitting}, dict.fromkeys(result["runs"], name)


def merge(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One result from scale_bench results keyed by their file names (see the module's doc)."""
    check_same_job(results)
    runs: dict[str, Any] = {}
    source: dict[str, str] = {}
    sittings: dict[str, Any] = {}
    for name, result in results.items():
        held, cell_source = _sittings(name, result)
        sittings.update(held)
        for key, cell in result["runs"].items():
            if key in runs:
                raise ValueError(f"cell {key} is in {source[key]} and in {cell_source[key]}: leave one file out")
            runs[key], source[key] = trimmed(cell), cell_source[key]
    replicas = sorted({_key_n(k) for k in runs})
    measured = {k.split("/")[0] for k in runs}
    first = next(iter(results.values()))
    floors = {w: first["workload"]["floors"] for w in WORKLOADS}  # the prompts are the same
    accept: dict[str, Any] = {}
    for n in replicas:
        accept.update(acceptance(runs, n, floors))
    return {
        "bench": "scale_bench",
        "merged_from": sittings,
        "args": {
            **{f: first["args"][f] for f in SAME_SETTINGS},
            "replicas": replicas,
            "systems": [s for s in SYSTEMS if s in measured],
            "ablation": sorted(measured - set(SYSTEMS)),
            "workloads": [w for w in WORKLOADS if any(f"/{w}/" in k for k in runs)],
            "repeats": min(r["args"]["repeats"] for r in results.values()),
        },
        "workload": first["workload"],
        "cell_source": source,
        "runs": runs,
        "acceptance": accept,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="scale_bench result files (JSON), PATH or PATH:N[,N...]")
    p.add_argument("--out", default=str(RESULTS / "scale_bench.json"))
    args = p.parse_args(argv)
    results = dict(read_file_arg(f) for f in args.files)
    result = merge(results)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["acceptance"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
