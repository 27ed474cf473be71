"""The thin I/O half of MCP's Streamable HTTP transport, over an injected ``httpx.Client``.

One POST per JSON-RPC message. The answer may be one JSON body or an SSE stream carrying server requests
and notifications before the response; the response is matched by request id. Reads are bounded in size
and in time; every httpx exception is mapped at this edge.
"""

from __future__ import annotations

import select
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from adapters.base import Limits, Timeouts
from adapters.errors import (
    AdapterError,
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    Rejected,
    Transient,
)
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
    "ACCEPT",
    "Exchange",
    "Session",
    "SessionGone",
    "StreamableHttpClient",
    "map_transport_error",
    "request_headers",
]

ACCEPT = "application/json, text/event-stream"
_ERROR_BODY_LIMIT = 64 * 1024
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


def request_headers(
    session: Session | None, *, bearer_token: str | None, include_version: bool = True
) -> dict[str, str]:
    """Headers for a POST: Accept both answer types, the session and negotiated version when known."""
    headers = {"Accept": ACCEPT, "Content-Type": "application/json"}
    if session is not None:
        if include_version:
            headers["MCP-Protocol-Version"] = session.protocol_version
        if session.session_id is not None:
            headers["Mcp-Session-Id"] = session.session_id
    if bearer_token is not None:
        headers["Authorization"] = f"Bearer {bearer_token}"
    return headers


def map_transport_error(exc: httpx.HTTPError, *, idempotent: bool, method: str) -> AdapterError:
    """Map an httpx exception to the most specific adapter error.

    A request that provably never left (connect and pool failures) is always :class:`Transient`. Once
    bytes may have reached the server, a non-idempotent request becomes :class:`OutcomeUnknown`.
    """
    what = f"{method}: {type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return Transient(f"not sent, {what}")
    if isinstance(exc, httpx.UnsupportedProtocol):
        return Rejected(f"bad URL, {what}")
    if isinstance(exc, httpx.DecodingError | httpx.TooManyRedirects):
        return ProtocolViolation(what)
    if idempotent:
        return Transient(what)
    return OutcomeUnknown(f"may have reached the server, {what}")


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self._end

    def remaining(self) -> float:
        return self._end - time.monotonic()


class _ReadBudgetExceeded(Exception):
    """The whole answer took longer than its read budget."""


@dataclass
class _StreamState:
    """What the legs of one (possibly resumed) SSE answer share."""

    messages: list[Message] = field(default_factory=list)
    size: int = 0
    last_event_id: str | None = None
    reconnect_ms: int | None = None


class _Resume(Exception):
    """The stream closed before the response after an event id: resume it with ``Last-Event-ID``."""


