"""The benchmark: every mix, output model and policy at cluster scale, its JSON and plot, the CLI."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from prefixflow.bench.sim_dispatch_check import load_bench, validate_files
from prefixflow.bench.sim_engines import VllmMeasurement, validate, validation_workloads
from prefixflow.bench.sim_items import PLAN_SLICE_ROWS, make_plan, trie_order_lcp
from prefixflow.bench.sim_run import (
    POLICIES,
    Cluster,
    RayData,
    Run,
    Units,
    h100_cluster,
    joins_pieces,
    policy_stream,
    simulate,
)
from prefixflow.bench.sim_startup import (
    REPLICAS_PER_NODE,
    TEXT_BYTES_PER_TOKEN,
    gpu_wait,
    plan_stage_bytes,
    rates_record,
    sort_bytes,
    startup_seconds,
)
from prefixflow.bench.sim_workloads import (
    DECIDED_FAMILY_SHARE,
    DECIDED_MEDIAN_SHARE,
    DECIDED_SIGMA,
    MIXES,
    OUTPUT_MODELS,
    Workload,
    output_lengths,
)
from prefixflow.pipeline.cost_model import CostModel


def policy_metrics(
    w: Workload, run: Run, cluster: Cluster, startup: dict[str, float], moved: int, seconds: float
) -> dict[str, Any]:
    """One row of the report: prompt work, GPU time, makespan with and without start-up, balance."""
    prompt = int(w.prompt_lens.sum())
    computed = int(run.computed_tokens(w).sum())
    busy = run.busy_s
    makespan = float(busy.max())
    with_start = makespan + startup["startup_s"]
    row = {
        "prompt_tokens": prompt,
        "computed_prompt_tokens": computed,
        "token_saving_ratio": round(1 - computed / prompt, 5),
        "output_tokens": int(run.items.output_len.sum()),
        "gpu_hours_busy": round(float(busy.sum()) / 3600, 4),
        "makespan_hours_without_startup": round(makespan / 3600, 5),
        "makespan_hours_with_startup": round(with_start / 3600, 5),
        "reserved_gpu_hours": round(with_start * cluster.num_replicas / 3600, 4),
        "slowest_replica_over_mean": round(makespan / float(busy.mean()), 4),
        "compute_bound_replicas": round(float((run.compute_s >= run.memory_s).mean()), 3),
        "startup": startup,
        "bytes_moved_before_generation": moved,
        "simulation_seconds": round(seconds, 1),
    }
    if isinstance(run.dispatch, Units):
        stolen = run.grain_replica != run.dispatch.owner
        row["units"] = {
            "num_units": int(len(stolen)),
            "stolen": int(stolen.sum()),
            "stolen_predicted_share": round(
                float(run.dispatch.seconds[stolen].sum() / max(run.dispatch.seconds.sum(), 1e-30)), 5
            ),
        }
    else:
        row["tasks"] = {
            "num_tasks": int(len(run.grain_replica)),
            "rows_per_task_mean": round(len(run.items.kind) / max(len(run.grain_replica), 1), 1),
            "tasks_per_replica_max": int(np.bincount(run.grain_replica).max()),
        }
    return row


def planner_record(plan: Any) -> dict[str, Any]:
    s = plan.summary
    return {
        "num_slices": s.get("num_slices", 1),
        "predicted_computed_prompt_tokens": s["computed_prompt_tokens"],
        "num_groups": s["num_groups"],
        "num_shared_groups": s["num_shared_groups"],
        "num_units": s["num_units"],
        "predicted_seconds_max_over_mean": round(s["predicted_seconds_max_over_mean"], 4),
        "optimal_token_saving_ratio": round(s["optimal_token_saving_ratio"], 5),
        "planning_seconds_here": round(s["planning_seconds"], 1),
    }


# The four policies, and stealing over the static plan: does joining a group's small pieces
# (the plan jobs with work stealing get) pay for the balance it gives up?
REPORTED_POLICIES = (*POLICIES, "plan_steal_unjoined")


def run_mix(
    name: str, num_prompts: int, cluster: Cluster, cm: CostModel, ray: RayData, seed: int = 0
) -> dict[str, Any]:
    """Every output model and policy on one mix; two plans (they see only the caps): the static
    one, and for plan_steal the one a job whose engines steal gets (build_plan stealing=True)."""
    w = MIXES[name](num_prompts, seed=seed)
    R = cluster.num_replicas
    started = time.perf_counter()
    order_lcp = trie_order_lcp(w)
    plans = {stealing: make_plan(w, R, cluster.block_size, order_lcp, stealing) for stealing in (False, True)}
    plan = plans[False]
    moved = plan_stage_bytes(w, plan, cluster.block_size, R, order_lcp)
    del order_lcp
    first_block = int(ray.block_rows(len(w), R)[0])
    tokens = float(w.prompt_lens.sum())
    startup = {
        p: startup_seconds(p, len(w), tokens, R, first_block, moved["total"]) for p in ("arrival", "sorted", "plan")
    }
    out: dict[str, Any] = {
        "num_prompts": len(w),
        "prompt_tokens": int(w.prompt_lens.sum()),
        "mean_prompt_len": round(float(w.prompt_lens.mean()), 1),
        "planner": planner_record(plan),
        "planner_stealing": planner_record(plans[True]),
        "planning_and_bytes_seconds": round(time.perf_counter() - started, 1),
        "plan_stage_bytes": moved,
        "output_models": {},
    }
    for model in OUTPUT_MODELS:
        outs = output_lengths(w, model, seed)
        rows: dict[str, Any] = {}
        for policy in REPORTED_POLICIES:
            start = time.perf_counter()
            items, how = policy_stream(w, policy, R, plans[joins_pieces(policy)], outs, ray)
            run = simulate(w, items, cluster, cm, how)
            moved_here = {"arrival": 0, "sorted": sort_bytes(w)}.get(policy, moved["total"])
            rows[policy] = policy_metrics(
                w,
                run,
                cluster,
                startup["plan" if policy.startswith("plan") else policy],
                moved_here,
                time.perf_counter() - start,
            )
            del items, run
            print(
                f"{name:15s} {model:13s} {policy:10s} "
                + json.dumps({k: v for k, v in rows[policy].items() if not isinstance(v, dict)}),
                flush=True,
            )
        out["output_models"][model] = {
            "output_tokens": int(outs.sum()),
            "policies": rows,
            "plan_steal_vs": _ratios(rows, "plan_steal"),
        }
        gc.collect()
    return out


def _ratios(rows: dict[str, Any], ours: str) -> dict[str, Any]:
    keys = ("computed_prompt_tokens", "gpu_hours_busy", "makespan_hours_without_startup", "makespan_hours_with_startup")
    return {base: {k: round(rows[ours][k] / rows[base][k], 4) for k in keys} for base in rows if base != ours}


def plot(report: dict[str, Any], path: Path) -> bool:
    """Computed prompt tokens, GPU hours and makespan per mix, output model and policy; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    mixes = list(report["mixes"])
    fig, axes = plt.subplots(len(OUTPUT_MODELS), 3, figsize=(15, 4 * len(OUTPUT_MODELS)), squeeze=False)
    panels = (
        ("computed_prompt_tokens", "prompt tokens computed (share of all)"),
        ("gpu_hours_busy", "GPU hours busy"),
        ("makespan_hours_without_startup", "makespan (hours; pale: start-up)"),
    )
    width = 0.8 / len(POLICIES)
    for row, model in zip(axes, OUTPUT_MODELS):
        for ax, (key, label) in zip(row, panels):
            for k, policy in enumerate(POLICIES):
                vals = [report["mixes"][m]["output_models"][model]["policies"][policy][key] for m in mixes]
                if key == "computed_prompt_tokens":
                    vals = [v / report["mixes"][m]["prompt_tokens"] for v, m in zip(vals, mixes)]
                x = np.arange(len(mixes)) + (k - (len(POLICIES) - 1) / 2) * width
                bars = ax.bar(x, vals, width, label=policy)
                if key == "makespan_hours_without_startup":
                    start = [
                        report["mixes"][m]["output_models"][model]["policies"][policy]["startup"]["startup_s"] / 3600
                        for m in mixes
                    ]
                    ax.bar(x, start, width, bottom=vals, color=bars[0].get_facecolor(), alpha=0.35)
            ax.set_xticks(np.arange(len(mixes)), mixes)
            ax.set_title(f"{label}, outputs {model}", fontsize=10)
    axes[0][0].legend()
    cfg = report["config"]
    fig.suptitle(
        f"cluster_sim: {cfg['num_prompts']:,} prompts per mix, {cfg['num_replicas']} replicas "
        f"(Llama-3.1-8B on H100, {cfg['cache_tokens']:,}-token prefix cache each)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# The fair scale bench's Ray runs that record each engine's ready time, as validate_dispatch
# reads them (sim_dispatch_check.py --extract): the judged N = 4 sitting (commit 7cf2716), the
# sittings with the driver's dispatch log at N = 2 and 4, the fbaa066 N = 2 sitting and three
# sittings of Ray's N = 4 fixed-length cell, 2026-12-04 (at 8454e67, each task's first data node
# logged; then with every node holding its blocks, batch_data_nodes; then at 0ffc176 also with
# each task's end, batch_finished_s). Left out: 28c84c3's (before the fair setup's blocks) and
# 2ad78dd's (each engine's first request only).
SCALE_BENCHES = tuple(
    Path(__file__).parent / "results" / f"scale_bench_{name}.json.gz"
    for name in (
        "dispatch_loose_last",
        "dispatch_handout",
        "dispatch_log_a",
        "dispatch_log_b",
        "dispatch_log_n4_fixed",
        "dispatch_log_n2",
        "n2_dispatch",
        "n4_fixed_dispatch_first_node",
        "n4_fixed_dispatch",
        "n4_fixed_dispatch_finished",
        "dispatch_ends",
        "dispatch_pool",
    )
)


def dispatch_validation(scale_benches: Sequence[Path]) -> dict[str, Any]:
    """validate_files on the scale_bench files that record their ray.data.llm runs' blocks (the
    fair bench's schema, sim_dispatch_check.py), and why each other one was skipped."""
    skipped: dict[str, Any] = {}
    for path in scale_benches:
        if not path.exists():
            skipped[os.path.relpath(path)] = {"skipped": f"no scale_bench file at {path}"}
        elif "token_rows" not in load_bench(path):
            skipped[os.path.relpath(path)] = {
                "skipped": f"{path} predates the fair bench (no token_rows, blocks or row maps)"
            }
    held = validate_files([p for p in scale_benches if os.path.relpath(p) not in skipped])
    return {**held, "files": {**held["files"], **skipped}}


def run_all(
    num_prompts: int,
    num_replicas: int,
    validate_engines: bool,
    ray: RayData,
    command: str = "",
    scale_benches: Sequence[Path] = (),
) -> dict[str, Any]:
    """Every mix, output model and policy, then (optionally) the validations: the cache model
    against engine counters, the dispatch model against the scale_bench files' Ray runs."""
    started = time.perf_counter()
    cm = CostModel.create(None, "h100")
    cluster = h100_cluster(num_replicas, cm)
    report: dict[str, Any] = {
        "bench": "cluster_sim",
        "command": command,
        "config": {
            "num_prompts": num_prompts,
            "num_replicas": num_replicas,
            "cache_tokens": cluster.cache_tokens,
            "block_size": cluster.block_size,
            "max_num_seqs": cluster.max_num_seqs,
            "model": "Llama-3.1-8B",
            "hardware": "h100",
            "ray_data": {
                "num_blocks": int(len(ray.block_rows(num_prompts, num_replicas))),
                "batch_size": ray.batch_size,
                "max_tasks_in_flight_per_actor": ray.max_tasks_in_flight_per_actor,
            },
            "output_caps": "uniform 8..128 per row (max_tokens); the planner is told them",
            "model_decided": {
                "median_share_of_cap": DECIDED_MEDIAN_SHARE,
                "log_sigma": DECIDED_SIGMA,
                "family_share_of_log_variance": DECIDED_FAMILY_SHARE,
            },
            "startup_rates": rates_record(),
            "text_bytes_per_token": TEXT_BYTES_PER_TOKEN,
            "replicas_per_node": REPLICAS_PER_NODE,
            "plan_slice_rows_when_nothing_is_shared": PLAN_SLICE_ROWS,
        },
        "assumptions": "see the docstrings of prefixflow.bench.cluster_sim and its sim_* modules",
        "mixes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        vllm = None
        if validate_engines and importlib.util.find_spec("vllm") is not None:
            from prefixflow.jobs.demo import demo_checkpoint

            # measured in a child process while the mixes are simulated
            vllm = VllmMeasurement(validation_workloads(), str(demo_checkpoint(tmp)))
        for name in MIXES:
            report["mixes"][name] = run_mix(name, num_prompts, cluster, cm, ray)
            gc.collect()
        report["simulation_seconds"] = round(time.perf_counter() - started, 1)
        if validate_engines:
            report["validation"] = validate(tmp, vllm=vllm)
            report["dispatch_validation"] = dispatch_validation(scale_benches)
    report["run_seconds"] = round(time.perf_counter() - started, 1)
    report["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description="Cluster-scale simulation of four ways to feed a data-parallel cluster")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per mix (default 10,000,000; --quick 20,000)")
    ap.add_argument("--replicas", type=int, default=None, help="default 64 (--quick 8)")
    ap.add_argument("--quick", action="store_true", help="20,000 prompts, 8 replicas, no engine validation")
    ap.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="ray.data.llm's blocks (default 4 x replicas x tasks in flight: a careful user)",
    )
    ap.add_argument("--batch-size", type=int, default=32, help="ray.data.llm's batch_size")
    ap.add_argument("--max-tasks-in-flight", type=int, default=16, help="ray.data.llm's max_tasks_in_flight_per_actor")
    ap.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the validation cases on vLLM and the native engine, and replay --scale-bench's "
        "ray.data.llm runs (default: not with --quick)",
    )
    ap.add_argument(
        "--scale-bench",
        nargs="+",
        default=[str(p) for p in SCALE_BENCHES],
        help="the scale_bench files (or extracts) whose ray.data.llm runs validate the dispatch model",
    )
    ap.add_argument("--out", default=None, help="default bench/results/cluster_sim.json (_quick with --quick)")
    args = ap.parse_args(argv)
    prompts = args.prompts or (20_000 if args.quick else 10_000_000)
    replicas = args.replicas or (8 if args.quick else 64)
    validate_engines = (not args.quick) if args.validate is None else args.validate
    ray = RayData(args.blocks, args.batch_size, args.max_tasks_in_flight)
    out = Path(args.out or f"bench/results/cluster_sim{'_quick' if args.quick else ''}.json")
    command = "python -m prefixflow.bench.cluster_sim " + " ".join(sys.argv[1:] if argv is None else argv)
    report = run_all(prompts, replicas, validate_engines, ray, command.strip(), [Path(p) for p in args.scale_bench])
    report["gpu_wait_before_first_work"] = gpu_wait(report)  # sim_startup's closed form on the result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    drew = plot(report, out.with_suffix(".png"))
    print(f"-> {out}{' and ' + str(out.with_suffix('.png')) if drew else ''} in {report['run_seconds']} s")
    return report
