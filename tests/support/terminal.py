"""A command run at a terminal, as a person runs it: a pseudo-terminal of a set size as its stdin, stdout
and stderr, what it writes read as it comes (every wait bounded), keys typed into it, and its output read
back as text (the terminal's control sequences taken out)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

__all__ = ["Terminal", "plain"]

#: CSI sequences (cursor moves, erases, colours), OSC sequences (titles, links), and lone escapes.
_CONTROL = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]")


def plain(raw: bytes) -> str:
    """The text a terminal shows, near enough to read and match: control sequences out, lines on ``\\n``."""
    return _CONTROL.sub(b"", raw).replace(b"\r\n", b"\n").replace(b"\r", b"\n").decode(errors="replace")


class Terminal:
    """``argv`` running on a pseudo-terminal ``columns`` wide; :attr:`raw` is everything it wrote so far."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], columns: int = 80, rows: int = 50):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self._master = master
        self.raw = bytearray()
        try:
            self.process = subprocess.Popen(
                argv,
                cwd=cwd,
                env={**env, "COLUMNS": str(columns), "LINES": str(rows), "TERM": "xterm-256color"},
                stdin=slave,
                stdout=slave,
                stderr=slave,
                start_new_session=True,
            )
        finally:
            os.close(slave)

    def read(self, seconds: float) -> bytes:
        """What the command writes in the next ``seconds`` (less if it exits); kept in :attr:`raw` too."""
        got = bytearray()
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self._master], [], [], min(left, 0.1))
            if not ready:
                if self.process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the other side closed (the command exited)
                break
            if not chunk:
                break
            got += chunk
        self.raw += got
        return bytes(got)

    def read_until(self, *texts: str, timeout: float) -> str:
        """Read until one of ``texts`` is on the screen (in :func:`plain` output), or fail after ``timeout``;
        the one found (the first of them, if more are)."""
        deadline = time.monotonic() + timeout
        while True:
            screen = plain(bytes(self.raw))
            if found := [text for text in texts if text in screen]:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting for {texts!r}; the screen:\n{screen[-3000:]}"
                )
            if self.process.poll() is not None and not self.read(0.2):
                raise AssertionError(
                    f"exited with {self.process.returncode} before {texts!r}:\n{screen[-3000:]}"
                )
            self.read(0.2)

    def type(self, keys: str) -> None:
        os.write(self._master, keys.encode())

    def wait(self, *, timeout: float) -> int:
        """Read to the end; the exit code (the command is killed and the test fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"still running after {timeout:.0f}s:\n{plain(bytes(self.raw))[-3000:]}")
            self.read(0.2)
        self.read(0.5)
        return self.process.returncode

    def close(self) -> None:
        """Kill the command if it still runs (not what it started: the caller stops that), and let go of the
        terminal (idempotent)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self._master >= 0:
            os.close(self._master)
            self._master = -1
