"""Prompt templates rendered in a bounded Jinja sandbox (operators/sandbox.py).

A template comes from a job spec and the values from a dataset, so neither may run code: the
sandbox forbids attribute access to internals and mutation, and StrictUndefined turns a missing
or null column into an error for that row (an error record), never into the text "None".

Nor may a template exhaust the machine (issue 27): past a limit of the sandbox, or on
OverflowError, MemoryError or RecursionError, the row's RowError says "prompt.template
exceeded a template limit for this row: ..."; any other exception the template raises is a
RowError too.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from prefixflow.errors import invalid, short
from prefixflow.images import IMAGE_PART_TYPES, part_image
from prefixflow.sandbox import TemplateLimitError, compiled, environment, render


class RowError(ValueError):
    """This row cannot become a prompt; the message goes into its error record."""


def _syntax_problem(source: str | None) -> str | None:
    """Why `source` is not a valid template (naming the line), or None when it is."""
    if source is None:
        return None
    try:
        compiled(source)
    except TemplateSyntaxError as e:
        return (
            f"not a valid Jinja template (line {e.lineno}: {e.message}): fix the template, "
            'e.g. "Question: {{ question }}"'
        )
    except RecursionError:  # Jinja's parser and compiler recurse once per level of nesting
        return "not a valid Jinja template: it is nested too deeply; fix the template"
    return None


PROMPT_KINDS = ("template", "user", "messages_column")


@dataclass(frozen=True)
class PromptTemplate:
    """How a row becomes a prompt: exactly one of template, user or messages_column.

    template: a plain prompt over the row's columns ("Q: {{ question }}"); BOS is added.
    system, user: chat messages built from the columns, rendered by the model's chat template.
    messages_column: a column holding chat messages ([{role, content}, ...]).
    Templates are Jinja, rendered in a sandbox; a missing column makes that row an error record.
    The job spec's `prompt` section is generated from this class (jobs/spec.py), so both
    refuse the same things with the same messages.
    """

    template: str | None = None
    system: str | None = None
    user: str | None = None
    messages_column: str | None = None
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        for name in ("template", "system", "user", "messages_column"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                _invalid(name, value, f"give text (a string), not a {type(value).__name__}")
        kinds = [k for k in PROMPT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            # Name the extra kind (or template when none is given): the spec reports that field.
            name = kinds[1] if kinds else "template"
            _invalid(
                name,
                getattr(self, name),
                "give exactly one of template, user (with "
                f"optional system) or messages_column; got {', '.join(kinds) or 'none'}",
            )
        if self.system is not None and self.user is None:
            _invalid("system", self.system, "system needs user: a chat prompt has a user message")
        for name in ("template", "system", "user"):
            problem = _syntax_problem(getattr(self, name))
            if problem is not None:
                _invalid(name, getattr(self, name), problem)

    @property
    def is_chat(self) -> bool:
        return self.template is None

    def render(self, row: dict[str, Any], images: list[Any] | None = None) -> str | list[dict[str, Any]]:
        """Plain text for `template`, else a list of chat messages. Raises RowError.
        images: collects the image sources of a messages_column's content parts (messages_from_value)."""
        values = self._values(row)
        if self.template is not None:
            text = _render(self.template, values, "prompt.template")
            if not text.strip():
                raise RowError("empty prompt: the template rendered to blank text for this row")
            return text
        if self.messages_column is not None:
            return messages_from_value(values.get(self.messages_column), self.messages_column, images)
        messages = []
        if self.system is not None:
            messages.append({"role": "system", "content": _render(self.system, values, "prompt.system")})
        user = _render(self.user or "", values, "prompt.user")
        if not user.strip():
            raise RowError("empty prompt: prompt.user rendered to blank text for this row")
        messages.append({"role": "user", "content": user})
        return messages

    def _values(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row's values a template sees: no nulls, no bookkeeping, binary values as the
        UTF-8 text they hold (a parquet binary column would otherwise render as "b'...'") and
        map values as the mapping they hold, as a struct's (Arrow gives "[('k', 'v')]"). A
        binary value that is not UTF-8 fails the row only where the prompt reads it."""
        values = {}
        for k, v in row.items():
            if v is None or k.startswith("_pf_"):
                continue
            if isinstance(v, list) and v and all(isinstance(x, tuple) and len(x) == 2 for x in v):
                v = dict(v)  # a map column: only Arrow's maps come as (key, value) tuples
            if isinstance(v, bytes):
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError as e:
                    if k in self.columns:
                        raise RowError(
                            f"column {k!r} holds bytes that are not UTF-8 text (byte "
                            f"{v[e.start]:#04x} at {e.start}): a prompt is text; "
                            "store the column as text"
                        ) from None
                    continue
            values[k] = v
        return values

    @functools.cached_property
    def columns(self) -> frozenset[str]:
        """The columns this prompt reads (template_columns), worked out once."""
        return frozenset(template_columns(self))


def _invalid(name: str, value: object, fix: str) -> None:
    raise invalid("PromptTemplate", name, value, fix)


def _render(source: str, values: dict[str, Any], field: str) -> str:
    """Render within the sandbox's limits; any failure is the row's RowError."""
    try:
        return render(source, values)
    except Exception as e:  # noqa: BLE001 - whatever the template raises fails its row only
        raise template_row_error(e, field, values) from None


def template_row_error(e: Exception, what: str, values: dict[str, Any] | None = None) -> RowError:
    """The RowError for a template (`what`: its field, or "the chat template") that failed for
    a row: past a limit of the sandbox, or by its own error (with the row's non-null columns
    when `values` are a row's). Messages are clipped: a template's own text may be huge."""
    if isinstance(e, TemplateLimitError):
        return RowError(
            f"{what} exceeded a template limit for this row: {_clip(e.message)}; make the template build less"
        )
    if isinstance(e, (OverflowError, MemoryError, RecursionError)):
        return RowError(
            f"{what} exceeded a template limit for this row ({type(e).__name__}: "
            f"{_clip(e)}); make the template build less"
        )
    if isinstance(e, TemplateError):
        have = "" if values is None else f"; the row's non-null columns are: {', '.join(sorted(values)) or 'none'}"
        return RowError(f"{what} failed for this row: {_clip(e.message or e)}{have}")
    if isinstance(e, ValueError) and values is None:  # a tokenizer refusing (no chat template, ...)
        return RowError(f"{what} failed for this row: {_clip(e)}")
    return RowError(f"{what} failed for this row: {type(e).__name__}: {_clip(e)}")


def _clip(e: object) -> str:
    text = str(e)
    return text if len(text) <= 500 else text[:497] + "..."


def messages_from_value(value: Any, column: str, images: list[Any] | None = None) -> list[dict[str, Any]]:
    """Validate chat messages from a column (a list of {role, content}, or its JSON text).

    images: where a vision-language job collects the image sources of the messages' content
    parts, in order (`content_value`); None: an image part is a RowError."""
    if value is None:
        raise RowError(
            f"column {column!r} is missing or null in this row: it must hold chat "
            'messages [{"role": ..., "content": ...}]'
        )
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RowError(f"column {column!r} is text that is not JSON chat messages") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise RowError(f"column {column!r} must be a non-empty list of chat messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RowError(f"message {i} of column {column!r} needs a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            content = content_value(content, i, images)
        if not isinstance(content, (str, list)):
            raise RowError(f"message {i} of column {column!r} needs string 'content'")
        messages.append({"role": m["role"], "content": content})
    if not any(isinstance(m["content"], list) or m["content"].strip() for m in messages):
        raise RowError("empty prompt: every message of this row has blank content")
    return messages


def content_value(parts: list[Any], index: int, images: list[Any] | None = None) -> str | list[dict[str, str]]:
    """The content of message `index` from its OpenAI content parts: the text parts joined,
    or, where the parts name images and `images` is a list, the parts as vision chat templates
    take them ([{"type": "text", "text": ...}, {"type": "image"}, ...]), each image's source
    appended to `images` (prefixflow/images.py). Any other part (input_audio, file, ...), or an
    image where `images` is None, is a RowError: answering from the text alone would quietly
    change the request."""
    texts: list[dict[str, str]] = []
    has_image = False
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES and images is not None:
            try:
                images.append(part_image(part))
            except ValueError as e:
                raise RowError(f"message {index}: {e}") from None
            texts.append({"type": "image"})
            has_image = True
        elif isinstance(kind, str) and kind != "text":
            why = (
                " (images run on engine.backend vllm with a vision-language model)" if kind in IMAGE_PART_TYPES else ""
            )
            raise RowError(
                f"message {index} has a content part of type {short(kind)}: this model takes text only; remove it{why}"
            )
        else:
            raise RowError(
                f'message {index} has a content part that is not {{"type": "text", "text": ...}}: give text parts only'
            )
    if has_image:
        return texts
    return "".join(t["text"] for t in texts)


def template_columns(prompt: PromptTemplate) -> set[str]:
    """The columns `prompt` reads from a row: its templates' free variables (Jinja's own globals
    such as `range` left out) and its messages_column."""
    from jinja2 import meta

    names: set[str] = set()
    for source in (prompt.template, prompt.system, prompt.user):
        if source is not None:
            names |= meta.find_undeclared_variables(environment().parse(source))
    names -= set(environment().globals)
    if prompt.messages_column is not None:
        names.add(prompt.messages_column)
    return names
