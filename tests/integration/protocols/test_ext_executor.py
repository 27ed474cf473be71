"""The terminal-state protocol end to end on the MCP tasks extension (2026-07-28): the real fastmcp-tasks
peer as ``tasks_ext`` beside longcall's 2025-11-25 server as ``reports``, real workers, beat and pipeline."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from ledger.states import OpState as S
from tests import support
from tests.support.ext_fleet import EXT_VERSION, ExtFleet, running_ext_fleet
from tests.support.fleet import FleetParts


@pytest.fixture
def ext_fleet(fleet_parts: FleetParts) -> Iterator[ExtFleet]:
    with running_ext_fleet(fleet_parts) as running:
        yield running


def test_happy_path_completed_tool_error_and_json_rpc_error(ext_fleet: ExtFleet) -> None:
    fleet = ext_fleet.fleet
    done = ext_fleet.submit("n/ext-job", "slow_job", {"steps": 2, "step_s": 0.2})
    ext_fleet.submit("n/ext-tool-error", "tool_error", {})
    ext_fleet.submit("n/ext-rpc-error", "protocol_error", {})

    receipt = fleet.wait_receipt("n/ext-job")
    assert receipt["terminal_state"] == "completed"
    assert receipt["result"]["content"][0]["text"] == "slow_job finished 2 steps"
    op = fleet.ledger.get(done)
    assert (op.state, op.protocol_version, op.session_ref) == (S.ACCEPTED, EXT_VERSION, None)
    tool_error = fleet.wait_receipt("n/ext-tool-error")
    assert tool_error["terminal_state"] == "failed"
    rpc_error = fleet.wait_receipt("n/ext-rpc-error")
    assert rpc_error["terminal_state"] == "failed"
    assert "upstream API rate limit exceeded" in json.dumps(rpc_error["result"])


def test_cancel_wins_acknowledged_then_cancelled_by_polling(ext_fleet: ExtFleet) -> None:
    fleet = ext_fleet.fleet
    op_id = ext_fleet.submit("n/ext-cancel", "slow_job", {"steps": 100, "step_s": 0.2})
    fleet.wait_state(op_id, S.WORKING)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/ext-cancel")
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    op = fleet.ledger.get(op_id)
    assert op.state is S.CANCELLED_ACCEPTED
    # the cancel was only acknowledged (the adapter's answer, see the conformance test): the cancelled end
    # was read from the server afterwards
    assert ext_fleet.server_status(str(op.remote_id)).server_state == "cancelled"


def test_completion_wins_the_race_and_is_accepted_completed(ext_fleet: ExtFleet) -> None:
    """The task completes on the server while the ledger still says WORKING (the next poll is 30 s away,
    the tool's hint): the cancel is acknowledged, and the completion read by polling stands."""
    fleet = ext_fleet.fleet
    op_id = ext_fleet.submit("n/ext-race", "rare_poll_job", {"seconds": 0.3})
    op = fleet.wait_state(op_id, S.WORKING)
    remote_id = str(op.remote_id)
    support.wait_for(
        "the task to complete on the server",
        lambda: ext_fleet.server_status(remote_id).server_state == "completed" or None,
        timeout=20,
    )
    assert fleet.ledger.get(op_id).state is S.WORKING
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/ext-race")
    assert receipt["terminal_state"] == "completed"
    assert receipt["result"]["content"][0]["text"] == "rare_poll_job done after 0.3s"
    assert fleet.ledger.get(op_id).state is S.ACCEPTED


def test_input_round_trip_keyed_as_asked_and_an_answered_key_refused(ext_fleet: ExtFleet) -> None:
    fleet = ext_fleet.fleet
    op_id = ext_fleet.submit("n/ext-ask", "ask_name", {"greeting": "Hello"})
    asked = support.wait_for(
        "the approval gate to be asked", lambda: next(iter(fleet.input_requests()), None)
    )
    assert (asked["op_id"], asked["input_round"]) == (str(op_id), 1)
    (key,) = asked["request"]  # the inputRequests map as sent
    assert asked["request"][key]["method"] == "elicitation/create"
    assert asked["request"][key]["params"]["message"] == "Please enter your name."

    with pytest.raises(Exception, match="not asked in this round"):
        fleet.send(
            "longcall.provide_input",
            op_id=str(op_id),
            input_round=1,
            response={"other-key": {"action": "accept", "content": {"name": "Mallory"}}},
        )
    with pytest.raises(Exception, match="does not match the requested schema"):
        fleet.send(
            "longcall.provide_input",
            op_id=str(op_id),
            input_round=1,
            response={key: {"action": "accept", "content": {"name": 42}}},
        )
    fleet.send(
        "longcall.provide_input",
        op_id=str(op_id),
        input_round=1,
        response={key: {"action": "accept", "content": {"name": "Luca"}}},
    )
    receipt = fleet.wait_receipt("n/ext-ask")
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == (
        "completed",
        "Hello, Luca!",
    )

    with pytest.raises(Exception, match="not waiting for input"):
        fleet.send(
            "longcall.provide_input",
            op_id=str(op_id),
            input_round=1,
            response={key: {"action": "accept", "content": {"name": "Mallory"}}},
        )
    assert len(fleet.input_requests()) == 1  # one round: the key shown again was not asked twice
    assert fleet.ledger.get(op_id).input_round == 1


def test_both_versions_live_and_one_disabled(ext_fleet: ExtFleet) -> None:
    """With mcp/2026-07-28 disabled, its new operations are refused while its in-flight one finishes, and
    mcp/2025-11-25 keeps working."""
    fleet = ext_fleet.fleet
    in_flight = ext_fleet.submit("n/ext-in-flight", "slow_job", {"steps": 8, "step_s": 0.25})
    fleet.wait_state(in_flight, S.WORKING)
    fleet.ledger.set_adapter_disabled("mcp", EXT_VERSION, disabled=True, actor="test")

    with pytest.raises(Exception, match="2026-07-28 adapter is disabled for new operations") as refused:
        ext_fleet.submit("n/ext-refused", "slow_job", {"steps": 1, "step_s": 0.1})
    assert type(refused.value).__name__ == "SubmissionRefused"
    legacy = fleet.submit("n/legacy", "slow_report", {"seconds": 0.3})

    assert fleet.wait_receipt("n/legacy")["terminal_state"] == "completed"
    assert fleet.ledger.get(legacy).protocol_version == "2025-11-25"
    finished = fleet.wait_receipt("n/ext-in-flight")
    assert finished["terminal_state"] == "completed"
    assert fleet.ledger.get(in_flight).protocol_version == EXT_VERSION
    assert fleet.ledger.find_by_call_node("n/ext-refused") is None
