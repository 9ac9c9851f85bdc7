"""A bounded Jinja sandbox for prompt templates (operators/template.py renders in it).

Jinja's immutable sandbox keeps a template from running code; this one also keeps it from
exhausting the machine (issue 27): `{{ 'a' * 10**12 }}`, `{{ 10 ** (10 ** 10) }}`,
`{{ range(10**9) | list }}` or two nested loops of 100,000 raised MemoryError or ran for hours,
in `validate` and in the tokenize stage. `_BoundedEnvironment` checks what an operation would
build before it runs it, and one `_Budget` per render bounds the work:
  - `*`, `**`, `+`, `%`, `~`, filters and method calls refuse to build a string, list or tuple
    of more than MAX_TEXT characters (a list or dict item counts ITEM_SIZE more, about what
    printing it adds), or an integer of more than MAX_INT_BITS bits:
    repetition counts, power sizes, width arguments (center, ljust, indent, zfill, ...), `%` and
    format widths, replace and join results are checked first. Sizes count nested values in
    full (so nested list literals cannot bomb either) and are computed once per container.
  - loop iterations, calls and range() items count against MAX_STEPS, the characters and items
    built against MAX_WORK, and a render stops after MAX_RENDER_SECONDS;
  - the rendered text, `{% set %}` blocks and macro output are at most MAX_TEXT characters.
When a template is compiled, loops and list/tuple/dict literals are routed through budget filters
(`_Rewrite`) and `~` through `bounded_join` (`_BoundedCodeGenerator`). Every filter takes the
context, which also stops Jinja from running filters with constant arguments while it compiles,
so compiling a template (spec validation) never builds a value. Going past a limit raises
TemplateLimitError (a row error, operators/template.py). Normal templates render exactly as in
Jinja's sandbox; compiled templates are cached, so a row costs less than before.

    compiled(source)        the template, compiled once per process
    render(source, values)  rendered within a fresh budget
    environment()           the bounded environment (for parsing: template_columns)
"""

from __future__ import annotations

import contextvars
import re
import time
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache, update_wrapper
from typing import Any, Callable

from jinja2 import StrictUndefined, TemplateError, nodes, pass_context
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import LoopContext
from jinja2.sandbox import (MAX_RANGE, ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                            SandboxedFormatter)
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

MAX_TEXT = 10_000_000  # characters (and items) of one value or prompt: ~2.5M tokens, past any context
MAX_INT_BITS = 10_000  # ~3,000 digits (Python refuses to print more than 4,300)
MAX_STEPS = 250_000  # loop iterations + calls + range() items per render (~0.1-1 s)
MAX_WORK = 100_000_000  # characters and items built per render
ITEM_SIZE = 8  # what a list item adds to a value's size: a list of 10M one-letter strings is
# 50M characters printed and seconds of work per pass, so containers stop near 1M items
MAX_RENDER_SECONDS = 5.0  # a normal render takes well under a millisecond
class TemplateLimitError(TemplateError):
    """A template went past one of the limits above; its row becomes an error record."""


@dataclass
class _Budget:
    """What one render has used so far (see _render)."""

    steps: int = 0
    work: int = 0
    deadline: float = field(default_factory=lambda: time.monotonic() + MAX_RENDER_SECONDS)
    # id -> (container, expanded size). Sandboxed code cannot mutate a list, tuple or dict, so a
    # size holds for the whole render; keeping the object keeps its id from being reused.
    sizes: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"more than {MAX_STEPS:,} loop iterations, calls and range() items")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took more than {MAX_RENDER_SECONDS:g} s")

    def charge(self, n: int) -> None:
        self.work += n
        if self.work > MAX_WORK:
            raise TemplateLimitError(f"built more than {MAX_WORK:,} characters and items in all")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("prefixflow_template_budget",
                                                                          default=None)


def _budget() -> _Budget:
    """This render's budget; outside a render a fresh one, so the size checks still hold."""
    return _BUDGET.get() or _Budget()


