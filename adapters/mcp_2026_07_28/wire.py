"""Pure functions from the MCP tasks extension's JSON (``io.modelcontextprotocol/tasks``, spec 2026-07-28,
SEP-2663) to the typed values of :mod:`adapters.base`; no I/O.

Facts (reference/mcp-tasks-extension.md): no handshake, every request carries the protocol version and
the client capabilities in ``_meta`` (the tasks opt-in among them, on every request); ``tools/call`` may
answer ``resultType: "task"`` with the task's fields at the top level (the schema; the nested
``task.taskId`` of the prose is tolerated); ``tasks/get`` carries the result or the error inline;
``tasks/update`` answers input requests by key; ``tasks/cancel`` is an acknowledgement only.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from adapters.base import (
    Created,
    ErrorInfo,
    InputRequest,
    RemoteRef,
    RemoteResult,
    RemoteStatus,
    TerminalKind,
)
from adapters.errors import (
    AdapterError,
    CapabilityRefused,
    NotFound,
    ProtocolViolation,
    Rejected,
    Transient,
)
from adapters.mcp_2025_11_25.wire import reply_refusal as elicitation_refusal
from adapters.mcp_2025_11_25.wire import result_from_payload
from adapters.task_fields import non_negative_int, parse_time

__all__ = [
    "ADAPTER_VERSION",
    "EXTENSION",
    "MISSING_CAPABILITY",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "REPLY_METHOD",
    "error_for",
    "header_value",
    "input_request_of",
    "parse_create_result",
    "parse_task",
    "reply_refusal",
    "request_meta",
    "round_id",
    "without_answered",
]

PROTOCOL: Final = "mcp"
PROTOCOL_VERSION: Final = "2026-07-28"
ADAPTER_VERSION: Final = "mcp-2026-07-28-ext-tasks/1"
EXTENSION: Final = "io.modelcontextprotocol/tasks"
#: The method an input round is answered with; an extension round's ``InputRequest.method``.
REPLY_METHOD: Final = "tasks/update"

META_VERSION: Final = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES: Final = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT_INFO: Final = "io.modelcontextprotocol/clientInfo"

INVALID_PARAMS: Final = -32602
METHOD_NOT_FOUND: Final = -32601
INTERNAL_ERROR: Final = -32603
#: Missing required client capability: the tasks opt-in was not on the request.
MISSING_CAPABILITY: Final = -32021
HEADER_MISMATCH: Final = -32020
UNSUPPORTED_VERSION: Final = -32022

_STATES: Final = frozenset({"working", "input_required", "completed", "failed", "cancelled"})
_TERMINAL: Final[dict[str, TerminalKind]] = {
    "completed": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
}
CLIENT_INFO: Final = {"name": "longcall", "version": ADAPTER_VERSION}


def request_meta(*, opt_in: bool = True) -> dict[str, Any]:
    """The ``_meta`` every request carries: the version, the client's capabilities (the tasks opt-in,
    elicitation in form mode) and its name. ``opt_in`` False leaves the tasks extension out."""
    capabilities: dict[str, Any] = {"elicitation": {"form": {}}}
    if opt_in:
        capabilities["extensions"] = {EXTENSION: {}}
    return {META_VERSION: PROTOCOL_VERSION, META_CAPABILITIES: capabilities, META_CLIENT_INFO: CLIENT_INFO}


def header_value(value: str) -> str:
    """A value for ``Mcp-Name``: as is when it is visible ASCII, else the ``=?base64?...?=`` form."""
    if value and all(33 <= ord(c) <= 126 for c in value) and not value.startswith("=?"):
        return value
    return "=?base64?" + base64.b64encode(value.encode()).decode("ascii") + "?="


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolViolation(f"{what} is not an object: {str(value)[:200]}")
    return value


def round_id(keys: list[str] | tuple[str, ...] | frozenset[str]) -> str:
    """The id of one input round: its keys, sorted, as JSON (the same set shown again is the same round)."""
    return json.dumps(sorted(keys), separators=(",", ":"))


def input_request_of(task_id: str, requests: Mapping[str, Any]) -> InputRequest:
    """One input round: the outstanding ``inputRequests`` map as sent (DESIGN §7). ``schema`` maps each
    elicitation key to its ``requestedSchema`` (None for other methods).

    Raises:
        ProtocolViolation: an entry is not ``{method, params}``.
    """
    schema: dict[str, Any] = {}
    for key, entry in requests.items():
        if not isinstance(key, str) or not key:
            raise ProtocolViolation(f"task {task_id}: input request key {key!r} is not a string")
        item = _object(entry, f"task {task_id}: input request {key!r}")
        method = item.get("method")
        if not isinstance(method, str) or not method:
            raise ProtocolViolation(f"task {task_id}: input request {key!r} has no method")
        params = item.get("params", {})
        if not isinstance(params, Mapping):
            raise ProtocolViolation(f"task {task_id}: input request {key!r} params are not an object")
        requested = params.get("requestedSchema") if method == "elicitation/create" else None
        schema[key] = dict(requested) if isinstance(requested, Mapping) else None
    return InputRequest(
        request_id=round_id(tuple(requests)),
        method=REPLY_METHOD,
        params={key: dict(value) for key, value in requests.items()},
        schema=schema,
        task_id=task_id,
    )


def without_answered(request: InputRequest, answered: Iterable[str]) -> InputRequest | None:
    """The round ``request`` without the keys already ``answered`` (DESIGN §7: a key already answered is
    never asked, nor sent, twice); None when no key is left. Until the server applies a reply (its ack is
    eventually consistent) a poll may show answered keys again."""
    done = set(answered)
    left = {key: value for key, value in request.params.items() if key not in done}
    if not left:
        return None
    if len(left) == len(request.params):
        return request
    return input_request_of(request.task_id, left)


def _inline_result(task: Mapping[str, Any], status: str, message: str | None) -> RemoteResult | None:
    """The outcome ``tasks/get`` carries inline: ``result`` (a CallToolResult) for completed, ``error``
    (a JSON-RPC error object) for failed; None when it is absent (read again) or cancelled."""
    if status == "completed":
        payload = task.get("result")
        if not isinstance(payload, Mapping):
            return None
        return result_from_payload(dict(payload), server_state=status, status_message=message)
    if status == "failed":
        error = task.get("error")
        if isinstance(error, Mapping):
            code = error.get("code")
            text = error.get("message")
            info = ErrorInfo(
                message=str(text) if text is not None else (message or "task failed"),
                code=code if isinstance(code, int) and not isinstance(code, bool) else None,
                data=error.get("data"),
            )
        else:
            info = ErrorInfo(message=message or "task failed without an error object")
        return RemoteResult(outcome="failed", server_state=status, payload={}, is_error=True, error=info)
    return None


def parse_task(value: object, *, expected_id: str | None = None) -> RemoteStatus:
    """A ``DetailedTask`` (``tasks/get`` result) or the fields of a ``CreateTaskResult``.

    ``resultType`` is not relied on (the spec's own examples disagree). ``ttlMs`` may be null
    (unlimited); an unparseable timestamp is None. ``input_required`` with its ``inputRequests`` is a
    round (``input_request``); without them the status says ``awaiting_input``. A terminal status
    carries its inline outcome as ``result`` (a cancelled one none).

    Raises:
        ProtocolViolation: not a task, an unknown status, another task's id, a malformed input request.
    """
    task = _object(value, "task")
    task_id = task.get("taskId")
    if not isinstance(task_id, str) or not task_id:
        raise ProtocolViolation(f"task without a taskId: {str(task)[:200]}")
    if expected_id is not None and task_id != expected_id:
        raise ProtocolViolation(f"asked about task {expected_id!r}, the server answered about {task_id!r}")
    status = task.get("status")
    if not isinstance(status, str) or status not in _STATES:
        raise ProtocolViolation(f"task {task_id}: unknown status {status!r}")
    message = task.get("statusMessage")
    message = message if isinstance(message, str) else None
    request: InputRequest | None = None
    if status == "input_required":
        requests = task.get("inputRequests")
        if isinstance(requests, Mapping) and requests:
            request = input_request_of(task_id, requests)
    return RemoteStatus(
        remote_id=task_id,
        server_state=status,
        terminal=_TERMINAL.get(status),
        status_message=message,
        poll_interval_ms=non_negative_int(task.get("pollIntervalMs")),
        ttl_ms=non_negative_int(task.get("ttlMs")),
        created_at=parse_time(task.get("createdAt")),
        last_updated_at=parse_time(task.get("lastUpdatedAt")),
        input_request=request,
        awaiting_input=status == "input_required" and request is None,
        raw=dict(task),
        result=_inline_result(task, status, message),
    )


def parse_create_result(result: Mapping[str, Any], *, server: str, tool: str) -> Created:
    """The answer to an opted-in ``tools/call``: a task (flat ``resultType: "task"``, or the nested
    ``task.taskId`` form as a tolerated deviation), or the tool's own synchronous result.

    Raises:
        CapabilityRefused: the server asks for input before it creates a task (MRTR): longcall answers
            input only on a durable task.
        ProtocolViolation: an unknown ``resultType`` or a task without its fields.
    """
    kind = result.get("resultType", "complete")
    where = f"server {server!r}: tools/call {tool!r}"
    if kind == "task":
        nested = result.get("task")
        fields: Mapping[str, Any] = result
        if "taskId" not in result and isinstance(nested, Mapping):
            fields = nested  # the prose's nested form, tolerated (reference §1.3 and its addendum)
        status = parse_task(fields)
        ref = RemoteRef(
            remote_id=status.remote_id, session_ref=None, protocol_version=PROTOCOL_VERSION, protocol=PROTOCOL
        )
        return Created(ref=ref, status=status)
    if kind == "complete":
        if "taskId" in result or isinstance(result.get("task"), Mapping):
            raise ProtocolViolation(f"{where}: a task in a result marked complete")
        return Created(
            ref=None,
            status=None,
            sync_result=result_from_payload(dict(result), server_state=None, status_message=None),
        )
    if kind == "input_required":
        raise CapabilityRefused(
            f"{where}: the server asks for input before creating a task (multi round-trip request); "
            "longcall answers input only for a task"
        )
    raise ProtocolViolation(f"{where}: unknown resultType {kind!r}")


def error_for(method: str, code: int | None, message: str, data: object, *, server: str) -> AdapterError:
    """The adapter error a JSON-RPC error (in a 200 body or a 4xx one) to ``method`` means.

    ``-32021`` (the opt-in missing) is a definite :class:`CapabilityRefused`, never retried; ``-32602``
    on a ``tasks/*`` request means unknown or expired (the extension cannot tell them apart).
    """
    text = f"server {server!r}: {method}: {message} (JSON-RPC {code})"
    if code == MISSING_CAPABILITY:
        return CapabilityRefused(
            f"{text}: the server requires the {EXTENSION} client capability on this request",
            code=code,
            data=data,
        )
    if method.startswith("tasks/") and code == INVALID_PARAMS:
        return NotFound(text, code=code, servers_word=True)
    if method.startswith("tasks/") and code == METHOD_NOT_FOUND:
        return Rejected(f"server {server!r}: does not implement {method}", code=code, data=data)
    if code == INTERNAL_ERROR and method in ("tasks/get",):
        return Transient(text)
    return Rejected(text, code=code, data=data)


def reply_refusal(request: InputRequest, response: Mapping[str, Any]) -> str | None:
    """Why ``response`` cannot answer the round ``request``: it must be the ``inputResponses`` map with
    every key of the round and no other; each elicitation answer an object with an ``action``."""
    if not isinstance(response, Mapping) or not response:
        return "the reply must be the inputResponses map (key -> response), not empty"
    asked = set(request.params)
    extra = sorted(set(response) - asked)
    if extra:
        return f"key(s) {extra} were not asked in this round (asked: {sorted(asked)})"
    missing = sorted(asked - set(response))
    if missing:
        return f"every key of the round must be answered; missing {missing}"
    for key, answer in response.items():
        if not isinstance(answer, Mapping):
            return f"the answer to {key!r} is not an object"
        entry = request.params.get(key)
        method = entry.get("method") if isinstance(entry, Mapping) else None
        if method == "elicitation/create" and isinstance(entry, Mapping):
            schemas = request.schema or {}
            schema = schemas.get(key) if isinstance(schemas, Mapping) else None
            params = entry.get("params")
            one = InputRequest(
                request_id=key,
                method=method,
                params=params if isinstance(params, Mapping) else {},
                schema=schema if isinstance(schema, Mapping) else None,
                task_id=request.task_id,
            )
            why = elicitation_refusal(one, answer)
            if why is not None:
                return f"the answer to {key!r}: {why}"
    return None
