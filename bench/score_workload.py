"""Part (b) of score_bench: PrefillOnly's post recommendation workload (Table 1), scaled to CPU.

Prompt of request (user u, post j): header (shared by all) + profile_u + question + post_j +
answer cue, scored with choices " positive" / " negative". See score_bench.py's docstring.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

POSTS_PER_USER = 50
CHOICES = ["positive", "negative"]
LOADS = (2.0, 4.0)  # user arrival rate / the rate the scorer serves users (full reuse)
TOKENS_PER_S = 10_000.0  # virtual clock of the online study
LAM = 20.0  # starvation weight (tokens per second queued), scaled down from the paper's 500
# by the CPU's ~100x slower requests


def make_workload(num_users: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and the user of each, users in turn, posts in order."""
    rng = np.random.default_rng(seed)

    def tok(n: int) -> list[int]:
        return rng.integers(10, 700, n).tolist()

    header, question, cue = tok(20), tok(12), tok(4)
    prompts: list[list[int]] = []
    users: list[int] = []
    for u in range(num_users):
        profile = tok(int(np.clip(rng.normal(1400, 300), 800, 1900)))
        for _ in range(POSTS_PER_USER):
            prompts.append(header + profile + question + tok(int(rng.integers(10, 21))) + cue)
            users.append(u)
    return prompts, users


def _hf_rate(
    path: str, prompts: list[list[int]], choice_ids: tuple[int, ...], ours: dict[int, tuple[float, ...]]
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    idx = torch.tensor(choice_ids)
    worst = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            probs = torch.softmax(logits[idx], -1).tolist()
            worst = max(worst, max(abs(a - b) for a, b in zip(probs, ours[i])))
    seconds = time.perf_counter() - t0
    return dict(
        requests=len(prompts),
        seconds=round(seconds, 2),
        requests_per_s=round(len(prompts) / seconds, 2),
        max_abs_prob_diff=worst,
    )


def _keep_best(best: dict, name: str, result: dict) -> None:
    if name not in best or result["seconds"] < best[name]["seconds"]:
        best[name] = result


def _summary(scorer, n: int) -> dict:
    st = scorer.score_stats
    lat = np.array(list(st.latency_s.values())) if st.latency_s else np.zeros(1)
    return dict(
        requests=n,
        seconds=round(st.wall_time_s, 2),
        requests_per_s=round(n / st.wall_time_s, 2),
        prefix_hits=st.num_prefix_hits,
        prefix_misses=st.num_prefix_misses,
        evictions=st.num_evictions,
        computed_tokens=st.num_computed_tokens,
        prompt_tokens=st.num_prompt_tokens,
        mean_latency_s=round(float(lat.mean()), 3),
        p99_latency_s=round(float(np.percentile(lat, 99)), 3),
    )


def workload_section(num_users: int, hf_requests: int) -> dict:
    from prefixflow.engine.config import EngineConfig
    from prefixflow.engine.scoring.options import ScoreOptions
    from prefixflow.engine.scoring.scorer import Scorer
    from prefixflow.engine.models.tiny import tiny_checkpoint_cached

    path = str(tiny_checkpoint_cached("llama", seed=0))
    prompts, users = make_workload(num_users)
    n = len(prompts)
    cfg = EngineConfig(model=path, device="cpu")

    def make(**o: Any) -> Scorer:
        return Scorer(cfg, ScoreOptions(choice_leading_space=True, **o))

    out: dict = dict(
        users=num_users,
        requests=n,
        posts_per_user=POSTS_PER_USER,
        prompt_tokens=int(sum(map(len, prompts))),
        model="tiny llama (engine/models/tiny.py)",
    )

    rng = np.random.default_rng(1)
    sample = sorted(rng.choice(n, size=min(hf_requests, n), replace=False).tolist())
    best: dict = {}
    for _ in range(2):  # best of two, alternating: the machine is shared
        s = make()
        results = s.score(prompts, CHOICES)
        _keep_best(best, "ours_offline_srjf_calibrated", _summary(s, n))
        alone = make(prefix_cache_bytes=0)
        alone.score([prompts[i] for i in sample], CHOICES)
        _keep_best(best, "ours_sample_no_prefix_reuse", _summary(alone, len(sample)))
        _keep_best(
            best,
            "transformers_sample",
            _hf_rate(
                path,
                [prompts[i] for i in sample],
                results[0].choice_token_ids,
                {k: results[i].probs for k, i in enumerate(sample)},
            ),
        )
    out.update(best)
    hf_rate = best["transformers_sample"]["requests_per_s"]
    out["requests_per_s_ratio_vs_transformers"] = round(
        best["ours_offline_srjf_calibrated"]["requests_per_s"] / hf_rate, 2
    )
    out["requests_per_s_ratio_vs_transformers_without_prefix_reuse"] = round(
        best["ours_sample_no_prefix_reuse"]["requests_per_s"] / hf_rate, 2
    )
    out["online"] = [_online(make, prompts, users, out["ours_offline_srjf_calibrated"], load) for load in LOADS]
    return out


def _online(make, prompts, users, offline: dict, load: float) -> dict:
    """Poisson user arrivals at `load` x the rate the scorer serves users with full prefix reuse,
    on the scorer's virtual clock (TOKENS_PER_S computed tokens per virtual second), so that
    the order, the hits and the latencies do not depend on the machine's load; a prefix cache
    of ~1.5 profiles."""
    from prefixflow.pipeline import build_plan

    rng = np.random.default_rng(2)
    num_users = max(users) + 1
    per_user_s = offline["computed_tokens"] / num_users / TOKENS_PER_S
    gap = per_user_s / load
    user_arrival = np.cumsum(rng.exponential(gap, num_users)) - gap
    arrivals = {i: float(max(0.0, user_arrival[u])) for i, u in enumerate(users)}
    groups = build_plan(prompts, order="fcfs").groups(0)
    a = make().args
    mean_prefix = float(np.mean([g.prefix_len for g in groups]))
    cap = int(1.5 * mean_prefix * 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4)
    out = dict(
        clock="virtual: computed tokens / tokens_per_s",
        tokens_per_s=TOKENS_PER_S,
        user_mean_gap_s=round(gap, 3),
        load=load,
        prefix_cache_bytes=cap,
        lam=LAM,
    )
    for name, opts in (
        ("fcfs", dict(policy="fcfs")),
        ("srjf_plain", dict(policy="srjf", calibrate=False)),
        ("srjf_calibrated", dict(policy="srjf", calibrate=True)),
    ):
        s = make(prefix_cache_bytes=cap, lam=LAM, **opts)
        for _ in s.score_groups(groups, CHOICES, arrivals=arrivals, tokens_per_s=TOKENS_PER_S):
            pass
        out[name] = _summary(s, len(prompts))
        last = max(arrivals[r] + lat for r, lat in s.score_stats.latency_s.items())
        out[name]["virtual_seconds"] = round(last, 3)
        out[name]["virtual_requests_per_s"] = round(len(prompts) / last, 2)
        print(load, name, out[name], flush=True)
    return out
