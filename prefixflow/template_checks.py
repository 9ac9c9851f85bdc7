"""What an operation of a template would build, estimated from its arguments before it runs
(prefixflow/sandbox.py calls these; the limits are prefixflow/template_budget.py's).

A render's time limit (prefixflow/deadline.py) stops Python code between two bytecodes, but not
one C call: `('\\t' * 100000).expandtabs(10000)` built 10^9 characters (2.1 GB) in one call
before its size could be looked at (issue 43). So every operation whose result grows with an
argument is refused first when the estimate passes a limit:
  - `*` (repetition counts), `**` (power sizes), `+`, `%` (widths, and fields x the largest
    argument), str.format widths (counted as the fields are made);
  - str/bytes methods: center, ljust, rjust, zfill, to_bytes (widths), expandtabs (tabs x tab
    size), translate (what the table maps each character to), replace (occurrences x growth),
    join (items x separator), split with a separator (pieces);
  - filters: prefixflow/template_filters.py.
What no estimate here covers grows by at most the few times that escaping or printing adds to
a value already within MAX_TEXT.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, TypeVar

from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter

from prefixflow.template_budget import (
    ITEM_SIZE,
    MAX_INT_BITS,
    MAX_TEXT,
    Budget,
    TemplateLimitError,
    check_int,
    is_lazy,
    materialized,
    num,
    over,
    size,
)

Check = Callable[[tuple, dict, Budget], "tuple | None"]  # (args, kwargs, budget) -> new args or None


def check_binop(op: str, left: Any, right: Any, budget: Budget) -> None:
    """Refuse `left op right` when its result would pass a limit, before computing it."""
    sequences = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(
                    f"'*' would make an integer of about "
                    f"{left.bit_length() + right.bit_length():,} bits (the "
                    f"limit is {MAX_INT_BITS:,})"
                )
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, sequences) and isinstance(n, int) and n > 0:
            over(size(seq, budget) * n, "'*' would make a value")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            bits = right * (abs(left).bit_length() - 1)  # at least this many
            if bits > MAX_INT_BITS:
                raise TemplateLimitError(
                    f"'**' would make an integer of at least {num(bits)} bits (the limit is {MAX_INT_BITS:,})"
                )
    elif op == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            over(size(left, budget) + size(right, budget), "'+' would make a value")
    elif op == "%" and isinstance(left, (str, bytes)):
        check_percent(left, right, budget)


# printf-style fields: (width, precision, conversion); "%%" has conversion "%".
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def check_percent(fmt: str | bytes, args: Any, budget: Budget) -> None:
    """`fmt % args`: every width and precision (`*` takes the next argument) at most MAX_TEXT,
    and the result (its fields filled with the largest argument) within MAX_TEXT."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    values = list(args.values()) if isinstance(args, Mapping) else (list(args) if isinstance(args, tuple) else [args])
    fields = [f for f in _PERCENT_FIELD.findall(text) if f[2] != "%"]
    position = 0
    for width, precision, _ in fields:
        for n in (width, precision):
            if n == "*":
                check_int(values[position] if position < len(values) else 0, "a '%*' width")
                position += 1
            elif n:
                check_int(int(n) if len(n) < 10 else MAX_TEXT + 1, "a '%' width or precision")
        position += 1
    largest = max((size(v, budget) for v in values), default=0)
    over(len(text) + len(fields) * largest, "'%' would make a value")


class BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, each field's width checked and the result's length counted."""

    made = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        for digits in re.findall(r"\d+", format_spec):
            check_int(int(digits) if len(digits) < 10 else MAX_TEXT + 1, "a format width or precision")
        text = super().format_field(value, format_spec)
        self.made += len(text)
        over(self.made, "format() would make a value")
        return text


class BoundedEscapeFormatter(BoundedFormatter, SandboxedEscapeFormatter):
    pass


_Text = TypeVar("_Text", str, bytes)  # a text of one kind, and its arguments of the same kind

# Methods of str, bytes and int whose integer arguments are sizes of what they build.
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "to_bytes"})


def method_args(method: Any, args: tuple, kwargs: dict, budget: Budget) -> tuple:
    """A str, bytes or int method's arguments once what it would build is within the limits
    (a lazy iterable given to join() comes back as a list)."""
    name, owner = method.__name__, method.__self__
    if not isinstance(owner, (str, bytes, bytearray, int)):
        return args
    if name in _WIDTH_METHODS:
        for n in (*args, *kwargs.values()):
            check_int(n, f"{name}()")
    if isinstance(owner, int):
        return args
    if name == "expandtabs":
        tab_size = arg(args, kwargs, 0, "tabsize", 8)
        if isinstance(tab_size, int):
            tabs = owner.count("\t") if isinstance(owner, str) else owner.count(b"\t")
            over(len(owner) + tabs * max(tab_size - 1, 0), "expandtabs() would make a value")
    elif name == "translate" and isinstance(owner, str) and args:
        over(_translated_size(owner, args[0]), "translate() would make a value")
    elif name == "replace" and len(args) >= 2:
        check_replace(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    elif name == "join" and args:
        items = materialized(args[0], budget) if is_lazy(args[0]) else args[0]
        over(joined_size(items, len(owner), budget), "join() would make a value")
        return (items, *args[1:])
    elif name in ("split", "rsplit"):
        _check_split(owner, arg(args, kwargs, 0, "sep"), arg(args, kwargs, 1, "maxsplit", -1), name)
    return args


def _translated_size(text: str, table: Any) -> int:
    """len(text.translate(table)) at most: each character counts what the table maps it to."""
    longer: dict[str, int] = {}
    for char in set(text):
        try:
            to = table[ord(char)]
        except (LookupError, TypeError):  # not in the table: the character stays
            continue
        n = len(to) if isinstance(to, str) else (0 if to is None else 1)
        if n > 1:
            longer[char] = n - 1
    if len(longer) > 16:  # one pass over the text instead of one per character
        counts = Counter(text)
        return len(text) + sum(counts[c] * extra for c, extra in longer.items())
    return len(text) + sum(text.count(c) * extra for c, extra in longer.items())


def check_replace(text: Any, old: Any, new: Any, count: Any) -> None:
    """text.replace(old, new, count), when all three are str or all three bytes."""
    if isinstance(text, str):
        if isinstance(old, str) and isinstance(new, str):
            _check_replace(text, old, new, count)
    elif isinstance(text, bytes) and isinstance(old, bytes) and isinstance(new, bytes):
        _check_replace(text, old, new, count)


def _check_replace(text: _Text, old: _Text, new: _Text, count: Any) -> None:
    if len(new) > len(old):
        n = text.count(old)  # old "" occurs len + 1 times
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        over(len(text) + n * (len(new) - len(old)), "replace() would make a value")


def _check_split(text: str | bytes | bytearray, sep: Any, maxsplit: Any, name: str) -> None:
    """split(sep): a list of count(sep) + 1 pieces (splitting on whitespace makes fewer pieces
    than the text has characters, each one a few bytes: left to the result's check)."""
    if isinstance(sep, type(text)) and sep and isinstance(maxsplit, int):
        found = text.count(sep)  # type: ignore[arg-type]  # sep is a type(text): mypy cannot pair the unions
        pieces = found if maxsplit < 0 else min(found, maxsplit)
        over(len(text) + ITEM_SIZE * (pieces + 1), f"{name}() would make a list")


def joined_size(items: Any, sep: int, budget: Budget) -> int:
    """What joining `items` (a string joins its characters) with a separator of `sep` characters
    makes, at most."""
    if isinstance(items, (str, bytes)):
        return len(items) + sep * max(len(items) - 1, 0)
    if not hasattr(items, "__len__"):
        return 0
    content = sum(len(x) if isinstance(x, (str, bytes)) else size(x, budget) for x in items)
    return content + sep * max(len(items) - 1, 0)


def arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """An argument by position or by keyword."""
    return args[i] if len(args) > i else kwargs.get(name, default)
