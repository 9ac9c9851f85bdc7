"""Checks before any work: the spec against the world it will run in.

    preflight(spec)          model folder (tokenizer, vocab_size, chat template), input files and a
                             sample of their rows, output path (writable, its S3 bucket reachable),
                             engine.backend http's servers (answering, serving the model)
    check_resources(spec)    after ray.init: can the cluster ever place one engine actor?
    sample_rows(spec, n)     the first n input rows, read by the job's own readers (no Ray)
    row_report(spec, rows)   which sampled rows would become error records, and why

A problem that every sampled row has (a template column no row has, sampling overrides with
keys SamplingParams does not know) is a spec error; rows that would only partly fail are
reported by `prefixflow validate` and become error records when the job runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixflow.engine.http_backend.client import Endpoint, EndpointDown, RequestFailed
from prefixflow.engine.models.model_args import read_model_args, require_classifier
from prefixflow.errors import FieldProblem, InvalidSetting, did_you_mean, short
from prefixflow.jobs.spec import JobSpec, SpecError
from prefixflow.model_source import model_kind, resolve_model, weight_files
from prefixflow.operators.columns import ERROR, SOURCE
from prefixflow.operators.config import model_max_len, table_package_problem
from prefixflow.operators.results.bookkeeping import (
    COMMITS,
    ERRORS_FILE,
    JOB_FILE,
    LOCK_FILE,
    MANIFEST,
    RESULTS_FILE,
    TMP_PREFIX,
)
from prefixflow.operators.results.commit import input_listing
from prefixflow.operators.results.table_commit import output_table_problem
from prefixflow.operators.row_sampling import SAMPLING_COLUMNS
from prefixflow.operators.stages.read import SUFFIXES, Format, parse_file
from prefixflow.operators.stages.read_table import (
    PATH_TABLES,
    TableInput,
    column_problems,
    pinned,
    sample_table,
    table_columns,
)
from prefixflow.operators.stages.tokenize import OPENAI_MESSAGES, check_row_sampling
from prefixflow.operators.template import PromptTemplate, RowError, template_columns
from prefixflow.requests import SamplingParams
from prefixflow.storage import (
    HTTP,
    StorageOptions,
    check_scheme,
    check_shared,
    is_local,
    is_s3,
    list_input_files,
    local_path,
    masked,
    normal_path,
    protocol,
    strip_scheme,
)

SAMPLE_ROWS = 32
PROBE_TIMEOUT_S = 10.0  # engine.backend http: how long validate waits for each endpoint's /models
SAMPLE_BYTES = 1 << 20  # the first MiB of the first file holds the sample of any usual input

Problems = list[tuple[str, str]]


def preflight(spec: JobSpec, source: str = "<spec>", address: str | None = None) -> list[dict[str, Any]]:
    """Checks that touch the outside world, before any work; returns the sampled rows.

    Raises SpecError naming each field: the model folder (its tokenizer, vocab_size against
    the weights, a chat template where the prompt needs one), its context length and KV cache
    (against this machine's memory when the job will start its own local cluster here: no
    `address` and no RAY_ADDRESS; check_resources checks a cluster's nodes), the input files,
    the output path (never the input's; one every Ray worker can share and write; writable;
    its S3 bucket reachable), and the columns and sampling overrides of the first SAMPLE_ROWS
    rows.
    """
    storage = spec.storage_options()
    here = [] if address or os.environ.get("RAY_ADDRESS") else _this_machine()
    model = _model_problems(spec)
    problems = model + kv_cache_problems(spec, here) + _lora_problems(spec) + _endpoint_problems(spec)
    problems += [] if model else _image_problems(spec)  # reads the model's config.json
    storage_failed = False
    table = spec.input.table_input()
    if table is not None:
        return _table_preflight(spec, table, source, problems)
    assert spec.input.path is not None  # file input (InputSpec)
    try:
        files = list_input_files(spec.input.path, storage)
        input_listing([f for f in files if protocol(f) in HTTP], storage)  # a size or an ETag
    except ValueError as e:  # a FieldProblem of input.path, or a bad URL's own error
        files = []
        problems.append(("input.path", e.text if isinstance(e, FieldProblem) else str(e)))
    except Exception as e:  # fsspec drivers raise many kinds; one line each
        if not isinstance(e, OSError) and is_local(_first_path(spec.input.path)):
            raise
        files, storage_failed = [], True
        problems.append(("input.path", _storage_failure(_first_path(spec.input.path), e, storage)))
    # The same storage settings failed for the input: one line says so, not a second wait.
    problems += _output_problems(spec, files) or _output_access_problems(spec, storage, storage_failed)
    rows: list[dict[str, Any]] = []
    if files:
        try:
            rows = sample_rows(spec, SAMPLE_ROWS)
        except (ValueError, OSError) as e:  # pyarrow's errors are ValueErrors too
            problems.append(("input.path", f"cannot read the first input file: {e}"))
        problems += row_problems(spec, rows)
    problems += _chat_template_problems(spec, rows)
    if problems:
        raise SpecError(source, problems)
    return rows


def _table_preflight(spec: JobSpec, table: TableInput, source: str, problems: Problems) -> list[dict[str, Any]]:
    """preflight for a table input: the table is reached at its version (the newest now unless
    the spec names one), a sample of its rows is checked as files' are, the output is checked
    as for any job, and the output table (if any) must not be the input table."""
    storage = spec.storage_options()
    field = "input.path" if table.format in PATH_TABLES else "input.table"
    rows: list[dict[str, Any]] = []
    missing = table_package_problem(table.format)
    if missing:
        problems.append(("input.format", missing))
        raise SpecError(source, problems)
    try:
        names = table_columns(pinned(table, storage), storage)
        missing_columns = column_problems(table, names) if names is not None else []
        problems += [(f"input.{name}", why) for name, why in missing_columns]
        rows = [] if missing_columns else sample_rows(spec, SAMPLE_ROWS)
    except Exception as e:  # noqa: BLE001 - each table library raises its own kinds; one line each
        problems.append((field, f"cannot read the {table.name} table: {masked(str(e))[:300]}"))
    problems += _output_problems(spec, []) or _output_access_problems(spec, storage, False)
    out = spec.output.table_output()
    if out is not None and out.format == table.format and _same_table(out.location, table.location):
        problems.append(("output.table", "is the input table: the job would append its answers to its own input"))
    if rows:
        problems += row_problems(spec, rows)
    problems += _chat_template_problems(spec, rows)
    if problems:
        raise SpecError(source, problems)
    return rows


def _same_table(a: str, b: str) -> bool:
    """Whether two table locations name one table: paths in normal_path's form, names as given."""
    try:
        return normal_path(a) == normal_path(b)
    except ValueError:  # not a path (an Iceberg or Unity Catalog name)
        return a == b


def _lora_problems(spec: JobSpec) -> Problems:
    """The `lora` folder: each adapter one every engine can load (prefixflow/lora.py)."""
    if spec.lora is None:
        return []
    try:
        spec.to_config().lora_adapters()
    except ValueError as e:
        return [("lora.path", str(e))]
    return []


def _image_problems(spec: JobSpec) -> Problems:
    """`images.root`: a folder the job can list (local, or in object storage with its settings);
    and a model that takes images (its config.json names an image token)."""
    if spec.images is None:
        return []
    config = spec.to_config()
    if config.tokenize_options().images is None:
        return [
            (
                "images",
                "the model takes text only (its config.json names no image_token_id): use a vision-language model, or remove images",
            )
        ]
    root = spec.images.root
    if root is None:
        return []
    try:
        if not spec.storage_options().filesystem(root).isdir(root):
            return [("images.root", f"{masked(root)} is not a folder: give the folder holding the images")]
    except (OSError, ValueError) as e:
        return [("images.root", f"{masked(root)} cannot be listed ({type(e).__name__}): check the path and storage")]
    return []


def _endpoint_problems(spec: JobSpec) -> Problems:
    """engine.backend http: each endpoint answers GET /models (once, within 10 s) with the
    model the job asks for among its names, and takes the key, if one is named."""
    config = spec.to_config()
    http = config.http_config
    if http is None:
        return []
    name = http.model or config.model
    quick = dataclasses.replace(http, max_retries=0, timeout_s=PROBE_TIMEOUT_S)
    problems: Problems = []
    for i, base in enumerate(http.endpoints):
        try:
            served = Endpoint(base, quick).served_models()
        except ValueError as e:  # the key's variable is not set
            return [("engine.http.api_key_env", str(e))]
        except (RequestFailed, EndpointDown) as e:
            field = "engine.http.api_key_env" if e.status in (401, 403) else f"engine.http.endpoints[{i}]"
            problems.append((field, str(e)))
            continue
        if served and name not in served:
            problems.append(
                (
                    "engine.http.model",
                    f"{base} serves {', '.join(served)}, not {name!r}: set engine.http.model to the served name",
                )
            )
    return problems


def _model_problems(spec: JobSpec) -> Problems:
    """A local model folder is checked here; the other forms prefixflow.model_source takes (an
    s3:// folder, a .gguf file, a hub id, a short name) are resolved where the engine runs."""
    kind = model_kind(spec.model)
    if kind in ("s3", "url"):  # copied where the engine runs; its scheme must be served there
        try:
            check_scheme(spec.model)
            check_shared(spec.model, writes=False)
        except ValueError as e:
            return [("model", str(e))]
    if kind != "folder":
        return []
    try:
        model = resolve_model(spec.model)  # config.json and safetensors weights are there
    except ValueError as e:
        return [("model", str(e))]
    try:
        config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # json.JSONDecodeError, UnicodeDecodeError
        return [("model", f"{str(model / 'config.json')!r} is not valid JSON ({e}): fix the file")]
    if not isinstance(config, dict):
        return [
            (
                "model",
                f"{str(model / 'config.json')!r} holds a {type(config).__name__}, not a JSON object: fix the file",
            )
        ]
    # Remote code may read a tokenizer from files of any name.
    problem = (
        (None if spec.engine.trust_remote_code else _tokenizer_problem(model))
        or _vocab_problem(model, config)
        or _generation_config_problem(spec)
        or _classifier_problem(spec, model)
    )
    if problem is not None:
        return [("model", problem)]
    limit = model_max_len(str(model), None)  # what tokenization uses: config.json, no torch
    wanted = spec.engine.max_model_len
    if wanted is not None and wanted > limit:
        return [
            (
                "engine.max_model_len",
                f"{wanted} is more than the model allows ({limit}, "
                "max_position_embeddings in its config.json): use at most "
                f"{limit}, or leave it unset to use the model's",
            )
        ]
    if wanted is not None and spec.engine.backend == "vllm" and not spec.resources.num_gpus_per_replica:
        from prefixflow.engine.vllm_backend.engine import cpu_context  # vLLM on CPUs: kept or refused

        try:
            cpu_context(spec.to_config().engine_config, str(model))
        except ValueError as e:  # engine.max_model_len's check: its value and fix, under the field
            why = f"{e.value} is invalid: {e.fix}" if isinstance(e, InvalidSetting) else str(e)
            return [("engine.max_model_len", why)]
    return []


def _classifier_problem(spec: JobSpec, model: Path) -> str | None:
    """task classify: a classification head, and an activation the engines apply."""
    if spec.task != "classify":
        return None
    try:
        require_classifier(read_model_args(model))
    except ValueError as e:
        return str(e)
    return None


def kv_cache_problems(spec: JobSpec, node_memory: list[int]) -> Problems:
    """engine.kv_cache_bytes against what must hold it: at least one KV block of the model
    (block_size tokens, each taking K and V in every layer), at most the memory of the largest
    node (`node_memory`, bytes per node; [] when not known). The engine allocates the cache when
    it starts: a budget too small fails there, one too large in the allocation."""
    budget = spec.engine.kv_cache_bytes
    if budget is None:
        return []
    if node_memory and budget > max(node_memory):
        return [
            (
                "engine.kv_cache_bytes",
                f"{budget:,} bytes is more than the memory of any node "
                f"that could run the engine ({max(node_memory):,} bytes on the largest): use "
                "less (on a GPU, less than its memory), or leave it unset to size the cache "
                "from the device's free memory",
            )
        ]
    block = _kv_block_bytes(spec)
    if block is not None and budget < block:
        return [
            (
                "engine.kv_cache_bytes",
                f"{budget:,} bytes cannot hold one KV block of this "
                f"model ({spec.engine.block_size} tokens x K and V in every layer: {block:,} "
                f"bytes at the smallest dtype the engine may use): use at least {block:,}, or "
                "leave it unset",
            )
        ]
    return []


def _kv_block_bytes(spec: JobSpec) -> int | None:
    """The bytes of one KV block of a local model, at the smallest element the engine may use
    (float32 on a CPU unless the dtype is set; a GPU may take the checkpoint's 16-bit dtype);
    None where the model is not a local folder the native engine's loader reads."""
    model = _local_model(spec)
    if model is None:
        return None
    try:
        per_token = read_model_args(model, vision=spec.engine.backend == "vllm").kv_bytes_per_token_per_elem
    except (ValueError, KeyError, TypeError, OSError):  # an architecture only vLLM runs
        return None
    dtype, device = spec.engine.dtype, spec.engine.device
    elem = 4 if dtype == "float32" or (dtype == "auto" and device == "cpu") else 2
    return spec.engine.block_size * per_token * elem


def _this_machine() -> list[int]:
    """[this machine's physical memory in bytes], or [] where the system does not say."""
    try:
        return [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (AttributeError, ValueError, OSError):
        return []


def _generation_config_problem(spec: JobSpec) -> str | None:
    """The model's generation_config.json as the job will read it (invalid JSON, a bad value
    the spec does not override), named by its file."""
    try:
        spec.to_config().sampling_params  # reads generation_config.json and checks it against the spec
    except ValueError as e:
        return str(e)
    return None


def _local_model(spec: JobSpec) -> Path | None:
    """The model's folder when `model` names a local folder that resolves, else None."""
    if model_kind(spec.model) != "folder":
        return None
    try:
        return resolve_model(spec.model)
    except ValueError:
        return None


# Files that hold a tokenizer's vocabulary: prefixflow/tokenizer.py reads tokenizer.json directly,
# transformers' AutoTokenizer the others; tokenizer_config.json alone is not a tokenizer.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.txt", "tekken.json")


def _tokenizer_problem(model: Path) -> str | None:
    names = {p.name for p in model.iterdir()}
    if names & set(VOCAB_FILES) or any(n.endswith(".tiktoken") for n in names):
        return None
    if {"vocab.json", "merges.txt"} <= names:
        return None
    missing = (
        "merges.txt (beside vocab.json)"
        if "vocab.json" in names
        else "tokenizer.json (or a vocabulary file: tokenizer.model, vocab.json with merges.txt, vocab.txt)"
    )
    return (
        f"{str(model)!r} has no tokenizer: {missing} is missing (config.json and the weights "
        "are there); copy the tokenizer files from where the model came from "
        "(tokenizer.save_pretrained writes them)"
    )


# Names of the token embedding in the architectures transformers and vLLM load.
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header


def _vocab_problem(model: Path, config: dict[str, Any]) -> str | None:
    """config.json's vocab_size against the rows of the embedding in the weights (read from
    the safetensors headers only: no weights are loaded). A mismatch fails the weight load
    late; a huge vocab_size asks for memory no machine has."""
    vocab = config.get("vocab_size")
    if vocab is None:  # a nested config (text_config): left to the engine
        return None
    where = str(model / "config.json")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        return f"{where!r} has vocab_size={short(vocab)}, not a positive integer: fix vocab_size"
    try:
        found = _embedding_rows(model)
    except ValueError as e:
        return str(e)
    if found is None or found[2] == vocab:
        return None
    name, file, rows = found
    return (
        f"{where!r} has vocab_size {vocab}, which disagrees with the weights ({name} has "
        f"{rows} rows in {file}): fix vocab_size (to {rows}), or copy the model again"
    )


def _embedding_rows(model: Path) -> tuple[str, str, int] | None:
    """(tensor name, file name, rows) of the token embedding, or None when no tensor has one
    of the EMBEDDINGS names. Raises ValueError naming a file that is not safetensors."""
    files = weight_files(model)
    index = model / "model.safetensors.index.json"
    if index.is_file():  # read only the shard that holds the embedding
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = {weight_map[n] for n in weight_map if n.endswith(EMBEDDINGS)}
        files = [f for f in files if f.name in shards]
    for file in files:
        header = _safetensors_header(file)
        name = next((n for n in header if n.endswith(EMBEDDINGS)), None)
        if name is None:
            continue
        shape = header[name].get("shape")
        if isinstance(shape, list) and shape and isinstance(shape[0], int):
            return name, file.name, shape[0]
    return None


def _safetensors_header(file: Path) -> dict[str, Any]:
    """The JSON header at the start of a safetensors file: 8 bytes of little-endian length,
    then {tensor name: {dtype, shape, data_offsets}}."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
            raise ValueError("a header that is not a table of tensors")
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(file)!r} is not a safetensors file ({e}): copy the weights again") from None
    return header


def _chat_template_problems(spec: JobSpec, rows: list[dict[str, Any]]) -> Problems:
    """A chat prompt (prompt.user, prompt.messages_column, OpenAI chat requests) for a local
    model without a chat template: every row would become an error record."""
    if spec.prompt is not None:
        field = next((f for f in ("messages_column", "user") if getattr(spec.prompt, f)), None)
        fix = "use prompt.template (a plain-text prompt)"
    else:  # OpenAI batch input: the sampled requests say whether they are chat requests
        good = [r for r in rows if r.get(ERROR) is None]
        field = "input" if good and all(r.get(OPENAI_MESSAGES) is not None for r in good) else None
        fix = "send /v1/completions requests (a prompt)"
    model = _local_model(spec) if field is not None else None
    if model is None or spec.engine.trust_remote_code or _has_chat_template(model):
        return []
    what = "the /v1/chat/completions requests need" if field == "input" else "a chat prompt needs"
    return [
        (
            field if field == "input" else f"prompt.{field}",
            f"{what} the model's chat template, and {str(model)!r} has no chat template (no "
            f"chat_template.jinja, no chat_template in tokenizer_config.json): {fix}, or add the "
            "model's template as chat_template.jinja in its folder",
        )
    ]


def _has_chat_template(model: Path) -> bool:
    """Where tokenizers find one: chat_template.jinja (what prefixflow/tokenizer.py reads first),
    tokenizer_config.json's chat_template (a string, or named templates), and, counted to be
    safe from refusing a model that has one, chat_template.json and additional_chat_templates/."""
    if (model / "chat_template.jinja").is_file() or (model / "additional_chat_templates").is_dir():
        return True
    for name in ("tokenizer_config.json", "chat_template.json"):
        try:
            config = json.loads((model / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("chat_template"):
            return True
    return False


def _output_problems(spec: JobSpec, files: list[str]) -> Problems:
    """The output must be a path (normal_path) that every Ray worker can share and write, and
    must not be an input file, lie in an input folder, hold an input file or be matched by an
    input glob: a job would read its own parts, and overwrite would delete its input."""
    try:
        check_shared(normal_path(spec.output.path), writes=True)
    except ValueError as e:
        return [("output.path", str(e))]
    problems: Problems = []
    problem = _clashes_with_input(spec, files, spec.output.path)
    if problem is not None:
        problems.append(("output.path", problem))
    table = spec.output.table_output()
    problem = None if table is None else table_package_problem(table.format)
    problem = problem or (output_table_problem(table, spec.storage_options()) if table is not None else None)
    if problem is not None:
        problems.append(("output.table", problem))
    return problems


# One file of each kind a job writes in its output folder (operators/results/write.py, commit.py): an
# input glob that matches one of them would read the job's own output on its resume.
WRITTEN = (
    "part-r000-000000000.jsonl",
    "part-r000-000000000.parquet",
    "part-error-000000000.jsonl",
    "part-errors-000000000.jsonl",
    f"{COMMITS}/part-r000-000000000.jsonl.json",
    RESULTS_FILE,
    ERRORS_FILE,
    "metrics.json",
    "plot.png",
    "_SUCCESS",
    JOB_FILE,
    MANIFEST,
    LOCK_FILE,
    f"{TMP_PREFIX}part-r000-000000000.jsonl",
)


def _clashes_with_input(spec: JobSpec, files: list[str], path: str) -> str | None:
    """Why something written at `path` would read or replace the job's input (None: it would
    not). Both sides in normal_path's form: `..`, symbolic links and the scheme's case do not
    hide a clash."""
    from fsspec.utils import glob_translate  # fsspec's own glob rule: what its listing matches

    out = _location(path)
    given = [spec.input.path] if isinstance(spec.input.path, str) else list(spec.input.path or [])
    for pattern in given:
        try:
            where = _location(pattern)
        except ValueError:  # not a path: input.path's own problem, reported beside this
            continue
        if any(ch in pattern for ch in "*?[") and protocol(pattern) not in HTTP:
            matches = re.compile(glob_translate(where)).match
            clash = any(matches(p) for p in (out, *(f"{out}/{name}" for name in WRITTEN)))
        else:
            clash = out == where or _inside(out, where)
        if clash:
            return (
                f"{path!r} is inside the input (input.path {pattern!r} would read what the "
                "job writes there): write it to a folder of its own"
            )
    for file in files:
        if _inside(_location(file), out) or _location(file) == out:
            return f"{path!r} holds the input file {file!r}: write it to a folder of its own"
    return None


def plan_out_problems(spec: JobSpec, out: str) -> Problems:
    """`prefixflow plan --out FILE`: the plan table may not replace or sit in the job's input or
    output, nor replace a file that is not a plan table."""
    storage = spec.storage_options()
    try:
        check_scheme(out)
        check_shared(normal_path(out), writes=True)
    except ValueError as e:
        return [("--out", str(e))]
    try:
        files = list_input_files(spec.input.path, storage) if spec.input.path is not None else []
    except (ValueError, OSError):
        files = []
    problem = _clashes_with_input(spec, files, out)
    if problem is None and (
        _location(out) == _location(spec.output.path) or _inside(_location(out), _location(spec.output.path))
    ):
        problem = f"{out!r} is inside the job's output.path {spec.output.path!r}: write the plan elsewhere"
    if problem is None and _exists_not_plan_table(out, storage):
        problem = (
            f"{out!r} exists and is not a plan table written by `prefixflow plan`: "
            "choose a new file name (nothing was written)"
        )
    return [] if problem is None else [("--out", problem)]


def _exists_not_plan_table(out: str, storage: StorageOptions) -> bool:
    """Whether `out` exists and is not a plan table (a folder, another file: not ours)."""
    import pyarrow.parquet as pq

    try:
        fs = storage.filesystem(out)
        if not fs.exists(out):
            return False
        with fs.open(out, "rb") as f:
            names = set(pq.read_schema(f).names)
    except Exception:  # noqa: BLE001 - not parquet, a folder, unreadable: not a plan table
        return True
    return not {"row_id", "replica", "rank", "group_id", "prefix_len"} <= names


def _output_access_problems(spec: JobSpec, storage: StorageOptions, skip_s3: bool) -> Problems:
    """The output can be written: a local folder that is not a file and can be created in its
    nearest existing folder; an s3:// bucket that exists and answers with these credentials;
    for another URL, a driver installed for its scheme and one request that answers."""
    path = normal_path(spec.output.path)  # _output_problems refused what it refuses
    if is_local(path):
        problem = _local_output_problem(local_path(path))
        return [] if problem is None else [("output.path", problem)]
    if skip_s3:
        return []
    try:
        fs = storage.filesystem(path)
    except ValueError as e:  # no driver for the scheme
        return [("output.path", str(e))]
    if not is_s3(path):
        try:  # one request with the job's settings (credentials, account)
            fs.exists(path)
        except Exception as e:  # noqa: BLE001 - fsspec drivers raise many kinds; one line each
            return [("output.path", _storage_failure(path, e, storage))]
        return []
    bucket, _, key = strip_scheme(path).partition("/")
    try:  # one cheap request: the job lists this prefix (its commit records) anyway
        fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
    except Exception as e:  # noqa: BLE001 - s3fs and botocore raise many kinds; one line each
        return [("output.path", _storage_failure(path, e, storage))]
    return []


def _local_output_problem(path: str) -> str | None:
    out = Path(normal_path(path))
    try:
        existing = next(p for p in (out, *out.parents) if p.exists())
        is_dir = existing.is_dir()
    except OSError as e:  # a parent this user may not look into
        return f"{path!r} cannot be checked ({e}): choose a folder this user can write"
    if not is_dir:
        where = "is a file" if existing == out else f"is inside {str(existing)!r}, which is a file"
        return f"{path!r} {where}: give a folder (it is created when missing)"
    if not os.access(existing, os.W_OK | os.X_OK):  # also False on a read-only mount
        return (
            f"{str(existing)!r} is not writable by this user, so the job cannot write "
            f"{path!r}: choose a folder this user can write, or change its permissions"
        )
    return None


def _storage_failure(path: str, e: BaseException, storage: StorageOptions) -> str:
    """One line for a storage request about `path` that failed: what failed, and the fix."""
    if is_local(path):
        return f"{path!r} cannot be read ({type(e).__name__}: {e})"
    if not is_s3(path):
        return (
            f"{path!r} cannot be reached ({type(e).__name__}: {str(e)[:200]}): check the path "
            f"and the credentials (storage.options.{protocol(path)}, or the environment "
            "variables of its fsspec driver)"
        )
    from botocore import exceptions as boto

    endpoint = storage.endpoint() or "of AWS"
    if isinstance(e, (boto.NoCredentialsError, boto.PartialCredentialsError)):
        return (
            f"{path!r}: no AWS credentials were found: set storage.aws_access_key_id and "
            "storage.aws_secret_access_key (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), "
            "or storage.anonymous: true for a public bucket"
        )
    if isinstance(e, (boto.ConnectionError, boto.HTTPClientError)):
        return (
            f"{path!r}: cannot reach the S3 endpoint {endpoint} ({type(e).__name__}): check "
            "storage.endpoint_url (or AWS_ENDPOINT_URL) and the network"
        )
    if isinstance(e, FileNotFoundError):
        bucket = strip_scheme(path).partition("/")[0]
        return (
            f"{path!r}: the bucket {bucket!r} does not exist (endpoint {endpoint}): create "
            "it, or fix the bucket name or storage.endpoint_url"
        )
    if isinstance(e, PermissionError):
        return (
            f"{path!r}: access denied ({e}): check the credentials (storage.aws_access_key_id "
            "and storage.aws_secret_access_key, or the AWS_* variables) and the bucket's policy"
        )
    return (
        f"{path!r} cannot be listed ({type(e).__name__}: {str(e)[:200]}): check "
        "storage.endpoint_url, storage.region and the credentials (or the AWS_* variables)"
    )


def _first_path(path: str | list[str]) -> str:
    return path if isinstance(path, str) else next((p for p in path if not is_local(p)), path[0])


def _location(path: str) -> str:
    """A comparable form: normal_path's local path (plain), or scheme://bucket/key for URLs."""
    path = normal_path(path)
    if is_local(path):
        return local_path(path)
    name = "s3" if is_s3(path) else protocol(path)
    return f"{name}://" + posixpath.normpath(strip_scheme(path)).strip("/")


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def sample_rows(spec: JobSpec, n: int = SAMPLE_ROWS) -> list[dict[str, Any]]:
    """The first n rows (at most input.limit) of the first input file, as dicts with the
    readers' bookkeeping columns (_pf_source, _pf_error). Read here, without Ray, by the
    job's own parsers, so a row is what the job would see (a table's: its first rows at the
    version the job reads). Raises ValueError or OSError."""
    storage = spec.storage_options()
    n = min(n, spec.input.limit or n)
    table = spec.input.table_input()
    if table is not None:
        return sample_table(pinned(table, storage), storage, n)
    fmt = typing.cast(Format, spec.input_format())
    assert spec.input.path is not None  # file input (InputSpec)
    first = list_input_files(spec.input.path, storage, SUFFIXES[fmt])[0]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with storage.filesystem(first).open(first, "rb") as f:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=n), None)
        return [] if batch is None else batch.to_pylist()[:n]
    # A small file is read whole, as the job reads it, so rows are named by line number; so is
    # one whose HTTP server sends no size (a stream cannot seek to a range).
    size = storage.filesystem(first).size(first)
    end = -1 if size is None or size <= SAMPLE_BYTES else SAMPLE_BYTES
    return parse_file(first, fmt, storage, 0, end).slice(0, n).to_pylist()