def _num(n: int) -> str:
    return f"{n:,}" if n.bit_length() < 128 else f"about 2**{n.bit_length()}"


def _over(size: int, what: str = "a value") -> None:
    if size > MAX_TEXT:
        raise TemplateLimitError(f"{what} of size {_num(size)} (characters, and {ITEM_SIZE} per list "
                                 f"item; the limit is {MAX_TEXT:,})")


def _check_int(n: Any, what: str, limit: int = MAX_TEXT) -> None:
    """A width or count argument: at most `limit`."""
    if isinstance(n, int) and n > limit:
        raise TemplateLimitError(f"{what} was given {_num(n)} (the limit is {limit:,})")


_CONTAINERS = (list, tuple, dict, set, frozenset, Namespace)


def _items(value: Any) -> Iterator[Any]:
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # Namespace lets this one name through
    if isinstance(value, dict):
        return (x for pair in value.items() for x in pair)
    return iter(value)


def _size(value: Any, budget: _Budget) -> int:
    """The size of `value`, nested values counted in full: a string its length, a container
    1 + ITEM_SIZE per item + its items' sizes, anything else 1. Each container
    is walked once per render (depth-first, explicit stack) and remembered, so a list holding
    another many times costs its length, not its expansion. Raises past MAX_TEXT."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if not isinstance(value, _CONTAINERS):
        return 1
    known = budget.sizes.get(id(value))
    if known is not None:
        return known[1]
    budget.sizes[id(value)] = (value, 1)  # while walked: a namespace inside itself counts 1
    budget.charge(len(value._Namespace__attrs) if isinstance(value, Namespace) else len(value))
    stack = [[value, _items(value), 1]]
    try:
        return _walk(stack, budget)
    except TemplateLimitError:
        for container, _, _ in stack:  # no provisional size may outlive the walk
            budget.sizes.pop(id(container), None)
        raise


def _walk(stack: list[list[Any]], budget: _Budget) -> int:
    """_size's depth-first walk: each frame is [container, iterator over its items, size]."""
    while True:
        top = stack[-1]
        for item in top[1]:
            if isinstance(item, str):
                top[2] += ITEM_SIZE + len(item)
            elif isinstance(item, _CONTAINERS) and id(item) not in budget.sizes:
                budget.sizes[id(item)] = (item, 1)
                budget.charge(len(item._Namespace__attrs) if isinstance(item, Namespace) else len(item))
                stack.append([item, _items(item), 1])
                break
            else:
                top[2] += ITEM_SIZE + _size(item, budget)
            _over(top[2])
        else:
            stack.pop()
            # A namespace's attributes can be set again later: measure it afresh each time.
            if isinstance(top[0], Namespace):
                del budget.sizes[id(top[0])]
            else:
                budget.sizes[id(top[0])] = (top[0], top[2])
            if not stack:
                return top[2]
            stack[-1][2] += ITEM_SIZE + top[2]
            _over(stack[-1][2])


def _bounded(value: Any, budget: _Budget) -> Any:
    """`value` once it is within the limits; what it took to build is charged."""
    if isinstance(value, str):
        _over(len(value))
        budget.charge(len(value))
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"an integer of {value.bit_length():,} bits (the limit is "
                                     f"{MAX_INT_BITS:,})")
        return value
    size = _size(value, budget)  # a container's walk is charged as it goes
    _over(size)
    if isinstance(value, (bytes, bytearray)):
        budget.charge(size)
    return value


