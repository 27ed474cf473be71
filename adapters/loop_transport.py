"""An httpx2 transport that sends its requests on one asyncio event loop of the process, with aiohttp.

Issue 21 measured what one status read costs a worker process (``bench/http_clients.py``): httpx2's own
transport (httpcore2 and h11, pure Python) is most of it, and more so with a batch's members sending side by
side on threads. aiohttp parses HTTP in C and sends every request of the process from one thread, so a
member thread only hands its request over and waits. :class:`LoopTransport` is that, behind httpx2's
transport interface: the adapters, their request hooks, cookies, redirects policy, decoding and answer caps
stay httpx2's, and only the exchange on the socket moves.

- One event loop thread per process (:func:`process_loop`), made on first use; a forked child (a Celery
  prefork child) makes its own, as it makes its own aiohttp sessions: its parent's do not run there.
- Each transport keeps its own connections (an aiohttp connector: at most ``max_connections`` at once, each
  kept open for the next request), as httpx2's transport of the same client would.
- The request's ``timeout`` extension is honoured: connect (and the wait for a free connection: ``pool``)
  and read, per read of the answer as httpx2's are.
- The answer is streamed: the transport returns once the head and the first chunk of the body are in, and
  the caller reads the rest as it comes (an event stream, an answer over the caller's cap refused at its
  first read). An answer not read to its end closes its connection.
- What aiohttp raises is raised as the httpx2 exception of the same meaning (:func:`_httpx2_error`): a
  connection never made is a ``ConnectError``/``ConnectTimeout``/``PoolTimeout`` (the request was not
  sent), a connection lost or a malformed answer a ``RemoteProtocolError`` or ``ReadError``, a read that
  waited past its timeout a ``ReadTimeout``, so the adapters' mapping of faults (``map_transport_error``)
  stays exact.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx2
import yarl

__all__ = ["LoopTransport", "process_loop"]

T = TypeVar("T")

#: The headers httpx2 has set that aiohttp sets itself from the body it is given.
_BODY_HEADERS = frozenset({"content-length", "transfer-encoding"})
#: How long closing a transport waits for its connections to close.
CLOSE_WAIT_S = 5.0
#: How much longer than the request's own timeouts allow a thread waits for the loop's answer before it
#: gives up on it (a loop that does not answer: never met, but a member thread never waits for ever).
LOOP_MARGIN_S = 5.0


def _bound_s(request: httpx2.Request) -> float | None:
    """The longest one step of a request may take on the loop (getting a connection, sending and reading the
    head; or one read of the body) by its timeouts, and a margin; None when one of them is unbounded."""
    phases: dict[str, float | None] = request.extensions.get("timeout", {})
    spans = [phases.get(phase) for phase in ("pool", "connect", "write", "read")]
    if any(span is None for span in spans):
        return None
    return sum(span for span in spans if span is not None) + LOOP_MARGIN_S


#: Every session open in this process, and in a forked child its parent's too: held until closed, and in
#: the child never closed: their sockets are the parent's too (closing a TLS connection sends its close to
#: the server on the parent's behalf), and dropped they would be collected as unclosed, each with a
#: complaint in the log. The same of a parent's loop (:data:`_inherited`).
_open_sessions: set[aiohttp.ClientSession] = set()
_inherited: list[asyncio.AbstractEventLoop] = []


class _ProcessLoop:
    """This process's event loop, run by a daemon thread of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        pid = os.getpid()
        with self._lock:
            if self._loop is None or self._pid != pid:
                # A forked child's copy of the parent's loop has no thread to run it: make one.
                if self._loop is not None:
                    _inherited.append(self._loop)
                self._loop = asyncio.new_event_loop()
                self._pid = pid
                thread = threading.Thread(
                    target=self._loop.run_forever, name="longcall-http-loop", daemon=True
                )
                thread.start()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T], bound_s: float | None = None) -> T:
        """``coro``'s result, run on the loop (its exception raised here); past ``bound_s``, it is
        cancelled and ``TimeoutError`` raised."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop())
        try:
            return future.result(bound_s)
        except TimeoutError:
            future.cancel()
            raise

    def owns(self, loop: asyncio.AbstractEventLoop) -> bool:
        with self._lock:
            return loop is self._loop and self._pid == os.getpid()


_process = _ProcessLoop()


def process_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop (the one thread every :class:`LoopTransport` of the process sends on)."""
    return _process.loop()


@dataclass(frozen=True, slots=True)
class _Head:
    """An answer's head and what the loop had of its body when it came."""

    status: int
    reason: str
    headers: list[tuple[bytes, bytes]]
    first: bytes
    ended: bool
    answer: aiohttp.ClientResponse
    loop: asyncio.AbstractEventLoop


