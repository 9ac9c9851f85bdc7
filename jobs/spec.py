"""JobSpec: the YAML job file, one pydantic model parsed once at the edge.

Unknown keys and bad values fail before anything starts, with the field path and a fix:

    prefixflow validate job.yaml
    job.yaml: 2 problems
      input.pathh: unknown key; did you mean 'path'? (allowed: path, format, limit)
      sampling.temperature: -1.0 is invalid: use 0 for greedy or a positive value

The engine, sampling and storage sections mirror `EngineConfig`, `SamplingParams` and
`StorageOptions` field for field (generated from their dataclasses, so they cannot drift apart). YAML is read with safe_load.
"""

from __future__ import annotations

import dataclasses
import re
import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from prefixflow.engine.config import EngineConfig
from prefixflow.operators.storage import StorageOptions
from prefixflow.pipeline.requests import SamplingParams

ORDERS = ("fcfs", "dfs", "batchllm", "blendserve")


class SpecError(ValueError):
    """A job spec is invalid. `problems` lists (field path, message) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}"]
        lines += [f"  {path}: {msg}" if path else f"  {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _mirror(cls: type, name: str, skip: tuple[str, ...] = ()) -> type[BaseModel]:
    """A strict pydantic model with the fields, types and defaults of a frozen dataclass."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        fields[f.name] = (hints[f.name], f.default)

    def check(self: BaseModel) -> BaseModel:
        cls(**_plain(self), **({"model": "."} if "model" in skip else {}))  # its own checks
        return self

    return create_model(name, __base__=_Strict, __validators__={
        "_check": model_validator(mode="after")(check)}, **fields)


def _plain(model: BaseModel) -> dict[str, Any]:
    return {k: getattr(model, k) for k in type(model).model_fields}


EngineSpec = _mirror(EngineConfig, "EngineSpec", skip=("model",))
SamplingSpec = _mirror(SamplingParams, "SamplingSpec")


# Object storage settings; anything left out comes from the AWS environment variables.
StorageSpec = _mirror(StorageOptions, "StorageSpec")


class InputSpec(_Strict):
    path: str | list[str] = Field(description="file, directory, glob or list; local or s3://")
    format: Literal["auto", "jsonl", "csv", "parquet", "openai"] = "auto"
    limit: int | None = Field(default=None, ge=1, description="read only the first N rows")


class PromptSpec(_Strict):
    """How a row becomes a prompt: exactly one of template, user or messages_column.

    template: a plain prompt over the row's columns ("Q: {{ question }}"); BOS is added.
    system, user: chat messages built from the columns, rendered by the model's chat template.
    messages_column: a column holding chat messages ([{role, content}, ...]).
    Templates are Jinja, rendered in a sandbox; a missing column makes that row an error record.
    """

    template: str | None = None
    system: str | None = None
    user: str | None = None
    messages_column: str | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_kind(self) -> "PromptSpec":
        kinds = [k for k in ("template", "user", "messages_column") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of template, user (with optional system) or "
                             f"messages_column; got {kinds or 'none'}")
        if self.system is not None and self.user is None:
            raise ValueError("system needs user: a chat prompt has a user message")
        from prefixflow.operators.template import check_syntax

        for name in ("template", "system", "user"):
            check_syntax(name, getattr(self, name))
        return self


class ScoreSpec(_Strict):
    """task: score (PrefillOnly): one probability per allowed answer. See operators/score.py."""

    choices: list[str | int] | None = Field(default=None, description="labels every row is "
                                            "scored on, e.g. [\"Yes\", \"No\"]")
    choices_column: str | None = Field(default=None, description="a list column with each row's labels")
    choice_leading_space: bool = False
    chunk_size: int = Field(default=512, ge=1, description="tokens per chunk of hybrid prefilling")
    max_forward_bytes: int | None = Field(default=None, gt=0, description="memory budget of one "
                                          "forward; longer rows become error records")
    prefix_cache_bytes: int | None = Field(default=None, ge=0)
    policy: Literal["srjf", "fcfs"] = "srjf"
    calibrate: bool = True
    lam: float = Field(default=500.0, ge=0, description="starvation weight (PrefillOnly Alg. 1)")

    @model_validator(mode="after")
    def _one_source(self) -> "ScoreSpec":
        if (self.choices is None) == (self.choices_column is None):
            raise ValueError("give exactly one of choices (e.g. [\"Yes\", \"No\"]) or choices_column")
        if self.choices is not None and len(self.choices) < 1:
            raise ValueError("choices is empty: give at least one label")
        return self


class TokenizeSpec(_Strict):
    concurrency: int = Field(default=1, ge=1, description="tokenizer actors")
    batch_size: int = Field(default=256, ge=1)


class ResourcesSpec(_Strict):
    num_gpus_per_replica: float = Field(default=0, ge=0)
    num_cpus_per_replica: float = Field(default=1, ge=0)


class OutputSpec(_Strict):
    path: str = Field(description="directory for parts and metrics.json; local or s3://")
    format: Literal["auto", "parquet", "jsonl", "openai"] = "auto"
    rows_per_part: int = Field(default=1000, ge=1)
    overwrite: bool = False
    resume: bool = Field(default=False, description="finish an interrupted job at this path: "
                         "committed rows are kept and skipped")
    include_prompt: bool = False


