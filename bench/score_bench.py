"""The `score` task (PrefillOnly) on the CPU: (a) peak memory of one long prompt, (b) the post
recommendation workload of PrefillOnly Table 1, scaled down.

    .venv/bin/python -m prefixflow.bench.score_bench [--tokens 16384] [--users 12]

(a) Peak memory. Each variant runs in a fresh subprocess that loads the model, runs a short
warm-up, then resets the kernel's resident-set high-water mark (`echo 5 >
/proc/self/clear_refs`), notes the RSS, runs ONE forward and reads VmHWM: the delta is the
forward's peak extra resident memory (weights and warm-up excluded). It includes glibc's slack:
after a freed mmap'd block glibc raises its mmap threshold, so later multi-MB activations come
from the heap and fragment it (~20 MB at 16k tokens; with MALLOC_MMAP_THRESHOLD_=1048576 the
hybrid peak matched `forward_bytes` within 3%). Variants: `hybrid_cN` (Scorer.score: hybrid
prefilling with chunk N + suffix KV discard), `generate` (ModelRunner.execute_logits of the
whole prompt as one prefill chunk; its paged KV cache for all layers is allocated before the
baseline and added from its size), `transformers` (AutoModelForCausalLM forward, default:
logits of every position) and `transformers_keep1` (logits_to_keep=1). Model: 4 layers, hidden
512, intermediate 1536, 8 heads, 2 KV heads, max_position_embeddings 32768 (random weights,
engine/models/tiny.py).

(b) Post recommendation (Table 1 / 10): U users, profiles ~ N(1400, 300) tokens (clipped to
[800, 1900]), 50 posts of ~15 tokens each, one request per (user, post) on the default tiny
model (2 layers, hidden 128). transformers scores a sample of the requests one by one (its
requests/s does not depend on which), and so does ours with prefix reuse off; ours also runs
all of them offline (all arrive at once, planned groups, SRJF): best of two runs each. Then
online: users arrive as a Poisson process (all 50 requests at once) at 2x and 4x the rate the
scorer serves them, with a prefix cache that holds ~1.5 profiles: FCFS, plain SRJF and SRJF
with continuous JCT calibration (Sec. 6.3), cache hits and latencies, on the scorer's virtual
clock (computed tokens / tokens_per_s), which makes the order reproducible. Other timings are
wall clock on a shared 2-core machine: load averages at start and end are recorded.

(c) With --model (e.g. smollm2-135m-instruct), only the offline part of (b) on that model:
ours (planned groups, prefix reuse) vs transformers one request at a time on a sample, written
to bench/results/score_bench_<model>.json beside the tiny model's results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


RESULTS = Path("bench/results/score_bench.json")
DEMO = dict(
    num_hidden_layers=4,
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)
CHUNKS = (512, 256)  # hybrid prefilling chunk sizes measured (ScoreOptions default: 512)


def _status_mb(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"{field}:\s+(\d+)", text)
    assert found is not None, f"/proc/self/status has no {field}"
    return int(found.group(1)) / 1024


def measure(variant: str, tokens: int, chunk: int) -> dict:
    """One variant's forward in this process (the subprocess side of (a))."""
    import torch

    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    path = str(tiny_checkpoint_cached("llama", seed=0, llama3_rope=False, **DEMO))
    ids = torch.randint(3, 600, (tokens,), generator=torch.Generator().manual_seed(0))
    run, extra = _variant(variant, path, tokens, chunk)
    run(ids[:64])  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_mb("VmRSS")
    t0 = time.perf_counter()
    run(ids)
    seconds = time.perf_counter() - t0
    peak = _status_mb("VmHWM") - base
    if variant == "hybrid":
        variant = f"hybrid_c{chunk}"
    return dict(
        variant=variant,
        tokens=tokens,
        peak_delta_mb=round(peak + extra, 1),
        extra_mb=round(extra, 1),
        seconds=round(seconds, 2),
    )


