"""The adapters' one exception tree.

Every foreign exception (httpx2, JSON decoding, a server's JSON-RPC error) is mapped at the edge to one
of these, with ``raise ... from``. Each class carries its retry meaning::

    AdapterError
     ├── Transient(retry_after)          retry later; nothing was decided
     │    ├── RateLimited(retry_after)   429, or 503 to a read; never a state change
     │    │    └── TooManyRequests       429: also NoWorkDone
     │    ├── NoWorkDone                 the server provably did no work for the request
     │    │    ├── NotSent               the request never left (connect / pool failure, or a step
     │    │    │    │                    before it failed)
     │    │    │    └── NoBearerToken    no bearer token could be had (a token endpoint down, a variable
     │    │    │                         not set): ``retry_after`` is the provider's backoff, not a server's
     │    │    └── TokenRenewed          401 invalid_token: the bearer token was renewed, send again
     │    ├── ResultNotReady             tasks/result asked before a terminal status
     │    └── ResultContradictsStatus    a result the observed terminal state rules out
     ├── Rejected(code, http_status)     definitive: the server refused this request
     │    ├── Unauthorized(challenge)    401: the credentials were refused (403: not allowed)
     │    ├── WrongTaskMode              -32601 / -32600 on tools/call
     │    └── CapabilityRefused          we refuse before sending: no task support, no sync bound
     ├── NotFound(session_gone)          task unknown, expired, or its session is gone
     ├── OutcomeUnknown(retry_after)     a non-idempotent request may or may not have taken effect
     ├── ProtocolViolation               malformed, oversized or mismatched answer
     │    └── AnswerTooLarge(limit)      an answer over the transport's cap (``max_result_bytes`` and its
     │                                   envelope margin): reading it again gives the same answer
     └── UnknownAdapter                  no adapter registered for (protocol, protocol_version)
"""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "AnswerTooLarge",
    "CapabilityRefused",
    "NoBearerToken",
    "NoWorkDone",
    "NotFound",
    "NotSent",
    "OutcomeUnknown",
    "ProtocolViolation",
    "RateLimited",
    "Rejected",
    "ResultContradictsStatus",
    "ResultNotReady",
    "TokenRenewed",
    "TooManyRequests",
    "Transient",
    "Unauthorized",
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
    """HTTP 429, or 503 to a request without an effect. ``retry_after`` is the server's Retry-After in
    seconds (None when absent). A 503 to a request with an effect (a create, a cancel) is
    :class:`OutcomeUnknown`: a gateway may send it after the origin did the work (DESIGN rule 1)."""


class NoWorkDone(Transient):
    """The server provably did no work for this request: it answered 429, or the request never left.

    This is the only failure after which a request with an effect (a create) may simply be sent again:
    every other failure of such a request is :class:`OutcomeUnknown` (DESIGN rule 1).
    """


class TooManyRequests(RateLimited, NoWorkDone):
    """HTTP 429: the server refused the request before doing any work."""


class NotSent(NoWorkDone):
    """The request never reached the server: the connection (or the pool) failed before it was sent, or a
    request it depends on (the handshake, the tool list) failed first."""


class NoBearerToken(NotSent):
    """No bearer token could be had for the request, so it was not sent: the token provider failed (its
    token endpoint down or refusing the client, a variable not set). ``retry_after`` is the provider's own
    backoff, not a wait the server asked for: it holds nothing for the server's other requests."""


class ResultNotReady(Transient):
    """The task is not terminal yet, so fetching its result would block: poll again first."""


class ResultContradictsStatus(Transient):
    """The result read for a terminal task contradicts its observed status: a JSON-RPC error (say -32603,
    a transient store error) for a task whose status said ``completed``. Such an answer decides nothing:
    only a ``failed`` status, or the protocol's own failure shape, makes a failed outcome. ``code`` and
    ``error_message`` are the server's words; ``observed`` is the status it contradicts."""

    def __init__(
        self, message: str, *, observed: str, code: int | None = None, error_message: str = ""
    ) -> None:
        super().__init__(message)
        self.observed = observed
        self.code = code
        self.error_message = error_message


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


class Unauthorized(Rejected):
    """HTTP 401 (or 403): the server refused the request's credentials before doing anything with it.
    ``challenge``: its ``WWW-Authenticate`` header (RFC 6750: ``error="invalid_token"`` for an expired or
    revoked token, and RFC 9728's ``resource_metadata``)."""

    def __init__(
        self, message: str, *, http_status: int, challenge: str | None, code: int | None = None
    ) -> None:
        super().__init__(message, code=code, http_status=http_status)
        self.challenge = challenge


class TokenRenewed(NoWorkDone):
    """A ``401`` refused the bearer token, and the token provider renewed it: the server did no work, and
    the request is sent again with the new token (charged to its budget again, by the step's retry). A
    fresh token refused in its turn is :class:`Unauthorized`, not this: the token is renewed once."""


class WrongTaskMode(Rejected):
    """``tools/call`` refused for its task mode (-32601 or -32600): the tool needs, or forbids, a task."""


class CapabilityRefused(Rejected):
    """Refused before sending: the server or tool declares no task support and no sync bound was given."""


class NotFound(AdapterError):
    """The task is unknown to the server: never created here, expired and purged, or bound to a gone session.

    The adapter cannot tell those apart; classifying is the executor's job. ``session_gone`` is True when
    the server answered HTTP 404 for the MCP session itself (the adapter has already re-initialized).
    ``servers_word`` is True when the server itself said the task is unknown to it (a JSON-RPC error to a
    task request, a google.rpc.Status NOT_FOUND), not a 404 from whatever stands on the way (a proxy's page,
    a wrong route) nor a session's end.
    """

    servers_word = False

    def __init__(
        self, message: str, *, code: int | None = None, session_gone: bool = False, servers_word: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.session_gone = session_gone
        self.servers_word = servers_word or type(self).servers_word


class OutcomeUnknown(AdapterError):
    """A non-idempotent request may or may not have reached the server: do not repeat it blindly.

    ``retry_after`` is the server's Retry-After when it sent one (a 503): a read that follows up on the
    request waits at least that long.
    """

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ProtocolViolation(AdapterError):
    """The answer broke the protocol: malformed, oversized, of the wrong type or about another task."""


class AnswerTooLarge(ProtocolViolation):
    """An answer larger than the transport reads (``limit`` bytes: ``Limits.max_body_bytes``, derived from
    ``max_result_bytes``): refused where that is proved, from its ``Content-Length`` before the body is read
    (``declared_bytes``), else once more than ``limit`` bytes arrived (``read_bytes``, a lower bound of its
    size). Not a failure that passes: the same request gets the same answer, so a step never reads it again
    (a result goes to an operator as RESULT_UNSTORABLE)."""

    def __init__(
        self, message: str, *, limit: int, read_bytes: int, declared_bytes: int | None = None
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.read_bytes = read_bytes
        self.declared_bytes = declared_bytes

    @property
    def size_seen(self) -> str:
        """The size as far as it is known: ``"N bytes"`` (declared) or ``"more than N bytes"``."""
        if self.declared_bytes is not None:
            return f"{self.declared_bytes} bytes"
        return f"more than {self.limit} bytes"


class UnknownAdapter(AdapterError, LookupError):
    """No adapter is registered for this (protocol, protocol_version) pair."""
