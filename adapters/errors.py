"""The adapters' one exception tree.

Every foreign exception (httpx, JSON decoding, a server's JSON-RPC error) is mapped at the edge to one
of these, with ``raise ... from``. Each class carries its retry meaning::

    AdapterError
     ├── Transient(retry_after)          retry later; nothing was decided
     │    ├── RateLimited(retry_after)   429 / 503; never a state change
     │    └── ResultNotReady             tasks/result asked before a terminal status
     ├── Rejected(code, http_status)     definitive: the server refused this request
     │    ├── WrongTaskMode              -32601 / -32600 on tools/call
     │    └── CapabilityRefused          we refuse before sending: no task support, no sync bound
     ├── NotFound(session_gone)          task unknown, expired, or its session is gone
     ├── OutcomeUnknown                  a non-idempotent request may or may not have taken effect
     ├── ProtocolViolation               malformed, oversized or mismatched answer
     └── UnknownAdapter                  no adapter registered for (protocol, protocol_version)
"""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "CapabilityRefused",
    "NotFound",
    "OutcomeUnknown",
    "ProtocolViolation",
    "RateLimited",
    "Rejected",
    "ResultNotReady",
    "Transient",
    "UnknownAdapter",
    "WrongTaskMode",
]


class AdapterError(Exception):
    """Base of every error an adapter raises."""


class Transient(AdapterError):
    """Nothing was decided; the same call may be retried, not before ``retry_after`` seconds if set."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateLimited(Transient):
    """HTTP 429 or 503. ``retry_after`` is the server's Retry-After in seconds (None when absent)."""


class ResultNotReady(Transient):
    """The task is not terminal yet, so fetching its result would block: poll again first."""


class Rejected(AdapterError):
    """A definitive refusal of this request; repeating it unchanged gives the same answer.

    ``code`` is the JSON-RPC error code when the server sent one, ``http_status`` the HTTP status when
    the refusal came from the transport (400, 401, 406, ...).
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        http_status: int | None = None,
        data: object = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status
        self.data = data


class WrongTaskMode(Rejected):
    """``tools/call`` refused for its task mode (-32601 or -32600): the tool needs, or forbids, a task."""


class CapabilityRefused(Rejected):
    """Refused before sending: the server or tool declares no task support and no sync bound was given."""


class NotFound(AdapterError):
    """The task is unknown to the server: never created here, expired and purged, or bound to a gone session.

    The adapter cannot tell those apart; classifying is the executor's job. ``session_gone`` is True when
    the server answered HTTP 404 for the MCP session itself (the adapter has already re-initialized).
    """

    def __init__(self, message: str, *, code: int | None = None, session_gone: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.session_gone = session_gone


class OutcomeUnknown(AdapterError):
    """A non-idempotent request may or may not have reached the server: do not repeat it blindly."""


class ProtocolViolation(AdapterError):
    """The answer broke the protocol: malformed, oversized, of the wrong type or about another task."""


class UnknownAdapter(AdapterError, LookupError):
    """No adapter is registered for this (protocol, protocol_version) pair."""
