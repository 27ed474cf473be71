"""The scripted servers: one task (or operation) per series, on the series' tick clock, answering at the
wire in the protocol's own JSON behind an ``httpx2.MockTransport``, so the real adapters parse every answer.

The server's truth is kept here (how many creates made a task, when a cancel was applied); the oracle
never reads it: it predicts the outcome from the series alone, and the runner compares.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2

from console.simulation.series import Series

RELATED = "io.modelcontextprotocol/related-task"
SESSION = "5e55105e55105e55105e55105e551051"
MCP_TOOL = "sim_report"
AIP_TOOL = "run_job"
AIP_CREATE = "POST /v1/projects/sim/jobs:run"
AIP_REQUEST_ID = "requestId"


class SimulatedCrash(BaseException):
    """The worker died here (between the create attempt and its answer): no code path catches it."""


@dataclass
class Truth:
    """What the server did, for the checks."""

    #: Distinct tasks / operations created (one per submission key on AIP-151, one per tools/call on MCP).
    tasks: int = 0
    create_requests: int = 0
    cancel_requests: int = 0
    cancelled_at: int | None = None
    created_at: int | None = None


@dataclass
class ScriptedServer:
    """The common part: the clock, the task's state at a tick, the read faults by number."""

    series: Series
    #: The run's tag: remote ids are unique per server in the ledger, across runs.
    tag: str = "run"
    tick: int = 0
    truth: Truth = field(default_factory=Truth)
    reads: int = 0
    result_reads: int = 0
    created_wall: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat())
    #: Whether an answer since the last tick asked the client to wait (a Retry-After): the series' clock
    #: then runs the hold it set out (:meth:`Simulation._run_out_hold`); no other tick needs to.
    asked_wait: bool = False

    @property
    def task_id(self) -> str:
        return f"task-{self.tag}-{self.series.seed}-{self.series.index}"

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        raise NotImplementedError

    def _done_tick(self) -> int | None:
        if self.truth.created_at is None:
            return None
        term = self.truth.created_at + self.series.term_tick
        if self.truth.cancelled_at is not None and self.truth.cancelled_at < term:
            return self.truth.cancelled_at
        return term

    def state(self) -> str | None:
        """``working`` | ``completed`` | ``failed`` | ``cancelled``, or None: unknown / expired."""
        if self.truth.created_at is None:
            return None
        done = self._done_tick()
        if done is None or self.tick < done:
            return "working"
        if self.series.expiry == "before_seen":
            return None
        if (
            self.truth.cancelled_at is not None
            and self.truth.cancelled_at < self.truth.created_at + self.series.term_tick
        ):
            return "cancelled"
        return self.series.terminal

    def _apply_cancel(self) -> bool:
        """A cancel arriving now: applied when the task is working (and the server honours it)."""
        self.truth.cancel_requests += 1
        if self.state() != "working":
            return False
        if self.series.protocol != "mcp" and self.series.cancel_policy == "ignore":
            return True
        self.truth.cancelled_at = self.tick
        return True

    def _read_fault(self) -> str | None:
        """The fault this status read meets (reads are numbered from 1), if any."""
        self.reads += 1
        return self.series.read_faults.get(self.reads)

    def _create_fault_before(self) -> httpx2.Response | None:
        fault = self.series.create_fault
        if self.truth.create_requests == 1:
            if fault in ("429", "429_retry_after"):
                headers = {"retry-after": "1"} if fault == "429_retry_after" else {}
                self.asked_wait = self.asked_wait or bool(headers)
                return httpx2.Response(
                    429, headers=headers, json={"error": {"code": 429, "message": "slow down"}}
                )
            if fault == "crash_before":
                raise SimulatedCrash("worker died before the create was sent")
        return None

    def _create_fault_after(self) -> httpx2.Response | None:
        fault = self.series.create_fault
        if self.truth.create_requests == 1:
            if fault == "lost_503":
                return httpx2.Response(
                    503, json={"error": {"code": 503, "message": "gateway lost the answer"}}
                )
            if fault == "lost_cut":
                raise httpx2.ReadError("connection cut after the request was sent")
            if fault == "crash_after":
                raise SimulatedCrash("worker died after the create was sent")
        return None

    def _create_task(self) -> None:
        if self.truth.created_at is None:
            self.truth.created_at = self.tick
            self.truth.tasks += 1

    def _create(self, make_task: Callable[[], None] | None = None) -> httpx2.Response | None:
        """A create request: counted, the fault scripted before it, the task made (``make_task``, else
        :meth:`_create_task`), the fault scripted after it. The fault's answer, or None: answer the task."""
        self.truth.create_requests += 1
        early = self._create_fault_before()
        if early is not None:
            return early
        (make_task or self._create_task)()
        return self._create_fault_after()


