"""longcall's demo MCP server for protocol 2026-07-28 with the tasks extension.

The extension is ``io.modelcontextprotocol/tasks`` (SEP-2663).

Run: ``python -m demo_server.mcp_ext --port N``. No handshake and no session: every POST carries
``MCP-Protocol-Version: 2026-07-28`` (otherwise 400, -32022) and ``_meta`` with the client's capabilities;
``tools/call`` with the tasks opt-in makes a task (flat ``resultType: "task"``), ``tasks/get`` carries the
result or error inline, ``tasks/update`` takes ``inputResponses``, ``tasks/cancel`` is an ack only.

Tools: ``slow_report(seconds, fail=False)``; ``ask_approval(question)`` (one input round, key
``approval-<n>``); ``plain_echo(text)`` (never a task).

Fault switches (``POST /_control/faults`` with a JSON object; ``DELETE`` clears them and the log; ``GET
/_control/log`` and ``GET /_control/tasks`` show what happened):

- ``lose_create_response: N`` — the next N task-creating ``tools/call`` make the task, then the connection
  is closed with no answer.
- ``complete_on_cancel: N`` — the next N ``tasks/cancel`` are acknowledged, but the task completes (the
  completion wins the race).
- ``status_429: {"<method>": {"count": N, "retry_after_s": S}}`` — 429 with Retry-After.
- ``result_error: {"code": C, "message": M}`` — tasks end ``failed`` with this error inline.
- ``nested_create: true`` — the create answer nests the task (``{"resultType": "task", "task": {...}}``),
  the prose's form, instead of the schema's flat one.
- ``input_on: "slow_report"`` — that tool asks for input too (one round before it runs).
- ``result_payload: {...}`` — while set, every task that finishes (and is not failed by ``result_error``)
  completes with this result inline instead of its own report.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from demo_server import control, serve
from demo_server._asgi import (
    Receive,
    Scope,
    Send,
    drop_connection,
    dumps,
    lifespan,
    read_body,
    request_headers,
    respond,
)

VERSION = "2026-07-28"
EXTENSION = "io.modelcontextprotocol/tasks"
META_CAPS = "io.modelcontextprotocol/clientCapabilities"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
TERMINAL = frozenset({"completed", "failed", "cancelled"})

TOOLS = [
    {
        "name": "slow_report",
        "description": "Builds a report slowly: sleeps `seconds`, then answers (isError when `fail`).",
        "inputSchema": {
            "type": "object",
            "properties": {"seconds": {"type": "number"}, "fail": {"type": "boolean"}},
        },
    },
    {
        "name": "ask_approval",
        "description": "Asks the client to approve `question` (one input round), answers approved/declined.",
        "inputSchema": {"type": "object", "properties": {"question": {"type": "string"}}},
    },
    {
        "name": "plain_echo",
        "description": "Echoes `text` at once (never a task).",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
]
APPROVAL_SCHEMA = {
    "type": "object",
    "properties": {"approved": {"type": "boolean"}},
    "required": ["approved"],
}


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


@dataclass
class ExtTask:
    task_id: str
    tool: str
    arguments: dict[str, Any]
    status: str = "working"
    created_at: str = field(default_factory=_now)
    updated_at: str = field(default_factory=_now)
    message: str | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    input_requests: dict[str, Any] = field(default_factory=dict)
    answered: dict[str, Any] = field(default_factory=dict)
    answered_event: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None

    def detailed(self, poll_interval_ms: int, ttl_ms: int) -> dict[str, Any]:
        task: dict[str, Any] = {
            "taskId": self.task_id,
            "status": self.status,
            "createdAt": self.created_at,
            "lastUpdatedAt": self.updated_at,
            "ttlMs": ttl_ms,
            "pollIntervalMs": poll_interval_ms,
        }
        if self.message is not None:
            task["statusMessage"] = self.message
        if self.status == "input_required":
            task["inputRequests"] = dict(self.input_requests)
        if self.status == "completed" and self.result is not None:
            task["result"] = self.result
        if self.status == "failed" and self.error is not None:
            task["error"] = self.error
        return task


class RpcError(Exception):
    def __init__(
        self,
        code: int,
        message: str,
        status: int = 400,
        data: object = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.status, self.data = code, message, status, data
        self.headers = {"retry-after": f"{retry_after_s:g}"} if retry_after_s is not None else {}


class ExtServer:
    """The ASGI app: one POST per request at ``/mcp``, fault switches and logs at ``/_control``."""

    def __init__(self, *, poll_interval_ms: int, ttl_ms: int) -> None:
        self.poll_interval_ms = poll_interval_ms
        self.ttl_ms = ttl_ms
        self.tasks: dict[str, ExtTask] = {}
        self.faults: dict[str, Any] = {}
        self.log: list[dict[str, Any]] = []
        self.rounds = 0
        self.control = control.Control(
            {
                ("faults", "POST"): self._set_faults,
                ("faults", "DELETE"): self._clear_faults,
                ("faults", "GET"): lambda _: (200, self.faults),
                ("log", "GET"): lambda _: (200, {"entries": self.log}),
                ("tasks", "GET"): self._tasks_view,
            },
            explain_missing=False,
        )

    # -- faults --------------------------------------------------------------------------------------

    def _take(self, name: str) -> bool:
        count = self.faults.get(name)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            self.faults[name] = count - 1
            return True
        return False

    def _take_429(self, method: str) -> float | None:
        spec = (self.faults.get("status_429") or {}).get(method)
        if not isinstance(spec, dict) or spec.get("count", 0) <= 0:
            return None
        spec["count"] -= 1
        return float(spec.get("retry_after_s", 1))

    # -- ASGI ----------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path.startswith(control.PREFIX):
            await self.control.answer(path, method, receive, send)
        elif path == "/mcp" and method == "POST":
            await self._post(scope, receive, send)
        elif path == "/mcp":
            await respond(send, 405, headers={"allow": "POST"})
        else:
            await respond(send, 404)

    # -- control endpoints (demo_server.control) -------------------------------------------------------

    def _set_faults(self, body: bytes | None) -> control.Answer:
        self.faults.update(json.loads(body or b"{}"))
        return 200, self.faults

    def _clear_faults(self, _: bytes | None) -> control.Answer:
        self.faults.clear()
        self.log.clear()
        return 204, None

    def _tasks_view(self, _: bytes | None) -> control.Answer:
        tasks = [t.detailed(self.poll_interval_ms, self.ttl_ms) for t in self.tasks.values()]
        return 200, {"tasks": tasks}

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = request_headers(scope)
        body = await read_body(receive)
        if body is None:
            return
        try:
            message = json.loads(body)
        except ValueError:
            await respond(
                send,
                400,
                dumps({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}),
            )
            return
        rpc = message.get("method")
        params = message.get("params") or {}
        self.log.append(
            {
                "method": rpc,
                "params": params,
                "headers": {k: v for k, v in headers.items() if k.startswith("mcp-")},
            }
        )
        try:
            result = await self._dispatch(rpc, params, headers, send)
        except RpcError as exc:
            error: dict[str, Any] = {"code": exc.code, "message": exc.message}
            if exc.data is not None:
                error["data"] = exc.data
            await respond(
                send, exc.status, dumps({"jsonrpc": "2.0", "id": message.get("id"), "error": error})
            )
            return
        if result is None:
            return  # the connection was dropped
        await respond(send, 200, dumps({"jsonrpc": "2.0", "id": message.get("id"), "result": result}))

    async def _dispatch(
        self, rpc: object, params: dict[str, Any], headers: dict[str, str], send: Send
    ) -> dict[str, Any] | None:
        requested = headers.get("mcp-protocol-version")
        if requested != VERSION:
            raise RpcError(
                -32022, "Unsupported protocol version", data={"supported": [VERSION], "requested": requested}
            )
        if not isinstance(rpc, str) or headers.get("mcp-method") != rpc:
            raise RpcError(-32020, "Mcp-Method header does not match the request body")
        meta = params.get("_meta")
        if (
            not isinstance(meta, dict)
            or meta.get(META_VERSION) != VERSION
            or not isinstance(meta.get(META_CAPS), dict)
        ):
            raise RpcError(-32602, "params._meta must carry the protocol version and client capabilities")
        opted_in = EXTENSION in (meta[META_CAPS].get("extensions") or {})
        if (retry := self._take_429(rpc)) is not None:
            raise RpcError(-32000, "Too many requests", status=429, retry_after_s=retry)
        if rpc == "server/discover":
            return {
                "resultType": "complete",
                "supportedVersions": [VERSION],
                "capabilities": {"tools": {}, "extensions": {EXTENSION: {}}},
                "ttlMs": 0,
                "cacheScope": "private",
            }
        if rpc == "tools/list":
            return {"resultType": "complete", "tools": TOOLS}
        if rpc == "tools/call":
            return await self._tools_call(params, opted_in, send)
        if rpc in ("tasks/get", "tasks/update", "tasks/cancel"):
            if not opted_in:
                raise RpcError(
                    -32021,
                    f"{rpc} requires the tasks extension",
                    data={"requiredCapabilities": {"extensions": {EXTENSION: {}}}},
                )
            task = self.tasks.get(str(params.get("taskId")))
            if task is None:
                raise RpcError(-32602, f"Task {params.get('taskId')} not found")
            if headers.get("mcp-name") not in (None, task.task_id):
                raise RpcError(-32020, "mcp-name header does not match the request body's 'taskId' parameter")
            return self._task_request(rpc, task, params)
        raise RpcError(-32601, "Method not found", status=404, data=rpc)

    async def _tools_call(self, params: dict[str, Any], opted_in: bool, send: Send) -> dict[str, Any] | None:
        name, arguments = params.get("name"), params.get("arguments") or {}
        if name == "plain_echo" or not opted_in:
            if name == "ask_approval":
                raise RpcError(
                    -32021,
                    "Tool 'ask_approval' requires the tasks extension",
                    data={"requiredCapabilities": {"extensions": {EXTENSION: {}}}},
                )
            return {
                "resultType": "complete",
                "content": [{"type": "text", "text": str(arguments.get("text", ""))}],
            }
        if name not in ("slow_report", "ask_approval"):
            raise RpcError(-32602, f"Unknown tool {name!r}")
        task = ExtTask(task_id=secrets.token_urlsafe(24), tool=str(name), arguments=dict(arguments))
        self.tasks[task.task_id] = task
        task.runner = asyncio.create_task(self._run(task))
        if self._take("lose_create_response"):
            await drop_connection(send)
            return None
        fields = task.detailed(self.poll_interval_ms, self.ttl_ms)
        if self.faults.get("nested_create"):
            return {"resultType": "task", "task": fields}
        return {"resultType": "task", **fields}

    def _task_request(self, rpc: str, task: ExtTask, params: dict[str, Any]) -> dict[str, Any]:
        if rpc == "tasks/get":
            return {"resultType": "complete", **task.detailed(self.poll_interval_ms, self.ttl_ms)}
        if rpc == "tasks/update":
            responses = params.get("inputResponses")
            if not isinstance(responses, dict):
                raise RpcError(-32602, "Invalid request parameters: inputResponses")
            for key, answer in responses.items():
                if key in task.input_requests and key not in task.answered:  # others are ignored (spec)
                    task.answered[key] = answer
            if task.input_requests and set(task.input_requests) <= set(task.answered):
                task.input_requests = {}
                task.answered_event.set()
            return {"resultType": "complete"}
        if task.status not in TERMINAL:
            if self._take("complete_on_cancel"):
                self._end(task, "completed", result=self._report(task))
            else:
                if task.runner is not None:
                    task.runner.cancel()
                self._end(task, "cancelled")
        return {"resultType": "complete"}

    def _end(
        self,
        task: ExtTask,
        status: str,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        if task.status in TERMINAL:
            return
        task.status, task.result, task.error, task.updated_at = status, result, error, _now()

    def _report(self, task: ExtTask) -> dict[str, Any]:
        seconds = float(task.arguments.get("seconds", 0))
        failed = bool(task.arguments.get("fail"))
        return {"content": [{"type": "text", "text": f"report ready after {seconds:g}s"}], "isError": failed}

    async def _ask(self, task: ExtTask, message: str) -> dict[str, Any]:
        self.rounds += 1
        key = f"approval-{self.rounds}"
        task.input_requests = {
            key: {
                "method": "elicitation/create",
                "params": {"mode": "form", "message": message, "requestedSchema": APPROVAL_SCHEMA},
            }
        }
        task.answered_event.clear()
        task.status, task.updated_at = "input_required", _now()
        await task.answered_event.wait()
        task.status, task.updated_at = "working", _now()
        answer: dict[str, Any] = task.answered[key]
        return answer

    async def _run(self, task: ExtTask) -> None:
        try:
            if task.tool == "ask_approval" or self.faults.get("input_on") == task.tool:
                answer = await self._ask(task, str(task.arguments.get("question", "Approve?")))
                approved = (
                    answer.get("action") == "accept" and (answer.get("content") or {}).get("approved") is True
                )
                if task.tool == "ask_approval":
                    text = "approved" if approved else "declined"
                    self._finish(task, {"content": [{"type": "text", "text": text}], "isError": False})
                    return
            await asyncio.sleep(float(task.arguments.get("seconds", 0)))
            self._finish(task, self._report(task))
        except asyncio.CancelledError:
            return

    def _finish(self, task: ExtTask, result: dict[str, Any]) -> None:
        error = self.faults.get("result_error")
        chosen = self.faults.get("result_payload")
        if isinstance(error, dict):
            self._end(task, "failed", error=error)
        elif isinstance(chosen, dict):
            self._end(task, "completed", result=chosen)
        else:
            self._end(task, "completed", result=result)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--poll-interval-ms", type=int, default=200)
    parser.add_argument("--ttl-ms", type=int, default=600_000)


def _app(args: argparse.Namespace) -> ExtServer:
    return ExtServer(poll_interval_ms=args.poll_interval_ms, ttl_ms=args.ttl_ms)


def main(argv: list[str] | None = None) -> None:
    serve.run(
        argv, module="demo_server.mcp_ext", doc=__doc__, port=8766, add_options=_options, build_app=_app
    )


if __name__ == "__main__":
    main()
