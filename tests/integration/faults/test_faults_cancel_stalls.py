"""Ways a cancel stalled in CANCEL_REQUESTED (hardening, H14 and the brief after it).

1. A cancel that cannot be sent: the AIP-151 demo server answers 503 to every ``CancelOperation``. Before
   the operation's wait budget ends it is retried (a 503 decided nothing); past it, the status read decides:
   a terminal state wins, an open one goes to an operator (DEADLINE_EXCEEDED, the last error named), never
   retried for ever.
2. A cancel on a control budget slower than one slot per dispatch tick (``control_qps`` 2): the status read
   after the cancel is charged as the step's follow-up, and a step whose read finds no token reads later
   and never sends the cancel again. AIP-151: ``test_gate.py::test_an_aip151_cancel_on_a_slow_control_
   budget_ends``; the MCP tasks extension (its cancel is an acknowledgement too) here.
3. A cancel acknowledged whose status read then never gets a control token (a fleet-wide hold outlasting
   the wait budget): it ends at the wait budget with an operator (DEADLINE_EXCEEDED, no token named), the
   cancel sent once; before, it was rescheduled silently for as long as the token stayed away.
4. A cancel that never gets a control token to be sent (the hold set before it): it ends at the wait budget
   with an operator, nothing sent; before, the step past the deadline found no token before it looked at
   the deadline, and was rescheduled for the hold's length.
5. A cancel refused past the wait budget with a Retry-After: its one final status read is made after that
   wait, as for every other cancel that could not be sent; before, the hold made the read find no token
   and the operator was told nothing of the operation's state.

Real worker processes, beat, Postgres, Redis and the demo server.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest

from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests import support
from tests.support.aip_fleet import AIP_SERVER, args, running_aip_fleet
from tests.support.ext_fleet import EXT_SERVER, ext_config, start_ext_demo_server
from tests.support.fleet import FleetParts, fleet_config, running_fleet, start_mcp_server
from workers.hot import HotState

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


@pytest.mark.slow
def test_an_mcp_tasks_extension_cancel_on_a_slow_control_budget_ends(fleet_parts: FleetParts) -> None:
    """The extension's ``tasks/cancel`` is only an acknowledgement: its end is read after it, on the same
    control budget (2 a second, below one slot per 250 ms tick). One ``tasks/cancel``, the task cancelled."""
    with contextlib.ExitStack() as stack:
        demo = start_ext_demo_server(fleet_parts.log_dir)
        stack.callback(demo.process.stop)
        mcp = start_mcp_server(fleet_parts.log_dir)
        stack.callback(mcp.process.stop)
        config = fleet_parts.tmp_path / "longcall-ext-slow.toml"
        config.write_text(fleet_config(mcp.url) + ext_config(demo.url, poll_qps=3, control_qps=2))
        fleet = stack.enter_context(running_fleet(fleet_parts, env={"LONGCALL_CONFIG": str(config)}))
        signature = dict(fleet.pipeline.signature("pipeline.record", queue="pipeline"))
        answer = fleet.send(
            "longcall.submit",
            call_node_id="n/ext-slow-cancel",
            server=EXT_SERVER,
            tool="slow_report",
            arguments={"seconds": 60},
            on_terminal=signature,
        )
        op_id = answer["op_id"]
        fleet.wait_state(uuid.UUID(op_id), S.WORKING, timeout=30)
        fleet.send("longcall.cancel", op_id=op_id)
        try:
            receipt = fleet.wait_receipt("n/ext-slow-cancel", timeout=30)
        finally:
            cancels = [e for e in demo.log() if e["method"] == "tasks/cancel"]
    assert receipt["terminal_state"] == "cancelled"
    assert len(cancels) == 1


#: A hold far longer than the wait budget (and within the longest hold kept, ``MAX_SERVER_WAIT_S``).
LONG_HOLD_S = 60.0


@pytest.mark.slow
def test_an_acknowledged_cancel_whose_status_read_never_gets_a_token_ends_at_the_wait_budget(
    fleet_parts: FleetParts,
) -> None:
    """The cancel is acknowledged (and never carried out); from then on the control budget has no token
    for its status read (the server's fleet-wide hold outlasts the wait budget). The operation still ends
    at its wait budget: an operator told why (DEADLINE_EXCEEDED, no control token), the cancel sent once,
    not rescheduled silently for the hold's length."""
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        running.aip.faults(cancel_takes_ms=3_600_000)
        # A longer budget than the others': the hold is set well before it ends, even on a loaded machine.
        op_id = running.submit("n/ack-no-token", args(seconds=600), wait_budget_s=2 * WAIT_BUDGET_S)
        op = fleet.wait_state(op_id, S.WORKING, timeout=30)
        assert op.wait_deadline is not None
        fleet.send("longcall.cancel", op_id=str(op_id))
        assert fleet.ledger.get(op_id).state is S.CANCEL_REQUESTED
        # The hold once the cancel is acknowledged: set sooner, it kept the cancel itself from being sent (in
        # a full run; that path is the next test's).
        support.wait_for("the cancel acknowledged", lambda: running.requests("CancelOperation"), timeout=10)
        hot = HotState(fleet_parts.redis_client, prefix=f"{fleet_parts.broker_prefix}longcall:")
        assert hot.hold(AIP_SERVER, LONG_HOLD_S) > LONG_HOLD_S - 1  # no token for anything from here on
        deadline = op.wait_deadline.timestamp()
        assert time.time() < deadline - 1.0, "the hold was set too late to test the wait for a token"
        handed = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=deadline - time.time() + 10)
        handed_at = time.time()
        records = fleet.ledger.reconciliations_for(op_id)
        cancels = running.requests("CancelOperation")

    assert handed.state is S.MANUAL_RECONCILIATION
    assert handed_at <= deadline + 5.0, f"handed over {handed_at - deadline:.1f} s after the wait budget"
    assert [r.reason for r in records] == [ReconciliationReason.DEADLINE_EXCEEDED]
    detail = records[0].detail
    assert "acknowledged" in detail["why"], detail
    assert "no control token" in detail["why"], detail
    assert len(cancels) == 1, cancels  # acknowledged once, never sent again


