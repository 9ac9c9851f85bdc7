"""The whole prefixflow job vs plain Ray Data + transformers `generate`, side by side.

Both read the same demo rows (documents x questions under one system prompt) on the same local
Ray, render the same chat prompts, generate greedily with the same tiny model and write parquet.
Reports both wall times, their ratio, the plan stage's share of prefixflow's wall time
(goal: < 5%) and how many outputs agree token for token.

    .venv/bin/python -m prefixflow.bench.pipeline_bench [--num-docs 24 --questions 8 --max-tokens 32]
        [--hidden 512 --layers 4]   # a larger random model, where compute outweighs start-up
        [--model smollm2-135m-instruct --out bench/results/pipeline_bench_smollm2.json]  # real

Writes bench/results/pipeline_bench.json.

With --peer ray-data-llm it compares instead the peer users would pick on vLLM: ray.data.llm
(build_processor + vLLMEngineProcessorConfig: chat template, tokenize, vLLM, detokenize stages)
against prefixflow with engine.backend: vllm, for each replica count of --replica-counts,
interleaved: end-to-end wall time, engine time, token saving and outputs compared.

    .venv/bin/python -m prefixflow.bench.pipeline_bench --peer ray-data-llm --num-docs 12 \
        --questions 4 --replica-counts 1,2 --out bench/results/pipeline_bench_vllm.json
        [--peer-prompts tokens]  # the peer gets our prompts' token ids (outputs then comparable:
                                 # its own tokenize stage adds a second BOS to chat prompts)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SYSTEM = "You are a helpful assistant. Read the document and answer the question below in one short sentence."
USER = "Document: {{ document }}\n\nQuestion: {{ question }}"
KV_CACHE_BYTES = 256 << 20
MAX_BATCHED_TOKENS = 2048


class HFGenerate:
    """The baseline: a map_batches actor running transformers' generate on padded batches."""

    def __init__(self, model: str, max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.tok = AutoTokenizer.from_pretrained(model)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.max_tokens = max_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        texts = [
            self.tok.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Document: {d}\n\nQuestion: {q}"}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for d, q in zip(batch["document"], batch["question"])
        ]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(
                **enc, max_new_tokens=self.max_tokens, do_sample=False, pad_token_id=self.tok.pad_token_id
            )
        new = out[:, enc["input_ids"].shape[1] :].tolist()
        eos = self.tok.eos_token_id
        tokens = [t[: t.index(eos) + 1] if eos in t else t for t in new]
        batch["generated_tokens"] = np.array([json.dumps(t) for t in tokens])
        batch["generated_text"] = np.array(self.tok.batch_decode(tokens, skip_special_tokens=True))
        return batch


def run_prefixflow(
    model: Path, data: Path, out: Path, args: argparse.Namespace, backend: str = "native"
) -> dict[str, Any]:
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import parse_spec

    spec = parse_spec(
        {
            "model": str(model),
            "input": {"path": str(data)},
            "prompt": {"system": SYSTEM, "user": USER},
            "sampling": {"temperature": 0, "max_tokens": args.max_tokens},
            "engine": {
                "device": "cpu",
                "kv_cache_bytes": KV_CACHE_BYTES,
                "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                "backend": backend,
            },
            "order": args.order,
            "replicas": args.replicas,
            "output": {"path": str(out), "rows_per_part": 256, "overwrite": True},
        }
    )
    started = time.perf_counter()
    metrics = run_job(spec, quiet=True)
    return {"wall_s": time.perf_counter() - started, "metrics": metrics}


def run_baseline(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    started = time.perf_counter()
    ds = ray.data.read_json(str(data)).map_batches(
        HFGenerate,
        fn_constructor_kwargs={"model": str(model), "max_tokens": args.max_tokens},
        batch_size=args.baseline_batch_size,
        compute=ray.data.ActorPoolStrategy(size=args.replicas),
        num_cpus=1,
    )
    ds.write_parquet(str(out))
    return {"wall_s": time.perf_counter() - started}


def run_ray_data_llm(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The peer: ray.data.llm's processor with its own chat-template, tokenize, vLLM and
    detokenize stages, the same KV budget, block size and step token limit as prefixflow's
    vLLM replicas; one CPU per replica (its default asks for a GPU)."""
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from prefixflow.engine.models.model_args import read_model_args

    margs = read_model_args(str(model))
    block = 32  # vLLM's CPU attention wants multiples of 32; prefixflow's vLLM replicas use 32 too
    blocks = KV_CACHE_BYTES // (block * margs.kv_bytes_per_token_per_elem * 4)
    ds, tokens = ray.data.read_json(str(data)), args.peer_prompts == "tokens"
    if tokens:  # our chat prompts' token ids: its tokenize stage would add a second BOS
        ds = ray.data.from_items(_with_token_ids(model, data))
    config = vLLMEngineProcessorConfig(
        model_source=str(model),
        batch_size=args.peer_batch_size,
        concurrency=args.replicas,
        chat_template_stage=not tokens,
        tokenize_stage=not tokens,
        engine_kwargs=dict(
            dtype="float32",
            block_size=block,
            num_gpu_blocks_override=blocks,
            max_model_len=min(blocks * block, margs.max_position_embeddings),
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            enable_prefix_caching=True,
        ),
        placement_group_config={"bundles": [{"CPU": 1}]},
        log_engine_metrics=False,
    )
    max_tokens = args.max_tokens
    processor = build_processor(
        config,
        preprocess=lambda r: dict(
            id=r["id"],
            sampling_params=dict(temperature=0.0, max_tokens=max_tokens),
            **({"tokenized_prompt": r["tokenized_prompt"]} if tokens else {"messages": _messages(r)}),
        ),
        postprocess=lambda r: dict(
            id=r["id"],
            generated_tokens=[int(t) for t in r["generated_tokens"]],
            generated_text=r["generated_text"],
            num_input_tokens=r["num_input_tokens"],
            scheduled_ts=(r.get("metrics") or {}).get("scheduled_ts"),
            last_token_ts=(r.get("metrics") or {}).get("last_token_ts"),
        ),
    )
    started = time.perf_counter()
    processor(ds).write_parquet(str(out))
    return {"wall_s": time.perf_counter() - started}


def _messages(row: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Document: {row['document']}\n\nQuestion: {row['question']}"},
    ]


def _with_token_ids(model: Path, data: Path) -> list[dict[str, Any]]:
    """The rows with `tokenized_prompt`: the chat template's text tokenized without adding
    special tokens (the template has the BOS), as prefixflow tokenizes chat prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in open(data)]
    for r in rows:
        text = tok.apply_chat_template(_messages(r), add_generation_prompt=True, tokenize=False)
        r["tokenized_prompt"] = tok(text, add_special_tokens=False)["input_ids"]
    return rows


def peer_summary(pf_out: Path, peer_out: Path, pf: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """One replica count: both wall times, engine times, token saving, outputs compared."""
    import pyarrow.parquet as pq

    from prefixflow.operators.results.write import read_output

    table = read_output(str(pf_out))
    assert not isinstance(table, list), "the job writes parquet, read back as a table"
    ours = {r["id"]: list(r["generated_tokens"]) for r in table.to_pylist() if r["error"] is None}
    theirs = pq.read_table(peer_out).to_pylist()
    m = pf["metrics"]
    ready = [r["engine_ready_s"] for r in m["per_replica"]]
    starts = [r["scheduled_ts"] for r in theirs if r["scheduled_ts"]]
    ends = [r["last_token_ts"] for r in theirs if r["last_token_ts"]]
    return {
        "prefixflow_vllm_wall_s": pf["wall_s"],
        "ray_data_llm_wall_s": peer["wall_s"],
        "wall_ratio_peer_over_prefixflow": peer["wall_s"] / pf["wall_s"],
        # From the first engine's first scheduled work to the last engine's last token (the
        # peer's per-row vLLM timestamps; prefixflow's replica records): start-up excluded.
        "prefixflow_engine_span_s": max(r["end_s"] for r in m["per_replica"]) - min(ready),
        "ray_data_llm_engine_span_s": (max(ends) - min(starts)) if starts and ends else None,
        "prefixflow_engine_run_s_per_replica": [r["run_seconds"] for r in m["per_replica"]],
        "prompt_tokens": m["prompt_tokens"],
        "generated_tokens": m["generated_tokens"],
        "peer_prompt_tokens": sum(r["num_input_tokens"] for r in theirs),
        "prefixflow_token_saving_ratio_plan": m["token_saving_ratio"],
        "prefixflow_token_saving_ratio_engine": m["token_saving_ratio_engine"],
        # ray.data.llm's rows carry no num_cached_tokens (prefix hits only reach Prometheus).
        "ray_data_llm_token_saving_ratio": None,
        "rows": len(theirs),
        "prefixflow_rows_ok": len(ours),
        "outputs_equal_fraction": float(np.mean([ours.get(r["id"]) == r["generated_tokens"] for r in theirs]))
        if theirs
        else 0.0,
    }


def main_peer(args: argparse.Namespace, model: Path, data: Path, work: Path) -> dict[str, Any]:
    """ray.data.llm vs prefixflow (engine.backend: vllm) for each replica count, interleaved."""
    import ray

    runs = []
    for replicas in [int(r) for r in args.replica_counts.split(",")]:
        args.replicas = replicas
        # ray.data.llm holds one actor per stage (chat template, tokenize, vLLM, detokenize):
        # with fewer logical CPUs its read tasks never get one and the job hangs.
        ray.init(
            num_cpus=replicas + 5,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
        peer = run_ray_data_llm(model, data, work / f"peer-{replicas}", args)
        ours = run_prefixflow(model, data, work / f"pf-{replicas}", args, backend="vllm")
        ray.shutdown()
        runs.append(
            {
                "replicas": replicas,
                "load_avg": os.getloadavg(),
                **peer_summary(work / f"pf-{replicas}", work / f"peer-{replicas}", ours, peer),
            }
        )
        print(json.dumps(runs[-1], indent=2), flush=True)
        result = {
            "bench": "pipeline_bench",
            "peer": "ray.data.llm",
            "args": vars(args),
            "machine": platform.node(),
            "cpus": os.cpu_count(),
            "runs": runs,
        }
        _write(result, Path(args.out))  # after each replica count: a long run keeps what it has
    return result


def agreement(pf_out: Path, base_out: Path) -> float:
    """Share of rows whose greedy tokens are the same in both outputs."""
    import pyarrow.parquet as pq

    from prefixflow.operators.results.write import read_output

    table = read_output(str(pf_out))
    assert not isinstance(table, list), "the job writes parquet, read back as a table"
    ours = table.to_pylist()
    theirs = {r["id"]: json.loads(r["generated_tokens"]) for r in pq.read_table(base_out).to_pylist()}
    same = [list(r["generated_tokens"]) == theirs[r["id"]] for r in ours if r["error"] is None]
    return float(np.mean(same)) if same else 0.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-docs", type=int, default=24)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--sentences", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--order", default="batchllm")
    p.add_argument("--baseline-batch-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=None, help="a larger random model than the demo's")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument(
        "--model",
        default=None,
        help="a model prefixflow.model_source resolves, e.g. "
        "smollm2-135m-instruct (default: the demo's tiny random Llama)",
    )
    p.add_argument("--out", default="bench/results/pipeline_bench.json")
    p.add_argument(
        "--peer",
        choices=("transformers", "ray-data-llm"),
        default="transformers",
        help="ray-data-llm: ray.data.llm vs prefixflow with engine.backend: vllm",
    )
    p.add_argument("--replica-counts", default="1,2", help="with --peer ray-data-llm")
    p.add_argument("--peer-batch-size", type=int, default=16, help="ray.data.llm's batch_size")
    p.add_argument(
        "--peer-prompts",
        choices=("chat", "tokens"),
        default="chat",
        help="chat: ray.data.llm renders and tokenizes messages itself (it adds a second "
        "BOS after the chat template's); tokens: it gets our prompts' token ids",
    )
    return p


def _model(args: argparse.Namespace, work: Path) -> Path:
    """The checkpoint both sides run: --model resolved, a larger random Llama (--hidden /
    --layers), or the demo's tiny one, the random ones written under `work`."""
    from prefixflow.jobs.demo import demo_checkpoint

    if args.model:
        from prefixflow.model_source import resolve_model

        return resolve_model(args.model)
    if args.hidden or args.layers:
        from prefixflow.engine.models.tiny import make_tiny_checkpoint

        overrides = {
            k: v
            for k, v in dict(
                hidden_size=args.hidden,
                num_hidden_layers=args.layers,
                intermediate_size=args.hidden and 2 * args.hidden,
            ).items()
            if v
        }
        return make_tiny_checkpoint(work / "model", arch="llama", seed=0, **overrides)
    return demo_checkpoint(work)


def _result(args: argparse.Namespace, base: dict[str, Any], ours: dict[str, Any], agree: float) -> dict[str, Any]:
    """The record of a --peer transformers run: both wall times, prefixflow's stages and savings."""
    m = ours["metrics"]
    st = m["stage_seconds"]
    return {
        "bench": "pipeline_bench",
        "args": vars(args),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "rows": m["rows"],
        "prompt_tokens": m["prompt_tokens"],
        "generated_tokens": m["generated_tokens"],
        "prefixflow_wall_s": ours["wall_s"],
        "baseline_wall_s": base["wall_s"],
        "wall_ratio_baseline_over_prefixflow": base["wall_s"] / ours["wall_s"],
        "plan_stage_s": st["gather_s"] + st["build_plan_s"],
        "plan_stage_share_of_wall": m["plan_share_of_wall"],
        "read_tokenize_share_of_wall": st["read_tokenize_s"] / m["wall_seconds"],
        "prefixflow_stage_seconds": st,
        "token_saving_ratio": m["token_saving_ratio"],
        "token_saving_ratio_engine": m["token_saving_ratio_engine"],
        "engine_run_s_per_replica": [r["run_seconds"] for r in m["per_replica"]],
        "outputs_agree_fraction": agree,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)

    import ray

    from prefixflow.jobs.demo import write_demo_data

    work = Path(tempfile.mkdtemp(prefix="pf_pipeline_bench_"))
    model = _model(args, work)
    data = write_demo_data(
        work, num_docs=args.num_docs, questions_per_doc=args.questions, sentences_per_doc=args.sentences
    )
    if args.peer == "ray-data-llm":
        return _write(main_peer(args, model, data, work), Path(args.out))
    # Logical CPUs: one per replica plus room for the read / tokenize / write tasks, the same
    # for both sides (with only `replicas` slots the baseline's readers would wait forever).
    ray.init(num_cpus=args.replicas + 2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    base = run_baseline(model, data, work / "baseline", args)
    ours = run_prefixflow(model, data, work / "prefixflow", args)
    agree = agreement(work / "prefixflow", work / "baseline")
    ray.shutdown()

    result = _result(args, base, ours, agree)
    print(json.dumps({k: v for k, v in result.items() if k != "prefixflow_stage_seconds"}, indent=2))
    return _write(result, Path(args.out))


def _write(result: dict[str, Any], out: Path) -> dict[str, Any]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
