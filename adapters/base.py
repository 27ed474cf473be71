"""The one small interface every protocol adapter implements, and the typed values it speaks.

All values are frozen dataclasses. Those the ledger stores and a *different* worker process reads back
(:class:`RemoteRef`, :class:`InputRequest`) round-trip through plain JSON with ``to_json``/``from_json``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, Protocol, runtime_checkable

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "ENVELOPE_MARGIN_BYTES",
    "UNMETERED",
    "AdapterConfig",
    "CancelOutcome",
    "Created",
    "ErrorInfo",
    "InputRequest",
    "Limits",
    "LookupResult",
    "RemoteRef",
    "RemoteResult",
    "RemoteStatus",
    "RequestBudget",
    "TaskSupport",
    "TerminalKind",
    "Timeouts",
    "ToolAdapter",
    "ToolCapabilities",
    "ToolRoute",
    "answer_cap",
]

TerminalKind = Literal["completed", "failed", "cancelled"]
TaskSupport = Literal["forbidden", "optional", "required"]
JsonObject = Mapping[str, Any]


def _require_str(data: Mapping[str, object], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key!r} must be a non-empty string, got {value!r}")
    return value


def _optional_str(data: Mapping[str, object], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string or null, got {value!r}")
    return value


@dataclass(frozen=True)
class RemoteRef:
    """Everything another worker process needs to resume an operation on the server.

    ``session_ref`` is the MCP session id a stateful server bound the task to (None when stateless);
    ``protocol_version`` the version negotiated on that session.
    """

    remote_id: str
    session_ref: str | None
    protocol_version: str
    protocol: str = "mcp"

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "protocol_version": self.protocol_version,
            "remote_id": self.remote_id,
            "session_ref": self.session_ref,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> RemoteRef:
        """Rebuild a reference stored by :meth:`to_json`.

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        return cls(
            remote_id=_require_str(data, "remote_id"),
            session_ref=_optional_str(data, "session_ref"),
            protocol_version=_require_str(data, "protocol_version"),
            protocol=_require_str(data, "protocol"),
        )


@dataclass(frozen=True)
class InputRequest:
    """A server's request for input tied to one task (``elicitation/create``, ``sampling/createMessage``).

    ``params`` are the request params exactly as sent (``_meta`` included); ``request_id`` must be echoed
    exactly in the reply (it may be a string or a number); ``schema`` is the elicitation's
    ``requestedSchema`` (None for sampling).
    """

    request_id: str | int
    method: str
    params: JsonObject
    schema: JsonObject | None
    task_id: str

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "params": dict(self.params),
            "request_id": self.request_id,
            "schema": None if self.schema is None else dict(self.schema),
            "task_id": self.task_id,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> InputRequest:
        """Rebuild a request stored by :meth:`to_json`.

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        request_id = data.get("request_id")
        if isinstance(request_id, bool) or not isinstance(request_id, str | int):
            raise ValueError(f"'request_id' must be a string or an integer, got {request_id!r}")  # noqa: TRY004
        params = data.get("params")
        if not isinstance(params, Mapping):
            raise ValueError(f"'params' must be an object, got {params!r}")  # noqa: TRY004
        schema = data.get("schema")
        if schema is not None and not isinstance(schema, Mapping):
            raise ValueError(f"'schema' must be an object or null, got {schema!r}")
        return cls(
            request_id=request_id,
            method=_require_str(data, "method"),
            params=dict(params),
            schema=None if schema is None else dict(schema),
            task_id=_require_str(data, "task_id"),
        )


@dataclass(frozen=True)
class RemoteStatus:
    """One observation of a remote task. ``server_state`` is the server's own word, verbatim.

    ``input_request`` is the server's question when the task waits for input and the question was read.
    ``awaiting_input`` says the server waits for input but its question is not in this status (it was
    not asked for, or could not be read yet): look again soon rather than at the usual interval.
    """

    remote_id: str
    server_state: str
    terminal: TerminalKind | None
    status_message: str | None
    poll_interval_ms: int | None
    ttl_ms: int | None
    created_at: datetime | None
    last_updated_at: datetime | None
    input_request: InputRequest | None = None
    awaiting_input: bool = False
    raw: JsonObject = field(default_factory=dict, compare=False, repr=False)
    #: The final result when the protocol carries it in the status itself (an AIP-151 done Operation): the
    #: result fetch then reads it from here and sends no request.
    result: RemoteResult | None = None


@dataclass(frozen=True)
class ErrorInfo:
    """Why a tool call failed: a JSON-RPC error (``code`` set) or the server's status message."""

    message: str
    code: int | None = None
    data: Any = None


