"""A step that leaves a receipt drains the outbox itself (issue 13): the receipt reaches the pipeline with no
``longcall.drain_outbox`` message (one broker round trip, its events and a task's CPU per operation fewer),
whether the step was a poll's result fetch or a synchronous submit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet
from tests.support.ledger_rows import evidence_for, place


@pytest.fixture
def fleet_without_beat_drains(fleet_parts: FleetParts) -> Iterator[Fleet]:
    # The beat's drain is an hour away: a receipt that arrives was sent by the step that wrote it.
    with running_fleet(fleet_parts, env={"LONGCALL_OUTBOX_INTERVAL_S": "3600"}) as fleet:
        yield fleet


def test_receipts_are_published_by_the_step_that_wrote_them(fleet_without_beat_drains: Fleet) -> None:
    fleet = fleet_without_beat_drains
    fleet.submit("n/report", "slow_report", {"seconds": 0.3})
    fleet.submit("n/lookup", "quick_lookup", {"key": "k1"})

    assert fleet.wait_receipt("n/report", timeout=60)["terminal_state"] == "completed"
    assert fleet.wait_receipt("n/lookup", timeout=60)["result"]["content"][0]["text"] == "value:k1"
    # The step publishes inside its drain's transaction and marks the row dispatched as it commits: the
    # pipeline can hold the receipt a moment before the row says so.
    support.wait_for(
        "the steps' drains to commit", lambda: fleet.ledger.ready_outbox_count() == 0, timeout=10
    )
    assert fleet.drains_run() == 0


def test_a_step_publishes_its_own_operations_rows_and_leaves_the_rest_to_the_beat(
    fleet_without_beat_drains: Fleet,
) -> None:
    """The step drains only what it wrote: a backlog of other operations' rows (a broker that was down, a
    crashed drainer) stays with the beat's drain (``longcall.outbox``), so a poll or a cancel never waits
    behind it, nor holds its row locks for as long as a slow broker takes."""
    fleet = fleet_without_beat_drains
    other = place(fleet.ledger, OpState.FETCHING_RESULT)
    assert fleet.ledger.accept_terminal(other.id, evidence_for(other, TerminalKind.COMPLETED)).accepted
    backlog = fleet.ledger.ready_outbox_count()
    assert backlog >= 1

    op_id = fleet.submit("n/report", "slow_report", {"seconds": 0.3})
    assert fleet.wait_receipt("n/report", timeout=60)["terminal_state"] == "completed"
    support.wait_for(
        "the step's drain to commit",
        lambda: [row.status for row in fleet.ledger.outbox_for(op_id)] == ["dispatched"],
        timeout=10,
    )
    assert fleet.drains_run() == 0
    assert [row.status for row in fleet.ledger.outbox_for(other.id)] == ["ready"]  # the beat's, still
    assert fleet.ledger.ready_outbox_count() == backlog
