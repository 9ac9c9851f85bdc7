"""Tokenize stage: rows -> prompt token ids, in parallel Ray tasks (one tokenizer per worker process).

Adds `_pf_tokens` (list<int32>; empty for a bad row) and `_pf_max_tokens` (the row's own
max_tokens, null where its overrides set none) and updates `_pf_error`: a row whose
template fails, whose prompt is empty or longer than the context becomes an error record
here and is left out of the plan. Chat prompts go through the model's chat template (or the
config's chat_template), and plain prompts through the spec's template: both render in the one
bounded sandbox (prefixflow/sandbox.py; the chat template through prefixflow/tokenizer.chat_text),
so a template that builds too much or runs too long is that row's error record.

The stage is `tokenize_batch`, a map_batches function run as tasks (fused with the read), not
an actor pool: Ray Data makes a pool's actors restartable with their constructor arguments in
the object store, which Ray's core reports as an error line (`E ... core_worker.cc: ... has
constructor arguments in the object store and max_restarts > 0`) on every good job. A task
needs neither, and Ray retries it like any task when its worker dies. Each worker process loads
the tokenizer once and keeps it for the job's next batches; it also caps its memory
(CappedTokenize: MEMORY_HEADROOM_BYTES past what it holds once loaded), so whatever no limit
foresaw fails that batch with MemoryError instead of exhausting the node.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from prefixflow.images import image_key, load_image
from prefixflow.lora import ADAPTER_COLUMN, row_adapter
from prefixflow.operators.columns import ADAPTER, ERROR, IMAGE_AT, IMAGE_KEYS, IMAGES
from prefixflow.operators.config import TokenizeOptions
from prefixflow.operators.row_sampling import SAMPLING_COLUMNS, row_sampling
from prefixflow.operators.stages.openai_batch import URL_TASK
from prefixflow.operators.template import RowError, messages_from_value, template_row_error
from prefixflow.tokenizer import chat_text, load_tokenizer

TOKENS, PROMPT = "_pf_tokens", "_pf_prompt"
# A row's own max_tokens (from its sampling overrides; null: the job's default): the plan's
# output-length hint, so that replicas are balanced for the outputs they will really make.
MAX_TOKENS = "_pf_max_tokens"
POOLING_PARAMS = "pooling_params"  # ray.data.llm's column of a row's vLLM PoolingParams fields
# Columns the OpenAI batch reader fills in place of a template (operators/stages/openai_batch.py).
OPENAI_MESSAGES, OPENAI_PROMPT, OPENAI_MODEL, OPENAI_URL = "_pf_messages", "_pf_prompt_text", "_pf_model", "_pf_url"


class Tokenize:
    """map_batches callable class: loads the tokenizer once per actor."""

    def __init__(self, opts: TokenizeOptions):
        self.opts = opts
        self.tokenizer = load_tokenizer(opts.model, opts.trust_remote_code)

    def __call__(self, table: pa.Table) -> pa.Table:
        rows = table.to_pylist()
        errors: list[str | None] = [r.get(ERROR) for r in rows]
        texts: list[str | None] = [None] * len(rows)
        max_tokens: list[int | None] = [None] * len(rows)
        chat = [False] * len(rows)
        adapters: list[str | None] = [None] * len(rows)
        sources: list[list[Any]] = [[] for _ in rows]  # each row's image sources, in prompt order
        for i, row in enumerate(rows):
            if errors[i] is None:
                try:
                    self._check_url(row)
                    self._check_pooling(row.get(POOLING_PARAMS))
                    adapters[i] = self._adapter(row)
                    max_tokens[i] = self._check_sampling(row)
                    texts[i], chat[i] = self._render(row, sources[i])
                except RowError as e:
                    errors[i] = str(e)
        tokens = self._encode(texts, chat)
        images = [RowImages() for _ in rows]
        for i, ids in enumerate(tokens):
            if errors[i] is None:
                errors[i] = self._check_length(len(ids))
            if errors[i] is None and self.opts.images is not None:
                images[i], errors[i] = row_images(ids, sources[i], self.opts)
            if errors[i] is not None:
                tokens[i] = []
        table = _set_column(table, ERROR, pa.array(errors, pa.string()))
        table = _set_column(table, TOKENS, pa.array(tokens, pa.list_(pa.int32())))
        table = _set_column(table, MAX_TOKENS, pa.array(max_tokens, pa.int64()))
        if self.opts.keep_prompt:
            table = _set_column(table, PROMPT, pa.array(texts, pa.string()))
        if self.opts.adapters is not None:
            table = _set_column(table, ADAPTER, pa.array(adapters, pa.string()))
        if self.opts.images is not None:
            table = _set_column(table, IMAGES, pa.array([r.data for r in images], pa.list_(pa.binary())))
            table = _set_column(table, IMAGE_AT, pa.array([r.at for r in images], pa.list_(pa.int32())))
            table = _set_column(table, IMAGE_KEYS, pa.array([r.keys for r in images], pa.list_(pa.int64())))
        return table

    def _check_pooling(self, value: Any) -> None:
        """A ray.data.llm row's `pooling_params` (vLLM's PoolingParams fields) may only ask for
        what the job does: the engines pool every row of a job alike, so a row asking for
        other dimensions or activation is an error record, never answered otherwise."""
        if value is None or self.opts.task not in ("embed", "classify"):
            return
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise RowError("pooling_params is not a JSON object: give a mapping like {}") from None
        if not isinstance(value, dict):
            raise RowError(f"pooling_params must be a mapping, got {type(value).__name__}")
        for key, given in value.items():
            if given is None or (key == "use_activation" and given == self.opts.pooling_activation):
                continue
            fix = (
                f"the job's is {self.opts.pooling_activation} (embed.normalize)"
                if key == "use_activation"
                else "the engines pool every row of a job alike"
            )
            raise RowError(f"pooling_params.{key}={given!r} is not honoured per row: {fix}")

    def _check_url(self, row: dict[str, Any]) -> None:
        """An OpenAI batch request asks for the job's task (one job runs one task)."""
        url = row.get(OPENAI_URL)
        if url is not None and URL_TASK.get(url, self.opts.task) != self.opts.task:
            raise RowError(f"url {url} asks for task {URL_TASK[url]}, but this job's task is {self.opts.task}")

    def _adapter(self, row: dict[str, Any]) -> str | None:
        """The LoRA adapter the row's `model` names, or its OpenAI request body's, as vLLM's
        OpenAI server reads it (None: the base model, or no adapters)."""
        if self.opts.adapters is None:
            return None
        model = row.get(OPENAI_MODEL) if OPENAI_MODEL in row else row.get(ADAPTER_COLUMN)
        try:
            return row_adapter(model, self.opts.model, self.opts.adapters)
        except ValueError as e:
            raise RowError(str(e)) from None

    def _check_sampling(self, row: dict[str, Any]) -> int | None:
        if self.opts.sampling is None:
            return None
        return check_row_sampling(self.opts.sampling, row)

    def _render(self, row: dict[str, Any], sources: list[Any]) -> tuple[str, bool]:
        """The prompt text of a row and whether it came from a chat template; the sources of the
        images its messages name are appended to `sources` (a job that takes images)."""
        images = sources if self.opts.images is not None else None
        if self.opts.prompt is not None:
            rendered = self.opts.prompt.render(row, images)
            if isinstance(rendered, str):
                return rendered, False
            return self._chat(rendered), True
        # No template: the row carries its prompt (OpenAI batch body, or ray.data.llm's
        # `messages` / `prompt` columns).
        for column in (OPENAI_MESSAGES, "messages") if self.opts.messages else (OPENAI_MESSAGES,):
            if row.get(column) is not None:
                return self._chat(messages_from_value(row[column], "messages", images)), True
        for column in (OPENAI_PROMPT, "prompt"):
            if row.get(column) is not None:
                text = str(row[column])
                if not text.strip():
                    raise RowError("empty prompt: the prompt text is blank")
                return text, False
        raise RowError(
            "the row has no prompt: give a prompt template, or a `messages` (chat) or `prompt` (text) column"
        )

    def _chat(self, messages: list[dict[str, Any]]) -> str:
        add = self.opts.prompt.add_generation_prompt if self.opts.prompt is not None else True
        if self.opts.continue_last and messages and messages[-1].get("role") != "user":
            add = False
        try:
            return chat_text(
                self.tokenizer,
                messages,
                add_generation_prompt=add,
                chat_template=self.opts.chat_template,
                continue_final_message=self.opts.continue_last and not add,
                **(self.opts.chat_template_kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - the template may refuse roles or orders, or pass a limit: a row error
            raise template_row_error(e, "the chat template") from None

    def _encode(self, texts: list[str | None], chat: list[bool]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in texts]
        for is_chat in (False, True):
            # A chat template writes BOS itself; a plain prompt gets the tokenizer's specials.
            idx = [i for i, t in enumerate(texts) if t is not None and chat[i] == is_chat]
            if idx:
                enc = self.tokenizer([texts[i] for i in idx], add_special_tokens=not is_chat)
                for i, ids in zip(idx, enc["input_ids"]):
                    out[i] = list(ids)
        return out

    def _check_length(self, n: int) -> str | None:
        if n == 0:
            return "empty prompt: it has no tokens"
        if n >= self.opts.max_model_len:
            return (
                f"prompt has {n} tokens but the context is {self.opts.max_model_len} "
                "(engine.max_model_len or the model's max_position_embeddings): shorten the "
                "prompt or raise engine.max_model_len"
            )
        return None


@dataclass(frozen=True)
class RowImages:
    """A row's images: their bytes, the positions of their placeholder tokens, their plan keys."""

    data: list[bytes] = field(default_factory=list)
    at: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)


def row_images(ids: list[int], sources: list[Any], opts: TokenizeOptions) -> tuple[RowImages, str | None]:
    """The images `sources` name, read and checked (opts.images, opts.image_storage), placed at
    the image tokens (opts.image_token_id) of the prompt `ids`; or why the row cannot run (its
    error record)."""
    assert opts.images is not None, "a job that takes images"
    at = [j for j, t in enumerate(ids) if t == opts.image_token_id]  # the text may hold the token too
    if len(at) != len(sources):
        return RowImages(), (
            f"the prompt has {len(at)} image placeholder tokens for {len(sources)} images: the chat "
            "template must write the model's image token once per image part (use the model's own)"
        )
    try:
        data = [load_image(source, opts.images, opts.image_storage) for source in sources]
    except ValueError as e:
        return RowImages(), str(e)
    return RowImages(data, at, [image_key(d) for d in data]), None


MEMORY_HEADROOM_BYTES = 8 << 30  # far past a batch of rows and a render's limits (prefixflow/sandbox.py)


class CappedTokenize(Tokenize):
    """The tokenize stage's Tokenize (`tokenize_batch`), whose process may hold at most
    MEMORY_HEADROOM_BYTES more than it holds once loaded. The cap is the kernel's RLIMIT_DATA
    (heap and private mappings; Ray's shared object store is not counted): past it an allocation
    fails with MemoryError, which a render turns into its row's error record, instead of the node
    running out of memory. Ray's own `memory=` option only reserves memory when tasks are placed;
    nothing enforces it. Only the stage's Ray workers are capped: a Tokenize inside the user's
    process or an engine actor (operators/faces/batch_generator.py) is not."""

    def __init__(self, opts: TokenizeOptions):
        super().__init__(opts)
        cap_data_memory(MEMORY_HEADROOM_BYTES)


# This worker process's tokenizer: the last job's (a worker serves one Ray job at a time).
_LOADED: list[CappedTokenize] = []


def tokenize_batch(table: pa.Table, opts: TokenizeOptions) -> pa.Table:
    """map_batches function of the tokenize stage (operators/faces/processor.py): `table`'s rows
    tokenized by this process's CappedTokenize for `opts`, loaded by its first batch."""
    if not _LOADED or _LOADED[0].opts != opts:
        _LOADED[:] = [CappedTokenize(opts)]
    return _LOADED[0](table)


def cap_data_memory(headroom: int) -> int | None:
    """Lower this process's RLIMIT_DATA to what it holds now plus `headroom`; returns the cap
    (None where the process's size cannot be read: not Linux)."""
    import resource  # Unix only, like the cap

    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmData:\s+(\d+) kB", status, re.M)
    if found is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = int(found.group(1)) * 1024 + headroom
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft == resource.RLIM_INFINITY or cap < soft:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    return cap


def check_row_sampling(default: Any, row: dict[str, Any]) -> int | None:
    """A row's sampling overrides must make valid SamplingParams over `default` (else RowError:
    the row becomes an error record); returns the row's max_tokens when it has overrides.
    Used by the tokenize stage and by preflight."""
    value = next((row[c] for c in SAMPLING_COLUMNS if row.get(c) is not None), None)
    if value is None:
        return None
    try:
        return row_sampling(default, value).max_tokens
    except ValueError as e:
        raise RowError(f"invalid sampling parameters for this row: {e}") from None


def _set_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, values)
    return table.append_column(name, values)
