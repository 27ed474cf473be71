"""What the AIP-151 demo server keeps: operations, google.rpc errors in both JSON envelopes, fault switches.

The wire forms follow the proto3 JSON mapping of ``google.longrunning.Operation`` (reference/aip-151.md
§2.2): ``done`` is left out while it is false (unless ``emit_default_done``), ``metadata`` and ``response``
are ``Any`` values with ``@type`` beside the fields, ``error`` is a ``google.rpc.Status`` whose ``code``
is the gRPC integer. See ``demo_server.aip151`` for the routes and what every switch does.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TYPE_PREFIX = "type.googleapis.com/"
METADATA_TYPE = TYPE_PREFIX + "longcall.demo.v1.ReportMetadata"
RESPONSE_TYPE = TYPE_PREFIX + "longcall.demo.v1.Report"
EMPTY_TYPE = TYPE_PREFIX + "google.protobuf.Empty"
STRUCT_TYPE = TYPE_PREFIX + "google.protobuf.Struct"
UNKNOWN_TYPE = TYPE_PREFIX + "longcall.demo.v1.NotInAnyDescriptorPool"
ERROR_INFO_TYPE = TYPE_PREFIX + "google.rpc.ErrorInfo"
RETRY_INFO_TYPE = TYPE_PREFIX + "google.rpc.RetryInfo"
DOMAIN = "demo.longcall.local"

#: google.rpc.Code: name -> (gRPC code, HTTP status), as code.proto's comments map them.
CODES: dict[str, tuple[int, int]] = {
    "OK": (0, 200),
    "CANCELLED": (1, 499),
    "UNKNOWN": (2, 500),
    "INVALID_ARGUMENT": (3, 400),
    "DEADLINE_EXCEEDED": (4, 504),
    "NOT_FOUND": (5, 404),
    "ALREADY_EXISTS": (6, 409),
    "PERMISSION_DENIED": (7, 403),
    "RESOURCE_EXHAUSTED": (8, 429),
    "FAILED_PRECONDITION": (9, 400),
    "ABORTED": (10, 409),
    "OUT_OF_RANGE": (11, 400),
    "UNIMPLEMENTED": (12, 501),
    "INTERNAL": (13, 500),
    "UNAVAILABLE": (14, 503),
    "DATA_LOSS": (15, 500),
    "UNAUTHENTICATED": (16, 401),
}

Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]
Outcome = Literal["response", "error", "empty", "none"]
Envelope = Literal["aip193", "grpc_gateway"]
CancelOfDone = Literal["failed_precondition", "empty", "unimplemented"]
#: The RPC names requests are logged and fault-switched by.
Rpc = Literal["RunReport", "GetOperation", "ListOperations", "CancelOperation", "DeleteOperation"]
RPCS: tuple[str, ...] = ("RunReport", "GetOperation", "ListOperations", "CancelOperation", "DeleteOperation")


def rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def duration(seconds: float) -> str:
    """A google.protobuf.Duration in its JSON form ("2s", "0.500s")."""
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{seconds:.3f}s"


class ApiError(Exception):
    """An error answer: a google.rpc.Status, written in whichever envelope the server is switched to."""

    def __init__(
        self,
        status: str,
        message: str,
        *,
        reason: str,
        retry_after_s: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.metadata = metadata or {}

    @property
    def http_status(self) -> int:
        return CODES[self.status][1]

    def details(self) -> list[dict[str, Any]]:
        details: list[dict[str, Any]] = [
            {"@type": ERROR_INFO_TYPE, "reason": self.reason, "domain": DOMAIN, "metadata": self.metadata},
        ]
        if self.retry_after_s is not None:
            details.append({"@type": RETRY_INFO_TYPE, "retryDelay": duration(self.retry_after_s)})
        return details

    def body(self, envelope: Envelope) -> dict[str, Any]:
        """AIP-193 ``{"error": {code: HTTP, status, message, details}}`` or grpc-gateway's bare Status
        ``{code: gRPC, message, details}``."""
        if envelope == "grpc_gateway":
            return {"code": CODES[self.status][0], "message": self.message, "details": self.details()}
        error = {"code": self.http_status, "message": self.message, "status": self.status}
        return {"error": {**error, "details": self.details()}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"retry-after": str(self.retry_after_s)}


def not_found(name: str, why: str = "not found") -> ApiError:
    return ApiError(
        "NOT_FOUND", f"Operation {name} {why}", reason="OPERATION_NOT_FOUND", metadata={"name": name}
    )


def invalid(message: str) -> ApiError:
    return ApiError("INVALID_ARGUMENT", message, reason="INVALID_REQUEST")


@dataclass(eq=False)
class Operation:
    """One report run; ``done`` follows the clock: due at ``created + seconds`` unless ended sooner."""

    name: str
    project: str
    seconds: float
    outcome: Outcome
    request_id: str | None
    request: dict[str, Any]
    created_wall: float = field(default_factory=time.time)
    created: float = field(default_factory=time.monotonic)
    #: Set when the op ended before its due time (cancelled): (monotonic, wall) end, and the error.
    ended: tuple[float, float] | None = None
    forced_error: dict[str, Any] | None = None
    cancel_requested: bool = False
    #: A cancel takes effect at this monotonic time (``cancel_takes_ms``), unless the op is done first.
    cancel_at: float | None = None
    #: The cancel lost the race: the op completes with its own outcome when the cancel would have landed.
    cancel_loses: bool = False

    def settle(self, now: float) -> None:
        """Apply a pending cancel whose moment has come (and the op was not already done by then)."""
        if self.cancel_at is None or self.ended is not None or now < self.cancel_at:
            return
        at = self.cancel_at
        self.cancel_at = None
        if at >= self.due:
            return  # completion won the race
        wall = self.created_wall + (at - self.created)
        if self.cancel_loses:
            self.ended = (at, wall)  # finishes with its own outcome at the moment of the cancel
            return
        self.ended = (at, wall)
        self.forced_error = {"code": 1, "message": "Operation was cancelled."}

    @property
    def due(self) -> float:
        return self.created + self.seconds

    def done_at(self, now: float) -> float | None:
        """The monotonic time the op became done, or None while it runs."""
        self.settle(now)
        if self.ended is not None:
            return self.ended[0]
        return self.due if now >= self.due else None

    def end_wall(self, now: float) -> float | None:
        self.settle(now)
        if self.ended is not None:
            return self.ended[1]
        return self.created_wall + self.seconds if now >= self.due else None

    def view(self, now: float, switches: FaultSwitches) -> dict[str, Any]:
        done_at = self.done_at(now)
        end_wall = self.end_wall(now)
        progress = (
            100.0
            if done_at is not None or self.seconds == 0
            else min(100.0, max(0.0, 100 * (now - self.created) / self.seconds))
        )
        metadata: dict[str, Any] = {
            "state": "RUNNING" if done_at is None else self._final_state(),
            "progressPercent": round(progress, 1),
            "createTime": rfc3339(self.created_wall),
            "cancelRequested": self.cancel_requested,
        }
        if end_wall is not None:
            metadata["endTime"] = rfc3339(end_wall)
        wire: dict[str, Any] = {"name": self.name, "metadata": _any(METADATA_TYPE, metadata, switches)}
        if done_at is None:
            if switches.emit_default_done:
                wire["done"] = False
            return wire
        wire["done"] = True
        if self.forced_error is not None:
            wire["error"] = self.forced_error
        elif self.outcome == "response" and switches.malformed_response:
            wire["response"] = json.dumps(self._response(switches))
        elif self.outcome == "response":
            wire["response"] = self._response(switches)
        elif self.outcome == "error":
            info = {"@type": ERROR_INFO_TYPE, "reason": "REPORT_FAILED", "domain": DOMAIN, "metadata": {}}
            wire["error"] = {"code": 13, "message": "The report failed", "details": [info]}
        elif self.outcome == "empty":
            wire["response"] = (
                {"@type": EMPTY_TYPE, "value": {}} if switches.go_empty else {"@type": EMPTY_TYPE}
            )
        return wire  # outcome "none": done with neither (legal in the current operations.proto)

    def _final_state(self) -> str:
        if self.forced_error is not None:
            return "CANCELLED"
        return "FAILED" if self.outcome == "error" else "SUCCEEDED"

    def _response(self, switches: FaultSwitches) -> dict[str, Any]:
        if switches.go_empty_response:
            return {"@type": EMPTY_TYPE, "value": {}}
        report_id = self.name.rpartition("/")[2]
        fields: dict[str, Any] = {
            "name": f"projects/{self.project}/reports/{report_id}",
            "seconds": self.seconds,
            "rows": 42,
        }
        if switches.response_padding_bytes:
            fields["padding"] = "x" * switches.response_padding_bytes
        if switches.unknown_type_response:
            return {"@type": UNKNOWN_TYPE, **fields, "extra": {"nested": [1, 2, 3]}}
        return _any(RESPONSE_TYPE, fields, switches)


def _any(type_url: str, fields: dict[str, Any], switches: FaultSwitches) -> dict[str, Any]:
    """An Any in proto3 JSON: the message's fields beside ``@type``, or a Struct's under ``value``."""
    if switches.well_known_types:
        return {"@type": STRUCT_TYPE, "value": fields}
    return {"@type": type_url, **fields}


class StatusFault(BaseModel):
    """Refuse the next ``count`` requests of one RPC (or ``"*"``: any) with 429/503, RetryInfo and
    Retry-After ``retry_after_s``; nothing is done for a refused request."""

    model_config = ConfigDict(extra="forbid")
    count: Count
    retry_after_s: Annotated[int, Field(ge=0)] = 2


class RateLimitWindow(BaseModel):
    """``start_in_s`` after the switch is set, and for ``seconds``, every request of ``rpc`` (``"*"``: any)
    gets 429 RESOURCE_EXHAUSTED; Retry-After / RetryInfo say ``retry_after_s`` (null: the window's time
    left, rounded up)."""

    model_config = ConfigDict(extra="forbid")
    rpc: str = "*"
    seconds: Annotated[float, Field(gt=0)]
    retry_after_s: Annotated[int, Field(ge=0)] | None = None
    start_in_s: Seconds = 0.0
    #: Set by the server when the switch is set: the window's start, as ``time.time()``.
    opens_at: float | None = None

    def left_s(self, now_wall: float) -> float | None:
        """Seconds of the window left at ``now_wall`` (None: not open, not yet or any more)."""
        if self.opens_at is None or now_wall < self.opens_at:
            return None
        left = self.opens_at + self.seconds - now_wall
        return left if left > 0 else None


class PlainNotFound(BaseModel):
    """After ``after`` more RunReport requests handled as usual, the next ``count`` are answered a plain-text
    404 (no google.rpc.Status) and never reach the service: nothing is created."""

    model_config = ConfigDict(extra="forbid")
    count: Count
    after: Count = 0

    def take(self) -> bool:
        """Whether this RunReport is answered the plain 404 (the switch counts it either way)."""
        if self.after > 0:
            self.after -= 1
            return False
        if self.count > 0:
            self.count -= 1
            return True
        return False


class Refusal(BaseModel):
    """Refuse the next ``count`` requests of one RPC with ``status`` (a google.rpc code name that refuses:
    no RetryInfo, no Retry-After); nothing is done for a refused request."""

    model_config = ConfigDict(extra="forbid")
    count: Count
    status: Literal[
        "INVALID_ARGUMENT", "PERMISSION_DENIED", "UNAUTHENTICATED", "FAILED_PRECONDITION", "UNIMPLEMENTED"
    ] = "PERMISSION_DENIED"


class StatusAfterCreate(BaseModel):
    """The next ``count`` RunReport requests create their operation, then are answered with this status
    (503 UNAVAILABLE by default) instead of the Operation: a front end failing after the origin acted."""

    model_config = ConfigDict(extra="forbid")
    count: Count
    status: Literal["UNAVAILABLE", "INTERNAL", "DEADLINE_EXCEEDED", "UNKNOWN"] = "UNAVAILABLE"


class FaultSwitches(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Which error envelope every error answer uses.
    envelope: Envelope = "aip193"
    #: What a cancel of an operation that is already done answers.
    cancel_of_done: CancelOfDone = "failed_precondition"
    #: Remove an operation this long after it is done (then 404 NOT_FOUND); null: keep it.
    expire_after_done_s: Seconds | None = None
    #: A RunReport creates its operation, then the connection is closed with no answer.
    lose_create_response: Count = 0
    status_after_create: StatusAfterCreate | None = None
    status_429: dict[str, StatusFault] = Field(default_factory=dict)
    status_503: dict[str, StatusFault] = Field(default_factory=dict)
    rate_limit_window: RateLimitWindow | None = None
    #: Every request of the RPC waits this long before it is handled.
    delay_ms: dict[str, Count] = Field(default_factory=dict)
    #: Go / grpc-gateway ``Empty``: ``{"@type": ...Empty, "value": {}}`` for outcome "empty" (else Python's
    #: ``{"@type": ...Empty}``).
    go_empty: bool = False
    #: Every done operation with a response carries the Go-style Empty instead of its Report.
    go_empty_response: bool = False
    #: Every done operation with a response carries an ``Any`` of a type no descriptor pool knows.
    unknown_type_response: bool = False
    #: ``metadata`` and the report ``response`` are ``google.protobuf.Struct`` Any values (``{"@type":
    #: ...Struct, "value": {...}}``), which a protobuf client parses without this server's descriptors.
    well_known_types: bool = False
    #: A running operation's JSON carries ``"done": false`` (proto3 JSON leaves the default out).
    emit_default_done: bool = False
    #: A cancel of a running operation takes effect this long after it is answered (until then: running).
    cancel_takes_ms: Count = 0
    #: The next N cancels of a running operation are answered ``{}`` but lose the race: the operation
    #: completes with its own outcome instead of CANCELLED.
    complete_on_cancel: Count = 0
    #: A RunReport whose requestId was seen with a different body: "same_operation" (AIP-155: the earlier
    #: response) or "already_exists" (409 ALREADY_EXISTS).
    request_id_conflict: Literal["same_operation", "already_exists"] = "same_operation"
    #: The server ignores requestId (no dedupe: a repeated create makes a second operation).
    ignore_request_id: bool = False
    #: A requestId is honoured this long after its first create (AIP-155: "any reasonable timeframe");
    #: later, the same id makes a new operation. Null: for as long as the server runs.
    request_id_window_s: Seconds | None = None
    #: RunReport for these projects answers 404 NOT_FOUND (the parent is gone) and creates nothing.
    missing_projects: list[str] = Field(default_factory=list)
    #: RunReport requests answered a plain-text HTTP 404 with no google.rpc.Status (what a proxy or a wrong
    #: route sends): nothing is created, the server never saw them.
    plain_404_create: PlainNotFound | None = None
    #: The next N requests of an RPC (or ``"*"``: any) are refused with this google.rpc status (no
    #: RetryInfo, no Retry-After): e.g. ``{"GetOperation": {"count": 5, "status": "PERMISSION_DENIED"}}``.
    refuse: dict[str, Refusal] = Field(default_factory=dict)
    #: Every done operation's Report response carries a ``padding`` string of this many bytes (a result
    #: of that size, carried by GetOperation itself).
    response_padding_bytes: Count = 0
    #: Every done operation with a Report response carries it as a JSON string instead of an ``Any``
    #: object: a protocol violation, the same answer every time.
    malformed_response: bool = False

    @field_validator("status_429", "status_503", "delay_ms", "refuse")
    @classmethod
    def _known_rpcs(cls, table: dict[str, Any]) -> dict[str, Any]:
        unknown = set(table) - {*RPCS, "*"}
        if unknown:
            raise ValueError(f"unknown RPC names {sorted(unknown)}; known: {', '.join(RPCS)} or *")
        return table

    @field_validator("rate_limit_window")
    @classmethod
    def _known_window_rpc(cls, window: RateLimitWindow | None) -> RateLimitWindow | None:
        if window is not None and window.rpc not in {*RPCS, "*"}:
            raise ValueError(f"unknown RPC name {window.rpc!r}")
        return window


RETAINED_REQUEST_IDS = 100_000


@dataclass
class OperationStore:
    """Operations by name, oldest first; request ids remembered with the Operation they answered."""

    operations: OrderedDict[str, Operation] = field(default_factory=OrderedDict)
    #: request id -> (the body it came with, operation name, monotonic time first seen).
    request_ids: OrderedDict[str, tuple[dict[str, Any], str, float]] = field(default_factory=OrderedDict)
    #: The last Operation JSON of a deleted or expired operation: AIP-155's answer for a repeated create.
    last_seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    expired: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    def sweep(self, now: float, switches: FaultSwitches) -> None:
        """Remove every operation done for longer than ``expire_after_done_s``."""
        keep_s = switches.expire_after_done_s
        if keep_s is None:
            return
        for name, op in list(self.operations.items()):
            done_at = op.done_at(now)
            if done_at is not None and now - done_at >= keep_s:
                self.last_seen[name] = op.view(now, switches)
                del self.operations[name]
                self.expired.append(name)

    def remember_request(self, request_id: str, body: dict[str, Any], name: str, now: float) -> None:
        self.request_ids[request_id] = (body, name, now)
        while len(self.request_ids) > RETAINED_REQUEST_IDS:
            self.request_ids.popitem(last=False)
