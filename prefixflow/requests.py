"""Small typed objects the layers exchange: sampling parameters and prefix-sharing groups.

Pure Python + numpy: the planner, the scheduler and the job spec import this without torch.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from prefixflow.errors import InvalidSetting, invalid, require


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's output. Defaults follow vLLM's, except `max_tokens`.

    temperature: 0 means greedy; otherwise logits are divided by it, and it must be at least
        MIN_TEMPERATURE (vLLM raises smaller ones to that floor; in float32 a much smaller one
        overflows the logits and yields token 0 over and over), so both backends agree.
    top_k: keep the k most likely tokens (at most the vocabulary); 0 or -1 disables.
    top_p: keep the smallest set whose probability reaches p; 1.0 disables.
    seed: per-request seed in [0, 2**63-1]; the same seed gives the same tokens whatever the batch.
    max_tokens: most tokens to generate (the finish reason is then "length").
    min_tokens: EOS and stop token ids are ignored until this many tokens exist.
    stop: strings that end generation when they appear in the text (excluded from the text).
    stop_token_ids: token ids that end generation (besides EOS unless `ignore_eos`).
    ignore_eos: keep generating past EOS (benchmarks).
    logprobs: number of top log-probabilities to return per token (None: none; 0: only the
        sampled token's log-probability).
    n: samples per prompt; the row keeps sample 0 and lists all in `samples`. A seeded
        request's sample i uses seed + i (as vLLM), so each is reproducible and they differ.
        A greedy request (temperature 0) runs once and lists its answer n times (as OpenAI).
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logits of tokens the
        output already has: once (presence) and per occurrence (frequency). 0 disables.
    repetition_penalty: > 0; logits of tokens in the prompt or the output are divided by it
        when positive, multiplied when negative. 1 disables.
    min_p: in [0, 1]; drop tokens less likely than min_p times the most likely one. 0 disables.
    include_stop_str_in_output: keep the matched stop string (or final EOS / stop token) in
        the text.
    skip_special_tokens: leave special tokens out of the text.
    detokenize: False returns no text (token ids only); stop strings then cannot work.
    structured_outputs: None, or a mapping with exactly one of vLLM's StructuredOutputsParams
        keys: json (a JSON schema object or its text), json_object (true), regex, choice (a
        list of strings), grammar. vLLM backend only.
    lora_adapter: the LoRA adapter this row runs with (prefixflow/lora.py; None: the base
        model). Not a sampling parameter: the row's `model` column sets it (the tokenize stage
        checks it names one of the job's adapters), never a `sampling` section or override. It
        lives here because it is per row like these and travels with them to the engine.
    images: the row's images (encoded bytes, in prompt order; prefixflow/images.py), set like
        lora_adapter by the tokenize stage, never by sampling settings; vLLM backend only.
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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: dict[str, Any] | None = None
    lora_adapter: str | None = None
    images: tuple[bytes, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        # Types are checked here, the one place every source (spec, rows, OpenAI bodies, Python)
        # goes through: a wrong type would otherwise pass the range checks and fail the engine
        # later, taking the whole replica down. Integral floats (5.0) are accepted as ints.
        # Upper bounds keep values inside the int32/int64 the engine and Arrow store them in.
        _set(self, "temperature", _real("temperature", self.temperature, "use 0 for greedy or a positive value"))
        _set(self, "top_p", _real("top_p", self.top_p, "use a value in (0, 1]"))
        _set(self, "top_k", _integer("top_k", self.top_k, -1, INT32_MAX, "use -1 or 0 to disable, or a positive k"))
        _set(self, "max_tokens", _integer("max_tokens", self.max_tokens, 1, INT32_MAX, "ask for at least one token"))
        _set(
            self,
            "min_tokens",
            _integer("min_tokens", self.min_tokens, 0, INT32_MAX, "use a value between 0 and max_tokens"),
        )
        if self.seed is not None:
            _set(self, "seed", _integer("seed", self.seed, 0, INT64_MAX, "use None or a non-negative integer"))
        if self.logprobs is not None:
            _set(self, "logprobs", _integer("logprobs", self.logprobs, 0, 20, "use None for no log-probabilities"))
        _set(self, "stop", _stop_strings(self.stop))
        _set(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            _check(isinstance(getattr(self, flag), bool), flag, getattr(self, flag), "use true or false")
        self._check_vllm_fields()
        _check(self.temperature >= 0, "temperature", self.temperature, "use 0 for greedy or a positive value")
        _check(
            self.temperature == 0 or self.temperature >= MIN_TEMPERATURE,
            "temperature",
            self.temperature,
            f"use 0 for greedy decoding or at least {MIN_TEMPERATURE}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "use a value in (0, 1]")
        _check(
            self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, "use a value between 0 and max_tokens"
        )

    def _check_vllm_fields(self) -> None:
        """The fields vLLM's SamplingParams has and ours gained (issue 15), vLLM's ranges."""
        _set(self, "n", _integer("n", self.n, 1, MAX_N, f"ask for 1 to {MAX_N} samples per prompt"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), "use a value in [-2, 2]; 0 disables")
            _check(-2.0 <= value <= 2.0, name, value, "use a value in [-2, 2]; 0 disables")
            _set(self, name, value)
        fix = "use a value above 0; 1 disables"
        _set(self, "repetition_penalty", _real("repetition_penalty", self.repetition_penalty, fix))
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, fix)
        _set(self, "min_p", _real("min_p", self.min_p, "use a value in [0, 1]; 0 disables"))
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "use a value in [0, 1]; 0 disables")
        _check(
            self.detokenize or not self.stop,
            "detokenize",
            self.detokenize,
            "stop strings need the text: keep detokenize true, or use stop_token_ids",
        )
        if self.structured_outputs is not None:
            _set(self, "structured_outputs", _structured(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def asked_once(self) -> tuple["SamplingParams", int]:
        """(the parameters to ask an engine, copies of its answer): a greedy request asking
        n > 1 samples is asked once and its answer copied n times (n greedy samples are one
        answer; vLLM refuses greedy n > 1); any other is asked as it is, once."""
        if self.n > 1 and self.greedy:
            return self.sample_params(0), self.n
        return self, 1

    def sample_params(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` of n: one sample, seed + index when seeded."""
        seed = None if self.seed is None else (self.seed + index) % (INT64_MAX + 1)
        return replace(self, n=1, seed=seed)

    def with_overrides(self, overrides: Any) -> "SamplingParams":
        """These parameters with a row's (or request body's) overrides applied; null values
        keep the default. ValueError naming the unknown key or the bad value."""
        if not isinstance(overrides, Mapping):
            raise ValueError(
                f"sampling parameters must be a mapping of field -> value, got "
                f'{type(overrides).__name__}: e.g. {{"temperature": 0, "max_tokens": 16}}'
            )
        allowed = [f.name for f in fields(self) if f.name not in NOT_OVERRIDDEN]
        values = {str(k): v for k, v in overrides.items() if v is not None}
        unknown = [k for k in values if k not in allowed]
        if unknown:
            raise ValueError(f"unknown sampling parameter {unknown[0]!r}: use keys among {', '.join(allowed)}")
        return replace(self, **values) if values else self