def row_problems(spec: JobSpec, rows: list[dict[str, Any]]) -> Problems:
    """Spec errors that the sampled rows show: problems that every row which parsed has."""
    good = [r for r in rows if r.get(ERROR) is None]
    if not good:  # nothing parsed: each row's error says why (row_report)
        return []
    columns = sorted({k for r in good for k in r if not k.startswith("_pf_")})
    problems: Problems = []
    template = spec.prompt_template()
    if template is not None:
        problems += _template_problems(template, good, columns)
    if spec.score is not None and spec.score.choices_column is not None:
        if spec.score.choices_column not in columns:
            problems.append(("score.choices_column", _no_column(spec.score.choices_column, columns)))
    return problems + _sampling_key_problems(good)


def _template_problems(prompt: PromptTemplate, rows: list[dict[str, Any]], columns: list[str]) -> Problems:
    problems: Problems = []
    for field in ("template", "system", "user", "messages_column"):
        value = getattr(prompt, field)
        if value is None:
            continue
        # system alone is no prompt: pair it with a constant user message
        one = PromptTemplate(**{field: value, **({"user": "."} if field == "system" else {})})
        missing = sorted(template_columns(one) - set(columns))
        # A name used only under `{% if x is defined %}` is optional: only a template that
        # fails on every sampled row needs the column.
        if missing and not any(_renders(one, r) for r in rows):
            problems += [(f"prompt.{field}", _no_column(name, columns)) for name in missing]
    return problems


