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
swallow it. The watchdog raises at most once per `time_limit` and only while the thread is
inside it; leaving the block withdraws one not yet delivered, so nothing is raised later in
unrelated code.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from types import TracebackType

TICK = 0.1  # seconds: how late past its limit a thread may be stopped


class TimeLimitExceeded(BaseException):
    """The code inside `time_limit` ran past its limit."""


class _Watchdog:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deadlines: dict[int, float] = {}  # thread id -> when to stop it
        threading.Thread(target=self._run, name="prefixflow-time-limit", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            with self.lock:
                for tid in [t for t, when in self.deadlines.items() if when <= now]:
                    del self.deadlines[tid]  # once: the thread is told, and left alone after
                    _raise_in(tid, TimeLimitExceeded)


def _raise_in(tid: int, exc: type[BaseException] | None) -> None:
    """Deliver `exc` at thread `tid`'s next bytecode (None withdraws one not yet delivered)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


_watchdog: _Watchdog | None = None
_start = threading.Lock()


def _reset_after_fork() -> None:
    global _watchdog, _start
    _watchdog, _start = None, threading.Lock()  # the child has no watchdog thread


os.register_at_fork(after_in_child=_reset_after_fork)


class time_limit:  # noqa: N801 - used as a function: `with time_limit(5.0):`
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
                _watchdog.deadlines[threading.get_ident()] = time.monotonic() + self.seconds

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.inner or _watchdog is None:
            return
        tid = threading.get_ident()
        with _watchdog.lock:  # from here on the watchdog leaves this thread alone
            fired = _watchdog.deadlines.pop(tid, None) is None
        if fired:  # raised already (then this is a no-op), or on its way: withdraw it
            _raise_in(tid, None)
