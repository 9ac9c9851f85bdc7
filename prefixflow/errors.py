"""How error messages are built, one way everywhere (torch-free, imports nothing of ours).

    invalid("EngineConfig", "block_size", 3, "use a power of two")
        -> InvalidSetting("EngineConfig.block_size=3 is invalid: use a power of two"), a
           ValueError that also carries owner, name, value and fix
    require(block_size in SIZES, "EngineConfig", "block_size", block_size, "use a power of two")
        -> raises that ValueError when the condition is false (every dataclass's check)
    one_of(("fcfs", "dfs")) -> "use one of 'fcfs', 'dfs'" (the fix of every choice check)
    did_you_mean("pathh", ["path", "format"]) -> "did you mean 'path'?"

The job spec (jobs/spec.py `_describe`) takes the field and the fix from an InvalidSetting's
attributes (never from its text), so a dataclass check and the spec name the same field with
the same fix.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 2, 80, 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 4
HUGE_INT = 10**40  # repr of a longer int is long, or refused (Python's int-to-str digit limit)


def short(value: Any) -> str:
    """repr of a value from a user, bounded: a YAML alias or a long template may make it huge."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= HUGE_INT:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    return _repr.repr(value)


class InvalidSetting(ValueError):
    """`owner.name=value` is invalid, and `fix` says how to fix it; the message says all of it.
    The parts stay readable (`value` as the message shows it), so that a caller who names the
    setting its own way (the job spec's field path, a file's key) builds its message from them
    instead of parsing this one."""

    def __init__(self, owner: str, name: str, value: str, fix: str):
        self.owner, self.name, self.value, self.fix = owner, name, value, fix
        super().__init__(f"{owner}.{name}={value} is invalid: {fix}")

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (a Ray task's error): rebuilt from its parts
        return (InvalidSetting, (self.owner, self.name, self.value, self.fix))


class FieldProblem(ValueError):
    """A problem found with the value of one setting (`field`, as the job spec names it) outside
    its dataclass: `text` starts with the value and says the problem and the fix; the message is
    `field=text`. A caller that lists problems by field (prefixflow validate) takes the parts."""

    def __init__(self, field: str, text: str):
        self.field, self.text = field, text
        super().__init__(f"{field}={text}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (FieldProblem, (self.field, self.text))


def invalid(owner: str, name: str, value: Any, fix: str) -> InvalidSetting:
    """The error for `owner.name=value`, saying how to fix it (raise what it returns)."""
    return InvalidSetting(owner, name, short(value), fix)


def require(ok: bool, owner: str, name: str, value: Any, fix: str) -> None:
    """Raise invalid(owner, name, value, fix) unless `ok`: the one argument check of every
    config dataclass (EngineConfig, ProcessorConfig, SamplingParams, ...)."""
    if not ok:
        raise invalid(owner, name, value, fix)


def one_of(choices: Iterable[Any]) -> str:
    """The fix of a value outside a fixed set of choices, the same wherever it is checked."""
    return f"use one of {', '.join(repr(c) for c in choices)}"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ "did you mean 'x'?" for the known name closest to `name`, or "" when none is close."""
    near = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {near[0]!r}?" if near else ""
