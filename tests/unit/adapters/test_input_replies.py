"""Input, the protocol's part: which replies a server's question accepts (``check_reply``), and a status
that says input is awaited when the question itself is not in it (``awaiting_input``)."""

from __future__ import annotations

from typing import Any

import httpx2
import pytest

from adapters import InputRequest, RemoteRef, Timeouts, ToolAdapter
from adapters.mcp_2025_11_25.wire import parse_task, reply_refusal
from tests.unit.adapters.mcp_fakes import SESSION, FakeMcpServer, Json, make_adapter, sse_body

TASK = "task-1"
REF = RemoteRef(remote_id=TASK, session_ref=SESSION, protocol_version="2025-11-25")
SCHEMA = {
    "type": "object",
    "properties": {"confirm": {"type": "boolean"}, "reason": {"type": "string"}},
    "required": ["confirm"],
}


def ask(schema: dict[str, Any] | None = SCHEMA, method: str = "elicitation/create") -> InputRequest:
    return InputRequest(
        request_id=7, method=method, params={"message": "Deploy?"}, schema=schema, task_id=TASK
    )


def adapter() -> ToolAdapter:
    return make_adapter(FakeMcpServer())


# ---- check_reply ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response",
    [
        {"action": "accept", "content": {"confirm": True}},
        {"action": "accept", "content": {"confirm": False, "reason": "not today"}},
        {"action": "decline"},
        {"action": "cancel"},
        {"action": "decline", "content": {"confirm": "not checked when declined"}},
    ],
)
def test_a_valid_elicitation_reply_is_accepted(response: dict[str, Any]) -> None:
    assert adapter().check_reply(ask(), response) is None


@pytest.mark.parametrize(
    "response", [{}, {"action": "yes"}, {"action": None}, {"content": {"confirm": True}}]
)
def test_an_elicitation_reply_needs_one_of_the_three_actions(response: dict[str, Any]) -> None:
    assert (
        adapter().check_reply(ask(), response)
        == "an elicitation reply needs action accept, decline or cancel"
    )


def test_accepted_content_must_match_the_requested_schema() -> None:
    refusal = adapter().check_reply(ask(), {"action": "accept", "content": {"confirm": "yes"}})
    assert refusal == "content does not match the requested schema: 'yes' is not of type 'boolean'"


def test_accepted_without_content_is_checked_as_an_empty_object() -> None:
    refusal = adapter().check_reply(ask(), {"action": "accept"})
    assert refusal == "content does not match the requested schema: 'confirm' is a required property"


def test_a_schema_the_validator_cannot_use_is_a_refusal_with_its_message() -> None:
    refusal = adapter().check_reply(ask({"type": "no-such-type"}), {"action": "accept", "content": {}})
    assert refusal is not None
    assert refusal.startswith("the server's schema is not usable: ")
    assert "no-such-type" in refusal


def test_an_elicitation_without_a_schema_accepts_any_content() -> None:
    assert adapter().check_reply(ask(None), {"action": "accept", "content": {"anything": 1}}) is None


def test_other_input_methods_are_not_checked_here() -> None:
    sampling = ask(None, method="sampling/createMessage")
    assert adapter().check_reply(sampling, {"role": "assistant", "whatever": True}) is None
    assert reply_refusal(sampling, {}) is None


def test_checking_a_reply_sends_nothing() -> None:
    server = FakeMcpServer()
    make_adapter(server).check_reply(ask(), {"action": "accept", "content": {"confirm": True}})
    assert server.requests == []


# ---- awaiting_input ------------------------------------------------------------------------------


def task(status: str) -> Json:
    return {"taskId": TASK, "status": status, "ttl": None}


@pytest.mark.parametrize(
    ("status", "awaiting"),
    [("working", False), ("input_required", True), ("completed", False), ("cancelled", False)],
)
def test_a_parsed_status_awaits_input_exactly_when_the_server_says_input_is_required(
    status: str, awaiting: bool
) -> None:
    parsed = parse_task(task(status))
    assert parsed.awaiting_input is awaiting
    assert parsed.input_request is None


def test_a_status_with_its_question_read_no_longer_awaits_it() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("input_required"))
    question = {
        "jsonrpc": "2.0",
        "id": "ask-1",
        "method": "elicitation/create",
        "params": {"message": "Deploy?", "requestedSchema": SCHEMA},
    }
    server.on(
        "tasks/result",
        lambda _b, _r: httpx2.Response(
            200, content=sse_body([question]), headers={"content-type": "text/event-stream"}
        ),
    )
    status = make_adapter(server).get(REF)
    assert status.input_request is not None
    assert not status.awaiting_input


def test_a_status_whose_question_could_not_be_read_awaits_input() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("input_required"))
    server.on("tasks/result", lambda _b, _r: httpx2.Response(503))
    status = make_adapter(server, timeouts=Timeouts(read=5.0, input_wait=0.2)).get(REF)
    assert status.input_request is None
    assert status.awaiting_input


def test_a_status_read_without_its_question_awaits_input() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("input_required"))
    status = make_adapter(server).get(REF, read_input=False)
    assert status.awaiting_input
    assert [b.get("method") for b in server.bodies] == ["tasks/get"]