@dataclass(frozen=True)
class RemoteResult:
    """The final outcome of a tool call, transport metadata stripped.

    ``outcome`` is what longcall accepts: a tool result with ``isError: true`` is ``failed`` even when the
    server reported ``completed``. ``server_state`` is the status the server reported (None for a
    synchronous call). ``payload`` is the ``CallToolResult`` without the related-task ``_meta``.
    ``task_verified`` is False when the server left out the related-task ``_meta`` that proves the result
    is this task's (it is still bound by the request's own task id); keep it in the audit.
    """

    outcome: TerminalKind
    server_state: str | None
    payload: JsonObject
    is_error: bool
    error: ErrorInfo | None = None
    task_verified: bool = True


@dataclass(frozen=True)
class Created:
    """The answer to ``create``: a task to follow (``ref`` + first ``status``), or, when the tool ran
    without a task, its final ``sync_result``."""

    ref: RemoteRef | None
    status: RemoteStatus | None
    sync_result: RemoteResult | None = None
    immediate_response: str | None = None

    @property
    def is_task(self) -> bool:
        return self.ref is not None


@dataclass(frozen=True)
class CancelOutcome:
    """``cancelled``: the server's success answer is the evidence of the cancelled terminal state.

    ``already_terminal``: the server refused because the task is terminal already (or gone). The caller
    must read the existing terminal state with ``get`` and never rewrite it to cancelled.

    ``acknowledged``: the server took the request and promised nothing (AIP-151 ``CancelOperation``
    answers ``Empty``; the MCP tasks extension's cancel is cooperative): the outcome is learned by
    polling, and a completion may still win.
    """

    kind: Literal["cancelled", "already_terminal", "acknowledged"]
    status: RemoteStatus | None
    message: str | None = None


@dataclass(frozen=True)
class ToolCapabilities:
    """What the server and the tool declared, at the adapter's fixed protocol version."""

    server: str
    tool: str
    protocol_version: str
    server_task_calls: bool
    task_support: TaskSupport
    can_list: bool
    can_cancel: bool
    descriptor_digest: str

    @property
    def use_task(self) -> bool:
        """True when a task-augmented call is allowed: declared by the server and by the tool."""
        return self.server_task_calls and self.task_support != "forbidden"


@dataclass(frozen=True)
class LookupResult:
    """The answer to "did the server create an operation for this submission key?".

    ``proof`` is ``found`` (``ref`` set), ``never_created`` (the server proved it), or ``unprovable``.
    Only ``never_created`` allows a resubmission. ``candidates`` are tasks an operator may look at; they
    are never proof.
    """

    proof: Literal["found", "never_created", "unprovable"]
    ref: RemoteRef | None
    detail: str
    candidates: tuple[RemoteStatus, ...] = ()


@dataclass(frozen=True)
class Timeouts:
    """Per-phase HTTP timeouts in seconds. ``read`` bounds each wait for bytes and the whole answer;
    ``input_wait`` bounds how long ``get`` listens for a server's input request."""

    connect: float = 5.0
    read: float = 30.0
    write: float = 10.0
    pool: float = 5.0
    input_wait: float = 5.0


#: The largest result accepted by default, in bytes of canonical JSON: the default of the fleet's
#: ``max_result_bytes`` (``LONGCALL_MAX_RESULT_BYTES``), which the transport's cap is derived from.
DEFAULT_MAX_RESULT_BYTES: Final = 8 * 1024 * 1024
#: What one answer may carry besides its result, over ``max_result_bytes``: the JSON-RPC envelope and the
#: related-task ``_meta``, SSE framing (``event:``/``id:``/``data:`` lines, a priming event), the
#: notifications and server requests a stream carries before its response, an HTTP body's own spacing.
#: A few hundred bytes in practice; 256 KiB leaves room for a stream's other messages too.
ENVELOPE_MARGIN_BYTES: Final = 256 * 1024


def answer_cap(max_result_bytes: int) -> int:
    """The transport's cap on one answer for results of at most ``max_result_bytes``: the two limits are
    one, so every result the fleet can store can be read, and an answer over the cap is a result too large
    to store (RESULT_UNSTORABLE) whatever the protocol."""
    return max_result_bytes + ENVELOPE_MARGIN_BYTES


@dataclass(frozen=True)
class Limits:
    """``max_body_bytes`` caps any one HTTP answer (JSON body or SSE stream, resumptions included; an
    error answer's body is read only up to its first 64 KiB): derived from ``max_result_bytes`` with
    :func:`answer_cap` (:meth:`for_results`); ``max_pages`` caps paginated listings; ``max_resumptions``
    caps how often an SSE stream that closed before its response is resumed with ``Last-Event-ID``;
    ``tool_list_max_age_s`` is how long a tool list (and so a descriptor digest) is reused before it is
    read again."""

    max_body_bytes: int = answer_cap(DEFAULT_MAX_RESULT_BYTES)
    max_pages: int = 50
    max_resumptions: int = 3
    tool_list_max_age_s: float = 300.0

    @classmethod
    def for_results(cls, max_result_bytes: int) -> Limits:
        """The limits of a fleet whose results may be ``max_result_bytes`` long (the others' defaults)."""
        return cls(max_body_bytes=answer_cap(max_result_bytes))


