"""Every HTTP request an adapter sends is charged to the caller's budget first (DESIGN rule 4), and a
refusal leaves the adapter unchanged, with nothing sent and nothing half-made."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from datetime import UTC, datetime

import httpx2
import pytest

from adapters import (
    UNMETERED,
    AdapterError,
    InputRequest,
    Limits,
    McpTasksAdapter,
    OutcomeUnknown,
    RateLimited,
    Rejected,
    RemoteRef,
    RequestBudget,
    Timeouts,
)
from adapters.streamable_http import Session, StreamableHttpClient
from tests.unit.adapters.mcp_fakes import (
    SESSION,
    URL,
    FakeMcpServer,
    Json,
    error_message,
    make_adapter,
    result_message,
    sse_body,
    wire_result,
)

TASK = "task-1"
REF = RemoteRef(remote_id=TASK, session_ref=SESSION, protocol_version="2025-11-25")
RELATED = "io.modelcontextprotocol/related-task"


class Refusal(Exception):
    """What a budget of the caller's raises; nothing in adapters knows it."""


class CountingBudget:
    """Counts its charges and remembers how many requests the transport had seen at each; refuses the
    charges numbered in ``refuse`` (1-based) by raising ``refusal``."""

    def __init__(
        self, server: FakeMcpServer, *, refuse: frozenset[int] = frozenset(), refusal: Exception | None = None
    ) -> None:
        self._server = server
        self._refuse = refuse
        self.refusal = refusal if refusal is not None else Refusal("no token")
        self.seen_at_charge: list[int] = []

    def charge(self) -> None:
        self.seen_at_charge.append(len(self._server.requests))
        if len(self.seen_at_charge) in self._refuse:
            raise self.refusal


def task(status: str, task_id: str = TASK) -> Json:
    return {"taskId": task_id, "status": status, "createdAt": "2026-11-30T07:45:37Z", "ttl": 60000}


def elicitation(task_id: str = TASK) -> Json:
    return {
        "jsonrpc": "2.0",
        "id": "ask-1",
        "method": "elicitation/create",
        "params": {
            "message": "Deploy?",
            "requestedSchema": {"type": "object"},
            "_meta": {RELATED: {"taskId": task_id}},
        },
    }


def stream(*messages: Json) -> Callable[[Json, httpx2.Request], httpx2.Response]:
    return lambda _b, _r: httpx2.Response(
        200, content=sse_body(list(messages)), headers={"content-type": "text/event-stream"}
    )


def resumed_get(server: FakeMcpServer) -> None:
    """tasks/get answers with a stream that closes after an event id; the GET resuming it has the answer."""
    server.on(
        "tasks/get",
        lambda _b, _r: httpx2.Response(
            200, content=b"id: e1\ndata:\n\n", headers={"content-type": "text/event-stream"}
        ),
    )

    def resume(_b: Json, _r: httpx2.Request) -> httpx2.Response:
        answer = result_message(server.calls("tasks/get")[-1]["id"], task("working"))
        return httpx2.Response(200, content=sse_body([answer]), headers={"content-type": "text/event-stream"})

    server.on("<get>", resume)


Call = Callable[[McpTasksAdapter, RequestBudget], object]


