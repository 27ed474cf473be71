"""MCP 2025-11-25 on the wire: pure functions from MCP JSON to the typed values of :mod:`adapters.base`.

Nothing here does I/O; :mod:`adapters.mcp_2025_11_25.adapter` sends the requests. The protocol's words
(methods, statuses, ``_meta`` keys, error codes) live here and in that client, never in ``workers/``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import jsonschema

from adapters.base import (
    Created,
    ErrorInfo,
    InputRequest,
    RemoteRef,
    RemoteResult,
    RemoteStatus,
    TaskSupport,
    TerminalKind,
)
from adapters.errors import (
    AdapterError,
    NotFound,
    ProtocolViolation,
    Rejected,
    ResultContradictsStatus,
    Transient,
    WrongTaskMode,
)
from adapters.http_answers import Session
from adapters.jsonrpc import ErrorResponse, Request, Response
from adapters.mcp_2025_11_25.schema_bounds import bounds_refusal
from adapters.task_fields import non_negative_int, parse_time

__all__ = [
    "ADAPTER_VERSION",
    "ELICITATION_ACTIONS",
    "INPUT_METHODS",
    "INVALID_PARAMS",
    "NO_INPUT_DURING_SYNC_CALL",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "RELATED_TASK",
    "ServerFacts",
    "TaskPage",
    "descriptor_digest",
    "find_tool",
    "first_input_request",
    "input_reply",
    "is_related_to",
    "negotiate",
    "parse_create_result",
    "parse_input_request",
    "parse_task",
    "parse_task_page",
    "parse_tools_page",
    "reply_refusal",
    "result_from_error",
    "result_from_payload",
    "result_of",
    "rpc_error",
    "strip_related_task",
    "tool_task_support",
]

PROTOCOL: Final = "mcp"
PROTOCOL_VERSION: Final = "2025-11-25"
ADAPTER_VERSION: Final = "mcp-2025-11-25/1"
RELATED_TASK: Final = "io.modelcontextprotocol/related-task"
IMMEDIATE_RESPONSE: Final = "io.modelcontextprotocol/model-immediate-response"
INPUT_METHODS: Final = frozenset({"elicitation/create", "sampling/createMessage"})
ELICITATION: Final = "elicitation/create"
ELICITATION_ACTIONS: Final = ("accept", "decline", "cancel")

_STATES: Final = frozenset({"working", "input_required", "completed", "failed", "cancelled"})
_TERMINAL: Final[dict[str, TerminalKind]] = {
    "completed": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
}
_TASK_SUPPORT: Final[dict[str, TaskSupport]] = {
    "forbidden": "forbidden",
    "optional": "optional",
    "required": "required",
}
INVALID_PARAMS: Final = -32602
_METHOD_NOT_FOUND: Final = -32601
_INVALID_REQUEST: Final = -32600
_INTERNAL_ERROR: Final = -32603
# Our refusal of a server request during a synchronous call. Deliberately not -32600/-32601: a server
# that relays it as the tools/call error must not make it look like a wrong task mode.
NO_INPUT_DURING_SYNC_CALL: Final = -32000


@dataclass(frozen=True)
class ServerFacts:
    """What ``initialize`` told us about the server."""

    protocol_version: str
    task_tool_calls: bool
    can_list: bool
    can_cancel: bool
    server_info: Mapping[str, Any]


@dataclass(frozen=True)
class TaskPage:
    tasks: tuple[RemoteStatus, ...]
    next_cursor: str | None


def _object(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolViolation(f"{what} must be an object, got {str(value)[:120]}")
    return value


def negotiate(result: Mapping[str, Any], *, server: str) -> ServerFacts:
    """Read an ``initialize`` result against the fixed version 2025-11-25.

    Raises:
        Rejected: the server answered with another protocol version (tasks exist only in 2025-11-25).
        ProtocolViolation: the result is malformed.
    """
    version = result.get("protocolVersion")
    if not isinstance(version, str):
        raise ProtocolViolation(f"server {server!r}: initialize result without protocolVersion")
    if version != PROTOCOL_VERSION:
        raise Rejected(
            f"server {server!r} negotiated protocol version {version}; this adapter speaks only "
            f"{PROTOCOL_VERSION}"
        )
    capabilities = _object(result.get("capabilities", {}), "capabilities")
    tasks = capabilities.get("tasks")
    task_tool_calls = can_list = can_cancel = False
    if isinstance(tasks, Mapping):
        requests = tasks.get("requests")
        tools = requests.get("tools") if isinstance(requests, Mapping) else None
        task_tool_calls = isinstance(tools, Mapping) and isinstance(tools.get("call"), Mapping)
        can_list = isinstance(tasks.get("list"), Mapping)
        can_cancel = isinstance(tasks.get("cancel"), Mapping)
    info = result.get("serverInfo")
    return ServerFacts(
        protocol_version=version,
        task_tool_calls=task_tool_calls,
        can_list=can_list,
        can_cancel=can_cancel,
        server_info=info if isinstance(info, Mapping) else {},
    )


def parse_tools_page(result: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], str | None]:
    """One ``tools/list`` page: the tool descriptors and the next cursor."""
    tools = result.get("tools")
    if not isinstance(tools, list):
        raise ProtocolViolation("tools/list result without a tools array")
    descriptors = [_object(tool, "tool descriptor") for tool in tools]
    cursor = result.get("nextCursor")
    return descriptors, cursor if isinstance(cursor, str) and cursor else None


def find_tool(descriptors: list[Mapping[str, Any]], tool: str) -> Mapping[str, Any] | None:
    for descriptor in descriptors:
        if descriptor.get("name") == tool:
            return descriptor
    return None


def tool_task_support(descriptor: Mapping[str, Any]) -> TaskSupport:
    """The tool's ``execution.taskSupport``; missing (or not understood) means ``forbidden``."""
    execution = descriptor.get("execution")
    if not isinstance(execution, Mapping):
        return "forbidden"
    value = execution.get("taskSupport")
    return _TASK_SUPPORT.get(value, "forbidden") if isinstance(value, str) else "forbidden"


