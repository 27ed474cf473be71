"""Intents through a credential refusal (issue 23): the server refuses the fleet's bearer token (a 401, not
renewable: a static token) while a cancel or an input reply is to be sent. The server did nothing with the
request, so the intent is kept and sent again after a growing pause; once the token is put right, the cancel
cancels and the reply answers. Before, the 401 read as "this server refuses cancels" (the cancel lost, the
report completed) or as a refused reply (the answer lost).

Real processes (longcall's MCP server with its ``require_bearer`` switch, workers, beat, a pipeline worker),
real Postgres and Redis; every wait bounded."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet

pytestmark = pytest.mark.slow

GOOD = "token-good"


def refused_for_credentials(fleet: Fleet, op_id: uuid.UUID, kind: str) -> int:
    """``kind`` events of ``op_id`` that say the server refused the credentials."""
    errors = [
        str((e["detail"] or {}).get("error", "")) for e in fleet.ledger.events(op_id) if e["kind"] == kind
    ]
    return len([error for error in errors if error.startswith("Unauthorized: HTTP 401")])


@pytest.fixture
def guarded_fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    """A fleet whose server takes only the token in the fleet's token file (as it is at first)."""
    token = fleet_parts.tmp_path / "reports.token"
    token.write_text(GOOD)
    with running_fleet(fleet_parts, server={"auth_file": str(token)}) as running:
        running.mcp.faults(require_bearer=GOOD)
        yield running


@pytest.mark.timeout(180)
def test_a_cancel_refused_for_the_credentials_is_kept_and_cancels_once_they_are_put_right(
    guarded_fleet: Fleet,
) -> None:
    fleet = guarded_fleet
    op_id = fleet.submit("n/cancel-401", "slow_report", {"seconds": 60})
    fleet.wait_state(op_id, OpState.WORKING, timeout=60)

    fleet.mcp.faults(require_bearer="a-token-the-fleet-does-not-have")
    fleet.send("longcall.cancel", op_id=str(op_id))
    support.wait_for(
        "two cancels refused for the credentials",
        lambda: refused_for_credentials(fleet, op_id, "cancel_failed") >= 2,
        timeout=60,
    )
    assert fleet.ledger.get(op_id).state is OpState.CANCEL_REQUESTED  # the intent is kept
    assert not [e for e in fleet.ledger.events(op_id) if e["kind"] == "cancel_refused"]

    fleet.mcp.faults(require_bearer=GOOD)
    receipt = fleet.wait_receipt("n/cancel-401", timeout=60)
    assert receipt["terminal_state"] == "cancelled"
    assert any(e["method"] == "tasks/cancel" for e in fleet.mcp.log())  # sent once the token was good


@pytest.mark.timeout(180)
def test_an_input_reply_refused_for_the_credentials_is_kept_and_answers_once_they_are_put_right(
    guarded_fleet: Fleet,
) -> None:
    fleet = guarded_fleet
    op_id = fleet.submit("n/reply-401", "ask_approval", {"question": "Ship?"})
    [request] = support.wait_for("the input request", lambda: fleet.input_requests() or None, timeout=60)

    fleet.mcp.faults(require_bearer="a-token-the-fleet-does-not-have")
    fleet.send(
        "longcall.provide_input",
        op_id=request["op_id"],
        input_round=request["input_round"],
        response={"action": "accept", "content": {"approved": True}},
    )
    support.wait_for(
        "a reply refused for the credentials",
        lambda: refused_for_credentials(fleet, op_id, "input_reply_failed") >= 1,
        timeout=60,
    )
    fleet.mcp.faults(require_bearer=GOOD)
    receipt = fleet.wait_receipt("n/reply-401", timeout=60)
    assert receipt["terminal_state"] == "completed"
    assert receipt["result"]["content"][0]["text"] == "approved"
