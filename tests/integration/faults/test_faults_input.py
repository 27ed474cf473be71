"""Input rounds under faults (issue 8, items 5 and 6): an input request cut with its stream, one that can
never be read, and a reply posted late while polls go on.

Real processes (longcall's MCP server with its fault switches, longcall workers, beat, a pipeline worker),
real Postgres and Redis; every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from console.main import main as cli
from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet

S = OpState
APPROVE = {"action": "accept", "content": {"approved": True}}
#: Long enough for the slowest step here (a status read that listens for an input request on two streams).
LEASE_S = "30"


@pytest.fixture
def input_fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    with running_fleet(fleet_parts, env={"LONGCALL_LEASE_S": LEASE_S}) as fleet:
        yield fleet


def longcall(fleet: Fleet, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """Run one ``longcall ... --json`` command against the fleet's ledger and config; its JSON output."""
    for name, value in fleet.env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def gate_rounds(fleet: Fleet, op_id: uuid.UUID) -> list[int]:
    return [r["input_round"] for r in fleet.input_requests() if r["op_id"] == str(op_id)]


def test_an_input_request_cut_with_its_stream_is_read_by_resuming_the_stream(input_fleet: Fleet) -> None:
    """Item 5 (a): the server's stream is cut under its question and it never sends it again on another
    stream, but it gave event ids: the stream is resumed with Last-Event-ID and round 1 opens."""
    fleet = input_fleet
    fleet.mcp.faults(sse_event_ids=True, lose_input_request=1)
    op_id = fleet.submit("n/cut-once", "ask_approval", {"question": "Ship it?"})

    request = support.wait_for(
        "the approval gate to be asked (the question read by resuming its stream)",
        lambda: next((r for r in fleet.input_requests() if r["op_id"] == str(op_id)), None),
        timeout=30,
    )
    assert (request["input_round"], request["request"]["message"]) == (1, "Ship it?")
    op = fleet.ledger.get(op_id)
    assert (op.state, op.input_round) == (S.INPUT_REQUIRED, 1)

    fleet.send("longcall.provide_input", op_id=str(op_id), input_round=1, response=APPROVE)
    receipt = fleet.wait_receipt("n/cut-once")
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == ("completed", "approved")
    assert gate_rounds(fleet, op_id) == [1]
    assert fleet.ledger.reconciliations_for(op_id) == []
    assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == 1


def test_an_input_request_that_cannot_be_read_goes_to_an_operator_within_the_bound(
    fleet_parts: FleetParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5 (b): the server says input_required, its question was lost with a stream that gave no event
    ids and is never sent again: within LONGCALL_INPUT_UNREADABLE_S the operation goes to an operator with
    an INPUT_UNREADABLE record, and ``longcall inputs`` / ``longcall reconcile`` show what is known."""
    env = {"LONGCALL_LEASE_S": LEASE_S, "LONGCALL_INPUT_UNREADABLE_S": "4"}
    with running_fleet(fleet_parts, env=env) as fleet:
        fleet.mcp.faults(lose_input_request=1)
        started = time.monotonic()
        op_id = fleet.submit("n/unreadable", "ask_approval", {"question": "Ship it?"})

        # While the bound runs, the operation is listed as waiting for a question nobody could read.
        waiting = support.wait_for(
            "the unreadable question to be listed by longcall inputs",
            lambda: next(
                (r for r in longcall(fleet, monkeypatch, "inputs") if r["op_id"] == str(op_id)), None
            ),
            timeout=30,
        )
        assert waiting["unreadable"] is True
        assert (waiting["server_state"], waiting["status_message"]) == ("input_required", "waiting for input")
        assert (waiting["input_round"], waiting["request"]) == (0, None)

        # One status read listens up to 5 s on each of two streams: the bound (4 s) plus two such reads.
        op = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=4 + 2 * 11 + 5)
        assert time.monotonic() - started < 4 + 2 * 11 + 5
        assert (op.server_state, op.status_message) == ("input_required", "waiting for input")
        (record,) = fleet.ledger.reconciliations_for(op_id)
        assert record.reason is ReconciliationReason.INPUT_UNREADABLE
        assert record.resolved_at is None
        assert record.detail["server_state"] == "input_required"
        assert record.detail["remote_id"] == op.remote_id

        listed = longcall(fleet, monkeypatch, "reconcile")
        assert [(r["op_id"], r["reason"]) for r in listed] == [(str(op_id), "INPUT_UNREADABLE")]
        assert listed[0]["detail"]["unreadable_since"] == record.detail["unreadable_since"]
        (row,) = [r for r in longcall(fleet, monkeypatch, "inputs") if r["op_id"] == str(op_id)]
        assert (row["state"], row["unreadable"], row["reconciliation"]) == (
            "MANUAL_RECONCILIATION",
            True,
            "INPUT_UNREADABLE",
        )
        assert row["unreadable_since"] == record.detail["unreadable_since"]
        assert gate_rounds(fleet, op_id) == []  # the gate was never asked a question nobody read
        assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == 1


def test_a_reply_posted_late_is_one_round_for_one_question(input_fleet: Fleet) -> None:
    """Item 6 (issue 8), as issue 19 item 5 made it: the reply to round 1 is stored before it is sent, and
    sent under a claim of the operation; the server takes it only 8 s later. While it is in flight no step
    of the operation runs beside it (no status read sees the question again mid-reply), and the question is
    never a round 2: one round, one reply taken, one receipt.

    The reply is sent by ``longcall.provide_input`` itself, or, when a poll step held the claim at that
    moment, by the step that next finds it not yet taken ("input_recorded"): the window is the server's,
    from the reply's arrival to its 202, whichever step sent it."""
    fleet = input_fleet
    fleet.mcp.faults(delay_reply_ms=8000)
    op_id = fleet.submit("n/late-reply", "ask_approval", {"question": "Ship it?"})
    support.wait_for("the approval gate to be asked", lambda: gate_rounds(fleet, op_id) or None)

    answer = fleet.send("longcall.provide_input", op_id=str(op_id), input_round=1, response=APPROVE)
    assert answer["action"] in ("input_provided", "input_recorded"), answer

    receipt = fleet.wait_receipt("n/late-reply")
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == ("completed", "approved")
    replies = fleet.mcp.replies()
    assert [r["outcome"] for r in replies] == ["taken"]
    arrived, answered = replies[0]["t"], replies[0]["answered"]
    assert answered - arrived >= 7.5, "the fault did not hold the reply: the late reply was not exercised"
    # The window was real, and held: no status read while the server held the reply (the step that sent it
    # holds the operation's claim until the 202; the server's own clock on both sides).
    reads = [
        e
        for e in fleet.mcp.log()
        if e["method"] in ("tasks/get", "tasks/result") and arrived < e["t"] < answered
    ]
    assert reads == [], f"{len(reads)} status reads ran beside the reply in flight"
    assert gate_rounds(fleet, op_id) == [1]
    op = fleet.ledger.get(op_id)
    assert (op.state, op.input_round) == (S.ACCEPTED, 1)
    assert [r["call_node_id"] for r in fleet.receipts()] == ["n/late-reply"]
