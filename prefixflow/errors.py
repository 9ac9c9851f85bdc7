"""How error messages are built, one way everywhere (torch-free, imports nothing of ours).

    invalid("EngineConfig", "block_size", 3, "use a power of two")
        -> ValueError("EngineConfig.block_size=3 is invalid: use a power of two")
    did_you_mean("pathh", ["path", "format"]) -> "did you mean 'path'?"

The job spec (jobs/spec.py `_describe`) reads the field back out of "<Owner>.<field>=<value> is
invalid: <fix>", so a dataclass check and the spec name the same field with the same fix.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 2, 80, 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 4


def short(value: Any) -> str:
    """repr of a value from a user, bounded: a YAML alias or a long template may make it huge."""
    return _repr.repr(value)


def invalid(owner: str, name: str, value: Any, fix: str) -> ValueError:
    """The ValueError for `owner.name=value`, saying how to fix it (raise what it returns)."""
    return ValueError(f"{owner}.{name}={short(value)} is invalid: {fix}")


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ "did you mean 'x'?" for the known name closest to `name`, or "" when none is close."""
    near = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {near[0]!r}?" if near else ""
