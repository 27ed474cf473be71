"""The scripted MCP tasks extension server (``io.modelcontextprotocol/tasks``, 2026-07-28): ``server/
discover``, ``tools/call`` answered with a task, ``tasks/get`` carrying the outcome inline, ``tasks/cancel``
an acknowledgement only (cooperative: the server honours it or lets the task complete)."""

from __future__ import annotations

import json
from typing import Any

import httpx2

from console.simulation.servers import MCP_TOOL, ScriptedServer, fault_response

EXTENSION = "io.modelcontextprotocol/tasks"
VERSION = "2026-07-28"


#: The one input round an ``ask_input`` task asks: a form elicitation.
ROUND = {
    "confirm": {
        "method": "elicitation/create",
        "params": {
            "mode": "form",
            "message": "Go on?",
            "requestedSchema": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
            },
        },
    }
}
#: The client's answer to :data:`ROUND`.
ANSWER = {"confirm": {"action": "accept", "content": {"ok": True}}}


class McpExtServer(ScriptedServer):
    #: The tick the answer to the input round arrived (``ask_input``); the task's end counts from it.
    answered_at: int | None = None
    updates: int = 0

    def state(self) -> str | None:
        if self.series.ask_input and self.truth.created_at is not None and self.answered_at is None:
            return "input_required" if self.tick > self.truth.created_at else "working"
        return super().state()

    def _done_tick(self) -> int | None:
        done = super()._done_tick()
        if done is not None and self.answered_at is not None:
            return self.answered_at + self.series.term_tick
        return done

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        if request.method != "POST":
            return httpx2.Response(405)
        body: dict[str, Any] = json.loads(request.content)
        method, rid = body.get("method"), body.get("id")
        if method is None or rid is None:
            return httpx2.Response(202)
        if method == "server/discover":
            return _ok(
                rid,
                {
                    "supportedVersions": [VERSION],
                    "capabilities": {"tools": {}, "extensions": {EXTENSION: {}}},
                    "serverInfo": {"name": "longcall-sim-ext", "version": "1"},
                },
            )
        if method == "tools/list":
            return _ok(
                rid,
                {
                    "tools": [
                        {
                            "name": MCP_TOOL,
                            "description": "A simulated long report.",
                            "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}},
                        }
                    ]
                },
            )
        if method == "tools/call":
            faulted = self._create()
            if faulted is not None:
                return faulted
            return _ok(rid, {"resultType": "task", **self._task()})
        task_id = (body.get("params") or {}).get("taskId")
        if method == "tasks/get":
            fault = self._read_fault()
            if fault == "other_task":
                return _ok(rid, {**self._task(), "taskId": "task-of-another-operation"})
            if fault is not None:
                return fault_response(fault, self)
            if self.state() is None or task_id != self.task_id:
                return _error(rid, -32602, f"Task not found: {task_id}")
            return _ok(rid, self._task())
        if method == "tasks/update":
            self.updates += 1
            if self.state() != "input_required" or task_id != self.task_id:
                return _error(rid, -32602, f"Task {task_id} is not waiting for input")
            if (body.get("params") or {}).get("inputResponses") != ANSWER:
                return _error(rid, -32602, "inputResponses do not answer the round")
            self.answered_at = self.tick
            return _ok(rid, {})
        if method == "tasks/cancel":
            if self.state() is None or task_id != self.task_id:
                self.truth.cancel_requests += 1
                return _error(rid, -32602, f"Task not found: {task_id}")
            self._apply_cancel()
            return _ok(rid, {})
        return _error(rid, -32601, "Method not found")

    def _task(self) -> dict[str, Any]:
        state = self.state() or "working"
        task: dict[str, Any] = {
            "taskId": self.task_id,
            "status": state,
            "createdAt": self.created_wall,
            "lastUpdatedAt": self.created_wall,
            "ttlMs": 600000,
            "pollIntervalMs": 200,
        }
        if state == "input_required":
            task["inputRequests"] = ROUND
        elif state == "completed":
            task["result"] = {
                "content": [{"type": "text", "text": f"completed {self.series.seed}/{self.series.index}"}],
                "structuredContent": {"index": self.series.index},
                "isError": False,
            }
        elif state == "failed":
            task["error"] = {"code": -32000, "message": "the report failed"}
        return task


def _ok(rid: object, result: dict[str, Any]) -> httpx2.Response:
    return httpx2.Response(200, json={"jsonrpc": "2.0", "id": rid, "result": result})


def _error(rid: object, code: int, message: str) -> httpx2.Response:
    return httpx2.Response(
        200, json={"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}
    )
