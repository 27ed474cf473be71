"""The simulation's generator and oracle (issue 12), pure: the same (seed, index) is the same series, and
the oracle's outcome for hand-written timelines is the protocol's (DESIGN §5)."""

from __future__ import annotations

import dataclasses

import pytest

from console.simulation.oracle import expect
from console.simulation.series import Series, generate

BASE = Series(seed=1, index=0, protocol="mcp", terminal="completed", term_tick=3)


def test_the_generator_is_a_function_of_seed_and_index() -> None:
    assert generate(5, 17) == generate(5, 17)
    assert generate(5, 17) != generate(6, 17)
    assert {generate(5, i).protocol for i in range(10)} == {"mcp", "aip151", "mcp-ext"}
    assert {generate(5, i, ("aip151",)).protocol for i in range(10)} == {"aip151"}


@pytest.mark.parametrize(
    ("changes", "outcome", "tasks"),
    [
        ({}, "completed", 1),
        ({"terminal": "failed"}, "failed", 1),
        ({"cancel_tick": -1}, "cancelled", 0),
        # MCP has no idempotency key: an unknown create outcome goes to an operator, never a second create.
        ({"create_fault": "lost_503"}, "manual", 1),
        ({"create_fault": "crash_before"}, "manual", 0),
        ({"create_fault": "429"}, "completed", 1),
        ({"create_fault": "429", "cancel_tick": 1}, "cancelled", 0),
        # The tasks/cancel answer is the evidence; a cancel after the end leaves the end as it was.
        ({"cancel_tick": 2}, "cancelled", 1),
        ({"cancel_tick": 3}, "completed", 1),
        ({"cancel_tick": 2, "cancel_ack_lost": True}, "cancelled", 1),
        ({"cancel_tick": 2, "expiry": "before_seen"}, "cancelled", 1),
        ({"cancel_tick": 2, "cancel_ack_lost": True, "expiry": "before_seen"}, "manual", 1),
        ({"expiry": "before_seen"}, "manual", 1),
    ],
)
def test_mcp_outcomes(changes: dict[str, object], outcome: str, tasks: int) -> None:
    expected = expect(dataclasses.replace(BASE, **changes))  # type: ignore[arg-type]
    assert (expected.outcome, expected.tasks) == (outcome, tasks)


@pytest.mark.parametrize(
    ("changes", "outcome", "tasks"),
    [
        ({}, "completed", 1),
        # AIP-155: the create repeated with the same request id is the lookup: one operation.
        ({"create_fault": "lost_503"}, "completed", 1),
        ({"create_fault": "lost_cut"}, "completed", 1),
        ({"create_fault": "crash_before"}, "completed", 1),
        ({"create_fault": "crash_after", "terminal": "failed"}, "failed", 1),
        # The outcome of a cancel comes from polling: done CANCELLED, or the completion that won.
        ({"cancel_tick": 2}, "cancelled", 1),
        ({"cancel_tick": 2, "cancel_policy": "ignore"}, "completed", 1),
        ({"create_fault": "crash_before", "cancel_tick": 1}, "cancelled", 1),
        ({"cancel_tick": 3}, "completed", 1),
        ({"cancel_tick": 2, "expiry": "before_seen"}, "manual", 1),
    ],
)
def test_aip151_outcomes(changes: dict[str, object], outcome: str, tasks: int) -> None:
    expected = expect(dataclasses.replace(BASE, protocol="aip151", **changes))  # type: ignore[arg-type]
    assert (expected.outcome, expected.tasks) == (outcome, tasks)


@pytest.mark.parametrize(
    ("changes", "outcome", "tasks"),
    [
        ({}, "completed", 1),
        # No idempotency key, no tasks/list: an unknown create outcome goes to an operator.
        ({"create_fault": "lost_cut"}, "manual", 1),
        ({"create_fault": "crash_before"}, "manual", 0),
        # tasks/cancel is an acknowledgement only: the end comes from polling.
        ({"cancel_tick": 2}, "cancelled", 1),
        ({"cancel_tick": 2, "cancel_policy": "ignore", "terminal": "failed"}, "failed", 1),
        ({"cancel_tick": 3}, "completed", 1),
        ({"expiry": "before_seen"}, "manual", 1),
    ],
)
def test_mcp_tasks_extension_outcomes(changes: dict[str, object], outcome: str, tasks: int) -> None:
    expected = expect(dataclasses.replace(BASE, protocol="mcp-ext", **changes))  # type: ignore[arg-type]
    assert (expected.outcome, expected.tasks) == (outcome, tasks)