def _check_binop(op: str, left: Any, right: Any, budget: _Budget) -> None:
    """Refuse `left op right` when its result would pass a limit, before computing it."""
    sequences = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"'*' would make an integer of about "
                                         f"{left.bit_length() + right.bit_length():,} bits (the "
                                         f"limit is {MAX_INT_BITS:,})")
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, sequences) and isinstance(n, int) and n > 0:
            _over(_size(seq, budget) * n, "'*' would make a value")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            bits = right * (abs(left).bit_length() - 1)  # at least this many
            if bits > MAX_INT_BITS:
                raise TemplateLimitError(f"'**' would make an integer of at least {_num(bits)} bits "
                                         f"(the limit is {MAX_INT_BITS:,})")
    elif op == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            _over(_size(left, budget) + _size(right, budget), "'+' would make a value")
    elif op == "%" and isinstance(left, (str, bytes)):
        _check_percent(left, right, budget)


# printf-style fields: (width, precision, conversion); "%%" has conversion "%".
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def _check_percent(fmt: str | bytes, args: Any, budget: _Budget) -> None:
    """`fmt % args`: every width and precision (`*` takes the next argument) at most MAX_TEXT,
    and the result (its fields filled with the largest argument) within MAX_TEXT."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    values = list(args.values()) if isinstance(args, Mapping) else (
        list(args) if isinstance(args, tuple) else [args])
    fields = [f for f in _PERCENT_FIELD.findall(text) if f[2] != "%"]
    position = 0
    for width, precision, _ in fields:
        for n in (width, precision):
            if n == "*":
                _check_int(values[position] if position < len(values) else 0, "a '%*' width")
                position += 1
            elif n:
                _check_int(int(n) if len(n) < 10 else MAX_TEXT + 1, "a '%' width or precision")
        position += 1
    largest = max((_size(v, budget) for v in values), default=0)
    _over(len(text) + len(fields) * largest, "'%' would make a value")


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, each field's width checked and the result's length counted."""

    made = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        for digits in re.findall(r"\d+", format_spec):
            _check_int(int(digits) if len(digits) < 10 else MAX_TEXT + 1, "a format width or precision")
        text = super().format_field(value, format_spec)
        self.made += len(text)
        _over(self.made, "format() would make a value")
        return text


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    pass


# Methods of str, bytes and int whose integer arguments are sizes of what they build.
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "to_bytes"})