def _renders(prompt: PromptTemplate, row: dict[str, Any]) -> bool:
    try:
        prompt.render(row)
        return True
    except RowError:
        return False


def _no_column(name: str, columns: list[str]) -> str:
    shown = ", ".join(columns[:20]) + (", ..." if len(columns) > 20 else "")
    fix = did_you_mean(name, columns) or "fix the name or the input"
    return f"names column {name!r}, which the input does not have (columns: {shown}); {fix}"


def _sampling_key_problems(rows: list[dict[str, Any]]) -> Problems:
    """Per-row sampling overrides with keys SamplingParams does not know, in every sampled row.
    (Fewer rows: those become error records. Values are checked per row: see row_report.)"""
    known = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown_per_row = []
    for row in rows:
        column = next((c for c in SAMPLING_COLUMNS if row.get(c) is not None), None)
        if column is None:
            continue
        value = row[column]
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            value = None
        # Arrow gives every row all the keys of the column (null where the row has none).
        keys = {k for k, v in value.items() if v is not None} if isinstance(value, dict) else set()
        unknown_per_row.append((column, sorted(keys - set(known))))
    if len(unknown_per_row) < len(rows) or not all(unknown for _, unknown in unknown_per_row):
        return []
    column, unknown = unknown_per_row[0]
    fix = did_you_mean(unknown[0], known) or f"use keys among: {', '.join(known)}"
    return [
        (
            "input",
            f"column {column!r} has keys SamplingParams does not know in every "
            f"sampled row ({', '.join(map(repr, unknown))}): {fix}",
        )
    ]


