"""bench/step_profile.py's arithmetic and its split of a profile, on the demo's tiny checkpoint."""

from __future__ import annotations

import random

from safetensors import safe_open

MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_weights_per_token_are_the_checkpoints_matmul_weights(tiny_model):
    from prefixflow.bench.step_profile import weights_per_token

    sizes: dict[str, int] = {}
    for f in tiny_model.glob("*.safetensors"):
        with safe_open(str(f), "numpy") as st:
            sizes.update((name, st.get_tensor(name).size) for name in st.keys())
    matmuls = sum(n for name, n in sizes.items() if name.endswith(".weight") and any(m in name for m in MATMULS))
    # The lm_head, or the embedding when the checkpoint ties them.
    lm_head = sizes.get("lm_head.weight", sizes["model.embed_tokens.weight"])
    assert matmuls > 0
    assert weights_per_token(str(tiny_model)) == matmuls + lm_head


def test_a_profile_splits_into_matmul_attention_and_the_rest(tiny_model):
    """A real native engine run under torch's profiler: the linears land in matmul, the wrapped
    parts in their own rows, nothing twice (every share is within the profiled wall)."""
    import torch
    from torch.profiler import ProfilerActivity

    from prefixflow.bench import native_profile, peer_bench as pb
    from prefixflow.bench.step_profile import CATEGORIES, _categories
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.native.llm_engine import LLMEngine

    native_profile._instrument()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(40)] for _ in range(4)]
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", kv_cache_bytes=4 << 20))
    load = pb.Workload("t", prompts, 4)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        pb.run_engine(engine, load, "plan")
    cats = _categories(prof)
    assert set(cats) == set(CATEGORIES) - {"python"}
    assert cats["matmul"] > 0 and cats["attention"] > 0 and cats["sample"] > 0 and cats["host"] > 0
    assert sum(cats.values()) < sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6 * 1.01
