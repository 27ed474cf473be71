"""JSON-RPC 2.0 messages and the pure half of Streamable HTTP: what an HTTP answer means.

Nothing here does I/O. :func:`classify_http_status` turns a non-200 answer into the package's error
tree; :func:`parse_retry_after` reads both Retry-After forms; :func:`parse_message` classifies one
decoded JSON value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from adapters.errors import (
    AdapterError,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    TooManyRequests,
    Transient,
    Unauthorized,
)

__all__ = [
    "ErrorResponse",
    "Message",
    "Notification",
    "Request",
    "Response",
    "classify_http_status",
    "decode_json",
    "parse_message",
    "parse_messages",
    "parse_retry_after",
]

RequestId = str | int


@dataclass(frozen=True)
class Request:
    """A request the *server* sent us (e.g. ``elicitation/create``)."""

    id: RequestId
    method: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Notification:
    method: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Response:
    id: RequestId
    result: Mapping[str, Any]


@dataclass(frozen=True)
class ErrorResponse:
    id: RequestId | None
    code: int
    message: str
    data: Any = None


Message = Request | Notification | Response | ErrorResponse


def _valid_id(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def parse_message(value: object) -> Message:
    """Classify one JSON value as a JSON-RPC message.

    Raises:
        ProtocolViolation: it is not a JSON-RPC 2.0 message.
    """
    if not isinstance(value, Mapping) or value.get("jsonrpc") != "2.0":
        raise ProtocolViolation(f"not a JSON-RPC 2.0 message: {str(value)[:200]}")
    method = value.get("method")
    if method is not None:
        if not isinstance(method, str):
            raise ProtocolViolation(f"JSON-RPC method must be a string: {method!r}")
        params = value.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise ProtocolViolation(f"params of {method} must be an object")
        if "id" in value:
            if not _valid_id(value["id"]):
                raise ProtocolViolation(f"bad request id {value['id']!r}")
            return Request(id=value["id"], method=method, params=params)
        return Notification(method=method, params=params)
    if "error" in value:
        error = value["error"]
        if not isinstance(error, Mapping):
            raise ProtocolViolation("JSON-RPC error must be an object")
        code = error.get("code")
        message = error.get("message", "")
        if not isinstance(code, int) or isinstance(code, bool) or not isinstance(message, str):
            raise ProtocolViolation(f"malformed JSON-RPC error: {str(error)[:200]}")
        raw_id = value.get("id")
        return ErrorResponse(
            id=raw_id if _valid_id(raw_id) else None, code=code, message=message, data=error.get("data")
        )
    if "result" in value:
        if not _valid_id(value.get("id")):
            raise ProtocolViolation(f"response without a valid id: {value.get('id')!r}")
        result = value["result"]
        if not isinstance(result, Mapping):
            raise ProtocolViolation("JSON-RPC result must be an object")
        return Response(id=value["id"], result=result)
    raise ProtocolViolation("JSON-RPC message is neither request, notification nor response")


def decode_json(text: str | bytes) -> object:
    """Decode JSON text.

    Raises:
        ProtocolViolation: it is not valid JSON.
    """
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolViolation(f"invalid JSON: {exc}") from exc


def parse_messages(value: object) -> list[Message]:
    """One JSON body: a single message or a batch (a list) of them."""
    if isinstance(value, list):
        return [parse_message(item) for item in value]
    return [parse_message(value)]


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP-date. None if absent or bad."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    current = now if now is not None else datetime.now(UTC)
    return max(0.0, (when - current).total_seconds())


def _body_message(body: bytes) -> tuple[str, int | None]:
    """The error text (and JSON-RPC code) a server put in an HTTP error body, if any."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        text = body.decode("utf-8", errors="replace").strip()
        return text[:500], None
    if isinstance(value, Mapping) and isinstance(value.get("error"), Mapping):
        error = value["error"]
        code = error.get("code")
        message = error.get("message")
        return (
            str(message) if message is not None else "",
            code if isinstance(code, int) and not isinstance(code, bool) else None,
        )
    return json.dumps(value)[:500], None


def classify_http_status(
    status: int,
    *,
    headers: Mapping[str, str],
    body: bytes,
    idempotent: bool,
    now: datetime | None = None,
) -> AdapterError:
    """The error a non-success HTTP answer to a JSON-RPC POST means.

    404 (a gone session) is not handled here: the client re-initializes first. Only a 429 proves that
    the server did no work (:class:`TooManyRequests`). For a request with an effect (``idempotent`` False:
    a create, a cancel, a reply) a 408 and every 5xx, 503 included, are :class:`OutcomeUnknown` — a
    gateway may answer them after the origin did the work (DESIGN rule 1); for a read, 503 is
    :class:`RateLimited` and the others are :class:`Transient`. The server's Retry-After is kept on all.
    """
    message, code = _body_message(body)
    described = f"HTTP {status}" + (f": {message}" if message else "")
    retry_after = parse_retry_after(headers.get("retry-after"), now=now)
    if status == 429:
        return TooManyRequests(described, retry_after=retry_after)
    if status == 408 or status >= 500:
        if not idempotent:
            return OutcomeUnknown(f"may have reached the server, {described}", retry_after=retry_after)
        if status == 503:
            return RateLimited(described, retry_after=retry_after)
        return Transient(described, retry_after=retry_after)
    if status in (401, 403):
        return Unauthorized(
            described, code=code, http_status=status, challenge=headers.get("www-authenticate")
        )
    if 400 <= status < 500:
        return Rejected(described, code=code, http_status=status)
    return ProtocolViolation(f"unexpected {described}")
