"""What one template render may build and do: the limits, and the budget that counts them
(prefixflow/sandbox.py renders every template within them; prefixflow/template_checks.py
estimates what an operation would build before it runs).

A value is at most MAX_TEXT in size: a string its length, an integer its digits, a container
1 + ITEM_SIZE per item + its items' sizes (about what printing it makes), nested values counted
in full. An integer has at most MAX_INT_BITS bits. One Budget per render counts loop
iterations, calls and range() items (MAX_STEPS) and the characters and items built (MAX_WORK);
the render's clock is checked at each step and by prefixflow/deadline.py. Going past a limit raises TemplateLimitError,
which makes the row an error record (operators/template.py, operators/stages/tokenize.py).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jinja2 import TemplateError
from jinja2.utils import Namespace

MAX_TEXT = 10_000_000  # characters (and items) of one value or prompt: ~2.5M tokens, past any context
MAX_INT_BITS = 10_000  # ~3,000 digits (Python refuses to print more than 4,300)
MAX_STEPS = 250_000  # loop iterations + calls + range() items per render (~0.1-1 s)
MAX_WORK = 100_000_000  # characters and items built per render
ITEM_SIZE = 8  # what a list item adds to a value's size: a list of 10M one-letter strings is
# 50M characters printed and seconds of work per pass, so containers stop near 1M items
MAX_RENDER_SECONDS = 5.0  # a normal render takes well under a millisecond

_V = TypeVar("_V")  # bounded() hands back the value it was given


class TemplateLimitError(TemplateError):
    """A template went past one of the limits above; its row becomes an error record."""


@dataclass
class Budget:
    """What one render has used so far, and until when it may run: the clock is checked at
    each step too, besides prefixflow/deadline.py's watchdog, which stops a step itself."""

    seconds: float = MAX_RENDER_SECONDS
    steps: int = 0
    work: int = 0
    deadline: float = 0.0
    # id -> (container, expanded size). Sandboxed code cannot mutate a list, tuple or dict, so a
    # size holds for the whole render; keeping the object keeps its id from being reused.
    sizes: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(f"more than {MAX_STEPS:,} loop iterations, calls and range() items")
        if time.monotonic() > self.deadline:
            raise self.too_long()

    def too_long(self) -> TemplateLimitError:
        return TemplateLimitError(f"rendering took more than {self.seconds:g} s")

    def charge(self, n: int) -> None:
        self.work += n
        if self.work > MAX_WORK:
            raise TemplateLimitError(f"built more than {MAX_WORK:,} characters and items in all")


BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("prefixflow_template_budget", default=None)


def current() -> Budget:
    """This render's budget; outside a render a fresh one, so the size checks still hold."""
    return BUDGET.get() or Budget()


def num(n: int) -> str:
    return f"{n:,}" if n.bit_length() < 128 else f"about 2**{n.bit_length()}"


def over(size: int, what: str = "a value") -> None:
    """TemplateLimitError when `size` passes MAX_TEXT; `what` says what would have been made."""
    if size > MAX_TEXT:
        raise TemplateLimitError(
            f"{what} of size {num(size)} (characters, and {ITEM_SIZE} per list item; the limit is {MAX_TEXT:,})"
        )


def check_int(n: Any, what: str, limit: int = MAX_TEXT) -> None:
    """A width or count argument: at most `limit`."""
    if isinstance(n, int) and n > limit:
        raise TemplateLimitError(f"{what} was given {num(n)} (the limit is {limit:,})")


CONTAINERS = (list, tuple, dict, set, frozenset, Namespace)


def _items(value: Any) -> Iterator[Any]:
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # Namespace lets this one name through
    if isinstance(value, dict):
        return (x for pair in value.items() for x in pair)
    return iter(value)


def _length(container: Any) -> int:
    return len(container._Namespace__attrs) if isinstance(container, Namespace) else len(container)


def size(value: Any, budget: Budget) -> int:
    """The size of `value` (the module docstring). Each container is walked once per render
    (depth-first, explicit stack) and remembered, so a list holding another many times costs
    its length, not its expansion. Raises past MAX_TEXT."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, int):  # printed, 10,000 bits are 3,011 digits
        return value.bit_length() * 3 // 10 + 1
    if not isinstance(value, CONTAINERS):
        return 1
    known = budget.sizes.get(id(value))
    if known is not None:
        return known[1]
    budget.sizes[id(value)] = (value, 1)  # while walked: a namespace inside itself counts 1
    budget.charge(_length(value))
    stack = [[value, _items(value), 1]]
    try:
        return _walk(stack, budget)
    except TemplateLimitError:
        for container, _, _ in stack:  # no provisional size may outlive the walk
            budget.sizes.pop(id(container), None)
        raise


def _walk(stack: list[list[Any]], budget: Budget) -> int:
    """size's depth-first walk: each frame is [container, iterator over its items, size]."""
    while True:
        top = stack[-1]
        for item in top[1]:
            if isinstance(item, str):
                top[2] += ITEM_SIZE + len(item)
            elif isinstance(item, CONTAINERS) and id(item) not in budget.sizes:
                budget.sizes[id(item)] = (item, 1)
                budget.charge(_length(item))
                stack.append([item, _items(item), 1])
                break
            else:
                top[2] += ITEM_SIZE + size(item, budget)
            over(top[2])
        else:
            stack.pop()
            # A namespace's attributes can be set again later: measure it afresh each time.
            if isinstance(top[0], Namespace):
                del budget.sizes[id(top[0])]
            else:
                budget.sizes[id(top[0])] = (top[0], top[2])
            if not stack:
                total: int = top[2]  # a frame's size
                return total
            stack[-1][2] += ITEM_SIZE + top[2]
            over(stack[-1][2])


def bounded(value: _V, budget: Budget) -> _V:
    """`value` once it is within the limits; what it took to build is charged."""
    if isinstance(value, str):
        over(len(value))
        budget.charge(len(value))
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"an integer of {value.bit_length():,} bits (the limit is {MAX_INT_BITS:,})")
        return value
    total = size(value, budget)  # a container's walk is charged as it goes
    over(total)
    if isinstance(value, (bytes, bytearray)):
        budget.charge(total)
    return value


def is_lazy(value: Any) -> bool:
    """An iterable whose size is known only by running it: map, select, a generator."""
    return not hasattr(value, "__len__") and hasattr(value, "__iter__")


def materialized(items: Iterable[Any], budget: Budget, what: str = "a list") -> list[Any]:
    """A lazy iterable as a list, built item by item within the limits (one step per item)."""
    out: list[Any] = []
    total = 1
    for item in items:
        budget.step()
        total += ITEM_SIZE + size(item, budget)
        over(total, what)
        out.append(item)
    return out
