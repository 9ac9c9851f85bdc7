"""What a filter of a template would build, estimated from its arguments before it runs
(prefixflow/sandbox.py wraps every filter with these; prefixflow/template_checks.py has the
same for operators and methods, and says why an estimate must come first).

  - center, indent (lines x width), wordwrap (lines x wrapstring, and the copying textwrap
    does for each word longer than the width: quadratic in the word), join, replace, format,
    sum, batch and slice (their lists), list, sort, slice and groupby of a string (a list of
    its characters), tojson (indent x depth, separators), urlize (target and rel per link, and
    the regex work Jinja's urlize spends on runs of punctuation: quadratic in a run);
  - pprint writes into a sink that stops at MAX_TEXT (its indentation grows with depth);
  - a filter that consumes a whole iterable (list, join, sort, ...) gets a lazy one (map,
    select, a generator) as a list built item by item within the limits.
"""

from __future__ import annotations

import io
import json
import pprint
import re
from typing import Any

from prefixflow.template_budget import (
    ITEM_SIZE,
    MAX_WORK,
    Budget,
    TemplateLimitError,
    check_int,
    is_lazy,
    materialized,
    num,
    over,
    size,
)
from prefixflow.template_checks import Check, arg, check_percent, check_replace, joined_size

MAX_REGEX_STEPS = 10_000_000  # about a second of the regex engine, which nothing can interrupt


def _filter_widths(name: str) -> Check:
    def check(args: tuple, kwargs: dict, budget: Budget) -> None:
        for n in (*args[1:], *kwargs.values()):
            check_int(n, f"the {name} filter")

    return check


def _filter_count(param: str) -> Check:
    """batch(linecount) and slice(slices): one step per list they will make, and per filler."""

    def check(args: tuple, kwargs: dict, budget: Budget) -> None:
        n = arg(args, kwargs, 1, param, 0)
        if isinstance(n, int) and n > 0:
            lists = len(args[0]) // n + 1 if param == "linecount" and hasattr(args[0], "__len__") else 0
            budget.step(n + lists)

    return check


def _filter_chars(name: str) -> Check:
    """list, sort, slice, groupby of a string: a list of its characters."""

    def check(args: tuple, kwargs: dict, budget: Budget) -> None:
        if isinstance(args[0], (str, bytes)):
            over(len(args[0]) * (1 + ITEM_SIZE), f"the {name} filter would make a list")

    return check


def _filter_indent(args: tuple, kwargs: dict, budget: Budget) -> None:
    value, width = args[0], arg(args, kwargs, 1, "width", 4)
    check_int(width, "the indent filter")
    if isinstance(value, str):
        each = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        over(len(value) + (value.count("\n") + 1) * each, "the indent filter would make a value")


# Where textwrap may end a line (its whitespace) and where str.splitlines does (Jinja's wordwrap
# wraps each line alone): each one can start a line of the output.
_LINE_STARTS = "\t\n\x0b\x0c\r \x1c\x1d\x1e\x85\u2028\u2029"
_TEXTWRAP_SPACE = "\t\n\x0b\x0c\r "


