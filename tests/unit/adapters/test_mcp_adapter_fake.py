"""The MCP adapter end to end over ``httpx2.MockTransport``, against a scripted server built from the
real transcripts."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx2
import pytest

from adapters import (
    AdapterConfig,
    CapabilityRefused,
    InputRequest,
    Limits,
    McpTasksAdapter,
    NotFound,
    NotSent,
    NoWorkDone,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    RemoteRef,
    ResultNotReady,
    Timeouts,
    TooManyRequests,
    Transient,
    WrongTaskMode,
)
from adapters.mcp_2025_11_25.wire import NO_INPUT_DURING_SYNC_CALL, RELATED_TASK
from tests.unit.adapters.mcp_fakes import (
    SESSION,
    FakeMcpServer,
    Json,
    error_message,
    make_adapter,
    result_message,
    sse_body,
    wire_result,
)

TASK = "121b4225b1fd46149328e7c2a17d3e29:a08a501f-15ca-4bd2-8dd2-ca3dc7918f58"
ASK_TASK = "121b4225b1fd46149328e7c2a17d3e29:13c70fe3-d44a-4cfe-8102-914792e914bf"
REF = RemoteRef(remote_id=TASK, session_ref=SESSION, protocol_version="2025-11-25")
ASK_REF = RemoteRef(remote_id=ASK_TASK, session_ref=SESSION, protocol_version="2025-11-25")


def task(status: str, task_id: str = TASK, **extra: Any) -> Json:
    return {
        "taskId": task_id,
        "status": status,
        "createdAt": "2026-11-30T07:45:37.374759Z",
        "lastUpdatedAt": "2026-11-30T07:45:38.979959Z",
        "ttl": 60000,
        "pollInterval": 500,
        **extra,
    }


def created_answer() -> Json:
    return wire_result("sse", "[A] tools/call (task-augmented) slow_count")


def elicitation(task_id: str = ASK_TASK) -> Json:
    return {
        "jsonrpc": "2.0",
        "id": f"task-{task_id}-1",
        "method": "elicitation/create",
        "params": {
            "mode": "form",
            "message": "Deploy?",
            "requestedSchema": {"type": "object", "properties": {"confirm": {"type": "boolean"}}},
            "_meta": {RELATED_TASK: {"taskId": task_id}},
        },
    }


# ---- session and negotiation ---------------------------------------------------------------------


def test_initialize_then_initialized_then_every_request_carries_the_session() -> None:
    server = FakeMcpServer()
    adapter = make_adapter(server)
    caps = adapter.capabilities("slow_count")
    assert caps.use_task
    assert adapter.session_ref == SESSION
    init, initialized, tools_list = server.bodies[:3]
    assert init["method"] == "initialize"
    assert init["params"]["protocolVersion"] == "2025-11-25"
    assert "elicitation" in init["params"]["capabilities"]
    assert "mcp-session-id" not in server.requests[0].headers
    assert initialized == {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert tools_list["method"] == "tools/list"
    for request in server.requests[1:]:
        assert request.headers["mcp-session-id"] == SESSION
        assert request.headers["mcp-protocol-version"] == "2025-11-25"
        assert request.headers["accept"] == "application/json, text/event-stream"


def test_tool_list_is_read_once_and_followed_across_pages() -> None:
    server = FakeMcpServer()
    first, second = server.tools[:3], server.tools[3:]
    server.on(
        "tools/list",
        lambda body, _r: result_message(body["id"], {"tools": first, "nextCursor": "p2"}),
        lambda body, _r: result_message(body["id"], {"tools": second}),
    )
    adapter = make_adapter(server)
    assert adapter.capabilities("echo").task_support == "forbidden"
    assert adapter.capabilities("slow_count").task_support == "optional"
    calls = server.calls("tools/list")
    assert [c["params"] for c in calls] == [{}, {"cursor": "p2"}]


def test_a_server_of_another_protocol_version_is_refused() -> None:
    server = FakeMcpServer(initialize_result={"protocolVersion": "2025-06-18", "capabilities": {}})
    with pytest.raises(Rejected, match="2025-06-18"):
        make_adapter(server).capabilities("slow_count")


def test_bearer_token_is_sent_and_never_shown() -> None:
    server = FakeMcpServer()
    adapter = make_adapter(server, token="tok-123")
    adapter.capabilities("slow_count")
    assert all(r.headers["authorization"] == "Bearer tok-123" for r in server.requests)
    assert "tok-123" not in repr(adapter._config)


# ---- create --------------------------------------------------------------------------------------


def test_create_sends_the_task_with_a_ttl_and_returns_the_reference() -> None:
    server = FakeMcpServer()
    server.on_result("tools/call", created_answer())
    created = make_adapter(server).create("slow_count", {"steps": 4}, submission_key="key-1", ttl_ms=60000)
    assert created.ref == REF
    assert created.status is not None
    assert created.status.server_state == "working"
    (call,) = server.calls("tools/call")
    assert call["params"] == {"name": "slow_count", "arguments": {"steps": 4}, "task": {"ttl": 60000}}
    assert "key-1" not in str(call)


def test_create_of_a_forbidden_tool_without_a_bound_is_refused_before_sending() -> None:
    server = FakeMcpServer()
    with pytest.raises(CapabilityRefused, match=r"tool 'echo' on server 'reports'"):
        make_adapter(server).create("echo", {"text": "hi"}, submission_key="k", ttl_ms=1000)
    assert server.calls("tools/call") == []


def test_create_of_a_forbidden_tool_with_a_bound_runs_synchronously() -> None:
    server = FakeMcpServer()
    server.on_result("tools/call", {"content": [{"type": "text", "text": "hi"}], "isError": False})
    created = make_adapter(server).create(
        "echo", {"text": "hi"}, submission_key="k", ttl_ms=1000, sync_upper_bound_s=3.0
    )
    assert created.ref is None
    assert created.sync_result is not None
    assert created.sync_result.outcome == "completed"
    assert "task" not in server.calls("tools/call")[0]["params"]


def test_a_synchronous_call_over_its_bound_is_outcome_unknown() -> None:
    server = FakeMcpServer()

    def slow(_body: Json, request: httpx2.Request) -> httpx2.Response:
        assert request.extensions["timeout"]["read"] == 1.5
        raise httpx2.ReadTimeout("bound reached", request=request)

    server.on("tools/call", slow)
    with pytest.raises(OutcomeUnknown):
        make_adapter(server).create("echo", {}, submission_key="k", ttl_ms=1000, sync_upper_bound_s=1.5)


def test_a_server_without_tasks_falls_back_to_sync_or_refuses() -> None:
    server = FakeMcpServer(initialize_result=wire_result("v2_notasks", "[v2] initialize"))
    adapter = make_adapter(server)
    with pytest.raises(CapabilityRefused, match="declares no task-augmented tools/call"):
        adapter.create("slow_count", {}, submission_key="k", ttl_ms=1000)
    with pytest.raises(CapabilityRefused, match="requires a task"):
        adapter.create("ask_confirm", {}, submission_key="k", ttl_ms=1000, sync_upper_bound_s=10)
    assert server.calls("tools/call") == []


def test_a_server_that_ignores_the_task_field_gives_a_synchronous_answer() -> None:
    server = FakeMcpServer()
    server.on_result("tools/call", wire_result("v2_notasks", "[v2] tools/call with task"))
    created = make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert created.ref is None
    assert created.sync_result is not None
    assert created.sync_result.outcome == "completed"


@pytest.mark.parametrize("code", [-32601, -32600])
def test_wrong_task_mode_on_create(code: int) -> None:
    server = FakeMcpServer()
    server.on_error("tools/call", code, "This tool does not support task-augmented invocation")
    with pytest.raises(WrongTaskMode) as caught:
        make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert caught.value.code == code


def test_create_after_the_session_ended_reinitializes_and_sends_once_more() -> None:
    server = FakeMcpServer()
    server.on(
        "tools/call",
        lambda _b, _r: httpx2.Response(404, json=error_message("server-error", -32600, "Session not found")),
        lambda body, _r: result_message(body["id"], created_answer()),
    )
    created = make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert created.ref is not None
    assert server.sessions_created == 2
    assert len(server.calls("tools/call")) == 2


@pytest.mark.parametrize("sync", [False, True], ids=["task", "synchronous"])
def test_a_create_whose_stream_cannot_be_resumed_on_its_session_is_unknown_and_never_repeated(
    sync: bool,
) -> None:
    """The tools/call's event stream closed after an event id, before its answer: the call reached the
    server. Its resumption (GET, Last-Event-ID) answered 404 for the session (the server restarted): that
    is the answer lost, not a call that never ran, so it is never sent again on a new session (it was: a
    second operation)."""
    server = FakeMcpServer()
    if sync:
        server.tools = [{"name": "slow_count", "inputSchema": {"type": "object"}}]
    server.on(
        "tools/call",
        lambda _b, _r: httpx2.Response(
            200, content=b"id: e1\r\ndata:\r\n\r\n", headers={"content-type": "text/event-stream"}
        ),
        lambda body, _r: result_message(body["id"], created_answer()),
    )
    server.on(
        "<get>", lambda _b, _r: httpx2.Response(404, json=error_message("x", -32600, "Session not found"))
    )
    adapter = make_adapter(server)
    with pytest.raises(OutcomeUnknown, match="could not be resumed"):
        adapter.create(
            "slow_count", {}, submission_key="k", ttl_ms=1000, sync_upper_bound_s=2.0 if sync else None
        )
    assert len(server.calls("tools/call")) == 1
    assert [b.get("http") for b in server.bodies if "http" in b] == ["GET"]


def test_a_lost_create_answer_is_outcome_unknown_and_never_repeated() -> None:
    server = FakeMcpServer()

    def lost(_body: Json, request: httpx2.Request) -> httpx2.Response:
        raise httpx2.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    server.on("tools/call", lost)
    with pytest.raises(OutcomeUnknown) as caught:
        make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert isinstance(caught.value.__cause__, httpx2.RemoteProtocolError)
    assert len(server.calls("tools/call")) == 1


def test_a_429_to_a_create_says_no_work_was_done_and_carries_retry_after() -> None:
    server = FakeMcpServer()
    server.on("tools/call", lambda _b, _r: httpx2.Response(429, headers={"Retry-After": "4"}))
    with pytest.raises(TooManyRequests) as caught:
        make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert isinstance(caught.value, NoWorkDone)
    assert caught.value.retry_after == 4.0


@pytest.mark.parametrize("status", [503, 408, 500, 502])
def test_a_gateway_error_to_a_create_is_an_unknown_outcome(status: int) -> None:
    """Rule 1: a gateway may answer 503 (or 408, or another 5xx) after the origin created the task."""
    server = FakeMcpServer()
    server.on("tools/call", lambda _b, _r: httpx2.Response(status, headers={"Retry-After": "4"}))
    with pytest.raises(OutcomeUnknown) as caught:
        make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert not isinstance(caught.value, NoWorkDone)
    assert caught.value.retry_after == 4.0
    assert len(server.calls("tools/call")) == 1


@pytest.mark.parametrize("status", [503, 500])
def test_a_create_whose_tool_list_failed_was_not_sent(status: int) -> None:
    """The tools/call never left when what it needs first failed: the one other "no work done"."""
    server = FakeMcpServer()
    server.on("tools/list", lambda _b, _r: httpx2.Response(status, headers={"Retry-After": "2"}))
    with pytest.raises(NotSent) as caught:
        make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert caught.value.retry_after == 2.0
    assert server.calls("tools/call") == []


VERSION = "2025-11-25"


def test_a_create_whose_connection_failed_was_not_sent() -> None:
    def refused(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused", request=request)

    adapter = McpTasksAdapter(
        AdapterConfig(
            name="demo", url="http://127.0.0.1:9/mcp", protocol="mcp", protocol_version="2025-11-25"
        ),
        httpx2.Client(transport=httpx2.MockTransport(refused)),
    )
    with pytest.raises(NotSent):
        adapter.create("slow_count", {}, submission_key="k", ttl_ms=1000)


@pytest.mark.parametrize("ttl", [0, -1, True])
def test_ttl_must_be_a_positive_integer(ttl: int) -> None:
    with pytest.raises(ValueError, match="ttl_ms"):
        make_adapter(FakeMcpServer()).create("slow_count", {}, submission_key="k", ttl_ms=ttl)


# ---- get -----------------------------------------------------------------------------------------


def test_get_from_a_stored_reference_needs_no_initialize() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("working", statusMessage="step 1/4"))
    status = make_adapter(server).get(REF)
    assert (status.server_state, status.status_message) == ("working", "step 1/4")
    assert server.sessions_created == 0
    (request,) = server.requests
    assert request.headers["mcp-session-id"] == SESSION
    assert request.headers["mcp-protocol-version"] == "2025-11-25"


def test_get_from_a_stateless_reference_sends_no_session() -> None:
    server = FakeMcpServer(session_id=None)
    server.on_result("tasks/get", task("completed"))
    ref = RemoteRef(remote_id=TASK, session_ref=None, protocol_version="2025-11-25")
    assert make_adapter(server).get(ref).terminal == "completed"
    assert "mcp-session-id" not in server.requests[0].headers


def test_get_on_an_ended_session_is_not_found_and_reinitializes() -> None:
    server = FakeMcpServer(session_id="fresh")
    server.on(
        "tasks/get", lambda _b, _r: httpx2.Response(404, json=error_message("server-error", -32600, "gone"))
    )
    adapter = make_adapter(server)
    with pytest.raises(NotFound) as caught:
        adapter.get(REF)
    assert caught.value.session_gone
    assert adapter.session_ref == "fresh"
    assert server.sessions_created == 1


def test_get_of_an_unknown_task_is_not_found() -> None:
    server = FakeMcpServer()
    server.on_error("tasks/get", -32602, f"Task not found: {TASK}")
    with pytest.raises(NotFound) as caught:
        make_adapter(server).get(REF)
    assert not caught.value.session_gone


def test_get_rate_limited_with_an_http_date() -> None:
    server = FakeMcpServer()
    later = datetime(2099, 1, 1, tzinfo=UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")
    server.on("tasks/get", lambda _b, _r: httpx2.Response(429, headers={"Retry-After": later}))
    with pytest.raises(RateLimited) as caught:
        make_adapter(server).get(REF)
    assert caught.value.retry_after is not None
    assert caught.value.retry_after > 0


def test_input_required_reads_the_request_from_the_result_stream() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("input_required", ASK_TASK))

    def stream(_body: Json, _request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, content=sse_body([elicitation()]), headers={"content-type": "text/event-stream"}
        )

    server.on("tasks/result", stream)
    status = make_adapter(server).get(ASK_REF)
    assert status.server_state == "input_required"
    assert status.input_request is not None
    assert status.input_request.request_id == f"task-{ASK_TASK}-1"
    assert status.input_request.schema == {"type": "object", "properties": {"confirm": {"type": "boolean"}}}


def test_input_required_in_json_mode_reads_the_get_stream_first() -> None:
    server = FakeMcpServer(mode="json")
    server.on_result("tasks/get", task("input_required", ASK_TASK))
    notification = {
        "jsonrpc": "2.0",
        "method": "notifications/tasks/status",
        "params": task("input_required"),
    }
    server.on(
        "<get>",
        lambda _b, _r: httpx2.Response(
            200,
            content=sse_body([notification, elicitation("someone-else"), elicitation()]),
            headers={"content-type": "text/event-stream"},
        ),
    )
    status = make_adapter(server).get(ASK_REF)
    assert status.input_request is not None
    assert status.input_request.task_id == ASK_TASK
    assert server.calls("tasks/result") == []
    get_request = next(r for r in server.requests if r.method == "GET")
    assert get_request.headers["accept"] == "text/event-stream"


def test_no_input_request_within_the_wait_gives_none() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("input_required", ASK_TASK))

    def blocked(_body: Json, request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ReadTimeout("waiting", request=request)

    server.on("tasks/result", blocked)
    adapter = make_adapter(server, timeouts=Timeouts(read=5.0, input_wait=0.2))
    status = adapter.get(ASK_REF)
    assert status.server_state == "input_required"
    assert status.input_request is None
    assert [r.method for r in server.requests].count("GET") == 1  # the GET stream was tried too (405)


def test_get_without_reading_input_sends_only_tasks_get() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("input_required", ASK_TASK))
    assert make_adapter(server).get(ASK_REF, read_input=False).input_request is None
    assert [b.get("method") for b in server.bodies] == ["tasks/get"]


# ---- result --------------------------------------------------------------------------------------


def test_result_before_terminal_is_not_fetched() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("working"))
    with pytest.raises(ResultNotReady) as caught:
        make_adapter(server).result(REF)
    assert caught.value.retry_after == 0.5
    assert server.calls("tasks/result") == []


def test_result_polls_once_when_no_status_is_given() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("completed"))
    server.on_result("tasks/result", wire_result("sse", "[A] tasks/result (completed)"))
    result = make_adapter(server).result(REF)
    assert result.outcome == "completed"
    assert RELATED_TASK not in str(result.payload)
    assert [b.get("method") for b in server.bodies] == ["tasks/get", "tasks/result"]


def test_result_of_another_task_is_a_protocol_violation() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("completed"))
    server.on_result("tasks/result", {"content": [], "_meta": {RELATED_TASK: {"taskId": "intruder"}}})
    with pytest.raises(ProtocolViolation):
        make_adapter(server).result(REF)


def test_result_of_an_expired_completed_task_is_not_found() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("completed"))
    server.on_error("tasks/result", -32602, "Failed to retrieve task: Task has expired")
    with pytest.raises(NotFound):
        make_adapter(server).result(REF)


def test_result_of_a_cancelled_task_refused_with_minus_32602_stays_cancelled() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("cancelled"))
    server.on_error("tasks/result", -32602, "a cancelled task has no result")
    result = make_adapter(server).result(REF)
    assert result.outcome == "cancelled"
    assert result.error is not None


def test_a_truncated_result_stream_is_transient() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("completed"))
    whole = sse_body([result_message("x", {"content": []})])
    server.on(
        "tasks/result",
        lambda _b, _r: httpx2.Response(
            200, content=whole[: len(whole) // 2], headers={"content-type": "text/event-stream"}
        ),
    )
    with pytest.raises(Transient):
        make_adapter(server).result(REF)


# ---- cancel --------------------------------------------------------------------------------------


def test_cancel_of_a_working_task_is_cancelled() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("working"))
    server.on_result("tasks/cancel", task("cancelled", statusMessage="step 4/40"))
    outcome = make_adapter(server).cancel(REF)
    assert outcome.kind == "cancelled"
    assert outcome.status is not None
    assert outcome.status.server_state == "cancelled"


def test_cancel_racing_completion_is_already_terminal() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("working"))
    server.on_error("tasks/cancel", -32602, "Cannot cancel task in terminal state 'completed'")
    outcome = make_adapter(server).cancel(REF)
    assert outcome.kind == "already_terminal"
    assert outcome.message == "Cannot cancel task in terminal state 'completed'"


def test_cancel_is_sent_first_with_no_status_read_before_it() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("working"))
    server.on_error("tasks/cancel", -32602, "Cannot cancel task: already in terminal status 'completed'")
    outcome = make_adapter(server).cancel(REF)
    assert (outcome.kind, outcome.status) == ("already_terminal", None)
    assert server.calls("tasks/get") == []


def test_cancel_reading_the_status_first_sends_no_cancel_for_a_terminal_task() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("completed"))
    outcome = make_adapter(server).cancel(REF, read_status_first=True)
    assert outcome.kind == "already_terminal"
    assert server.calls("tasks/cancel") == []


def test_a_lost_cancel_answer_is_outcome_unknown() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("working"))

    def lost(_body: Json, request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ReadTimeout("no answer", request=request)

    server.on("tasks/cancel", lost)
    with pytest.raises(OutcomeUnknown):
        make_adapter(server).cancel(REF)


# ---- reply_input ---------------------------------------------------------------------------------


def test_reply_is_a_separate_post_echoing_the_id_with_the_related_task_meta() -> None:
    server = FakeMcpServer()
    request = InputRequest(
        request_id=f"task-{ASK_TASK}-1", method="elicitation/create", params={}, schema=None, task_id=ASK_TASK
    )
    make_adapter(server).reply_input(ASK_REF, request, {"action": "accept", "content": {"confirm": True}})
    (body,) = server.bodies
    assert body == {
        "jsonrpc": "2.0",
        "id": f"task-{ASK_TASK}-1",
        "result": {
            "action": "accept",
            "content": {"confirm": True},
            "_meta": {RELATED_TASK: {"taskId": ASK_TASK}},
        },
    }
    assert server.requests[0].headers["mcp-session-id"] == SESSION


def test_a_numeric_request_id_stays_numeric() -> None:
    server = FakeMcpServer()
    request = InputRequest(
        request_id=7, method="elicitation/create", params={}, schema=None, task_id=ASK_TASK
    )
    make_adapter(server).reply_input(ASK_REF, request, {"action": "decline"})
    assert server.bodies[0]["id"] == 7


def test_a_reply_to_a_gone_session_is_not_found() -> None:
    server = FakeMcpServer()
    server.on("<post>", lambda _b, _r: httpx2.Response(404))
    request = InputRequest(
        request_id="r", method="elicitation/create", params={}, schema=None, task_id=ASK_TASK
    )
    with pytest.raises(NotFound) as caught:
        make_adapter(server).reply_input(ASK_REF, request, {"action": "cancel"})
    assert caught.value.session_gone


def test_a_reply_for_another_task_is_a_caller_error() -> None:
    request = InputRequest(
        request_id="r", method="elicitation/create", params={}, schema=None, task_id="other"
    )
    with pytest.raises(ValueError, match="answered for"):
        make_adapter(FakeMcpServer()).reply_input(ASK_REF, request, {"action": "accept"})


# ---- lookup and listing --------------------------------------------------------------------------


def test_lookup_by_key_is_never_proof_but_lists_candidates() -> None:
    server = FakeMcpServer()
    server.on_result(
        "tasks/list",
        {"tasks": [task("working", "old", createdAt="2026-11-30T06:00:00Z"), task("working", "new")]},
    )
    lookup = make_adapter(server).lookup_by_key(
        "key-1", tool="slow_count", submitted_after=datetime(2026, 11, 30, 7, 0, tzinfo=UTC)
    )
    assert lookup.proof == "unprovable"
    assert lookup.ref is None
    assert [c.remote_id for c in lookup.candidates] == ["new"]
    assert "key-1" in lookup.detail


def test_lookup_by_key_without_a_time_sends_nothing() -> None:
    server = FakeMcpServer()
    assert make_adapter(server).lookup_by_key("key-1").proof == "unprovable"
    assert server.requests == []


def test_a_reference_of_another_protocol_is_refused() -> None:
    ref = RemoteRef(remote_id="operations/1", session_ref=None, protocol_version="v1", protocol="aip151")
    with pytest.raises(ValueError, match="aip151"):
        make_adapter(FakeMcpServer()).get(ref)


def test_minus_32602_from_the_result_of_a_failed_task_still_there_is_the_calls_own_error() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("failed", statusMessage="Invalid params: bad key"))
    server.on_error("tasks/result", -32602, "Invalid params: bad key")
    result = make_adapter(server).result(REF)
    assert result.outcome == "failed"
    assert result.error is not None
    assert result.error.code == -32602
    assert [b.get("method") for b in server.bodies] == ["tasks/get", "tasks/result", "tasks/get"]


def test_minus_32602_from_the_result_of_a_failed_task_that_is_gone_is_not_found() -> None:
    server = FakeMcpServer()
    server.on(
        "tasks/get",
        lambda body, _r: result_message(body["id"], task("failed")),
        lambda body, _r: error_message(body["id"], -32602, "Task not found"),
    )
    server.on_error("tasks/result", -32602, "Task not found")
    with pytest.raises(NotFound):
        make_adapter(server).result(REF)


def test_a_failed_input_read_still_returns_the_status() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("input_required", ASK_TASK))
    server.on("tasks/result", lambda _b, _r: httpx2.Response(503, headers={"Retry-After": "1"}))
    status = make_adapter(server).get(ASK_REF)
    assert status.server_state == "input_required"
    assert status.input_request is None


def test_a_server_request_during_a_synchronous_call_is_refused_not_answered() -> None:
    server = FakeMcpServer()
    server.on(
        "tools/call",
        lambda body, _r: [
            elicitation("unrelated"),
            error_message(body["id"], -32000, "longcall cannot answer elicitation/create"),
        ],
    )
    with pytest.raises(Rejected) as caught:
        make_adapter(server).create("echo", {}, submission_key="k", ttl_ms=1000, sync_upper_bound_s=5)
    assert not isinstance(caught.value, WrongTaskMode)
    refusal = next(b for b in server.bodies if "error" in b)
    assert refusal["id"] == "task-unrelated-1"
    assert refusal["error"]["code"] == NO_INPUT_DURING_SYNC_CALL
    assert "synchronous call of 'echo'" in refusal["error"]["message"]


def test_a_result_without_the_related_task_meta_is_accepted_unverified() -> None:
    server = FakeMcpServer()
    server.on_result("tasks/get", task("completed"))
    server.on_result("tasks/result", {"content": [{"type": "text", "text": "boom"}], "isError": True})
    result = make_adapter(server).result(REF)
    assert (result.outcome, result.task_verified) == ("failed", False)


def test_an_unreadable_create_answer_is_outcome_unknown() -> None:
    server = FakeMcpServer()
    server.on("tools/call", lambda _b, _r: httpx2.Response(200, text="<html>oops</html>"))
    with pytest.raises(OutcomeUnknown) as caught:
        make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000)
    assert isinstance(caught.value.__cause__, ProtocolViolation)


def test_a_task_made_of_a_synchronous_call_is_outcome_unknown() -> None:
    server = FakeMcpServer()
    server.on_result("tools/call", created_answer())
    with pytest.raises(OutcomeUnknown, match="made a task"):
        make_adapter(server).create("echo", {}, submission_key="k", ttl_ms=1000, sync_upper_bound_s=2)


def test_an_unreadable_cancel_answer_is_outcome_unknown_but_an_unreadable_poll_is_a_violation() -> None:
    server = FakeMcpServer()
    server.on(
        "tasks/get",
        lambda body, _r: result_message(body["id"], task("working")),
        lambda body, _r: result_message(body["id"], {"taskId": TASK, "status": "exploded"}),
    )
    server.on_result("tasks/cancel", {"taskId": TASK, "status": "bogus"})
    adapter = make_adapter(server)
    with pytest.raises(OutcomeUnknown):
        adapter.cancel(REF, read_status_first=True)  # the read takes the first ("working") answer
    with pytest.raises(ProtocolViolation):
        adapter.get(REF)


def test_the_tool_list_is_read_again_once_it_is_older_than_its_max_age() -> None:
    server = FakeMcpServer()
    adapter = make_adapter(server, limits=Limits(tool_list_max_age_s=0.0))
    adapter.capabilities("slow_count")
    adapter.capabilities("slow_count")
    assert len(server.calls("tools/list")) == 2
    cached = FakeMcpServer()
    adapter = make_adapter(cached)
    adapter.capabilities("slow_count")
    adapter.capabilities("echo")
    assert len(cached.calls("tools/list")) == 1
