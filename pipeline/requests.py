"""Small typed objects the layers exchange: sampling parameters and prefix-sharing groups.

Pure Python + numpy: the planner, the scheduler and the job spec import this without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's output. Defaults follow vLLM's, except `max_tokens`.

    temperature: 0 means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 or -1 disables.
    top_p: keep the smallest set whose probability reaches p; 1.0 disables.
    seed: per-request seed; the same seed gives the same tokens whatever the batch.
    max_tokens: most tokens to generate (the finish reason is then "length").
    min_tokens: EOS and stop token ids are ignored until this many tokens exist.
    stop: strings that end generation when they appear in the text (excluded from the text).
    stop_token_ids: token ids that end generation (besides EOS unless `ignore_eos`).
    ignore_eos: keep generating past EOS (benchmarks).
    logprobs: number of top log-probabilities to return per token (None: none; 0: only the
        sampled token's log-probability).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 64
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from YAML/JSON but store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(self.temperature >= 0, "temperature", self.temperature, "use 0 for greedy or a positive value")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "use -1 or 0 to disable, or a positive k")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "use a value in (0, 1]")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "ask for at least one token")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               "use a value between 0 and max_tokens")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
               "use None or an integer in [0, 20]")
        _check(all(s for s in self.stop), "stop", self.stop, "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, name: str, value: object, fix: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {fix}")


@dataclass(frozen=True, slots=True, eq=False)
class PrefixGroup:
    """Requests that share one prefix, scheduled together (BatchLLM Sec. 3.3.1).

    The shared prefix's KV is computed once, referenced by every member, and freed when the
    last member finishes. Members are listed in the order the plan wants them run. A group of
    one has an empty prefix: its whole prompt is its distinct part.

    Token arrays are numpy views into the planner's flat token buffer (no copies).
    """

    group_id: int
    prefix: np.ndarray                     # [prefix_len] shared prompt tokens
    row_ids: np.ndarray                    # [num_members] int64 row ids, in run order
    distinct: tuple[np.ndarray, ...]       # per member: prompt tokens after the prefix
    output_lens: np.ndarray | None = None  # [num_members] expected output lengths, if known
    replica: int = 0

    @property
    def prefix_len(self) -> int:
        return int(len(self.prefix))

    @property
    def num_members(self) -> int:
        return int(len(self.row_ids))

    def prompt(self, i: int) -> np.ndarray:
        """The full prompt of member i (a copy: prefix + distinct)."""
        return np.concatenate([self.prefix, self.distinct[i]])

    def prompt_tokens(self) -> int:
        return self.prefix_len * self.num_members + sum(len(d) for d in self.distinct)

    def computed_tokens(self) -> int:
        """Prompt tokens the engine computes when the prefix is shared: prefix once + distinct."""
        return self.prefix_len + sum(len(d) for d in self.distinct)

    def __repr__(self) -> str:
        return (f"PrefixGroup(id={self.group_id}, prefix_len={self.prefix_len}, "
                f"members={self.num_members}, replica={self.replica})")

