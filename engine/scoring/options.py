"""ScoreOptions: the score task's settings (torch-free, so job specs validate without torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from prefixflow.errors import invalid

ScorePolicy = Literal["srjf", "fcfs"]
SCORE_POLICIES: tuple[str, ...] = get_args(ScorePolicy)


@dataclass(frozen=True, slots=True)
class ScoreOptions:
    """chunk_size: tokens per chunk of the non-attention layers (hybrid prefilling, Sec. 4).
    prefix_cache_bytes: budget of the group prefix KVs kept at once; None: the EngineConfig's
        kv_cache_bytes, else 1 GiB. 0 disables sharing across members (each recomputes).
    max_forward_bytes: memory budget of one forward (activations, one layer's KV, the group's
        prefix KV; `forward_bytes`); longer rows get an error. None: only max_model_len.
    choice_leading_space: encode string choices with a leading space (scoring/choices.py).
    add_special_tokens: string prompts get the tokenizer's BOS, as in LLMEngine.generate.
    policy: "srjf" (Alg. 1) or "fcfs" (plan / arrival order). calibrate: recompute the cached
        length before every pick (False: plain SRJF, cached length taken at arrival).
    lam: starvation term, score reduction per second queued (the paper's lambda = 500).
    max_packed_tokens: the waiting requests that share a picked request's prefix (its group's
        members, or requests with none) run with it in one packed forward (Prepacking), up to
        this many tokens of their own; 1: one request per forward, as PrefillOnly runs them
        (on a GPU a long prompt fills it alone; on a CPU a short one leaves the matmuls small).
    """

    chunk_size: int = 512
    prefix_cache_bytes: int | None = None
    max_forward_bytes: int | None = None
    choice_leading_space: bool = False
    add_special_tokens: bool = True
    policy: ScorePolicy = "srjf"
    calibrate: bool = True
    lam: float = 500.0
    max_packed_tokens: int = 512

    def __post_init__(self) -> None:
        for name, ok, fix in (
            ("chunk_size", self.chunk_size >= 1, "use a positive token count"),
            (
                "prefix_cache_bytes",
                self.prefix_cache_bytes is None or self.prefix_cache_bytes >= 0,
                "use None, 0 or a byte budget",
            ),
            (
                "max_forward_bytes",
                self.max_forward_bytes is None or self.max_forward_bytes > 0,
                "use None or a positive byte budget",
            ),
            ("policy", self.policy in SCORE_POLICIES, f"use one of {', '.join(map(repr, SCORE_POLICIES))}"),
            ("lam", self.lam >= 0, "use 0 or a positive weight"),
            ("max_packed_tokens", self.max_packed_tokens >= 1, "use a positive token count (1: no packing)"),
        ):
            if not ok:
                raise invalid("ScoreOptions", name, getattr(self, name), fix)
