"""A step that leaves a receipt drains the outbox itself (issue 13): the receipt reaches the pipeline with no
``longcall.drain_outbox`` message (one broker round trip, its events and a task's CPU per operation fewer),
whether the step was a poll's result fetch or a synchronous submit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.fleet import Fleet, FleetParts, running_fleet


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
    assert fleet.drains_run() == 0
    assert fleet.ledger.ready_outbox_count() == 0