class JobSpec(_Strict):
    """One offline batch job. See jobs/examples/*.yaml."""

    name: str = "prefixflow-job"
    model: str = Field(description="Hugging Face model directory (config.json, weights, tokenizer)")
    task: Literal["generate", "score"] = "generate"
    input: InputSpec
    prompt: PromptSpec | None = None
    score: ScoreSpec | None = Field(default=None, description="settings of task: score")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)  # type: ignore[valid-type]
    engine: EngineSpec = Field(default_factory=EngineSpec)  # type: ignore[valid-type]
    order: Literal["fcfs", "dfs", "batchllm", "blendserve"] = "batchllm"
    replicas: int = Field(default=1, ge=1, description="data-parallel engine actors")
    max_retries_per_row: int = Field(default=2, ge=0, le=10, description="after an engine actor "
                                     "dies, its uncommitted rows run again; a replica whose actor "
                                     "dies this many more times in a row without committing a row "
                                     "has its rows left become error records")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tokenize: TokenizeSpec = Field(default_factory=TokenizeSpec)
    output: OutputSpec
    storage: StorageSpec = Field(default_factory=StorageSpec)

    @model_validator(mode="after")
    def _prompt_for_format(self) -> "JobSpec":
        fmt = self.input_format()  # raises, naming input.format, when it cannot be inferred
        if self.task == "score" and self.score is None:
            raise ValueError("task: score needs a score section, e.g. score: {choices: [\"Yes\", \"No\"]}")
        if self.task == "score" and fmt == "openai":
            raise ValueError("task: score cannot read OpenAI batch files (they are chat/completion "
                             "requests): use task: generate, or a jsonl/csv/parquet input")
        if self.prompt is None and fmt != "openai":
            raise ValueError("prompt is required unless input.format is openai: add prompt.template "
                             "(e.g. \"Q: {{ question }}\") or prompt.user, or prompt.messages_column")
        return self

    def input_format(self) -> str:
        from prefixflow.operators.read import infer_format

        fmt = self.input.format
        return infer_format(self.input.path) if fmt == "auto" else fmt

    def output_format(self) -> str:
        fmt = self.output.format
        if fmt != "auto":
            return fmt
        return "openai" if self.input_format() == "openai" else "parquet"


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read a YAML job file (safe_load) and validate it; raise SpecError on any problem."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(str(path), [("", "no such file: give the path of a job YAML")])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise SpecError(str(path), [("", f"not valid YAML: {e}")]) from None
    return parse_spec(data, str(path), overrides)


def parse_spec(data: Any, source: str = "<spec>", overrides: dict[str, Any] | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(source, [("", f"the top level must be a mapping, got {type(data).__name__}")])
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(source, _merge([_describe(err) for err in e.errors()])) from None


def _merge(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One line per field: a union type reports each alternative separately."""
    merged: dict[str, str] = {}
    for path, msg in problems:
        if path in merged and "wrong type" in msg and "wrong type" in merged[path]:
            merged[path] += " or " + msg.split("input should be ", 1)[-1]
        elif path not in merged:
            merged[path] = msg
    return list(merged.items())


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        data = data.setdefault(k, {})
    data[keys[-1]] = value


def _describe(err: dict[str, Any]) -> tuple[str, str]:
    """One pydantic error -> (field path, message with a fix)."""
    loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "str", "list["))]
    path = ".".join(loc)
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return path, _unknown_key(loc)
    if kind == "missing":
        return path, "required field is missing: add it"
    if kind == "literal_error":
        return path, f"{value!r} is not allowed: {err['msg'].replace('Input should be', 'use')}"
    msg = err["msg"].removeprefix("Value error, ")
    # EngineConfig / SamplingParams checks say "SamplingParams.top_p=2.0 is invalid: ...".
    own = re.match(r"^\w+\.(\w+)=(.*?) is invalid: (.*)$", msg, re.S)
    if own:
        return f"{path}.{own.group(1)}" if path else own.group(1), f"{own.group(2)} is invalid: {own.group(3)}"
    if kind == "model_type":
        fields = ", ".join(_model_of(_field_annotation(loc)).model_fields) if _field_annotation(loc) else ""
        return path, f"{value!r} has the wrong type: this must be a mapping" + (f" with keys among: {fields}" if fields else "")
    if kind.endswith(("_type", "_parsing")):
        msg = msg.replace("valid tuple", "valid list")
        return path, f"{value!r} has the wrong type: {msg[0].lower() + msg[1:]}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return path, f"{value!r} is out of range: use a value that is {msg.removeprefix('Input should be ')}"
    return path, msg


def _unknown_key(loc: list[str]) -> str:
    model: Any = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            break
        model = _model_of(field.annotation)
    allowed = list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
    near = difflib.get_close_matches(loc[-1], allowed, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"unknown key{hint} (allowed: {', '.join(allowed)})" if allowed else "unknown key: remove it"


def _field_annotation(loc: list[str]) -> Any:
    """The annotation of the field at `loc` when it (or its Optional) is a spec model."""
    model: Any = JobSpec
    annotation = None
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        annotation = field.annotation
        model = _model_of(annotation)
    return annotation if _model_of(annotation) is not None else None


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
