"""What the side-by-side benchmarks share when they record a result: the command that gives it,
a median with its spread, the time a set of spans covers, and the JSON file under
bench/results/."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def command_line(module: str, args: argparse.Namespace) -> str:
    """The command that reruns a benchmark with these arguments (its --out left out)."""
    given = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    return f"python -m prefixflow.bench.{module} {given}"


def spread(values: list[float], name: str = "seconds") -> dict[str, float]:
    """{name}_median, _min and _max of repeated measurements."""
    return {f"{name}_median": statistics.median(values), f"{name}_min": min(values), f"{name}_max": max(values)}


def covered_length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the (start, end) spans: the time at least one was open (an
    engine with requests in it, a device with a kernel running), in the spans' unit."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write `result` as indented JSON to `path` (its folder made) and print its systems."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    for system, s in result.get("systems", {}).items():
        print(system, s)