def descriptor_digest(descriptor: Mapping[str, Any]) -> str:
    """A stable digest of a tool descriptor as the server listed it (the ledger's descriptor version)."""
    canonical = json.dumps(descriptor, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def parse_task(value: object, *, expected_id: str | None = None) -> RemoteStatus:
    """A ``Task`` object (``tasks/get`` result, ``CreateTaskResult.task``, ``tasks/cancel`` result).

    Lenient where servers differ: a missing ``ttl`` is null (mcp 1.30 leaves it out), unparseable
    timestamps are None. Strict where it matters: the status must be one of the five, and the task id
    must be the one asked about.

    Raises:
        ProtocolViolation: not a task, an unknown status, or another task's id.
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
    return RemoteStatus(
        remote_id=task_id,
        server_state=status,
        terminal=_TERMINAL.get(status),
        status_message=message if isinstance(message, str) else None,
        poll_interval_ms=non_negative_int(task.get("pollInterval")),
        ttl_ms=non_negative_int(task.get("ttl")),
        created_at=parse_time(task.get("createdAt")),
        last_updated_at=parse_time(task.get("lastUpdatedAt")),
        # The question itself travels on another stream; the client attaches it when it reads it.
        awaiting_input=status == "input_required",
        raw=dict(task),
    )


def _is_tool_result(result: Mapping[str, Any]) -> bool:
    return "content" in result or "structuredContent" in result or "isError" in result


def result_from_payload(
    payload: Mapping[str, Any], *, server_state: str | None, status_message: str | None
) -> RemoteResult:
    """The outcome of a ``CallToolResult`` (already stripped of transport metadata).

    ``isError: true`` is a failed outcome even when the server said ``completed``; ``failed`` with an
    empty result takes the status message as its error; ``cancelled`` stays cancelled whatever the
    payload (it goes to the audit only).
    """
    is_error = payload.get("isError") is True
    if server_state == "cancelled":
        return RemoteResult(
            outcome="cancelled", server_state=server_state, payload=payload, is_error=is_error
        )
    if is_error or server_state == "failed":
        # The tool's own error text says more than a status message; a failed task's is the reverse.
        if is_error:
            text = _first_text(payload) or status_message or "tool reported an error"
        else:
            text = status_message or _first_text(payload) or "task failed without a status message"
        return RemoteResult(
            outcome="failed",
            server_state=server_state,
            payload=payload,
            is_error=is_error,
            error=ErrorInfo(message=text),
        )
    return RemoteResult(outcome="completed", server_state=server_state, payload=payload, is_error=False)


def result_from_error(error: ErrorResponse, *, server_state: str | None) -> RemoteResult:
    """``tasks/result`` answered with a JSON-RPC error: for a ``failed`` task, the underlying request's
    error (a failed outcome); for a ``cancelled`` one, whatever the server says (TS SDK: -32603) goes to
    the audit of a cancelled outcome.

    Raises:
        ResultContradictsStatus: any other status (``completed``): an error cannot be the result of a
            completed task (a transient store error, say), so it decides nothing and is read again.
    """
    if server_state not in ("failed", "cancelled"):
        raise ResultContradictsStatus(
            f"tasks/result answered JSON-RPC error {error.code} ({error.message}) for a task whose status "
            f"is {server_state!r}",
            observed=str(server_state),
            code=error.code,
            error_message=error.message,
        )
    outcome: TerminalKind = "cancelled" if server_state == "cancelled" else "failed"
    return RemoteResult(
        outcome=outcome,
        server_state=server_state,
        payload={},
        is_error=True,
        error=ErrorInfo(message=error.message, code=error.code, data=error.data),
    )


def _first_text(payload: Mapping[str, Any]) -> str | None:
    content = payload.get("content")
    if isinstance(content, list):
        for block in content:
            if (
                isinstance(block, Mapping)
                and block.get("type") == "text"
                and isinstance(block.get("text"), str)
            ):
                return str(block["text"])
    return None


def strip_related_task(result: Mapping[str, Any], *, task_id: str) -> tuple[dict[str, Any], bool]:
    """Remove the related-task ``_meta`` from a ``tasks/result`` answer; check it names our task.

    Returns the payload and whether the metadata proved the task. A result *without* the metadata (a
    spec violation, seen on FastMCP for isError results) is still bound to our task by ``params.taskId``
    and the JSON-RPC id of its own request, so it is returned unverified rather than refused forever.

    Raises:
        ProtocolViolation: the metadata is malformed or names another task.
    """
    meta = result.get("_meta")
    payload = {key: value for key, value in result.items() if key != "_meta"}
    if not isinstance(meta, Mapping) or RELATED_TASK not in meta:
        if isinstance(meta, Mapping) and meta:
            payload["_meta"] = dict(meta)
        return payload, False
    related = meta[RELATED_TASK]
    if not isinstance(related, Mapping) or related.get("taskId") != task_id:
        named = related.get("taskId") if isinstance(related, Mapping) else related
        raise ProtocolViolation(f"tasks/result for {task_id} carries the result of task {named!r}")
    rest = {key: value for key, value in meta.items() if key != RELATED_TASK}
    if rest:
        payload["_meta"] = rest
    return payload, True


def parse_create_result(result: Mapping[str, Any], *, session: Session) -> Created:
    """A ``tools/call`` answer to a task-augmented request: a ``CreateTaskResult`` (follow the task) or,
    from a server that ignored the ``task`` field, a plain ``CallToolResult`` (the final answer).

    Raises:
        ProtocolViolation: neither shape.
    """
    if "task" in result:
        status = parse_task(result["task"])
        meta = result.get("_meta")
        immediate = meta.get(IMMEDIATE_RESPONSE) if isinstance(meta, Mapping) else None
        ref = RemoteRef(
            remote_id=status.remote_id,
            session_ref=session.session_id,
            protocol_version=session.protocol_version,
            protocol=PROTOCOL,
        )
        return Created(
            ref=ref,
            status=status,
            immediate_response=immediate if isinstance(immediate, str) else None,
        )
    if _is_tool_result(result):
        return Created(
            ref=None,
            status=None,
            sync_result=result_from_payload(dict(result), server_state=None, status_message=None),
        )
    raise ProtocolViolation(f"tools/call answer is neither a task nor a tool result: {str(result)[:200]}")


def parse_input_request(message: Request, *, task_id: str) -> InputRequest | None:
    """The server's input request for our task, read from our ``tasks/result`` stream.

    None when the request is not an input method or its related-task ``_meta`` names another task. A
    request without that ``_meta`` on our own stream is taken as ours (the stream relates it).
    """
    if message.method not in INPUT_METHODS:
        return None
    meta = message.params.get("_meta")
    related = meta.get(RELATED_TASK) if isinstance(meta, Mapping) else None
    if isinstance(related, Mapping) and related.get("taskId") != task_id:
        return None
    schema = message.params.get("requestedSchema")
    return InputRequest(
        request_id=message.id,
        method=message.method,
        params=dict(message.params),
        schema=dict(schema) if isinstance(schema, Mapping) else None,
        task_id=task_id,
    )


def input_reply(request: InputRequest, response: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-RPC response that answers ``request``: its id echoed exactly, our related-task ``_meta``."""
    result = dict(response)
    meta = result.get("_meta")
    merged = dict(meta) if isinstance(meta, Mapping) else {}
    merged[RELATED_TASK] = {"taskId": request.task_id}
    result["_meta"] = merged
    return {"jsonrpc": "2.0", "id": request.request_id, "result": result}


def is_related_to(message: Request, task_id: str) -> bool:
    """True when the request's related-task ``_meta`` names ``task_id`` explicitly."""
    meta = message.params.get("_meta")
    related = meta.get(RELATED_TASK) if isinstance(meta, Mapping) else None
    return isinstance(related, Mapping) and related.get("taskId") == task_id


def first_input_request(requests: Iterable[Request], task_id: str) -> InputRequest | None:
    """The first of the server's requests that asks for input on ``task_id``."""
    for message in requests:
        request = parse_input_request(message, task_id=task_id)
        if request is not None:
            return request
    return None


def reply_refusal(request: InputRequest, response: Mapping[str, Any]) -> str | None:
    """Why ``response`` cannot answer ``request``, or None when it can.

    An ``elicitation/create`` reply needs an action of accept, decline or cancel; an accepted one needs
    ``content`` valid against the requested schema (a schema the validator cannot use refuses too),
    checked in bounded time (:mod:`adapters.mcp_2025_11_25.schema_bounds`). Other input methods are not
    checked here.
    """
    if request.method != ELICITATION:
        return None
    action = response.get("action")
    if action not in ELICITATION_ACTIONS:
        return "an elicitation reply needs action accept, decline or cancel"
    if action == "accept":
        content, schema = response.get("content", {}), request.schema or {}
        bounds = bounds_refusal(schema, content)  # before jsonschema runs: it cannot be interrupted
        if bounds is not None:
            return bounds
        try:
            jsonschema.validate(content, schema)
        except jsonschema.ValidationError as exc:
            return f"content does not match the requested schema: {exc.message}"
        except jsonschema.SchemaError as exc:
            return f"the server's schema is not usable: {exc.message}"
    return None


def parse_task_page(result: Mapping[str, Any]) -> TaskPage:
    tasks = result.get("tasks")
    if not isinstance(tasks, list):
        raise ProtocolViolation("tasks/list result without a tasks array")
    cursor = result.get("nextCursor")
    return TaskPage(
        tasks=tuple(parse_task(task) for task in tasks),
        next_cursor=cursor if isinstance(cursor, str) and cursor else None,
    )


def rpc_error(method: str, error: ErrorResponse, *, server: str, tool: str | None = None) -> AdapterError:
    """The adapter error a JSON-RPC error answer means, by method (reference/mcp-tasks.md §1.11)."""
    where = f"server {server!r}: {method}" + (f" {tool!r}" if tool else "")
    text = f"{where}: {error.message} (JSON-RPC {error.code})"
    if method == "tools/call" and error.code in (_METHOD_NOT_FOUND, _INVALID_REQUEST):
        return WrongTaskMode(text, code=error.code, data=error.data)
    if method in ("tasks/get", "tasks/result", "tasks/cancel") and error.code == INVALID_PARAMS:
        return NotFound(text, code=error.code, servers_word=True)
    if method.startswith("tasks/") and error.code == _METHOD_NOT_FOUND:
        return Rejected(f"{where}: the server does not implement {method}", code=error.code, data=error.data)
    if error.code == _INTERNAL_ERROR and method != "tools/call":
        return Transient(text)
    return Rejected(text, code=error.code, data=error.data)


def result_of(
    method: str, response: Response | ErrorResponse | None, *, server: str, tool: str | None = None
) -> Mapping[str, Any]:
    """The ``result`` of the answer to ``method``.

    Raises:
        AdapterError: the server answered with an error (see :func:`rpc_error`).
        ProtocolViolation: it answered nothing.
    """
    if isinstance(response, ErrorResponse):
        raise rpc_error(method, response, server=server, tool=tool)
    if response is None:
        raise ProtocolViolation(f"server {server!r}: {method} answered nothing")
    return response.result
