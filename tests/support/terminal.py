"""Running a command in a pseudo-terminal, as a user's shell would, for the tests of what it
draws there (progress redrawn in place, the quiet console)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
import time


def run_in_terminal(
    argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 240, columns: int | None = None
) -> str:
    """Run a command with a pseudo-terminal (`columns` wide, when given) as its stdin, stdout
    and stderr; what it printed. Fails when the command exits non-zero."""
    master, slave = pty.openpty()
    if columns is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=30) == 0, out.decode(errors="replace")[-3000:]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return out.decode(errors="replace")