def fault_response(fault: str, server: ScriptedServer) -> httpx2.Response:
    if fault in ("429", "429_retry_after", "503", "503_retry_after"):
        status = 429 if fault.startswith("429") else 503
        headers = {"retry-after": "1"} if fault.endswith("retry_after") else {}
        server.asked_wait = server.asked_wait or bool(headers)
        return httpx2.Response(status, headers=headers, json={"error": {"code": status, "message": fault}})
    if fault == "truncated":
        return httpx2.Response(
            200,
            content=b'{"jsonrpc": "2.0", "id": 1, "result": {"taskId": "',
            headers={"content-type": "application/json"},
        )
    raise AssertionError(fault)


class McpServer(ScriptedServer):
    """MCP 2025-11-25 with core Tasks, JSON answers, one session."""

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body: dict[str, Any] = json.loads(request.content) if request.method == "POST" else {}
        method = body.get("method")
        rid = body.get("id")
        if request.method != "POST":
            return httpx2.Response(405)
        if method is None or rid is None:
            return httpx2.Response(202)
        if method == "initialize":
            return self._ok(
                rid,
                {
                    "protocolVersion": "2025-11-25",
                    "capabilities": {
                        "tools": {"listChanged": False},
                        "tasks": {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}},
                    },
                    "serverInfo": {"name": "longcall-sim", "version": "1"},
                },
                session=True,
            )
        if method == "tools/list":
            return self._ok(
                rid,
                {
                    "tools": [
                        {
                            "name": MCP_TOOL,
                            "description": "A simulated long report.",
                            "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}},
                            "execution": {"taskSupport": "required"},
                        }
                    ]
                },
            )
        if method == "tasks/list":
            return self._ok(rid, {"tasks": [self._task()] if self.state() else []})
        if method == "tools/call":
            faulted = self._create()
            if faulted is not None:
                return faulted
            return self._ok(rid, {"task": self._task()})
        task_id = (body.get("params") or {}).get("taskId")
        if method == "tasks/get":
            fault = self._read_fault()
            if fault is not None:
                return self._other(rid) if fault == "other_task" else fault_response(fault, self)
            return self._task_answer(rid, task_id, self._task)
        if method == "tasks/result":
            self.result_reads += 1
            if self.result_reads == 1 and self.series.result_fault is not None:
                if self.series.result_fault == "other_task":
                    return self._ok(
                        rid,
                        {
                            "_meta": {RELATED: {"taskId": "task-of-another-operation"}},
                            "content": [{"type": "text", "text": "not yours"}],
                            "isError": False,
                        },
                    )
                return fault_response(self.series.result_fault, self)
            state = self.state()
            if state is None or task_id != self.task_id:
                return self._error(rid, -32602, f"Task not found: {task_id}")
            if state == "working":
                return self._error(rid, -32603, "would block")
            if state == "cancelled":
                return self._ok(rid, {"_meta": {RELATED: {"taskId": self.task_id}}})
            failed = state == "failed"
            return self._ok(
                rid,
                {
                    "_meta": {RELATED: {"taskId": self.task_id}},
                    "content": [{"type": "text", "text": f"{state} {self.series.seed}/{self.series.index}"}],
                    "structuredContent": {"index": self.series.index, "outcome": state},
                    "isError": failed,
                },
            )
        if method == "tasks/cancel":
            state = self.state()
            if state is None or task_id != self.task_id:
                self.truth.cancel_requests += 1
                return self._error(rid, -32602, f"Task not found: {task_id}")
            if state != "working":
                self.truth.cancel_requests += 1
                return self._error(rid, -32602, f"Cannot cancel task in terminal state '{state}'")
            self._apply_cancel()
            if self.series.cancel_ack_lost and self.truth.cancel_requests == 1:
                return httpx2.Response(503, json={"error": "the cancel's answer was lost"})
            return self._ok(rid, {**self._task(), "status": "cancelled"})
        return self._error(rid, -32601, "Method not found")

    def _task(self) -> dict[str, Any]:
        return {
            "taskId": self.task_id,
            "status": self.state() or "working",
            "createdAt": self.created_wall,
            "lastUpdatedAt": self.created_wall,
            "ttl": 600000,
            "pollInterval": 200,
        }

    def _task_answer(self, rid: object, task_id: object, task: Any) -> httpx2.Response:
        if self.state() is None or task_id != self.task_id:
            return self._error(rid, -32602, f"Task not found: {task_id}")
        return self._ok(rid, task())

    def _other(self, rid: object) -> httpx2.Response:
        return self._ok(rid, {**self._task(), "taskId": "task-of-another-operation"})

    @staticmethod
    def _ok(rid: object, result: dict[str, Any], *, session: bool = False) -> httpx2.Response:
        headers = {"mcp-session-id": SESSION} if session else {}
        return httpx2.Response(200, json={"jsonrpc": "2.0", "id": rid, "result": result}, headers=headers)

    @staticmethod
    def _error(rid: object, code: int, message: str) -> httpx2.Response:
        return httpx2.Response(
            200, json={"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}
        )


class AipServer(ScriptedServer):
    """AIP-151 ``google.longrunning`` over REST/JSON; the create deduplicated by its AIP-155 request id."""

    def __init__(self, series: Series, tag: str = "run") -> None:
        super().__init__(series, tag)
        self.request_ids: set[str] = set()

    @property
    def name(self) -> str:
        return f"projects/sim/operations/op-{self.tag}-{self.series.seed}-{self.series.index}"

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/projects/sim/jobs:run":
            request_id = json.loads(request.content).get(AIP_REQUEST_ID)
            faulted = self._create(lambda: self._create_operation(request_id))
            if faulted is not None:
                return faulted
            return httpx2.Response(200, json=self._operation())
        if path == f"/v1/{self.name}:cancel" and request.method == "POST":
            if self.state() is None:
                self.truth.cancel_requests += 1
                return _aip_error(404, "NOT_FOUND", "no such operation")
            if self.state() != "working":
                self.truth.cancel_requests += 1
                return _aip_error(400, "FAILED_PRECONDITION", "operation is done")
            self._apply_cancel()
            return httpx2.Response(200, json={})
        if path.startswith("/v1/") and request.method == "GET":
            fault = self._read_fault()
            if fault == "other_task":
                return httpx2.Response(
                    200, json={**self._operation(), "name": "projects/sim/operations/another"}
                )
            if fault == "truncated":
                return httpx2.Response(
                    200, content=b'{"name": "projects/', headers={"content-type": "application/json"}
                )
            if fault is not None:
                return fault_response(fault, self)
            if path != f"/v1/{self.name}" or self.state() is None:
                return _aip_error(404, "NOT_FOUND", "no such operation")
            return httpx2.Response(200, json=self._operation())
        return _aip_error(404, "NOT_FOUND", f"no route {request.method} {path}")

    def _create_operation(self, request_id: str) -> None:
        """The create deduplicated by its AIP-155 request id."""
        if request_id not in self.request_ids:
            self.request_ids.add(request_id)
            if self.truth.created_at is not None:
                self.truth.tasks += 1  # a second request id: a second operation
            self._create_task()

    def _operation(self) -> dict[str, Any]:
        state = self.state() or "working"
        op: dict[str, Any] = {"name": self.name, "done": state != "working"}
        if state == "completed":
            op["response"] = {"@type": "type.googleapis.com/sim.Report", "index": self.series.index}
        elif state == "failed":
            op["error"] = {"code": 13, "message": "the job failed"}
        elif state == "cancelled":
            op["error"] = {"code": 1, "message": "cancelled"}
        return op


def _aip_error(http: int, status: str, message: str) -> httpx2.Response:
    return httpx2.Response(http, json={"error": {"code": http, "status": status, "message": message}})
