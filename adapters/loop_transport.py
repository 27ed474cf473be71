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
import concurrent.futures
import os
import ssl
import threading
from collections.abc import Callable, Coroutine, Iterator
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


#: What a request that the loop did not answer in time is failed with.
LOOP_SILENT = "the event loop did not answer"


def _bound_s(request: httpx2.Request, *, reads: int = 2) -> float | None:
    """The longest one step of a request may take on the loop by its timeouts (getting a connection, the
    write and the head's reads; or one read of the body: ``reads=1``), and a margin; None when one of them
    is unbounded (the adapters' ``Timeouts`` bound all four). aiohttp's read timeout restarts with each read
    of the head, and is rounded up to a whole second past 5 s: the head may take twice the read timeout."""
    phases: dict[str, float | None] = request.extensions.get("timeout", {})
    pool, connect, write, read = (phases.get(phase) for phase in ("pool", "connect", "write", "read"))
    if pool is None or connect is None or write is None or read is None:
        return None
    if reads == 1:
        return read + 1.0 + LOOP_MARGIN_S
    return pool + connect + write + reads * (read + 1.0) + LOOP_MARGIN_S


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

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        bound_s: float | None = None,
        *,
        if_late: Callable[[T], None] | None = None,
    ) -> T:
        """``coro``'s result, run on the loop (its exception raised here); past ``bound_s``, it is
        cancelled and ``TimeoutError`` raised, and a result that comes all the same is given to
        ``if_late`` on the loop (an answer nobody reads: closed)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop())
        try:
            return future.result(bound_s)
        except (TimeoutError, concurrent.futures.CancelledError):
            if not future.cancel() and if_late is not None:
                late = if_late
                future.add_done_callback(lambda done: _give_late(done, late))
            raise TimeoutError from None

    def forget_locks(self) -> None:
        """A forked child's start: a lock a parent's thread held at the fork is held for ever here."""
        self._lock = threading.Lock()

    def owns(self, loop: asyncio.AbstractEventLoop) -> bool:
        with self._lock:
            return loop is self._loop and self._pid == os.getpid()


def _give_late(done: concurrent.futures.Future[T], if_late: Callable[[T], None]) -> None:
    if not done.cancelled() and done.exception() is None:
        if_late(done.result())


_process = _ProcessLoop()
os.register_at_fork(after_in_child=_process.forget_locks)


def process_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop (the one thread every :class:`LoopTransport` of the process sends on)."""
    return _process.loop()


@dataclass(frozen=True, slots=True)
class _Head:
    """An answer's head and what the loop had of its body when it came."""

    status: int
    reason: str
    version: bytes
    headers: list[tuple[bytes, bytes]]
    first: bytes
    ended: bool
    answer: aiohttp.ClientResponse
    loop: asyncio.AbstractEventLoop
    #: What reading the body met already: raised where httpx2's would be, on the body's first read.
    fault: httpx2.TransportError | None = None

    def close(self) -> None:
        """On the loop: the answer nobody will read closed (its connection is not kept)."""
        self.answer.close()


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
        if self._head.fault is not None:
            raise self._head.fault
        answer = self._head.answer
        bound = _bound_s(self._request, reads=1)
        while not self._ended:
            try:
                chunk = _process.run(_read_chunk(answer, self._request), bound)
            except TimeoutError:
                raise httpx2.ReadTimeout(LOOP_SILENT, request=self._request) from None
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


def _buffered(
    answer: aiohttp.ClientResponse, request: httpx2.Request
) -> tuple[bytes, httpx2.TransportError | None]:
    """What of the body came with the head (a small answer: all of it), without waiting for more; and the
    fault the body met already, if any."""
    try:
        return answer.content.read_nowait(), None
    except Exception as exc:  # noqa: BLE001 -- whatever the body met is raised at its first read
        return b"", _httpx2_error(exc, request, sent=True)


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
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return httpx2.UnsupportedProtocol(text, request=request)
    if isinstance(exc, aiohttp.ClientConnectionError | OSError):  # the connection broke under it
        return httpx2.ReadError(text, request=request)
    if isinstance(exc, ValueError):  # a header or body aiohttp refused to send
        return httpx2.LocalProtocolError(text, request=request)
    return httpx2.TransportError(text, request=request)


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
                try:
                    self._session = _process.run(self._open(self._ssl), CLOSE_WAIT_S)
                except TimeoutError:
                    raise httpx2.PoolTimeout(LOOP_SILENT) from None
                _open_sessions.add(self._session)
                self._pid = pid
            return self._session

    async def _open(self, context: ssl.SSLContext) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, ssl=context)
        session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),  # the httpx2 client keeps the cookies
            auto_decompress=False,  # the httpx2 response decodes its content
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trust_env=False,  # a proxy is httpx2's (its mounts), never this transport's
            raise_for_status=False,
        )
        # aiohttp sends an idempotent request (an AIP-151 GET) again, once, when its connection breaks: a
        # second request the server's budget never paid for (rule 4). A failed read is the step's to retry.
        session._retry_connection = False
        return session

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        session = self._session_here()
        body = request.read()
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _BODY_HEADERS]
        try:
            head = _process.run(
                self._exchange(session, request, headers, body), _bound_s(request), if_late=_close_late
            )
        except TimeoutError:
            raise httpx2.ReadTimeout(LOOP_SILENT, request=request) from None
        return httpx2.Response(
            head.status,
            headers=head.headers,
            stream=_Body(head, request),
            extensions={
                "http_version": head.version,
                "reason_phrase": head.reason.encode("ascii", "replace"),
            },
        )

    async def _exchange(
        self,
        session: aiohttp.ClientSession,
        request: httpx2.Request,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> _Head:
        try:
            answer = await session.request(
                request.method,
                yarl.URL(str(request.url), encoded=True),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=_timeout(request),
            )
        except Exception as exc:
            raise _httpx2_error(exc, request, sent=not _never_sent(exc)) from exc
        try:
            first, fault = _buffered(answer, request)
            version = answer.version
            return _Head(
                status=answer.status,
                reason=answer.reason or "",
                version=b"HTTP/%d.%d" % (version.major, version.minor) if version else b"HTTP/1.1",
                headers=list(answer.raw_headers),
                first=first,
                ended=fault is None and answer.content.at_eof(),
                answer=answer,
                loop=asyncio.get_running_loop(),
                fault=fault,
            )
        except BaseException:
            answer.close()  # its connection is not kept, nor left for the collector to close off the loop
            raise

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


def _close_late(head: _Head) -> None:
    head.close()


def _never_sent(exc: BaseException) -> bool:
    """Whether aiohttp failed before the request could reach the server (no connection was made)."""
    return isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)