def _check_method(method: Any, args: tuple, kwargs: dict, budget: _Budget) -> None:
    name, owner = method.__name__, method.__self__
    if not isinstance(owner, (str, bytes, bytearray, int)):
        return
    if name in _WIDTH_METHODS:
        for n in (*args, *kwargs.values()):
            _check_int(n, f"{name}()")
    elif name == "replace" and isinstance(owner, (str, bytes)) and len(args) >= 2:
        _check_replace(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    elif name == "join" and isinstance(owner, (str, bytes)) and args and isinstance(args[0], (list, tuple)):
        _over(_size(args[0], budget) + len(owner) * len(args[0]), "join() would make a value")


def _check_replace(text: Any, old: Any, new: Any, count: Any) -> None:
    kind = str if isinstance(text, str) else bytes
    if not (isinstance(text, kind) and isinstance(old, kind) and isinstance(new, kind)):
        return
    if len(new) > len(old):
        n = text.count(old)  # old "" occurs len + 1 times
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _over(len(text) + n * (len(new) - len(old)), "replace() would make a value")


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """A filter's argument by position (0 is the filtered value) or by keyword."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def _filter_widths(name: str) -> Callable[[tuple, dict, _Budget], None]:
    def check(args: tuple, kwargs: dict, budget: _Budget) -> None:
        for n in (*args[1:], *kwargs.values()):
            _check_int(n, f"the {name} filter")
    return check


def _filter_count(param: str) -> Callable[[tuple, dict, _Budget], None]:
    """batch(linecount) and slice(slices): one step per list they will make, and per filler."""
    def check(args: tuple, kwargs: dict, budget: _Budget) -> None:
        n = _arg(args, kwargs, 1, param, 0)
        if isinstance(n, int) and n > 0:
            lists = len(args[0]) // n + 1 if param == "linecount" and hasattr(args[0], "__len__") else 0
            budget.step(n + lists)
    return check


def _filter_indent(args: tuple, kwargs: dict, budget: _Budget) -> None:
    value, width = args[0], _arg(args, kwargs, 1, "width", 4)
    _check_int(width, "the indent filter")
    if isinstance(value, str):
        each = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _over(len(value) + (value.count("\n") + 1) * each, "the indent filter would make a value")


def _filter_wordwrap(args: tuple, kwargs: dict, budget: _Budget) -> None:
    _filter_widths("wordwrap")(args, kwargs, budget)
    value, wrap = args[0], _arg(args, kwargs, 4, "wrapstring")
    if isinstance(value, str) and isinstance(wrap, str):  # at most one line per word
        lines = len(value.split()) + value.count("\n") + 1
        _over(len(value) + lines * len(wrap), "the wordwrap filter would make a value")


def _filter_replace(args: tuple, kwargs: dict, budget: _Budget) -> None:
    if len(args) >= 3:
        _check_replace(args[0], args[1], args[2], _arg(args, kwargs, 3, "count"))


def _filter_format(args: tuple, kwargs: dict, budget: _Budget) -> None:
    if isinstance(args[0], str):
        _check_percent(args[0], kwargs or args[1:], budget)


def _filter_join(args: tuple, kwargs: dict, budget: _Budget) -> None:
    value, sep = args[0], _arg(args, kwargs, 1, "d", "")
    if isinstance(value, (list, tuple)) and isinstance(sep, str):
        _over(_size(value, budget) + len(sep) * len(value), "the join filter would make a value")


def _filter_sum(args: tuple, kwargs: dict, budget: _Budget) -> tuple | None:
    """sum(start=[]) concatenates: the iterable is made a list to measure what it would make."""
    if len(args) < 1 or isinstance(_arg(args, kwargs, 3, "start", 0), (int, float)):
        return None
    items = list(args[0])
    total = sum(_size(x, budget) for x in items)
    _over(total, "the sum filter would make a value")
    budget.charge(total * len(items))  # each addition copies what it has so far
    return (items, *args[1:])


# Built-in filters that build in proportion to an argument: checked before they run.
_FILTER_CHECKS: dict[str, Callable[[tuple, dict, _Budget], tuple | None]] = {
    "center": _filter_widths("center"), "indent": _filter_indent, "wordwrap": _filter_wordwrap,
    "batch": _filter_count("linecount"), "slice": _filter_count("slices"),
    "replace": _filter_replace, "format": _filter_format, "join": _filter_join, "sum": _filter_sum}


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """A built-in filter with its pre-check and result check. Taking the context also keeps
    Jinja from running it while compiling (it folds constant filter calls)."""
    passes = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    check = _FILTER_CHECKS.get(name)

    def bounded(context: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        if args:
            _size(args[0], budget)  # e.g. a namespace whose attributes were set since
            if check is not None:
                args = check(args, kwargs, budget) or args
        if passes == "context":
            args = (context, *args)
        elif passes == "eval_context":
            args = (context.eval_ctx, *args)
        elif passes == "environment":
            args = (context.environment, *args)
        return _bounded(func(*args, **kwargs), budget)

    # after update_wrapper, which copies the filter's own jinja_pass_arg
    return pass_context(update_wrapper(bounded, func))


class _Counted:
    """A loop's iterable, one step per item (len() as the iterable's, for loop.length)."""

    __slots__ = ("items",)

    def __init__(self, items: Any):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        budget = _budget()
        for item in self.items:
            budget.step()
            yield item


@pass_context
def _loop_items(context: Any, items: Any) -> _Counted:
    return _Counted(items)


@pass_context
def _literal(context: Any, value: Any) -> Any:
    """A list, tuple or dict literal: `[a, a, a]` nested ten deep is a bomb too."""
    return _bounded(value, _budget())


def _range(*args: Any) -> range:
    items = range(*args)
    n = max(0, -((items.start - items.stop) // items.step))  # len(), which fails past sys.maxsize
    if n > MAX_RANGE:
        raise TemplateLimitError(f"range() of {_num(n)} items (the limit is {MAX_RANGE:,} per call)")
    _budget().step(n)
    return items


def _lipsum(*args: Any, **kwargs: Any) -> str:
    """Jinja's lipsum(n=5, html=True, min=20, max=100): n paragraphs of up to max words."""
    given = {**dict(zip(("n", "html", "min", "max"), args)), **kwargs}
    counts = [given.get(k, d) for k, d in (("n", 5), ("min", 20), ("max", 100))]
    if all(isinstance(c, int) for c in counts):
        _budget().step(max(counts[0], 0) * max(counts[1], counts[2], 0))
    return generate_lorem_ipsum(*args, **kwargs)


