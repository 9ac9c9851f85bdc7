"""JobSpec: the YAML job file, one pydantic model parsed once at the edge.

Unknown keys and bad values fail before anything starts, with the field path and a fix:

    prefixflow validate job.yaml
    job.yaml: 2 problems
      input.pathh: unknown key; did you mean 'path'? (allowed: path, format, limit, table, version, ...)
      sampling.temperature: -1.0 is invalid: use 0 for greedy or a positive value

The engine, sampling, storage, prompt and score sections mirror `EngineConfig`,
`SamplingParams`, `StorageOptions`, `PromptTemplate` and `ScoreConfig` field for field (generated
from their dataclasses by `_mirror`, so they cannot drift apart, and the Python API refuses the
same values with the same messages); task, order and engine.backend are checked by
operators/config.setting_problems, the check ProcessorConfig runs, and the other top-level
defaults are ProcessorConfig's. `JobSpec.to_config()` is the one place a spec becomes the
ProcessorConfig the Python API takes.
YAML is read with a safe loader (no python/* tags) that also refuses duplicate keys, nesting
deeper than a spec needs and alias bombs (`_SpecLoader`); `--set KEY=VALUE` values are read the
same way. The spec file and each `--set` value have a size cap.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
    field_validator,
    model_validator,
)

from prefixflow.engine.config import EngineConfig
from prefixflow.errors import InvalidSetting, did_you_mean, invalid, short
from prefixflow.jobs.job import Job
from prefixflow.images import ImageConfig
from prefixflow.lora import LoraConfig
from prefixflow.model_source import normalize_model  # torch-free
from prefixflow.operators.config import (
    DEFAULT_BACKEND,
    INPUT_TABLE_FORMATS,
    OUTPUT_TABLE_FORMATS,
    OPENAI_TASKS,
    EmbedConfig,
    ProcessorConfig,
    ScoreConfig,
    choice_problems,
    limit_problems,
    setting_problems,
)
from prefixflow.operators.results.table_commit import OutputTableFormat, TableOutput
from prefixflow.operators.results.write import WriteOptions
from prefixflow.operators.stages.read import Format, ReadOptions, infer_format
from prefixflow.operators.stages.read_table import (
    PATH_TABLES,
    TableFormat,
    TableInput,
    filter_problems,
    token_env_problem,
)
from prefixflow.operators.template import PromptTemplate
from prefixflow.requests import NOT_OVERRIDDEN, SamplingParams
from prefixflow.storage import StorageOptions, masked, normal_path


class SpecError(ValueError):
    """A job spec is invalid. `problems` lists (field path, message) pairs; URLs in them are
    shown without their passwords and tokens (storage.masked)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        problems = [(path, masked(msg)) for path, msg in problems]
        self.source = source
        self.problems = problems
        if len(problems) == 1:  # one problem, one line
            path, msg = problems[0]
            super().__init__(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")
            return
        lines = [f"{source}: {len(problems)} problems"]
        lines += [f"  {path}: {msg}" if path else f"  {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


# A spec needs four or five levels; deeper YAML is refused before PyYAML's recursive composer
# (three frames per level) runs out of stack.
MAX_DEPTH = 32
# A spec holds tens of values (a long stop list or JSON schema: a few thousand). An alias counts
# the values of what it points to, so a "billion laughs" bomb (anchors of lists of aliases, 836
# bytes for 9**9 values) is refused while it is read: before pydantic, model_dump or the vLLM
# argument checks would expand it (31.6 s and 1.7 GB for 9 levels, ~17 GB for 10).
MAX_NODES = 100_000
MAX_SPEC_BYTES = 1 << 20  # a spec with a long prompt is a few KiB
MAX_SET_BYTES = 64 << 10  # per --set value (Linux caps one argument at 128 KiB anyway)


class _YAMLProblem(yaml.YAMLError):
    """The spec loader refused the YAML at `field` (a duplicate key, or too deep)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader (python/* tags stay refused) that also refuses duplicate keys, which plain
    YAML silently resolves to the last one, nesting deeper than MAX_DEPTH, and documents that
    expand to more than MAX_NODES values.

    Composing yields a graph in which an alias is the very node its anchor names; each node's
    expanded size and height are computed once, from its children's, when it is composed (an
    alias is looked up, never walked), so the check is linear in the text whatever it expands to.
    """

    def __init__(self, stream: str):
        super().__init__(stream)
        self._path: list[str | None] = []
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values expanded, levels)

    def _field(self, *more: str) -> str:
        return ".".join(p for p in [*self._path, *more] if p is not None)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if len(self._path) >= MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise _YAMLProblem(
                ".".join(p for p in self._path[:3] if p is not None) + "...",
                f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1}, "
                f"column {mark.column + 1}): a job spec needs only a few levels",
            )
        # index: the key node of a mapping value, the position in a sequence, None for a key.
        part = index.value if isinstance(index, yaml.ScalarNode) else (str(index) if isinstance(index, int) else None)
        alias = self.check_event(yaml.AliasEvent)
        self._path.append(part)
        try:
            node = super().compose_node(parent, index)
            self._measure(node, alias)
            return node
        finally:
            self._path.pop()

    def _measure(self, node: Any, alias: bool) -> None:
        """Record the node's expanded size and height; refuse a bomb, a self-reference, or
        aliases that stack deeper than MAX_DEPTH."""
        line = node.start_mark.line + 1
        if alias:
            if id(node) not in self._sizes:  # its anchor is still being composed
                raise _YAMLProblem(
                    self._field(),
                    f"an alias refers to itself (line {line}): a spec holds plain data; write the value out",
                )
            levels = self._sizes[id(node)][1]
            if len(self._path) - 1 + levels > MAX_DEPTH:
                raise _YAMLProblem(
                    self._field(),
                    f"nested more than {MAX_DEPTH} levels deep through "
                    f"aliases (line {line}): a job spec needs only a few levels",
                )
            return
        children = (
            node.value
            if isinstance(node, yaml.SequenceNode)
            else [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else []
        )
        measured = [self._sizes[id(child)] for child in children]
        size = 1 + sum(n for n, _ in measured)
        if size > MAX_NODES:
            raise _YAMLProblem(
                self._field(),
                f"expands to more than {MAX_NODES:,} values (line "
                f"{line}; aliases count as the values they stand for): a job spec "
                "needs far fewer; remove the aliases that repeat large values",
            )
        self._sizes[id(node)] = (size, 1 + max((h for _, h in measured), default=0))

    def compose_mapping_node(self, anchor: Any) -> Any:
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue
            line = key.start_mark.line + 1
            if key.tag == "tag:yaml.org,2002:merge" and (key.tag, key.value) in seen:
                raise _YAMLProblem(
                    self._field(),
                    f"two '<<' merge keys in one mapping (lines "
                    f"{seen[key.tag, key.value]} and {line}): a mapping's keys must "
                    "be unique, and YAML readers differ on which merge wins; merge "
                    "several with one key: <<: [*a, *b]",
                )
            if (key.tag, key.value) in seen:
                raise _YAMLProblem(
                    self._field(key.value),
                    f"duplicate key (lines "
                    f"{seen[key.tag, key.value]} and {line}): YAML would keep only "
                    "the last one; remove one of them",
                )
            seen[key.tag, key.value] = line
        return node


def load_yaml(text: str, source: str, field: str = "") -> Any:
    """Parse YAML text with the spec loader; raise SpecError (one line) on any problem."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(
            source,
            [
                (
                    field,
                    f"the YAML is {len(text):,} characters; a job spec is at "
                    f"most {MAX_SPEC_BYTES >> 20} MiB: is this the right file?",
                )
            ],
        )
    try:
        return yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass: builds no objects
    except _YAMLProblem as e:
        raise SpecError(source, [(_join(field, e.field), e.message)]) from None
    except yaml.YAMLError as e:
        why = " ".join(str(e).split())  # PyYAML's messages span several lines
        if isinstance(e, yaml.constructor.ConstructorError):
            why += " (tags such as !!python/... are refused: a spec holds only data)"
        raise SpecError(source, [(field, f"not valid YAML: {why}")]) from None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs -> {dotted key: value}; each value is YAML, read like a spec."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or "" in key.split("."):
            raise SpecError("--set", [("", f"{short(pair)} is not KEY=VALUE: write e.g. --set sampling.max_tokens=32")])
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_SET_BYTES:
            raise SpecError(
                "--set",
                [
                    (
                        key,
                        f"the value is {size:,} bytes; a --set value is at most "
                        f"{MAX_SET_BYTES >> 10} KiB: put long values in the spec file",
                    )
                ],
            )
        out[key] = load_yaml(value, "--set", key)
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _mirror(cls: type, name: str, skip: tuple[str, ...] = (), extra: dict[str, Any] | None = None) -> type[BaseModel]:
    """A strict pydantic model with the fields, types and defaults of a frozen dataclass,
    plus `extra` fields ({name: (type, default)}) that the dataclass does not check."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else Field(default_factory=f.default_factory)
        fields[f.name] = (_strict_bool(hints[f.name]), default)
    own = list(fields)
    fields.update(extra or {})

    def check(self: BaseModel) -> BaseModel:
        given = {k: getattr(self, k) for k in own}
        cls(**given, **({"model": "."} if "model" in skip else {}))  # its own checks
        return self

    # pydantic turns `top_k: true` into 1 before the dataclass could refuse it: refuse first.
    takes_bool = {k for k, (hint, _) in fields.items() if StrictBool in (hint, *typing.get_args(hint))}

    def no_bool_numbers(data: Any) -> Any:
        for key, value in data.items() if isinstance(data, dict) else ():
            if isinstance(value, bool) and key in fields and key not in takes_bool:
                raise invalid(cls.__name__, key, value, "give a number, not true or false")
        return data

    # pydantic annotates __validators__ as plain callables, though its own docs pass decorated
    # ones (a PydanticDescriptorProxy each), as here.
    validators: dict[str, Any] = {
        "_no_bool_numbers": model_validator(mode="before")(no_bool_numbers),
        "_check": model_validator(mode="after")(check),
    }
    return create_model(name, __base__=_Strict, __validators__=validators, **fields)


def _strict_bool(hint: Any) -> Any:
    """`hint` with bool as StrictBool: a spec's true and false are YAML's, never pydantic's
    readings of text ("yes", "off", "1" would pass as booleans)."""
    if hint is bool:
        return StrictBool
    args = typing.get_args(hint)
    if bool in args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.Union[tuple(StrictBool if a is bool else a for a in args)]
    return hint


def _default(name: str) -> Any:
    """ProcessorConfig's default of `name`: the spec's top-level settings have no other."""
    return ProcessorConfig.__dataclass_fields__[name].default


def _choice(name: str) -> AfterValidator:
    """ProcessorConfig's check of `name` (operators/config.CHOICES) for a str field
    (`Annotated[str, _choice(name)]`), run per field so that it is reported beside the spec's
    other problems."""

    def check(value: str) -> str:
        for _, bad, fix in choice_problems({name: value}):
            raise ValueError(f"{short(bad)} is invalid: {fix}")
        return value

    return AfterValidator(check)


def _limited(name: str) -> WrapValidator:
    """ProcessorConfig's limit of `name` (operators/config.LIMITS) for a number field
    (`Annotated[int, _limited(name)]`), run per field so that the spec names its own field
    path (output.rows_per_part, ...). YAML's true and false are refused before pydantic would
    read them as 1 and 0."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, bool):  # YAML's true is not a count
            raise ValueError(f"{value!r} is invalid: give a number, not true or false")
        value = handler(value)
        for _, bad, fix in limit_problems({name: value}):
            raise ValueError(f"{short(bad)} is invalid: {fix}")
        return value

    return WrapValidator(check)


# The sections that mirror a dataclass are built when the module loads (_mirror), so the type
# checker cannot see their fields: to it they are Any.
if TYPE_CHECKING:
    EngineSpec: TypeAlias = Any
    SamplingSpec: TypeAlias = Any
    StorageSpec: TypeAlias = Any
    PromptSpec: TypeAlias = Any
    ScoreSpec: TypeAlias = Any
    EmbedSpec: TypeAlias = Any
    LoraSpec: TypeAlias = Any
    ImagesSpec: TypeAlias = Any
else:
    # engine.backend, engine.vllm and engine.http choose the engine (operators/config.setting_problems checks
    # them for both the spec and ProcessorConfig); the other engine fields are EngineConfig's.
    EngineSpec = _mirror(
        EngineConfig,
        "EngineSpec",
        skip=("model",),
        extra={
            "backend": (
                Annotated[str, _choice("engine.backend")],
                Field(
                    default=DEFAULT_BACKEND,
                    description="native: prefixflow's engine; vllm: vLLM's engine (pip install prefixflow[vllm]); "
                    "http: OpenAI-compatible servers (engine.http)",
                ),
            ),
            "vllm": (
                dict[str, Any],
                Field(
                    default_factory=dict,
                    description="vLLM engine arguments, "
                    "passed through (like ray.data.llm's engine_kwargs); backend vllm only",
                ),
            ),
            "http": (
                dict[str, Any] | None,
                Field(
                    default=None,
                    description="backend http: the OpenAI-compatible servers (endpoints: one replica each, "
                    "model, api_key_env, max_concurrency, qps, max_retries, backoff_s, timeout_s, token_ids)",
                ),
            ),
        },
    )
    SamplingSpec = _mirror(SamplingParams, "SamplingSpec", skip=NOT_OVERRIDDEN)

    # Object storage settings (prefixflow/storage.py); anything left out comes from the AWS
    # environment variables, or for other schemes from their fsspec driver's.
    StorageSpec = _mirror(StorageOptions, "StorageSpec")

    # How a row becomes a prompt: exactly one of template, user (with optional system) or
    # messages_column; PromptTemplate's own checks (and messages) apply to the spec too.
    PromptSpec = _mirror(PromptTemplate, "PromptSpec")

    # task: score (PrefillOnly), one probability per allowed answer (operators/results/score.py).
    # add_special_tokens stays out: the prompt section decides the prompt's text.
    ScoreSpec = _mirror(ScoreConfig, "ScoreSpec", skip=("add_special_tokens",))

    # task: embed, one vector per row (operators/results/embed.py), pooled as the model says
    # unless these say otherwise.
    EmbedSpec = _mirror(EmbedConfig, "EmbedSpec")
    # per-row LoRA adapters (prefixflow/lora.py): a row's `model` names its adapter
    LoraSpec = _mirror(LoraConfig, "LoraSpec")
    # where the images of chat messages may come from (prefixflow/images.py)
    ImagesSpec = _mirror(ImageConfig, "ImagesSpec")


class InputSpec(_Strict):
    path: str | list[str] | None = Field(
        default=None,
        description="file, directory, glob or list; a local path or a URL (s3://, gs://, abfss://, file://, ...); "
        "formats delta and lance: the table's path or URL",
    )
    format: Literal["auto", "jsonl", "csv", "parquet", "openai", "delta", "iceberg", "lance", "unity_catalog"] = "auto"
    limit: int | None = Field(default=None, ge=1, description="read only the first N rows")
    # Tables (operators/stages/read_table.py):
    table: str | None = Field(
        default=None, description="formats iceberg (namespace.table) and unity_catalog (catalog.schema.table)"
    )
    version: int | None = Field(
        default=None,
        ge=0,
        description="the table version to read (Delta, Lance; Iceberg: a snapshot id); default: the newest at start",
    )
    columns: list[str] | None = Field(default=None, description="tables: read only these columns")
    filter: list[Any] | None = Field(
        default=None,
        description='tables: [[column, operator, value], ...], all must hold, e.g. [["split", "=", "test"]]',
    )
    catalog: dict[str, str | int | float | bool] | None = Field(
        default=None, description="format iceberg: pyiceberg's catalog properties, e.g. {type: sql, uri: ...}"
    )
    url: str | None = Field(default=None, description="format unity_catalog: the workspace URL")
    token_env: str = Field(
        default="DATABRICKS_TOKEN", description="format unity_catalog: the environment variable holding the token"
    )
    region: str | None = Field(default=None, description="format unity_catalog: the storage's region, if it needs one")

    @field_validator("path")
    @classmethod
    def _not_empty(cls, path: str | list[str] | None) -> str | list[str] | None:
        if path == [] or (isinstance(path, str) and not path.strip()):
            raise ValueError(f"{path!r} is empty: give at least one file, directory or glob")
        if isinstance(path, list) and any(not p.strip() for p in path):
            raise ValueError(f"{short(path)} has an empty entry: give a file, directory or glob in each")
        return path

    @field_validator("filter")
    @classmethod
    def _a_filter(cls, triples: list[Any] | None) -> list[Any] | None:
        problem = None if triples is None else filter_problems(triples)
        if problem:
            raise ValueError(problem)
        return triples

    @model_validator(mode="after")
    def _fields_of_format(self) -> "InputSpec":
        """Each format's own fields: a file format needs path; a table format the path or name
        of its table; fields another format takes are refused, by name."""
        problems = input_field_problems(self)
        if problems:
            raise _SpecProblems([(f"input.{name}", why) for name, why in problems])
        return self

    def table_input(self) -> TableInput | None:
        """The table this input reads (None: files)."""
        if self.format not in INPUT_TABLE_FORMATS:
            return None
        location = self.path if self.format in PATH_TABLES else self.table
        assert isinstance(location, str)  # input_field_problems
        return TableInput(
            format=typing.cast(TableFormat, self.format),
            location=location,
            version=self.version,
            columns=tuple(self.columns) if self.columns else None,
            filter=tuple((str(n), str(op), v) for n, op, v in self.filter or []),
            catalog={k: str(v) for k, v in (self.catalog or {}).items()},
            url=self.url,
            token_env=self.token_env,
            region=self.region,
        )


# Which input fields each format takes (the others are refused by name).
_FILE_FIELDS = {"path", "format", "limit"}
_INPUT_FIELDS = {
    "delta": {"path", "format", "limit", "version", "columns", "filter"},
    "lance": {"path", "format", "limit", "version", "columns", "filter"},
    "iceberg": {"table", "format", "limit", "version", "columns", "filter", "catalog"},
    "unity_catalog": {"table", "format", "limit", "columns", "filter", "url", "token_env", "region"},
}


def input_field_problems(spec: InputSpec) -> list[tuple[str, str]]:
    fmt = spec.format
    allowed = _INPUT_FIELDS.get(fmt, _FILE_FIELDS)
    # (a field at its default is not given: a spec dumped and read again stays valid)
    given = [
        k for k in spec.model_fields_set if k not in allowed and getattr(spec, k) != InputSpec.model_fields[k].default
    ]
    what = f"format {fmt}" if fmt in INPUT_TABLE_FORMATS else "file input"
    problems = [(k, f"is not used by {what}: remove it (fields: {', '.join(sorted(allowed))})") for k in sorted(given)]
    needs = "table" if fmt in ("iceberg", "unity_catalog") else "path"
    if getattr(spec, needs) is None:
        example = {"iceberg": "my_namespace.my_table", "unity_catalog": "main.default.my_table"}.get(
            fmt, "data/questions/"
        )
        problems.append((needs, f"required field is missing for {what}: add it, e.g. {needs}: {example}"))
    elif fmt in PATH_TABLES and not isinstance(spec.path, str):
        problems.append(("path", f"format {fmt} reads one table: give its path or URL, not a list"))
    if fmt == "iceberg":
        problems += [(k, why) for k, why in iceberg_problems(spec.table, spec.catalog)]
    if fmt == "unity_catalog" and token_env_problem(spec.token_env):
        problems.append(("token_env", str(token_env_problem(spec.token_env))))
    return problems


def iceberg_problems(table: str | None, catalog: dict[str, Any] | None) -> list[tuple[str, str]]:
    """An Iceberg table's name and catalog, for input and output alike: the name has its
    namespace; the catalog's properties are given, and none of them names Python code to import
    (pyiceberg's py-catalog-impl, py-io-impl, ...: a spec holds data only)."""
    problems = []
    if table is not None and "." not in table.strip("."):
        problems.append(("table", f"{short(table)} has no namespace: give namespace.table, e.g. analytics.{table}"))
    if not catalog:
        problems.append(("catalog", "format iceberg needs the catalog's properties, e.g. {type: sql, uri: ...}"))
    code = sorted(k for k in catalog or {} if k.startswith("py-"))
    if code:
        problems.append(
            (
                "catalog",
                f"{', '.join(code)} would make pyiceberg import Python code that the spec names: a spec "
                "holds data only; use a catalog type (sql, rest, glue, hive, ...)",
            )
        )
    return problems


class TokenizeSpec(_Strict):
    concurrency: Annotated[int, _limited("tokenize_concurrency")] = Field(
        default=_default("tokenize_concurrency"), description="tokenize tasks at once"
    )
    batch_size: Annotated[int, _limited("tokenize_batch_size")] = _default("tokenize_batch_size")


class ReplicasSpec(_Strict):
    """replicas as a range, as ray.data.llm's concurrency=(min, max): the plan is made for max
    engines and max are started; min of them must fit the cluster when the job starts, the
    others start when resources come (a node added) and take work then."""

    min: Annotated[int, _limited("replicas")]
    max: Annotated[int, _limited("replicas")]

    @model_validator(mode="after")
    def _ordered(self) -> "ReplicasSpec":
        if self.min > self.max:
            raise ValueError(f"min={self.min} is more than max={self.max}: give min <= max")
        return self


class ResourcesSpec(_Strict):
    num_gpus_per_replica: Annotated[float, _limited("num_gpus_per_replica")] = _default("num_gpus_per_replica")
    num_cpus_per_replica: Annotated[float, _limited("num_cpus_per_replica")] = _default("num_cpus_per_replica")


class OutputSpec(_Strict):
    path: str = Field(
        description="directory for parts and metrics.json; a local path or a URL (s3://, gs://, abfss://, file://, ...)"
    )
    format: Literal["auto", "parquet", "jsonl", "openai", "delta", "iceberg", "lance"] = "auto"
    rows_per_part: Annotated[int, _limited("rows_per_chunk")] = _default("rows_per_chunk")
    overwrite: StrictBool = False
    resume: StrictBool = Field(
        default=False, description="finish an interrupted job at this path: committed rows are kept and skipped"
    )
    include_prompt: StrictBool = _default("include_prompt")
    error_file: StrictBool = Field(
        default=False,
        description="format openai: the failed "
        "requests' lines go to errors.jsonl, results.jsonl keeps the "
        "others (as OpenAI's output and error files)",
    )

    # Table output (operators/results/table_commit.py): the parts go to `path` as for any job,
    # then every row into the table in one commit.
    table: str | None = Field(
        default=None,
        description="formats delta and lance: the table's path or URL; iceberg: its name (namespace.table)",
    )
    catalog: dict[str, str | int | float | bool] | None = Field(
        default=None, description="format iceberg: pyiceberg's catalog properties"
    )
    errors: Literal["table", "folder"] = Field(
        default="table",
        description="table formats: error records into the table (with their error column) or only in the parts",
    )

    @model_validator(mode="after")
    def _table_fields(self) -> "OutputSpec":
        problems: list[tuple[str, str]] = []
        if self.format not in OUTPUT_TABLE_FORMATS:
            given = [
                k for k in ("table", "catalog", "errors") if getattr(self, k) != OutputSpec.model_fields[k].default
            ]
            problems += [(k, "is for table output (format delta, iceberg or lance): remove it") for k in given]
        elif not self.table:
            example = "my_namespace.answers" if self.format == "iceberg" else "out/answers_table"
            problems.append(("table", f"required for format {self.format}: add it, e.g. table: {example}"))
        if self.format == "iceberg":
            problems += iceberg_problems(self.table, self.catalog)
        elif self.format in ("delta", "lance") and self.catalog is not None:
            problems.append(("catalog", f"is not used by format {self.format}: remove it"))
        if problems:
            raise _SpecProblems([(f"output.{k}", why) for k, why in problems])
        return self

    def table_output(self) -> TableOutput | None:
        """Where the rows land at the end (None: the parts are the output)."""
        if self.format not in OUTPUT_TABLE_FORMATS or self.table is None:
            return None
        return TableOutput(
            format=typing.cast(OutputTableFormat, self.format),
            location=self.table,
            catalog={k: str(v) for k, v in (self.catalog or {}).items()},
            errors=self.errors,
        )

    @field_validator("path")
    @classmethod
    def _not_empty(cls, path: str) -> str:
        if not path.strip():  # the parts and bookkeeping would land in the working directory
            raise ValueError(f"{path!r} is empty: give the folder (or URL) to write the job's output to")
        return path

    @model_validator(mode="after")
    def _resume_or_overwrite(self) -> "OutputSpec":
        if self.overwrite and self.resume:
            raise ValueError(
                "output.overwrite and output.resume are both true: choose one: "
                "resume keeps committed parts, overwrite deletes them"
            )
        return self


class JobSpec(_Strict):
    """One offline batch job. See jobs/examples/*.yaml."""

    name: str = "prefixflow-job"
    model: str = Field(description="Hugging Face model directory (config.json, weights, tokenizer)")
    task: Annotated[str, _choice("task")] = Field(
        default=_default("task"), description="generate, score, embed or classify"
    )
    input: InputSpec
    prompt: PromptSpec | None = None
    score: ScoreSpec | None = Field(default=None, description="settings of task: score")
    embed: EmbedSpec | None = Field(default=None, description="settings of task: embed (pooling, normalize)")
    lora: LoraSpec | None = Field(
        default=None,
        description="per-row LoRA adapters: path (one subfolder per adapter; a row's model column names "
        "one), max_loras, max_lora_rank; engine.backend vllm",
    )
    images: ImagesSpec | None = Field(
        default=None,
        description="where the images of chat messages may come from: root (a local folder or an s3:// URL), "
        "allow_urls (fetch http(s) URLs), max_bytes, max_pixels, timeout_s; a vision-language model on "
        "engine.backend vllm",
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    order: Annotated[str, _choice("order")] = Field(
        default=_default("order"), description="plan order: fcfs, dfs, batchllm or blendserve"
    )
    # A count or a {min, max} range; the discriminator picks the one a value means, so that its
    # problems are that form's alone.
    replicas: Annotated[
        Annotated[int, _limited("replicas"), Tag("tag:count")] | Annotated[ReplicasSpec, Tag("tag:range")],
        Discriminator(lambda v: "tag:range" if isinstance(v, (dict, ReplicasSpec)) else "tag:count"),
    ] = Field(default=_default("replicas"), description="data-parallel engine actors: a count, or {min, max}")
    work_stealing: StrictBool = Field(
        default=_default("work_stealing"),
        description="a replica that runs dry takes unstarted plan units of the one expected to finish last (prefix-affine: those whose prefix it computes again least)",
    )
    window_rows: Annotated[int, _limited("window_rows")] | None = Field(
        default=_default("window_rows"),
        description="plan the job in windows of this many rows, each run while the next is read and "
        "planned; unset: the whole job is planned before any row runs, unless its input holds more than "
        "4,000,000 rows: then windows of 1,000,000; 0: the whole job, whatever its size",
    )
    window_planners: Annotated[int, _limited("window_planners")] = Field(
        default=_default("window_planners"),
        description="with window_rows: windows planned at once, each by a Ray task on any node; a window's "
        "plan sees the prefix homes of the windows up to this many before it",
    )
    max_retries_per_row: int = Field(
        default=_default("max_retries_per_row"),
        ge=0,
        le=10,
        description="after an engine actor "
        "dies, its uncommitted rows run again; a replica whose actor "
        "dies this many more times in a row without committing a row "
        "has its rows left become error records",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tokenize: TokenizeSpec = Field(default_factory=TokenizeSpec)
    output: OutputSpec
    storage: StorageSpec = Field(default_factory=StorageSpec)

    @model_validator(mode="after")
    def _settings(self) -> "JobSpec":
        """task, order, engine.backend and what the backend cannot run: ProcessorConfig's
        check (operators/config.setting_problems), every problem on its own line."""
        score = self.score.model_dump() if self.score is not None else None
        problems = setting_problems(self.engine.model_dump(), self.task, score, self.order)
        if problems:  # parse_spec unpacks them
            raise _SpecProblems([(field, f"{short(value)} is invalid: {fix}") for field, value, fix in problems])
        return self

    @model_validator(mode="after")
    def _prompt_for_format(self) -> "JobSpec":
        fmt = self.input_format()  # raises, naming input.format, when it cannot be inferred
        if self.task == "score" and self.score is None:
            raise ValueError('task: score needs a score section, e.g. score: {choices: ["Yes", "No"]}')
        if self.task not in OPENAI_TASKS and fmt == "openai":
            raise ValueError(
                f"task: {self.task} cannot read OpenAI batch files (they hold chat/completion "
                "requests, task: generate, or /v1/embeddings requests, task: embed): use one of "
                "those, or a jsonl/csv/parquet input"
            )
        if self.embed is not None and self.task != "embed":
            raise _SpecProblems([("embed", "embed settings need task: embed; set it, or remove embed")])
        for name, what in (("lora", "LoRA adapters"), ("images", "images")):
            if getattr(self, name) is not None and (self.task != "generate" or self.engine.backend != "vllm"):
                raise _SpecProblems(
                    [(name, f"{what} run with task: generate on engine.backend: vllm; set them, or remove {name}")]
                )
        if self.prompt is None and fmt != "openai":
            raise ValueError(
                "prompt is required unless input.format is openai: add prompt.template "
                '(e.g. "Q: {{ question }}") or prompt.user, or prompt.messages_column'
            )
        if self.output_format() == "openai" and fmt != "openai":
            why = "openai output needs input.format: openai (the lines are keyed by the requests' custom_id)"
            raise _SpecProblems([("output.format", f"{why}: use parquet or jsonl")])
        if self.output.error_file and self.output_format() != "openai":
            raise ValueError(
                f"output.error_file is true but the output format is {self.output_format()}: "
                "errors.jsonl is written for output.format: openai only; remove error_file "
                "(error rows carry their `error` column)"
            )
        self._device_has_a_gpu()
        return self

    def _device_has_a_gpu(self) -> None:
        # An actor without a GPU slot sees no GPU, so a cuda engine could never start in it.
        device, gpus = self.engine.device, self.resources.num_gpus_per_replica
        if device.startswith("cuda") and gpus == 0:
            raise ValueError(
                f"engine.device is {device!r} but resources.num_gpus_per_replica is 0: "
                "set resources.num_gpus_per_replica (e.g. 1, one GPU per replica) or "
                "use engine.device: auto"
            )
        index = device.partition(":")[2]
        if index.isdigit() and int(index) >= math.ceil(gpus):
            raise ValueError(
                f"engine.device is {device!r} but each replica sees only "
                f"{math.ceil(gpus)} GPU(s) (resources.num_gpus_per_replica): use "
                "engine.device: cuda"
            )

    def input_format(self) -> Format | TableFormat:
        fmt = self.input.format
        if fmt != "auto":
            return fmt
        assert self.input.path is not None  # input_field_problems: file input needs a path
        return infer_format(self.input.path)

    def output_format(self) -> str:
        fmt = self.output.format
        if fmt != "auto":
            return fmt
        return "openai" if self.input_format() == "openai" else "parquet"

    @property
    def num_replicas(self) -> int:
        """The replicas the plan is made for (the range's max)."""
        return self.replicas.max if isinstance(self.replicas, ReplicasSpec) else self.replicas

    def sampling_given(self) -> dict[str, Any]:
        """The sampling fields the spec sets itself (the model's generation_config.json fills
        the others: operators/config.sampling_with_defaults)."""
        return self.sampling.model_dump(include=self.sampling.model_fields_set)

    def storage_options(self) -> StorageOptions:
        """The storage settings every reader and writer of this job uses."""
        return StorageOptions(**self.storage.model_dump())

    def prompt_template(self) -> PromptTemplate | None:
        """The prompt template (None: rows carry their prompts or messages)."""
        return PromptTemplate(**self.prompt.model_dump()) if self.prompt is not None else None

    def to_job(self) -> Job:
        """The job this spec describes, read once: the record a run, its report and the CLI take
        (jobs/job.py)."""
        table = self.input.table_input()
        path = table.location if table is not None else self.input.path
        assert path is not None  # input_field_problems
        fmt = self.input_format()
        storage = self.storage_options()
        table_out = self.output.table_output()
        return Job(
            name=self.name,
            config=self.to_config(),
            read=ReadOptions(
                path=path if isinstance(path, str) else tuple(path),
                # a table's rows come typed, as parquet's do
                format="parquet" if table is not None or fmt in INPUT_TABLE_FORMATS else typing.cast(Format, fmt),
                storage=storage,
                limit=self.input.limit,
                min_tasks=2 * self.tokenize.concurrency,
                table=table,
            ),
            write=WriteOptions(
                path=normal_path(self.output.path),
                # a table output's parts are parquet; the table gets their rows at the end
                format="parquet" if table_out is not None else self.output_format(),
                storage=storage,
                model_name=Path(self.model).name,
                created=int(time.time()),
                # absolute, as the engine gets it: the actors' working folder may differ
                model=normalize_model(self.model),
            ),
            overwrite=self.output.overwrite,
            resume=self.output.resume,
            error_file=self.output.error_file,
            identity_key=self._identity_key(),
            engine_fields=self.engine.model_dump(),
            table_out=table_out,
        )

    def _identity_key(self) -> str:
        """What must not change between a run and its resume (the output flags may)."""
        data = self.model_dump(mode="json")
        for key in ("overwrite", "resume"):
            data["output"].pop(key, None)
        data.pop("storage", None)  # credentials and retry settings may change between attempts
        # A table's version is in the input's identity as read (the pinned one): a resume may
        # name the version the first run read by default (operators/stages/read_table.py).
        data["input"].pop("version", None)
        # A catalog's properties may hold its credentials (a REST token, S3 keys), which may change
        # between attempts; the tables are named by input.table and output.table.
        data["input"].pop("catalog", None)
        data["output"].pop("catalog", None)
        # Unset: the key of a job started before the field existed. 0 (whole, whatever the size)
        # is the same key: a run planned whole before unset meant windows for large inputs is
        # resumed with window_rows: 0; whole or windowed, the plan's own identity tells them apart.
        if not data.get("window_rows"):
            data.pop("window_rows", None)
        if data.get("window_planners") == 1:  # the default: the key of a job started before the field existed
            data.pop("window_planners", None)
        return json.dumps(data, sort_keys=True)

    def to_config(self) -> ProcessorConfig:
        """The ProcessorConfig this job runs with, the one the Python API takes: the only place
        a spec's sections become its fields."""
        return ProcessorConfig(
            model=normalize_model(self.model),  # local paths absolute; hub ids and short names kept
            prompt=self.prompt_template(),
            sampling=self.sampling_given(),  # the model's generation_config.json fills the rest
            engine=self.engine.model_dump(),
            order=self.order,
            replicas=self.num_replicas,
            min_replicas=self.replicas.min if isinstance(self.replicas, ReplicasSpec) else None,
            work_stealing=self.work_stealing,
            window_rows=self.window_rows,
            window_planners=self.window_planners,
            max_retries_per_row=self.max_retries_per_row,
            num_gpus_per_replica=self.resources.num_gpus_per_replica,
            num_cpus_per_replica=self.resources.num_cpus_per_replica,
            tokenize_concurrency=self.tokenize.concurrency,
            tokenize_batch_size=self.tokenize.batch_size,
            rows_per_chunk=self.output.rows_per_part,
            include_prompt=self.output.include_prompt,
            openai_batch=self.input_format() == "openai",
            task=self.task,
            score=self.score.model_dump() if self.score is not None else None,
            embed=self.embed.model_dump() if self.embed is not None else None,
            lora=self.lora.model_dump() if self.lora is not None else None,
            images=self.images.model_dump() if self.images is not None else None,
            storage=self.storage_options() if self.images is not None else None,
        )


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read a YAML job file (safely, see _SpecLoader) and validate it; raise SpecError on any problem."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(str(path), [("", "no such file: give the path of a job YAML")])
    size = path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise SpecError(
            str(path),
            [
                (
                    "",
                    f"the file is {size:,} bytes; a job spec is at most "
                    f"{MAX_SPEC_BYTES >> 20} MiB (a few KiB is usual): is this the "
                    "right file?",
                )
            ],
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(str(path), [("", f"not valid YAML: {e}")]) from None
    return parse_spec(load_yaml(text, str(path)), str(path), overrides)


def parse_spec(data: Any, source: str = "<spec>", overrides: dict[str, Any] | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(source, [("", f"the top level must be a mapping, got {type(data).__name__}")])
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value, source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        problems = [p for err in e.errors() for p in _problems_of(err)]
        raise SpecError(source, _merge(problems)) from None


class _SpecProblems(ValueError):
    """Raised by a JobSpec validator that finds several problems at once: pydantic keeps one
    error per validator, so the (field path, message) pairs travel inside it."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in problems))
        self.problems = problems


def _problems_of(err: Any) -> list[tuple[str, str]]:
    raised = (err.get("ctx") or {}).get("error")
    return raised.problems if isinstance(raised, _SpecProblems) else [_describe(err)]


def _merge(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One line per field: a union type reports each alternative separately."""
    merged: dict[str, str] = {}
    for path, msg in problems:
        if path in merged and "wrong type" in msg and "wrong type" in merged[path]:
            merged[path] += " or " + msg.split("input should be ", 1)[-1]
        elif path not in merged:
            merged[path] = msg
    return list(merged.items())


def _set_dotted(data: dict, dotted: str, value: Any, source: str) -> None:
    """--set a.b.c=v: walk the mappings a, a.b (made when missing) and set c."""
    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        if data.get(k) is None:
            data[k] = {}
        if not isinstance(data[k], dict):
            here = ".".join(keys[: i + 1])
            kind = "a list" if isinstance(data[k], list) else f"{short(data[k])}, not a mapping"
            raise SpecError(
                source,
                [
                    (
                        here,
                        f"is {kind}: --set {dotted} cannot set a key under "
                        f"it; set the whole value instead, e.g. --set {here}=...",
                    )
                ],
            )
        data = data[k]
    data[keys[-1]] = value


def _describe(err: dict[str, Any]) -> tuple[str, str]:
    """One pydantic error -> (field path, message with a fix)."""
    loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "str", "list[", "tag:"))]
    path = ".".join(loc)
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return path, _unknown_key(loc)
    if kind == "missing":
        return path, "required field is missing: add it"
    if kind == "literal_error":
        return path, f"{short(value)} is not allowed: {err['msg'].replace('Input should be', 'use')}"
    msg = err["msg"].removeprefix("Value error, ")
    own = (err.get("ctx") or {}).get("error")
    if isinstance(own, InvalidSetting):  # a dataclass's own check (EngineConfig, SamplingParams)
        return f"{path}.{own.name}" if path else own.name, f"{own.value} is invalid: {own.fix}"
    if kind == "model_type":
        fields = ", ".join(_model_of(_field_annotation(loc)).model_fields) if _field_annotation(loc) else ""
        return path, f"{short(value)} has the wrong type: this must be a mapping" + (
            f" with keys among: {fields}" if fields else ""
        )
    if kind == "bool_type":  # StrictBool: text is not read as a boolean
        return path, f"{short(value)} is not a boolean: write true or false, without quotes"
    if kind == "int_parsing_size":  # e.g. 1e20 for an int: pydantic speaks of a string here
        return path, f"{short(value)} is too large for an integer: use a smaller value"
    if kind.endswith(("_type", "_parsing")):
        msg = msg.replace("valid tuple", "valid list")
        return path, f"{short(value)} has the wrong type: {msg[0].lower() + msg[1:]}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return path, f"{short(value)} is out of range: use a value that is {msg.removeprefix('Input should be ')}"
    return path, msg


def _unknown_key(loc: list[str]) -> str:
    model: Any = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            break
        model = _model_of(field.annotation)
    allowed = list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
    hint = did_you_mean(loc[-1], allowed)
    hint = f"; {hint}" if hint else ""
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
    """The spec model an annotation holds (itself, or inside an Optional, a union or Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None