class StreamableHttpClient:
    """Sends JSON-RPC messages to one MCP endpoint; knows nothing of tasks."""

    def __init__(
        self,
        http: httpx.Client,
        url: str,
        *,
        bearer_token: str | None,
        timeouts: Timeouts,
        limits: Limits,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self._http = http
        self._url = url
        # Parsed once: httpx would parse the string again for every request.
        self._endpoint: httpx.URL | str
        try:
            self._endpoint = httpx.URL(url)
        except httpx.InvalidURL:
            self._endpoint = url  # refused when it is used, as before
        self._token = bearer_token
        self._timeouts = timeouts
        self._limits = limits
        # Random ids: workers sharing one stateful session must never reuse an id the server still maps.
        self._new_id = new_id or (lambda: f"lc-{uuid.uuid4().hex}")

    @property
    def url(self) -> str:
        return self._url

    def _timeout(self, read: float) -> httpx.Timeout:
        t = self._timeouts
        return httpx.Timeout(connect=t.connect, read=read, write=t.write, pool=t.pool)

    def request(
        self,
        method: str,
        params: Mapping[str, Any],
        *,
        session: Session | None,
        idempotent: bool,
        read_timeout: float | None = None,
        until: Callable[[Message], bool] | None = None,
        patient: bool = False,
        include_version: bool = True,
        on_request: Callable[[Request], None] | None = None,
    ) -> Exchange:
        """POST one request and read its answer.

        ``until`` may stop an SSE read early at a server message it is looking for. ``patient`` turns
        "no answer within ``read_timeout``" into ``Exchange(waited_out=True)`` instead of an error.
        ``on_request`` is called for each server request on the stream, while it is being read.

        Raises:
            SessionGone: HTTP 404 on a request that carried a session id.
            Transient, RateLimited, Rejected, OutcomeUnknown, ProtocolViolation: see ``adapters.errors``.
        """
        request_id = self._new_id()
        body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": dict(params)}
        budget = read_timeout if read_timeout is not None else self._timeouts.read
        deadline = _Deadline(budget)
        headers = request_headers(session, bearer_token=self._token, include_version=include_version)
        state = _StreamState()

        def read(answer: httpx.Response, *, resuming: bool) -> Exchange:
            return self._read_answer(
                answer,
                request_id=request_id,
                method=method,
                session=session,
                idempotent=idempotent,
                deadline=deadline,
                until=until,
                patient=patient,
                on_request=on_request,
                state=state,
                resuming=resuming,
            )

        def post() -> Exchange:
            with self._http.stream(
                "POST", self._endpoint, json=body, headers=headers, timeout=self._timeout(budget)
            ) as answer:
                return read(answer, resuming=False)

        def resume() -> Exchange:
            resume_headers = {
                **headers,
                "Accept": "text/event-stream",
                "Last-Event-ID": state.last_event_id or "",
            }
            del resume_headers["Content-Type"]
            with self._http.stream(
                "GET",
                self._endpoint,
                headers=resume_headers,
                timeout=self._timeout(max(deadline.remaining(), 0.01)),
            ) as answer:
                return read(answer, resuming=True)

        leg, resumed = post, 0
        while True:
            try:
                return self._mapped(leg, method=method, idempotent=idempotent, patient=patient, budget=budget)
            except _Resume:
                wait_s = (state.reconnect_ms or 0) / 1000
                if resumed >= self._limits.max_resumptions or deadline.remaining() <= wait_s:
                    break
                # The server asked for this pause before reconnecting (SSE ``retry``), bounded by the budget.
                time.sleep(wait_s)
                leg, resumed = resume, resumed + 1
        text = f"{method}: event stream closed without a response (resumed {resumed}x)"
        if idempotent:
            raise Transient(text)
        raise OutcomeUnknown(text)

    def _mapped(
        self, leg: Callable[[], Exchange], *, method: str, idempotent: bool, patient: bool, budget: float
    ) -> Exchange:
        """Run one leg of a request, mapping every foreign exception at this edge."""
        try:
            return leg()
        except httpx.ReadTimeout as exc:
            if patient:
                return Exchange(response=None, waited_out=True)
            raise map_transport_error(exc, idempotent=idempotent, method=method) from exc
        except _ReadBudgetExceeded as exc:
            if patient:
                return Exchange(response=None, waited_out=True)
            message = f"{method}: no answer within {budget:g}s"
            if idempotent:
                raise Transient(message) from exc
            raise OutcomeUnknown(f"may have reached the server, {message}") from exc
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, idempotent=idempotent, method=method) from exc
        except UnicodeDecodeError as exc:
            raise ProtocolViolation(f"{method}: answer is not UTF-8") from exc

    def post_message(
        self, message: Mapping[str, Any], *, session: Session | None, what: str, idempotent: bool = False
    ) -> None:
        """POST a notification or a response. The server answers 202 ("accepted", nothing more).

        Raises:
            SessionGone, Transient, RateLimited, Rejected, OutcomeUnknown, ProtocolViolation.
        """
        headers = request_headers(session, bearer_token=self._token)
        try:
            with self._http.stream(
                "POST",
                self._endpoint,
                json=dict(message),
                headers=headers,
                timeout=self._timeout(self._timeouts.read),
            ) as answer:
                if answer.status_code in (200, 202, 204):
                    return
                body = self._read_bounded(answer, _ERROR_BODY_LIMIT, None)
                if answer.status_code == 404 and session is not None and session.session_id is not None:
                    raise SessionGone(f"{what}: session {session.session_id} not found (HTTP 404)")
                raise classify_http_status(
                    answer.status_code, headers=answer.headers, body=body, idempotent=idempotent
                )
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, idempotent=idempotent, method=what) from exc

    def listen(self, *, session: Session, wait_s: float, until: Callable[[Message], bool]) -> Exchange:
        """Open the session's GET stream and read server messages until ``until`` matches or ``wait_s``
        runs out. A server without that stream (405) or with it held elsewhere (409) gives nothing.

        Raises:
            SessionGone, Transient, RateLimited, Rejected, ProtocolViolation.
        """
        headers = request_headers(session, bearer_token=self._token)
        headers["Accept"] = "text/event-stream"
        del headers["Content-Type"]
        deadline = _Deadline(wait_s)
        try:
            with self._http.stream(
                "GET", self._endpoint, headers=headers, timeout=self._timeout(wait_s)
            ) as answer:
                status = answer.status_code
                if status in (405, 409):
                    return Exchange(response=None, waited_out=True)
                if status == 404 and session.session_id is not None:
                    raise SessionGone(f"GET stream: session {session.session_id} not found (HTTP 404)")
                if status != 200:
                    body = self._read_bounded(answer, _ERROR_BODY_LIMIT, None)
                    raise classify_http_status(status, headers=answer.headers, body=body, idempotent=True)
                content_type = answer.headers.get("content-type", "").split(";")[0].strip().lower()
                if content_type != "text/event-stream":
                    raise ProtocolViolation(f"GET stream: unexpected content type {content_type!r}")
                return self._read_stream(
                    answer,
                    request_id=None,
                    method="GET stream",
                    session_header=answer.headers.get("mcp-session-id"),
                    idempotent=True,
                    deadline=deadline,
                    until=until,
                    patient=True,
                )
        except (httpx.ReadTimeout, _ReadBudgetExceeded):
            return Exchange(response=None, waited_out=True)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, idempotent=True, method="GET stream") from exc
        except UnicodeDecodeError as exc:
            raise ProtocolViolation("GET stream is not UTF-8") from exc

    def _read_bounded(self, answer: httpx.Response, limit: int, deadline: _Deadline | None) -> bytes:
        chunks: list[bytes] = []
        size = 0
        for chunk in answer.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise ProtocolViolation(f"answer larger than {limit} bytes")
            chunks.append(chunk)
            if deadline is not None and deadline.expired():
                raise _ReadBudgetExceeded
        return b"".join(chunks)

    def _read_answer(
        self,
        answer: httpx.Response,
        *,
        request_id: str,
        method: str,
        session: Session | None,
        idempotent: bool,
        deadline: _Deadline,
        until: Callable[[Message], bool] | None,
        patient: bool,
        on_request: Callable[[Request], None] | None,
        state: _StreamState | None = None,
        resuming: bool = False,
    ) -> Exchange:
        status = answer.status_code
        session_header = answer.headers.get("mcp-session-id")
        if status == 404 and session is not None and session.session_id is not None:
            raise SessionGone(f"{method}: session {session.session_id} not found (HTTP 404)")
        if resuming and status != 200:
            # The server cannot resume the stream: the answer is lost, as if the stream had simply ended.
            text = f"{method}: stream could not be resumed (HTTP {status})"
            if idempotent:
                raise Transient(text)
            raise OutcomeUnknown(text)
        if status in (202, 204):
            message = f"{method}: HTTP {status}, accepted without an answer"
            if idempotent:
                raise Transient(message)
            raise OutcomeUnknown(message)
        if status != 200:
            body = self._read_bounded(answer, _ERROR_BODY_LIMIT, None)
            raise classify_http_status(status, headers=answer.headers, body=body, idempotent=idempotent)
        content_type = answer.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type == "application/json" and not resuming:
            body = self._read_bounded(answer, self._limits.max_body_bytes, deadline)
            messages = parse_messages(decode_json(body))
            exchange = self._collect(messages, request_id, method, session_header, from_stream=False)
            return replace(exchange, content_type=content_type)
        if content_type == "text/event-stream":
            return self._read_stream(
                answer,
                request_id=request_id,
                method=method,
                session_header=session_header,
                idempotent=idempotent,
                deadline=deadline,
                until=until,
                patient=patient,
                on_request=on_request,
                state=state,
            )
        raise ProtocolViolation(f"{method}: unexpected content type {content_type!r}")

    @staticmethod
    def _is_ours(message: Message, request_id: str | None) -> bool:
        if request_id is None:
            return False
        return isinstance(message, Response | ErrorResponse) and message.id in (request_id, None)

    def _collect(
        self,
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
            elif self._is_ours(message, request_id):
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
            content_type="" if not from_stream else "text/event-stream",
        )

    def _read_stream(
        self,
        answer: httpx.Response,
        *,
        request_id: str | None,
        method: str,
        session_header: str | None,
        idempotent: bool,
        deadline: _Deadline,
        until: Callable[[Message], bool] | None,
        patient: bool,
        on_request: Callable[[Request], None] | None = None,
        state: _StreamState | None = None,
    ) -> Exchange:
        state = state if state is not None else _StreamState()
        decoder = SseDecoder()
        messages = state.messages
        limit = self._limits.max_body_bytes
        chunks = answer.iter_bytes()
        leg_size = 0
        try:
            for chunk in chunks:
                state.size += len(chunk)
                leg_size += len(chunk)
                if state.size > limit:
                    raise ProtocolViolation(f"{method}: event stream larger than {limit} bytes")
                for event in decoder.feed(chunk):
                    if not event.data.strip():
                        continue
                    message = parse_message(decode_json(event.data))
                    messages.append(message)
                    if on_request is not None and isinstance(message, Request):
                        on_request(message)
                    if self._is_ours(message, request_id):
                        _finish_stream(answer, chunks, leg_size, limit)
                        return self._collect(messages, request_id, method, session_header, from_stream=True)
                    if until is not None and until(message):
                        return self._collect(messages, request_id, method, session_header, from_stream=True)
                if deadline.expired():
                    raise _ReadBudgetExceeded
            decoder.close()
        finally:
            state.last_event_id = decoder.last_event_id or state.last_event_id
            state.reconnect_ms = (
                decoder.reconnect_ms if decoder.reconnect_ms is not None else state.reconnect_ms
            )
        exchange = self._collect(messages, request_id, method, session_header, from_stream=True)
        if exchange.response is not None or patient:
            return replace(exchange, waited_out=exchange.response is None)
        if request_id is not None and state.last_event_id is not None:
            raise _Resume
        text = f"{method}: event stream ended without a response"
        if idempotent:
            raise Transient(text)
        raise OutcomeUnknown(text)


def _finish_stream(answer: httpx.Response, chunks: Iterator[bytes], size: int, limit: int) -> None:
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
    except httpx.HTTPError:
        return  # the response is held; a broken end only costs the connection


def _readable(sock: socket.socket, timeout: float) -> bool:
    if timeout <= 0:
        timeout = 0.0
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000))