@dataclass(frozen=True)
class RowReport:
    """What `prefixflow validate` says about the sampled rows."""

    num_rows: int
    num_bad: int
    reasons: tuple[str, ...]  # the first few, "source: why"


def row_report(spec: JobSpec, rows: list[dict[str, Any]], max_reasons: int = 3) -> RowReport:
    """Which sampled rows would become error records (read errors, templates that fail for
    the row, invalid sampling overrides); prompts are not tokenized here."""
    prompt = spec.prompt_template()
    default = _job_sampling(spec)
    bad = []
    for row in rows:
        why = row.get(ERROR) or _row_error(prompt, default, row)
        if why is not None:
            bad.append(f"{row.get(SOURCE) or 'a row'}: {why}")
    return RowReport(num_rows=len(rows), num_bad=len(bad), reasons=tuple(bad[:max_reasons]))


def _job_sampling(spec: JobSpec) -> SamplingParams:
    """The sampling each row's overrides apply to, taken from the job's own config
    (ProcessorConfig.sampling_params: the spec's fields over the model's generation_config.json;
    a row's min_tokens can be valid over one max_tokens and not over the other). A model that is
    not a local folder is not fetched here: the spec's fields alone, over SamplingParams' defaults."""
    if _local_model(spec) is None:
        return SamplingParams().with_overrides(spec.sampling_given())
    return spec.to_config().sampling_params


