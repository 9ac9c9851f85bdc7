"""The bounded Jinja sandbox every template renders in: prompt templates (operators/template.py)
and a model's chat template (prefixflow/tokenizer.py), one environment of each kind.

Jinja's immutable sandbox keeps a template from running code; this one also keeps it from
exhausting the machine (issues 27 and 43): `{{ 'a' * 10**12 }}`, `{{ 10 ** (10 ** 10) }}`,
`{{ range(10**9) | list }}`, two nested loops of 100,000, `('a' * 500000) | wordwrap(1)` or
`('\t' * 100000).expandtabs(10000)` raised MemoryError or ran for hours, in `validate`, in the
tokenize stage, and in a model's chat template, which transformers renders without limits.
  - what an operation would build is estimated from its arguments and refused before it runs
    (prefixflow/template_checks.py): widths, counts, repetition, tab sizes, translation
    tables, separators, indents; every value built is at most MAX_TEXT in size and every
    integer MAX_INT_BITS (prefixflow/template_budget.py);
  - loop iterations, calls and range() items count against MAX_STEPS, the characters and
    items built against MAX_WORK;
  - a render stops after MAX_RENDER_SECONDS wherever its time goes, inside a filter too
    (prefixflow/deadline.py);
  - the rendered text, `{% set %}` blocks and macro output are at most MAX_TEXT characters.
When a template is compiled, loops and list/tuple/dict literals are routed through budget filters
(`_Rewrite`) and `~` through `bounded_join` (`_BoundedCodeGenerator`). Every filter takes the
context, which also stops Jinja from running filters with constant arguments while it compiles,
so compiling a template (spec validation) never builds a value. Going past a limit raises
TemplateLimitError (a row error). Normal templates render exactly as in Jinja's sandbox, and
chat templates exactly as transformers renders them; compiled templates are cached.

    compiled(source, chat)        the template, compiled once per process
    render(source, values, chat)  rendered within a fresh budget and the time limit
    environment(chat)             the bounded environment (for parsing: template_columns)
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache, update_wrapper
from typing import Any, Callable

import jinja2.ext
from jinja2 import StrictUndefined, Template, TemplateError, Undefined, nodes, pass_context
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import LoopContext
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from prefixflow.deadline import TimeLimitExceeded, time_limit
from prefixflow.template_budget import (
    BUDGET,
    MAX_RENDER_SECONDS,
    MAX_TEXT,
    Budget,
    TemplateLimitError,
    bounded,
    current,
    num,
    over,
    size,
)
from prefixflow.template_checks import BoundedEscapeFormatter, BoundedFormatter, Check, check_binop, method_args
from prefixflow.template_filters import FILTER_CHECKS, bounded_pprint, checked_filter_args, filter_tojson

__all__ = ["MAX_TEXT", "TemplateLimitError", "compiled", "environment", "render"]


def _bounded_filter(name: str, func: Callable[..., Any], check: Check | None = None) -> Callable[..., Any]:
    """A filter with its pre-check and result check. Taking the context also keeps Jinja from
    running it while compiling (it folds constant filter calls)."""
    passes = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    check = check or FILTER_CHECKS.get(name)

    def bounded_call(context: Any, *args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.step()
        args = checked_filter_args(name, check, args, kwargs, budget)
        if passes == "context":
            args = (context, *args)
        elif passes == "eval_context":
            args = (context.eval_ctx, *args)
        elif passes == "environment":
            args = (context.environment, *args)
        return bounded(func(*args, **kwargs), budget)

    # after update_wrapper, which copies the filter's own jinja_pass_arg
    return pass_context(update_wrapper(bounded_call, func))


class _Counted:
    """A loop's iterable, one step per item (len() as the iterable's, for loop.length)."""

    __slots__ = ("items",)

    def __init__(self, items: Any):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        budget = current()
        for item in self.items:
            budget.step()
            yield item


@pass_context
def _loop_items(context: Any, items: Any) -> _Counted:
    return _Counted(items)


@pass_context
def _literal(context: Any, value: Any) -> Any:
    """A list, tuple or dict literal: `[a, a, a]` nested ten deep is a bomb too."""
    return bounded(value, current())


def _range(*args: Any) -> range:
    items = range(*args)
    n = max(0, -((items.start - items.stop) // items.step))  # len(), which fails past sys.maxsize
    if n > MAX_RANGE:
        raise TemplateLimitError(f"range() of {num(n)} items (the limit is {MAX_RANGE:,} per call)")
    current().step(n)
    return items


def _lipsum(*args: Any, **kwargs: Any) -> str:
    """Jinja's lipsum(n=5, html=True, min=20, max=100): n paragraphs of up to max words."""
    given = {**dict(zip(("n", "html", "min", "max"), args)), **kwargs}
    counts = [given.get(k, d) for k, d in (("n", 5), ("min", 20), ("max", 100))]
    if all(isinstance(c, int) for c in counts):
        current().step(max(counts[0], 0) * max(counts[1], counts[2], 0))
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


