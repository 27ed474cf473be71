"""Reading one answer of MCP's Streamable HTTP transport, bounded in size and in time.

The answer to a POST is one JSON body or an SSE stream that may carry server requests and notifications
before the response, which is matched by request id. Nothing here sends a request: these functions read
an ``httpx2.Response`` that :class:`adapters.streamable_http.StreamableHttpClient` has opened, and raise
the package's errors, or one of the two private signals below that the client turns into them
(:class:`ReadBudgetExceeded`, :class:`Resume`).
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import httpx2

from adapters.errors import AnswerTooLarge, NotFound, OutcomeUnknown, ProtocolViolation, Transient
from adapters.jsonrpc import (
    ErrorResponse,
    Message,
    Notification,
    Request,
    Response,
    classify_http_status,
    decode_json,
    parse_message,
    parse_messages,
)
from adapters.sse import SseDecoder

__all__ = [
    "ERROR_BODY_LIMIT",
    "Deadline",
    "Exchange",
    "ReadBudgetExceeded",
    "Resume",
    "Session",
    "SessionGone",
    "StreamState",
    "declared_length",
    "read_answer",
    "read_bounded",
    "read_error_body",
    "read_stream",
]

#: How much of an HTTP error body is read for its message.
ERROR_BODY_LIMIT = 64 * 1024
#: How long the end of an event stream is waited for once its response is in (see ``_finish_stream``).
_STREAM_END_GRACE_S = 0.02


@dataclass(frozen=True)
class Session:
    """An MCP session as seen by the client: the server-assigned id (None when stateless) and the
    negotiated protocol version. Any worker can rebuild it from stored values, without initializing."""

    session_id: str | None
    protocol_version: str


@dataclass(frozen=True)
class Exchange:
    """What one POST brought back.

    ``response`` is None only when ``until`` stopped the read first or, for a patient read, when the wait
    ran out (``waited_out``).
    """

    response: Response | ErrorResponse | None
    server_requests: tuple[Request, ...] = ()
    notifications: tuple[Notification, ...] = ()
    session_id: str | None = None
    waited_out: bool = False
    content_type: str = ""


class SessionGone(NotFound):
    """HTTP 404 for a request that carried an ``Mcp-Session-Id``: the session ended."""

    def __init__(self, message: str) -> None:
        super().__init__(message, session_gone=True)


class Deadline:
    """The time budget of one whole answer, resumptions included."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self._end

    def remaining(self) -> float:
        return self._end - time.monotonic()


class ReadBudgetExceeded(Exception):
    """The whole answer took longer than its read budget."""


class Resume(Exception):
    """The stream closed before the response after an event id: resume it with ``Last-Event-ID``."""


@dataclass
class StreamState:
    """What the legs of one (possibly resumed) SSE answer share."""

    messages: list[Message] = field(default_factory=list)
    size: int = 0
    last_event_id: str | None = None
    reconnect_ms: int | None = None


def read_bounded(
    answer: httpx2.Response, limit: int, deadline: Deadline | None, *, what: str = "answer"
) -> bytes:
    """The whole body, refused past ``limit`` bytes or (when given) past ``deadline``.

    Raises:
        AnswerTooLarge: its ``Content-Length`` says it is over ``limit`` (nothing of it is read), or more
            than ``limit`` bytes arrived.
        ReadBudgetExceeded: ``deadline`` passed while reading.
    """
    declared = declared_length(answer)
    if declared is not None and declared > limit:
        raise AnswerTooLarge(
            f"{what}: {declared} bytes (Content-Length), over the {limit}-byte cap",
            limit=limit,
            read_bytes=0,
            declared_bytes=declared,
        )
    chunks: list[bytes] = []
    size = 0
    for chunk in answer.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(
                f"{what}: larger than the {limit}-byte cap ({size} bytes read)", limit=limit, read_bytes=size
            )
        chunks.append(chunk)
        if deadline is not None and deadline.expired():
            raise ReadBudgetExceeded
    return b"".join(chunks)


