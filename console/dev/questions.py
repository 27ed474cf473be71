"""The demo's questions (approve the report? record the lost task as found?), answered without stopping it.

:class:`KeyQuestion` reads the answer from the terminal a key at a time in a thread of its own, the
terminal in cbreak mode (no echo, no line buffering) only while it asks: ``y`` or Enter is yes, ``n`` is no,
and the end of the input is the default. The demo asks it each tick whether it has an answer, so the live
table goes on moving while the question waits. :class:`Given` is the answer ``--yes`` (or a stdin that is no
terminal) gives at once.
"""

from __future__ import annotations

import os
import select
import termios
import threading
import tty
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Asker", "Given", "KeyQuestion", "Question", "asker"]

#: How long the reading thread waits for a key before it looks whether it was closed.
_POLL_S = 0.1


class Question(Protocol):
    #: The question as it is shown (below the live table while it waits).
    text: str
    #: How the answer was given, printed after it: "" at the terminal, " (--yes)" when given at once.
    how: str

    def answer(self) -> bool | None:
        """The answer, or None while there is none yet (never waits)."""

    def close(self) -> None:
        """Stop asking; the terminal as it was before (idempotent)."""


class Asker(Protocol):
    def ask(self, text: str) -> Question: ...


@dataclass
class Given:
    """An answer given before the question (``--yes``)."""

    text: str
    value: bool
    how: str = " (--yes)"

    def answer(self) -> bool | None:
        return self.value

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class GivenAsker:
    value: bool
    how: str

    def ask(self, text: str) -> Question:
        return Given(text, self.value, self.how)


class KeyQuestion:
    """A yes/no question answered at the terminal behind ``fd``, read a key at a time by a thread."""

    how = ""

    def __init__(self, text: str, fd: int, *, default: bool = True) -> None:
        self.text = f"{text} [{'Y/n' if default else 'y/N'}]"
        self._fd = fd
        self._default = default
        self._answer: bool | None = None
        self._closed = threading.Event()
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)  # one key at a time...
        mode = termios.tcgetattr(fd)
        mode[tty.LFLAG] &= ~termios.ECHO  # ...not echoed over the live table (3.12's setcbreak keeps ECHO)
        termios.tcsetattr(fd, termios.TCSANOW, mode)
        self._thread = threading.Thread(target=self._read, name="longcall-dev-question", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            ready, _, _ = select.select([self._fd], [], [], _POLL_S)
            if not ready:
                continue
            key = os.read(self._fd, 1)
            if key == b"":  # the input ended: the default, as a confirm prompt takes it
                self._answer = self._default
                return
            letter = key.decode("ascii", errors="replace").lower()
            if letter in ("\r", "\n"):
                self._answer = self._default
            elif letter in ("y", "n"):
                self._answer = letter == "y"
            if self._answer is not None:
                return

    def answer(self) -> bool | None:
        return self._answer

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=2 * _POLL_S + 1)
        termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)


@dataclass(frozen=True)
class TerminalAsker:
    fd: int

    def ask(self, text: str) -> Question:
        return KeyQuestion(text, self.fd)


def asker(*, yes: bool, stdin_fd: int | None) -> Asker:
    """Questions answered yes at once with ``--yes`` (or with no terminal to ask at, ``stdin_fd`` None),
    else asked at the terminal on ``stdin_fd``."""
    if yes:
        return GivenAsker(True, " (--yes)")
    if stdin_fd is None:
        return GivenAsker(True, " (stdin is not a terminal)")
    return TerminalAsker(stdin_fd)
