"""A time limit on a piece of Python code that holds inside any Python function it calls.

    with time_limit(5.0):
        ...   # raises TimeLimitExceeded in this thread once 5 s have passed

A template render (prefixflow/sandbox.py) spends its time in filters and methods that its own
checks cannot see into: `('a' * 500000) | wordwrap(1)` is one call of textwrap's quadratic loop
(7 s per row, issue 43). Checking a clock between the template's own steps cannot stop that,
and a trace function on every call made each render 3x slower. Instead one watchdog thread per
process, waking every TICK seconds, raises TimeLimitExceeded into a thread whose limit has
passed (CPython's PyThreadState_SetAsyncExc), which Python delivers at that thread's next
bytecode: inside textwrap, pprint, Jinja or our own code alike. A single C call (one str
method) runs to its end first, which is why the sandbox also bounds the size of every value
before it is built.

TimeLimitExceeded is a BaseException, so `except Exception` in the code it interrupts does not
swallow it; Python itself drops one that arrives in a gc callback or a __del__, so the watchdog
raises again every RETRY_SECONDS, DELIVERIES times at most, while the thread is still inside
(the sandbox also checks its clock at each step of a template: prefixflow/template_budget.py).
It raises only while the thread is inside the block: leaving it ends the raising and withdraws
one not yet delivered, so nothing is raised later in unrelated code.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from types import TracebackType
from typing import Any

TICK = 0.1  # seconds: how late past its limit a thread may be stopped
RETRY_SECONDS = 0.5
DELIVERIES = 3


class TimeLimitExceeded(BaseException):
    """The code inside `time_limit` ran past its limit."""


class _Watchdog:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        # thread id -> [when to raise next, deliveries left]
        self.deadlines: dict[int, list[Any]] = {}
        threading.Thread(target=self._run, name="prefixflow-time-limit", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            with self.lock:
                for tid, due in list(self.deadlines.items()):
                    if due[0] <= now:
                        _raise_in(tid, TimeLimitExceeded)
                        due[0], due[1] = now + RETRY_SECONDS, due[1] - 1
                        if due[1] == 0:
                            del self.deadlines[tid]


def _raise_in(tid: int, exc: type[BaseException] | None) -> None:
    """Deliver `exc` at thread `tid`'s next bytecode (None withdraws one not yet delivered)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


_watchdog: _Watchdog | None = None
_start = threading.Lock()


def _reset_after_fork() -> None:
    global _watchdog, _start
    _watchdog, _start = None, threading.Lock()  # the child has no watchdog thread


os.register_at_fork(after_in_child=_reset_after_fork)


class time_limit:  # lower case: used as a function: `with time_limit(5.0):`
    """Raise TimeLimitExceeded in this thread once `seconds` have passed inside the block. A
    block inside another keeps the outer one's limit."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.inner = False

    def __enter__(self) -> None:
        global _watchdog
        with _start:
            if _watchdog is None:
                _watchdog = _Watchdog()
        with _watchdog.lock:
            self.inner = threading.get_ident() in _watchdog.deadlines
            if not self.inner:
                _watchdog.deadlines[threading.get_ident()] = [time.monotonic() + self.seconds, DELIVERIES]

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.inner or _watchdog is None:
            return
        tid = threading.get_ident()
        while True:  # until the watchdog has let go of this thread, even if it raises meanwhile
            try:
                with _watchdog.lock:
                    _watchdog.deadlines.pop(tid, None)
                _raise_in(tid, None)  # withdraw one raised but not delivered yet
                return
            except TimeLimitExceeded:
                continue
