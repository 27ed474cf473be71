"""The MCP tasks extension adapter (2026-07-28) over ``httpx2.MockTransport``: the wire shapes the text
allows (flat and nested create results), the headers and ``_meta`` on every request, and the error
mapping (-32021, -32602, 429, 5xx, cut answers) that a real peer cannot be made to show on demand."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import httpx2
import pytest

from adapters import (
    AdapterConfig,
    CapabilityRefused,
    NotFound,
    OutcomeUnknown,
    RemoteRef,
    ResultNotReady,
    TokenRenewed,
    TooManyRequests,
    Transient,
)
from adapters.mcp_2026_07_28 import EXTENSION, McpExtTasksAdapter
from adapters.mcp_2026_07_28.wire import parse_task, round_id

URL = "http://ext.test/mcp"
TASK = "tsk-1"
Json = dict[str, Any]
Handler = Callable[[Json], httpx2.Response]


def task_fields(status: str = "working", **extra: Any) -> Json:
    return {
        "taskId": TASK,
        "status": status,
        "createdAt": "2026-11-30T07:57:38.020703+00:00",
        "lastUpdatedAt": "2026-11-30T07:57:38.020703+00:00",
        "ttlMs": 60000,
        "pollIntervalMs": 5000,
        **extra,
    }


def ok(body: Json, result: Json) -> httpx2.Response:
    return httpx2.Response(200, json={"jsonrpc": "2.0", "id": body["id"], "result": result})


def rpc_error(body: Json, code: int, message: str, status: int = 400) -> httpx2.Response:
    return httpx2.Response(
        status, json={"jsonrpc": "2.0", "id": body["id"], "error": {"code": code, "message": message}}
    )


class Fake:
    """Answers each JSON-RPC method with a handler and records every request."""

    def __init__(self, handlers: Mapping[str, Handler]) -> None:
        self.handlers = dict(handlers)
        self.requests: list[httpx2.Request] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        body = json.loads(request.content)
        return self.handlers[body["method"]](body)

    def bodies(self) -> list[Json]:
        return [json.loads(r.content) for r in self.requests]


def make(fake: Fake) -> McpExtTasksAdapter:
    config = AdapterConfig(
        name="ext", url=URL, protocol="mcp", protocol_version="2026-07-28", bearer_token="tok-1"
    )
    return McpExtTasksAdapter(config, httpx2.Client(transport=httpx2.MockTransport(fake)))


REF = RemoteRef(TASK, None, "2026-07-28")


def test_the_flat_create_result_of_the_schema_is_a_task() -> None:
    fake = Fake({"tools/call": lambda b: ok(b, {"resultType": "task", **task_fields()})})
    created = make(fake).create("slow", {"a": 1}, submission_key="k", ttl_ms=1000)
    assert created.ref == RemoteRef(TASK, None, "2026-07-28", "mcp")
    assert created.status is not None
    assert (created.status.server_state, created.status.poll_interval_ms, created.status.ttl_ms) == (
        "working",
        5000,
        60000,
    )


def test_the_nested_task_form_of_the_prose_is_tolerated() -> None:
    fake = Fake({"tools/call": lambda b: ok(b, {"resultType": "task", "task": task_fields()})})
    created = make(fake).create("slow", {}, submission_key="k", ttl_ms=1000)
    assert created.ref is not None
    assert created.ref.remote_id == TASK


def test_every_request_carries_the_version_header_routing_headers_and_the_opt_in() -> None:
    fake = Fake(
        {
            "tools/call": lambda b: ok(b, {"resultType": "task", **task_fields()}),
            "tasks/get": lambda b: ok(b, {"resultType": "complete", **task_fields()}),
            "tasks/cancel": lambda b: ok(b, {"resultType": "complete"}),
        }
    )
    adapter = make(fake)
    adapter.create("slow tool", {}, submission_key="k", ttl_ms=1000)
    adapter.get(REF)
    adapter.cancel(REF)
    names = []
    for request, body in zip(fake.requests, fake.bodies(), strict=True):
        assert request.headers["MCP-Protocol-Version"] == "2026-07-28"
        assert request.headers["Mcp-Method"] == body["method"]
        assert request.headers["Authorization"] == "Bearer tok-1"
        assert "Mcp-Session-Id" not in request.headers
        meta = body["params"]["_meta"]
        assert meta["io.modelcontextprotocol/protocolVersion"] == "2026-07-28"
        assert meta["io.modelcontextprotocol/clientCapabilities"]["extensions"] == {EXTENSION: {}}
        names.append(request.headers["Mcp-Name"])
    # a name that is not visible ASCII goes base64-encoded; task requests are routed by the task id
    assert names == ["=?base64?c2xvdyB0b29s?=", TASK, TASK]
    assert "task" not in fake.bodies()[0]["params"]  # no 2025-11-25 task parameter


def test_a_missing_capability_is_a_definite_refusal_never_a_retry() -> None:
    fake = Fake({"tools/call": lambda b: rpc_error(b, -32021, "requires the tasks extension")})
    with pytest.raises(CapabilityRefused) as refused:
        make(fake).create("must", {}, submission_key="k", ttl_ms=1000)
    assert refused.value.code == -32021
    assert len(fake.requests) == 1


def test_a_synchronous_answer_is_the_tools_result() -> None:
    fake = Fake({"tools/call": lambda b: ok(b, {"content": [{"type": "text", "text": "hi"}]})})
    created = make(fake).create("plain", {}, submission_key="k", ttl_ms=1000)
    assert created.ref is None
    assert created.sync_result is not None
    assert created.sync_result.outcome == "completed"


def test_input_asked_before_a_task_exists_is_refused() -> None:
    fake = Fake({"tools/call": lambda b: ok(b, {"resultType": "input_required", "inputRequests": {}})})
    with pytest.raises(CapabilityRefused, match="before creating a task"):
        make(fake).create("ask", {}, submission_key="k", ttl_ms=1000)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (lambda b: httpx2.Response(429, headers={"Retry-After": "3"}), TooManyRequests),
        (lambda b: httpx2.Response(503), OutcomeUnknown),
        (
            lambda b: httpx2.Response(
                200, json={"jsonrpc": "2.0", "id": b["id"], "result": {"resultType": "??"}}
            ),
            OutcomeUnknown,
        ),
    ],
)
def test_a_create_is_only_made_again_after_a_429(answer: Handler, error: type[Exception]) -> None:
    with pytest.raises(error) as raised:
        make(Fake({"tools/call": answer})).create("slow", {}, submission_key="k", ttl_ms=1000)
    if isinstance(raised.value, TooManyRequests):
        assert raised.value.retry_after == 3


def test_a_cut_create_answer_is_an_unknown_outcome() -> None:
    def cut(body: Json) -> httpx2.Response:
        raise httpx2.ReadError("connection reset")

    with pytest.raises(OutcomeUnknown):
        make(Fake({"tools/call": cut})).create("slow", {}, submission_key="k", ttl_ms=1000)


def test_an_unknown_or_expired_task_is_not_found() -> None:
    fake = Fake({"tasks/get": lambda b: rpc_error(b, -32602, "Task tsk-1 not found")})
    with pytest.raises(NotFound):
        make(fake).get(REF)


def test_an_internal_error_on_a_read_is_transient() -> None:
    fake = Fake({"tasks/get": lambda b: rpc_error(b, -32603, "store down", status=200)})
    with pytest.raises(Transient):
        make(fake).get(REF)


def test_the_result_is_read_inline_and_without_a_status_with_one_get() -> None:
    payload = {"content": [{"type": "text", "text": "done"}], "isError": False}
    fake = Fake(
        {"tasks/get": lambda b: ok(b, {"resultType": "complete", **task_fields("completed", result=payload)})}
    )
    adapter = make(fake)
    status = adapter.get(REF)
    assert status.result is not None
    assert status.result.outcome == "completed"
    assert adapter.result(REF, status=status) == status.result
    assert len(fake.requests) == 1
    assert adapter.result(REF).payload == payload
    assert len(fake.requests) == 2


def test_the_result_of_a_working_task_is_not_ready() -> None:
    fake = Fake({"tasks/get": lambda b: ok(b, {"resultType": "complete", **task_fields()})})
    with pytest.raises(ResultNotReady):
        make(fake).result(REF)


def test_a_failed_task_carries_its_json_rpc_error() -> None:
    status = parse_task(task_fields("failed", error={"code": -32603, "message": "boom", "data": {"x": 1}}))
    assert status.result is not None
    assert status.result.error is not None
    assert (status.result.outcome, status.result.error.code, status.result.error.data) == (
        "failed",
        -32603,
        {"x": 1},
    )


def test_resulttype_task_on_tasks_get_is_not_relied_on() -> None:
    """The spec's examples show resultType "task" on tasks/get, its schema "complete": either is read."""
    assert (
        parse_task({"resultType": "task", **task_fields("completed", result={"content": []})}).terminal
        == "completed"
    )


