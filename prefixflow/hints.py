"""The did-you-mean hint of error messages, built one way for every unknown name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ "did you mean 'x'?" for the known name closest to `name`, or "" when none is close."""
    near = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {near[0]!r}?" if near else ""
