"""AIP-151 (``google.longrunning``) over REST/JSON on the wire: pure functions, no I/O.

An ``Operation`` has five fields (``name``, ``metadata``, ``done``, and ``oneof result {error, response}``)
and nothing else: no state enum, no poll hint, no TTL. ``done`` is omitted while running (proto3 JSON
drops default scalars). ``metadata`` and ``response`` are ``Any`` values, kept as the JSON the server
sent (an unknown ``@type`` included, and both shapes of ``google.protobuf.Empty``): nothing here needs a
descriptor. Errors come in two envelopes, AIP-193's ``{"error": {code, status, message, details}}`` (code:
the HTTP status) and grpc-gateway's bare ``{"code": 5, "message": ...}`` (code: the gRPC code).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from adapters.base import ErrorInfo, RemoteResult, RemoteStatus, TerminalKind, ToolRoute
from adapters.errors import (
    AdapterError,
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    TooManyRequests,
    Transient,
    Unauthorized,
)
from adapters.jsonrpc import parse_retry_after

__all__ = [
    "ADAPTER_VERSION",
    "CANCELLED",
    "GRPC_CODES",
    "PLACEHOLDER",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "CreateRequest",
    "RpcError",
    "StatusNotFound",
    "build_create",
    "classify_error",
    "is_status_not_found",
    "operation_path",
    "parse_duration",
    "parse_error_body",
    "parse_operation",
    "parse_operation_page",
    "route_digest",
]

PROTOCOL: Final = "aip151"
PROTOCOL_VERSION: Final = "v1"
ADAPTER_VERSION: Final = "aip151-v1/1"

#: google.rpc.Code by number (code.proto).
GRPC_CODES: Final[Mapping[int, str]] = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}
_CODE_BY_NAME: Final = {name: code for code, name in GRPC_CODES.items()}
#: The HTTP status code.proto maps each gRPC code to, for an envelope that gives only the gRPC code.
_HTTP_OF: Final[Mapping[str, int]] = {
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
    "UNAUTHENTICATED": 401,
}
CANCELLED: Final = 1
_RETRY_INFO: Final = "type.googleapis.com/google.rpc.RetryInfo"
_CREATE: Final = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) (/\S*)$")
#: A ``{placeholder}`` of a create route, filled from the argument of that name.
PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DURATION: Final = re.compile(r"^(\d+(?:\.\d{1,9})?)s$")
#: What an operation name may hold: a resource path, its segments URL-safe (RFC 3986 unreserved, "@" and
#: ":"; e.g. the Spanner emulator's ``.../operations/_auto_op_1a2b``) and never "." or "..".
_NAME_SEGMENT: Final = re.compile(r"^[A-Za-z0-9_.~@:-]+$")


# --------------------------------------------------------------------------------------- operations


def operation_path(name: str) -> str:
    """The URL path of an operation by its ``name`` (``/v1/{name}``, DESIGN §7), checked to be a relative
    resource path: a name that could leave ``/v1/`` or carry a query is refused, never followed.

    Raises:
        ProtocolViolation: the name is empty, absolute, or has an empty, ``.``/``..`` or unsafe segment.
    """
    segments = name.split("/")
    if not name or any(s in ("", ".", "..") or not _NAME_SEGMENT.match(s) for s in segments):
        raise ProtocolViolation(f"operation name {name!r} is not a resource path")
    return "/v1/" + "/".join(quote(s, safe="@:-._~") for s in segments)


def parse_operation(value: object, *, server: str, expected_name: str | None = None) -> RemoteStatus:
    """A ``google.longrunning.Operation`` as JSON, as one status observation.

    The terminal kind: ``response`` -> completed; ``error`` with code 1 -> cancelled; any other ``error``
    -> failed; ``done`` with neither -> **completed** with no response (the current operations.proto:
    "Some services might not provide the result"; an operation that ended without an error did not fail;
    the receipt's result is the done Operation, where the missing ``response`` shows). ``server_state``
    keeps the protocol's words: ``done=false``, ``done=true response``, ``done=true error CANCELLED``
    (the code's name), ``done=true neither``. ``raw`` is the Operation as sent; ``result`` the final
    result when done (the Operation itself, see :func:`_result`).

    Raises:
        ProtocolViolation: not an Operation (wrong types, both ``error`` and ``response``, a result on an
            operation not done, a name that is not a resource path, or another operation's name).
    """
    if not isinstance(value, Mapping):
        raise ProtocolViolation(f"server {server!r}: an Operation must be a JSON object, got {value!r:.200}")
    name = value.get("name", "")
    done = value.get("done", False)
    if not isinstance(name, str) or not isinstance(done, bool):
        raise ProtocolViolation(f"server {server!r}: Operation name/done of the wrong type: {value!r:.200}")
    error, response = value.get("error"), value.get("response")
    if error is not None and response is not None:
        raise ProtocolViolation(f"server {server!r}: Operation {name!r} has both error and response")
    if not done and (error is not None or response is not None):
        raise ProtocolViolation(f"server {server!r}: Operation {name!r} has a result but is not done")
    if response is not None and not isinstance(response, Mapping):
        raise ProtocolViolation(f"server {server!r}: Operation {name!r}: response is not an Any object")
    if name:
        operation_path(name)
    elif not done:
        raise ProtocolViolation(f"server {server!r}: a running Operation without a name cannot be followed")
    if expected_name is not None and name and name != expected_name:
        raise ProtocolViolation(f"server {server!r}: asked for {expected_name!r}, answered {name!r}")
    if expected_name is not None and not name:
        name = expected_name  # the answer to GetOperation(name) is that operation, its name left out
    raw = dict(value)
    if not done:
        return _status(name or "", "done=false", None, None, raw, result=None)
    if error is not None:
        status = _status_error(error, server=server, name=name)
        kind: TerminalKind = "cancelled" if status.code == CANCELLED else "failed"
        state = f"done=true error {GRPC_CODES.get(status.code, str(status.code))}"
        return _status(
            name, state, kind, status.message or None, raw, result=_result(raw, kind, state, status)
        )
    state = "done=true response" if response is not None else "done=true neither"
    return _status(name, state, "completed", None, raw, result=_result(raw, "completed", state, None))


@dataclass(frozen=True)
class RpcError:
    """A ``google.rpc.Status``: the gRPC ``code``, its name, the message and the details as sent."""

    code: int
    status: str
    message: str
    details: tuple[Any, ...] = ()

    @property
    def retry_delay_s(self) -> float | None:
        """``RetryInfo.retryDelay`` from the details, in seconds (None when absent or unreadable)."""
        for detail in self.details:
            if isinstance(detail, Mapping) and detail.get("@type") == _RETRY_INFO:
                return parse_duration(detail.get("retryDelay"))
        return None


def _status_error(error: object, *, server: str, name: str) -> RpcError:
    if not isinstance(error, Mapping):
        raise ProtocolViolation(f"server {server!r}: Operation {name!r}: error is not a google.rpc.Status")
    code = error.get("code", 0)
    message = error.get("message", "")
    details = error.get("details", [])
    if isinstance(code, bool) or not isinstance(code, int) or not isinstance(message, str):
        raise ProtocolViolation(f"server {server!r}: Operation {name!r}: malformed error {error!r:.200}")
    if not isinstance(details, list):
        raise ProtocolViolation(f"server {server!r}: Operation {name!r}: error details are not a list")
    return RpcError(code, GRPC_CODES.get(code, str(code)), message, tuple(details))


def _status(
    name: str,
    state: str,
    terminal: TerminalKind | None,
    message: str | None,
    raw: dict[str, Any],
    *,
    result: RemoteResult | None,
) -> RemoteStatus:
    return RemoteStatus(
        remote_id=name,
        server_state=state,
        terminal=terminal,
        status_message=message,
        poll_interval_ms=None,  # AIP-151 has no poll hint on the wire: the server's configured default
        ttl_ms=None,  # nor a TTL: expiry counts from completion and is unknown to the client
        created_at=None,
        last_updated_at=None,
        raw=raw,
        result=result,
    )


def _result(raw: dict[str, Any], kind: TerminalKind, state: str, error: RpcError | None) -> RemoteResult:
    """The result of a done operation is the done Operation itself (as sent; ``Any`` values kept as JSON).
    A failure also carries the error as :class:`ErrorInfo` (``code``: the gRPC code, ``data``: details)."""
    info = None
    if error is not None:
        info = ErrorInfo(message=error.message or error.status, code=error.code, data=list(error.details))
    return RemoteResult(outcome=kind, server_state=state, payload=raw, is_error=kind == "failed", error=info)


def parse_operation_page(value: object, *, server: str) -> tuple[list[RemoteStatus], str | None]:
    """A ``ListOperationsResponse``: its operations and ``nextPageToken`` (None when there is no next page).

    Raises:
        ProtocolViolation: not a ListOperationsResponse.
    """
    if not isinstance(value, Mapping):
        raise ProtocolViolation(f"server {server!r}: ListOperationsResponse must be a JSON object")
    operations = value.get("operations", [])
    token = value.get("nextPageToken", "")
    if not isinstance(operations, list) or not isinstance(token, str):
        raise ProtocolViolation(f"server {server!r}: malformed ListOperationsResponse {value!r:.200}")
    return [parse_operation(op, server=server) for op in operations], token or None


# ------------------------------------------------------------------------------------------- errors


def parse_duration(value: object) -> float | None:
    """A protobuf ``Duration`` in JSON (``"2.5s"``), in seconds; None when absent or malformed."""
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        return float(match.group(1)) if match else None
    return None


def parse_error_body(http_status: int, body: bytes) -> RpcError:
    """The error an HTTP error answer carries, from either envelope; without one, what the HTTP status
    says (``UNKNOWN`` for a status code.proto does not map)."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        value = None
    envelope = value.get("error") if isinstance(value, Mapping) else None
    if isinstance(envelope, Mapping):  # AIP-193: code is the HTTP status, status the gRPC name
        status = envelope.get("status")
        name = status if isinstance(status, str) and status in _CODE_BY_NAME else _name_of_http(http_status)
        return _rpc_error(name, envelope.get("message"), envelope.get("details"))
    if isinstance(value, Mapping) and isinstance(value.get("code"), int):  # grpc-gateway: the gRPC code
        code = value["code"]
        name = GRPC_CODES.get(code) or _name_of_http(http_status)
        return _rpc_error(name, value.get("message"), value.get("details"))
    text = body.decode("utf-8", errors="replace").strip()[:500]
    return RpcError(_CODE_BY_NAME[_name_of_http(http_status)], _name_of_http(http_status), text)


def _rpc_error(name: str, message: object, details: object) -> RpcError:
    return RpcError(
        _CODE_BY_NAME[name],
        name,
        message if isinstance(message, str) else "",
        tuple(details) if isinstance(details, list) else (),
    )


def _name_of_http(http_status: int) -> str:
    for name, status in (
        ("INVALID_ARGUMENT", 400),
        ("UNAUTHENTICATED", 401),
        ("PERMISSION_DENIED", 403),
        ("NOT_FOUND", 404),
        ("ABORTED", 409),
        ("RESOURCE_EXHAUSTED", 429),
        ("UNIMPLEMENTED", 501),
        ("UNAVAILABLE", 503),
        ("DEADLINE_EXCEEDED", 504),
    ):
        if http_status == status:
            return name
    return "INTERNAL" if http_status >= 500 else "UNKNOWN" if http_status < 400 else "FAILED_PRECONDITION"


class StatusNotFound(NotFound):
    """NOT_FOUND in the server's own words: an HTTP 404 whose body is a google.rpc.Status NOT_FOUND
    (:func:`is_status_not_found`). A plain 404 (a proxy's page, a router's, a JSON body that is no Status)
    is a :class:`NotFound` only: it says the URL was not found by whatever answered, not what the service
    holds."""

    servers_word = True


def is_status_not_found(http_status: int, body: bytes) -> bool:
    """Whether an error answer is the service's NOT_FOUND: HTTP 404 with a google.rpc.Status saying so, in
    AIP-193's envelope (``{"error": {"code": 404, "status": "NOT_FOUND", ...}}``, ``code`` the HTTP status
    when present) or grpc-gateway's bare Status (``{"code": 5, "message": ...}``, the gRPC code; the
    Spanner emulator's). Anything else, a 404 without such a body included, is not."""
    if http_status != 404:
        return False
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(value, Mapping):
        return False
    envelope = value.get("error")
    if envelope is not None:
        if not isinstance(envelope, Mapping) or envelope.get("status") != "NOT_FOUND":
            return False
        code = envelope.get("code", 404)
        return isinstance(code, int) and not isinstance(code, bool) and code == 404
    code, message = value.get("code"), value.get("message", "")
    return isinstance(code, int) and not isinstance(code, bool) and code == 5 and isinstance(message, str)


def classify_error(
    http_status: int, headers: Mapping[str, str], body: bytes, *, effect: bool, what: str
) -> tuple[RpcError, AdapterError]:
    """The error an HTTP error answer means, and the server's words.

    The wait the server asked for is the longer of ``RetryInfo.retryDelay`` and ``Retry-After``. A 429 or
    RESOURCE_EXHAUSTED proves no work was done (:class:`TooManyRequests`); NOT_FOUND is :class:`NotFound`
    (classifying it is the executor's job), :class:`StatusNotFound` when the server said it in a
    google.rpc.Status; UNIMPLEMENTED is a :class:`Rejected`; UNAVAILABLE, a 408, a
    timeout and any other 5xx decide nothing for a read (:class:`RateLimited` for UNAVAILABLE, else
    :class:`Transient`) and leave a request with an ``effect`` (a create, a cancel) unknown
    (:class:`OutcomeUnknown`: a gateway may answer so after the origin did the work). The rest refuses.
    """
    error = parse_error_body(http_status, body)
    waits = [w for w in (error.retry_delay_s, parse_retry_after(headers.get("retry-after"))) if w is not None]
    retry_after = max(waits) if waits else None
    said = f"{what}: HTTP {http_status} {error.status}" + (f": {error.message}" if error.message else "")
    name = error.status
    if http_status == 429 or name == "RESOURCE_EXHAUSTED":
        return error, TooManyRequests(said, retry_after=retry_after)
    if http_status == 404 or name == "NOT_FOUND":
        if is_status_not_found(http_status, body):
            return error, StatusNotFound(said, code=error.code)
        return error, NotFound(said, code=error.code)
    if http_status in (401, 403):  # UNAUTHENTICATED, PERMISSION_DENIED: refused before any work
        challenge = headers.get("www-authenticate")
        return error, Unauthorized(said, code=error.code, http_status=http_status, challenge=challenge)
    if http_status == 501 or name == "UNIMPLEMENTED":
        return error, Rejected(said, code=error.code, http_status=http_status, data=list(error.details))
    unavailable = http_status == 503 or name == "UNAVAILABLE"
    if unavailable or http_status == 408 or http_status >= 500 or name in ("DEADLINE_EXCEEDED", "INTERNAL"):
        if effect:
            return error, OutcomeUnknown(f"may have reached the server, {said}", retry_after=retry_after)
        if unavailable:
            return error, RateLimited(said, retry_after=retry_after)
        return error, Transient(said, retry_after=retry_after)
    return error, Rejected(said, code=error.code, http_status=http_status, data=list(error.details))


# ------------------------------------------------------------------------------------------- create


@dataclass(frozen=True)
class CreateRequest:
    """The create call of one tool, ready to send: the method, the path (placeholders filled), and the
    JSON body (GET/DELETE: the query parameters) with the submission key in ``request_id_field``."""

    method: str
    path: str
    body: dict[str, Any]


def build_create(
    tool: str, route: ToolRoute, arguments: Mapping[str, Any], submission_key: str
) -> CreateRequest:
    """Fill the route's template from ``arguments``; the rest, plus the key, is the body.

    Raises:
        Rejected: the route is not usable (no ``create``/``request_id_field``, a bad template), an argument
            a placeholder needs is missing or not a string or integer, or the arguments already carry the
            request id field (the submission key goes there, and only longcall sets it). Nothing was sent.
    """
    if route.create is None or route.request_id_field is None:
        raise Rejected(f"tool {tool!r} has no create route and request_id_field: it cannot be started")
    match = _CREATE.match(route.create)
    if match is None:
        raise Rejected(f"tool {tool!r}: create {route.create!r} is not 'METHOD /path'")
    method, template = match.groups()
    if route.request_id_field in arguments:
        raise Rejected(
            f"tool {tool!r}: the arguments carry {route.request_id_field!r}, where longcall puts the "
            f"submission key (AIP-155 request_id); leave it out"
        )
    body = dict(arguments)
    missing: list[str] = []

    def fill(found: re.Match[str]) -> str:
        key = found.group(1)
        value = body.pop(key, None)
        if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
            missing.append(key)
            return ""
        return quote(str(value), safe="@-._~")

    path = PLACEHOLDER.sub(fill, template)
    if missing:
        raise Rejected(
            f"tool {tool!r}: the path {template!r} needs the argument(s) {', '.join(sorted(missing))} "
            f"as non-empty strings or integers"
        )
    body[route.request_id_field] = submission_key
    return CreateRequest(method, path, body)


def route_digest(tool: str, route: ToolRoute) -> str:
    """A stable digest of what the configuration says about starting the tool (its descriptor version)."""
    text = json.dumps([tool, route.create, route.request_id_field], separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
