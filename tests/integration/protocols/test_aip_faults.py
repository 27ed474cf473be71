"""AIP-151 faults end to end (issue 10, items 2 and 5): the lost create answer recovered by key with no
operator, the only path to "never created", expiry after done, a 429 storm with RetryInfo and
Retry-After, and the request budgets, measured in the demo AIP-151 server's own request log. Real worker
processes, beat, Postgres and Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests import support
from tests.integration.steps.test_qps import max_in_any_window
from tests.support.aip_fleet import AipFleet, args, running_aip_fleet
from tests.support.fleet import FleetParts

S = OpState
WINDOW_S = 1.0


@pytest.fixture
def aip_fleet(fleet_parts: FleetParts) -> Iterator[AipFleet]:
    with running_aip_fleet(fleet_parts) as running:
        yield running


def kinds(aip_fleet: AipFleet, op_id: Any) -> list[str]:
    return [e["kind"] for e in aip_fleet.fleet.ledger.events(op_id)]


@pytest.mark.parametrize(
    "fault",
    [
        {"lose_create_response": 1},  # created, then the connection closed unanswered
        {"status_after_create": {"count": 1, "status": "UNAVAILABLE"}},  # created, then a 503
    ],
)
def test_a_lost_create_answer_is_recovered_by_key_with_one_operation_and_no_operator(
    aip_fleet: AipFleet, fault: dict[str, Any]
) -> None:
    fleet = aip_fleet.fleet
    aip_fleet.aip.faults(**fault)
    op_id = aip_fleet.submit("n/aip-lost", args(0.5))
    receipt = fleet.wait_receipt("n/aip-lost")
    assert receipt["terminal_state"] == "completed"
    op = fleet.ledger.get(op_id)
    assert op.state is S.ACCEPTED
    # One operation on the server, found by repeating the create with the same request id (AIP-155).
    assert [o["name"] for o in aip_fleet.operations()] == [op.remote_id]
    creates = aip_fleet.requests("RunReport")
    assert [c["request_id"] for c in creates] == [str(op.submission_key)] * 2
    events = kinds(aip_fleet, op_id)
    assert "submission_unknown" in events
    assert "found_by_key" in events
    assert "manual_reconciliation" not in events
    assert fleet.ledger.reconciliations_for(op_id) == []


def test_not_found_to_the_repeated_create_is_the_only_path_to_never_created(aip_fleet: AipFleet) -> None:
    """A 503 to the create (nothing done), and the parent gone meanwhile: the lookup (the create repeated)
    is NOT_FOUND, which proves "never created" (NOT_FOUND_SAFE), the resubmission with the same key is
    refused NOT_FOUND again, and the receipt says failed. Nothing was ever created on the server."""
    fleet = aip_fleet.fleet
    aip_fleet.aip.faults(
        status_503={"RunReport": {"count": 1, "retry_after_s": 0}}, missing_projects=["gone"]
    )
    op_id = aip_fleet.submit("n/aip-gone", args(project="gone"))
    receipt = fleet.wait_receipt("n/aip-gone")
    assert receipt["terminal_state"] == "failed"
    assert "NOT_FOUND" in receipt["result"]["error"]["message"]
    events = kinds(aip_fleet, op_id)
    assert events.index("submission_unknown") < events.index("never_created") < events.index("resubmission")
    assert aip_fleet.operations() == []
    assert len(aip_fleet.requests("RunReport")) == 3  # the create, the lookup, the resubmission
    assert fleet.ledger.reconciliations_for(op_id) == []


def test_a_404_to_the_first_create_is_a_failed_receipt_without_a_lookup(aip_fleet: AipFleet) -> None:
    aip_fleet.aip.faults(missing_projects=["gone"])
    op_id = aip_fleet.submit("n/aip-404", args(project="gone"))
    assert aip_fleet.fleet.wait_receipt("n/aip-404")["terminal_state"] == "failed"
    assert "submission_unknown" not in kinds(aip_fleet, op_id)
    assert len(aip_fleet.requests("RunReport")) == 1


def test_expiry_right_after_done_still_ends_in_a_receipt(fleet_parts: FleetParts) -> None:
    """The done Operation is the result, held the moment it is seen: the operation expiring a moment later
    costs nothing (google-api-core's future would raise NotFound on its next read)."""
    with running_aip_fleet(fleet_parts, aip_flags=("--expire-after-done-s", "1")) as aip_fleet:
        fleet = aip_fleet.fleet
        op_id = aip_fleet.submit("n/aip-expiring", args(0.5))
        assert fleet.wait_receipt("n/aip-expiring")["terminal_state"] == "completed"
        name = fleet.ledger.get(op_id).remote_id
        support.wait_for("the operation to expire", lambda: name in aip_fleet.aip.operations()["expired"])
        gets = [e["status"] for e in aip_fleet.requests("GetOperation")]
        assert gets[-1] == 200  # nothing was read after the done one
        assert fleet.ledger.get(op_id).state is S.ACCEPTED


def test_expiry_before_done_was_seen_goes_to_an_operator(fleet_parts: FleetParts) -> None:
    """Done and expired between two polls: nothing was held, so "not found" is UNKNOWN (rule 11), never a
    guessed receipt."""
    with running_aip_fleet(
        fleet_parts, aip_flags=("--expire-after-done-s", "0.3"), exports={"default_poll_interval_ms": 3000}
    ) as aip_fleet:
        fleet = aip_fleet.fleet
        op_id = aip_fleet.submit("n/aip-gone-early", args(0.2))
        op = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=30)
        records = fleet.ledger.reconciliations_for(op_id)
        assert [r.reason for r in records] == [ReconciliationReason.UNKNOWN_NOT_FOUND]
        assert op.result is None
        assert fleet.receipts() == []


