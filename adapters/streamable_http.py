"""The thin I/O half of MCP's Streamable HTTP transport, over an injected ``httpx2.Client``.

One POST per JSON-RPC message. The answer may be one JSON body or an SSE stream carrying server requests
and notifications before the response; the response is matched by request id. Reads are bounded in size
and in time (:mod:`adapters.http_answers` reads them); every httpx2 exception is mapped at this edge.
Each HTTP request sent (a POST, a GET stream, the GET that resumes a stream) is first charged to the
caller's :class:`~adapters.base.RequestBudget`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import httpx2

from adapters.base import UNMETERED, Limits, RequestBudget, Timeouts, redact_url
from adapters.credentials import BearerToken, Credentials
from adapters.errors import (
    AdapterError,
    AnswerTooLarge,
    NotSent,
    OutcomeUnknown,
    ProtocolViolation,
    Rejected,
    Transient,
    Unauthorized,
)
from adapters.http_answers import (
    ERROR_BODY_LIMIT,
    Deadline,
    Exchange,
    ReadBudgetExceeded,
    Resume,
    Session,
    SessionGone,
    StreamState,
    declared_length,
    read_answer,
    read_error_body,
    read_stream,
)
from adapters.jsonrpc import Message, Request, classify_http_status
from adapters.metering import Refused

__all__ = [
    "ACCEPT",
    "Exchange",
    "RequestTimeouts",
    "Session",
    "SessionGone",
    "StreamableHttpClient",
    "TimeoutExtension",
    "encode_message",
    "map_transport_error",
    "request_headers",
]

ACCEPT = "application/json, text/event-stream"


def request_headers(session: Session | None, *, include_version: bool = True) -> dict[str, str]:
    """Headers for a POST: Accept both answer types, the session and negotiated version when known."""
    headers = {"Accept": ACCEPT, "Content-Type": "application/json"}
    if session is not None:
        if include_version:
            headers["MCP-Protocol-Version"] = session.protocol_version
        if session.session_id is not None:
            headers["Mcp-Session-Id"] = session.session_id
    return headers


def map_transport_error(exc: httpx2.HTTPError, *, idempotent: bool, method: str) -> AdapterError:
    """Map an httpx2 exception to the most specific adapter error.

    A request that provably never left (connect and pool failures) is always :class:`NotSent`. Once
    bytes may have reached the server, a non-idempotent request becomes :class:`OutcomeUnknown`.
    """
    what = f"{method}: {type(exc).__name__}: {exc}"
    if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout | httpx2.PoolTimeout):
        return NotSent(f"not sent, {what}")
    if isinstance(exc, httpx2.UnsupportedProtocol):
        return Rejected(f"bad URL, {what}")
    if isinstance(exc, httpx2.DecodingError | httpx2.TooManyRedirects):
        return ProtocolViolation(what)
    if idempotent:
        return Transient(what)
    return OutcomeUnknown(f"may have reached the server, {what}")


#: The request extension that sets a request's timeouts (what httpx2 makes of ``timeout=``).
TimeoutExtension = dict[str, dict[str, float | None]]


def _timeout_extension(timeouts: Timeouts, read: float) -> TimeoutExtension:
    t = timeouts
    return {"timeout": httpx2.Timeout(connect=t.connect, read=read, write=t.write, pool=t.pool).as_dict()}


class RequestTimeouts:
    """The ``timeout`` extension of each request a client sends (``extensions=``, what httpx2 makes of
    ``timeout=``): the client's per-phase timeouts with the read timeout the request asks for. The usual one
    is built once (httpx2 would build the same ``Timeout`` again for every request); each request gets its own
    copy, since httpx2 hands the mapping itself to the request, where a hook may change it."""

    def __init__(self, timeouts: Timeouts) -> None:
        self._timeouts = timeouts
        self._usual = _timeout_extension(timeouts, timeouts.read)["timeout"]

    def extension(self, read: float | None = None) -> TimeoutExtension:
        """The extension for a read timeout of ``read`` seconds (by default the client's)."""
        if read is None or read == self._timeouts.read:
            return {"timeout": dict(self._usual)}
        return _timeout_extension(self._timeouts, read)


def encode_message(message: dict[str, Any]) -> bytes:
    """A JSON-RPC message as httpx2's ``json=`` encodes it (the request then sets its own Content-Type)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class StreamableHttpClient:
    """Sends JSON-RPC messages to one MCP endpoint; knows nothing of tasks."""

    def __init__(
        self,
        http: httpx2.Client,
        url: str,
        *,
        bearer_token: BearerToken,
        timeouts: Timeouts,
        limits: Limits,
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self._http = http
        self._url = redact_url(url)
        # Parsed once: httpx2 would parse the string again for every request.
        self._endpoint: httpx2.URL | str
        try:
            endpoint = httpx2.URL(url)
        except httpx2.InvalidURL:
            self._endpoint = url  # refused when it is used, as before
            self._credentials = Credentials(bearer_token)
        else:
            self._endpoint, self._credentials = Credentials.of(endpoint, bearer_token)
        self._timeouts = timeouts
        self._limits = limits
        self._request_timeouts = RequestTimeouts(timeouts)
        # Random ids: workers sharing one stateful session must never reuse an id the server still maps.
        self._new_id = new_id or (lambda: f"lc-{uuid.uuid4().hex}")

    @property
    def url(self) -> str:
        """The endpoint as it may be shown: a password in it is redacted."""
        return self._url

    def _headers(self, session: Session | None, *, include_version: bool = True) -> dict[str, str]:
        """:func:`request_headers` with this request's credentials: the bearer token as it is now, else the
        URL's basic auth.

        Raises:
            Transient: the token provider failed; nothing was sent.
        """
        return request_headers(session, include_version=include_version) | self._credentials.headers()

    def _timeout(self, read: float) -> TimeoutExtension:
        return self._request_timeouts.extension(read)

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
        budget: RequestBudget = UNMETERED,
    ) -> Exchange:
        """POST one request and read its answer.

        ``until`` may stop an SSE read early at a server message it is looking for. ``patient`` turns
        "no answer within ``read_timeout``" into ``Exchange(waited_out=True)`` instead of an error.
        ``on_request`` is called for each server request on the stream, while it is being read.
        ``budget`` is charged before the POST and before each GET that resumes its stream.

        Raises:
            SessionGone: HTTP 404 on a request that carried a session id.
            Transient, RateLimited, Rejected, OutcomeUnknown, ProtocolViolation: see ``adapters.errors``.
            Whatever ``budget.charge()`` raises, except for the resumption of a non-idempotent request
            (its POST went out, so the answer lost is :class:`OutcomeUnknown`).
        """
        request_id = self._new_id()
        body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": dict(params)}
        read_s = read_timeout if read_timeout is not None else self._timeouts.read
        deadline = Deadline(read_s)
        headers = self._headers(session, include_version=include_version)
        state = StreamState()

        def read(answer: httpx2.Response, *, resuming: bool) -> Exchange:
            return read_answer(
                answer,
                request_id=request_id,
                method=method,
                session=session,
                idempotent=idempotent,
                deadline=deadline,
                max_body_bytes=self._limits.max_body_bytes,
                until=until,
                patient=patient,
                on_request=on_request,
                state=state,
                resuming=resuming,
            )

        def post() -> Exchange:
            with self._http.stream(
                "POST",
                self._endpoint,
                content=encode_message(body),
                headers=headers,
                extensions=self._timeout(read_s),
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
                extensions=self._timeout(max(deadline.remaining(), 0.01)),
            ) as answer:
                return read(answer, resuming=True)

        budget.charge()
        leg, resumed = post, 0
        while True:
            try:
                return self._mapped(leg, method=method, idempotent=idempotent, patient=patient, read_s=read_s)
            except Unauthorized as exc:  # a bearer token refused as invalid: renewed, sent again by the step
                raise self._credentials.refused(exc, headers) from exc
            except Resume:
                wait_s = (state.reconnect_ms or 0) / 1000
                if resumed >= self._limits.max_resumptions or deadline.remaining() <= wait_s:
                    break
            # The server asked for this pause before reconnecting (SSE ``retry``), bounded by the read
            # time. Out of the handler, so a refused charge carries no stray context.
            time.sleep(wait_s)
            self._charge_resumption(budget, method=method, idempotent=idempotent)
            leg, resumed = resume, resumed + 1
        if patient:
            return Exchange(response=None, waited_out=True)
        text = f"{method}: event stream closed without a response (resumed {resumed}x)"
        if idempotent:
            raise Transient(text)
        raise OutcomeUnknown(text)

    @staticmethod
    def _charge_resumption(budget: RequestBudget, *, method: str, idempotent: bool) -> None:
        if idempotent:
            budget.charge()
            return
        try:
            budget.charge()
        except (Exception, Refused) as exc:  # noqa: BLE001 -- a budget refuses with any exception
            # The POST went out and may have taken effect: a refused resumption must not read as
            # "nothing was sent", so it ends like any stream that cannot be resumed.
            refusal = exc.refusal if isinstance(exc, Refused) else exc
            raise OutcomeUnknown(
                f"{method}: event stream closed without a response; its resumption was refused by the "
                f"request budget ({refusal!r})"
            ) from refusal

    def _mapped(
        self, leg: Callable[[], Exchange], *, method: str, idempotent: bool, patient: bool, read_s: float
    ) -> Exchange:
        """Run one leg of a request, mapping every foreign exception at this edge."""
        try:
            return leg()
        except httpx2.ReadTimeout as exc:
            if patient:
                return Exchange(response=None, waited_out=True)
            raise map_transport_error(exc, idempotent=idempotent, method=method) from exc
        except ReadBudgetExceeded as exc:
            if patient:
                return Exchange(response=None, waited_out=True)
            message = f"{method}: no answer within {read_s:g}s"
            if idempotent:
                raise Transient(message) from exc
            raise OutcomeUnknown(f"may have reached the server, {message}") from exc
        except httpx2.HTTPError as exc:
            raise map_transport_error(exc, idempotent=idempotent, method=method) from exc
        except UnicodeDecodeError as exc:
            raise ProtocolViolation(f"{method}: answer is not UTF-8") from exc

    def post_message(
        self,
        message: Mapping[str, Any],
        *,
        session: Session | None,
        what: str,
        idempotent: bool = False,
        budget: RequestBudget = UNMETERED,
    ) -> None:
        """POST a notification or a response, after charging ``budget``. The server answers 202
        ("accepted", nothing more).

        Raises:
            SessionGone, Transient, RateLimited, Rejected, OutcomeUnknown, ProtocolViolation.
            Whatever ``budget.charge()`` raises.
        """
        headers = self._headers(session)
        budget.charge()
        try:
            with self._http.stream(
                "POST",
                self._endpoint,
                content=encode_message(dict(message)),
                headers=headers,
                extensions=self._timeout(self._timeouts.read),
            ) as answer:
                if answer.status_code in (200, 202, 204):
                    _read_short_body(answer)
                    return
                body = read_error_body(answer)
                if answer.status_code == 404 and session is not None and session.session_id is not None:
                    raise SessionGone(f"{what}: session {session.session_id} not found (HTTP 404)")
                error = classify_http_status(
                    answer.status_code, headers=answer.headers, body=body, idempotent=idempotent
                )
                raise self._credentials.refused(error, headers)
        except httpx2.HTTPError as exc:
            raise map_transport_error(exc, idempotent=idempotent, method=what) from exc

    def listen(
        self,
        *,
        session: Session,
        wait_s: float,
        until: Callable[[Message], bool],
        budget: RequestBudget = UNMETERED,
    ) -> Exchange:
        """Open the session's GET stream (after charging ``budget``) and read server messages until
        ``until`` matches or ``wait_s`` runs out. A server without that stream (405) or with it held
        elsewhere (409) gives nothing.

        Raises:
            SessionGone, Transient, RateLimited, Rejected, ProtocolViolation.
            Whatever ``budget.charge()`` raises.
        """
        headers = self._headers(session)
        headers["Accept"] = "text/event-stream"
        del headers["Content-Type"]
        deadline = Deadline(wait_s)
        budget.charge()
        try:
            with self._http.stream(
                "GET", self._endpoint, headers=headers, extensions=self._timeout(wait_s)
            ) as answer:
                status = answer.status_code
                if status in (405, 409):
                    return Exchange(response=None, waited_out=True)
                if status == 404 and session.session_id is not None:
                    raise SessionGone(f"GET stream: session {session.session_id} not found (HTTP 404)")
                if status != 200:
                    body = read_error_body(answer)
                    error = classify_http_status(status, headers=answer.headers, body=body, idempotent=True)
                    raise self._credentials.refused(error, headers)
                content_type = answer.headers.get("content-type", "").split(";")[0].strip().lower()
                if content_type != "text/event-stream":
                    raise ProtocolViolation(f"GET stream: unexpected content type {content_type!r}")
                return read_stream(
                    answer,
                    request_id=None,
                    method="GET stream",
                    session_header=answer.headers.get("mcp-session-id"),
                    idempotent=True,
                    deadline=deadline,
                    max_body_bytes=self._limits.max_body_bytes,
                    until=until,
                    patient=True,
                )
        except (httpx2.ReadTimeout, ReadBudgetExceeded):
            return Exchange(response=None, waited_out=True)
        except AnswerTooLarge as exc:
            # The session's stream carries no result: what it brought past the cap is a stream to drop,
            # not a result too large to store.
            raise ProtocolViolation(f"GET stream: {exc}") from exc
        except httpx2.HTTPError as exc:
            raise map_transport_error(exc, idempotent=True, method="GET stream") from exc
        except UnicodeDecodeError as exc:
            raise ProtocolViolation("GET stream is not UTF-8") from exc


def _read_short_body(answer: httpx2.Response) -> None:
    """A message's acceptance (a 2xx) with a short body of a known size (a 202's is empty): that body read
    to its end, so that its connection is kept for the next request, not closed. A longer or unsized body is
    left, and goes with its connection. The message was accepted whatever its body does: a read that fails
    (a body cut, or late past the read timeout) costs only the connection."""
    length = declared_length(answer)
    if length is None or length > ERROR_BODY_LIMIT:
        return
    try:
        for _ in answer.iter_bytes():
            pass
    except (httpx2.HTTPError, AnswerTooLarge):
        return
