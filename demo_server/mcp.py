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

Control endpoints (test harness only, same port):

* ``GET /_control/log`` -> ``{"entries": [{"t": time.time(), "method", "id", "task_id", "session",
  "budget"}]}``, one entry per JSON-RPC request or notification received, refused ones included
  (``budget``: the request's ``Longcall-Budget`` header, or null). ``DELETE`` clears it.
* ``GET /_control/http_log`` -> ``{"entries": [{"t", "verb", "budget", "query"}]}``: every HTTP request to
  ``/mcp`` (POST, GET, DELETE; JSON-RPC responses and refused requests included), ``query`` its URL's query
  string. ``DELETE`` clears it.
* ``GET /_control/replies`` -> ``{"replies": [{"t", "id", "session", "outcome"}]}``: every client JSON-RPC
  response (an input reply) received; ``outcome`` is ``taken`` (a task waited for it), ``duplicate``
  (none did: answered already, or unknown), ``refused`` or ``ignored`` (the fault switches below).
* ``GET /_control/tasks`` -> ``{"tasks": [every task with session, tool, arguments, result, error,
  pendingInputs], "expired": [purged ids]}``.
* ``GET /_control/faults`` shows the switches; ``POST`` a JSON object sets the named ones (others stay);
  ``DELETE`` resets all. Counted switches (an integer N) are used up by the next N matching events:

  - ``lose_create_response: N`` — a task-augmented ``tools/call`` creates the task, then the server
    closes the connection without any HTTP answer.
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
    that is not JSON (:data:`MALFORMED_RESULT`, as SSE event data or as the JSON body).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import copy
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from pydantic import ValidationError

from demo_server._asgi import (
    JSON_TYPE,
    SSE_TYPE,
    Receive,
    Scope,
    Send,
    SseStream,
    drop_connection,
    dumps,
    read_body,
    request_headers,
    respond,
    sse_event,
    wait_disconnect,
)
from demo_server.faults import Faults, HttpLog, RequestLog
from demo_server.resumable import LOST_IN_TRANSIT, ResumableStream, StreamLogs
from demo_server.tasks import RELATED_TASK, PendingInput, RpcError, Task, TaskStore
from demo_server.tools import TOOLS, Tool, ToolError, text_result

LATEST_VERSION = "2025-11-25"
SUPPORTED_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
SERVER_INFO = {"name": "longcall-demo", "version": "0.1.0"}
REORDER_HOLD_S = 10.0
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: The request budget longcall charged a request to (``poll`` / ``control``), as the request names it.
BUDGET_HEADER = "longcall-budget"
#: What ``malformed_result`` answers a ``tasks/result`` with: the same unparsable body every time.
MALFORMED_RESULT = b'{"jsonrpc": "2.0", "result": {"content": [ this is not JSON'
_CLOSE = object()


@dataclass(frozen=True)
class ServerOptions:
    stateless: bool = False
    json_response: bool = False
    poll_interval_ms: int = 500
    max_ttl_ms: int | None = None
    page_size: int = 50


@dataclass(eq=False)
class Session:
    session_id: str
    client_capabilities: dict[str, Any] = field(default_factory=dict)
    stream: asyncio.Queue[object] | None = None

    def push(self, message: object) -> None:
        """Best effort: onto the GET stream when one is open, else dropped."""
        if self.stream is not None:
            self.stream.put_nowait(message)


@dataclass(frozen=True)
class Incoming:
    """One JSON-RPC message posted to /mcp, with the session it came in."""

    message: dict[str, Any]
    session: Session | None

    @property
    def method(self) -> str | None:
        method = self.message.get("method")
        return method if isinstance(method, str) else None

    @property
    def params(self) -> dict[str, Any]:
        params = self.message.get("params")
        return params if isinstance(params, dict) else {}

    @property
    def session_id(self) -> str | None:
        return None if self.session is None else self.session.session_id


def _transport_error(code: int, message: str) -> bytes:
    return dumps({"jsonrpc": "2.0", "id": "server-error", "error": {"code": code, "message": message}})


async def _method_not_allowed(send: Send) -> None:
    """GET and DELETE without sessions (stateless mode)."""
    await respond(send, 405, _transport_error(-32000, "Method Not Allowed"), headers={"allow": "POST"})


def _accepts(accept: str, media_type: str) -> bool:
    return any(part.split(";")[0].strip() == media_type for part in accept.split(","))


class _TaskContext:
    """What a tool running as a task may do: ask the client for input."""

    def __init__(self, server: DemoMcpServer, task: Task) -> None:
        self._server = server
        self._task = task
        self._asked = 0

    def take_forced_input(self) -> bool:
        return self._server.faults.take("force_input_required")

    async def elicit(self, message: str, requested_schema: dict[str, Any]) -> dict[str, Any]:
        return await self._server.elicit(self._task, message, requested_schema, self._next_id())

    def _next_id(self) -> str:
        self._asked += 1
        return f"{self._task.task_id}-input-{self._asked}"


class _PlainContext:
    """A plain (non-task) call cannot ask for input."""

    def take_forced_input(self) -> bool:
        return False

    async def elicit(self, message: str, requested_schema: dict[str, Any]) -> dict[str, Any]:
        raise RpcError(-32600, "input can only be requested from a task")


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
        self._pending: dict[str, PendingInput] = {}
        self._runners: set[asyncio.Task[None]] = set()
        self._held_get: asyncio.Event | None = None
        self._stream_logs = StreamLogs()

    # ---- ASGI entry -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
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
        elif path.startswith("/_control/"):
            await self._control(path.removeprefix("/_control/"), method, receive, send)
        else:
            await respond(send, 404, b"Not Found", content_type="text/plain")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for runner in list(self._runners):
                    runner.cancel()
                for session in self._sessions.values():
                    session.push(_CLOSE)
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- HTTP: POST /mcp --------------------------------------------------------------------------

    def _session_headers(self, session: Session | None) -> dict[str, str]:
        return {} if session is None or self.options.stateless else {"mcp-session-id": session.session_id}

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = request_headers(scope)
        accept = headers.get("accept", "")
        if self.options.json_response:
            if not _accepts(accept, JSON_TYPE):
                message = "Not Acceptable: Client must accept application/json"
                await respond(send, 406, _transport_error(-32600, message))
                return
        elif not (_accepts(accept, JSON_TYPE) and _accepts(accept, SSE_TYPE)):
            message = "Not Acceptable: Client must accept both application/json and text/event-stream"
            await respond(send, 406, _transport_error(-32600, message))
            return
        if headers.get("content-type", "").split(";")[0].strip() != JSON_TYPE:
            message = "Unsupported Media Type: Content-Type must be application/json"
            await respond(send, 415, _transport_error(-32600, message))
            return
        body = await read_body(receive)
        if body is None:
            return
        try:
            message = json.loads(body)
        except ValueError:
            await respond(send, 400, _transport_error(-32700, "Parse error: Invalid JSON"))
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            await respond(send, 400, _transport_error(-32600, "Invalid Request: not a JSON-RPC 2.0 message"))
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
            reply = {"t": time.time(), "id": message.get("id"), "session": headers.get("mcp-session-id")}
            if self.faults.take("refuse_reply"):
                self.replies.append({**reply, "outcome": "refused"})
                await drop_connection(send)
                return
            if self.faults.switches.delay_reply_ms:
                await asyncio.sleep(self.faults.switches.delay_reply_ms / 1000)
            if self.faults.take("ignore_reply"):
                self.replies.append({**reply, "outcome": "ignored"})
            else:
                taken = self._client_response(incoming)
                self.replies.append({**reply, "outcome": "taken" if taken else "duplicate"})
            await respond(send, 202, headers=self._session_headers(incoming.session))
        elif "id" not in message:
            await respond(send, 202, headers=self._session_headers(incoming.session))
        else:
            await self._request(incoming, receive, send)

    async def _check_session(self, headers: dict[str, str], send: Send) -> tuple[bool, Session | None]:
        """(ok, the session: None when stateless); not ok after answering the error."""
        version = headers.get("mcp-protocol-version")
        session: Session | None = None
        if not self.options.stateless:
            session_id = headers.get("mcp-session-id")
            if not session_id:
                await respond(send, 400, _transport_error(-32600, "Bad Request: Missing session ID"))
                return False, None
            session = self._sessions.get(session_id)
            if session is None:
                await respond(send, 404, _transport_error(-32600, "Session not found"))
                return False, None
        if version is not None and version not in SUPPORTED_VERSIONS:
            supported = ", ".join(SUPPORTED_VERSIONS)
            text = f"Bad Request: Unsupported protocol version: {version}. Supported versions: {supported}"
            await respond(send, 400, _transport_error(-32600, text), headers=self._session_headers(session))
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
        await self._answer(send, answer, self._session_headers(session))

    def _client_response(self, incoming: Incoming) -> bool:
        """A JSON-RPC response to one of our requests: hand it to the task that waits for it. False when no
        task waits for it (answered already, unknown id, another session): ignored, as the SDK does."""
        pending = self._pending.get(str(incoming.message.get("id")))
        if pending is None or pending.answer.done():
            return False
        if not self.options.stateless and pending.task.session_id != incoming.session_id:
            return False
        result = incoming.message.get("result")
        pending.answer.set_result(result if isinstance(result, dict) else {"action": "cancel"})
        return True

    async def _answer(
        self, send: Send, message: dict[str, Any], headers: dict[str, str], *, plain_json: bool = False
    ) -> None:
        if self.options.json_response or plain_json:
            await respond(send, 200, dumps(message), headers=headers)
        else:
            await respond(send, 200, sse_event(message), headers=headers, content_type=SSE_TYPE)

    # ---- JSON-RPC requests ------------------------------------------------------------------------

    async def _request(self, incoming: Incoming, receive: Receive, send: Send) -> None:
        method = incoming.method or ""
        headers = self._session_headers(incoming.session)
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
            await self._tasks_result(incoming, receive, send, headers)
            return
        created: Task | None = None
        try:
            if method == "tools/call":
                result, created = await self._tools_call(incoming)
            else:
                result = self._simple_request(incoming)
            answer = {"jsonrpc": "2.0", "id": incoming.message["id"], "result": result}
        except RpcError as error:
            answer = {"jsonrpc": "2.0", "id": incoming.message["id"], "error": error.wire()}
        if created is not None and self.faults.take("lose_create_response"):
            await drop_connection(send)
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

    def _release_held_get(self) -> None:
        held = self._held_get
        if held is not None:
            self._held_get = None
            held.set()

    def _simple_request(self, incoming: Incoming) -> dict[str, Any]:
        method = incoming.method
        params = incoming.params
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": [tool.descriptor() for tool in TOOLS.values()]}
        if method == "tasks/get":
            return self.store.get(params.get("taskId"), incoming.session_id).wire()
        if method == "tasks/cancel":
            return self._cancel(self.store.get(params.get("taskId"), incoming.session_id))
        if method == "tasks/list" and not self.options.stateless:
            return self._list(incoming.session_id, params.get("cursor"))
        raise RpcError(-32601, "Method not found", method)

    def _list(self, session_id: str | None, cursor: object) -> dict[str, Any]:
        start = 0
        if cursor is not None:
            try:
                start = int(base64.urlsafe_b64decode(str(cursor).encode()).decode().removeprefix("offset:"))
            except ValueError as error:
                raise RpcError(-32602, "Invalid params: invalid cursor") from error
        tasks = sorted(self.store.of_session(session_id), key=lambda task: task.created_mono)
        end = start + self.options.page_size
        page: dict[str, Any] = {"tasks": [task.wire() for task in tasks[start:end]]}
        if end < len(tasks):
            page["nextCursor"] = base64.urlsafe_b64encode(f"offset:{end}".encode()).decode()
        return page

    async def _tools_call(self, incoming: Incoming) -> tuple[dict[str, Any], Task | None]:
        params = incoming.params
        tool = TOOLS.get(str(params.get("name")))
        if tool is None:
            raise RpcError(-32602, f"Unknown tool: {params.get('name')}")
        arguments = params.get("arguments") or {}
        task_request = params.get("task")
        if not isinstance(arguments, dict) or not (task_request is None or isinstance(task_request, dict)):
            raise RpcError(-32602, "Invalid params: arguments and task must be objects")
        if task_request is not None and not tool.accepts_task:
            raise RpcError(-32601, f"Tool '{tool.name}' does not support task-augmented invocation")
        if task_request is None and tool.task_support == "required":
            raise RpcError(-32601, f"Tool '{tool.name}' requires task-augmented invocation")
        if task_request is None:
            try:
                result = await tool.run(_PlainContext(), arguments)
            except ToolError as error:
                return text_result(str(error), is_error=True), None
            chosen = self.faults.switches.result_payload
            return (copy.deepcopy(chosen) if chosen is not None else result), None
        task = self._create_task(tool, arguments, task_request.get("ttl"), incoming.session_id)
        return {"task": task.wire()}, task

    def _create_task(
        self, tool: Tool, arguments: dict[str, Any], ttl: object, session_id: str | None
    ) -> Task:
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0):
            raise RpcError(-32602, "Invalid params: task.ttl must be a non-negative integer or null")
        if ttl is not None and self.options.max_ttl_ms is not None:
            ttl = min(ttl, self.options.max_ttl_ms)
        task = Task(
            task_id=str(uuid.uuid4()),
            session_id=None if self.options.stateless else session_id,
            tool=tool.name,
            arguments=arguments,
            ttl_ms=ttl,
            poll_interval_ms=self.options.poll_interval_ms,
            on_change=self._task_changed,
        )
        self.store.add(task)
        runner = asyncio.create_task(self._run(task, tool), name=f"task {task.task_id}")
        task.runner = runner
        self._runners.add(runner)
        runner.add_done_callback(self._runners.discard)
        return task

    async def _run(self, task: Task, tool: Tool) -> None:
        try:
            result = await tool.run(_TaskContext(self, task), task.arguments)
        except ToolError as error:
            result = text_result(str(error), is_error=True)
        except RpcError as error:
            self._fail(task, error.wire())
            return
        except Exception as error:  # noqa: BLE001 - any crash of the tool is the task's failure
            self._fail(task, {"code": -32603, "message": f"{type(error).__name__}: {error}"})
            return
        self._finish(task, result)

    def _finish(self, task: Task, result: dict[str, Any]) -> None:
        if task.terminal:  # cancelled meanwhile: it stays cancelled
            return
        chosen = self.faults.switches.result_payload
        if chosen is not None:
            result = copy.deepcopy(chosen)
        task.result = result
        task.purge_after_s = self.faults.expire_after_s()
        if result.get("isError"):
            texts = [item.get("text") for item in result.get("content", []) if isinstance(item, dict)]
            task.set_status("failed", next((text for text in texts if isinstance(text, str)), "tool error"))
        else:
            task.set_status("completed", task.status_message)

    def _fail(self, task: Task, error: dict[str, Any]) -> None:
        if task.terminal:
            return
        task.error = error
        task.purge_after_s = self.faults.expire_after_s()
        task.set_status("failed", str(error["message"]))

    def _cancel(self, task: Task) -> dict[str, Any]:
        if not task.terminal and self.faults.take("complete_on_cancel"):
            self._stop(task)
            self._finish(task, TOOLS[task.tool].instant_result(task.arguments))
        if task.terminal:
            raise RpcError(-32602, f"Cannot cancel task: already in terminal status '{task.status}'")
        task.purge_after_s = self.faults.expire_after_s()
        task.set_status("cancelled", "The task was cancelled by request.")
        self._stop(task)
        return task.wire()

    def _stop(self, task: Task) -> None:
        if task.runner is not None:
            task.runner.cancel()
        for pending in task.inputs.values():
            pending.answer.cancel()

    def _task_changed(self, task: Task) -> None:
        if task.session_id is not None and task.session_id in self._sessions:
            notification = {"jsonrpc": "2.0", "method": "notifications/tasks/status", "params": task.wire()}
            self._sessions[task.session_id].push(notification)

    async def elicit(
        self, task: Task, message: str, requested_schema: dict[str, Any], request_id: str
    ) -> dict[str, Any]:
        session = self._sessions.get(task.session_id or "")
        if session is not None and "elicitation" not in session.client_capabilities:
            raise RpcError(-32600, "Client does not support elicitation capability")
        request = {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "elicitation/create",
            "params": {
                "mode": "form",
                "message": message,
                "requestedSchema": requested_schema,
                "_meta": {RELATED_TASK: {"taskId": task.task_id}},
            },
        }
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        pending = PendingInput(request_id, request, task, answer)
        task.inputs[request_id] = pending
        self._pending[request_id] = pending
        try:
            task.set_status("input_required", "waiting for input")
            if self.options.json_response and session is not None and session.stream is not None:
                pending.holder = session.stream
                session.push(request)
            return await answer
        finally:
            del task.inputs[request_id]
            del self._pending[request_id]
            if not task.terminal:
                task.set_status("working", None)

    # ---- tasks/result -----------------------------------------------------------------------------

    async def _tasks_result(
        self, incoming: Incoming, receive: Receive, send: Send, headers: dict[str, str]
    ) -> None:
        request_id = incoming.message["id"]
        try:
            task = self.store.get(incoming.params.get("taskId"), incoming.session_id)
        except RpcError as error:
            await self._answer(send, {"jsonrpc": "2.0", "id": request_id, "error": error.wire()}, headers)
            return
        stream = None
        if not self.options.json_response:
            stream = await self._result_stream(send, headers, task, request_id)
        if not await self._follow(task, stream, receive, send):
            return
        injected = self.faults.take_result_error()
        final = {"error": injected} if injected is not None else self._final_answer(task)
        answer = {"jsonrpc": "2.0", "id": request_id, **final}
        try:
            await self._send_result(send, answer, headers, stream)
        finally:
            if self.faults.switches.reorder_release == "tasks/result":
                self._release_held_get()

    async def _send_result(
        self, send: Send, answer: dict[str, Any], headers: dict[str, str], stream: SseStream | None
    ) -> None:
        if self.faults.take("drop_result"):
            await drop_connection(send)
        elif self.faults.take("malformed_result"):
            if stream is not None:
                await stream.write(b"event: message\r\ndata: " + MALFORMED_RESULT + b"\r\n\r\n")
                await stream.close()
            else:
                await respond(send, 200, MALFORMED_RESULT, headers=headers)
        elif self.faults.take("truncate_result"):
            data = sse_event(answer) if stream is not None else dumps(answer)
            if stream is not None:
                await stream.write(data[: len(data) // 2])
            else:
                await send_partial(send, data, headers)
            await drop_connection(send)
        elif stream is not None:
            await stream.event(answer)
            await stream.close()
        else:
            await respond(send, 200, dumps(answer), headers=headers)

    async def _result_stream(
        self, send: Send, headers: dict[str, str], task: Task, request_id: object
    ) -> SseStream:
        if not self.faults.switches.sse_event_ids:
            return SseStream(send, headers)
        stream = ResumableStream(send, headers, self._stream_logs.open(task.task_id, request_id))
        await stream.prime()
        return stream

    async def _follow(self, task: Task, stream: SseStream | None, receive: Receive, send: Send) -> bool:
        """Carry the task's input requests on ``stream`` until the task is terminal (True), or until the
        client goes away or the stream is cut under a request (False: nothing more to send)."""
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            while not task.terminal:
                if stream is not None:
                    for pending in list(task.inputs.values()):
                        if pending.holder is None and not await self._deliver(pending, stream, send):
                            return False
                change = asyncio.ensure_future(task.changed().wait())
                await asyncio.wait({change, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                change.cancel()
                if disconnected.done():
                    return False
        finally:
            disconnected.cancel()
            if stream is not None:
                _release(task.inputs.values(), stream)
        return True

    async def _deliver(self, pending: PendingInput, stream: SseStream, send: Send) -> bool:
        """Send an input request on ``stream``; with ``lose_input_request``, cut the stream under it instead
        (False). A lost request counts as sent: only resuming this stream brings it back."""
        if not self.faults.take("lose_input_request"):
            pending.holder = stream
            await stream.event(pending.request)
            return True
        pending.holder = LOST_IN_TRANSIT
        if isinstance(stream, ResumableStream):
            stream.keep_unsent(pending.request)
        await stream.start()
        await drop_connection(send)
        return False

    async def _resume(self, last_event_id: str, session: Session, receive: Receive, send: Send) -> None:
        """GET with ``Last-Event-ID``: replay what followed that event on its ``tasks/result`` stream, then
        go on as that stream (its input requests, then its final answer under the original request id)."""
        log = self._stream_logs.find(last_event_id)
        replay = log.after(last_event_id) if log is not None else None
        task = None
        if log is not None:
            with contextlib.suppress(RpcError):
                task = self.store.get(log.task_id, session.session_id)
        if log is None or replay is None or task is None:
            message = f"Bad Request: no stream to resume at event {last_event_id!r}"
            await respond(send, 400, _transport_error(-32000, message))
            return
        headers = self._session_headers(session)
        stream = ResumableStream(send, headers, log)
        await stream.start()
        for replayed, data in replay:
            await stream.write(data)
            pending = task.inputs.get(str(replayed.get("id")))
            if pending is not None and pending.holder is LOST_IN_TRANSIT:
                pending.holder = stream
        if not await self._follow(task, stream, receive, send):
            return
        answer = {"jsonrpc": "2.0", "id": log.request_id, **self._final_answer(task)}
        await self._send_result(send, answer, headers, stream)

    @staticmethod
    def _final_answer(task: Task) -> dict[str, Any]:
        related = {RELATED_TASK: {"taskId": task.task_id}}
        if task.status == "cancelled":
            message = f"Task {task.task_id} was cancelled: a cancelled task has no result"
            return {"error": {"code": -32602, "message": message}}
        if task.error is not None:
            return {"error": task.error}
        result = dict(task.result or {})
        result["_meta"] = {**result.get("_meta", {}), **related}
        return {"result": result}

    # ---- GET and DELETE /mcp ----------------------------------------------------------------------

    async def _get_stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.options.stateless:
            await _method_not_allowed(send)
            return
        headers = request_headers(scope)
        if not _accepts(headers.get("accept", ""), SSE_TYPE):
            message = "Not Acceptable: Client must accept text/event-stream"
            await respond(send, 406, _transport_error(-32600, message))
            return
        ok, session = await self._check_session(headers, send)
        if not ok or session is None:
            return
        last_event_id = headers.get("last-event-id")
        if last_event_id is not None:
            await self._resume(last_event_id, session, receive, send)
            return
        if session.stream is not None:
            message = "Conflict: Only one SSE stream is allowed per session"
            await respond(send, 409, _transport_error(-32000, message))
            return
        if await read_body(receive) is None:
            return
        queue: asyncio.Queue[object] = asyncio.Queue()
        session.stream = queue
        if self.options.json_response:
            for task in self.store.of_session(session.session_id):
                for pending in task.inputs.values():
                    if pending.holder is None:
                        pending.holder = queue
                        queue.put_nowait(pending.request)
        stream = SseStream(send, self._session_headers(session))
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await stream.start()
            while True:
                item = asyncio.ensure_future(queue.get())
                await asyncio.wait({item, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    item.cancel()
                    return
                outgoing = item.result()
                if outgoing is _CLOSE:
                    await stream.close()
                    return
                await stream.event(outgoing)
        finally:
            disconnected.cancel()
            if session.stream is queue:
                session.stream = None
            _release(self._pending.values(), queue)

    async def _delete(self, scope: Scope, send: Send) -> None:
        if self.options.stateless:
            await _method_not_allowed(send)
            return
        ok, session = await self._check_session(request_headers(scope), send)
        if not ok or session is None:
            return
        del self._sessions[session.session_id]
        session.push(_CLOSE)
        await respond(send, 200)

    # ---- control endpoints ------------------------------------------------------------------------

    async def _control(self, name: str, method: str, receive: Receive, send: Send) -> None:
        if name == "faults" and method == "GET":
            await respond(send, 200, dumps(self.faults.switches.model_dump()))
        elif name == "faults" and method == "POST":
            try:
                changes = json.loads(await read_body(receive) or b"")
            except ValueError as error:
                changes = error
            if not isinstance(changes, dict):
                await respond(send, 400, dumps({"error": "the body must be a JSON object of fault switches"}))
                return
            try:
                switches = self.faults.update(changes)
            except ValidationError as error:
                await respond(send, 400, dumps({"error": str(error)}))
                return
            await respond(send, 200, dumps(switches.model_dump()))
        elif name == "faults" and method == "DELETE":
            self.faults.reset()
            await respond(send, 200, dumps(self.faults.switches.model_dump()))
        elif name == "log" and method == "GET":
            await respond(send, 200, dumps({"entries": list(self.log.entries)}))
        elif name == "replies" and method == "GET":
            await respond(send, 200, dumps({"replies": self.replies}))
        elif name == "log" and method == "DELETE":
            self.log.clear()
            await respond(send, 200, dumps({"entries": []}))
        elif name == "http_log" and method == "GET":
            await respond(send, 200, dumps({"entries": list(self.http_log.entries)}))
        elif name == "http_log" and method == "DELETE":
            self.http_log.clear()
            await respond(send, 200, dumps({"entries": []}))
        elif name == "tasks" and method == "GET":
            tasks = [task.view() for task in self.store.all()]
            await respond(send, 200, dumps({"tasks": tasks, "expired": self.store.expired_ids()}))
        else:
            await respond(send, 404, dumps({"error": f"no control endpoint {method} /_control/{name}"}))


def _release(inputs: Iterable[PendingInput], stream: object) -> None:
    """A closed stream gives its undelivered-or-unanswered requests back for the next stream."""
    for pending in list(inputs):
        if pending.holder is stream:
            pending.holder = None
            pending.task.wake()


async def send_partial(send: Send, data: bytes, headers: dict[str, str]) -> None:
    """Announce the whole JSON body, then send only its first half (the caller drops the connection)."""
    start_headers = {**headers, "content-type": JSON_TYPE, "content-length": str(len(data))}
    raw = [(name.encode(), value.encode()) for name, value in start_headers.items()]
    await send({"type": "http.response.start", "status": 200, "headers": raw})
    await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m demo_server.mcp", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--stateless", action="store_true", help="no sessions; tasks visible to any caller")
    parser.add_argument("--json-response", action="store_true", help="application/json answers, not SSE")
    parser.add_argument("--poll-interval-ms", type=int, default=500)
    parser.add_argument("--max-ttl-ms", type=int, default=None, help="cap on a requested ttl")
    parser.add_argument("--page-size", type=int, default=50, help="tasks/list page size")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    options = ServerOptions(
        stateless=args.stateless,
        json_response=args.json_response,
        poll_interval_ms=args.poll_interval_ms,
        max_ttl_ms=args.max_ttl_ms,
        page_size=args.page_size,
    )
    config = uvicorn.Config(
        DemoMcpServer(options),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
