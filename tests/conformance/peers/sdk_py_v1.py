"""Conformance peer: the Python MCP SDK 1.30 lowlevel server with its experimental 2025-11-25 tasks.

Run with the sdk-py-1.30 venv from scripts/install-peers:
    python sdk_py_v1.py --port N [--json-response] [--stateless]

The SDK as shipped tears sessions down on ordinary task traffic (shared/reference/mcp-tasks.md §2.4); the
workarounds below are what a test peer needs, each marked with its bug number:
  #1 a cancel-safe store: late transitions out of a terminal state and late results are no-ops;
  #2 only terminal tasks expire (a running task outliving its ttl would otherwise kill the session);
  #3 one server-lifetime task group for task work (the SDK's slot is overwritten per session and
     cleared when any session ends);
  #4 a task-mode gate in front of tools/call so a wrong mode is -32601, not an isError result;
  #6 status notifications are best effort (a closed session must not fail the task).
Left as the SDK does it (documented quirks): `ttl` omitted when null, isError -> `completed`, a raising
tool -> `failed` with an empty tasks/result, tasks/result of a cancelled task -> empty result.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import Any

import anyio
import uvicorn
from mcp.server.experimental.task_context import ServerTaskContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import McpError
from mcp.shared.experimental.tasks.helpers import is_terminal
from mcp.shared.experimental.tasks.in_memory_task_store import InMemoryTaskStore, StoredTask
from mcp.types import (
    METHOD_NOT_FOUND,
    CallToolRequest,
    CallToolResult,
    ErrorData,
    Result,
    Task,
    TaskStatus,
    TextContent,
    Tool,
    ToolExecution,
)

# The SDK marks its tasks API deprecated (tasks left the core spec in 2026-07-28); this peer exists to use it.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=__name__)

APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"approved": {"type": "boolean"}},
    "required": ["approved"],
}
TOOLS = [
    Tool(
        name="slow_report",
        description="Builds a report slowly: sleeps `seconds`, then answers (isError when `fail`).",
        inputSchema={
            "type": "object",
            "properties": {
                "seconds": {"type": "number", "minimum": 0},
                "fail": {"type": "boolean", "default": False},
            },
            "required": ["seconds"],
        },
        execution=ToolExecution(taskSupport="optional"),
    ),
    Tool(
        name="quick_lookup",
        description="Looks a key up at once (no task support).",
        inputSchema={"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    ),
    Tool(
        name="ask_approval",
        description="Asks the client to approve `question` (elicitation) and answers approved/declined.",
        inputSchema={
            "type": "object",
            "properties": {"question": {"type": "string"}},
            "required": ["question"],
        },
        execution=ToolExecution(taskSupport="required"),
    ),
]
TOOL_MODES = {tool.name: tool.execution.taskSupport if tool.execution else None for tool in TOOLS}


class CancelSafeStore(InMemoryTaskStore):
    """Workarounds #1 and #2 on the SDK's in-memory store."""

    def _is_expired(self, stored: StoredTask) -> bool:
        return is_terminal(stored.task.status) and super()._is_expired(stored)

    async def update_task(
        self, task_id: str, status: TaskStatus | None = None, status_message: str | None = None
    ) -> Task:
        stored = self._tasks.get(task_id)
        if stored is not None and is_terminal(stored.task.status):
            return Task(**stored.task.model_dump())
        return await super().update_task(task_id, status, status_message)

    async def store_result(self, task_id: str, result: Result) -> None:
        stored = self._tasks.get(task_id)
        if stored is None or is_terminal(stored.task.status):
            return
        await super().store_result(task_id, result)


async def _best_effort_notification(self: ServerTaskContext) -> None:
    """Workaround #6: a status notification to a gone session is dropped, not raised into the task."""
    with contextlib.suppress(Exception):
        await _sdk_send_notification(self)


_sdk_send_notification = ServerTaskContext._send_notification
ServerTaskContext._send_notification = _best_effort_notification  # type: ignore[method-assign]


