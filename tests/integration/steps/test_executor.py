"""The terminal-state protocol end to end: longcall's MCP server, real worker processes and beat."""

from __future__ import annotations

import pytest

from ledger.states import OpState
from tests import support
from tests.support.fleet import BROKERS, Fleet


@pytest.mark.parametrize("broker", BROKERS)
def test_happy_path_completed_failed_and_synchronous(fleet: Fleet) -> None:
    done = fleet.submit("n/report", "slow_report", {"seconds": 0.5})
    failed = fleet.submit("n/failing", "slow_report", {"seconds": 0.2, "fail": True})
    sync = fleet.submit("n/lookup", "quick_lookup", {"key": "k1"})

    receipt = fleet.wait_receipt("n/report")
    assert receipt["terminal_state"] == "completed"
    assert receipt["result"]["content"][0]["text"] == "report ready after 0.5s"
    assert fleet.wait_receipt("n/failing")["terminal_state"] == "failed"
    lookup = fleet.wait_receipt("n/lookup")
    assert (lookup["terminal_state"], lookup["result"]["content"][0]["text"]) == ("completed", "value:k1")

    assert fleet.ledger.get(done).state is OpState.ACCEPTED
    assert fleet.ledger.get(failed).state is OpState.ACCEPTED
    assert fleet.ledger.get(sync).remote_id is None  # it ran as one synchronous call
    creates = [e for e in fleet.mcp.log() if e["method"] == "tools/call"]
    assert len(creates) == 3


def test_cancel_of_a_running_task(fleet: Fleet) -> None:
    op_id = fleet.submit("n/long", "slow_report", {"seconds": 60})
    fleet.wait_state(op_id, OpState.WORKING)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/long")
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    assert fleet.ledger.get(op_id).state is OpState.CANCELLED_ACCEPTED


@pytest.mark.parametrize("broker", BROKERS)
def test_input_required_round_trip_and_an_old_round_is_refused(fleet: Fleet) -> None:
    op_id = fleet.submit("n/approve", "ask_approval", {"question": "Ship it?"})
    request = support.wait_for(
        "the approval gate to be asked", lambda: next(iter(fleet.input_requests()), None)
    )
    assert (request["op_id"], request["input_round"]) == (str(op_id), 1)
    assert request["request"]["message"] == "Ship it?"
    assert request["schema_digest"].startswith("sha256:")
    op = fleet.ledger.get(op_id)
    assert (op.state, op.next_poll_at) == (OpState.INPUT_REQUIRED, None)  # polling paused

    with pytest.raises(Exception, match="does not match the requested schema"):
        fleet.send(
            "longcall.provide_input",
            op_id=str(op_id),
            input_round=1,
            response={"action": "accept", "content": {"approved": "yes"}},
        )
    fleet.send(
        "longcall.provide_input",
        op_id=str(op_id),
        input_round=1,
        response={"action": "accept", "content": {"approved": True}},
    )
    receipt = fleet.wait_receipt("n/approve")
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == ("completed", "approved")

    with pytest.raises(Exception, match="not waiting for input") as replay:
        fleet.send(
            "longcall.provide_input",
            op_id=str(op_id),
            input_round=1,
            response={"action": "accept", "content": {"approved": False}},
        )
    assert type(replay.value).__name__ == "RequestRefused"
    refused = [e for e in fleet.ledger.events(op_id) if e["kind"] == "input_refused"]
    assert len(refused) == 2


def test_a_lost_create_answer_never_creates_twice(fleet: Fleet) -> None:
    fleet.mcp.faults(lose_create_response=1)
    op_id = fleet.submit("n/lost", "slow_report", {"seconds": 30})
    op = fleet.wait_state(op_id, OpState.MANUAL_RECONCILIATION)
    [record] = fleet.ledger.reconciliations_for(op_id)
    assert record.reason.value == "SUBMISSION_UNKNOWN"
    assert fleet.ledger.find_by_submission_key(op.submission_key) == op
    assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == 1
    assert (
        len(fleet.mcp.tasks()) == 1
    )  # the server did create it: an operator decides, longcall never re-calls
    kinds = [e["kind"] for e in fleet.ledger.events(op_id)]
    assert (
        kinds.index("create_attempted")
        < kinds.index("submission_unknown")
        < kinds.index("manual_reconciliation")
    )


@pytest.mark.parametrize("broker", BROKERS)
def test_a_completion_that_wins_the_cancel_race_is_accepted(fleet: Fleet) -> None:
    op_id = fleet.submit("n/race", "slow_report", {"seconds": 60})
    fleet.wait_state(op_id, OpState.WORKING)
    fleet.mcp.faults(complete_on_cancel=1)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/race")
    assert receipt["terminal_state"] == "completed"
    assert fleet.ledger.get(op_id).state is OpState.ACCEPTED
    assert fleet.ledger.open_reconciliations() == []


def test_a_downstream_task_that_fails_and_retries_sees_the_same_receipt(fleet: Fleet) -> None:
    flaky = dict(fleet.pipeline.signature("pipeline.flaky", queue="pipeline"))
    fleet.send(
        "longcall.submit",
        call_node_id="n/flaky",
        server="reports",
        tool="slow_report",
        arguments={"seconds": 0.2},
        on_terminal=flaky,
    )
    attempts = support.wait_for(
        "the retried downstream attempt",
        lambda: a if len(a := [d for d in fleet.deliveries() if "attempt" in d]) >= 2 else None,
    )
    assert [a["attempt"] for a in attempts] == [0, 1]
    assert attempts[0]["task_id"] == attempts[1]["task_id"]
    assert attempts[0]["kwargs"]["receipt"] == attempts[1]["kwargs"]["receipt"]