# Fields a row's or a spec's sampling settings never set (a row's `model` column sets lora_adapter,
# its messages' image parts the images).
NOT_OVERRIDDEN = ("lora_adapter", "images")
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
MAX_N = 1024
# vLLM's SamplingParams raises 0 < temperature < 1e-2 to 1e-2 (its _MAX_TEMP, "may cause
# numerical errors nan or inf"); refusing those values keeps one behaviour on both backends.
MIN_TEMPERATURE = 1e-2
# vLLM's StructuredOutputsParams keys (one per request) and what each needs.
STRUCTURED_KINDS = {
    "json": "a JSON schema object or its JSON text",
    "json_object": "true",
    "regex": "a non-empty regular expression string",
    "choice": "a non-empty list of non-empty strings",
    "grammar": "a non-empty grammar string (EBNF / Lark / GBNF)",
}


# The engines' `params` argument: one SamplingParams for all rows, or row_id -> SamplingParams.
Params = SamplingParams | Mapping[int, SamplingParams]


def params_for_row(params: Params, row_id: int) -> SamplingParams:
    """A row's SamplingParams from one for all rows, or a row_id -> SamplingParams mapping
    (the engines' `params` argument). ValueError when the mapping has no entry for the row."""
    if isinstance(params, SamplingParams):
        return params
    try:
        return params[row_id]
    except KeyError:
        raise ValueError(
            f"params has no SamplingParams for row_id={row_id}: give one for every row, "
            "or a single SamplingParams for all"
        ) from None


def _set(params: SamplingParams, name: str, value: object) -> None:
    object.__setattr__(params, name, value)  # normalising a frozen dataclass's own field