def _filter(node: nodes.Node, name: str) -> nodes.Filter:
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
        self.filters["pprint"] = bounded_pprint
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(_pf_loop=_loop_items, _pf_literal=_literal)
        self.globals.update(range=_range, lipsum=_lipsum)

    @staticmethod
    def concat(parts: Any) -> str:
        """Joins the rendered text, and a `{% set %}` block's, a macro's or a filter block's
        output: the parts are references, measured before one string is made of them."""
        parts = list(parts)
        over(sum(map(len, parts)), "output")
        return "".join(parts)

    @staticmethod
    def bounded_join(join: Callable[[Any], str], parts: tuple[Any, ...]) -> str:
        """`a ~ b`: measured before it is joined."""
        budget = current()
        over(sum(size(p, budget) for p in parts), "'~' would make a value")
        return bounded(join(parts), budget)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current()
        check_binop(operator, left, right, budget)
        return bounded(self.binop_table[operator](left, right), budget)

    # `__self`, as Jinja names it: a template's keyword argument `self` passes through
    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.step()
        if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop
            args = (_Counted(args[0]), *args[1:])
        elif isinstance(__obj, (types.BuiltinMethodType, types.MethodType)):  # Markup's are Python
            args = method_args(__obj, args, kwargs, budget)
        return bounded(super().call(__context, __obj, *args, **kwargs), budget)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format / format_map as Jinja's sandbox runs them, with BoundedFormatter."""
        if not (
            isinstance(value, (types.MethodType, types.BuiltinMethodType))
            and value.__name__ in ("format", "format_map")
            and isinstance(value.__self__, str)
        ):
            return None  # the same test as Jinja's
        text: str = value.__self__
        format_map = value.__name__ == "format_map"

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            if format_map:  # Jinja's own checks
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs = args[0]
                args = ()
            formatter = (
                BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) else BoundedFormatter(self)
            )
            return bounded(type(text)(formatter.vformat(text, args, kwargs)), current())

        return update_wrapper(bounded_format, value)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' chat templates may use to
    mark the assistant's text: rendered as its body (transformers also records where it is,
    for training masks, which prompts do not need)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' tojson for chat templates: JSON without Jinja's HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: Any) -> str:
    if isinstance(fmt, str):  # a directive prints at most a few dozen characters
        over(len(fmt) + 64 * fmt.count("%"), "strftime_now() would make a value")
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=2)
def environment(chat: bool = False) -> _BoundedEnvironment:
    """The prompt templates' environment (StrictUndefined: a missing column fails its row), or
    (chat) a model's chat template's, set up as transformers sets up its own: trim_blocks,
    lstrip_blocks, loop controls, {% generation %}, Jinja's lenient Undefined, a tojson that
    does not escape HTML, raise_exception and strftime_now."""
    if not chat:
        return _BoundedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True)
    env = _BoundedEnvironment(
        undefined=Undefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _bounded_filter("tojson", _tojson, filter_tojson(2, 3))
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


@lru_cache(maxsize=256)
def compiled(source: str, chat: bool = False) -> Template:
    """Compiled once per process (a spec has at most three templates, a model one)."""
    return environment(chat).from_string(source)


def render(source: str, values: dict[str, Any], chat: bool = False) -> str:
    """`source` rendered with `values` within the limits (a fresh budget and clock). Raises
    TemplateLimitError past a limit, and whatever else the template raises."""
    budget = Budget(seconds=MAX_RENDER_SECONDS)
    token = BUDGET.set(budget)
    try:
        with time_limit(MAX_RENDER_SECONDS):
            return compiled(source, chat).render(values)  # joined by _BoundedEnvironment.concat
    except TimeLimitExceeded:
        raise budget.too_long() from None
    finally:
        BUDGET.reset(token)