def test_an_input_round_is_the_map_of_outstanding_requests() -> None:
    requests = {
        "k2": {
            "method": "elicitation/create",
            "params": {"message": "m", "requestedSchema": {"type": "object"}},
        },
        "k1": {"method": "sampling/createMessage", "params": {"messages": []}},
    }
    status = parse_task(task_fields("input_required", inputRequests=requests))
    request = status.input_request
    assert request is not None
    assert not status.awaiting_input
    assert (request.method, dict(request.params), request.request_id) == (
        "tasks/update",
        requests,
        round_id(["k1", "k2"]),
    )
    assert request.request_id == '["k1","k2"]'
    assert parse_task(task_fields("input_required")).awaiting_input  # the map not shown yet


def test_a_reply_must_answer_exactly_the_round() -> None:
    requests = {
        "k1": {
            "method": "elicitation/create",
            "params": {
                "message": "m",
                "requestedSchema": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                },
            },
        }
    }
    fake = Fake({"tasks/update": lambda b: ok(b, {"resultType": "complete"})})
    adapter = make(fake)
    request = parse_task(task_fields("input_required", inputRequests=requests)).input_request
    assert request is not None
    good = {"k1": {"action": "accept", "content": {"name": "Ada"}}}
    assert adapter.check_reply(request, good) is None
    assert "not asked" in str(adapter.check_reply(request, {**good, "k9": {"action": "decline"}}))
    assert "not empty" in str(adapter.check_reply(request, {}))
    assert "schema" in str(adapter.check_reply(request, {"k1": {"action": "accept", "content": {"name": 1}}}))
    with pytest.raises(ValueError, match="refused"):
        adapter.reply_input(REF, request, {"k9": {"action": "decline"}})
    assert fake.requests == []  # nothing sent for a refused reply
    adapter.reply_input(REF, request, good)
    (body,) = fake.bodies()
    assert body["method"] == "tasks/update"
    assert (body["params"]["taskId"], body["params"]["inputResponses"]) == (TASK, good)