def _real(name: str, value: object, fix: str) -> float:
    number = None
    # numbers.Real takes numpy scalars too; a bool is a number to Python, never to a user.
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            pass
    if number is None or not math.isfinite(number):
        raise _invalid(name, value, f"a finite number is needed; {fix}")
    return number


def _integer(name: str, value: object, lo: int, hi: int, fix: str) -> int:
    number: int | None = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        number = int(math.trunc(value))  # 5.0 from JSON or YAML; int() of a Real truncates
    if number is None or not lo <= number <= hi:
        raise _invalid(name, value, f"an integer in [{lo}, {hi}] is needed; {fix}")
    return number


def _stop_strings(stop: object) -> tuple[str, ...]:
    # Accept lists from YAML/JSON but store tuples so the object stays hashable.
    stop = (stop,) if isinstance(stop, str) else stop
    if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)):
        raise _invalid("stop", stop, "use a non-empty string or a list of non-empty strings")
    return tuple(stop)


def _token_ids(ids: object) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple, np.ndarray)):
        raise _invalid("stop_token_ids", ids, "use a list of token ids")
    return tuple(_integer("stop_token_ids", t, 0, INT32_MAX, "use token ids of the model's vocabulary") for t in ids)


class FrozenDict(dict):
    """A read-only dict that hashes (SamplingParams stays hashable, and JSON-serialisable)."""

    def __hash__(self) -> int:  # type: ignore[override]  # dict's stubs make it unhashable: this one hashes
        return hash(json.dumps(self, sort_keys=True, default=str))

    def _read_only(self, *args: object, **kwargs: object) -> None:
        raise TypeError("SamplingParams.structured_outputs is read-only: use with_overrides")

    __setitem__ = __delitem__ = update = pop = clear = setdefault = _read_only
    popitem = _read_only  # type: ignore[assignment]  # stubs: () -> (key, value); this one only raises


def _structured(value: object) -> FrozenDict:
    """structured_outputs: exactly one known key with a value of the right type."""
    name, kinds = "structured_outputs", ", ".join(STRUCTURED_KINDS)
    if not isinstance(value, Mapping):
        raise _invalid(name, value, f"give a mapping with one key among {kinds}")
    keys = [str(k) for k, v in value.items() if v is not None]
    _check(len(keys) == 1 and keys[0] in STRUCTURED_KINDS, name, value, f"give exactly one key among {kinds}")
    kind, spec = keys[0], value[keys[0]]
    fix = f"{name}.{kind} needs {STRUCTURED_KINDS[kind]}"
    if kind == "json":
        schema = spec
        if isinstance(spec, str):
            try:
                schema = json.loads(spec)
            except ValueError:
                schema = None
        _check(isinstance(schema, Mapping), f"{name}.json", spec, fix)
        spec = FrozenDict(schema) if not isinstance(spec, str) else spec
    elif kind == "json_object":
        _check(spec is True, f"{name}.json_object", spec, fix)
    elif kind == "choice":
        ok = isinstance(spec, (list, tuple)) and len(spec) > 0 and all(isinstance(c, str) and c for c in spec)
        _check(ok, f"{name}.choice", spec, fix)
        spec = tuple(spec)
    else:
        _check(isinstance(spec, str) and bool(spec.strip()), f"{name}.{kind}", spec, fix)
    return FrozenDict({kind: spec})


def _check(ok: bool, name: str, value: object, fix: str) -> None:
    require(ok, "SamplingParams", name, value, fix)


def _invalid(name: str, value: object, fix: str) -> InvalidSetting:
    """The error `_check` raises (for a check that also narrows the value's type)."""
    return invalid("SamplingParams", name, value, fix)


@dataclass(frozen=True, slots=True, eq=False)
class PrefixGroup:
    """Requests that share one prefix, scheduled together (BatchLLM Sec. 3.3.1).

    The shared prefix's KV is computed once, referenced by every member, and freed when the
    last member finishes. Members are listed in the order the plan wants them run. A group of
    one has an empty prefix (its whole prompt is its distinct part), except a piece of a larger
    run that a plan unit boundary cut (pipeline/plan.py Plan.units), which keeps the run's.

    Token arrays are numpy views into the planner's flat token buffer (no copies).
    """

    group_id: int
    prefix: np.ndarray  # [prefix_len] shared prompt tokens
    row_ids: np.ndarray  # [num_members] int64 row ids, in run order
    distinct: tuple[np.ndarray, ...]  # per member: prompt tokens after the prefix
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
        return (
            f"PrefixGroup(id={self.group_id}, prefix_len={self.prefix_len}, "
            f"members={self.num_members}, replica={self.replica})"
        )
