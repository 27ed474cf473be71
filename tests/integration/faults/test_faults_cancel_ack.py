"""A cancel the server acknowledges but never carries out is not polled for ever (hardening, H11 item 2).

AIP-151's CancelOperation is best effort: the server answers ``{}`` and the outcome is learned by polling.
The demo AIP-151 server's ``cancel_takes_ms`` switch makes an acknowledged cancel land that long after its
answer; set to an hour, the operation keeps running. When the operation's wait budget runs out in
CANCEL_REQUESTED it goes to an operator (DEADLINE_EXCEEDED, the acknowledgement's time in the detail), and
no status read follows; a cancel that lands before the budget ends is still accepted. Real worker
processes, beat, Postgres and Redis.
"""

from __future__ import annotations

import datetime as dt
import time

import pytest

from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests import support
from tests.support.aip_fleet import args, running_aip_fleet
from tests.support.fleet import FleetParts

S = OpState

WAIT_BUDGET_S = 4.0
#: A cancel that lands an hour after its acknowledgement: never, within this test.
NEVER_MS = 3_600_000


@pytest.mark.slow
def test_an_acknowledged_cancel_never_carried_out_goes_to_an_operator_at_the_wait_budget(
    fleet_parts: FleetParts,
) -> None:
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        running.aip.faults(cancel_takes_ms=NEVER_MS)
        op_id = running.submit("n/ack-never", args(seconds=600), wait_budget_s=WAIT_BUDGET_S)
        op = fleet.wait_state(op_id, S.WORKING, timeout=30)
        assert op.wait_deadline is not None
        fleet.send("longcall.cancel", op_id=str(op_id))
        support.wait_for(
            "the cancel to be acknowledged",
            lambda: any(e["rpc"] == "CancelOperation" and e["status"] == 200 for e in running.requests()),
            timeout=10,
        )
        assert fleet.ledger.get(op_id).state is S.CANCEL_REQUESTED
        deadline = op.wait_deadline.timestamp()
        handed = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=WAIT_BUDGET_S + 15)
        handed_at = time.time()
        # Nothing more is read once it is an operator's: measured over a second after the hand-over.
        support.wait_for("a second after the hand-over", lambda: time.time() >= handed_at + 1.0, timeout=5)
        reads = [e for e in running.requests("GetOperation") if e["path"].endswith(handed.remote_id or "-")]
        records = fleet.ledger.reconciliations_for(op_id)
        server_op = running.server_operation(handed.remote_id or "")
        cancels = running.requests("CancelOperation")

    assert handed_at <= deadline + 5.0, f"handed over {handed_at - deadline:.1f} s after the wait budget"
    late = [e for e in reads if e["t"] > handed_at]
    assert late == [], f"{len(late)} status reads after the hand-over"
    # Polled while the cancel was pending, on the control budget, none past the budget's end (+ one read).
    assert sum(e["t"] > deadline for e in reads) <= 1
    assert [r.reason for r in records] == [ReconciliationReason.DEADLINE_EXCEEDED]
    detail = records[0].detail
    assert "acknowledged" in detail["why"], detail
    assert "never carried out" in detail["why"], detail
    acknowledged_at = dt.datetime.fromisoformat(detail["acknowledged_at"])
    assert acknowledged_at.timestamp() < deadline
    assert detail["acknowledged_at"] in detail["why"]
    assert "done" not in server_op  # the server still runs it: nothing was decided for the operator
    assert len(cancels) == 1  # acknowledged once, not sent again


@pytest.mark.slow
def test_a_cancel_carried_out_before_the_wait_budget_still_wins(fleet_parts: FleetParts) -> None:
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        running.aip.faults(cancel_takes_ms=1500)
        op_id = running.submit("n/ack-late", args(seconds=600), wait_budget_s=WAIT_BUDGET_S)
        fleet.wait_state(op_id, S.WORKING, timeout=30)
        fleet.send("longcall.cancel", op_id=str(op_id))
        receipt = fleet.wait_receipt("n/ack-late", timeout=WAIT_BUDGET_S + 15)
        records = fleet.ledger.reconciliations_for(op_id)
    assert receipt["terminal_state"] == "cancelled"
    assert records == []
