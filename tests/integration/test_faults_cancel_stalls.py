"""Two ways a cancel stalled in CANCEL_REQUESTED (hardening, H14).

1. A cancel that cannot be sent: the AIP-151 demo server answers 503 to every ``CancelOperation``. Before
   the operation's wait budget ends it is retried (a 503 decided nothing); past it, the status read decides:
   a terminal state wins, an open one goes to an operator (DEADLINE_EXCEEDED, the last error named), never
   retried for ever.
2. (The slow control budget: ``test_gate.py::test_an_aip151_cancel_on_a_slow_control_budget_ends``.)

Real worker processes, beat, Postgres, Redis and the demo server.
"""

from __future__ import annotations

import time

import pytest

from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests import support
from tests.integration.aip_fleet import args, running_aip_fleet
from tests.integration.fleet import FleetParts

S = OpState

WAIT_BUDGET_S = 4.0
#: More 503s than the test can use up: every cancel is refused.
ALWAYS = 100_000


@pytest.mark.slow
def test_a_cancel_that_cannot_be_sent_goes_to_an_operator_past_the_wait_budget(
    fleet_parts: FleetParts,
) -> None:
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        running.aip.faults(status_503={"CancelOperation": {"count": ALWAYS, "retry_after_s": 0}})
        op_id = running.submit("n/cancel-503", args(seconds=600), wait_budget_s=WAIT_BUDGET_S)
        op = fleet.wait_state(op_id, S.WORKING, timeout=30)
        assert op.wait_deadline is not None
        fleet.send("longcall.cancel", op_id=str(op_id))
        support.wait_for(
            "a refused cancel",
            lambda: any(e["rpc"] == "CancelOperation" and e["status"] == 503 for e in running.requests()),
            timeout=10,
        )
        deadline = op.wait_deadline.timestamp()
        handed = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=WAIT_BUDGET_S + 15)
        handed_at = time.time()
        support.wait_for("a second after the hand-over", lambda: time.time() >= handed_at + 1.0, timeout=5)
        cancels = running.requests("CancelOperation")
        records = fleet.ledger.reconciliations_for(op_id)
        server_op = running.server_operation(handed.remote_id or "")

    assert handed_at <= deadline + 5.0, f"handed over {handed_at - deadline:.1f} s after the wait budget"
    assert len(cancels) >= 2, "a refused cancel is retried before the wait budget ends"
    assert all(e["status"] == 503 for e in cancels)
    assert [e for e in cancels if e["t"] > handed_at] == [], "a cancel sent after the hand-over"
    assert [r.reason for r in records] == [ReconciliationReason.DEADLINE_EXCEEDED]
    detail = records[0].detail
    assert "could not be sent" in detail["why"], detail
    assert "503" in detail["why"] or "UNAVAILABLE" in detail["why"], detail
    assert detail["server_state"] is not None  # the status was read: the operation still open
    assert "done" not in server_op


@pytest.mark.slow
def test_a_terminal_state_wins_over_a_cancel_that_cannot_be_sent(fleet_parts: FleetParts) -> None:
    """Past the wait budget the status read decides: an operation that completed meanwhile is accepted as
    completed, not handed to an operator."""
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        running.aip.faults(status_503={"CancelOperation": {"count": ALWAYS, "retry_after_s": 0}})
        op_id = running.submit(
            "n/cancel-503-done", args(seconds=WAIT_BUDGET_S - 1.5), wait_budget_s=WAIT_BUDGET_S
        )
        fleet.wait_state(op_id, S.WORKING, timeout=30)
        fleet.send("longcall.cancel", op_id=str(op_id))
        receipt = fleet.wait_receipt("n/cancel-503-done", timeout=WAIT_BUDGET_S + 20)
        records = fleet.ledger.reconciliations_for(op_id)
    assert receipt["terminal_state"] == "completed"
    assert records == []