class _Body(httpx2.SyncByteStream):
    """The rest of an answer's body, each chunk read on the loop."""

    def __init__(self, head: _Head, request: httpx2.Request) -> None:
        self._head = head
        self._request = request
        self._ended = head.ended
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        if self._head.first:
            yield self._head.first
        answer = self._head.answer
        bound = _bound_s(self._request)
        while not self._ended:
            try:
                chunk = _process.run(_read_chunk(answer, self._request), bound)
            except TimeoutError:
                raise httpx2.ReadTimeout("the event loop did not answer", request=self._request) from None
            if not chunk:
                self._ended = True
                break
            yield chunk

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        answer, loop = self._head.answer, self._head.loop
        if not _process.owns(loop):
            return  # the answer came to the parent of this forked child: its connection is not ours
        # Read to its end, the connection is kept for the next request; else it is closed (what is left of
        # the answer would be read as the next one's).
        loop.call_soon_threadsafe(answer.release if self._ended else answer.close)


async def _read_chunk(answer: aiohttp.ClientResponse, request: httpx2.Request) -> bytes:
    try:
        return await answer.content.readany()
    except Exception as exc:
        raise _httpx2_error(exc, request, sent=True) from exc


def _timeout(request: httpx2.Request) -> aiohttp.ClientTimeout:
    """The request's httpx2 timeouts as aiohttp's: ``pool`` and ``connect`` bound getting a connection,
    ``connect`` a new connection's handshake, ``read`` each read of the answer (none bounds the whole)."""
    phases: dict[str, float | None] = request.extensions.get("timeout", {})
    pool, connect, read = phases.get("pool"), phases.get("connect"), phases.get("read")
    acquire = None if pool is None or connect is None else pool + connect
    return aiohttp.ClientTimeout(total=None, connect=acquire, sock_connect=connect, sock_read=read)


def _httpx2_error(exc: BaseException, request: httpx2.Request, *, sent: bool) -> httpx2.TransportError:
    """What httpx2's own transport raises for what aiohttp met (``sent``: the request may have reached the
    server: its connection was made)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx2.ConnectTimeout(text, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):  # DNS, refused, TLS handshake: never sent
        return httpx2.ConnectError(text, request=request)
    if isinstance(exc, aiohttp.SocketTimeoutError | asyncio.TimeoutError | TimeoutError):
        return (
            httpx2.ReadTimeout(text, request=request) if sent else httpx2.PoolTimeout(text, request=request)
        )
    if isinstance(
        exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientResponseError
    ):
        return httpx2.RemoteProtocolError(text, request=request)
    if isinstance(exc, aiohttp.InvalidURL):
        return httpx2.UnsupportedProtocol(text, request=request)
    return httpx2.ReadError(text, request=request)


class LoopTransport(httpx2.BaseTransport):
    """Sends each request on this process's event loop (:func:`process_loop`) on connections of its own,
    at most ``max_connections`` at once, each kept open for the next request."""

    def __init__(self, *, max_connections: int) -> None:
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._pid = -1
        self._session: aiohttp.ClientSession | None = None
        self._ssl: ssl.SSLContext | None = None

    def _session_here(self) -> aiohttp.ClientSession:
        pid = os.getpid()
        with self._lock:
            if self._session is None or self._pid != pid:
                if self._ssl is None:
                    self._ssl = httpx2.create_ssl_context()  # the trust httpx2's own transport has
                self._session = _process.run(self._open(self._ssl))
                _open_sessions.add(self._session)
                self._pid = pid
            return self._session

    async def _open(self, context: ssl.SSLContext) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, ssl=context)
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # the httpx2 client keeps the cookies
            auto_decompress=False,  # the httpx2 response decodes its content
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trust_env=False,  # a proxy is httpx2's (its mounts), never this transport's
            raise_for_status=False,
        )

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        session = self._session_here()
        body = request.read()
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _BODY_HEADERS]
        try:
            head = _process.run(self._exchange(session, request, headers, body), _bound_s(request))
        except TimeoutError:
            raise httpx2.ReadTimeout("the event loop did not answer", request=request) from None
        return httpx2.Response(
            head.status,
            headers=head.headers,
            stream=_Body(head, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason.encode("ascii", "replace")},
        )

    async def _exchange(
        self,
        session: aiohttp.ClientSession,
        request: httpx2.Request,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> _Head:
        sent = False
        try:
            answer = await session.request(
                request.method,
                yarl.URL(str(request.url), encoded=True),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=_timeout(request),
            )
            sent = True
            first = await answer.content.readany()
        except Exception as exc:
            raise _httpx2_error(exc, request, sent=sent or not _never_sent(exc)) from exc
        return _Head(
            status=answer.status,
            reason=answer.reason or "",
            headers=list(answer.raw_headers),
            first=first,
            ended=answer.content.at_eof(),
            answer=answer,
            loop=asyncio.get_running_loop(),
        )

    def close(self) -> None:
        with self._lock:
            session, self._session = self._session, None
            pid = self._pid
        if session is None or pid != os.getpid():
            return
        _open_sessions.discard(session)
        future = asyncio.run_coroutine_threadsafe(session.close(), _process.loop())
        try:
            future.result(CLOSE_WAIT_S)
        except TimeoutError:
            future.cancel()


def _never_sent(exc: BaseException) -> bool:
    """Whether aiohttp failed before the request could reach the server (no connection was made)."""
    return isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)
