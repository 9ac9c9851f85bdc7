"""A job's console: our plan, progress, answers and errors; Ray's own log lines in a file.

Ray writes its log lines to the driver's stdout and stderr: its Python loggers'
("2026-11-30 03:23:30,355<TAB>INFO worker.py:2038 -- Started a local Ray instance."), its C++
core's ("[2026-11-30 03:23:33,049 E 19234 19234] core_worker.cc:2465: ..."), and its workers'
forwarded with a "(Name pid=N)" prefix. `quiet_console(path)` sends both file descriptors (so
also what C++ and child libraries write) through a filter: every Ray log line goes to the log
file; the console keeps every other line, and Ray's warnings and errors that are not known to
be harmless (KNOWN_HARMLESS). `prefixflow run --verbose` skips the filter.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

# Ray lines that warn on a good run, each with why it is harmless here.
KNOWN_HARMLESS = (
    # A local cluster of Ray 2.60 has token authentication on by default (../shared/NOTES.md).
    "Token authentication is enabled for this Ray cluster",
    # Ray Data's progress bars, which the quiet console turns off (our progress line has the job's).
    "Progress bars disabled. To enable, set",
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_WORKER = r"(?:\([^()]*\)\s+)?"  # "(ReplicaGenerator pid=123) " on a forwarded worker line
_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
_PYTHON_LINE = re.compile(_WORKER + _STAMP + r"\s+(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+:\d+ -- ")
_CORE_LINE = re.compile(_WORKER + r"\[" + _STAMP + r" ([DIWEF]) \d+ \d+\] \S+:\d+: ")
_QUIET_LEVELS = {"DEBUG", "INFO", "D", "I"}


def route(line: str) -> tuple[bool, bool]:
    """(to the log file, to the console) for a line of output: a Ray log line goes to the file,
    and to the console too when it is a warning or error that KNOWN_HARMLESS does not name;
    any other line goes to the console only."""
    plain = _ANSI.sub("", line)
    match = _PYTHON_LINE.match(plain) or _CORE_LINE.match(plain)
    if match is None:
        return False, True
    return True, match.group(1) not in _QUIET_LEVELS and not any(text in plain for text in KNOWN_HARMLESS)


def shows_on_console(line: str) -> bool:
    return route(line)[1]


@contextlib.contextmanager
def quiet_console(log_path: Path) -> Iterator[Path]:
    """Inside the block, stdout and stderr (the file descriptors, so child libraries too) go
    through route: Ray's log lines are appended to `log_path`, the rest to the console."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        sys.stdout.flush()
        sys.stderr.flush()
        pump = _Filter((1, 2), log)
        try:
            yield log_path
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            pump.stop()


class _Filter:
    """The file descriptors `fds` each through a pipe, and one thread that passes each line on
    to its console, or not (one thread: lines leave in the order they came, across the two). A
    line is cut at "\\n" or "\\r" (a progress line redrawn in place), and a partial line that
    waits longer than HOLD_S goes out as it is (a prompt, a line being drawn). A terminal is
    replaced by a pseudo-terminal of its size, raw (no newline translation), so that whatever
    asks isatty() still draws for a terminal."""

    HOLD_S = 0.2

    def __init__(self, fds: tuple[int, ...], log: BinaryIO):
        self.log = log
        self.consoles = {fd: os.dup(fd) for fd in fds}  # fd -> the console it wrote to
        self.reads = {_redirect(fd): fd for fd in fds}  # read end -> fd
        self.thread = threading.Thread(target=self._pump, name="prefixflow-console", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        pending = dict.fromkeys(self.reads, b"")
        while pending:
            ready, _, _ = select.select(list(pending), [], [], self.HOLD_S)
            if not ready:  # partial lines held long enough: out as they are
                for read, part in pending.items():
                    pending[read] = self._emit(self.reads[read], part) if part else part
                continue
            for read in ready:
                try:
                    data = os.read(read, 1 << 16)
                except OSError:  # a pseudo-terminal whose every writer closed it (EIO)
                    data = b""
                *lines, pending[read] = re.split(rb"(?<=[\r\n])", pending[read] + data)
                for line in lines:
                    self._emit(self.reads[read], line)
                if not data:  # every writer closed it
                    self._emit(self.reads[read], pending.pop(read))
                    os.close(read)

    def _emit(self, fd: int, line: bytes) -> bytes:
        if not line:
            return b""
        to_log, to_console = route(line.decode("utf-8", "replace"))
        if to_log:
            self.log.write(line if line.endswith((b"\n", b"\r")) else line + b"\n")
        if to_console:
            os.write(self.consoles[fd], line)
        return b""

    def stop(self) -> None:
        """Each descriptor back to its console. The pipes' last writers are gone with them (no
        child of ours holds one: Ray starts its processes with their own log files), so the
        thread reads to the end and stops."""
        for fd, console in self.consoles.items():
            os.dup2(console, fd)
        self.thread.join(timeout=5.0)


def _redirect(fd: int) -> int:
    """`fd` made the write end of a new pipe (a pseudo-terminal of its size where it is a
    terminal); returns the read end."""
    if os.isatty(fd):
        read, write = os.openpty()
        tty.setraw(write)
        with contextlib.suppress(OSError):  # no size to copy: the pseudo-terminal's default
            fcntl.ioctl(write, termios.TIOCSWINSZ, fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    else:
        read, write = os.pipe()
    os.dup2(write, fd)
    os.close(write)
    return read
