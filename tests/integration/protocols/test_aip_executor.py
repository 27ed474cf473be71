"""AIP-151 operations end to end (issue 10, items 5 and 6): longcall's demo AIP-151 server, real worker
processes, beat, Postgres, Redis, and the pipeline worker that receives the receipts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ledger.states import OpState
from tests import support
from tests.support.aip_fleet import AipFleet, args, running_aip_fleet
from tests.support.fleet import FleetParts

S = OpState
REPORT = "type.googleapis.com/longcall.demo.v1.Report"


@pytest.fixture
def aip_fleet(fleet_parts: FleetParts) -> Iterator[AipFleet]:
    with running_aip_fleet(fleet_parts) as running:
        yield running


def test_completed_failed_and_neither_end_in_receipts_carrying_the_done_operation(
    aip_fleet: AipFleet,
) -> None:
    fleet = aip_fleet.fleet
    done = aip_fleet.submit("n/aip-done", args(0.5))
    failed = aip_fleet.submit("n/aip-failed", args(0.3, "error"))
    neither = aip_fleet.submit("n/aip-neither", args(0.3, "none"))
    empty = aip_fleet.submit("n/aip-empty", args(0, "empty"))  # done in the create's own answer

    receipt = fleet.wait_receipt("n/aip-done")
    assert receipt["terminal_state"] == "completed"
    result = receipt["result"]
    assert (result["done"], result["isError"]) == (True, False)
    assert result["response"]["@type"] == REPORT
    assert result["name"] == fleet.ledger.get(done).remote_id
    assert result["name"].startswith("projects/demo/operations/")

    failure = fleet.wait_receipt("n/aip-failed")
    assert failure["terminal_state"] == "failed"
    assert (failure["result"]["error"]["code"], failure["result"]["isError"]) == (13, True)

    nothing = fleet.wait_receipt("n/aip-neither")
    assert nothing["terminal_state"] == "completed"
    assert "response" not in nothing["result"]
    assert "error" not in nothing["result"]
    assert fleet.wait_receipt("n/aip-empty")["result"]["response"] == {
        "@type": "type.googleapis.com/google.protobuf.Empty"
    }

    for op_id in (done, failed, neither, empty):
        op = fleet.ledger.get(op_id)
        assert (op.state, op.protocol, op.protocol_version) == (S.ACCEPTED, "aip151", "v1")
    assert len(aip_fleet.requests("RunReport")) == 4  # one create each
    assert len(aip_fleet.operations()) == 4
    sent = {o["name"]: o["requestId"] for o in aip_fleet.operations()}
    assert sent[fleet.ledger.get(done).remote_id] == str(fleet.ledger.get(done).submission_key)
    # The done Operation is the result: never read again once it was seen done.
    for op_id in (done, failed, neither):
        name = fleet.ledger.get(op_id).remote_id
        reads = [e for e in aip_fleet.requests("GetOperation") if e["path"].endswith(str(name))]
        assert reads, f"{name} was never polled"
        assert all(e["status"] == 200 for e in reads)


def test_a_mixed_fleet_runs_mcp_and_aip151_operations_side_by_side(aip_fleet: AipFleet) -> None:
    fleet = aip_fleet.fleet
    for index in range(3):
        fleet.submit(f"n/mcp-{index}", "slow_report", {"seconds": 0.5})
        aip_fleet.submit(f"n/aip-{index}", args(0.5))
    for index in range(3):
        mcp = fleet.wait_receipt(f"n/mcp-{index}")
        aip = fleet.wait_receipt(f"n/aip-{index}")
        assert (mcp["terminal_state"], aip["terminal_state"]) == ("completed", "completed")
        assert mcp["result"]["content"][0]["text"] == "report ready after 0.5s"
        assert aip["result"]["response"]["@type"] == REPORT
    ops = [fleet.ledger.find_by_call_node(f"n/{kind}-{i}") for kind in ("mcp", "aip") for i in range(3)]
    assert [(o.server, o.protocol) for o in ops if o is not None] == [("reports", "mcp")] * 3 + [
        ("exports", "aip151")
    ] * 3
    assert len([e for e in aip_fleet.mcp.log() if e["method"] == "tools/call"]) == 3
    assert len(aip_fleet.requests("RunReport")) == 3
    assert aip_fleet.fleet.mcp.log() == []  # running_fleet's own MCP server is not in the configuration


def test_cancel_wins_the_operation_ends_cancelled_on_the_server_and_in_the_ledger(
    aip_fleet: AipFleet,
) -> None:
    fleet = aip_fleet.fleet
    aip_fleet.aip.faults(cancel_takes_ms=600)  # the cancel's Empty comes first, the end later: polled for
    op_id = aip_fleet.submit("n/aip-cancel", args(60))
    fleet.wait_state(op_id, S.WORKING)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/aip-cancel")
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    op = fleet.ledger.get(op_id)
    assert op.state is S.CANCELLED_ACCEPTED
    on_server = aip_fleet.server_operation(str(op.remote_id))
    assert (on_server.get("done"), on_server["error"]["code"]) == (True, 1)
    cancels = aip_fleet.requests("CancelOperation")
    assert len(cancels) == 1  # acknowledged once, then only polled
    kinds = [e["kind"] for e in fleet.ledger.events(op_id)]
    assert (
        kinds.count("cancel_pending") == 1
    )  # the acknowledgement; the reads after it are counted on the row
    assert fleet.ledger.get(op_id).unchanged_polls > 0


def test_a_cancel_acknowledged_whose_status_read_fails_is_never_sent_again(aip_fleet: AipFleet) -> None:
    """The cancel is acknowledged (``{}``), and the status read that follows it meets a 503: the step comes
    back later and reads again. It never sends the cancel a second time: the acknowledgement is kept with
    the failed read (before, it was dropped with it, and every transient read failure sent the cancel
    again until the wait budget ran out)."""
    fleet = aip_fleet.fleet
    aip_fleet.aip.faults(cancel_takes_ms=2500)  # acknowledged at once, landing later: polled for
    op_id = aip_fleet.submit("n/aip-cancel-read", args(60))
    fleet.wait_state(op_id, S.WORKING)
    aip_fleet.aip.faults(cancel_takes_ms=2500, status_503={"GetOperation": {"count": 3, "retry_after_s": 0}})
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/aip-cancel-read", timeout=45)
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    kinds = [e["kind"] for e in fleet.ledger.events(op_id)]
    assert "cancel_read_failed" in kinds, kinds  # the read after the acknowledgement failed
    assert len(aip_fleet.requests("CancelOperation")) == 1, kinds


def test_completion_wins_the_race_and_is_accepted_completed(aip_fleet: AipFleet) -> None:
    fleet = aip_fleet.fleet
    aip_fleet.aip.faults(complete_on_cancel=1)  # the cancel is answered {} but the operation completes
    op_id = aip_fleet.submit("n/aip-race", args(1.5))
    fleet.wait_state(op_id, S.WORKING)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/aip-race")
    assert receipt["terminal_state"] == "completed"
    assert receipt["result"]["response"]["@type"] == REPORT
    assert fleet.ledger.get(op_id).state is S.ACCEPTED
    assert len(aip_fleet.requests("CancelOperation")) == 1


@pytest.mark.parametrize("cancel_of_done", ["failed_precondition", "empty", "unimplemented"])
def test_a_cancel_of_an_operation_done_already_reads_its_end(
    fleet_parts: FleetParts, cancel_of_done: str
) -> None:
    """The ledger still says WORKING (the next poll is a minute away) when the operation is done on the
    server: whatever the cancel answers (400 FAILED_PRECONDITION, a silent Empty, 501 UNIMPLEMENTED), the
    end is read by polling and the completion stands, never rewritten to cancelled."""
    with running_aip_fleet(
        fleet_parts,
        aip_flags=("--cancel-of-done", cancel_of_done),
        exports={"default_poll_interval_ms": 60_000},
    ) as aip_fleet:
        fleet = aip_fleet.fleet
        op_id = aip_fleet.submit("n/aip-late-cancel", args(0.2))
        op = fleet.wait_state(op_id, S.WORKING)
        name = str(op.remote_id)
        support.wait_for(
            "the operation to be done on the server", lambda: aip_fleet.server_operation(name).get("done")
        )
        fleet.send("longcall.cancel", op_id=str(op_id))
        receipt = fleet.wait_receipt("n/aip-late-cancel")
        assert receipt["terminal_state"] == "completed"
        assert fleet.ledger.get(op_id).state is S.ACCEPTED
        cancels = aip_fleet.requests("CancelOperation")
        assert [e["status"] for e in cancels] == [
            {"failed_precondition": 400, "empty": 200, "unimplemented": 501}[cancel_of_done]
        ]