def _filter_wordwrap(args: tuple, kwargs: dict, budget: Budget) -> None:
    """wordwrap(s, width=79, break_long_words=True, wrapstring=None): at most one line per word
    and line, plus one per `width` characters of each word longer than the width, each joined
    by wrapstring; textwrap breaks such a word by copying what is left of it once per line."""
    value, width = args[0], arg(args, kwargs, 1, "width", 79)
    check_int(width, "the wordwrap filter")
    if not isinstance(value, str) or not isinstance(width, int) or width < 1:
        return  # textwrap refuses a width below 1 itself
    wrap = arg(args, kwargs, 3, "wrapstring")
    joiner = len(wrap) if isinstance(wrap, str) else 1  # None: the environment's newline
    breaks_words = arg(args, kwargs, 2, "break_long_words", True)
    at_hyphens = arg(args, kwargs, 4, "break_on_hyphens", True)
    lines = sum(value.count(c) for c in _LINE_STARTS) + 1
    long_word = re.compile(f"[^{re.escape(_TEXTWRAP_SPACE)}]{{{width + 1},}}")
    for word in long_word.finditer(value) if len(value) > width else ():
        n = word.end() - word.start()
        lines += (n // width if breaks_words else 0) + (word.group().count("-") if at_hyphens else 0)
        copied = n * (n // width) // 2 if breaks_words else 0
        if budget.work + copied > MAX_WORK:
            raise TemplateLimitError(
                f"the wordwrap filter would copy {num(copied)} characters to break a "
                f"word of {n:,} into lines of {width:,} (the limit is {MAX_WORK:,} in all)"
            )
        budget.charge(copied)
        over(len(value) + lines * joiner, "the wordwrap filter would make a value")
    over(len(value) + lines * joiner, "the wordwrap filter would make a value")


def _filter_replace(args: tuple, kwargs: dict, budget: Budget) -> None:
    """replace(s, old, new, count): Jinja makes numbers text first."""
    old, new = (
        str(x) if isinstance(x, (int, float)) else x for x in (arg(args, kwargs, 1, "old"), arg(args, kwargs, 2, "new"))
    )
    check_replace(args[0], old, new, arg(args, kwargs, 3, "count"))


def _filter_format(args: tuple, kwargs: dict, budget: Budget) -> None:
    if isinstance(args[0], str):
        check_percent(args[0], kwargs or args[1:], budget)


def _filter_join(args: tuple, kwargs: dict, budget: Budget) -> None:
    value, sep = args[0], arg(args, kwargs, 1, "d", "")
    if isinstance(sep, str):
        over(joined_size(value, len(sep), budget), "the join filter would make a value")


def _filter_sum(args: tuple, kwargs: dict, budget: Budget) -> tuple | None:
    """sum(start=[]) concatenates: the iterable is made a list to measure what it would make."""
    if isinstance(arg(args, kwargs, 2, "start", 0), (int, float)) or isinstance(args[0], (str, bytes)):
        return None  # numbers (or a string, which sum refuses)
    items = list(args[0])  # a lazy one came as a list already (sandbox.py's MATERIALIZING)
    total = sum(size(x, budget) for x in items)
    over(total, "the sum filter would make a value")
    budget.charge(total * len(items))  # each addition copies what it has so far
    return (items, *args[1:])


def filter_tojson(indent_at: int, separators_at: int | None) -> Check:
    """tojson: Jinja's (value, indent) or a chat template's (x, ensure_ascii, indent,
    separators, sort_keys). With an indent, every line carries indent x depth characters;
    with separators, every item one: those are measured by encoding in pieces, counted."""

    def check(args: tuple, kwargs: dict, budget: Budget) -> None:
        indent = arg(args, kwargs, indent_at, "indent")
        seps = None if separators_at is None else arg(args, kwargs, separators_at, "separators")
        width = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        check_int(width, "tojson's indent")
        long_seps = (
            tuple(seps)
            if isinstance(seps, (list, tuple))
            and len(seps) == 2
            and all(isinstance(s, str) for s in seps)
            and len(seps[0]) + len(seps[1]) > 4
            else None
        )
        if width <= 0 and long_seps is None:
            return  # escaping grows a value a few times at most
        over(max(width, 0) * (_depth(args[0]) + 1), "tojson's indent would make a line")
        encoder = json.JSONEncoder(indent=indent, separators=long_seps, ensure_ascii=False)
        made = 0
        try:
            for piece in encoder.iterencode(args[0]):
                made += len(piece)
                over(made, "the tojson filter would make a value")
        except (TypeError, ValueError):
            return  # not JSON: the filter says so itself

    return check


def _depth(value: Any) -> int:
    """How deeply lists, tuples and dicts nest in `value` (the value is within MAX_TEXT, so the
    walk over its expansion is too)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            deepest = max(deepest, depth + 1)
            stack.extend((x, depth + 1) for x in (item.values() if isinstance(item, dict) else item))
    return deepest


# Jinja's urlize strips a word's trailing punctuation with re.search(r"([)>.,\n]|&gt;)+$"),
# which tries every start in a run: k(k+1)/2 steps for a run of k (20,000 dots: 42 s, one call).
_PUNCTUATION_RUN = re.compile(r"(?:[).,>]|&gt;){2,}")


def _filter_urlize(args: tuple, kwargs: dict, budget: Budget) -> None:
    """urlize(value, trim_url_limit, nofollow, target, rel, extra_schemes)."""
    value = args[0]
    if not isinstance(value, str):
        return
    steps = 0
    for run in _PUNCTUATION_RUN.finditer(value):
        k = len(run.group()) - 3 * run.group().count("&gt;")
        steps += k * (k + 1) // 2
        if steps > MAX_REGEX_STEPS:
            raise TemplateLimitError(
                "the urlize filter would search runs of punctuation "
                f"({k:,} characters in a row) more than {MAX_REGEX_STEPS:,} "
                "times"
            )
    added = sum(len(x) for x in (arg(args, kwargs, 3, "target"), arg(args, kwargs, 4, "rel")) if isinstance(x, str))
    if added:
        links = value.count(".") + value.count("@") + value.count(":") + 1  # a link has one
        over(len(value) + links * added, "the urlize filter would make a value")


class _Sink(io.StringIO):
    """Text written piece by piece, refused past MAX_TEXT."""

    def __init__(self, what: str):
        super().__init__()
        self.made, self.what = 0, what

    def write(self, text: str) -> int:
        self.made += len(text)
        over(self.made, self.what)
        return super().write(text)


def bounded_pprint(value: Any) -> str:
    """Jinja's pprint filter (pprint.pformat), written into a sink that stops at MAX_TEXT: each
    nested line is indented by the keys and brackets above it, so the text can grow with
    depth x items."""
    sink = _Sink("the pprint filter would make a value")
    pprint.PrettyPrinter(stream=sink).pprint(value)
    return sink.getvalue()[:-1]  # pprint ends with a newline, pformat does not


def _all(*checks: Check) -> Check:
    def check(args: tuple, kwargs: dict, budget: Budget) -> None:
        for one in checks:
            one(args, kwargs, budget)

    return check


# Built-in filters that build in proportion to an argument: checked before they run.
FILTER_CHECKS: dict[str, Check] = {
    "center": _filter_widths("center"),
    "indent": _filter_indent,
    "wordwrap": _filter_wordwrap,
    "batch": _filter_count("linecount"),
    "slice": _all(_filter_count("slices"), _filter_chars("slice")),
    "replace": _filter_replace,
    "format": _filter_format,
    "join": _filter_join,
    "sum": _filter_sum,
    "list": _filter_chars("list"),
    "sort": _filter_chars("sort"),
    "groupby": _filter_chars("groupby"),
    "tojson": filter_tojson(1, None),
    "urlize": _filter_urlize,
}
# Filters that consume their whole input: a lazy one is made a list first, within the limits.
MATERIALIZING = frozenset({"list", "join", "sort", "reverse", "slice", "groupby", "sum"})


def checked_filter_args(name: str, check: Check | None, args: tuple, kwargs: dict, budget: Budget) -> tuple:
    """A filter's arguments once what it would build is within the limits."""
    if not args:
        return args
    if name in MATERIALIZING and is_lazy(args[0]):
        args = (materialized(args[0], budget, f"the {name} filter's list"), *args[1:])
    size(args[0], budget)  # e.g. a namespace whose attributes were set since
    if check is not None:
        args = check(args, kwargs, budget) or args
    return args
