"""The MCP adapter's pure half, fed with real answers from reference/wire/."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from adapters import ErrorInfo, NotFound, ProtocolViolation, Rejected, Transient, WrongTaskMode
from adapters.errors import ResultContradictsStatus
from adapters.jsonrpc import ErrorResponse, Request
from adapters.mcp_2025_11_25.wire import (
    RELATED_TASK,
    descriptor_digest,
    input_reply,
    negotiate,
    parse_create_result,
    parse_input_request,
    parse_task,
    parse_task_page,
    parse_tools_page,
    result_from_error,
    result_from_payload,
    rpc_error,
    strip_related_task,
    tool_task_support,
)
from adapters.streamable_http import Session
from tests.unit.adapters.mcp_fakes import wire, wire_messages, wire_result

SESSION = Session(session_id="9d029e60fd9944ec9f36b5431f692087", protocol_version="2025-11-25")


def first_message(transcript: str, title: str) -> dict[str, Any]:
    entry = next(e for t, e in wire(transcript).items() if t[3:] == title)
    return wire_messages(entry)[0]


def error_of(transcript: str, title: str) -> ErrorResponse:
    message = first_message(transcript, title)
    return ErrorResponse(id=message["id"], code=message["error"]["code"], message=message["error"]["message"])


# ---- negotiation ---------------------------------------------------------------------------------


def test_sdk_1_30_declares_task_tool_calls_list_and_cancel() -> None:
    facts = negotiate(wire_result("sse", "[A] initialize"), server="reports")
    assert (facts.task_tool_calls, facts.can_list, facts.can_cancel) == (True, True, True)
    assert facts.server_info["name"] == "tasks-peer"


def test_sdk_2_3_declares_no_tasks() -> None:
    facts = negotiate(wire_result("v2_notasks", "[v2] initialize"), server="reports")
    assert (facts.task_tool_calls, facts.can_list, facts.can_cancel) == (False, False, False)


def test_ts_sdk_declares_tasks() -> None:
    assert negotiate(wire_result("ts_peer", "[TS] initialize"), server="reports").task_tool_calls


def test_tasks_without_tools_call_is_no_task_support() -> None:
    result = {"protocolVersion": "2025-11-25", "capabilities": {"tasks": {"list": {}, "requests": {}}}}
    assert not negotiate(result, server="reports").task_tool_calls


def test_another_protocol_version_is_refused_naming_the_server() -> None:
    with pytest.raises(Rejected, match=r"'reports' negotiated protocol version 2025-06-18"):
        negotiate({"protocolVersion": "2025-06-18", "capabilities": {}}, server="reports")


def test_tool_task_support_missing_execution_means_forbidden() -> None:
    tools, cursor = parse_tools_page(wire_result("sse", "[A] tools/list"))
    support = {tool["name"]: tool_task_support(tool) for tool in tools}
    assert support == {
        "slow_count": "optional",
        "stubborn": "optional",
        "ask_confirm": "required",
        "tool_error": "optional",
        "tool_raise": "optional",
        "echo": "forbidden",
    }
    assert cursor is None
    assert tool_task_support({"name": "x", "execution": {"taskSupport": "sometimes"}}) == "forbidden"


def test_descriptor_digest_is_independent_of_key_order() -> None:
    a = {"name": "t", "inputSchema": {"type": "object", "properties": {"a": 1, "b": 2}}}
    b = {"inputSchema": {"properties": {"b": 2, "a": 1}, "type": "object"}, "name": "t"}
    assert descriptor_digest(a) == descriptor_digest(b)
    assert descriptor_digest(a) != descriptor_digest({**a, "execution": {"taskSupport": "optional"}})


# ---- tasks ---------------------------------------------------------------------------------------


def test_create_result_gives_a_reference_with_the_session_and_the_first_status() -> None:
    created = parse_create_result(
        wire_result("sse", "[A] tools/call (task-augmented) slow_count"), session=SESSION
    )
    assert created.ref is not None
    assert created.ref.remote_id == "121b4225b1fd46149328e7c2a17d3e29:a08a501f-15ca-4bd2-8dd2-ca3dc7918f58"
    assert created.ref.session_ref == SESSION.session_id
    assert created.ref.protocol_version == "2025-11-25"
    assert created.status is not None
    assert (created.status.server_state, created.status.terminal) == ("working", None)
    assert (created.status.ttl_ms, created.status.poll_interval_ms) == (60000, 500)
    assert created.status.created_at == datetime(2026, 11, 30, 7, 45, 37, 374759, tzinfo=UTC)
    assert created.immediate_response == "Counting started in background."


def test_missing_ttl_is_read_as_null() -> None:
    created = parse_create_result(wire_result("sse", "[A] tools/call (task without ttl)"), session=SESSION)
    assert created.status is not None
    assert created.status.ttl_ms is None
    assert created.status.poll_interval_ms == 500


def test_null_ttl_and_odd_numbers_are_read_leniently() -> None:
    task = {
        "taskId": "t",
        "status": "working",
        "ttl": None,
        "pollInterval": 250.0,
        "createdAt": "not a date",
        "lastUpdatedAt": "2026-11-30T07:47:02.877Z",
    }
    status = parse_task(task)
    assert status.ttl_ms is None
    assert status.poll_interval_ms == 250
    assert status.created_at is None
    assert status.last_updated_at == datetime(2026, 11, 30, 7, 47, 2, 877000, tzinfo=UTC)
    assert parse_task({**task, "pollInterval": -1, "ttl": True}).poll_interval_ms is None


def test_ts_sdk_task_with_status_message_at_creation() -> None:
    created = parse_create_result(wire_result("ts_peer", "[TS] tools/call task"), session=SESSION)
    assert created.status is not None
    assert created.status.status_message == "step 1/3"


@pytest.mark.parametrize(
    ("title", "state", "terminal"),
    [
        ("[A] tasks/get (poll)", "working", None),
        ("[A] tasks/get ask_confirm", "input_required", None),
        ("[A] tasks/get (after cancel)", "cancelled", "cancelled"),
        ("[A] tasks/get tool_error", "completed", "completed"),
        ("[A] tasks/get tool_raise", "failed", "failed"),
    ],
)
def test_server_state_is_kept_verbatim_with_its_terminal_kind(
    title: str, state: str, terminal: str | None
) -> None:
    status = parse_task(wire_result("sse", title))
    assert (status.server_state, status.terminal) == (state, terminal)
    assert status.raw["status"] == state


def test_an_unknown_status_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="unknown status"):
        parse_task({"taskId": "t", "status": "paused"})


def test_an_answer_about_another_task_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="answered about"):
        parse_task(wire_result("sse", "[A] tasks/get (poll)"), expected_id="mine")


def test_list_page() -> None:
    page = parse_task_page(wire_result("ts_peer", "[TS] tasks/list"))
    assert [s.server_state for s in page.tasks] == ["completed", "cancelled"]
    assert page.next_cursor is None


# ---- results -------------------------------------------------------------------------------------

TASK_A = "121b4225b1fd46149328e7c2a17d3e29:a08a501f-15ca-4bd2-8dd2-ca3dc7918f58"


def test_related_task_meta_is_stripped_after_checking_the_task_id() -> None:
    payload, verified = strip_related_task(wire_result("sse", "[A] tasks/result (completed)"), task_id=TASK_A)
    assert verified
    assert payload == {
        "content": [{"type": "text", "text": "counted 4 steps"}],
        "structuredContent": {"steps": 4},
        "isError": False,
    }


def test_other_meta_keys_survive_the_strip() -> None:
    result = {"_meta": {RELATED_TASK: {"taskId": "t"}, "x/trace": "abc"}, "content": []}
    assert strip_related_task(result, task_id="t") == ({"content": [], "_meta": {"x/trace": "abc"}}, True)


def test_a_result_of_another_task_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="carries the result of task"):
        strip_related_task(wire_result("sse", "[A] tasks/result (completed)"), task_id="other")


def test_a_result_without_the_related_task_meta_is_kept_but_unverified() -> None:
    assert strip_related_task({"content": [], "isError": True}, task_id="t") == (
        {"content": [], "isError": True},
        False,
    )
    assert strip_related_task({"content": [], "_meta": {"x": 1}}, task_id="t") == (
        {"content": [], "_meta": {"x": 1}},
        False,
    )


@pytest.mark.parametrize("related", [{"taskId": 5}, "t", {}])
def test_a_malformed_related_task_meta_is_a_protocol_violation(related: object) -> None:
    with pytest.raises(ProtocolViolation, match="carries the result of task"):
        strip_related_task({"content": [], "_meta": {RELATED_TASK: related}}, task_id="t")


def test_completed_with_is_error_is_a_failed_outcome() -> None:
    result = wire_result("sse", "[A] tasks/result tool_error")
    task_id = result["_meta"][RELATED_TASK]["taskId"]
    outcome = result_from_payload(
        strip_related_task(result, task_id=task_id)[0], server_state="completed", status_message=None
    )
    assert (outcome.outcome, outcome.server_state, outcome.is_error) == ("failed", "completed", True)
    assert outcome.error == ErrorInfo(message="something went wrong")


def test_failed_with_an_empty_result_takes_the_status_message_as_error() -> None:
    result = wire_result("sse", "[A] tasks/result tool_raise (failed)")
    status = parse_task(wire_result("sse", "[A] tasks/get tool_raise"))
    payload, verified = strip_related_task(result, task_id=status.remote_id)
    assert verified
    assert payload == {}
    outcome = result_from_payload(payload, server_state="failed", status_message=status.status_message)
    assert outcome.outcome == "failed"
    assert outcome.error == ErrorInfo(message="boom inside task")


def test_cancelled_stays_cancelled_whatever_the_payload() -> None:
    outcome = result_from_payload(
        {"content": [{"type": "text", "text": "done anyway"}]}, server_state="cancelled", status_message=None
    )
    assert outcome.outcome == "cancelled"


def test_ts_sdk_internal_error_for_a_cancelled_result_is_a_cancelled_outcome_with_the_error() -> None:
    error = error_of("ts_peer", "[TS] tasks/result cancelled")
    outcome = result_from_error(error, server_state="cancelled")
    assert outcome.outcome == "cancelled"
    assert outcome.error is not None
    assert outcome.error.code == -32603


def test_an_underlying_json_rpc_error_is_a_failed_outcome() -> None:
    outcome = result_from_error(
        ErrorResponse(id=1, code=-32000, message="tool crashed"), server_state="failed"
    )
    assert (outcome.outcome, outcome.is_error) == ("failed", True)
    assert outcome.error == ErrorInfo(message="tool crashed", code=-32000)


@pytest.mark.parametrize("code", [-32603, -32000, -32601])
def test_a_json_rpc_error_for_a_completed_task_contradicts_its_status(code: int) -> None:
    """Issue 8 item 1: an error (a transient store error, say) is never the result of a completed task."""
    error = ErrorResponse(id=1, code=code, message="store unavailable")
    with pytest.raises(ResultContradictsStatus, match="completed") as raised:
        result_from_error(error, server_state="completed")
    assert (raised.value.observed, raised.value.code, raised.value.error_message) == (
        "completed",
        code,
        "store unavailable",
    )
    assert isinstance(raised.value, Transient)  # read again: it decided nothing


def test_a_plain_tool_result_to_a_task_request_is_a_synchronous_answer() -> None:
    created = parse_create_result(wire_result("v2_notasks", "[v2] tools/call with task"), session=SESSION)
    assert created.ref is None
    assert created.sync_result is not None
    assert created.sync_result.outcome == "completed"
    assert created.sync_result.server_state is None


def test_an_answer_neither_task_nor_result_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation):
        parse_create_result({"something": 1}, session=SESSION)


# ---- the error table (reference/mcp-tasks.md §1.11) ----------------------------------------------


@pytest.mark.parametrize(
    ("transcript", "title", "method"),
    [
        ("sse", "[A] tasks/get (unknown id)", "tasks/get"),
        ("sse", "[A] tasks/result (unknown id)", "tasks/result"),
        ("sse", "[A] tasks/cancel (unknown id)", "tasks/cancel"),
        ("sse", "[A] tasks/get (expired, ttl=800ms)", "tasks/get"),
        ("sse", "[B] session B: tasks/get on session A's task", "tasks/get"),
        ("ts_peer", "[TS] tasks/get unknown", "tasks/get"),
        ("ts_peer", "[TS] tasks/result unknown", "tasks/result"),
    ],
)
def test_unknown_expired_or_foreign_task_is_not_found(transcript: str, title: str, method: str) -> None:
    error = rpc_error(method, error_of(transcript, title), server="reports")
    assert type(error) is NotFound
    assert error.code == -32602


@pytest.mark.parametrize(
    ("transcript", "title"),
    [
        ("sse", "[A] tools/call echo WITH task (forbidden)"),
        ("sse", "[A] tools/call ask_confirm WITHOUT task (required)"),
    ],
)
def test_wrong_task_mode_from_the_sdk(transcript: str, title: str) -> None:
    error = rpc_error("tools/call", error_of(transcript, title), server="reports", tool="echo")
    assert isinstance(error, WrongTaskMode)
    assert error.code == -32601


def test_minus_32600_on_tools_call_is_also_wrong_task_mode() -> None:
    spec_example = ErrorResponse(
        id=1, code=-32600, message="Task augmentation required for tools/call requests"
    )
    assert isinstance(rpc_error("tools/call", spec_example, server="reports"), WrongTaskMode)


def test_invalid_cursor_on_tasks_list_is_a_rejection() -> None:
    error = rpc_error(
        "tasks/list", ErrorResponse(id=1, code=-32602, message="Invalid cursor"), server="reports"
    )
    assert type(error) is Rejected
    assert error.code == -32602


def test_method_not_found_on_tasks_methods_says_the_server_lacks_them() -> None:
    error = rpc_error("tasks/get", error_of("v2_notasks", "[v2] tasks/get"), server="reports")
    assert type(error) is Rejected
    assert "does not implement tasks/get" in str(error)


def test_internal_error_is_transient_on_reads_and_a_rejection_on_tools_call() -> None:
    internal = ErrorResponse(id=1, code=-32603, message="oops")
    assert type(rpc_error("tasks/get", internal, server="reports")) is Transient
    assert type(rpc_error("tools/call", internal, server="reports")) is Rejected


def test_other_tools_call_errors_are_rejections_with_code_and_message() -> None:
    error = rpc_error(
        "tools/call", ErrorResponse(id=1, code=-32602, message="Unknown tool"), server="s", tool="x"
    )
    assert type(error) is Rejected
    assert error.code == -32602
    assert "Unknown tool" in str(error)
    assert "'x'" in str(error)


# ---- input ---------------------------------------------------------------------------------------

ASK_TASK = "121b4225b1fd46149328e7c2a17d3e29:13c70fe3-d44a-4cfe-8102-914792e914bf"


def elicitation_request() -> Request:
    message = first_message("sse", "[A] tasks/result (input_required) SSE stream")
    return Request(id=message["id"], method=message["method"], params=message["params"])


def test_elicitation_from_the_result_stream_becomes_an_input_request() -> None:
    request = parse_input_request(elicitation_request(), task_id=ASK_TASK)
    assert request is not None
    assert request.request_id == f"task-{ASK_TASK}-140171580551360"
    assert request.method == "elicitation/create"
    assert request.schema == {
        "type": "object",
        "properties": {"confirm": {"type": "boolean", "description": "yes/no"}},
        "required": ["confirm"],
    }
    assert request.params["message"] == "Deploy?"
    assert request.params["_meta"] == {RELATED_TASK: {"taskId": ASK_TASK}}


def test_a_request_for_another_task_or_of_another_method_is_not_ours() -> None:
    assert parse_input_request(elicitation_request(), task_id="other") is None
    assert parse_input_request(Request(id=1, method="ping", params={}), task_id=ASK_TASK) is None


def test_sampling_requests_are_input_requests_without_schema() -> None:
    request = parse_input_request(
        Request(id=7, method="sampling/createMessage", params={"messages": []}), task_id=ASK_TASK
    )
    assert request is not None
    assert request.schema is None


def test_the_reply_echoes_the_id_exactly_and_carries_the_related_task_meta() -> None:
    request = parse_input_request(elicitation_request(), task_id=ASK_TASK)
    assert request is not None
    reply = input_reply(request, {"action": "accept", "content": {"confirm": True}})
    sent_in_transcript = next(e for t, e in wire("sse").items() if t[3:] == "[A] POST elicitation response")[
        "request"
    ]
    assert reply == sent_in_transcript