def capabilities(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    return adapter.capabilities("slow_count", budget=budget)


def create_task(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    return adapter.create("slow_count", {"n": 1}, submission_key="k", ttl_ms=1000, budget=budget)


def create_sync(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    return adapter.create("echo", {}, submission_key="k", ttl_ms=1000, sync_upper_bound_s=5, budget=budget)


def lookup(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    after = datetime(2026, 1, 1, tzinfo=UTC)
    return adapter.lookup_by_key("k", tool="slow_count", submitted_after=after, budget=budget)


def get(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    return adapter.get(REF, budget=budget)


def result(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    return adapter.result(REF, budget=budget)


def cancel(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    return adapter.cancel(REF, budget=budget)


def cancel_after_a_read(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    return adapter.cancel(REF, budget=budget, read_status_first=True)


def reply(adapter: McpTasksAdapter, budget: RequestBudget) -> object:
    request = InputRequest(
        request_id="ask-1", method="elicitation/create", params={}, schema=None, task_id=TASK
    )
    adapter.reply_input(REF, request, {"action": "decline"}, budget=budget)
    return None


def script(name: str, server: FakeMcpServer) -> None:
    """Set the fake up for one scenario."""
    if name == "create a task after the session ended":
        server.on(
            "tools/call",
            lambda _b, _r: httpx2.Response(404, json=error_message("e", -32600, "Session not found")),
            lambda body, _r: result_message(
                body["id"], wire_result("sse", "[A] tools/call (task-augmented)")
            ),
        )
    elif name.startswith("create a task"):
        server.on_result("tools/call", wire_result("sse", "[A] tools/call (task-augmented)"))
    elif name == "create synchronously, refusing the server's question":
        server.on(
            "tools/call", lambda body, _r: [elicitation("other"), result_message(body["id"], {"content": []})]
        )
    elif name == "lookup over two tasks/list pages":
        server.on(
            "tasks/list",
            lambda body, _r: result_message(
                body["id"], {"tasks": [task("working", "a")], "nextCursor": "p2"}
            ),
            lambda body, _r: result_message(body["id"], {"tasks": [task("working", "b")]}),
        )
    elif name == "get, reading the question from the result stream":
        server.on_result("tasks/get", task("input_required"))
        server.on("tasks/result", stream(elicitation()))
    elif name == "get, the question in neither stream":
        server.on_result("tasks/get", task("input_required"))
        server.on(
            "tasks/result", stream({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}})
        )
    elif name == "get, the answer on a resumed stream":
        resumed_get(server)
    elif name == "get on an ended session":
        server.on("tasks/get", lambda _b, _r: httpx2.Response(404))
    elif name == "result after one poll":
        server.on_result("tasks/get", task("completed"))
        server.on_result("tasks/result", {"content": [], "_meta": {RELATED: {"taskId": TASK}}})
    elif name == "result of a failed task, -32602, still there":
        server.on_result("tasks/get", task("failed"))
        server.on_error("tasks/result", -32602, "Invalid params")
    elif name.startswith("cancel"):
        server.on_result("tasks/get", task("working"))
        server.on_result("tasks/cancel", task("cancelled"))
    else:
        server.on_result("tasks/get", task("working"))


SCENARIOS: list[tuple[str, Call, int]] = [
    ("capabilities on a new session", capabilities, 3),
    ("create a task", create_task, 4),
    ("create a task after the session ended", create_task, 7),
    ("create synchronously, refusing the server's question", create_sync, 5),
    ("lookup over two tasks/list pages", lookup, 4),
    ("get", get, 1),
    ("get, reading the question from the result stream", get, 2),
    ("get, the question in neither stream", get, 3),
    ("get, the answer on a resumed stream", get, 2),
    ("get on an ended session", get, 3),
    ("result after one poll", result, 2),
    ("result of a failed task, -32602, still there", result, 3),
    ("cancel", cancel, 1),
    ("cancel, reading the status first", cancel_after_a_read, 2),
    ("reply_input", reply, 1),
]


@pytest.mark.parametrize(("name", "call", "requests"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_each_request_is_charged_once_immediately_before_it_is_sent(
    name: str, call: Call, requests: int
) -> None:
    server = FakeMcpServer()
    script(name, server)
    adapter = make_adapter(server, timeouts=Timeouts(read=5.0, input_wait=0.2))
    budget = CountingBudget(server)
    # Some scenarios end in the server's error; what counts here is what was sent.
    with contextlib.suppress(AdapterError):
        call(adapter, budget)
    assert len(server.requests) == requests
    # Charge n came when n requests had been sent: each charge was followed by exactly one request.
    assert budget.seen_at_charge == list(range(requests))


@pytest.mark.parametrize("mode", ["sse", "json"])
def test_the_default_budget_charges_nothing_and_changes_nothing(mode: str) -> None:
    server = FakeMcpServer(mode=mode)
    server.on_result("tools/call", wire_result("sse", "[A] tools/call (task-augmented)"))
    created = make_adapter(server).create("slow_count", {}, submission_key="k", ttl_ms=1000, budget=UNMETERED)
    assert created.ref is not None
    assert [b.get("method") for b in server.bodies] == [
        "initialize",
        "notifications/initialized",
        "tools/list",
        "tools/call",
    ]


def test_a_refusal_before_the_tools_call_means_it_is_never_sent() -> None:
    server = FakeMcpServer()
    server.on_result("tools/call", wire_result("sse", "[A] tools/call (task-augmented)"))
    adapter = make_adapter(server)
    budget = CountingBudget(server, refuse=frozenset({4}))
    with pytest.raises(Refusal) as caught:
        create_task(adapter, budget)
    assert caught.value is budget.refusal
    assert server.calls("tools/call") == []
    assert len(server.requests) == 3


def test_a_refused_initialize_leaves_no_session() -> None:
    server = FakeMcpServer()
    adapter = make_adapter(server)
    with pytest.raises(Refusal):
        capabilities(adapter, CountingBudget(server, refuse=frozenset({1})))
    assert server.requests == []
    assert adapter.session_ref is None
    capabilities(adapter, UNMETERED)
    assert server.sessions_created == 1


def test_an_initialize_whose_initialized_notification_was_refused_is_not_kept() -> None:
    server = FakeMcpServer()
    adapter = make_adapter(server)
    with pytest.raises(Refusal):
        capabilities(adapter, CountingBudget(server, refuse=frozenset({2})))
    assert [b.get("method") for b in server.bodies] == ["initialize"]
    assert adapter.session_ref is None
    capabilities(adapter, UNMETERED)
    assert server.sessions_created == 2
    assert [b.get("method") for b in server.bodies][1:] == [
        "initialize",
        "notifications/initialized",
        "tools/list",
    ]


def test_a_refusal_that_looks_like_the_servers_429_is_not_read_as_one() -> None:
    # The input read swallows the server's Transient errors (the status is still returned): a budget's
    # RateLimited is the caller's, and must come back out, the same object.
    server = FakeMcpServer()
    script("get, reading the question from the result stream", server)
    budget = CountingBudget(
        server, refuse=frozenset({2}), refusal=RateLimited("no poll token", retry_after=0.5)
    )
    with pytest.raises(RateLimited) as caught:
        get(make_adapter(server), budget)
    assert caught.value is budget.refusal
    assert caught.value.__context__ is None
    assert server.calls("tasks/result") == []


def test_a_refused_listing_is_not_folded_into_the_lookups_detail() -> None:
    server = FakeMcpServer()
    script("lookup over two tasks/list pages", server)
    budget = CountingBudget(server, refuse=frozenset({4}), refusal=Rejected("budget closed"))
    with pytest.raises(Rejected) as caught:
        lookup(make_adapter(server), budget)
    assert caught.value is budget.refusal
    assert len(server.calls("tasks/list")) == 1


@pytest.mark.parametrize(("call", "refused"), [(cancel, 1), (cancel_after_a_read, 2)])
def test_a_refused_cancel_is_not_sent(call: Call, refused: int) -> None:
    server = FakeMcpServer()
    script("cancel", server)
    with pytest.raises(Refusal):
        call(make_adapter(server), CountingBudget(server, refuse=frozenset({refused})))
    assert server.calls("tasks/cancel") == []


def test_the_refusal_of_a_question_during_a_synchronous_call_is_skipped_not_raised() -> None:
    # The tools/call went out: leaving with the budget's refusal would hide that the tool may have run.
    server = FakeMcpServer()
    script("create synchronously, refusing the server's question", server)
    budget = CountingBudget(server, refuse=frozenset({5}))
    created = create_sync(make_adapter(server), budget)
    assert getattr(created, "sync_result", None) is not None
    assert not any("error" in body for body in server.bodies)
    assert len(budget.seen_at_charge) == 5


def test_a_refused_resumption_of_an_idempotent_read_passes_the_refusal_on() -> None:
    server = FakeMcpServer()
    resumed_get(server)
    budget = CountingBudget(server, refuse=frozenset({2}))
    with pytest.raises(Refusal):
        get(make_adapter(server), budget)
    assert [r.method for r in server.requests] == ["POST"]


def resumable_client(answers: list[httpx2.Response], seen: list[httpx2.Request]) -> StreamableHttpClient:
    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return answers.pop(0)

    return StreamableHttpClient(
        httpx2.Client(transport=httpx2.MockTransport(handler)),
        URL,
        bearer_token=None,
        timeouts=Timeouts(read=2.0),
        limits=Limits(),
        new_id=lambda: "req-1",
    )


def test_a_refused_resumption_of_a_tools_call_is_outcome_unknown() -> None:
    seen: list[httpx2.Request] = []
    closed = httpx2.Response(200, content=b"id: e1\ndata:\n\n", headers={"content-type": "text/event-stream"})
    client = resumable_client([closed], seen)

    class RefuseSecond:
        charges = 0

        def charge(self) -> None:
            self.charges += 1
            if self.charges == 2:
                raise Refusal("no control token")

    with pytest.raises(OutcomeUnknown, match="resumption was refused") as caught:
        client.request(
            "tools/call", {}, session=Session("abc", "2025-11-25"), idempotent=False, budget=RefuseSecond()
        )
    assert isinstance(caught.value.__cause__, Refusal)
    assert [r.method for r in seen] == ["POST"]


def test_a_resumed_stream_charges_its_get() -> None:
    seen: list[httpx2.Request] = []
    final = json.dumps(result_message("req-1", {"ok": True}))
    answers = [
        httpx2.Response(200, content=b"id: e1\ndata:\n\n", headers={"content-type": "text/event-stream"}),
        httpx2.Response(
            200, content=f"id: e2\ndata: {final}\n\n".encode(), headers={"content-type": "text/event-stream"}
        ),
    ]
    charged_at: list[int] = []

    class Counting:
        def charge(self) -> None:
            charged_at.append(len(seen))

    answer = resumable_client(answers, seen).request(
        "tools/call", {}, session=Session("abc", "2025-11-25"), idempotent=False, budget=Counting()
    )
    assert answer.response is not None
    assert [r.method for r in seen] == ["POST", "GET"]
    assert charged_at == [0, 1]


def test_listen_and_post_message_charge_before_sending() -> None:
    seen: list[httpx2.Request] = []
    client = resumable_client([httpx2.Response(405), httpx2.Response(202)], seen)
    session = Session("abc", "2025-11-25")
    refusing = CountingBudget(FakeMcpServer(), refuse=frozenset({1, 2}))
    with pytest.raises(Refusal):
        client.listen(session=session, wait_s=0.1, until=lambda _m: True, budget=refusing)
    with pytest.raises(Refusal):
        client.post_message({"jsonrpc": "2.0", "method": "n"}, session=session, what="n", budget=refusing)
    assert seen == []
    client.listen(session=session, wait_s=0.1, until=lambda _m: True)
    client.post_message({"jsonrpc": "2.0", "method": "n"}, session=session, what="n")
    assert [r.method for r in seen] == ["GET", "POST"]