def _variant(variant: str, path: str, tokens: int, chunk: int):
    import torch

    from prefixflow.engine.config import EngineConfig

    if variant == "hybrid":
        from prefixflow.engine.scoring.options import ScoreOptions
        from prefixflow.engine.scoring.scorer import Scorer

        s = Scorer(EngineConfig(model=path, device="cpu"), ScoreOptions(chunk_size=chunk))
        return (lambda ids: s.score([ids.tolist()], [5, 6])), 0.0
    if variant == "generate":
        from prefixflow.engine.native.model_runner import ModelRunner
        from prefixflow.engine.native.step import SeqChunk, StepInput
        from prefixflow.requests import SamplingParams

        probe = ModelRunner(EngineConfig(model=path, device="cpu", kv_cache_bytes=1 << 20))
        kv_bytes = probe.kv_bytes_per_token * (tokens + 16)
        del probe
        r = ModelRunner(EngineConfig(model=path, device="cpu", kv_cache_bytes=kv_bytes))

        def run(ids):
            n = len(ids)
            step = StepInput(
                (
                    SeqChunk(
                        0,
                        tuple(ids.tolist()),
                        0,
                        0,
                        tuple(range(-(-n // 16))),
                        sample=True,
                        sampling_params=SamplingParams(),
                    ),
                )
            )
            r.execute_logits(step)

        return run, kv_bytes / 2**20
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    keep = {"logits_to_keep": 1} if variant == "transformers_keep1" else {}

    def run_hf(ids):
        with torch.no_grad():
            hf(ids[None], **keep)

    return run_hf, 0.0


def memory_section(long_tokens: int, short_tokens: int) -> dict:
    from prefixflow.engine.models.model_args import read_model_args
    from prefixflow.engine.scoring.forward import forward_bytes
    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    args = read_model_args(tiny_checkpoint_cached("llama", seed=0, llama3_rope=False, **DEMO))
    rows: list[dict[str, Any]] = []
    plan = [("hybrid", short_tokens, c) for c in CHUNKS]
    plan += [(v, short_tokens, 0) for v in ("generate", "transformers", "transformers_keep1")]
    plan += [("hybrid", long_tokens, c) for c in CHUNKS]
    plan += [(v, long_tokens, 0) for v in ("generate", "transformers", "transformers_keep1")]
    for variant, n, chunk in plan:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefixflow.bench.score_bench",
                "--measure",
                variant,
                "--tokens",
                str(n),
                "--chunk",
                str(chunk),
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            rows.append(dict(variant=variant, tokens=n, error=out.stderr[-500:]))
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    for r in rows:
        if r["variant"].startswith("hybrid_c") and "peak_delta_mb" in r:
            chunk = int(r["variant"].removeprefix("hybrid_c"))
            r["predicted_mb"] = round(forward_bytes(args, 4, r["tokens"], 0, chunk) / 2**20, 1)
    ratios = {}
    for n in (short_tokens, long_tokens):
        by = {r["variant"]: r for r in rows if r["tokens"] == n and "peak_delta_mb" in r}
        for c in CHUNKS:
            for other in ("generate", "transformers", "transformers_keep1"):
                if f"hybrid_c{c}" in by and other in by:
                    ratios[f"{other}_over_hybrid_c{c}@{n}"] = round(
                        by[other]["peak_delta_mb"] / by[f"hybrid_c{c}"]["peak_delta_mb"], 2
                    )
    return dict(
        method="peak RSS delta of one forward in a fresh process (VmHWM after "
        "clear_refs=5, minus RSS before); generate adds its KV cache size",
        model=DEMO,
        rows=rows,
        ratios=ratios,
    )


def real_model_section(model: str, num_users: int, hf_requests: int) -> dict:
    """(c): the post recommendation requests, offline, on a model prefixflow.model_source resolves."""
    from prefixflow.bench.score_workload import CHOICES, _hf_rate, _summary, make_workload
    from prefixflow.engine.config import EngineConfig
    from prefixflow.model_source import resolve_model
    from prefixflow.engine.scoring.options import ScoreOptions
    from prefixflow.engine.scoring.scorer import Scorer

    path = str(resolve_model(model))
    prompts, _ = make_workload(num_users)
    scorer = Scorer(EngineConfig(model=path, device="cpu"), ScoreOptions(choice_leading_space=True))
    results = scorer.score(prompts, CHOICES)
    ours = _summary(scorer, len(prompts))
    sample = list(range(0, len(prompts), max(1, len(prompts) // hf_requests)))[:hf_requests]
    hf = _hf_rate(
        path,
        [prompts[i] for i in sample],
        results[0].choice_token_ids,
        {k: results[i].probs for k, i in enumerate(sample)},
    )
    return dict(
        model=model,
        users=num_users,
        requests=len(prompts),
        prompt_tokens=int(sum(map(len, prompts))),
        ours_offline=ours,
        transformers_sample=hf,
        requests_per_s_ratio_vs_transformers=round(ours["requests_per_s"] / hf["requests_per_s"], 2),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--short-tokens", type=int, default=4096)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--hf-requests", type=int, default=60)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--model", default=None, help="(c) only, on this model")
    a = parser.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure, a.tokens, a.chunk)))
        return
    if a.model:
        result: dict[str, Any] = {
            "load_average_at_start": os.getloadavg(),
            "real_model": real_model_section(a.model, a.users, a.hf_requests),
            "load_average_at_end": os.getloadavg(),
        }
        path = RESULTS.with_name(f"score_bench_{a.model}.json")
        path.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return
    from prefixflow.bench.score_workload import workload_section

    result = {"load_average_at_start": os.getloadavg()}
    if not a.skip_memory:
        result["memory"] = memory_section(a.tokens, a.short_tokens)
    result["post_recommendation"] = workload_section(a.users, a.hf_requests)
    result["load_average_at_end"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