@dataclass(frozen=True)
class ToolRoute:
    """How one tool is started on a server whose protocol has no tool discovery (AIP-151).

    ``create``: ``"METHOD /path/{placeholder}"``; each ``{placeholder}`` is filled from the argument of
    that name, the remaining arguments are the JSON body. ``request_id_field``: the body field that
    carries the submission key (AIP-155 ``request_id``)."""

    create: str | None = None
    request_id_field: str | None = None


@dataclass(frozen=True)
class AdapterConfig:
    """Plain values an adapter is built from. The bearer token is a value, or ``token_provider``: called
    before every request (a rotated token is used from the next request on); the adapter never looks
    the environment up itself. ``url`` may carry ``user:password``: the adapter sends it as HTTP basic
    auth (unless a bearer token is set) and never shows it (see :func:`redact_url`)."""

    name: str
    url: str
    protocol: str
    protocol_version: str
    bearer_token: str | None = field(default=None, repr=False)
    token_provider: Callable[[], str | None] | None = field(default=None, repr=False)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    #: Per-tool routes, for protocols that are told how to start a tool (AIP-151); empty for MCP.
    tools: Mapping[str, ToolRoute] = field(default_factory=dict)


def redact_url(url: str) -> str:
    """``url`` as it may be shown (errors, events, logs): a password in it replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _password = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}{slash}{path}"


class RequestBudget(Protocol):
    """What every HTTP request an adapter sends is charged to (DESIGN rule 4: the server's poll or
    control bucket, chosen by the step that calls the adapter)."""

    def charge(self) -> None:
        """Called once before every HTTP request the adapter sends; it may raise to refuse, and the
        exception propagates unchanged, nothing is sent."""


class _Unmetered:
    def charge(self) -> None:
        return None

    def __repr__(self) -> str:
        return "UNMETERED"


#: The budget that charges nothing: the default of every :class:`ToolAdapter` method.
UNMETERED: Final[RequestBudget] = _Unmetered()


@runtime_checkable
class ToolAdapter(Protocol):
    """One protocol version's client. Every method maps failures to :mod:`adapters.errors`.

    Every method that talks to the server takes ``budget``, charged once before each HTTP request it
    sends. A refusal (an exception from ``budget.charge()``) leaves the method at once, unchanged and
    unmapped, with that request unsent and no half-made state behind it: whatever was sent before it
    has been read through. Only where leaving would hide that a request with an effect went out does
    the adapter answer for it instead (for MCP, see :mod:`adapters.mcp_2025_11_25.adapter`).
    """

    @property
    def name(self) -> str: ...

    @property
    def protocol(self) -> str: ...

    @property
    def protocol_version(self) -> str: ...

    @property
    def adapter_version(self) -> str: ...

    def capabilities(self, tool: str, *, budget: RequestBudget = UNMETERED) -> ToolCapabilities: ...

    def create(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        submission_key: str,
        ttl_ms: int,
        sync_upper_bound_s: float | None = None,
        budget: RequestBudget = UNMETERED,
    ) -> Created: ...

    def lookup_by_key(
        self,
        submission_key: str,
        *,
        tool: str | None = None,
        submitted_after: datetime | None = None,
        arguments: Mapping[str, Any] | None = None,
        budget: RequestBudget = UNMETERED,
    ) -> LookupResult:
        """``arguments``: the call's arguments as submitted, for a protocol whose lookup is the create
        repeated with the same key (AIP-155); ignored by the others."""
        ...

    def get(
        self, remote: RemoteRef, *, read_input: bool = True, budget: RequestBudget = UNMETERED
    ) -> RemoteStatus: ...

    def result(
        self, remote: RemoteRef, *, status: RemoteStatus | None = None, budget: RequestBudget = UNMETERED
    ) -> RemoteResult: ...

    def cancel(
        self, remote: RemoteRef, *, budget: RequestBudget = UNMETERED, read_status_first: bool = False
    ) -> CancelOutcome:
        """Ask the server to cancel. ``read_status_first``: read the status first and send no cancel for a
        task already terminal (for a server that would answer "cancelled" for a completed task)."""
        ...

    def reply_input(
        self,
        remote: RemoteRef,
        request: InputRequest,
        response: Mapping[str, Any],
        *,
        budget: RequestBudget = UNMETERED,
    ) -> None: ...

    def check_reply(self, request: InputRequest, response: Mapping[str, Any]) -> str | None:
        """Why ``response`` cannot answer ``request`` (e.g. it does not match the requested schema), or
        None when it can. Pure: nothing is sent."""