@pytest.mark.parametrize("envelope", ["aip193", "grpc_gateway"])
def test_a_429_storm_with_retry_info_sees_no_request_inside_the_window(
    fleet_parts: FleetParts, envelope: str
) -> None:
    """Every request refused for 3 s with RetryInfo and Retry-After of 1 s (the create first), then three
    more 429s to the polls: the server never sees a request while a Retry-After it gave runs, and the
    operation ends in its receipt, created once."""
    with running_aip_fleet(fleet_parts, aip_flags=("--envelope", envelope)) as aip_fleet:
        fleet = aip_fleet.fleet
        aip_fleet.aip.faults(
            rate_limit_window={"rpc": "*", "seconds": 3, "retry_after_s": 1},
            status_429={"GetOperation": {"count": 3, "retry_after_s": 1}},
        )
        op_id = aip_fleet.submit("n/aip-storm", args(2))
        receipt = fleet.wait_receipt("n/aip-storm", timeout=60)
        log = aip_fleet.aip.log()
        switches = aip_fleet.aip.faults()
        operations = aip_fleet.operations()
        events = kinds(aip_fleet, op_id)
    assert receipt["terminal_state"] == "completed"
    refused = [e for e in log if e["status"] == 429]
    assert len(refused) >= 4
    assert {"RunReport", "GetOperation"} <= {e["rpc"] for e in refused}
    assert switches["status_429"]["GetOperation"]["count"] == 0
    inside = [e for e in log if e["inside_retry_after"]]
    assert inside == [], f"requests inside a Retry-After window: {inside}"
    assert len(operations) == 1
    assert "rate_limited" in events


BUDGET_OPERATIONS = 12
BUDGET_POLL_QPS = 3
BUDGET_CONTROL_QPS = 2


@pytest.mark.slow
def test_every_request_is_charged_to_its_budget(fleet_parts: FleetParts) -> None:
    """12 operations on a server with poll_qps 3 and control_qps 2: in every 1 s window of the AIP-151
    server's log, the polls (GetOperation: the fetch sends nothing, the result is the done Operation) stay
    within poll_qps, the creates within control_qps, all within their sum."""
    with running_aip_fleet(
        fleet_parts,
        exports={
            "poll_qps": BUDGET_POLL_QPS,
            "control_qps": BUDGET_CONTROL_QPS,
            "default_poll_interval_ms": 100,
        },
    ) as aip_fleet:
        fleet = aip_fleet.fleet
        answers = [
            fleet.send_nowait(
                "longcall.submit",
                call_node_id=f"n/aip-budget-{index:02d}",
                server="exports",
                tool="run_report",
                arguments=args(1 + index % 3),
                on_terminal=dict(fleet.pipeline.signature("pipeline.record", queue="pipeline")),
            )
            for index in range(BUDGET_OPERATIONS)
        ]
        for answer in answers:
            answer.get(timeout=60)
        support.wait_for(
            "every receipt", lambda: len(fleet.receipts()) == BUDGET_OPERATIONS, timeout=180, interval=0.5
        )
        log = aip_fleet.aip.log()
    polls = [e["t"] for e in log if e["rpc"] == "GetOperation"]
    creates = [e["t"] for e in log if e["rpc"] == "RunReport"]
    assert len(creates) == BUDGET_OPERATIONS
    assert len(polls) >= BUDGET_OPERATIONS
    assert max_in_any_window(polls, WINDOW_S) <= BUDGET_POLL_QPS
    assert max_in_any_window(creates, WINDOW_S) <= BUDGET_CONTROL_QPS
    assert max_in_any_window([e["t"] for e in log], WINDOW_S) <= BUDGET_POLL_QPS + BUDGET_CONTROL_QPS
