"""The `embed` task: what the plan buys an embedding job, on vLLM's pooling runner and on the native
engine, beside vLLM as a careful user runs it (issue 40).

    python -m prefixflow.bench.embed_bench [--docs 24] [--questions 8] [--repeats 3]
        [--model smollm2-135m-instruct] [--kv-blocks 0] [--out bench/results/embed_bench.json]

Workload: the demo's documents x questions (shuffled, as the demo writes them), each row
"Represent this question about the document for retrieval.\\nDocument: ...\\nQuestion: ..."
tokenized with the model's tokenizer (its BOS included): rows of one document share a long
prefix. Systems, on one replica, last-token pooling, normalized (vLLM's default for a causal
model):
- vllm_arrival / vllm_sorted: vLLM's own `LLM.embed` (runner pooling, prefix caching on, the
  same block size, KV blocks and batch budget as ours) on the rows in arrival order, and
  sorted by their token ids (what a careful user does to help its LRU prefix cache);
- prefixflow_vllm: our vLLM backend (VllmEngine.embed_groups) fed the plan's groups;
- prefixflow_native: our native engine (Scorer.embed_groups) fed the plan's groups.
Every system embeds every row; the vectors are compared with the native engine's (max abs
difference). Per run: wall seconds of the embedding (engine start and tokenizing excluded; the
plan's time is reported beside ours), prompt tokens computed (prompt tokens less those the
prefix cache served), the load average. --repeats runs of each, interleaved; median, min, max.
--kv-blocks 0 sizes vLLM's cache to hold the whole job's prompts (roomy); a smaller value is a
tight cache, where arrival order loses its hits.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from prefixflow.bench.record import command_line, spread, write_result

INSTRUCTION = "Represent this question about the document for retrieval.\nDocument: {document}\nQuestion: {question}"
BLOCK = 32  # vLLM's CPU attention wants multiples of 32
SYSTEMS = ("vllm_arrival", "vllm_sorted", "prefixflow_vllm", "prefixflow_native")
MAX_BATCHED_TOKENS, MAX_MODEL_LEN = 4096, 1024


def workload(tokenizer: Any, docs: int, questions: int) -> list[list[int]]:
    from prefixflow.jobs.demo import demo_rows

    rows = demo_rows(num_docs=docs, questions_per_doc=questions)
    return [list(tokenizer(INSTRUCTION.format(**r))["input_ids"]) for r in rows]


def run_vllm_peer(llm: Any, prompts: list[list[int]]) -> tuple[float, int, dict[int, list[float]]]:
    """vLLM's LLM.embed on the prompts in the order given: (seconds, computed tokens, vectors)."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    seconds = time.perf_counter() - start
    computed = sum(len(p) - int(o.num_cached_tokens or 0) for p, o in zip(prompts, outs))
    return seconds, computed, {i: o.outputs.embedding for i, o in enumerate(outs)}


def run_ours(engine: Any, plan: Any, pooling: Any) -> tuple[float, int, dict[int, list[float]]]:
    """One of our engines on the plan's groups: (seconds, computed tokens, vectors by row)."""
    if hasattr(engine, "reset_prefix_cache"):
        engine.reset_prefix_cache()
    else:  # the native Scorer: a fresh prefix cache
        from prefixflow.engine.scoring.cache import PrefixCache

        engine.prefix_cache = PrefixCache(engine.prefix_cache_bytes)
    start = time.perf_counter()
    outs = list(engine.embed_groups(plan.groups(0), pooling))
    seconds = time.perf_counter() - start
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:1]
    totals = engine.totals
    return seconds, int(totals.num_computed_prompt_tokens), {o.row_id: list(o.embedding) for o in outs}


def engines(model: str, blocks: int, pooling: Any) -> dict[str, Any]:
    """The three engines, with one block size, KV cache and batch budget: vLLM's own LLM (the
    peer), our vLLM backend and our native engine."""
    from vllm import LLM

    from prefixflow.engine import EngineConfig, Scorer
    from prefixflow.engine.models.model_args import read_model_args
    from prefixflow.engine.vllm_backend.engine import VllmEngine

    kv_bytes = blocks * BLOCK * read_model_args(model).kv_bytes_per_token_per_elem * 4
    config = EngineConfig(
        model=model,
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        kv_cache_bytes=kv_bytes,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
    )
    ours_vllm = VllmEngine(config, {"enforce_eager": True}, pooling=pooling)
    llm = LLM(
        model=model,
        runner="pooling",
        convert="embed",
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,
        pooler_config={"pooling_type": "LAST", "use_activation": True},
        disable_log_stats=True,
    )
    return {"peer": llm, "prefixflow_vllm": ours_vllm, "prefixflow_native": Scorer(config)}


def run_all(prompts: list[list[int]], plan: Any, pooling: Any, built: dict[str, Any], repeats: int) -> dict[str, list]:
    """Every system `repeats` times, interleaved (module docstring)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for rep in range(repeats):
        for system in SYSTEMS:
            load = os.getloadavg()[0]
            if system == "vllm_arrival":
                seconds, computed, vecs = run_vllm_peer(built["peer"], prompts)
            elif system == "vllm_sorted":
                seconds, computed, by_pos = run_vllm_peer(built["peer"], [prompts[i] for i in order])
                vecs = {order[k]: v for k, v in by_pos.items()}
            else:
                seconds, computed, vecs = run_ours(built[system], plan, pooling)
            runs[system].append({"seconds": seconds, "computed_tokens": computed, "load_avg": load, "vectors": vecs})
            total = sum(map(len, prompts))
            print(f"repeat {rep} {system}: {seconds:.2f} s, computed {computed} of {total} tokens, load {load:.1f}")
    return runs


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Median, min and max seconds, computed tokens and load per system; the largest difference
    of its vectors from the native engine's (the reference: transformers' in tests/cpu)."""
    import numpy as np

    reference = runs["prefixflow_native"][0]["vectors"]
    out = {}
    for system, rs in runs.items():
        diff = max(
            float(np.abs(np.asarray(r["vectors"][i]) - np.asarray(reference[i])).max()) for r in rs for i in reference
        )
        out[system] = {
            **spread([r["seconds"] for r in rs]),
            "computed_tokens": [r["computed_tokens"] for r in rs],
            "load_avg": [round(r["load_avg"], 2) for r in rs],
            "max_abs_diff_vs_native": diff,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--kv-blocks", type=int, default=0, help="vLLM's KV blocks (0: enough for every prompt)")
    p.add_argument("--out", default="bench/results/embed_bench.json")
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as our backend runs it
    import torch

    from prefixflow.engine.scoring.pooling import Pooling
    from prefixflow.model_source import resolve_model
    from prefixflow.pipeline import build_plan
    from prefixflow.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    model = str(resolve_model(args.model))
    prompts = workload(load_tokenizer(model), args.docs, args.questions)
    blocks = args.kv_blocks or sum(-(-len(q) // BLOCK) for q in prompts) + 16
    pooling = Pooling("last", True)
    t0 = time.perf_counter()
    plan = build_plan(prompts, row_ids=list(range(len(prompts))), order="batchllm", min_prefix_len=BLOCK)
    plan_s = time.perf_counter() - t0
    runs = run_all(prompts, plan, pooling, engines(model, blocks, pooling), args.repeats)
    result = {
        "command": command_line("embed_bench", args),
        "model": args.model,
        "rows": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "plan": {"seconds": plan_s, "computed_prompt_tokens": int(plan.summary["computed_prompt_tokens"])},
        "kv_blocks": blocks,
        "block_size": BLOCK,
        "pooling": "last, normalized",
        "systems": summary(runs),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