def _row_error(prompt: PromptTemplate | None, default: SamplingParams, row: dict[str, Any]) -> str | None:
    try:
        check_row_sampling(default, row)  # the tokenize stage's own per-row check
        if prompt is not None:
            prompt.render(row)
    except RowError as e:
        return str(e)
    return None


def check_resources(spec: JobSpec, source: str = "<spec>") -> None:
    """Run right after ray.init: raise SpecError when no node of the cluster could ever hold
    one engine actor (Ray would wait for it forever). An actor needs one node with
    resources.num_cpus_per_replica CPUs and resources.num_gpus_per_replica GPUs. On an
    autoscaling cluster this sees only the nodes present now."""
    import ray

    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    # A node's memory as Ray sees it: what it may give tasks and actors plus its object store.
    memory = [int(n.get("memory", 0) + n.get("object_store_memory", 0)) for n in nodes]
    problems = resource_problems(spec, nodes) or kv_cache_problems(spec, memory)
    if problems:
        raise SpecError(source, problems)


def resource_problems(spec: JobSpec, nodes: list[dict[str, float]]) -> Problems:
    """`nodes`: each alive node's resources, as ray.nodes() gives them ({"CPU": 8, "GPU": 1})."""
    cpus, gpus = spec.resources.num_cpus_per_replica, spec.resources.num_gpus_per_replica
    most_cpus = max((n.get("CPU", 0) for n in nodes), default=0)
    most_gpus = max((n.get("GPU", 0) for n in nodes), default=0)
    if spec.engine.device.startswith("cuda") and most_gpus == 0:
        return [
            (
                "engine.device",
                f"{spec.engine.device!r} but the Ray cluster has no GPU: use "
                "engine.device: cpu (or auto), or run on a cluster with GPUs",
            )
        ]
    if gpus > most_gpus:
        return [
            (
                "resources.num_gpus_per_replica",
                f"{gpus:g} but no node of the Ray cluster has "
                f"more than {most_gpus:g} GPU(s), so no engine actor could start: use at most "
                f"{most_gpus:g}",
            )
        ]
    if cpus > most_cpus:
        return [
            (
                "resources.num_cpus_per_replica",
                f"{cpus:g} but no node of the Ray cluster has "
                f"more than {most_cpus:g} CPU(s), so no engine actor could start: use at most "
                f"{most_cpus:g}",
            )
        ]
    if not any(n.get("CPU", 0) >= cpus and n.get("GPU", 0) >= gpus for n in nodes):
        return [
            (
                "resources",
                f"no node of the Ray cluster has both {cpus:g} CPU(s) and {gpus:g} "
                "GPU(s) (num_cpus_per_replica, num_gpus_per_replica): lower one of them",
            )
        ]
    least = spec.replicas.min if not isinstance(spec.replicas, int) else None
    slots = engine_slots(nodes, cpus, gpus)
    if least is not None and slots < least:
        return [
            (
                "replicas.min",
                f"{least} but the Ray cluster holds {slots} engine(s) of {cpus:g} CPU(s) "
                f"and {gpus:g} GPU(s) at once: lower replicas.min, or start the job on more nodes",
            )
        ]
    return []


def engine_slots(nodes: list[dict[str, float]], cpus: float, gpus: float) -> int:
    """How many engine actors of `cpus` CPUs and `gpus` GPUs the nodes hold at once."""

    def fits(have: float, need: float) -> float:
        return have // need if need > 0 else float("inf")

    total = sum(min(fits(n.get("CPU", 0), cpus), fits(n.get("GPU", 0), gpus)) for n in nodes)
    return int(min(total, 1 << 30))
