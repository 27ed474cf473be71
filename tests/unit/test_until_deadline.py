"""A step's reschedule never carries its row past the operation's wait deadline while the deadline is ahead,
and a deadline that passed during the step (after the step looked at it) brings the row back at once, so that
the next step meets it and decides; a deadline long past leaves the wait as it is (no tight loop)."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ledger.records import Operation
from workers.steps.context import DEADLINE_JUST_PASSED_S, DEADLINE_SLACK_S, StepContext

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)
HOLD_S = 52.0  # a server's fleet-wide hold: the wait a step without a token is put off by


def _op(deadline_in_s: float | None) -> Operation:
    deadline = None if deadline_in_s is None else NOW + dt.timedelta(seconds=deadline_in_s)
    return cast(Operation, SimpleNamespace(wait_deadline=deadline))


def _until(deadline_in_s: float | None, delay_s: float = HOLD_S) -> float:
    context = StepContext(runtime=cast(Any, None), clock=lambda: NOW)
    return context.until_deadline(_op(deadline_in_s), delay_s)


def test_no_deadline_leaves_the_wait() -> None:
    assert _until(None) == HOLD_S


def test_a_deadline_ahead_caps_the_wait_just_past_it() -> None:
    assert _until(3.0) == pytest.approx(3.0 + DEADLINE_SLACK_S)
    assert _until(3.0, delay_s=1.0) == 1.0


@pytest.mark.parametrize("past_s", [0.0, 0.002, 0.5 * DEADLINE_JUST_PASSED_S])
def test_a_deadline_that_passed_during_the_step_brings_the_row_back_at_once(past_s: float) -> None:
    """The step looked at the deadline just before it passed, then found no token: its row is due at once,
    not after the hold (the full run of 2026-12-07: 52 s past the wait budget)."""
    assert _until(-past_s) == DEADLINE_SLACK_S


def test_a_deadline_long_past_leaves_the_wait() -> None:
    """A step that does not decide on the deadline is not brought back in a loop."""
    assert _until(-DEADLINE_JUST_PASSED_S) == HOLD_S
    assert _until(-60.0) == HOLD_S