def read_error_body(answer: httpx2.Response) -> bytes:
    """The start of an error answer's body, for its message: at most :data:`ERROR_BODY_LIMIT` bytes, the
    rest left unread (it goes with the connection). An error answer is never refused for its size: what
    it says is in its status, and its body only adds the words."""
    chunks: list[bytes] = []
    size = 0
    for chunk in answer.iter_bytes():
        chunks.append(chunk[: ERROR_BODY_LIMIT - size])
        size += len(chunks[-1])
        if size >= ERROR_BODY_LIMIT:
            break
    return b"".join(chunks)


def declared_length(answer: httpx2.Response) -> int | None:
    """The body's size as its ``Content-Length`` declares it, when that is the size of what is read (no
    ``Content-Encoding``: a compressed body is read decoded, larger than declared)."""
    length = answer.headers.get("content-length")
    if length is None or not length.isdigit() or answer.headers.get("content-encoding"):
        return None
    return int(length)


def read_answer(
    answer: httpx2.Response,
    *,
    request_id: str,
    method: str,
    session: Session | None,
    idempotent: bool,
    deadline: Deadline,
    max_body_bytes: int,
    until: Callable[[Message], bool] | None,
    patient: bool,
    on_request: Callable[[Request], None] | None,
    state: StreamState | None = None,
    resuming: bool = False,
) -> Exchange:
    """Read the answer to the request ``request_id`` (a POST, or the GET that resumes its stream).

    Raises:
        SessionGone: HTTP 404 on a request that carried a session id.
        Resume: the stream closed before the response, after an event id.
        ReadBudgetExceeded: ``deadline`` passed while reading.
        Transient, RateLimited, Rejected, OutcomeUnknown, ProtocolViolation: see ``adapters.errors``.
    """
    status = answer.status_code
    session_header = answer.headers.get("mcp-session-id")
    if resuming and status != 200:
        # The server cannot resume the stream: the answer is lost, as if the stream had simply ended. A 404
        # for the session included: the request itself reached the server (its stream had begun), so it is
        # not "never ran" (SessionGone, which a create answers by sending the call again on a new session).
        text = f"{method}: stream could not be resumed (HTTP {status})"
        if idempotent:
            raise Transient(text)
        raise OutcomeUnknown(text)
    if status == 404 and session is not None and session.session_id is not None:
        raise SessionGone(f"{method}: session {session.session_id} not found (HTTP 404)")
    if status in (202, 204):
        message = f"{method}: HTTP {status}, accepted without an answer"
        if idempotent:
            raise Transient(message)
        raise OutcomeUnknown(message)
    if status != 200:
        body = read_error_body(answer)
        raise classify_http_status(status, headers=answer.headers, body=body, idempotent=idempotent)
    content_type = answer.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json" and not resuming:
        body = read_bounded(answer, max_body_bytes, deadline, what=method)
        messages = parse_messages(decode_json(body))
        return _collect(messages, request_id, method, session_header, from_stream=False)
    if content_type == "text/event-stream":
        return read_stream(
            answer,
            request_id=request_id,
            method=method,
            session_header=session_header,
            idempotent=idempotent,
            deadline=deadline,
            max_body_bytes=max_body_bytes,
            until=until,
            patient=patient,
            on_request=on_request,
            state=state,
        )
    raise ProtocolViolation(f"{method}: unexpected content type {content_type!r}")


