"""engine.backend http: the prefix-cache hits a fleet of OpenAI-compatible servers reports with
the plan's order and placement, beside the ways a careful user feeds a fleet (issue 40).

    python -m prefixflow.bench.http_bench [--docs 24] [--questions 8] [--servers 2] [--repeats 3]
        [--model smollm2-135m-instruct] [--kv-mib 256] [--out bench/results/http_bench.json]

Servers: --servers real `vllm serve` CPU servers on 127.0.0.1 (bench/vllm_servers.py: prefix
caching on, block size 32, --kv-mib of KV cache each, fp32), started once; each cell starts
with every server's prefix cache emptied (dev mode's /reset_prefix_cache).
Workload: the demo's documents x questions, shuffled as the demo writes them, each row
"Document: ...\\nQuestion: ...\\nAnswer:" tokenized with the model's tokenizer; rows of one
document share a long prefix; greedy, --max-tokens each.
Cells (one HTTP client for all, HttpEngine, max_concurrency 16 per server, all servers fed at
once, each server's rows in the order given):
- arrival_rr: arrival order, rows dealt round-robin over the servers (a load balancer in front
  of the fleet, as ray.data.llm's HTTP processor sends to one URL);
- sorted_rr: rows sorted by their token ids, then round-robin (a careful user behind a load
  balancer);
- sorted_split: sorted, then cut into --servers contiguous shares (a careful user who shards
  the sorted file by hand: siblings stay together except at the cuts);
- prefixflow: the plan (batchllm, one partition per server, block-sized prefixes), partition r
  to server r in plan order (what a job with engine.backend http sends, without stealing).
Per cell: the servers' prefix-cache hit rate (vllm:prefix_cache_hits_total over
vllm:prefix_cache_queries_total, summed over the servers: prompt tokens served from cache),
prompt tokens computed, wall seconds until the last answer, the load average. --repeats runs
of each cell, interleaved; median, min, max. All servers share this machine's cores, so the
seconds say little about a real fleet; the hit rate is the measure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefixflow.bench.vllm_servers import metric, reset_prefix_cache, vllm_servers

TEMPLATE = "Document: {document}\nQuestion: {question}\nAnswer:"
CELLS = ("arrival_rr", "sorted_rr", "sorted_split", "prefixflow")
SERVED = "bench"
BLOCK = 32  # the servers' block size (vLLM's CPU attention wants multiples of 32)
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def workload(model: str, docs: int, questions: int) -> list[list[int]]:
    from prefixflow.jobs.demo import demo_rows
    from prefixflow.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    return [list(tok(TEMPLATE.format(**r))["input_ids"]) for r in demo_rows(num_docs=docs, questions_per_doc=questions)]


def shares(cell: str, prompts: list[list[int]], servers: int) -> list[list[Any]]:
    """Each server's groups for a cell, in the order it gets them (a peer's rows are groups of
    one, without a prefix hint: the server's cache finds what it finds)."""
    from prefixflow.pipeline import build_plan

    if cell == "prefixflow":
        plan = build_plan(prompts, order="batchllm", num_replicas=servers, min_prefix_len=BLOCK)
        return [list(plan.groups(r)) for r in range(servers)]
    order = list(range(len(prompts)))
    if cell != "arrival_rr":
        order.sort(key=lambda i: prompts[i])
    if cell == "sorted_split":
        cut = [len(order) * s // servers for s in range(servers + 1)]
        parts = [order[cut[s] : cut[s + 1]] for s in range(servers)]
    else:
        parts = [order[s::servers] for s in range(servers)]
    singles = build_plan(prompts, order="fcfs", min_prefix_len=10**9)  # one group per row
    by_row = {int(g.row_ids[0]): g for g in singles.groups(0)}
    return [[by_row[i] for i in part] for part in parts]


def run_cell(urls: list[str], groups: list[list[Any]], model: str, max_tokens: int) -> dict[str, Any]:
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.http_backend.config import HttpConfig
    from prefixflow.engine.http_backend.engine import HttpEngine
    from prefixflow.requests import SamplingParams

    for url in urls:
        reset_prefix_cache(url)
    before = [(metric(u, HITS), metric(u, QUERIES)) for u in urls]
    http = HttpConfig.of({"endpoints": urls, "model": SERVED, "max_concurrency": 16})
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()

    def serve(r: int) -> list[Any]:
        engine = HttpEngine(EngineConfig(model=model, device="cpu"), http, r)
        return list(engine.run(groups[r], params))

    with ThreadPoolExecutor(len(urls)) as pool:
        outs = [o for part in pool.map(serve, range(len(urls))) for o in part]
    seconds = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    assert not errors, errors[:2]
    after = [(metric(u, HITS), metric(u, QUERIES)) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return {
        "seconds": seconds,
        "rows": len(outs),
        "prompt_tokens": int(queries),
        "cached_tokens": int(hits),
        "computed_tokens": int(queries - hits),
        "hit_rate": hits / queries if queries else 0.0,
        "rows_per_server": [sum(g.num_members for g in part) for part in groups],
        "load_avg_1m": os.getloadavg()[0],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float]:
        values = [r[key] for r in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {k: stat(k) for k in ("hit_rate", "computed_tokens", "seconds", "load_avg_1m")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--kv-mib", type=int, default=256)
    parser.add_argument("--out", default="bench/results/http_bench.json")
    args = parser.parse_args()

    from prefixflow.model_source import resolve_model

    model = str(resolve_model(args.model))
    prompts = workload(model, args.docs, args.questions)
    logs = Path(tempfile.mkdtemp(prefix="http_bench-"))  # the servers' logs
    print(f"server logs: {logs}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CELLS}
    with vllm_servers(model, args.servers, SERVED, logs, max_model_len=2048, kv_cache_bytes=args.kv_mib << 20) as urls:
        cells = {c: shares(c, prompts, args.servers) for c in CELLS}
        for repeat in range(args.repeats):
            for cell in CELLS:
                runs[cell].append(run_cell(urls, cells[cell], model, args.max_tokens))
                print(f"repeat {repeat} {cell}: {json.dumps(runs[cell][-1])}", flush=True)
    result = {
        "workload": {
            "docs": args.docs,
            "questions": args.questions,
            "rows": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "model": args.model,
            "max_tokens": args.max_tokens,
        },
        "servers": {"count": args.servers, "kv_cache_mib": args.kv_mib, "block_size": BLOCK, "max_concurrency": 16},
        "cells": {c: {"summary": summary(runs[c]), "runs": runs[c]} for c in CELLS},
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    for c in CELLS:
        s = result["cells"][c]["summary"]
        print(
            f"{c:13s} hit rate {s['hit_rate']['median']:.3f}  computed {s['computed_tokens']['median']:,.0f}  "
            f"{s['seconds']['median']:.1f} s"
        )


if __name__ == "__main__":
    main()
