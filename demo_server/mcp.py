"""longcall's own MCP server: core Tasks of protocol 2025-11-25, done the way the spec says.

Run: ``python -m demo_server.mcp --host 127.0.0.1 --port 8765 [--stateless] [--json-response]``

Streamable HTTP on ``/mcp`` (plain ASGI under uvicorn). What it does, and where the Python SDK (mcp 1.30)
differs:

* ``initialize`` negotiates 2025-11-25 (an older supported version is echoed) and declares
  ``capabilities.tasks = {list, cancel, requests.tools.call}`` (no ``list`` when stateless: requestors
  cannot be told apart) and ``tools.listChanged = false``.
* ``tools/list`` shows ``execution.taskSupport``. ``tools/call`` runs plainly, or as a task when
  ``params.task`` is given (``ttl`` in ms; absent or null = unlimited; ``--max-ttl-ms`` caps it). A task
  for a tool without task support, or a plain call of a ``required`` tool: -32601. Unknown tool: -32602.
* The Task object always carries ``ttl`` (null allowed) and ``pollInterval``. A tool result with
  ``isError`` ends the task ``failed`` (statusMessage = the error text); a tool that raises ends it
  ``failed`` and ``tasks/result`` answers the JSON-RPC error. ``tasks/result`` blocks until the task is
  terminal and adds ``_meta["io.modelcontextprotocol/related-task"]``; for a cancelled task it answers
  -32602 "Task <id> was cancelled: a cancelled task has no result" (the spec leaves this open).
* ``tasks/cancel``: the task is ``cancelled`` before the answer and its work is stopped; on a terminal
  task -32602 "Cannot cancel task: already in terminal status '<status>'". Unknown id: -32602 "Failed to
  retrieve task: Task not found"; a purged one: "... Task has expired". Only terminal tasks are purged
  (at createdAt + ttl). ``tasks/list`` (stateful only): the session's tasks, oldest first, pages of
  ``--page-size`` with an opaque ``nextCursor``; a bad cursor is -32602.
* Stateful (default): ``Mcp-Session-Id`` from ``initialize``; a task is visible only to its session
  (others get "Task not found"). Stateless (``--stateless``): no session, any caller with the id sees it.
* ``input_required``: ``ask_approval`` sends ``elicitation/create`` (string id ``<taskId>-input-<n>``,
  related-task ``_meta``) on the SSE stream of a pending ``tasks/result`` for that task; in
  ``--json-response`` mode on the session's GET stream. A request is on one open stream at a time; when
  that stream closes unanswered, the next ``tasks/result`` (or GET) stream carries it again.
  The client answers with a separate POST of a JSON-RPC response echoing the id (202). A stateful client
  that did not declare ``elicitation`` gets the task failed with -32600.
* Transport as the SDK: SSE answers by default (``event: message``, CRLF, no ids) or ``application/json``
  with ``--json-response``. POST needs ``Accept`` with both types (JSON mode: ``application/json``), else
  406; ``Content-Type: application/json`` else 415; missing session 400, unknown or DELETEd session 404;
  unsupported ``MCP-Protocol-Version`` 400 (a missing one is accepted). Notifications and responses get
  202. GET opens the session's stream for ``notifications/tasks/status`` (one per session: 409). DELETE
  ends the session. Transport errors carry ``"id": "server-error"``. Where the SDK is not faithful:
  ``tasks/get`` is always answered with ``application/json`` (tasks spec: servers SHOULD NOT upgrade a
  poll to SSE), and an ``Origin`` that is not a loopback host gets 403 (transports spec: MUST validate).

This module is the transport (HTTP checks, sessions, routing, the control endpoints); the JSON-RPC methods
are ``demo_server.mcp_methods``, the SSE streams and the delivery of input requests
``demo_server.mcp_streams``, what they share ``demo_server.mcp_session``.

Control endpoints (test harness only, same port):

* ``GET /_control/log`` -> ``{"entries": [{"t": time.time(), "method", "id", "task_id", "session",
  "budget"}]}``, one entry per JSON-RPC request or notification received, refused ones included
  (``budget``: the request's ``Longcall-Budget`` header, or null). ``DELETE`` clears it.
* ``GET /_control/http_log`` -> ``{"entries": [{"t", "verb", "budget", "query"}]}``: every HTTP request to
  ``/mcp`` (POST, GET, DELETE; JSON-RPC responses and refused requests included), ``query`` its URL's query
  string. ``DELETE`` clears it.
* ``GET /_control/replies`` -> ``{"replies": [{"t", "id", "session", "outcome"}]}``: every client JSON-RPC
  response (an input reply) received at ``t``; ``outcome`` is ``taken`` (a task waited for it),
  ``duplicate`` (none did: answered already, or unknown), ``refused`` or ``ignored`` (the fault switches
  below), or ``pending`` while ``delay_reply_ms`` holds it. A taken or duplicate reply has ``answered``:
  when its 202 was sent.
* ``GET /_control/tasks`` -> ``{"tasks": [every task with session, tool, arguments, result, error,
  pendingInputs], "expired": [purged ids]}``.
* ``POST /_control/finish`` ``{"task_ids": [...]}`` -> ``{"finished": {taskId: lastUpdatedAt}}``: each named
  task still ``working`` (any session's) ends at once with its tool's own result, as if its run had just
  finished (a benchmark completes tasks at instants it knows); others are left alone and not listed.
* ``GET /_control/faults`` shows the switches; ``POST`` a JSON object sets the named ones (others stay);
  ``DELETE`` resets all. Counted switches (an integer N) are used up by the next N matching events:

  - ``lose_create_response: N`` — a task-augmented ``tools/call`` creates the task, then the server
    closes the connection without any HTTP answer.
  - ``dribble_call_answer: N`` — a ``tools/call`` (a task's create or a synchronous call) is done, then
    its answer is sent a byte at a time, 0.1 s apart, its head included (the head alone some 30 s, each
    byte well within a read timeout), and the connection closed.
  - ``status_after_create: {"status": S, "count": N}`` — a task-augmented ``tools/call`` creates the task,
    then is answered HTTP S with a -32000 error body (a gateway failing after the origin did the work).
  - ``delay_ms: {"<method>": ms}`` — every request of that method waits before it is handled.
  - ``reorder: N`` — a ``tasks/get`` answer (computed on arrival) is held until the next ``tasks/get``
    answer has been sent (at most 10 s), so the older state arrives last; with
    ``reorder_release: "tasks/result"``, until the next ``tasks/result`` answer has been sent.
  - ``status_429`` / ``status_503: {"<method>": {"count": N, "retry_after_s": S}}`` — the next N requests of
    the method get that HTTP status with ``Retry-After: S`` and a -32000 error body; nothing is done.
  - ``truncate_result: N`` — a ``tasks/result`` answer is cut in half and the connection closed.
  - ``drop_result: N`` — a ``tasks/result`` connection is closed with no answer (the task stays).
  - ``expire_early: {"after_ms": M}`` (or null) — tasks are purged M ms after they become terminal.
  - ``complete_on_cancel: N`` — a ``tasks/cancel`` of a running task finds it completing at that
    instant: the task ends with the tool's result and the cancel answers -32602 already 'completed'.
  - ``sse_event_ids: true`` — ``tasks/result`` SSE streams carry event ids (a priming event first) and a
    GET with ``Last-Event-ID`` resumes one: what followed is replayed, then the stream goes on there
    (``demo_server.resumable``).
  - ``lose_input_request: N`` — the stream about to carry an input request is cut instead; the server
    counts the request as sent and never sends it on another stream (as the mcp 1.30 server): only a
    resumption of that stream (``sse_event_ids``) brings it back.
  - ``delay_reply_ms: M`` — a client's JSON-RPC response (an input reply) waits M ms before it is taken.
  - ``refuse_reply: N`` — a client's JSON-RPC response is not taken: its connection is closed with no
    answer; the task still waits for its input (the server asks once: it does not show the question again).
  - ``reject_reply: N`` — a client's JSON-RPC response is answered 400 with a JSON-RPC error (-32602) and
    not taken: the server refuses the reply; the task still waits for its input.
  - ``ignore_reply: N`` — a client's JSON-RPC response is answered 202 and thrown away: the task still
    waits.
  - ``require_bearer: "<token>"`` (or null) — every request to /mcp without ``Authorization: Bearer
    <token>`` is answered 401 (a rotated credential: set the new token here).
  - ``force_input_required: N`` — a ``slow_report`` task first asks ``elicitation/create`` ("Continue the
    <s>s report?", approved schema): ``input_required`` until answered; not approved -> isError, failed.
  - ``result_error: {"count": N, "code": C, "message": M}`` (or null) — the next N ``tasks/result``
    answers of a terminal task are the JSON-RPC error C (default -32603) instead of its result.
  - ``result_payload: {...}`` (or null) — while set, every tool run that finishes ends with this
    CallToolResult instead of its own (``isError`` true ends the task failed).
  - ``malformed_result: N`` — the next N ``tasks/result`` answers of a terminal task are the same body
    that is not JSON (``demo_server.mcp_streams.MALFORMED_RESULT``, as SSE event data or as the JSON
    body).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from demo_server import control, serve
from demo_server._asgi import (
    JSON_TYPE,
    SSE_TYPE,
    Receive,
    Scope,
    Send,
    dribble_answer,
    drop_connection,
    dumps,
    lifespan,
    read_body,
    request_headers,
    respond,
)
from demo_server.faults import Faults, HttpLog, RequestLog
from demo_server.mcp_methods import McpMethods
from demo_server.mcp_session import CLOSE, Incoming, ServerOptions, Session, transport_error
from demo_server.mcp_streams import Streams, send_answer
from demo_server.tasks import RpcError, Task, TaskStore

LATEST_VERSION = "2025-11-25"
SUPPORTED_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
SERVER_INFO = {"name": "longcall-demo", "version": "0.1.0"}
REORDER_HOLD_S = 10.0
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: The request budget longcall charged a request to (``poll`` / ``control``), as the request names it.
BUDGET_HEADER = "longcall-budget"


async def _method_not_allowed(send: Send) -> None:
    """GET and DELETE without sessions (stateless mode)."""
    await respond(send, 405, transport_error(-32000, "Method Not Allowed"), headers={"allow": "POST"})


def _accepts(accept: str, media_type: str) -> bool:
    return any(part.split(";")[0].strip() == media_type for part in accept.split(","))


class DemoMcpServer:
    """The ASGI application."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.faults = Faults()
        #: Every client JSON-RPC response (an input reply) received: its id and what became of it.
        self.replies: list[dict[str, Any]] = []
        self.log = RequestLog()
        self.http_log = HttpLog()
        self.store = TaskStore()
        self._sessions: dict[str, Session] = {}
        self._held_get: asyncio.Event | None = None
        self.streams = Streams(
            options, self.faults, self.store, self._sessions, after_result=self._after_result
        )
        self.methods = McpMethods(
            options, self.faults, self.store, elicit=self.streams.elicit, on_change=self._task_changed
        )
        self.control = control.Control(
            {
                **control.switch_endpoints(self._show_faults, self._set_faults, self._reset_faults),
                **control.log_endpoints("log", lambda: self.log.entries, self.log.clear),
                **control.log_endpoints("http_log", lambda: self.http_log.entries, self.http_log.clear),
                ("replies", "GET"): lambda _: (200, {"replies": self.replies}),
                ("tasks", "GET"): self._tasks_view,
                ("finish", "POST"): self._finish_tasks,
            }
        )

    # ---- ASGI entry -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, on_shutdown=self._shutdown)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path.rstrip("/") == "/mcp":
            self.http_log.record(
                verb=method,
                budget=request_headers(scope).get(BUDGET_HEADER),
                query=scope.get("query_string", b"").decode("latin-1"),
            )
            origin = request_headers(scope).get("origin")
            required = self.faults.switches.require_bearer
            if origin is not None and urlsplit(origin).hostname not in LOOPBACK_HOSTS:
                body = {"jsonrpc": "2.0", "error": {"code": -32600, "message": f"Forbidden: Origin {origin}"}}
                await respond(send, 403, dumps(body))
            elif required is not None and request_headers(scope).get("authorization") != f"Bearer {required}":
                body = {"jsonrpc": "2.0", "error": {"code": -32001, "message": "Unauthorized: bearer token"}}
                await respond(send, 401, dumps(body), headers={"www-authenticate": 'Bearer realm="demo"'})
            elif method == "POST":
                await self._post(scope, receive, send)
            elif method == "GET":
                await self._get_stream(scope, receive, send)
            elif method == "DELETE":
                await self._delete(scope, send)
            else:
                await respond(send, 405, headers={"allow": "GET, POST, DELETE"})
        elif path.startswith(control.PREFIX):
            await self.control.answer(path, method, receive, send)
        else:
            await respond(send, 404, b"Not Found", content_type="text/plain")

    def _shutdown(self) -> None:
        self.methods.stop_all()
        for session in self._sessions.values():
            session.push(CLOSE)

    # ---- HTTP: POST /mcp --------------------------------------------------------------------------

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = request_headers(scope)
        accept = headers.get("accept", "")
        if self.options.json_response:
            if not _accepts(accept, JSON_TYPE):
                message = "Not Acceptable: Client must accept application/json"
                await respond(send, 406, transport_error(-32600, message))
                return
        elif not (_accepts(accept, JSON_TYPE) and _accepts(accept, SSE_TYPE)):
            message = "Not Acceptable: Client must accept both application/json and text/event-stream"
            await respond(send, 406, transport_error(-32600, message))
            return
        if headers.get("content-type", "").split(";")[0].strip() != JSON_TYPE:
            message = "Unsupported Media Type: Content-Type must be application/json"
            await respond(send, 415, transport_error(-32600, message))
            return
        body = await read_body(receive)
        if body is None:
            return
        try:
            message = json.loads(body)
        except ValueError:
            await respond(send, 400, transport_error(-32700, "Parse error: Invalid JSON"))
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            await respond(send, 400, transport_error(-32600, "Invalid Request: not a JSON-RPC 2.0 message"))
            return
        raw_method = message.get("method")
        if raw_method is not None:
            params = message.get("params")
            task_id = params.get("taskId") if isinstance(params, dict) else None
            self.log.record(
                method=str(raw_method),
                message_id=message.get("id"),
                task_id=task_id,
                session=headers.get("mcp-session-id"),
                budget=headers.get(BUDGET_HEADER),
            )
        if raw_method == "initialize":
            await self._initialize(message, send)
            return
        ok, session = await self._check_session(headers, send)
        if not ok:
            return
        incoming = Incoming(message, session)
        if raw_method is None:
            await self._reply(incoming, headers, send)
        elif "id" not in message:
            await respond(send, 202, headers=self.options.session_headers(incoming.session))
        else:
            await self._request(incoming, receive, send)

    async def _reply(self, incoming: Incoming, headers: dict[str, str], send: Send) -> None:
        """A client's JSON-RPC response (an input reply): taken, or as the fault switches say."""
        reply = {"t": time.time(), "id": incoming.message.get("id"), "session": headers.get("mcp-session-id")}
        if self.faults.take("refuse_reply"):
            self.replies.append({**reply, "outcome": "refused"})
            await drop_connection(send)
            return
        if self.faults.take("reject_reply"):
            self.replies.append({**reply, "outcome": "rejected"})
            await respond(send, 400, transport_error(-32602, "Invalid params: the reply is refused"))
            return
        # Listed as it arrives ("pending" while it is held), so that a reply still held is seen.
        entry = {**reply, "outcome": "pending"}
        self.replies.append(entry)
        if self.faults.switches.delay_reply_ms:
            await asyncio.sleep(self.faults.switches.delay_reply_ms / 1000)
        if self.faults.take("ignore_reply"):
            entry["outcome"] = "ignored"
        else:
            taken = self.streams.take_reply(incoming)
            entry.update(outcome="taken" if taken else "duplicate", answered=time.time())
        await respond(send, 202, headers=self.options.session_headers(incoming.session))

    async def _check_session(self, headers: dict[str, str], send: Send) -> tuple[bool, Session | None]:
        """(ok, the session: None when stateless); not ok after answering the error."""
        version = headers.get("mcp-protocol-version")
        session: Session | None = None
        if not self.options.stateless:
            session_id = headers.get("mcp-session-id")
            if not session_id:
                await respond(send, 400, transport_error(-32600, "Bad Request: Missing session ID"))
                return False, None
            session = self._sessions.get(session_id)
            if session is None:
                await respond(send, 404, transport_error(-32600, "Session not found"))
                return False, None
        if version is not None and version not in SUPPORTED_VERSIONS:
            supported = ", ".join(SUPPORTED_VERSIONS)
            text = f"Bad Request: Unsupported protocol version: {version}. Supported versions: {supported}"
            refusal = transport_error(-32600, text)
            await respond(send, 400, refusal, headers=self.options.session_headers(session))
            return False, None
        return True, session

    async def _initialize(self, message: dict[str, Any], send: Send) -> None:
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        requested = params.get("protocolVersion")
        version = requested if requested in SUPPORTED_VERSIONS else LATEST_VERSION
        capabilities = params.get("capabilities")
        session = Session(
            session_id=uuid.uuid4().hex,
            client_capabilities=capabilities if isinstance(capabilities, dict) else {},
        )
        if not self.options.stateless:
            self._sessions[session.session_id] = session
        tasks: dict[str, Any] = {"cancel": {}, "requests": {"tools": {"call": {}}}}
        if not self.options.stateless:
            tasks = {"list": {}, **tasks}
        result = {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": False}, "tasks": tasks},
            "serverInfo": SERVER_INFO,
        }
        answer = {"jsonrpc": "2.0", "id": message.get("id"), "result": result}
        await self._answer(send, answer, self.options.session_headers(session))

    async def _answer(
        self, send: Send, message: dict[str, Any], headers: dict[str, str], *, plain_json: bool = False
    ) -> None:
        await send_answer(send, message, headers, as_json=self.options.json_response or plain_json)

    # ---- JSON-RPC requests (demo_server.mcp_methods; tasks/result: demo_server.mcp_streams) -----------

    async def _request(self, incoming: Incoming, receive: Receive, send: Send) -> None:
        method = incoming.method or ""
        headers = self.options.session_headers(incoming.session)
        refusal = self.faults.take_http_status(method)
        if refusal is not None:
            status, retry_after = refusal
            text = "Too Many Requests" if status == 429 else "Service Unavailable"
            body = {
                "jsonrpc": "2.0",
                "id": incoming.message["id"],
                "error": {"code": -32000, "message": text},
            }
            await respond(send, status, dumps(body), headers={**headers, "retry-after": str(retry_after)})
            return
        delay = self.faults.delay_s(method)
        if delay > 0:
            await asyncio.sleep(delay)
        if method == "tasks/result":
            await self.streams.tasks_result(incoming, receive, send, headers)
            return
        created: Task | None = None
        try:
            if method == "tools/call":
                result, created = await self.methods.tools_call(incoming)
            else:
                result = self.methods.simple_request(incoming)
            answer = {"jsonrpc": "2.0", "id": incoming.message["id"], "result": result}
        except RpcError as error:
            answer = {"jsonrpc": "2.0", "id": incoming.message["id"], "error": error.wire()}
        if created is not None and self.faults.take("lose_create_response"):
            await drop_connection(send)
        elif method == "tools/call" and self.faults.take("dribble_call_answer"):
            await dribble_answer(send, dumps(answer), headers)
        elif created is not None and (gateway := self.faults.take_status_after_create()) is not None:
            gateway_error = {"code": -32000, "message": f"Gateway error {gateway}"}
            body = {"jsonrpc": "2.0", "id": incoming.message["id"], "error": gateway_error}
            await respond(send, gateway, dumps(body), headers=headers)
        elif method == "tasks/get":
            await self._answer_tasks_get(send, answer, headers)
        else:
            await self._answer(send, answer, headers)

    async def _answer_tasks_get(self, send: Send, answer: dict[str, Any], headers: dict[str, str]) -> None:
        held = self._held_get
        if held is None and self.faults.take("reorder"):
            self._held_get = held = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.wait(), timeout=REORDER_HOLD_S)
            if self._held_get is held:
                self._held_get = None
            await self._answer(send, answer, headers, plain_json=True)
            return
        await self._answer(send, answer, headers, plain_json=True)
        if self.faults.switches.reorder_release == "tasks/get":
            self._release_held_get()

    def _after_result(self) -> None:
        if self.faults.switches.reorder_release == "tasks/result":
            self._release_held_get()

    def _release_held_get(self) -> None:
        held = self._held_get
        if held is not None:
            self._held_get = None
            held.set()

    def _task_changed(self, task: Task) -> None:
        if task.session_id is not None and task.session_id in self._sessions:
            notification = {"jsonrpc": "2.0", "method": "notifications/tasks/status", "params": task.wire()}
            self._sessions[task.session_id].push(notification)

    # ---- GET and DELETE /mcp ----------------------------------------------------------------------

    async def _get_stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.options.stateless:
            await _method_not_allowed(send)
            return
        headers = request_headers(scope)
        if not _accepts(headers.get("accept", ""), SSE_TYPE):
            message = "Not Acceptable: Client must accept text/event-stream"
            await respond(send, 406, transport_error(-32600, message))
            return
        ok, session = await self._check_session(headers, send)
        if not ok or session is None:
            return
        last_event_id = headers.get("last-event-id")
        if last_event_id is not None:
            answer_headers = self.options.session_headers(session)
            await self.streams.resume(last_event_id, session, receive, send, answer_headers)
            return
        if session.stream is not None:
            message = "Conflict: Only one SSE stream is allowed per session"
            await respond(send, 409, transport_error(-32000, message))
            return
        if await read_body(receive) is None:
            return
        await self.streams.session_stream(session, receive, send, self.options.session_headers(session))

    async def _delete(self, scope: Scope, send: Send) -> None:
        if self.options.stateless:
            await _method_not_allowed(send)
            return
        ok, session = await self._check_session(request_headers(scope), send)
        if not ok or session is None:
            return
        del self._sessions[session.session_id]
        session.push(CLOSE)
        await respond(send, 200)

    # ---- control endpoints (demo_server.control) --------------------------------------------------

    def _show_faults(self) -> dict[str, Any]:
        return self.faults.switches.model_dump()

    def _set_faults(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self.faults.update(changes).model_dump()

    def _reset_faults(self) -> dict[str, Any]:
        self.faults.reset()
        return self.faults.switches.model_dump()

    def _finish_tasks(self, body: bytes | None) -> control.Answer:
        try:
            request = json.loads(body or b"")
        except ValueError:
            request = None
        task_ids = request.get("task_ids") if isinstance(request, dict) else None
        if not isinstance(task_ids, list) or not all(isinstance(task_id, str) for task_id in task_ids):
            return 400, {"error": 'the body must be {"task_ids": [<task id>, ...]}'}
        return 200, {"finished": self.methods.finish_now(task_ids)}

    def _tasks_view(self, _: bytes | None) -> control.Answer:
        tasks = [task.view() for task in self.store.all()]
        return 200, {"tasks": tasks, "expired": self.store.expired_ids()}


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stateless", action="store_true", help="no sessions; tasks visible to any caller")
    parser.add_argument("--json-response", action="store_true", help="application/json answers, not SSE")
    parser.add_argument("--poll-interval-ms", type=int, default=500)
    parser.add_argument("--max-ttl-ms", type=int, default=None, help="cap on a requested ttl")
    parser.add_argument("--page-size", type=int, default=50, help="tasks/list page size")


def _app(args: argparse.Namespace) -> DemoMcpServer:
    options = ServerOptions(
        stateless=args.stateless,
        json_response=args.json_response,
        poll_interval_ms=args.poll_interval_ms,
        max_ttl_ms=args.max_ttl_ms,
        page_size=args.page_size,
    )
    return DemoMcpServer(options)


def main(argv: list[str] | None = None) -> None:
    serve.run(argv, module="demo_server.mcp", doc=__doc__, port=8765, add_options=_options, build_app=_app)


if __name__ == "__main__":
    main()
