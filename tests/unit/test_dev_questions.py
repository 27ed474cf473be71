"""``longcall dev``'s questions: asked at a terminal (a pseudo-terminal here) without waiting for the answer,
answered a key at a time, the terminal's mode put back; answered at once with ``--yes`` or no terminal."""

from __future__ import annotations

import os
import pty
import termios
from collections.abc import Iterator

import pytest

from console.dev.questions import KeyQuestion, asker
from tests.support import wait_for


@pytest.fixture
def pseudo_terminal() -> Iterator[tuple[int, int]]:
    master, slave = pty.openpty()
    try:
        yield master, slave
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.parametrize(("keys", "expected"), [("y", True), ("N", False), ("\r", True), ("x\n", True)])
def test_a_key_answers_and_nothing_waits_for_it(
    pseudo_terminal: tuple[int, int], keys: str, expected: bool
) -> None:
    master, slave = pseudo_terminal
    before = termios.tcgetattr(slave)
    question = KeyQuestion("Approve?", slave)
    try:
        assert question.text == "Approve? [Y/n]"
        assert question.answer() is None  # asked, and the caller goes on
        assert termios.tcgetattr(slave)[3] & termios.ECHO == 0  # the key is not echoed over the table
        os.write(master, keys.encode())
        assert wait_for("the answer", lambda: question.answer() is not None, timeout=5)
        assert question.answer() is expected
    finally:
        question.close()
    assert termios.tcgetattr(slave) == before  # the terminal as it was


def test_closed_unanswered_it_stops_reading_and_puts_the_terminal_back(
    pseudo_terminal: tuple[int, int],
) -> None:
    master, slave = pseudo_terminal
    before = termios.tcgetattr(slave)
    question = KeyQuestion("Record it as found?", slave, default=False)
    assert question.text == "Record it as found? [y/N]"
    question.close()
    question.close()  # idempotent
    assert termios.tcgetattr(slave) == before
    os.write(master, b"y")
    assert question.answer() is None  # a key after the close answers nothing


def test_with_yes_or_without_a_terminal_every_question_is_answered_yes_at_once() -> None:
    given = asker(yes=True, stdin_fd=None).ask("Approve?")
    assert (given.answer(), given.how) == (True, " (--yes)")
    untold = asker(yes=False, stdin_fd=None).ask("Approve?")
    assert (untold.answer(), untold.how) == (True, " (stdin is not a terminal)")