def read_stream(
    answer: httpx2.Response,
    *,
    request_id: str | None,
    method: str,
    session_header: str | None,
    idempotent: bool,
    deadline: Deadline,
    max_body_bytes: int,
    until: Callable[[Message], bool] | None,
    patient: bool,
    on_request: Callable[[Request], None] | None = None,
    state: StreamState | None = None,
) -> Exchange:
    """Read an SSE answer until the response to ``request_id`` (None: a GET stream, no response) or a
    message ``until`` matches. ``on_request`` sees each server request as it arrives."""
    state = state if state is not None else StreamState()
    decoder = SseDecoder()
    messages = state.messages
    chunks = answer.iter_bytes()
    leg_size = 0
    cut: httpx2.TransportError | None = None
    try:
        for chunk in _until_cut(chunks, resumable=request_id is not None, decoder=decoder, state=state):
            state.size += len(chunk)
            leg_size += len(chunk)
            if state.size > max_body_bytes:
                raise AnswerTooLarge(
                    f"{method}: event stream larger than the {max_body_bytes}-byte cap ({state.size} bytes "
                    f"read)",
                    limit=max_body_bytes,
                    read_bytes=state.size,
                )
            for event in decoder.feed(chunk):
                if not event.data.strip():
                    continue
                message = parse_message(decode_json(event.data))
                messages.append(message)
                if on_request is not None and isinstance(message, Request):
                    on_request(message)
                if _is_ours(message, request_id):
                    _finish_stream(answer, chunks, leg_size, max_body_bytes)
                    return _collect(messages, request_id, method, session_header, from_stream=True)
                if until is not None and until(message):
                    return _collect(messages, request_id, method, session_header, from_stream=True)
            if deadline.expired():
                raise ReadBudgetExceeded
        decoder.close()
    except _Cut as signal:
        cut = signal.error
    finally:
        state.last_event_id = decoder.last_event_id or state.last_event_id
        state.reconnect_ms = decoder.reconnect_ms if decoder.reconnect_ms is not None else state.reconnect_ms
    exchange = _collect(messages, request_id, method, session_header, from_stream=True)
    if exchange.response is not None:
        return exchange
    if request_id is not None and state.last_event_id is not None:
        # Closed or cut before its response, after an event id: resumable, patient or not (a server's
        # request cut with the stream comes back only this way).
        raise Resume from cut
    if patient:
        return replace(exchange, waited_out=True)
    text = f"{method}: event stream ended without a response"
    if idempotent:
        raise Transient(text)
    raise OutcomeUnknown(text)


class _Cut(Exception):
    """The connection under a resumable stream broke (see :func:`_until_cut`)."""

    def __init__(self, error: httpx2.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


def _until_cut(
    chunks: Iterator[bytes], *, resumable: bool, decoder: SseDecoder, state: StreamState
) -> Iterator[bytes]:
    """The stream's chunks; a connection that breaks after an event id of a request's stream ends them
    with :class:`_Cut` (the stream is resumed), any other break is raised as it is."""
    try:
        yield from chunks
    except (httpx2.RemoteProtocolError, httpx2.ReadError) as exc:
        if resumable and (decoder.last_event_id or state.last_event_id) is not None:
            raise _Cut(exc) from exc
        raise


def _is_ours(message: Message, request_id: str | None) -> bool:
    if request_id is None:
        return False
    return isinstance(message, Response | ErrorResponse) and message.id in (request_id, None)


def _collect(
    messages: list[Message],
    request_id: str | None,
    method: str,
    session_header: str | None,
    *,
    from_stream: bool,
) -> Exchange:
    requests: list[Request] = []
    notifications: list[Notification] = []
    response: Response | ErrorResponse | None = None
    for message in messages:
        if isinstance(message, Request):
            requests.append(message)
        elif isinstance(message, Notification):
            notifications.append(message)
        elif _is_ours(message, request_id):
            response = message
        else:
            raise ProtocolViolation(f"{method}: answer for another request id {message.id!r}")
    if response is None and not from_stream:
        raise ProtocolViolation(f"{method}: JSON answer without a response")
    return Exchange(
        response=response,
        server_requests=tuple(requests),
        notifications=tuple(notifications),
        session_id=session_header,
        content_type="text/event-stream" if from_stream else "application/json",
    )


def _finish_stream(answer: httpx2.Response, chunks: Iterator[bytes], size: int, limit: int) -> None:
    """Read the rest of an event stream whose response is in, when it is already arriving: a whole answer
    lets its connection go back to the pool, an unfinished one is closed with it. A server SHOULD end the
    stream after the response; one that keeps it open is waited for ``_STREAM_END_GRACE_S`` at most."""
    network = answer.extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None
    if not isinstance(sock, socket.socket):
        return
    length = answer.headers.get("content-length")
    end = time.monotonic() + _STREAM_END_GRACE_S
    try:
        while size <= limit:
            # A body of known length is whole once read: its end needs no more bytes from the network.
            whole = length is not None and length.isdigit() and size >= int(length)
            if not whole and not _readable(sock, end - time.monotonic()):
                return
            chunk = next(chunks, None)
            if chunk is None:
                return
            size += len(chunk)
    except httpx2.HTTPError:
        return  # the response is held; a broken end only costs the connection


def _readable(sock: socket.socket, timeout: float) -> bool:
    if timeout <= 0:
        timeout = 0.0
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000))
