"""What planning in windows buys in time (issue 39): whole jobs on local Ray, one plan against
windows, side by side.

    python -m prefixflow.bench.stream_job_bench [--sizes 2000,20000] [--repeats 3] [--replicas 2]
        [--window-share 4] [--max-tokens 4] [--model smollm2-135m-instruct]
        [--out bench/results/stream_job_bench.json]

For each dataset size: the demo's documents x questions (shuffled, as the demo writes them),
in JSONL files of --rows-per-file rows (Ray Data's blocks, where windows are cut), run as a
job (jobs/run.run_job, native engine on the CPU) with one plan (window_rows unset: read,
tokenize and plan all, then run) and with window_rows = rows / --window-share, the two
interleaved, --repeats times each. Per run, from the job's start: when the first engine was
ready (its model loaded), when the first row finished (metrics.json per_replica
first_output_s), when the first part was committed (the commit records' written_at), and the
whole job's wall time; the prompt tokens the engines computed (what windows cost, their prefix
caches' hits counted) and the windows. Median,
min and max of each, the load average beside them. The model: the demo's tiny random Llama
(default: engine time small, so the plan's barrier shows) or --model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prefixflow.bench.fault_bench import local_records
from prefixflow.bench.pipeline_bench import KV_CACHE_BYTES, MAX_BATCHED_TOKENS, SYSTEM, USER

TIMES = ("engine_ready_s", "first_output_s", "first_part_s", "wall_s")


def write_rows(directory: Path, num_docs: int, questions: int, rows_per_file: int) -> Path:
    """The demo's rows (shuffled) in JSONL files of rows_per_file rows: a block each (Ray
    Data's parquet reader joins small files into one block, and a job of one block is one
    window)."""
    from prefixflow.jobs.demo import demo_rows

    rows = demo_rows(num_docs=num_docs, questions_per_doc=questions)
    directory.mkdir(parents=True, exist_ok=True)
    for k in range(0, len(rows), rows_per_file):
        with open(directory / f"rows-{k:09d}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[k : k + rows_per_file])
    return directory


def run_once(model: Path, data: Path, out: Path, args: argparse.Namespace, window_rows: int | None) -> dict[str, Any]:
    """One job, timed from its start (module docstring)."""
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import parse_spec

    spec: dict[str, Any] = {
        "model": str(model),
        "input": {"path": str(data), "format": "jsonl"},
        "prompt": {"system": SYSTEM, "user": USER},
        "sampling": {"temperature": 0, "max_tokens": args.max_tokens},
        "engine": {"device": "cpu", "kv_cache_bytes": KV_CACHE_BYTES, "max_num_batched_tokens": MAX_BATCHED_TOKENS},
        "replicas": args.replicas,
        "output": {"path": str(out), "overwrite": True},
    }
    if window_rows is not None:
        spec["window_rows"] = window_rows
    started = time.time()
    metrics = run_job(parse_spec(spec), quiet=True)
    wall = time.time() - started
    replicas = metrics["per_replica"]
    outputs = [r["first_output_s"] for r in replicas if r.get("first_output_s")]
    return {
        "engine_ready_s": min(r["engine_ready_s"] for r in replicas) - started,
        "first_output_s": min(outputs) - started if outputs else None,
        "first_part_s": min(r["written_at"] for r in local_records(out)) - started,
        "wall_s": wall,
        "rows": metrics["rows"],
        "computed_prompt_tokens": metrics["computed_prompt_tokens"],  # the plan's groups' count
        # what the engines computed, their prefix caches' hits (earlier windows' too) counted
        "engine_computed_prompt_tokens": sum(
            (r.get("engine_totals") or {}).get("num_computed_prompt_tokens", 0) for r in replicas
        ),
        "num_windows": metrics["plan"].get("num_windows", 1),
        "stage_seconds": metrics["stage_seconds"],
        "load_average": os.getloadavg()[0],
    }


def _spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in TIMES:
        vals = [r[key] for r in runs if r[key] is not None]
        out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
    return out


def bench_size(model: Path, work: Path, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """One plan and windows over `rows` rows, interleaved, --repeats each."""
    num_docs = max(1, rows // args.questions)
    data = write_rows(work / f"data-{rows}", num_docs, args.questions, args.rows_per_file)
    window_rows = max(1, num_docs * args.questions // args.window_share)
    runs: dict[str, list[dict[str, Any]]] = {"one_plan": [], "windows": []}
    for k in range(args.repeats):
        for name, window in (("one_plan", None), ("windows", window_rows)):
            runs[name].append(run_once(model, data, work / f"out-{rows}-{name}-{k}", args, window))
            print(rows, name, k, {key: round(runs[name][-1][key] or -1, 2) for key in TIMES}, flush=True)
    return {
        "rows": num_docs * args.questions,
        "window_rows": window_rows,
        "summary": {name: _spread(r) for name, r in runs.items()},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2000,20000", help="rows of each dataset, comma separated")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--rows-per-file", type=int, default=250)
    parser.add_argument("--window-share", type=int, default=4, help="window_rows = rows / this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", default=None, help="a model (default: the demo's tiny random Llama)")
    parser.add_argument("--out", default="bench/results/stream_job_bench.json")
    args = parser.parse_args(argv)

    import ray

    from prefixflow.jobs.demo import demo_checkpoint
    from prefixflow.jobs.run import LOCAL_CLUSTER_SYSTEM_CONFIG
    from prefixflow.model_source import resolve_model

    work = Path(tempfile.mkdtemp(prefix="pf_stream_job_bench_"))
    model = resolve_model(args.model) if args.model else demo_checkpoint(work)
    # One slot per engine and two for the read, tokenize and write tasks (a windowed job
    # tokenizes the next window while the engines run), and the settings of the local cluster
    # that `prefixflow run` starts (idle workers kept: jobs/run.py).
    ray.init(
        num_cpus=args.replicas + 2,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=LOCAL_CLUSTER_SYSTEM_CONFIG,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    result: dict[str, Any] = {"model": str(args.model or "tiny random llama"), "replicas": args.replicas}
    result["max_tokens"], result["sizes"] = args.max_tokens, {}
    for rows in (int(s) for s in args.sizes.split(",")):
        result["sizes"][str(rows)] = bench_size(model, work, rows, args)
    ray.shutdown()
    result["load_average_end"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
