"""Faults on the MCP tasks extension (2026-07-28), end to end: longcall's demo_server.mcp_ext as
``tasks_ext`` with its fault switches, real workers, beat and pipeline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from ledger.states import OpState as S
from tests import support
from tests.support.ext_fleet import EXT_VERSION, ExtFleet, running_ext_fleet
from tests.support.fleet import FleetParts, McpServer


@pytest.fixture
def ext_demo(fleet_parts: FleetParts) -> Iterator[ExtFleet]:
    with running_ext_fleet(fleet_parts, demo_flags=()) as running:
        yield running


def server(ext: ExtFleet) -> McpServer:
    assert ext.demo is not None
    return ext.demo


def calls(ext: ExtFleet, method: str) -> list[dict[str, Any]]:
    return [e for e in server(ext).log() if e["method"] == method]


def test_a_lost_create_answer_goes_to_an_operator_with_a_clear_reason(ext_demo: ExtFleet) -> None:
    """No idempotency key and no tasks/list: the lost answer can be neither found nor proved never made,
    so the operation waits for an operator; the tool is never called a second time."""
    fleet = ext_demo.fleet
    server(ext_demo).faults(lose_create_response=1)
    op_id = ext_demo.submit("n/ext-lost", "slow_report", {"seconds": 30})
    op = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=60)
    [record] = fleet.ledger.reconciliations_for(op_id)
    assert record.reason.value == "SUBMISSION_UNKNOWN"
    assert "no idempotency key" in json.dumps(record.detail, default=str)
    assert len(calls(ext_demo, "tools/call")) == 1
    assert len(server(ext_demo).tasks()) == 1  # the one task the lost answer named
    assert op.protocol_version == EXT_VERSION


def test_cancel_acknowledged_then_the_completion_wins(ext_demo: ExtFleet) -> None:
    fleet = ext_demo.fleet
    server(ext_demo).faults(complete_on_cancel=1)
    op_id = ext_demo.submit("n/ext-completion-wins", "slow_report", {"seconds": 60})
    fleet.wait_state(op_id, S.WORKING)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/ext-completion-wins")
    assert receipt["terminal_state"] == "completed"
    assert receipt["result"]["content"][0]["text"] == "report ready after 60s"
    assert fleet.ledger.get(op_id).state is S.ACCEPTED
    assert len(calls(ext_demo, "tasks/cancel")) == 1

    # the other order: the cancel wins
    other = ext_demo.submit("n/ext-cancel-wins", "slow_report", {"seconds": 60})
    fleet.wait_state(other, S.WORKING)
    fleet.send("longcall.cancel", op_id=str(other))
    assert fleet.wait_receipt("n/ext-cancel-wins")["terminal_state"] == "cancelled"
    assert fleet.ledger.get(other).state is S.CANCELLED_ACCEPTED


def test_429_with_retry_after_on_create_and_on_polls(ext_demo: ExtFleet) -> None:
    fleet = ext_demo.fleet
    server(ext_demo).faults(
        status_429={
            "tools/call": {"count": 1, "retry_after_s": 1},
            "tasks/get": {"count": 2, "retry_after_s": 1},
        }
    )
    op_id = ext_demo.submit("n/ext-429", "slow_report", {"seconds": 0.2})
    receipt = fleet.wait_receipt("n/ext-429", timeout=60)
    assert receipt["terminal_state"] == "completed"
    assert len(calls(ext_demo, "tools/call")) == 2  # refused once before any work, then made once
    assert len(server(ext_demo).tasks()) == 1
    kinds = [e["kind"] for e in fleet.ledger.events(op_id)]
    assert "rate_limited" in kinds


def test_a_result_error_inline_nested_create_and_input_round(ext_demo: ExtFleet) -> None:
    fleet = ext_demo.fleet
    server(ext_demo).faults(nested_create=True, result_error={"code": -32603, "message": "store exploded"})
    ext_demo.submit("n/ext-error", "slow_report", {"seconds": 0.2})
    failed = fleet.wait_receipt("n/ext-error")
    assert failed["terminal_state"] == "failed"
    assert "store exploded" in json.dumps(failed["result"])

    server(ext_demo).faults(result_error=None)
    op_id = ext_demo.submit("n/ext-approve", "ask_approval", {"question": "Ship it?"})
    asked = support.wait_for(
        "the approval gate to be asked", lambda: next(iter(fleet.input_requests()), None)
    )
    (key,) = asked["request"]
    assert asked["request"][key]["params"]["message"] == "Ship it?"
    fleet.send(
        "longcall.provide_input",
        op_id=str(op_id),
        input_round=1,
        response={key: {"action": "accept", "content": {"approved": True}}},
    )
    receipt = fleet.wait_receipt("n/ext-approve")
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == ("completed", "approved")
    [update] = calls(ext_demo, "tasks/update")
    assert update["params"]["inputResponses"] == {key: {"action": "accept", "content": {"approved": True}}}
    remote_id = str(fleet.ledger.get(op_id).remote_id)
    for entry in server(ext_demo).log():
        if str(entry["method"]).startswith("tasks/") and entry["params"].get("taskId") == remote_id:
            assert entry["headers"]["mcp-name"] == remote_id


def test_the_poll_interval_hint_is_a_floor(fleet_parts: FleetParts) -> None:
    """The server hints 1 s between polls: a 3 s task is read about three times, never more often than the
    hint allows (fastmcp-tasks' own client starts at 20 ms and doubles up to the hint; longcall does not)."""
    with running_ext_fleet(fleet_parts, demo_flags=("--poll-interval-ms", "1000")) as ext:
        op_id = ext.submit("n/ext-floor", "slow_report", {"seconds": 3})
        assert ext.fleet.wait_receipt("n/ext-floor", timeout=60)["terminal_state"] == "completed"
        op = ext.fleet.ledger.get(op_id)
        polls = [e for e in server(ext).log() if e["method"] == "tasks/get"]
        assert 2 <= len(polls) <= 4, len(polls)  # 3 s / 1 s, plus the read that sees the end
        assert op.poll_interval_ms == 1000
