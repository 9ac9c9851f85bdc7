"""Images: what planning by the image's content buys "one image, many questions" on vLLM, beside
vLLM as a careful user feeds it (issue 40 item 4).

    python -m prefixflow.bench.image_bench [--images 12] [--questions 8] [--repeats 3]
        [--kv-blocks 24] [--out bench/results/image_bench.json]

Workload: `--images` random pictures, each asked `--questions` questions after one long system
prompt and one instruction (chat messages: system; user = [image, instruction, question]),
shuffled, rendered with the tiny vision-language checkpoint's chat template (engine/models/
tiny.py `tiny_vlm_checkpoint_cached`: Idefics3, four image tokens per picture). Rows about one
picture share the system prompt, the picture and the instruction; rows about two pictures share
only the system prompt, although their token ids are the same up to the question: the image's
placeholder token is the same token for every picture.

Systems, one replica, the same engine settings (block size, KV blocks, batch budget), greedy with
a fixed output length (ignore_eos):
- vllm_arrival: vLLM's own `LLM.generate` on the rows in arrival order;
- vllm_sorted: the rows sorted by their token ids, what a careful user does for an LRU prefix
  cache (it cannot see the pictures: questions of one text about many pictures come together);
- vllm_sorted_by_image: sorted by (picture bytes, token ids): a careful user who knows;
- prefixflow_vllm: our vLLM backend fed the plan, each picture keyed by the sha256 of its bytes
  in place of its placeholder (operators/stages/plan.plan_tokens);
- prefixflow_vllm_unkeyed: the same plan built from the token ids alone (the ablation).
Per run: prompt tokens computed (vLLM's expanded prompt tokens less those its prefix cache
served), wall seconds (engine start excluded; the pictures' decoding included for every
system), the load average; `--repeats` runs of each,
interleaved; median, min and max. Every system's answers are compared with vllm_arrival's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from typing import Any

from prefixflow.bench.record import command_line, spread, write_result

BLOCK = 32  # vLLM's CPU attention wants multiples of 32
MAX_BATCHED_TOKENS, MAX_MODEL_LEN, MAX_TOKENS = 2048, 512, 8
SYSTEMS = ("vllm_arrival", "vllm_sorted", "vllm_sorted_by_image", "prefixflow_vllm", "prefixflow_vllm_unkeyed")
SYSTEM_PROMPT = (
    "You are a careful assistant who describes pictures for a catalogue. Look at the whole picture, "
    "name what it shows, its colours and its layout, and answer the question in a few words only."
)
INSTRUCTION = "Answer from the picture alone; if the picture does not show it, say so plainly."
QUESTIONS = (
    "What is it?",
    "Which colours?",
    "Is it bright?",
    "How many shapes?",
    "Where is the centre?",
    "Is it a photo?",
    "What is on the left?",
    "Give it a title.",
    "Is there text?",
    "What mood?",
)


def workload(model: str, images: int, questions: int, seed: int = 0) -> list[dict[str, Any]]:
    """Shuffled rows {picture, tokens, png}: the tokenize stage's columns for each question."""
    import pyarrow as pa

    from prefixflow.engine.models.tiny import png_image
    from prefixflow.operators.config import ProcessorConfig
    from prefixflow.operators.stages.tokenize import Tokenize

    pngs = [png_image(seed * 1000 + k) for k in range(images)]
    rows: list[dict[str, Any]] = [
        {"picture": k, "q": q, "messages": json.dumps(_messages(pngs[k], QUESTIONS[q % len(QUESTIONS)]))}
        for k in range(images)
        for q in range(questions)
    ]
    random.Random(seed).shuffle(rows)
    config = ProcessorConfig(model=model, prompt={"messages_column": "messages"}, engine={"backend": "vllm"})
    table = Tokenize(config.tokenize_options())(pa.Table.from_pylist([{**r, "_pf_error": None} for r in rows]))
    errors = [e for e in table.column("_pf_error").to_pylist() if e is not None]
    assert not errors, errors[:1]
    columns = zip(*(table.column(c).to_pylist() for c in ("_pf_tokens", "_pf_image_at", "_pf_image_keys")))
    return [
        {**r, "tokens": t, "at": at, "keys": keys, "png": pngs[r["picture"]]} for r, (t, at, keys) in zip(rows, columns)
    ]


def _messages(png: bytes, question: str) -> list[dict[str, Any]]:
    import base64

    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": f"{INSTRUCTION} {question}"}]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]


