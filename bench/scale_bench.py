"""Scale-out benchmark (issue 28, item 2): one job shaped like real batch work, on a multi-node
Ray test cluster on this machine, with N = 1, 2 and 4 data-parallel replicas, run by four systems
with the same model and the same rows:

    ray_llm_arrival   ray.data.llm (build_processor, vLLM's CPU build, its default batch size),
                      rows in arrival order;
    ray_llm_sorted    the same after `ds.sort` on the prompt text (what a careful user does; the
                      actor pool still hands consecutive batches to whichever replica is free),
                      vLLM's engine core in the actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0);
    ray_llm_sorted_mp the same with vLLM's engine core in a child process (vLLM's default): the
                      comparisons take the faster of the two;
    prefixflow_vllm   prefixflow, engine.backend: vllm;
    prefixflow_native prefixflow's own engine.

The workload: at least 2,048 chat rows under one system prompt; documents of 200-2,000 tokens
(log-uniform) whose question counts follow a Zipf law (the first asked hundreds of times, most
one to five); each row its own output length, 8-128 tokens (ignore_eos, so every system makes
exactly that many); rows shuffled. Every system gets the same prompts as token ids (ray.data.llm's
own tokenize stage would add a second BOS to the chat template's), the same KV cache per replica
(engine.kv_cache_bytes / vLLM's num_gpu_blocks_override, blocks of 32 tokens, prefix caching on)
and one CPU slot per replica.

Measured per system and N: prompt tokens computed on all replicas together (prefixflow: its
engines' totals; vLLM under ray.data.llm: prompt tokens minus its prefix-cache hits, each
request's `num_cached_tokens`, recorded by a worker setup hook since ray.data.llm's rows do not
carry it), each replica's engine time (first request in to last request out) and the slowest
over the mean, end-to-end wall time with and without engine start-up (start-up: until the last
replica's engine took its first request), and outputs compared token for token with
prefixflow_native at N=1. Each run is its own driver process on the cluster, so no engine or
cache outlives it; runs are interleaved by system. Results: bench/results/scale_bench.json and .png.

    .venv/bin/python -m prefixflow.bench.scale_bench [--replicas 1,2,4] [--rows 2048]
        [--systems ray_llm_arrival,ray_llm_sorted,prefixflow_vllm,prefixflow_native] [--quick]

Time it only with nothing else running: on 2 cores a second job skews every ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEM = ("You are a careful reader working through a large batch of documents. Read the document "
          "below and answer the question about it in one short sentence, using only what the "
          "document says.")
USER = "Document: {{ document }}\n\nQuestion: {{ question }}"
SYSTEMS = ("ray_llm_arrival", "ray_llm_sorted", "ray_llm_sorted_mp", "prefixflow_vllm",
           "prefixflow_native")
BLOCK = 32                # vLLM's CPU attention wants multiples of 32; every system uses 32
KV_CACHE_BYTES = 64 << 20  # per replica: about 16k tokens of the bench model (fp32)
FILE_ROWS = 32            # rows per input file of the ray.data.llm runs: one block per batch
MODEL_SHAPE = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
RESULTS = Path(__file__).parent / "results"
# Ray rewrites 127.0.0.1 in an address to the machine's IP unless "clusters" are off: with this
# every node and driver of the test cluster talks over the loopback address.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# ---- the workload ------------------------------------------------------------------------------

def zipf_counts(num_rows: int, top: int, exponent: float) -> list[int]:
    """Questions per document: round(top / rank^exponent), at least one, until num_rows."""
    counts: list[int] = []
    while sum(counts) < num_rows:
        counts.append(max(1, round(top / (len(counts) + 1) ** exponent)))
    counts[-1] -= sum(counts) - num_rows
    return [c for c in counts if c > 0]


def make_rows(tokenizer: Any, num_rows: int, seed: int = 0, top: int | None = None) -> list[dict[str, Any]]:
    """The bench's rows (see the module docstring), shuffled: id, doc_id, document, question,
    max_tokens."""
    from prefixflow.jobs.demo import _OBJECTS, _QUESTIONS, _SUBJECTS, _VERBS

    rng = random.Random(seed)
    counts = zipf_counts(num_rows, top or max(8, num_rows * 3 // 10), 1.3)
    rows = []
    for doc_id, count in enumerate(counts):
        target = int(math.exp(rng.uniform(math.log(200), math.log(2000))))
        sentences: list[str] = []
        while len(tokenizer.encode(" ".join(sentences))) < target:
            sentences += [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
                          for _ in range(max(1, (target - len(tokenizer.encode(" ".join(sentences)))) // 12))]
        document = " ".join(sentences)
        for q in range(count):
            rows.append({"doc_id": doc_id, "document": document,
                         "question": f"{rng.choice(_QUESTIONS)} (ask {q}, part {rng.randint(1, 99)})",
                         "max_tokens": rng.randint(8, 128)})
    rng.shuffle(rows)
    return [{"id": i, **r} for i, r in enumerate(rows)]


def messages(row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Document: {row['document']}\n\nQuestion: {row['question']}"}]


def write_inputs(model: Path, rows: list[dict[str, Any]], folder: Path) -> tuple[Path, Path]:
    """(prefixflow's input: the rows with their `sampling_params`, ray.data.llm's input: a folder
    of files of FILE_ROWS rows each, as a real dataset is, holding the rows with `tokenized_prompt`,
    the chat template's text tokenized as prefixflow tokenizes chat prompts (the template holds the
    BOS), and `prompt_text`, what a careful user sorts by). Several files matter: Ray Data's sort
    makes as many output blocks as its input had read tasks, and one block reaches one replica."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    ours, theirs = folder / "rows.jsonl", folder / "rows_tokens"
    theirs.mkdir()
    with open(ours, "w") as a:
        for k, r in enumerate(rows):
            params = {"max_tokens": r["max_tokens"], "ignore_eos": True}
            a.write(json.dumps({**r, "sampling_params": params}) + "\n")
            text = tok.apply_chat_template(messages(r), add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            with open(theirs / f"part-{k // FILE_ROWS:05d}.jsonl", "a") as b:
                b.write(json.dumps({"id": r["id"], "max_tokens": r["max_tokens"], "prompt_text": text,
                                    "tokenized_prompt": ids}) + "\n")
    return ours, theirs


def prompt_token_floors(prompts: list[list[int]], block: int = BLOCK) -> dict[str, int]:
    """The fewest prompt tokens any system can compute on these prompts, with a cache as large as
    it likes and any order: every distinct token once (the prefix tree's tokens), and, with a
    cache that reuses whole blocks only (vLLM's), every distinct whole block once plus each
    prompt's tokens past its last shared whole block (a prompt met whole still computes its last
    token). In sorted order each prompt shares the most with the one before it, so the sum over
    sorted neighbours is that floor."""
    import numpy as np

    from prefixflow.pipeline.prefix_tree import PrefixTree, sort_with_lcp
    from prefixflow.pipeline.ragged import RaggedTokens

    tokens = RaggedTokens.from_sequences(prompts)
    order, lcp = sort_with_lcp(tokens, block)
    lens = tokens.lengths[order]
    shared = np.minimum(np.r_[0, lcp], np.maximum(lens - 1, 0)) // block * block
    return {"prompt_tokens": int(lens.sum()),
            "distinct_prompt_tokens": PrefixTree.from_sorted(order, lcp, tokens.lengths).tree_tokens(),
            "whole_block_floor": int((lens - shared).sum())}


# ---- one run: a driver process on the cluster ---------------------------------------------------

def run_one(system: str, replicas: int, data: Path, model: Path, out: Path) -> dict[str, Any]:
    """Run `system` with `replicas` replicas on the cluster at RAY_ADDRESS; returns its record."""
    t0 = time.time()
    if system.startswith("prefixflow"):
        record = _run_prefixflow(system.removeprefix("prefixflow_"), replicas, data, model, out)
    else:
        record = _run_ray_llm("sorted" in system, system.endswith("_mp"), replicas, data, model)
    record["wall_s"] = time.time() - t0
    record["engine_start_s"] = max(record.pop("ready_at")) - t0
    record["wall_without_start_s"] = record["wall_s"] - record["engine_start_s"]
    record["load_average"] = os.getloadavg()  # this 2-core machine is shared by every replica
    return record


def _run_prefixflow(backend: str, replicas: int, data: Path, model: Path, out: Path) -> dict[str, Any]:
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import parse_spec
    from prefixflow.operators.write import read_output

    spec = parse_spec({
        "name": f"scale-{backend}-{replicas}", "model": str(model), "input": {"path": str(data)},
        "prompt": {"system": SYSTEM, "user": USER}, "sampling": {"temperature": 0},
        "engine": {"backend": backend, "device": "cpu", "dtype": "float32", "block_size": BLOCK,
                   "kv_cache_bytes": KV_CACHE_BYTES},
        "replicas": replicas, "order": "batchllm",
        "output": {"path": str(out), "format": "parquet", "rows_per_part": 256, "overwrite": True}})
    metrics = run_job(spec, quiet=True)
    rows = read_output(str(out)).to_pylist()
    per = metrics["per_replica"]
    from prefixflow.engine.models.loader import read_model_args

    return {"computed_prompt_tokens": sum(r["engine_totals"]["num_computed_prompt_tokens"] for r in per),
            "kv_bytes_per_token": read_model_args(str(model)).kv_bytes_per_token_per_elem * 4,
            "prompt_tokens": sum(r["num_input_tokens"] for r in rows),
            "engine_s": [r["run_seconds"] for r in per], "nodes": [r.get("node_id") for r in per],
            "ready_at": [r["engine_ready_s"] for r in per],
            "outputs": {int(r["id"]): [int(t) for t in r["generated_tokens"]] for r in rows}}


def _run_ray_llm(sort: bool, multiprocess: bool, replicas: int, data: Path, model: Path) -> dict[str, Any]:
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from prefixflow.engine.models.loader import read_model_args

    margs = read_model_args(str(model))
    blocks = KV_CACHE_BYTES // (BLOCK * margs.kv_bytes_per_token_per_elem * 4)
    config = vLLMEngineProcessorConfig(
        model_source=str(model), concurrency=(replicas, replicas), chat_template_stage=False, tokenize_stage=False,
        engine_kwargs=dict(dtype="float32", block_size=BLOCK, num_gpu_blocks_override=blocks,
                           kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=True,
                           max_model_len=margs.max_position_embeddings),
        placement_group_config={"bundles": [{"CPU": 1}]}, log_engine_metrics=False,
        runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                  "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}})
    processor = build_processor(
        config,
        preprocess=lambda r: dict(id=r["id"], tokenized_prompt=r["tokenized_prompt"],
                                  sampling_params=dict(temperature=0.0, max_tokens=r["max_tokens"],
                                                       ignore_eos=True)),
        postprocess=lambda r: dict(id=r["id"], generated_tokens=[int(t) for t in r["generated_tokens"]],
                                   num_input_tokens=r["num_input_tokens"], **_engine_fields(r)))
    # ray.data.llm at its best: a fixed pool of `replicas` engines (an int `concurrency` is an
    # autoscaling pool from 1, which a small job never grows), all started before the first batch
    # is handed out (else the first engine up takes up to 2 x max_concurrent_batches blocks at
    # once: all of a small sorted dataset), and one block per batch (a folder of files; a sort
    # keeps the count).
    ray.data.DataContext.get_current().wait_for_min_actors_s = 3600
    ds = ray.data.read_json(str(data))
    if sort:
        ds = ds.sort("prompt_text")
    rows = processor(ds).take_all()
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], []).append(r)
    return {"computed_prompt_tokens": sum(r["num_input_tokens"] - r["num_cached_tokens"] for r in rows),
            "prompt_tokens": sum(r["num_input_tokens"] for r in rows),
            "engine_s": [max(r["finished_at"] for r in rs) - min(r["arrival_time"] for r in rs)
                         for rs in by_pid.values()],
            "ready_at": [min(r["arrival_time"] for r in rs) for rs in by_pid.values()],
            "batch_size": config.batch_size, "num_gpu_blocks": blocks,
            "row_pid": {int(r["id"]): r["pid"] for r in rows},
            "rows_per_replica": [len(rs) for rs in by_pid.values()],
            "outputs": {int(r["id"]): r["generated_tokens"] for r in rows}}