class _Rewrite(NodeTransformer):
    """Routes loops and literals through the budget filters (see the module docstring)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _filter(node.iter, "_pf_loop")
        return node

    def _literal(self, node: nodes.Expr) -> nodes.Node:
        self.generic_visit(node)
        return _filter(node, "_pf_literal") if getattr(node, "ctx", "load") == "load" else node

    visit_List = visit_Tuple = visit_Dict = _literal


def _filter(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _BoundedCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        _Rewrite().visit(node)
        for child in node.find_all(nodes.Filter):
            child.set_environment(self.environment)
        super().visit_Template(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        """`a ~ b`: Jinja's own code, through environment.bounded_join."""
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.bounded_join({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the limits of the module docstring."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(_pf_loop=_loop_items, _pf_literal=_literal)
        self.globals.update(range=_range, lipsum=_lipsum)

    @staticmethod
    def concat(parts: Any) -> str:  # type: ignore[override]
        """Joins the rendered text, and a `{% set %}` block's, a macro's or a filter block's
        output: the parts are references, measured before one string is made of them."""
        parts = list(parts)
        _over(sum(map(len, parts)), "output")
        return "".join(parts)

    @staticmethod
    def bounded_join(join: Callable[[Any], str], parts: tuple[Any, ...]) -> str:
        """`a ~ b`: measured before it is joined."""
        budget = _budget()
        _over(sum(_size(p, budget) for p in parts), "'~' would make a value")
        return _bounded(join(parts), budget)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        _check_binop(operator, left, right, budget)
        return _bounded(self.binop_table[operator](left, right), budget)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.step()
        if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop
            args = (_Counted(args[0]), *args[1:])
        elif isinstance(__obj, (types.BuiltinMethodType, types.MethodType)):  # Markup's are Python
            _check_method(__obj, args, kwargs, budget)
        return _bounded(super().call(__context, __obj, *args, **kwargs), budget)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / format_map as Jinja's sandbox runs them, with _BoundedFormatter."""
        if not (isinstance(value, (types.MethodType, types.BuiltinMethodType))
                and value.__name__ in ("format", "format_map") and isinstance(value.__self__, str)):
            return None  # the same test as Jinja's
        text: str = value.__self__
        format_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if format_map:  # Jinja's own checks
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                args, kwargs = (), args[0]
            formatter = (_BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup)
                         else _BoundedFormatter(self))
            return _bounded(type(text)(formatter.vformat(text, args, kwargs)), _budget())

        return update_wrapper(bounded, value)


@lru_cache(maxsize=1)
def environment() -> _BoundedEnvironment:
    return _BoundedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True)


@lru_cache(maxsize=256)
def compiled(source: str) -> Any:
    """Compiled once per process (a spec has at most three templates)."""
    return environment().from_string(source)



def render(source: str, values: dict[str, Any]) -> str:
    """`source` rendered with `values` within the limits (a fresh budget). Raises
    TemplateLimitError past a limit, and whatever else the template raises."""
    token = _BUDGET.set(_Budget())
    try:
        return compiled(source).render(values)  # joined by _BoundedEnvironment.concat
    finally:
        _BUDGET.reset(token)
