"""Peer benchmark: vLLM with and without our plan and group scheduler, and our native engine.

    python -m prefixflow.bench.peer_bench [--quick] [--repeats 2] [--out bench/results/peer_bench.json]

Same checkpoint for all (a random Llama, 4 layers, hidden 512, fp32 on the CPU; or --model, e.g.
smollm2-135m-instruct), prompts as token ids, greedy with fixed output lengths (ignore_eos), the
prefix cache emptied before every run.
Each engine lives in its own process (2 threads) for the whole benchmark of one cache size; the
driver hands the processes the runs one at a time, interleaved (workload, repeat, engine), so all
systems see the same machine load. The engines:

    (1) vllm_arrival   vLLM's stock scheduler, requests in arrival (row) order
    (2) vllm_sorted    vLLM's stock scheduler, requests sorted by their token ids
    (3) vllm_plan      vLLM's stock scheduler, requests in our plan order (groups adjacent)
    (4) vllm_batchllm  our plan + group scheduling: priority = plan rank, no request cap, groups
                       added only while the KV cache keeps room for them (GroupScheduling)
    ablation rows      vllm_prio (plan + priority only), vllm_batchllm_mp (4) with vLLM's engine
                       core in a child process. (A third part, pinning a group's prefix blocks
                       until its last member finished, computed no fewer prompt tokens than plan
                       order alone on any workload and added preemptions: it was dropped.)
    (5) native         our engine (LLMEngine.run on the planner's groups)

Workloads (shuffled rows): documents x questions; two-level sharing (one system prompt, then
documents, then questions); no sharing with varied lengths; decode-heavy (shared prefixes, long
outputs). Each with a roomy KV cache and a small one that holds only a few prefixes.
Output: per run wall and process CPU time, output tokens per second, cached prompt tokens, and a
sha of all output tokens (compared across engines); the ratios the project's goals name; a PNG.

`run_engine(engine, workload, order)` is the per-engine runner (importable; it takes an engine
from `build_engine(name, cache_blocks, path)`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MODEL = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4)
BLOCK = 32  # vLLM's CPU block; the caches below are counted in these blocks
VOCAB = 700  # ids below the tiny tokenizer's vocabulary
THREADS = 2

# name -> (backend, order, group-scheduler parts or None, engine core in this process)
ENGINES: dict[str, tuple[str, str, dict | None, bool]] = {
    "vllm_arrival": ("vllm", "arrival", None, True),
    "vllm_sorted": ("vllm", "sorted", None, True),
    "vllm_plan": ("vllm", "plan", None, True),
    "vllm_prio": ("vllm", "plan", dict(priority=True, no_cap=False, kv_room=False), True),
    "vllm_batchllm": ("vllm", "plan", dict(priority=True, no_cap=True), True),
    "vllm_batchllm_mp": ("vllm", "plan", dict(priority=True, no_cap=True), False),
    "native": ("native", "plan", None, True),
}
# Engines that differ only in the order requests are given share one process.
PROCESS_OF = {"vllm_arrival": "vllm_stock", "vllm_sorted": "vllm_stock", "vllm_plan": "vllm_stock"}


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _shuffled(name: str, prompts: list[list[int]], max_tokens: int, rng: random.Random) -> Workload:
    rng.shuffle(prompts)
    return Workload(name, prompts, max_tokens)


def workloads(quick: bool, seed: int = 0) -> list[Workload]:
    s = 2 if quick else 1  # --quick: half the documents and rows
    rng = random.Random(seed)
    docs = [_tokens(rng, 384) for _ in range(6 // s)]
    questions = [_tokens(rng, 24) for _ in range(6)]
    system = _tokens(rng, 256)
    docs2 = [_tokens(rng, 256) for _ in range(6 // s)]
    prefixes = [_tokens(rng, 256) for _ in range(4 // s)]
    return [
        _shuffled("docs_x_questions", [d + q for d in docs for q in questions], 16, rng),
        _shuffled("two_level", [system + d + q for d in docs2 for q in questions], 16, rng),
        _shuffled("no_sharing", [_tokens(rng, rng.randint(64, 512)) for _ in range(32 // s)], 16, rng),
        _shuffled("decode_heavy", [p + _tokens(rng, 32) for p in prefixes for _ in range(6)], 96, rng),
    ]


CACHES = {"roomy": 1024, "small": 32}  # blocks of 32 tokens: 32k tokens / 1k tokens (~2.5 documents)


def model_path(model: str) -> str:
    """The checkpoint folder of `model`: "tiny" is MODEL's random Llama (written once, cached),
    anything else a model name or path (prefixflow.model_source.resolve_model)."""
    from prefixflow.engine.models.tiny import tiny_checkpoint_cached
    from prefixflow.model_source import resolve_model

    if model == "tiny":
        return str(tiny_checkpoint_cached("llama", seed=0, llama3_rope=False, **MODEL))
    return str(resolve_model(model))


# ---- the per-engine runner (in the engine's process) -----------------------------------------


def build_engine(name: str, cache_blocks: int, path: str) -> Any:
    """The engine of ENGINES[name] (or PROCESS_OF's shared one) with a KV cache of
    `cache_blocks` x 32 tokens, on the CPU with THREADS threads."""
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.models.model_args import read_model_args

    backend, _, parts, in_process = ENGINES[name]
    kv_bytes_per_token = read_model_args(path).kv_bytes_per_token_per_elem * 4  # fp32
    config = EngineConfig(
        model=path,
        device="cpu",
        dtype="float32",
        kv_cache_bytes=cache_blocks * BLOCK * kv_bytes_per_token,
        # vLLM keeps one block of its cache in reserve, and refuses a longer
        # context than the rest holds (engine/vllm_backend/engine.cpu_context)
        max_model_len=min(2048, (cache_blocks - 1) * BLOCK),
    )
    if backend == "native":
        import torch

        from prefixflow.engine.native.llm_engine import LLMEngine

        torch.set_num_threads(THREADS)
        return LLMEngine(config)
    from prefixflow.engine.vllm_backend.engine import GroupScheduling, VllmEngine

    scheduling = GroupScheduling(**parts) if parts else False
    return VllmEngine(config, {"enforce_eager": True}, scheduling, in_process=in_process)


def run_engine(engine: Any, workload: Workload, order: str) -> tuple[dict, dict[int, list[int]]]:
    """One cold run of `workload` with requests given in `order` ("arrival", "sorted" or
    "plan": pipeline.build_plan's groups): (timings, token counts and the outputs' sha;
    row -> output tokens)."""
    from prefixflow.requests import SamplingParams

    engine.reset_prefix_cache()
    groups = feed_groups(workload, order, min_prefix_len=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    outs = {o.row_id: list(o.token_ids) for o in engine.run(groups, params)}
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    t = engine.totals
    result = dict(
        wall_s=round(wall, 3),
        cpu_s=round(cpu, 3),
        output_tokens=t.num_output_tokens,
        output_tokens_per_s=round(t.num_output_tokens / wall, 2),
        prompt_tokens=t.num_prompt_tokens,
        computed_prompt_tokens=t.num_computed_prompt_tokens,
        token_saving_ratio=round(t.token_saving_ratio, 4),
        steps=t.num_steps,
        preemptions=t.num_preemptions,
        errors=len(workload.prompts) - len(outs),
        outputs_sha=hashlib.sha256(
            json.dumps([outs.get(i) for i in range(len(workload.prompts))]).encode()
        ).hexdigest()[:12],
    )
    return result, outs


def feed_groups(workload: Workload, order: str, min_prefix_len: int) -> list:
    """The PrefixGroups an engine is given: singletons in arrival or sorted order, or the plan."""
    import numpy as np

    from prefixflow.pipeline import build_plan
    from prefixflow.requests import PrefixGroup

    rows = list(range(len(workload.prompts)))
    if order == "plan":
        plan = build_plan(
            workload.prompts,
            row_ids=rows,
            order="batchllm",
            min_prefix_len=min_prefix_len,
            output_lens=[workload.max_tokens] * len(rows),
        )
        return plan.groups(0)
    if order == "sorted":
        rows.sort(key=lambda r: workload.prompts[r])
    empty = np.zeros(0, dtype=np.int64)
    return [
        PrefixGroup(
            group_id=i,
            prefix=empty,
            row_ids=np.asarray([r], dtype=np.int64),
            distinct=(np.asarray(workload.prompts[r], dtype=np.int64),),
        )
        for i, r in enumerate(rows)
    ]


def worker(process: str, cache_blocks: int, path: str) -> None:
    """A benchmark process: builds its engine, then runs what the driver sends on stdin (one
    JSON request per line) and answers on stdout with a line starting PFRESULT."""
    name = next(n for n in ENGINES if PROCESS_OF.get(n, n) == process)
    t0 = time.perf_counter()
    engine = build_engine(name, cache_blocks, path)
    warm = Workload("warm", [[5, 6, 7] * 20, [5, 6, 7] * 20 + [9]], 4)
    run_engine(engine, warm, "plan")
    _answer(dict(ready=True, start_s=round(time.perf_counter() - t0, 1)))
    for line in sys.stdin:
        req = json.loads(line)
        result, _ = run_engine(engine, Workload(**req["workload"]), req["order"])
        _answer(result)


def _answer(obj: dict) -> None:
    sys.stdout.write("PFRESULT " + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---- the driver ---------------------------------------------------------------------------------


class Proc:
    """One engine process (with its children, in a session of its own); logs under `log`.

    Between its runs it is stopped (SIGSTOP to its process group): an idle engine still wakes
    (vLLM's engine core in a child process polled about 10% of a core), and on 2 cores one
    stray runnable thread stalls the running engine's 2 OpenMP threads at every barrier: with
    vllm_batchllm_mp idle beside it, the native engine took up to 1.8x its time alone."""

    def __init__(self, process: str, cache_blocks: int, path: str, log: Path) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(THREADS),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.log = open(log, "w")
        self.p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefixflow.bench.peer_bench",
                "--worker",
                process,
                "--cache-blocks",
                str(cache_blocks),
                "--model-path",
                path,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert self.p.stdin is not None and self.p.stdout is not None, "both pipes were asked for"
        self.stdin, self.stdout = self.p.stdin, self.p.stdout

    def pause(self) -> None:
        os.killpg(self.p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.p.pid, signal.SIGCONT)

    def read(self) -> dict:
        for line in self.stdout:
            if line.startswith("PFRESULT "):
                return json.loads(line[len("PFRESULT ") :])
            self.log.write(line)
        raise RuntimeError(f"engine process exited (rc {self.p.wait()}); see {self.log.name}")

    def ask(self, workload: Workload, order: str) -> dict:
        self.stdin.write(json.dumps(dict(workload=asdict(workload), order=order)) + "\n")
        self.stdin.flush()
        return self.read()

    def close(self) -> None:
        """Resume the whole group (a dead worker's children too), then end it; killed if it
        does not exit within a minute."""
        try:
            self.resume()
        except ProcessLookupError:
            pass
        try:
            self.stdin.close()
            self.p.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        finally:
            self.log.close()


def bench_cache(
    cache: str, blocks: int, engines: list[str], loads: list[Workload], repeats: int, path: str, logs: Path
) -> dict:
    procs: dict[str, Proc] = {}
    results: dict[str, dict] = {w.name: {} for w in loads}
    try:
        for name in engines:  # one at a time: starting several at once only adds contention
            process = PROCESS_OF.get(name, name)
            if process not in procs:
                procs[process] = Proc(process, blocks, path, logs / f"{cache}_{process}.log")
                print(f"[{cache}] {process} started: {procs[process].read()}", flush=True)
                procs[process].pause()
        for w in loads:
            for rep in range(repeats):
                for name in engines:
                    proc = procs[PROCESS_OF.get(name, name)]
                    proc.resume()
                    r = proc.ask(w, ENGINES[name][1])
                    proc.pause()
                    print(
                        f"[{cache}] {w.name} {name} rep {rep}: {r['wall_s']} s, "
                        f"{r['output_tokens_per_s']} tok/s, saving {r['token_saving_ratio']}, "
                        f"sha {r['outputs_sha']}",
                        flush=True,
                    )
                    best = results[w.name].get(name)
                    walls = (best["all_wall_s"] if best else []) + [r["wall_s"]]
                    if best is None or r["wall_s"] < best["wall_s"]:
                        best = r
                    best["all_wall_s"] = walls
                    results[w.name][name] = best
    finally:
        for p in procs.values():
            p.close()
    for w in loads:
        results[w.name]["ratios"] = ratios(results[w.name])
        results[w.name]["ratios_cpu_time"] = ratios(results[w.name], "cpu_s")
        # Every engine against the first one run (vllm_arrival in a full run).
        first = results[w.name][engines[0]]["outputs_sha"]
        results[w.name][f"same_outputs_as_{engines[0]}"] = {
            n: r["outputs_sha"] == first
            for n, r in results[w.name].items()
            if isinstance(r, dict) and "outputs_sha" in r
        }
    return results


def ratios(r: dict, measure: str = "wall_s") -> dict:
    """Speed ratios on the least-disturbed time of each engine: wall time, or ("cpu_s") this
    process's CPU time (engines whose work runs in their own process only)."""
    speed = {
        n: 1.0 / v[measure]
        for n, v in r.items()
        if isinstance(v, dict) and v.get(measure) and not (measure == "cpu_s" and n.endswith("_mp"))
    }
    out = {}
    if {"vllm_batchllm", "vllm_arrival", "vllm_sorted", "vllm_plan"} <= set(speed):
        best12 = max(speed["vllm_arrival"], speed["vllm_sorted"])
        out["batchllm_vs_best_of_arrival_sorted"] = round(speed["vllm_batchllm"] / best12, 3)
        out["batchllm_vs_arrival"] = round(speed["vllm_batchllm"] / speed["vllm_arrival"], 3)
        out["batchllm_vs_plan_stock"] = round(speed["vllm_batchllm"] / speed["vllm_plan"], 3)
        out["plan_stock_vs_best_of_arrival_sorted"] = round(speed["vllm_plan"] / best12, 3)
        for n in ("vllm_prio", "vllm_batchllm_mp"):
            if n in speed:
                out[f"{n}_vs_plan_stock"] = round(speed[n] / speed["vllm_plan"], 3)
        if "vllm_batchllm_mp" in speed:
            out["batchllm_mp_vs_in_process"] = round(speed["vllm_batchllm_mp"] / speed["vllm_batchllm"], 3)
    if "native" in speed and "vllm_sorted" in speed:
        out["native_vs_vllm_sorted"] = round(speed["native"] / speed["vllm_sorted"], 3)
        if "vllm_batchllm" in speed:
            out["native_vs_vllm_batchllm"] = round(speed["native"] / speed["vllm_batchllm"], 3)
    return out


def plot(results: dict, engines: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caches = list(results)
    fig, axes = plt.subplots(1, len(caches), figsize=(7 * len(caches), 4.2), squeeze=False)
    for ax, cache in zip(axes[0], caches):
        names = list(results[cache])
        width = 0.8 / len(engines)
        for i, e in enumerate(engines):
            ys = [results[cache][w][e]["output_tokens_per_s"] for w in names]
            ax.bar([x + i * width for x in range(len(names))], ys, width, label=e)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, fontsize=8)
        ax.set_ylabel("output tokens / wall s")
        ax.set_title(f"{cache} KV cache ({CACHES[cache]} blocks of {BLOCK})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="half-size workloads, one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved runs per engine (best kept)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of ENGINES")
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--workloads", default=None, help="comma-separated subset of the workload names")
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (the random 4-layer Llama) or a model name or folder, e.g. smollm2-135m-instruct",
    )
    ap.add_argument("--out", default="bench/results/peer_bench.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cache-blocks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    return ap.parse_args()


def _meta(
    args: argparse.Namespace,
    engines: list[str],
    repeats: int,
    loads: list[Workload],
    started: float,
    load_before: tuple[float, float, float],
    png: Path,
) -> dict:
    """The run's meta record; load_avg_after and total_s are taken now (the runs are over)."""
    return dict(
        model=MODEL if args.model == "tiny" else args.model,
        dtype="float32",
        device="cpu",
        threads_per_engine=THREADS,
        block=BLOCK,
        caches=CACHES,
        repeats=repeats,
        quick=args.quick,
        engines={n: ENGINES[n] for n in engines},
        workloads={
            w.name: dict(rows=len(w.prompts), prompt_tokens=w.prompt_tokens, max_tokens=w.max_tokens) for w in loads
        },
        timing="wall time of each run, least of the interleaved repeats; one engine runs at a time",
        cpus=os.cpu_count(),
        machine=platform.machine(),
        load_avg_before=load_before,
        load_avg_after=os.getloadavg(),
        total_s=round(time.time() - started, 1),
        plot=str(png),
    )


def main() -> None:
    args = _parse_args()
    if args.worker:
        return worker(args.worker, args.cache_blocks, args.model_path)
    # A terminated driver still resumes and ends its stopped engine processes (Proc.close).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    path = model_path(args.model)
    engines = args.engines.split(",")
    repeats = args.repeats or (1 if args.quick else 2)
    loads = [w for w in workloads(args.quick) if args.workloads is None or w.name in args.workloads.split(",")]
    out = Path(args.out)
    logs = Path(tempfile.gettempdir()) / "peer_bench_logs"
    logs.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()
    results = {c: bench_cache(c, CACHES[c], engines, loads, repeats, path, logs) for c in args.caches.split(",")}
    png = out.with_suffix(".png")
    plot(results, engines, png)
    meta = _meta(args, engines, repeats, loads, started, load_before, png)
    out.write_text(json.dumps({"meta": meta, **results}, indent=1))
    print(json.dumps({c: {w: r["ratios"] for w, r in results[c].items()} for c in results}, indent=1))
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