def test_a_task_of_the_other_generation_is_never_sent_on_this_wire() -> None:
    fake = Fake({})
    with pytest.raises(ValueError, match="2025-11-25"):
        make(fake).get(RemoteRef(TASK, "sess", "2025-11-25"))
    assert fake.requests == []


class Renewable:
    """A token provider that renews on a refusal (as ``adapters.oauth.CachedToken`` does): tok-1, tok-2."""

    def __init__(self) -> None:
        self.tokens = iter(["tok-1", "tok-2"])
        self.current = next(self.tokens)
        self.renewed: list[str | None] = []

    def __call__(self) -> str:
        return self.current

    def renew(self, refused: str | None, *, resource_metadata_url: str | None = None) -> bool:
        self.renewed.append(refused)
        self.current = next(self.tokens)
        return True


@pytest.mark.parametrize(
    "body",
    [
        {"error": "invalid_token", "error_description": "expired"},
        {"jsonrpc": "2.0", "id": "x", "error": {"code": -32001, "message": "Unauthorized"}},  # a gateway's
    ],
)
def test_a_401_invalid_token_renews_the_token_once_and_no_work_was_done(body: Json) -> None:
    """Issue 23 on the 2026-07-28 transport: a ``tasks/get`` answered 401 ``invalid_token`` is TokenRenewed
    (no work done: the step reads again), the refused token handed to the provider, the next read sent with
    the new token."""
    answers = iter(
        [
            httpx2.Response(
                401,
                json=body,
                headers={
                    "WWW-Authenticate": 'Bearer error="invalid_token", resource_metadata="https://h/.well-known/x"'
                },
            )
        ]
    )
    fake = Fake(
        {"tasks/get": lambda b: next(answers, None) or ok(b, {"resultType": "complete", **task_fields()})}
    )
    tokens = Renewable()
    config = AdapterConfig(
        name="ext", url=URL, protocol="mcp", protocol_version="2026-07-28", token_provider=tokens
    )
    adapter = McpExtTasksAdapter(config, httpx2.Client(transport=httpx2.MockTransport(fake)))
    with pytest.raises(TokenRenewed):
        adapter.get(REF)
    assert adapter.get(REF).server_state == "working"
    assert tokens.renewed == ["tok-1"]
    assert [r.headers["authorization"] for r in fake.requests] == ["Bearer tok-1", "Bearer tok-2"]
