"""The MCP adapter for protocol version 2025-11-25 (core Tasks, experimental).

The module has two halves. The pure functions at the top turn MCP JSON into the typed values of
:mod:`adapters.base` and never do I/O; :class:`McpTasksAdapter` below is the thin client that sends the
requests through :class:`adapters.streamable_http.StreamableHttpClient`.

Facts this adapter is built on (reference/mcp-tasks.md): task ids come from the server and there is no
idempotency key, so a lost create answer is :class:`OutcomeUnknown` and ``lookup_by_key`` can never prove
"never created"; every unknown/expired/terminal task error is ``-32602``; ``-32601`` and ``-32600`` on
``tools/call`` both mean "wrong task mode"; ``ttl`` may be missing on the wire (read as null);
``tasks/result`` blocks until the task is terminal, so it is only called after a terminal status.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Final

import httpx

from adapters.base import (
    AdapterConfig,
    CancelOutcome,
    Created,
    ErrorInfo,
    InputRequest,
    LookupResult,
    RemoteRef,
    RemoteResult,
    RemoteStatus,
    TaskSupport,
    TerminalKind,
    ToolCapabilities,
)
from adapters.errors import (
    AdapterError,
    CapabilityRefused,
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    Rejected,
    ResultNotReady,
    Transient,
    WrongTaskMode,
)
from adapters.jsonrpc import ErrorResponse, Message, Request, Response
from adapters.streamable_http import Exchange, Session, SessionGone, StreamableHttpClient

__all__ = [
    "ADAPTER_VERSION",
    "INPUT_METHODS",
    "NO_INPUT_DURING_SYNC_CALL",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "RELATED_TASK",
    "McpTasksAdapter",
    "ServerFacts",
    "TaskPage",
    "descriptor_digest",
    "find_tool",
    "input_reply",
    "negotiate",
    "parse_create_result",
    "parse_input_request",
    "parse_task",
    "parse_task_page",
    "parse_tools_page",
    "result_from_error",
    "result_from_payload",
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
_INVALID_PARAMS: Final = -32602
_METHOD_NOT_FOUND: Final = -32601
_INVALID_REQUEST: Final = -32600
_INTERNAL_ERROR: Final = -32603
# Our refusal of a server request during a synchronous call. Deliberately not -32600/-32601: a server
# that relays it as the tools/call error must not make it look like a wrong task mode.
NO_INPUT_DURING_SYNC_CALL: Final = -32000


# --------------------------------------------------------------------------------------------------
# Pure parsing
# --------------------------------------------------------------------------------------------------


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


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _non_negative_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)


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
        poll_interval_ms=_non_negative_int(task.get("pollInterval")),
        ttl_ms=_non_negative_int(task.get("ttl")),
        created_at=_parse_time(task.get("createdAt")),
        last_updated_at=_parse_time(task.get("lastUpdatedAt")),
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
    if is_error:
        text = _first_text(payload) or status_message or "tool reported an error"
        return RemoteResult(
            outcome="failed",
            server_state=server_state,
            payload=payload,
            is_error=True,
            error=ErrorInfo(message=text),
        )
    if server_state == "failed":
        text = status_message or _first_text(payload) or "task failed without a status message"
        return RemoteResult(
            outcome="failed",
            server_state=server_state,
            payload=payload,
            is_error=False,
            error=ErrorInfo(message=text),
        )
    return RemoteResult(outcome="completed", server_state=server_state, payload=payload, is_error=False)


def result_from_error(error: ErrorResponse, *, server_state: str | None) -> RemoteResult:
    """``tasks/result`` answered with the underlying request's JSON-RPC error: a failed outcome
    (or, for a cancelled task, a cancelled one whose error goes to the audit)."""
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


def _first_input(exchange: Exchange, task_id: str) -> InputRequest | None:
    for message in exchange.server_requests:
        request = parse_input_request(message, task_id=task_id)
        if request is not None:
            return request
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
    if method in ("tasks/get", "tasks/result", "tasks/cancel") and error.code == _INVALID_PARAMS:
        return NotFound(text, code=error.code)
    if method.startswith("tasks/") and error.code == _METHOD_NOT_FOUND:
        return Rejected(f"{where}: the server does not implement {method}", code=error.code, data=error.data)
    if error.code == _INTERNAL_ERROR and method != "tools/call":
        return Transient(text)
    return Rejected(text, code=error.code, data=error.data)


# --------------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _unreadable_answer_is_unknown(what: str) -> Iterator[None]:
    """For a request with an effect, an answer we cannot read says nothing about whether the effect
    happened: a protocol violation there is an unknown outcome, never a refusal to retry around."""
    try:
        yield
    except ProtocolViolation as exc:
        raise OutcomeUnknown(
            f"{what}: the answer is unreadable ({exc}); the request may have taken effect"
        ) from exc


class McpTasksAdapter:
    """MCP 2025-11-25 over Streamable HTTP, through an injected ``httpx.Client``.

    One instance per (server, worker process). It initializes a session lazily for ``capabilities``
    and ``create``; ``get``/``result``/``cancel``/``reply_input`` use the session stored in the
    :class:`RemoteRef` as-is, so any worker can resume any operation without re-initializing.
    """

    def __init__(self, config: AdapterConfig, http: httpx.Client) -> None:
        if (config.protocol, config.protocol_version) != (PROTOCOL, PROTOCOL_VERSION):
            raise ValueError(
                f"{type(self).__name__} speaks {PROTOCOL} {PROTOCOL_VERSION}, not "
                f"{config.protocol} {config.protocol_version}"
            )
        self._config = config
        self._client = StreamableHttpClient(
            http,
            config.url,
            bearer_token=config.bearer_token,
            timeouts=config.timeouts,
            limits=config.limits,
        )
        self._lock = threading.RLock()
        self._session: Session | None = None
        self._facts: ServerFacts | None = None
        self._tools: list[Mapping[str, Any]] | None = None
        self._tools_read_at = 0.0

    # -- identity ----------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def protocol(self) -> str:
        return PROTOCOL

    @property
    def protocol_version(self) -> str:
        return PROTOCOL_VERSION

    @property
    def adapter_version(self) -> str:
        return ADAPTER_VERSION

    @property
    def session_ref(self) -> str | None:
        """The current session's id (None when stateless or not initialized yet)."""
        return self._session.session_id if self._session is not None else None

    # -- session -----------------------------------------------------------------------------------

    def server_facts(self) -> ServerFacts:
        """Initialize if needed; return what the server declared."""
        with self._lock:
            if self._facts is None or self._session is None:
                return self._initialize()[1]
            return self._facts

    def _current_session(self) -> Session:
        with self._lock:
            if self._session is None:
                return self._initialize()[0]
            return self._session

    def _initialize(self) -> tuple[Session, ServerFacts]:
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {"elicitation": {"form": {}}, "tasks": {}},
            "clientInfo": {"name": "longcall", "version": ADAPTER_VERSION},
        }
        exchange = self._client.request("initialize", params, session=None, idempotent=True)
        result = self._result_of("initialize", exchange)
        facts = negotiate(result, server=self.name)
        session = Session(session_id=exchange.session_id, protocol_version=facts.protocol_version)
        self._client.post_message(
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            session=session,
            what="notifications/initialized",
            idempotent=True,
        )
        self._session, self._facts, self._tools = session, facts, None
        return session, facts

    def _session_gone(self, gone: Session | None) -> None:
        """A 404 for ``gone``: forget it and re-initialize (MUST, per the transport spec)."""
        with self._lock:
            if self._session is None or gone is None or self._session.session_id == gone.session_id:
                self._session, self._facts, self._tools = None, None, None
                try:
                    self._initialize()
                except AdapterError:
                    # The next call initializes lazily; the caller is told NotFound either way.
                    self._session, self._facts, self._tools = None, None, None

    @staticmethod
    def _stored_session(remote: RemoteRef) -> Session:
        if remote.protocol != PROTOCOL:
            raise ValueError(f"reference of protocol {remote.protocol!r} given to the MCP adapter")
        return Session(session_id=remote.session_ref, protocol_version=remote.protocol_version)

    def _result_of(self, method: str, exchange: Exchange, *, tool: str | None = None) -> Mapping[str, Any]:
        response = exchange.response
        if isinstance(response, ErrorResponse):
            raise rpc_error(method, response, server=self.name, tool=tool)
        if response is None:
            raise ProtocolViolation(f"server {self.name!r}: {method} answered nothing")
        return response.result

    # -- capabilities ------------------------------------------------------------------------------

    def _tool_list(self) -> list[Mapping[str, Any]]:
        with self._lock:
            session = self._current_session()
            fresh = time.monotonic() - self._tools_read_at < self._config.limits.tool_list_max_age_s
            if self._tools is not None and fresh:
                return self._tools
            tools: list[Mapping[str, Any]] = []
            cursor: str | None = None
            for _ in range(self._config.limits.max_pages):
                params: dict[str, Any] = {"cursor": cursor} if cursor else {}
                exchange = self._client.request("tools/list", params, session=session, idempotent=True)
                page, cursor = parse_tools_page(self._result_of("tools/list", exchange))
                tools.extend(page)
                if cursor is None:
                    self._tools, self._tools_read_at = tools, time.monotonic()
                    return tools
            raise ProtocolViolation(
                f"server {self.name!r}: tools/list has more than {self._config.limits.max_pages} pages"
            )

    def capabilities(self, tool: str) -> ToolCapabilities:
        """Negotiate for one tool: the server's ``tasks.requests.tools.call`` and the tool's taskSupport.

        Raises:
            Rejected: the server does not list the tool, or negotiated another protocol version.
            Transient, RateLimited, ProtocolViolation, OutcomeUnknown: transport failures.
        """
        try:
            facts = self.server_facts()
            descriptor = find_tool(self._tool_list(), tool)
        except SessionGone:
            self._session_gone(self._session)
            facts = self.server_facts()
            descriptor = find_tool(self._tool_list(), tool)
        if descriptor is None:
            raise Rejected(f"server {self.name!r} lists no tool {tool!r}")
        return ToolCapabilities(
            server=self.name,
            tool=tool,
            protocol_version=facts.protocol_version,
            server_task_calls=facts.task_tool_calls,
            task_support=tool_task_support(descriptor),
            can_list=facts.can_list,
            can_cancel=facts.can_cancel,
            descriptor_digest=descriptor_digest(descriptor),
        )

    # -- create ------------------------------------------------------------------------------------

    def create(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        submission_key: str,
        ttl_ms: int,
        sync_upper_bound_s: float | None = None,
    ) -> Created:
        """Start the tool call: as a task when the server and tool declare it, else synchronously when
        ``sync_upper_bound_s`` allows, else refuse.

        MCP 2025-11-25 has no idempotency key: ``submission_key`` is not sent, and a lost answer is
        :class:`OutcomeUnknown` (never retried here).

        Raises:
            CapabilityRefused: no task support and no synchronous bound (or a required-task tool on a
                server without tasks).
            WrongTaskMode: the server refused the call's task mode (-32601/-32600).
            Rejected: any other definitive refusal.
            OutcomeUnknown: the request may have started the tool.
            Transient, RateLimited, ProtocolViolation.
        """
        del submission_key  # no key in this protocol version; kept by the ledger only
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be a positive integer, got {ttl_ms!r}")
        caps = self.capabilities(tool)
        if caps.use_task:
            params = {"name": tool, "arguments": dict(arguments), "task": {"ttl": ttl_ms}}
            session = self._current_session()
            with _unreadable_answer_is_unknown(f"server {self.name!r}: tools/call {tool!r}"):
                try:
                    exchange = self._client.request("tools/call", params, session=session, idempotent=False)
                except SessionGone:
                    # 404 before dispatch: the call never ran, so sending it again on a new session is safe.
                    self._session_gone(session)
                    session = self._current_session()
                    exchange = self._client.request("tools/call", params, session=session, idempotent=False)
                return parse_create_result(
                    self._result_of("tools/call", exchange, tool=tool), session=session
                )
        if caps.task_support == "required":
            raise CapabilityRefused(
                f"tool {tool!r} on server {self.name!r} requires a task, but the server declares no "
                f"task-augmented tools/call"
            )
        if sync_upper_bound_s is None:
            why = (
                "the server declares no task-augmented tools/call"
                if not caps.server_task_calls
                else "the tool declares no task support"
            )
            raise CapabilityRefused(
                f"tool {tool!r} on server {self.name!r} cannot run as a task ({why}) and no synchronous "
                f"upper bound is configured for it"
            )
        return self._call_sync(tool, arguments, sync_upper_bound_s)

    def _call_sync(self, tool: str, arguments: Mapping[str, Any], bound_s: float) -> Created:
        params = {"name": tool, "arguments": dict(arguments)}
        session = self._current_session()

        def send(on: Session) -> Exchange:
            return self._client.request(
                "tools/call",
                params,
                session=on,
                idempotent=False,
                read_timeout=bound_s,
                on_request=lambda request: self._refuse_during_sync_call(on, request, tool),
            )

        with _unreadable_answer_is_unknown(f"server {self.name!r}: tools/call {tool!r}"):
            try:
                exchange = send(session)
            except SessionGone:
                self._session_gone(session)
                session = self._current_session()
                exchange = send(session)
            result = self._result_of("tools/call", exchange, tool=tool)
            if "task" in result:
                raise ProtocolViolation(f"server {self.name!r} made a task of a call sent without one")
            return Created(
                ref=None,
                status=None,
                sync_result=result_from_payload(dict(result), server_state=None, status_message=None),
            )

    def _refuse_during_sync_call(self, session: Session, request: Request, tool: str) -> None:
        """A synchronous call has no durable operation to park a question on: refuse the server's request
        (as an SDK client without that capability does) rather than answer for a human or hang."""
        refusal = {
            "jsonrpc": "2.0",
            "id": request.id,
            "error": {
                "code": NO_INPUT_DURING_SYNC_CALL,
                "message": f"longcall cannot answer {request.method} during the synchronous call of "
                f"{tool!r}; run the tool as a task to get input",
            },
        }
        with contextlib.suppress(AdapterError):
            # Unanswered, the call still ends at its synchronous bound.
            self._client.post_message(refusal, session=session, what=f"refusal of {request.method}")

    # -- lookup ------------------------------------------------------------------------------------

    def lookup_by_key(
        self,
        submission_key: str,
        *,
        tool: str | None = None,
        submitted_after: datetime | None = None,
        session_ref: str | None = None,
    ) -> LookupResult:
        """MCP 2025-11-25 has no idempotency key and no client-chosen task id, so nothing can prove that
        a submission was never created. When the server lists tasks, tasks created after
        ``submitted_after`` are returned as candidates for an operator, never as proof.
        """
        detail = (
            f"MCP {PROTOCOL_VERSION} has no idempotency key: server {self.name!r} cannot be asked whether "
            f"submission {submission_key} created a task"
        )
        candidates: tuple[RemoteStatus, ...] = ()
        if submitted_after is not None:
            try:
                facts = self.server_facts()
                if facts.can_list:
                    candidates = tuple(
                        status
                        for status in self.list_tasks_all(session_ref=session_ref)
                        if status.created_at is None
                        or status.created_at.tzinfo is None
                        or status.created_at >= submitted_after
                    )
            except AdapterError as exc:
                detail += f"; listing candidates failed: {exc}"
        del tool
        return LookupResult(proof="unprovable", ref=None, detail=detail, candidates=candidates)

    def list_tasks(self, cursor: str | None = None, *, session_ref: str | None = None) -> TaskPage:
        """One ``tasks/list`` page, on ``session_ref`` (or the current session).

        Raises:
            Rejected: the server does not declare ``tasks.list``.
            NotFound: the session is gone. Transient, RateLimited, ProtocolViolation.
        """
        facts = self.server_facts()
        if not facts.can_list:
            raise Rejected(f"server {self.name!r} does not declare tasks/list")
        session = (
            Session(session_id=session_ref, protocol_version=facts.protocol_version)
            if session_ref is not None
            else self._current_session()
        )
        params: dict[str, Any] = {"cursor": cursor} if cursor else {}
        try:
            exchange = self._client.request("tasks/list", params, session=session, idempotent=True)
        except SessionGone as exc:
            self._session_gone(session)
            raise NotFound(str(exc), session_gone=True) from exc
        return parse_task_page(self._result_of("tasks/list", exchange))

    def list_tasks_all(self, *, session_ref: str | None = None) -> list[RemoteStatus]:
        tasks: list[RemoteStatus] = []
        cursor: str | None = None
        for _ in range(self._config.limits.max_pages):
            page = self.list_tasks(cursor, session_ref=session_ref)
            tasks.extend(page.tasks)
            cursor = page.next_cursor
            if cursor is None:
                return tasks
        raise ProtocolViolation(
            f"server {self.name!r}: tasks/list has more than {self._config.limits.max_pages} pages"
        )

    # -- follow a task -----------------------------------------------------------------------------

    def _task_request(self, method: str, remote: RemoteRef, *, idempotent: bool, **kwargs: Any) -> Exchange:
        session = self._stored_session(remote)
        try:
            return self._client.request(
                method, {"taskId": remote.remote_id}, session=session, idempotent=idempotent, **kwargs
            )
        except SessionGone as exc:
            self._session_gone(session)
            raise NotFound(
                f"server {self.name!r}: {method} {remote.remote_id}: session {remote.session_ref} is gone",
                session_gone=True,
            ) from exc

    def get(self, remote: RemoteRef, *, read_input: bool = True) -> RemoteStatus:
        """Poll the task (``tasks/get``). On ``input_required`` (and ``read_input``), also read the
        server's input request from the ``tasks/result`` stream, waiting at most ``timeouts.input_wait``.

        Raises:
            NotFound: unknown, expired, or its session is gone (-32602 / HTTP 404).
            Transient, RateLimited, Rejected, ProtocolViolation.
        """
        exchange = self._task_request("tasks/get", remote, idempotent=True)
        status = parse_task(self._result_of("tasks/get", exchange), expected_id=remote.remote_id)
        if status.server_state == "input_required" and read_input:
            try:
                request = self.read_input_request(
                    remote, json_first=exchange.content_type == "application/json"
                )
            except Transient:
                # The status itself was read; the input request is read again on the next poll.
                request = None
            if request is not None:
                status = replace(status, input_request=request)
        return status

    def read_input_request(self, remote: RemoteRef, *, json_first: bool = False) -> InputRequest | None:
        """Read the server's pending input request for this task; None when none arrives in time.

        Servers deliver it on the SSE stream of ``tasks/result`` (mcp SDKs) or, answering in JSON mode, on
        the session's GET stream; both are tried, each for at most ``timeouts.input_wait``, the GET
        stream first when the server answers in JSON (``json_first``).
        """
        readers = [self._input_from_result_stream, self._input_from_get_stream]
        if json_first:
            readers.reverse()
        for reader in readers:
            request = reader(remote)
            if request is not None:
                return request
        return None

    def _input_from_result_stream(self, remote: RemoteRef) -> InputRequest | None:
        task_id = remote.remote_id

        def is_input(message: Message) -> bool:
            return isinstance(message, Request) and parse_input_request(message, task_id=task_id) is not None

        exchange = self._task_request(
            "tasks/result",
            remote,
            idempotent=True,
            read_timeout=self._config.timeouts.input_wait,
            until=is_input,
            patient=True,
        )
        return _first_input(exchange, task_id)

    def _input_from_get_stream(self, remote: RemoteRef) -> InputRequest | None:
        if remote.session_ref is None:
            return None
        task_id = remote.remote_id
        session = self._stored_session(remote)

        def is_input(message: Message) -> bool:
            if not isinstance(message, Request):
                return False
            meta = message.params.get("_meta")
            related = meta.get(RELATED_TASK) if isinstance(meta, Mapping) else None
            # On the GET stream only an explicit related-task _meta ties a request to this task.
            return isinstance(related, Mapping) and parse_input_request(message, task_id=task_id) is not None

        try:
            exchange = self._client.listen(
                session=session, wait_s=self._config.timeouts.input_wait, until=is_input
            )
        except SessionGone as exc:
            self._session_gone(session)
            raise NotFound(
                f"server {self.name!r}: GET stream for {task_id}: session {remote.session_ref} is gone",
                session_gone=True,
            ) from exc
        return _first_input(exchange, task_id)

    def result(self, remote: RemoteRef, *, status: RemoteStatus | None = None) -> RemoteResult:
        """Fetch the final result of a terminal task (``tasks/result``), verified to be this task's.

        ``status`` is the terminal status already observed; without it the adapter polls once first.

        Raises:
            ResultNotReady: the task is not terminal (``tasks/result`` would block).
            NotFound: unknown or expired. ProtocolViolation: another task's result, or malformed.
            Transient, RateLimited, Rejected.
        """
        if status is None:
            status = self.get(remote, read_input=False)
        if status.remote_id != remote.remote_id:
            raise ValueError(f"status of {status.remote_id} given for {remote.remote_id}")
        if status.terminal is None:
            retry = status.poll_interval_ms / 1000 if status.poll_interval_ms is not None else None
            raise ResultNotReady(
                f"task {remote.remote_id} is {status.server_state}, not terminal", retry_after=retry
            )
        exchange = self._task_request("tasks/result", remote, idempotent=True)
        response = exchange.response
        if isinstance(response, ErrorResponse):
            # A cancelled task has no defined result: servers answer an empty result, -32603 or -32602.
            # For a failed task, -32602 may be the call's own invalid-params error rather than "task
            # unknown": the task still being there tells them apart.
            if (
                response.code == _INVALID_PARAMS
                and status.terminal != "cancelled"
                and (status.terminal != "failed" or not self._still_there(remote))
            ):
                raise rpc_error("tasks/result", response, server=self.name)
            return result_from_error(response, server_state=status.server_state)
        if not isinstance(response, Response):
            raise ProtocolViolation(f"server {self.name!r}: tasks/result answered nothing")
        payload, verified = strip_related_task(response.result, task_id=remote.remote_id)
        outcome = result_from_payload(
            payload, server_state=status.server_state, status_message=status.status_message
        )
        return replace(outcome, task_verified=verified)

    def _still_there(self, remote: RemoteRef) -> bool:
        try:
            self.get(remote, read_input=False)
        except NotFound:
            return False
        return True

    def cancel(self, remote: RemoteRef) -> CancelOutcome:
        """Ask the server to cancel (``tasks/cancel``), after one ``tasks/get`` that skips the request when
        the task is terminal already.

        A success answer is the evidence of the cancelled terminal state. ``-32602`` means already
        terminal (or gone): the outcome says so and the caller reads the state with ``get``.

        Raises:
            OutcomeUnknown: the request may have cancelled the task; read the state with ``get``.
            NotFound: the session is gone. Rejected: the server does not implement tasks/cancel.
            Transient, RateLimited, ProtocolViolation.
        """
        observed = self.get(remote, read_input=False)
        if observed.terminal is not None:
            # Already terminal: never send a cancel a lenient server might answer with "cancelled".
            return CancelOutcome(kind="already_terminal", status=observed, message=observed.status_message)
        with _unreadable_answer_is_unknown(f"server {self.name!r}: tasks/cancel {remote.remote_id}"):
            exchange = self._task_request("tasks/cancel", remote, idempotent=False)
            response = exchange.response
            if isinstance(response, ErrorResponse) and response.code == _INVALID_PARAMS:
                return CancelOutcome(kind="already_terminal", status=None, message=response.message)
            status = parse_task(self._result_of("tasks/cancel", exchange), expected_id=remote.remote_id)
        if status.server_state == "cancelled":
            return CancelOutcome(kind="cancelled", status=status, message=status.status_message)
        return CancelOutcome(kind="already_terminal", status=status, message=status.status_message)

    def reply_input(self, remote: RemoteRef, request: InputRequest, response: Mapping[str, Any]) -> None:
        """Answer the server's input request with a separate POST (202 = accepted, nothing more).

        Raises:
            NotFound: the session is gone. OutcomeUnknown: the reply may or may not have arrived.
            Rejected, Transient, RateLimited.
        """
        if request.task_id != remote.remote_id:
            raise ValueError(f"input request of task {request.task_id} answered for {remote.remote_id}")
        session = self._stored_session(remote)
        try:
            self._client.post_message(input_reply(request, response), session=session, what=request.method)
        except SessionGone as exc:
            self._session_gone(session)
            raise NotFound(
                f"server {self.name!r}: reply to {request.method} for {remote.remote_id}: session gone",
                session_gone=True,
            ) from exc