def plans(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The plan keyed by picture (as a job plans it) and the plan of the token ids alone."""
    import pyarrow as pa

    from prefixflow.operators.stages.plan import plan_tokens
    from prefixflow.pipeline import HashedPrompts, build_plan

    table = pa.table(
        {
            "_pf_tokens": pa.array([r["tokens"] for r in rows], pa.list_(pa.int32())),
            "_pf_image_at": pa.array([r["at"] for r in rows], pa.list_(pa.int32())),
            "_pf_image_keys": pa.array([r["keys"] for r in rows], pa.list_(pa.int64())),
        }
    )
    ids = list(range(len(rows)))
    keyed = HashedPrompts.from_tokens(table.column("_pf_tokens"), BLOCK, keyed=plan_tokens(table))
    return {
        "prefixflow_vllm": build_plan(keyed, row_ids=ids, order="batchllm", min_prefix_len=BLOCK),
        "prefixflow_vllm_unkeyed": build_plan(
            [r["tokens"] for r in rows], row_ids=ids, order="batchllm", min_prefix_len=BLOCK
        ),
    }


def run_peer(llm: Any, rows: list[dict[str, Any]], order: list[int]) -> dict[str, Any]:
    """vLLM's LLM.generate on the rows in `order`: seconds, computed tokens, answers by row."""
    from vllm import SamplingParams

    from prefixflow.images import decode_image

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()  # the pictures decoded inside the clock, as our backend decodes them
    prompts = [
        {"prompt_token_ids": rows[i]["tokens"], "multi_modal_data": {"image": [decode_image(rows[i]["png"])]}}
        for i in order
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "cached_tokens": sum(int(o.num_cached_tokens or 0) for o in outs),
        "answers": {i: list(o.outputs[0].token_ids) for i, o in zip(order, outs)},
    }


def run_ours(engine: Any, rows: list[dict[str, Any]], plan: Any) -> dict[str, Any]:
    """Our vLLM backend on the plan's groups, each row's picture in its SamplingParams."""
    from prefixflow.requests import SamplingParams

    engine.reset_prefix_cache()
    base = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = {i: SamplingParams(**{**_fields(base), "images": (r["png"],)}) for i, r in enumerate(rows)}
    start = time.perf_counter()
    outs = list(engine.run(plan.groups(0), params))
    seconds = time.perf_counter() - start
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:1]
    return {
        "seconds": seconds,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "answers": {o.row_id: list(o.token_ids) for o in outs},
    }


def _fields(params: Any) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(params, f.name) for f in fields(params)}


def engines(model: str, blocks: int) -> dict[str, Any]:
    """vLLM's own LLM (the peer) and our vLLM backend, with one block size, KV cache and batch
    budget (the language model's KV: ModelArgs of its text_config)."""
    from vllm import LLM

    from prefixflow.engine import EngineConfig
    from prefixflow.engine.models.model_args import read_model_args
    from prefixflow.engine.vllm_backend.engine import VllmEngine

    kv_bytes = blocks * BLOCK * read_model_args(model, vision=True).kv_bytes_per_token_per_elem * 4
    config = EngineConfig(
        model=model,
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        kv_cache_bytes=kv_bytes,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
    )
    ours = VllmEngine(config, {"enforce_eager": True})
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    return {"peer": llm, "ours": ours}


def run_all(rows: list[dict[str, Any]], planned: dict[str, Any], built: dict[str, Any], repeats: int) -> dict:
    """Every system `repeats` times, interleaved (module docstring)."""
    arrival = list(range(len(rows)))
    orders = {
        "vllm_arrival": arrival,
        "vllm_sorted": sorted(arrival, key=lambda i: rows[i]["tokens"]),
        "vllm_sorted_by_image": sorted(
            arrival, key=lambda i: (hashlib.sha256(rows[i]["png"]).digest(), rows[i]["tokens"])
        ),
    }
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    expanded = 0
    for rep in range(repeats):
        for system in SYSTEMS:
            load = os.getloadavg()[0]
            if system in orders:
                got = run_peer(built["peer"], rows, orders[system])
                expanded = got["prompt_tokens"]
            else:
                got = run_ours(built["ours"], rows, planned[system])
            got["computed_tokens"] = expanded - got["cached_tokens"]  # vLLM's expanded prompts
            got["load_avg"] = load
            runs[system].append(got)
            print(f"repeat {rep} {system}: {got['seconds']:.2f} s, computed {got['computed_tokens']} of {expanded}")
    return runs


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    reference = runs["vllm_arrival"][0]["answers"]
    out = {}
    for system, rs in runs.items():
        out[system] = {
            **spread([r["seconds"] for r in rs]),
            "computed_tokens": [r["computed_tokens"] for r in rs],
            "load_avg": [round(r["load_avg"], 2) for r in rs],
            "answers_equal_arrival": all(r["answers"] == reference for r in rs),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=12)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-blocks", type=int, default=24, help="vLLM's KV blocks (a cache too small for the whole job)")
    p.add_argument("--out", default="bench/results/image_bench.json")
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as our backend runs it
    import torch

    from prefixflow.engine.models.tiny import tiny_vlm_checkpoint_cached

    torch.set_num_threads(2)
    model = str(tiny_vlm_checkpoint_cached())
    rows = workload(model, args.images, args.questions)
    planned = plans(rows)
    runs = run_all(rows, planned, engines(model, args.kv_blocks), args.repeats)
    result = {
        "command": command_line("image_bench", args),
        "model": "tiny Idefics3 (engine/models/tiny.py tiny_vlm_checkpoint_cached)",
        "rows": len(rows),
        "kv_blocks": args.kv_blocks,
        "block_size": BLOCK,
        "plan_computed_prompt_tokens": {k: int(v.summary["computed_prompt_tokens"]) for k, v in planned.items()},
        "systems": summary(runs),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
