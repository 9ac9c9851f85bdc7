"""The whole prefixflow job vs plain Ray Data + transformers `generate`, side by side.

Both read the same demo rows (documents x questions under one system prompt) on the same local
Ray, render the same chat prompts, generate greedily with the same tiny model and write parquet.
Reports both wall times, their ratio, the plan stage's share of prefixflow's wall time
(goal: < 5%) and how many outputs agree token for token.

    .venv/bin/python -m prefixflow.bench.pipeline_bench [--num-docs 24 --questions 8 --max-tokens 32]
        [--hidden 512 --layers 4]   # a larger random model, where compute outweighs start-up
        [--model smollm2-135m-instruct --out bench/results/pipeline_bench_smollm2.json]  # real

Writes bench/results/pipeline_bench.json.
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

SYSTEM = ("You are a helpful assistant. Read the document and answer the question below in one "
          "short sentence.")
USER = "Document: {{ document }}\n\nQuestion: {{ question }}"


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

        texts = [self.tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Document: {d}\n\nQuestion: {q}"}],
            add_generation_prompt=True, tokenize=False) for d, q in zip(batch["document"], batch["question"])]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = self.model.generate(**enc, max_new_tokens=self.max_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id)
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        eos = self.tok.eos_token_id
        tokens = [t[:t.index(eos) + 1] if eos in t else t for t in new]
        batch["generated_tokens"] = np.array([json.dumps(t) for t in tokens])
        batch["generated_text"] = np.array(self.tok.batch_decode(tokens, skip_special_tokens=True))
        return batch


def run_prefixflow(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    from prefixflow.jobs.run import run_job
    from prefixflow.jobs.spec import parse_spec

    spec = parse_spec({
        "model": str(model), "input": {"path": str(data)},
        "prompt": {"system": SYSTEM, "user": USER},
        "sampling": {"temperature": 0, "max_tokens": args.max_tokens},
        "engine": {"device": "cpu", "kv_cache_bytes": 256 << 20, "max_num_batched_tokens": 2048},
        "order": args.order, "replicas": args.replicas,
        "output": {"path": str(out), "rows_per_part": 256, "overwrite": True},
    })
    started = time.perf_counter()
    metrics = run_job(spec, quiet=True)
    return {"wall_s": time.perf_counter() - started, "metrics": metrics}


def run_baseline(model: Path, data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    started = time.perf_counter()
    ds = ray.data.read_json(str(data)).map_batches(
        HFGenerate, fn_constructor_kwargs={"model": str(model), "max_tokens": args.max_tokens},
        batch_size=args.baseline_batch_size, compute=ray.data.ActorPoolStrategy(size=args.replicas),
        num_cpus=1)
    ds.write_parquet(str(out))
    return {"wall_s": time.perf_counter() - started}


def agreement(pf_out: Path, base_out: Path) -> float:
    """Share of rows whose greedy tokens are the same in both outputs."""
    import pyarrow.parquet as pq

    from prefixflow.operators.write import read_output

    ours = read_output(str(pf_out)).to_pylist()
    theirs = {r["id"]: json.loads(r["generated_tokens"]) for r in pq.read_table(base_out).to_pylist()}
    same = [list(r["generated_tokens"]) == theirs[r["id"]] for r in ours if r["error"] is None]
    return float(np.mean(same)) if same else 0.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
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
    p.add_argument("--model", default=None, help="a model engine.model_source resolves, e.g. "
                   "smollm2-135m-instruct (default: the demo's tiny random Llama)")
    p.add_argument("--out", default="bench/results/pipeline_bench.json")
    args = p.parse_args(argv)

    import ray

    from prefixflow.jobs.demo import demo_checkpoint, write_demo_data

    work = Path(tempfile.mkdtemp(prefix="pf_pipeline_bench_"))
    if args.model:
        from prefixflow.engine.model_source import resolve_model

        model = resolve_model(args.model)
    elif args.hidden or args.layers:
        from prefixflow.engine.tiny import make_tiny_checkpoint

        overrides = {k: v for k, v in dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                           intermediate_size=args.hidden and 2 * args.hidden).items() if v}
        model = make_tiny_checkpoint(work / "model", arch="llama", seed=0, **overrides)
    else:
        model = demo_checkpoint(work)
    data = write_demo_data(work, num_docs=args.num_docs, questions_per_doc=args.questions,
                           sentences_per_doc=args.sentences)
    # Logical CPUs: one per replica plus room for the read / tokenize / write tasks, the same
    # for both sides (with only `replicas` slots the baseline's readers would wait forever).
    ray.init(num_cpus=args.replicas + 2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    base = run_baseline(model, data, work / "baseline", args)
    ours = run_prefixflow(model, data, work / "prefixflow", args)
    agree = agreement(work / "prefixflow", work / "baseline")
    ray.shutdown()

    m = ours["metrics"]
    st = m["stage_seconds"]
    result = {
        "bench": "pipeline_bench", "args": vars(args), "machine": platform.node(), "cpus": os.cpu_count(),
        "rows": m["rows"], "prompt_tokens": m["prompt_tokens"], "generated_tokens": m["generated_tokens"],
        "prefixflow_wall_s": ours["wall_s"], "baseline_wall_s": base["wall_s"],
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "prefixflow_stage_seconds"}, indent=2))
    return result


if __name__ == "__main__":
    main()