def text_result(text: str, *, is_error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], isError=is_error)


def build_server() -> tuple[Server[Any, Any], CancelSafeStore]:
    server: Server[Any, Any] = Server("longcall-peer-sdk-py-1.30", version="1.30.0")
    store = CancelSafeStore()
    server.experimental.enable_tasks(store=store)

    @server.list_tools()
    async def list_tools() -> list[Tool]:
        return TOOLS

    async def sleep_unless_cancelled(seconds: float, task: ServerTaskContext | None) -> None:
        """The SDK does not stop a cancelled task's work; the tool has to look at the store itself."""
        deadline = anyio.current_time() + seconds
        while (left := deadline - anyio.current_time()) > 0:
            await anyio.sleep(min(left, 0.1))
            if task is not None:
                current = await store.get_task(task.task_id)
                if current is None or current.status == "cancelled":
                    return

    @server.call_tool()
    async def call_tool(name: str, arguments: dict[str, Any]) -> Any:
        context = server.request_context
        if name == "quick_lookup":
            return text_result(f"value:{arguments['key']}")
        if name == "slow_report":
            seconds = float(arguments["seconds"])
            fail = bool(arguments.get("fail", False))
            result = text_result(f"report ready after {seconds:g}s", is_error=fail)
            if not context.experimental.is_task:
                await sleep_unless_cancelled(seconds, None)
                return result

            async def report(task: ServerTaskContext) -> CallToolResult:
                await sleep_unless_cancelled(seconds, task)
                return result

            return await context.experimental.run_task(report)
        if name == "ask_approval":

            async def approval(task: ServerTaskContext) -> CallToolResult:
                answer = await task.elicit(arguments["question"], APPROVAL_SCHEMA)
                approved = answer.action == "accept" and (answer.content or {}).get("approved") is True
                return text_result("approved" if approved else "declined")

            return await context.experimental.run_task(approval)
        raise ValueError(f"Unknown tool: {name}")

    sdk_call_tool = server.request_handlers[CallToolRequest]

    async def task_mode_gate(request: CallToolRequest) -> Any:
        """Workaround #4: answer a wrong task mode with -32601 before the SDK turns it into isError."""
        mode = TOOL_MODES.get(request.params.name)
        is_task = request.params.task is not None
        if request.params.name in TOOL_MODES:
            if is_task and mode not in ("optional", "required"):
                message = "This tool does not support task-augmented invocation"
                raise McpError(ErrorData(code=METHOD_NOT_FOUND, message=message))
            if not is_task and mode == "required":
                raise McpError(
                    ErrorData(code=METHOD_NOT_FOUND, message="This tool requires task-augmented invocation")
                )
        return await sdk_call_tool(request)

    server.request_handlers[CallToolRequest] = task_mode_gate
    return server, store


class App:
    """Plain ASGI: /mcp to the SDK's session manager; the lifespan owns the task group (#3)."""

    def __init__(self, *, json_response: bool, stateless: bool) -> None:
        self.server, _ = build_server()
        self.manager = StreamableHTTPSessionManager(
            app=self.server, json_response=json_response, stateless=stateless
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        support = self.server.experimental.task_support
        assert support is not None

        @contextlib.asynccontextmanager
        async def no_per_session_group() -> AsyncIterator[None]:
            yield

        async with anyio.create_task_group() as group, self.manager.run():
            support._task_group = group
            support.run = no_per_session_group  # type: ignore[method-assign]
            yield
            group.cancel_scope.cancel()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            assert message["type"] == "lifespan.startup"
            async with self.running():
                await send({"type": "lifespan.startup.complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "http" and scope["path"].rstrip("/") == "/mcp":
            await self.manager.handle_request(scope, receive, send)
        elif scope["type"] == "http":
            body = b"Not Found"
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"9")]})
            await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--json-response", action="store_true")
    parser.add_argument("--stateless", action="store_true")
    args = parser.parse_args()
    app = App(json_response=args.json_response, stateless=args.stateless)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
