"""Scale-out benchmark, fair (issue 38): one job shaped like real batch work on Ray's multi-node
test cluster on this machine (a head and 3 worker nodes of 2 CPU slots), N = 1, 2 and 4 engines,
prefixflow (both backends, plan + work stealing) against ray.data.llm as a careful user runs it
(bench/scale_systems.py says exactly how), on two workloads (bench/scale_workload.py): output
lengths fixed (ignore_eos) and decided by the model (greedy outputs end at an EOS chosen to
spread them). Every cell runs `--repeats` times, interleaved (each repeat runs every cell once),
each run its own driver process, so no engine or cache outlives it; the load average is kept
beside each run. Ray runs both of its configurations once per cell and repeats the faster (a
careful user's tuning). At N = 4 the static plan (work stealing off) runs too, for the ablation.

    .venv/bin/python -m prefixflow.bench.scale_bench [--replicas 1,2,4] [--repeats 3]
        [--workloads fixed,model_decided] [--systems ...] [--quick]

Results: bench/results/scale_bench.json (and .png): per cell every repeat's record, the
median and the spread (min, max) of its figures, Ray's better configuration per cell, outputs
compared token for token with prefixflow_native at N=1, the workload's prompt-token floors and
output lengths, the acceptance goals at N = 4 as met or not with their numbers, and
cluster_sim's dispatch model checked against the Ray runs (validate_dispatch).

Time it only with nothing else running: on 2 cores a second job skews every ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from prefixflow.bench.scale_systems import RAY_SYSTEMS, ray_num_blocks, run_one
from prefixflow.bench.scale_workload import (
    BLOCK,
    KV_CACHE_BYTES,
    MODEL_DECIDED_CAP,
    MODEL_DECIDED_SAMPLING,
    MODEL_SHAPE,
    WORKLOADS,
    bench_model,
    chat_tokens,
    choose_eos,
    greedy_outputs,
    length_summary,
    make_rows,
    prompt_token_floors,
    with_eos,
    write_input,
    zipf_counts,
)

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("prefixflow_native", "prefixflow_vllm", *RAY_SYSTEMS)
ABLATION = ("prefixflow_native_static", "prefixflow_vllm_static")  # at the largest N only
# Ray rewrites 127.0.0.1 in an address to the machine's IP unless "clusters" are off: with this
# every node and driver of the test cluster talks over the loopback address.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
FIGURES = (
    "wall_s",
    "wall_from_first_request_s",
    "wall_from_last_engine_start_s",
    "computed_prompt_tokens",
    "busy_max_over_mean",
    "end_spread_s",
)
RAY_TIE = 0.10  # Ray configurations this close in their first run both run every repeat
GOALS = {"speedup_vs_ray_best": 1.2, "busy_max_over_mean": 1.05, "computed_vs_whole_block_floor": 1.02}


class TestCluster:
    """Ray's multi-node test cluster on this machine: a head (6 CPU slots: drivers, tokenizing,
    ray.data.llm's other stages) and `workers` nodes of 2 CPU slots each, all on 127.0.0.1."""

    def __init__(self, workers: int, root: Path):
        from ray.cluster_utils import Cluster

        os.environ.update(LOOPBACK)
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 6,
                "node_ip_address": "127.0.0.1",
                "env_vars": {"PREFIXFLOW_CACHE": str(root / "head-cache")},
            },
        )
        for k in range(workers):
            self.cluster.add_node(
                num_cpus=2, node_ip_address="127.0.0.1", env_vars={"PREFIXFLOW_CACHE": str(root / f"node{k}-cache")}
            )
        self.cluster.wait_for_nodes()

    def run(self, system: str, replicas: int, data: Path, model: Path, out: Path, log: Path) -> dict[str, Any]:
        env = {**os.environ, **LOOPBACK, "RAY_ADDRESS": self.cluster.address}
        cmd = [
            sys.executable,
            "-m",
            "prefixflow.bench.scale_bench",
            "--run-one",
            system,
            "--replicas",
            str(replicas),
            "--data",
            str(data),
            "--model",
            str(model),
            "--out",
            str(out),
        ]
        with open(log, "wb") as f:
            proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{system} x{replicas} failed (exit {proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}"
            )
        return json.loads((out.parent / f"{out.name}.json").read_text())

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _driver_main(args: argparse.Namespace) -> None:
    """--run-one: one system on the cluster at RAY_ADDRESS; writes <out>.json."""
    import ray

    hook = {"worker_process_setup_hook": "prefixflow.bench.scale_systems.record_engine_fields"}
    ray.init(runtime_env=hook if args.run_one.startswith("ray_llm") else None, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    out = Path(args.out)
    record = run_one(args.run_one, int(args.replicas), Path(args.data), Path(args.model), out)
    (out.parent / f"{out.name}.json").write_text(json.dumps(record))


# ---- the workload, prepared once ----------------------------------------------------------------


def prepare(work: Path, num_rows: int) -> dict[str, Any]:
    """Rows, token ids, the model of each workload (the model-decided one with its chosen EOS),
    the input files and each row's output length in each workload."""
    from transformers import AutoTokenizer

    model = bench_model(work)
    tok = AutoTokenizer.from_pretrained(str(model))
    rows = make_rows(tok, num_rows)
    texts, tokens = zip(*(chat_tokens(tok, r) for r in rows))
    penalty = MODEL_DECIDED_SAMPLING["frequency_penalty"]
    cached = work / f"greedy-{num_rows}-{MODEL_DECIDED_CAP}-fp{penalty}.json"
    if not cached.exists():  # the same rows, model and sampling give the same outputs: computed once
        cached.write_text(json.dumps(greedy_outputs(model, list(tokens))))
    outputs = json.loads(cached.read_text())
    eos, lengths = choose_eos(outputs, MODEL_DECIDED_CAP, also=(tok.eos_token_id,))
    models = {"fixed": model, "model_decided": with_eos(model, eos, work)}
    inputs = {w: write_input(rows, w, work / f"rows-{w}.jsonl") for w in WORKLOADS}
    sorted_ids = [r["id"] for _, r in sorted(zip(texts, rows), key=lambda p: p[0])]
    return {
        "rows": rows,
        "tokens": [list(t) for t in tokens],
        "models": models,
        "inputs": inputs,
        "eos": eos,
        "sorted_ids": sorted_ids,
        "output_tokens": {"fixed": [r["max_tokens"] for r in rows], "model_decided": lengths},
    }


def _with_blocks(record: dict[str, Any], sorted_ids: list[int]) -> dict[str, Any]:
    """A Ray run's blocks in dispatch order: its sorted rows cut into `num_blocks` equal
    blocks, as `repartition` (no shuffle) cuts them (checked on Ray 2.60: 2,048 rows into 256
    blocks of 8, in order)."""
    if "num_blocks" not in record:
        return record
    n, k = len(sorted_ids), record["num_blocks"]
    bounds = [round(b * n / k) for b in range(k + 1)]
    block_ids = [sorted_ids[bounds[b] : bounds[b + 1]] for b in range(k)]
    record["block_rows"] = [len(b) for b in block_ids]
    record["block_row_ids"] = block_ids
    record["row_block"] = {r: b for b, ids in enumerate(block_ids) for r in ids}
    return record


# ---- figures, medians, goals --------------------------------------------------------------------


def figures(record: dict[str, Any]) -> dict[str, Any]:
    """The derived figures of one run: busy time balance (an engine that got no work counts,
    at 0) and the spread of the engines' last outputs."""
    busy = record["engine_busy_s"]  # every engine started, idle ones at 0
    ends = [e for e in record["engine_end_s"] if e is not None]
    return {**record, "busy_max_over_mean": max(busy) / (sum(busy) / len(busy)), "end_spread_s": max(ends) - min(ends)}


def cell_summary(repeats: list[dict[str, Any]], reference: dict[int, list[int]] | None) -> dict[str, Any]:
    """Median and (min, max) of each figure over the repeats, outputs compared with the reference."""
    out: dict[str, Any] = {"repeats": repeats, "median": {}, "spread": {}}
    for f in FIGURES:
        values = [r[f] for r in repeats]
        out["median"][f] = median(values)
        out["spread"][f] = [min(values), max(values)]
    out["load_average_1m"] = [r["load_average"][0] for r in repeats]
    if reference is not None:
        out["outputs_equal"] = [
            sum(r["outputs"].get(str(i), r["outputs"].get(i)) == t for i, t in reference.items()) for r in repeats
        ]
    return out


def acceptance(runs: dict[str, Any], n: int, floors: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The issue's goals at N = n on the model-decided workload, each met or not, with numbers;
    the same figures on the fixed workload beside them."""
    out: dict[str, Any] = {}
    for workload in WORKLOADS:
        rays = {s: runs[f"{s}/{workload}/{n}"] for s in RAY_SYSTEMS if f"{s}/{workload}/{n}" in runs}
        if not rays:
            continue
        best_ray = min(rays, key=lambda s: rays[s]["median"]["wall_from_first_request_s"])
        for system in ("prefixflow_native", "prefixflow_vllm"):
            cell = runs.get(f"{system}/{workload}/{n}")
            if cell is None:
                continue
            m, r = cell["median"], rays[best_ray]["median"]
            row = {
                "ray_best": best_ray,
                "speedup_vs_ray_best": r["wall_from_first_request_s"] / m["wall_from_first_request_s"],
                "speedup_vs_ray_best_with_start": r["wall_s"] / m["wall_s"],
                "busy_max_over_mean": m["busy_max_over_mean"],
                "computed_vs_ray_best": m["computed_prompt_tokens"] / r["computed_prompt_tokens"],
                "computed_vs_whole_block_floor": m["computed_prompt_tokens"] / floors[workload]["whole_block_floor"],
            }
            static = runs.get(f"{system}_static/{workload}/{n}")
            if static is not None:
                row["speedup_vs_static_plan"] = (
                    static["median"]["wall_from_first_request_s"] / m["wall_from_first_request_s"]
                )
                row["static_busy_max_over_mean"] = static["median"]["busy_max_over_mean"]
            if workload == "model_decided":
                row["goals"] = {
                    g: {"goal": v, "value": row[g], "met": row[g] >= v if g.startswith("speedup") else row[g] <= v}
                    for g, v in GOALS.items()
                    if g != "computed_vs_whole_block_floor" or system == "prefixflow_vllm"
                }
            out[f"{system}/{workload}/{n}"] = row
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    workloads = result["args"]["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for system in result["args"]["systems"]:
            keys = [(n, f"{system}/{workload}/{n}") for n in result["args"]["replicas"]]
            cells = [(n, result["runs"][k]) for n, k in keys if k in result["runs"]]
            if not cells:
                continue
            med = [c["median"]["wall_from_first_request_s"] for _, c in cells]
            lo = [m - c["spread"]["wall_from_first_request_s"][0] for m, (_, c) in zip(med, cells)]
            hi = [c["spread"]["wall_from_first_request_s"][1] - m for m, (_, c) in zip(med, cells)]
            ax.errorbar([n for n, _ in cells], med, yerr=[lo, hi], marker="o", capsize=3, label=system)
        ax.set(
            xlabel="engines (replicas)",
            ylabel="wall time from the first request (s)",
            title=f"{workload} output lengths",
            xticks=result["args"]["replicas"],
        )
        ax.legend(fontsize=7)
    fig.suptitle(
        f"scale_bench: {result['workload']['rows']} rows, {result['workload']['documents']} documents, "
        f"median of {result['args']['repeats']} (bars: min-max)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the bench ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="1,2,4")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--ablation", default=",".join(ABLATION), help="systems run at the largest N only")
    p.add_argument("--workers", type=int, default=3, help="worker nodes of the test cluster")
    p.add_argument("--quick", action="store_true", help="256 rows, N = 1 and 2, one repeat (a smoke run)")
    p.add_argument("--out", default=str(RESULTS / "scale_bench.json"))
    p.add_argument(
        "--work", help="a work folder: its finished runs (same rows and model) are taken as they are, the others run"
    )
    p.add_argument("--run-one", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def _cells(args: argparse.Namespace, replicas: list[int]) -> list[tuple[str, str, int]]:
    """(workload, system, N) of every cell, in run order within a repeat."""
    workloads, systems = args.workloads.split(","), args.systems.split(",")
    ablation = [s for s in args.ablation.split(",") if s]
    return [(w, s, n) for n in replicas for w in workloads for s in systems + (ablation if n == max(replicas) else [])]


def _ray_kept(found: dict[str, list], workload: str, n: int) -> list[str]:
    """The Ray configurations a careful user keeps for (workload, N): the faster one in its first
    repeat (wall time from the first request), and any other within RAY_TIE of it, which one run
    cannot tell apart from it (the faster then is the one of the lower median)."""
    tried = {s: found[k][0]["wall_from_first_request_s"] for s in RAY_SYSTEMS if (k := f"{s}/{workload}/{n}") in found}
    fastest = min(tried.values(), default=0.0)
    return [s for s, t in tried.items() if t <= fastest * (1 + RAY_TIE)]


def run_all(args: argparse.Namespace, work: Path, prep: dict[str, Any], replicas: list[int]) -> dict[str, list]:
    """Every run (reusing those already in `work`); returns {"system/workload/N": [records]}.
    Each repeat runs every cell once (so that a drift of the machine spreads over all of them);
    after the first, Ray runs only the configurations `_ray_kept` keeps (a careful user tries
    both once and keeps the better; two within noise of each other both run every repeat)."""
    cluster = TestCluster(args.workers, work)
    found: dict[str, list] = {}
    try:
        for k in range(args.repeats):
            for workload, system, n in _cells(args, replicas):
                if k > 0 and system in RAY_SYSTEMS and system not in _ray_kept(found, workload, n):
                    continue
                _run_cell(cluster, work, prep, found, k, workload, system, n)
    finally:
        cluster.shutdown()
    return found


def _run_cell(
    cluster: TestCluster,
    work: Path,
    prep: dict[str, Any],
    found: dict[str, list],
    k: int,
    workload: str,
    system: str,
    n: int,
) -> None:
    key, name = f"{system}/{workload}/{n}", f"{system}-{workload}-{n}-r{k}"
    done = work / f"{name}.json"
    if not done.exists():
        print(f"{key} repeat {k} ...", flush=True)
        cluster.run(system, n, prep["inputs"][workload], prep["models"][workload], work / name, work / f"{name}.log")
    record = figures(_with_blocks(json.loads(done.read_text()), prep["sorted_ids"]))
    record["workload"] = workload
    found.setdefault(key, []).append(record)
    print(
        f"  {key} #{k}: wall {record['wall_s']:.1f} s, from the first request "
        f"{record['wall_from_first_request_s']:.1f} s, computed {record['computed_prompt_tokens']}, "
        f"busy max/mean {record['busy_max_over_mean']:.3f}, load {record['load_average'][0]:.1f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.run_one:
        _driver_main(args)
        return
    from prefixflow.pipeline.cost_model import measure_cpu_profile

    if args.quick:
        args.rows, args.repeats, args.replicas = 256, 1, "1,2"
    replicas = [int(n) for n in args.replicas.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="scale_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {work}", flush=True)
    profile = measure_cpu_profile()  # before the cluster starts: the machine quiet
    prep = prepare(work, args.rows)
    found = run_all(args, work, prep, replicas)
    result = summarize(args, prep, found, replicas, profile)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    result["dispatch_check"] = _dispatch_check(path)
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    print(json.dumps(result["acceptance"], indent=2))
    print(f"wrote {path}")


def summarize(
    args: argparse.Namespace, prep: dict[str, Any], found: dict[str, list], replicas: list[int], profile: Any
) -> dict[str, Any]:
    rows, tokens = prep["rows"], prep["tokens"]
    floors = {w: prompt_token_floors(tokens) for w in WORKLOADS}  # the prompts are the same
    runs = {}
    for key, repeats in found.items():
        workload = key.split("/")[1]
        ref = found.get(f"prefixflow_native/{workload}/{replicas[0]}")
        reference = {int(i): t for i, t in ref[0]["outputs"].items()} if ref else None
        runs[key] = cell_summary(repeats, reference)
    accept = {}
    for n in replicas:
        accept.update(acceptance(runs, n, floors))
    for cell in runs.values():  # the outputs are compared; the file keeps their lengths only
        for r in cell["repeats"]:
            r["output_lengths"] = {int(i): len(t) for i, t in r.pop("outputs").items()}
    from prefixflow.engine.models.model_args import read_json

    return {
        "bench": "scale_bench",
        "args": {
            "replicas": replicas,
            "systems": args.systems.split(","),
            "ablation": args.ablation.split(","),
            "workloads": args.workloads.split(","),
            "rows": args.rows,
            "repeats": args.repeats,
            "workers": args.workers,
            "kv_cache_bytes": KV_CACHE_BYTES,
            "block_size": BLOCK,
            "model": MODEL_SHAPE,
            "model_config": read_json(prep["models"]["fixed"] / "config.json"),
            "ray_num_blocks": {n: ray_num_blocks(args.rows, n, 32) for n in replicas},
        },
        "workload": {
            "rows": len(rows),
            "documents": len({r["doc_id"] for r in rows}),
            "questions_per_document_top": sorted(
                zipf_counts(args.rows, max(8, args.rows * 3 // 10), 1.3), reverse=True
            )[:5],
            "model_decided_eos_id": prep["eos"],
            "output_lengths": {
                w: length_summary(prep["output_tokens"][w], MODEL_DECIDED_CAP if w == "model_decided" else 128)
                for w in WORKLOADS
            },
            "floors": floors["fixed"],
        },
        "hardware_profile": {"peak_flops": profile.peak_flops, "mem_bandwidth": profile.mem_bandwidth},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average_at_end": os.getloadavg()},
        "rows": [
            {
                "id": r["id"],
                "prompt_tokens": len(t),
                "max_tokens": r["max_tokens"],
                "output_tokens": {w: prep["output_tokens"][w][i] for w in WORKLOADS},
            }
            for i, (r, t) in enumerate(zip(rows, tokens))
        ],
        "token_rows": tokens,
        "runs": runs,
        "acceptance": accept,
    }


def _dispatch_check(path: Path) -> dict[str, Any]:
    """cluster_sim's dispatch model replayed on the Ray runs of the file (bench/sim_dispatch_check.py)."""
    try:
        from prefixflow.bench.sim_dispatch_check import validate_dispatch
    except ImportError as e:  # the simulator's module is not there
        return {"skipped": str(e)}
    out = validate_dispatch(path)
    return {
        "max_abs_error": out["max_abs_error"],
        "within_goal": out["within_goal"],
        "goal": out["goal"],
        "runs": {k: v["errors"] for k, v in out["runs"].items()},
    }


if __name__ == "__main__":
    main()