@pytest.mark.slow
def test_a_cancel_that_never_gets_a_token_to_be_sent_ends_at_the_wait_budget(fleet_parts: FleetParts) -> None:
    """The server's fleet-wide hold is set before the cancel: the control budget has no token to send it,
    nor to read the status after. The operation still ends at its wait budget: an operator told that the
    cancel could not be sent for want of a control token, nothing sent. Before, the step past the deadline
    found no token before it looked at the deadline and was rescheduled for the hold's length (a hold
    renewed, by a server answering 429s to other calls, would have kept it there with no one told)."""
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        op_id = running.submit("n/cancel-no-token", args(seconds=600), wait_budget_s=2 * WAIT_BUDGET_S)
        op = fleet.wait_state(op_id, S.WORKING, timeout=30)
        assert op.wait_deadline is not None
        hot = HotState(fleet_parts.redis_client, prefix=f"{fleet_parts.broker_prefix}longcall:")
        assert hot.hold(AIP_SERVER, LONG_HOLD_S) > LONG_HOLD_S - 1  # no token for anything from here on
        fleet.send("longcall.cancel", op_id=str(op_id))
        assert fleet.ledger.get(op_id).state is S.CANCEL_REQUESTED
        deadline = op.wait_deadline.timestamp()
        assert time.time() < deadline - 1.0, "the hold was set too late to test the wait for a token"
        fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=deadline - time.time() + 10)
        handed_at = time.time()
        records = fleet.ledger.reconciliations_for(op_id)
        cancels = running.requests("CancelOperation")

    assert handed_at <= deadline + 5.0, f"handed over {handed_at - deadline:.1f} s after the wait budget"
    assert [r.reason for r in records] == [ReconciliationReason.DEADLINE_EXCEEDED]
    detail = records[0].detail
    assert "could not be sent" in detail["why"], detail
    assert "no control token for the cancel" in detail["why"], detail
    assert cancels == [], cancels  # never sent: no token for it


@pytest.mark.slow
def test_a_cancel_refused_with_retry_after_past_the_wait_budget_gets_its_final_status_read(
    fleet_parts: FleetParts,
) -> None:
    """Every CancelOperation gets 503 with a Retry-After of 2 s (held fleet-wide). Past the wait budget the
    last refused cancel is followed, as every other unsent cancel is, by one status read once the hold is
    over: the operator is told the operation's server state, and the read was not sent inside the hold."""
    retry_after_s = 2
    with running_aip_fleet(fleet_parts) as running:
        fleet = running.fleet
        running.aip.faults(status_503={"CancelOperation": {"count": ALWAYS, "retry_after_s": retry_after_s}})
        op_id = running.submit("n/cancel-503-ra", args(seconds=600), wait_budget_s=WAIT_BUDGET_S)
        op = fleet.wait_state(op_id, S.WORKING, timeout=30)
        assert op.wait_deadline is not None
        fleet.send("longcall.cancel", op_id=str(op_id))
        deadline = op.wait_deadline.timestamp()
        handed = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=WAIT_BUDGET_S + 20)
        handed_at = time.time()
        support.wait_for("a second after the hand-over", lambda: time.time() >= handed_at + 1.0, timeout=5)
        records = fleet.ledger.reconciliations_for(op_id)
        log = running.requests()

    assert handed_at <= deadline + retry_after_s + 5.0, f"handed over {handed_at - deadline:.1f} s late"
    assert [r.reason for r in records] == [ReconciliationReason.DEADLINE_EXCEEDED]
    detail = records[0].detail
    assert "could not be sent" in detail["why"], detail
    assert detail["server_state"] is not None, detail  # the final status read was made
    cancels = [e for e in log if e["rpc"] == "CancelOperation"]
    last_cancel = cancels[-1]
    reads = [e for e in log if e["rpc"] == "GetOperation" and e["t"] > last_cancel["t"]]
    assert len(reads) == 1, f"one final status read after the last refused cancel: {reads}"
    assert not reads[0]["inside_retry_after"], reads
    assert [e for e in log if e["t"] > handed_at] == [], "a request after the hand-over"
    assert handed.remote_id is not None
