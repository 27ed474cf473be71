"""The JSON-RPC methods of the 2025-11-25 demo server, and a task's run from creation to its end.

``ping``, ``tools/list``, ``tools/call`` (plain, or as a task), ``tasks/get``, ``tasks/cancel`` and
``tasks/list`` are answered here; ``tasks/result`` is answered on a stream (``demo_server.mcp_streams``),
and a task's input requests go out through the ``elicit`` it is given. What each method answers, and the
fault switches that act here (``result_payload``, ``expire_early``, ``complete_on_cancel``,
``force_input_required``), are documented in ``demo_server.mcp``.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from demo_server.faults import Faults
from demo_server.mcp_session import Incoming, ServerOptions
from demo_server.tasks import RpcError, Task, TaskStore
from demo_server.tools import TOOLS, Tool, ToolError, text_result

#: Ask the client of ``task`` for input: (task, message, requested schema, request id) -> its answer.
Elicit = Callable[[Task, str, dict[str, Any], str], Awaitable[dict[str, Any]]]


class _TaskContext:
    """What a tool running as a task may do: ask the client for input."""

    def __init__(self, faults: Faults, elicit: Elicit, task: Task) -> None:
        self._faults = faults
        self._elicit = elicit
        self._task = task
        self._asked = 0

    def take_forced_input(self) -> bool:
        return self._faults.take("force_input_required")

    async def elicit(self, message: str, requested_schema: dict[str, Any]) -> dict[str, Any]:
        return await self._elicit(self._task, message, requested_schema, self._next_id())

    def _next_id(self) -> str:
        self._asked += 1
        return f"{self._task.task_id}-input-{self._asked}"


class _PlainContext:
    """A plain (non-task) call cannot ask for input."""

    def take_forced_input(self) -> bool:
        return False

    async def elicit(self, message: str, requested_schema: dict[str, Any]) -> dict[str, Any]:
        raise RpcError(-32600, "input can only be requested from a task")


class McpMethods:
    """The methods over the server's task store; ``on_change`` is told of every change of a task's status
    (the transport sends ``notifications/tasks/status``)."""

    def __init__(
        self,
        options: ServerOptions,
        faults: Faults,
        store: TaskStore,
        *,
        elicit: Elicit,
        on_change: Callable[[Task], None],
    ) -> None:
        self._options = options
        self._faults = faults
        self._store = store
        self._elicit = elicit
        self._on_change = on_change
        self._runners: set[asyncio.Task[None]] = set()

    def stop_all(self) -> None:
        """Cancel every task still running (the server is stopping)."""
        for runner in list(self._runners):
            runner.cancel()

    def simple_request(self, incoming: Incoming) -> dict[str, Any]:
        method = incoming.method
        params = incoming.params
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": [tool.descriptor() for tool in TOOLS.values()]}
        if method == "tasks/get":
            return self._store.get(params.get("taskId"), incoming.session_id).wire()
        if method == "tasks/cancel":
            return self._cancel(self._store.get(params.get("taskId"), incoming.session_id))
        if method == "tasks/list" and not self._options.stateless:
            return self._list(incoming.session_id, params.get("cursor"))
        raise RpcError(-32601, "Method not found", method)

    def _list(self, session_id: str | None, cursor: object) -> dict[str, Any]:
        start = 0
        if cursor is not None:
            try:
                start = int(base64.urlsafe_b64decode(str(cursor).encode()).decode().removeprefix("offset:"))
            except ValueError as error:
                raise RpcError(-32602, "Invalid params: invalid cursor") from error
        tasks = sorted(self._store.of_session(session_id), key=lambda task: task.created_mono)
        end = start + self._options.page_size
        page: dict[str, Any] = {"tasks": [task.wire() for task in tasks[start:end]]}
        if end < len(tasks):
            page["nextCursor"] = base64.urlsafe_b64encode(f"offset:{end}".encode()).decode()
        return page

    async def tools_call(self, incoming: Incoming) -> tuple[dict[str, Any], Task | None]:
        """The answer, and the task when the call created one."""
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
            chosen = self._faults.switches.result_payload
            return (copy.deepcopy(chosen) if chosen is not None else result), None
        task = self._create_task(tool, arguments, task_request.get("ttl"), incoming.session_id)
        return {"task": task.wire()}, task

    def _create_task(
        self, tool: Tool, arguments: dict[str, Any], ttl: object, session_id: str | None
    ) -> Task:
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0):
            raise RpcError(-32602, "Invalid params: task.ttl must be a non-negative integer or null")
        if ttl is not None and self._options.max_ttl_ms is not None:
            ttl = min(ttl, self._options.max_ttl_ms)
        task = Task(
            task_id=str(uuid.uuid4()),
            session_id=None if self._options.stateless else session_id,
            tool=tool.name,
            arguments=arguments,
            ttl_ms=ttl,
            poll_interval_ms=self._options.poll_interval_ms,
            on_change=self._on_change,
        )
        self._store.add(task)
        runner = asyncio.create_task(self._run(task, tool), name=f"task {task.task_id}")
        task.runner = runner
        self._runners.add(runner)
        runner.add_done_callback(self._runners.discard)
        return task

    async def _run(self, task: Task, tool: Tool) -> None:
        try:
            result = await tool.run(_TaskContext(self._faults, self._elicit, task), task.arguments)
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
        chosen = self._faults.switches.result_payload
        if chosen is not None:
            result = copy.deepcopy(chosen)
        task.result = result
        task.purge_after_s = self._faults.expire_after_s()
        if result.get("isError"):
            texts = [item.get("text") for item in result.get("content", []) if isinstance(item, dict)]
            task.set_status("failed", next((text for text in texts if isinstance(text, str)), "tool error"))
        else:
            task.set_status("completed", task.status_message)

    def _fail(self, task: Task, error: dict[str, Any]) -> None:
        if task.terminal:
            return
        task.error = error
        task.purge_after_s = self._faults.expire_after_s()
        task.set_status("failed", str(error["message"]))

    def _cancel(self, task: Task) -> dict[str, Any]:
        if not task.terminal and self._faults.take("complete_on_cancel"):
            self._stop(task)
            self._finish(task, TOOLS[task.tool].instant_result(task.arguments))
        if task.terminal:
            raise RpcError(-32602, f"Cannot cancel task: already in terminal status '{task.status}'")
        task.purge_after_s = self._faults.expire_after_s()
        task.set_status("cancelled", "The task was cancelled by request.")
        self._stop(task)
        return task.wire()

    def finish_now(self, task_ids: list[str]) -> dict[str, str]:
        """Each named task still working ends this instant with its tool's own result, as if its run had
        just finished (the run is stopped): ``{taskId: lastUpdatedAt}`` of those it ended. A task that is
        not working (terminal, waiting for input) or not known is left alone and not in the answer."""
        finished: dict[str, str] = {}
        for task_id in task_ids:
            task = self._store.find(task_id)
            if task is None or task.status != "working":
                continue
            self._stop(task)
            self._finish(task, TOOLS[task.tool].instant_result(task.arguments))
            finished[task_id] = task.last_updated_at
        return finished

    def _stop(self, task: Task) -> None:
        if task.runner is not None:
            task.runner.cancel()
        for pending in task.inputs.values():
            pending.answer.cancel()
