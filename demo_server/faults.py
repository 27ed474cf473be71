"""Fault switches and the request log of the demo MCP server (see `demo_server.mcp` for what each does)."""

from __future__ import annotations

import time
from collections import deque
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Count = Annotated[int, Field(ge=0)]

CountedFault = Literal[
    "lose_create_response",
    "dribble_call_answer",
    "reorder",
    "truncate_result",
    "drop_result",
    "complete_on_cancel",
    "force_input_required",
    "lose_input_request",
    "refuse_reply",
    "reject_reply",
    "ignore_reply",
    "malformed_result",
]


class StatusFault(BaseModel):
    """Answer the next `count` requests of one method with an HTTP error and a Retry-After header."""

    model_config = ConfigDict(extra="forbid")
    count: Count
    retry_after_s: Count = 1


class ResultError(BaseModel):
    """Answer the next `count` ``tasks/result`` requests of a terminal task with this JSON-RPC error (a
    transient store error, say) instead of the task's result; the task itself is unchanged."""

    model_config = ConfigDict(extra="forbid")
    count: Count
    code: int = -32603
    message: str = "Internal error: the result store is unavailable"


class StatusAfterCreate(BaseModel):
    """The next `count` task-augmented ``tools/call`` requests create their task, then are answered with
    this HTTP status and a -32000 error body (a gateway that fails after the origin did the work)."""

    model_config = ConfigDict(extra="forbid")
    status: Annotated[int, Field(ge=400, le=599)]
    count: Count


class ExpireEarly(BaseModel):
    """Purge every task `after_ms` after it becomes terminal (0: at once), whatever its ttl."""

    model_config = ConfigDict(extra="forbid")
    after_ms: Count = 0


class FaultSwitches(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lose_create_response: Count = 0
    dribble_call_answer: Count = 0
    status_after_create: StatusAfterCreate | None = None
    delay_ms: dict[str, Count] = Field(default_factory=dict)
    reorder: Count = 0
    #: Which answer releases a ``tasks/get`` answer held by ``reorder``: the next ``tasks/get`` answer, or
    #: the next ``tasks/result`` answer (later still: the newer poller has written what it saw).
    reorder_release: Literal["tasks/get", "tasks/result"] = "tasks/get"
    status_429: dict[str, StatusFault] = Field(default_factory=dict)
    status_503: dict[str, StatusFault] = Field(default_factory=dict)
    truncate_result: Count = 0
    drop_result: Count = 0
    expire_early: ExpireEarly | None = None
    complete_on_cancel: Count = 0
    force_input_required: Count = 0
    #: ``tasks/result`` SSE streams carry event ids and resume on a GET with ``Last-Event-ID``.
    sse_event_ids: bool = False
    lose_input_request: Count = 0
    #: A client's JSON-RPC response (an input reply) is held this long before it is accepted.
    delay_reply_ms: Count = 0
    result_error: ResultError | None = None
    #: While set, every tool run that finishes ends with this CallToolResult instead of its own.
    result_payload: dict[str, Any] | None = None
    #: While set, every request to /mcp must carry ``Authorization: Bearer <this token>``, else HTTP 401.
    require_bearer: str | None = None
    #: The next N client JSON-RPC responses (input replies) are not taken: the connection is closed with no
    #: answer (a refused or cut POST); the task still waits for its input.
    refuse_reply: Count = 0
    #: The next N client JSON-RPC responses are answered HTTP 400 with a JSON-RPC error and not taken (a
    #: server that refuses the reply); the task still waits for its input.
    reject_reply: Count = 0
    #: The next N client JSON-RPC responses are answered 202 and thrown away: the task still waits (a
    #: server that took the reply and never carried it to the task).
    ignore_reply: Count = 0
    #: The next N ``tasks/result`` answers of a terminal task are not JSON (the same unparsable body each
    #: time, in the SSE event's data or as the JSON body); the task itself is unchanged.
    malformed_result: Count = 0


class Faults:
    """The switches in force; counted switches are used up one request (or task) at a time."""

    def __init__(self) -> None:
        self.switches = FaultSwitches()

    def update(self, changes: dict[str, Any]) -> FaultSwitches:
        """Set the named switches, keep the others (raises pydantic.ValidationError on bad input)."""
        self.switches = FaultSwitches.model_validate({**self.switches.model_dump(), **changes})
        return self.switches

    def reset(self) -> None:
        self.switches = FaultSwitches()

    def take(self, name: CountedFault) -> bool:
        left: int = getattr(self.switches, name)
        if left <= 0:
            return False
        setattr(self.switches, name, left - 1)
        return True

    def take_http_status(self, method: str) -> tuple[int, int] | None:
        """(HTTP status, Retry-After seconds) when this request is to be refused."""
        for status, table in ((429, self.switches.status_429), (503, self.switches.status_503)):
            fault = table.get(method)
            if fault is not None and fault.count > 0:
                fault.count -= 1
                return status, fault.retry_after_s
        return None

    def take_result_error(self) -> dict[str, Any] | None:
        """The JSON-RPC error to answer this ``tasks/result`` with, if the switch has one left."""
        fault = self.switches.result_error
        if fault is None or fault.count <= 0:
            return None
        fault.count -= 1
        return {"code": fault.code, "message": fault.message}

    def take_status_after_create(self) -> int | None:
        """The HTTP status to answer a ``tools/call`` that just created its task with, if any is left."""
        fault = self.switches.status_after_create
        if fault is None or fault.count <= 0:
            return None
        fault.count -= 1
        return fault.status

    def delay_s(self, method: str) -> float:
        return self.switches.delay_ms.get(method, 0) / 1000

    def expire_after_s(self) -> float | None:
        early = self.switches.expire_early
        return None if early is None else early.after_ms / 1000


#: How many entries a log keeps: the newest.
LOG_LIMIT = 100_000


class RequestLog:
    """Every JSON-RPC message with a method the server received, in arrival order (the newest `limit`)."""

    def __init__(self, limit: int = LOG_LIMIT) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=limit)

    def record(
        self,
        *,
        method: str,
        message_id: object,
        task_id: object,
        session: str | None,
        budget: str | None = None,
    ) -> None:
        entry = {
            "t": time.time(),
            "method": method,
            "id": message_id,
            "task_id": task_id,
            "session": session,
            "budget": budget,
        }
        self.entries.append(entry)

    def clear(self) -> None:
        self.entries.clear()


class HttpLog:
    """Every HTTP request to the MCP endpoint (POST, GET, DELETE; JSON-RPC responses and refused requests
    included), with the request budget the client named in its ``Longcall-Budget`` header (None: none) and
    the URL's query string ("" without one: a client configured with ``/mcp?fleet=b`` can be told apart)."""

    def __init__(self, limit: int = LOG_LIMIT) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=limit)

    def record(self, *, verb: str, budget: str | None, query: str = "") -> None:
        self.entries.append({"t": time.time(), "verb": verb, "budget": budget, "query": query})

    def clear(self) -> None:
        self.entries.clear()