def _engine_fields(row: dict[str, Any]) -> dict[str, Any]:
    m = row.get("metrics") or {}
    return {k: m.get(k) for k in ("num_cached_tokens", "finished_at", "pid", "arrival_time")}


def record_cached_tokens() -> None:
    """A Ray worker setup hook for the ray.data.llm runs: each vLLM output row's `metrics` also
    gets the request's num_cached_tokens (prefix-cache hits), when it finished and which engine
    process ran it. Changes nothing else."""
    from ray.llm._internal.batch.stages import vllm_engine_stage as stage

    original = stage.vLLMOutputData.from_vllm_engine_output.__func__

    def from_vllm_engine_output(cls: Any, output: Any) -> Any:
        data = original(cls, output)
        data.metrics = {**(data.metrics or {}), "num_cached_tokens": output.num_cached_tokens or 0,
                        "finished_at": time.time(), "pid": os.getpid()}
        return data

    stage.vLLMOutputData.from_vllm_engine_output = classmethod(from_vllm_engine_output)


# ---- the cluster and the driver ----------------------------------------------------------------

class TestCluster:
    """Ray's multi-node test cluster on this machine: a head (6 CPU slots: drivers, tokenizing,
    ray.data.llm's other stages, whose actors hold a slot each: its detokenizer pool is as large
    as the engine pool) and `workers` nodes of 2 CPU slots each, all on 127.0.0.1."""

    def __init__(self, workers: int, root: Path):
        from ray.cluster_utils import Cluster

        os.environ.update(LOOPBACK)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 6, "node_ip_address": "127.0.0.1",
            "env_vars": {"PREFIXFLOW_CACHE": str(root / "head-cache")}})
        for k in range(workers):
            self.cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1",
                                  env_vars={"PREFIXFLOW_CACHE": str(root / f"node{k}-cache")})
        self.cluster.wait_for_nodes()

    def run(self, system: str, replicas: int, data: Path, model: Path, out: Path, log: Path) -> dict[str, Any]:
        env = {**os.environ, **LOOPBACK, "RAY_ADDRESS": self.cluster.address}
        cmd = [sys.executable, "-m", "prefixflow.bench.scale_bench", "--run-one", system,
               "--replicas", str(replicas), "--data", str(data), "--model", str(model), "--out", str(out)]
        with open(log, "wb") as f:
            proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} x{replicas} failed (exit {proc.returncode}):\n"
                               f"{log.read_text(errors='replace')[-4000:]}")
        return json.loads((out.parent / f"{out.name}.json").read_text())

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _driver_main(args: argparse.Namespace) -> None:
    """--run-one: one system on the cluster at RAY_ADDRESS; writes <out>.json."""
    import ray

    hook = {"worker_process_setup_hook": "prefixflow.bench.scale_bench.record_cached_tokens"}
    ray.init(runtime_env=hook if args.run_one.startswith("ray_llm") else None, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    out = Path(args.out)
    record = run_one(args.run_one, args.replicas, Path(args.data), Path(args.model), out)
    (out.parent / f"{out.name}.json").write_text(json.dumps(record))


# ---- the bench ---------------------------------------------------------------------------------

def bench_model(folder: Path) -> Path:
    """The random-weight Llama every system runs (4 layers, hidden 256, 4k context): big enough
    that prefill compute, not per-step overhead, sets the pace of a prompt."""
    from prefixflow.engine.models.tiny import make_tiny_checkpoint

    path = folder / "scale-llama"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch="llama", seed=0, **MODEL_SHAPE)
    return path


def summarize(runs: dict[str, dict[str, Any]], reference: dict[int, list[int]]) -> dict[str, Any]:
    """Per system and N: the record without outputs, plus the slowest replica over the mean and
    the outputs equal to the reference's."""
    out: dict[str, Any] = {}
    for key, run in runs.items():
        engine = run["engine_s"]
        outputs = run.pop("outputs")
        run.pop("row_pid", None)
        out[key] = {**run, "slowest_over_mean": max(engine) / (sum(engine) / len(engine)),
                    "outputs_equal": sum(outputs.get(i) == t for i, t in reference.items()),
                    "outputs": len(outputs)}
    return out


def simulator_check(runs: dict[str, dict[str, Any]], token_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """cluster_sim's prediction of each run's computed prompt tokens (same prompts in arrival
    order, same cache, same block size; for ray.data.llm the replica each row really ran on),
    against the measured count (issue 28 item 3's check)."""
    from prefixflow.bench.cluster_sim import predict_computed_tokens

    prompts = [r["tokenized_prompt"] for r in token_rows]
    outs = [r["max_tokens"] for r in token_rows]
    cache_blocks = next((r["num_gpu_blocks"] for r in runs.values() if "num_gpu_blocks" in r), None)
    out = {}
    for key, run in runs.items():
        system, n = key.split("/")
        if system.startswith("ray_llm"):
            pids = {int(i): pid for i, pid in run["row_pid"].items()}
            index = {pid: k for k, pid in enumerate(sorted(set(pids.values())))}
            pred = predict_computed_tokens(
                prompts, len(index), (cache_blocks - 1) * BLOCK, "sorted" if "sorted" in system else "arrival",
                block_size=BLOCK, output_lens=outs, batch_size=run["batch_size"],
                row_replica=[index[pids[r["id"]]] for r in token_rows])
        else:  # vLLM keeps one of its blocks as the null block
            vllm = system == "prefixflow_vllm"
            blocks = KV_CACHE_BYTES // (BLOCK * run["kv_bytes_per_token"])
            pred = predict_computed_tokens(prompts, int(n), (blocks - vllm) * BLOCK,
                                           "plan_vllm" if vllm else "plan", block_size=BLOCK, output_lens=outs)
        measured = run["computed_prompt_tokens"]
        out[key] = {"measured": measured, "predicted": pred.computed_prompt_tokens,
                    "error": pred.computed_prompt_tokens / measured - 1}
    return out


def ratios(summary: dict[str, Any], replicas: list[int]) -> dict[str, Any]:
    """The acceptance's comparisons at each N: ours vs ray.data.llm with sorted input (the
    faster of its two vLLM process modes), and vs our own count at N = 1."""
    out = {}
    for n in replicas:
        modes = [summary[k] for k in (f"ray_llm_sorted/{n}", f"ray_llm_sorted_mp/{n}") if k in summary]
        sorted_ = min(modes, key=lambda r: r["wall_without_start_s"]) if modes else None
        for system in ("prefixflow_native", "prefixflow_vllm"):
            ours, one = summary.get(f"{system}/{n}"), summary.get(f"{system}/1")
            if ours is None:
                continue
            row = {"computed_vs_own_n1": ours["computed_prompt_tokens"] / one["computed_prompt_tokens"] if one else None}
            if sorted_ is not None:
                row.update(
                    computed_vs_ray_llm_sorted=ours["computed_prompt_tokens"] / sorted_["computed_prompt_tokens"],
                    speedup_vs_ray_llm_sorted_without_start=sorted_["wall_without_start_s"] / ours["wall_without_start_s"],
                    speedup_vs_ray_llm_sorted_with_start=sorted_["wall_s"] / ours["wall_s"])
            out[f"{system}/{n}"] = row
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in result["args"]["systems"]:
        ns = [n for n in result["args"]["replicas"] if f"{system}/{n}" in result["runs"]]
        runs = [result["runs"][f"{system}/{n}"] for n in ns]
        axes[0].plot(ns, [r["computed_prompt_tokens"] / 1e3 for r in runs], "o-", label=system)
        axes[1].plot(ns, [r["wall_without_start_s"] for r in runs], "o-", label=system)
    axes[0].set(xlabel="replicas", ylabel="prompt tokens computed (k)", xticks=result["args"]["replicas"])
    axes[1].set(xlabel="replicas", ylabel="wall time without engine start (s)", xticks=result["args"]["replicas"])
    axes[0].legend(fontsize=8)
    fig.suptitle(f"scale_bench: {result['workload']['rows']} rows, {result['workload']['documents']} documents")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default="1,2,4")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workers", type=int, default=3, help="worker nodes of the test cluster")
    p.add_argument("--quick", action="store_true", help="256 rows, N = 1 and 2 (a smoke run)")
    p.add_argument("--out", default=str(RESULTS / "scale_bench.json"))
    p.add_argument("--reuse", help="a work folder of an earlier run (same rows and model): its "
                   "finished runs are taken as they are, the others run")
    p.add_argument("--run-one", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.run_one:
        _driver_main(args)
        return
    replicas = [1, 2] if args.quick else [int(n) for n in args.replicas.split(",")]
    num_rows = 256 if args.quick else args.rows
    systems = args.systems.split(",")
    work = Path(tempfile.mkdtemp(prefix="scale_bench-"))
    model = bench_model(work)
    from transformers import AutoTokenizer

    rows = make_rows(AutoTokenizer.from_pretrained(str(model)), num_rows)
    ours, theirs = write_inputs(model, rows, work)
    cluster = TestCluster(args.workers, work)
    runs: dict[str, dict[str, Any]] = {}
    try:
        for n in replicas:
            for system in systems:  # interleaved: every system at one N before the next N
                data = ours if system.startswith("prefixflow") else theirs
                key = f"{system}/{n}"
                earlier = Path(args.reuse or work) / f"{key.replace('/', '-')}.json"
                if args.reuse and earlier.exists():
                    runs[key] = json.loads(earlier.read_text())
                    print(f"{key}: taken from {earlier}", flush=True)
                    continue
                print(f"{key} ...", flush=True)
                runs[key] = cluster.run(system, n, data, model, work / key.replace("/", "-"),
                                        work / f"{key.replace('/', '-')}.log")
                print(f"  {key}: computed {runs[key]['computed_prompt_tokens']} of "
                      f"{runs[key]['prompt_tokens']} prompt tokens, wall {runs[key]['wall_s']:.1f} s "
                      f"({runs[key]['wall_without_start_s']:.1f} s without start-up)", flush=True)
    finally:
        cluster.shutdown()
    reference_key = next(k for k in (f"prefixflow_native/{replicas[0]}", *runs) if k in runs)
    reference = runs[reference_key]["outputs"]
    token_rows = [json.loads(line) for f in sorted(theirs.iterdir()) for line in open(f)]
    check = simulator_check(runs, token_rows)
    summary = summarize(runs, reference)
    docs = {r["doc_id"] for r in rows}
    result = {
        "bench": "scale_bench", "args": {"replicas": replicas, "systems": systems, "rows": num_rows,
                                          "workers": args.workers, "kv_cache_bytes": KV_CACHE_BYTES,
                                          "block_size": BLOCK, "model": MODEL_SHAPE},
        "workload": {"rows": len(rows), "documents": len(docs),
                     "questions_per_document_top": sorted(zipf_counts(num_rows, max(8, num_rows * 3 // 10), 1.3), reverse=True)[:5],
                     "output_tokens": sum(r["max_tokens"] for r in rows),
                     "floors": prompt_token_floors([r["tokenized_prompt"] for r in token_rows])},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
        "reference_outputs": reference_key, "runs": summary, "acceptance": ratios(summary, replicas),
        "simulator_check": check}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, path.with_suffix(".png"))
    print(json.dumps(result["acceptance"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
