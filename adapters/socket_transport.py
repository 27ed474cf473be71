"""An httpx2 transport that sends HTTP/1.1 on plain sockets of its own and parses the answers with httptools.

Issue 21 measured where the worker CPU of a status read goes (``bench/http_clients.py``): httpx2's own
transport (httpcore2's pool and h11, pure Python) is the largest part, and grows when a batch's members send
side by side on threads. :class:`LoopTransport` moved the exchange to aiohttp on an event loop, and paid for
the hand-over between threads wherever a read went alone. This transport does the exchange on the caller's
own thread, as httpx2's does, with a socket, ``sendall`` and ``recv``, and llhttp (the C parser of Node.js,
through ``httptools``) for the answer: no event loop, no hand-over, no per-byte Python.

It is httpx2's transport interface, so the adapters, their request hooks, cookies, redirect policy, decoding
and answer caps stay httpx2's; only the exchange on the socket is this module's:

- Connections are kept per origin and reused, newest first, while they are younger than
  :data:`KEEPALIVE_EXPIRY_S` since their last answer; one the server has closed (readable while idle: its
  end of file, or bytes nobody asked for) is dropped before a request is written on it. At most
  ``max_connections`` are open at once; a request past them waits for one to be free up to its ``pool``
  timeout (``PoolTimeout``).
- The request's ``timeout`` extension is honoured per phase: ``connect`` (the TCP connection and the TLS
  handshake), ``write`` (each write), ``pool``, as httpx2's transport does, and ``read`` for the whole
  answer from the moment the request was written, its head included (``adapters.answer_within`` does the
  same for httpx2's transport): a server dribbling its answer a byte at a time cannot hold the caller.
- The answer is streamed: the transport returns at the head, with what of the body came with it, and the
  caller reads the rest as it comes (an event stream; an answer over the caller's cap refused at its first
  read). An answer read to its end gives its connection back; one closed before its end closes it.
- A fault is raised as the httpx2 exception of the same meaning, so the adapters' mapping of faults
  (``map_transport_error``) stays exact: nothing was written (the connection or the pool failed) is
  ``ConnectError``/``ConnectTimeout``/``PoolTimeout``; once the request may be on its way, a ``WriteError``
  or ``WriteTimeout``, and then ``ReadTimeout``, ``ReadError`` or ``RemoteProtocolError``. A request is
  never sent again by this transport, on any connection.
- A forked child (a Celery prefork child) forgets its parent's connections (their sockets are the
  parent's too) and opens its own.

Only what an adapter's client sends: HTTP/1.1 ``http``/``https`` URLs, with a body of known length
(``HEAD`` and ``CONNECT`` are refused, as are header values with a line break). The workers send only the
polls' status reads on it (``workers.remote.StatusReadsApart``).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import httptools
import httpx2
from httpx2._decoders import MultiDecoder  # httpx2's own: what its client advertises, bounded

from adapters.answer_within import late, read_wait

__all__ = ["KEEPALIVE_EXPIRY_S", "AnswerHeaders", "LeanAnswer", "SocketTransport"]

#: How long a connection is kept idle for the next request (httpx2's default).
KEEPALIVE_EXPIRY_S = 5.0
#: How many bytes one read of a socket asks for.
READ_SIZE = 65_536
#: The largest head of an answer read (interim answers included), as httpx2's own transport bounds it: past
#: it, a server sending header lines without end is refused, not held in memory.
MAX_HEAD_BYTES = 65_536
#: The methods this transport sends (an answer to HEAD has a length and no body: the parser is not told).
METHODS = frozenset({b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"})
_DEFAULT_PORTS = {b"http": 80, b"https": 443}

#: Every transport of the process, so that a forked child forgets their connections.
_transports: weakref.WeakSet[SocketTransport] = weakref.WeakSet()


def _forget_in_child() -> None:
    for transport in list(_transports):
        transport._forget()


os.register_at_fork(after_in_child=_forget_in_child)


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    origin: tuple[bytes, bytes, int]
    idle_since: float = 0.0

    def readable(self) -> bool:
        """Something came while it was idle: the server's end of file or bytes nobody asked for."""
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass(eq=False)
class _Answer:
    """What the parser has read of one answer (httptools' callbacks): the final one, past any interim one
    (100 Continue, 103 Early Hints), and nothing past its end."""

    status: int = 0
    reason: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    head_done: bool = False
    done: bool = False
    #: the body runs to the connection's end (neither a length nor chunked)
    to_close: bool = False
    length_known: bool = False
    #: the answer lets its connection carry the next request (the parser says so only while the head ends)
    keep_alive: bool = False
    #: an interim answer is being read: the final one follows it
    interim: bool = False
    #: bytes came past the answer's end: the connection carries nothing more
    extra: bool = False
    parser: httptools.HttpResponseParser | None = None

    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True
            return
        self.headers = []
        self.reason = b""
        self.length_known = False

    def on_status(self, reason: bytes) -> None:
        if not self.extra:
            self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.extra:
            return
        self.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
        ):
            self.length_known = True

    def on_headers_complete(self) -> None:
        if self.extra or self.parser is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.interim = True
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if not self.extra and not self.interim:
            self.body.append(bytes(body))

    def on_message_complete(self) -> None:
        if self.extra:
            return
        if self.interim:
            self.interim = False
            return
        self.done = True


class _Exchange:
    """One request's exchange on one connection: its head read by :meth:`head`, its body by :meth:`chunks`."""

    def __init__(
        self, transport: SocketTransport, connection: _Connection, read_s: float | None, *, reusable: bool
    ) -> None:
        self._transport = transport
        self._reusable = reusable
        self._connection = connection
        self._read_s = read_s
        self._answer = _Answer()
        self._parser = self._answer.parser = httptools.HttpResponseParser(self._answer)
        self._received = 0
        self._finished = False
        self.sock = connection.sock
        #: When the request was written (:meth:`sent`): the answer's read time counts from there.
        self._written_at: float | None = None

    def sent(self) -> None:
        """The request is written: the whole answer, its head included, must come within the read timeout
        from now (each read waits only what is left of it: ``adapters.answer_within.read_wait``), not within
        a read timeout per read, which a server dribbling its answer a byte at a time would hold for ever."""
        self._written_at = time.monotonic()

    def head(self) -> _Answer:
        answer = self._answer
        while not answer.head_done:
            self._read()
        if answer.status == 101:
            raise httpx2.RemoteProtocolError("the server switched protocols (HTTP 101)")
        answer.to_close = not answer.length_known and not answer.done
        return answer

    def chunks(self) -> Iterator[bytes]:
        answer = self._answer
        while True:
            if answer.body:
                taken, answer.body = answer.body, []
                yield from taken
            if answer.done:
                return
            self._read()

    def close(self) -> None:
        """The caller is done: a connection whose answer was read to its end is kept for the next request."""
        if self._finished:
            return
        self._finished = True
        answer = self._answer
        keep = (
            self._reusable and answer.done and answer.keep_alive and not answer.to_close and not answer.extra
        )
        self._transport._give_back(self._connection, keep=keep)

    def _read(self) -> None:
        sock = self._connection.sock
        wait_s = read_wait(self._written_at, self._read_s)
        if wait_s is not None and wait_s <= 0:
            raise httpx2.ReadTimeout(late(self._read_s or 0.0))
        try:
            sock.settimeout(wait_s)
            data = sock.recv(READ_SIZE)
        except TimeoutError as exc:
            raise httpx2.ReadTimeout(late(self._read_s or 0.0)) from exc
        except OSError as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc
        if not data:
            if self._answer.head_done and self._answer.to_close:
                self._answer.done = True  # a body that runs to the connection's end has ended
                return
            if not self._received:
                raise httpx2.RemoteProtocolError("Server disconnected without sending a response.")
            raise httpx2.RemoteProtocolError("the server closed the connection before the answer's end")
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # The callbacks raise nothing of their own: this is what interrupted them (a signal's exception).
            raise (exc.__context__ or exc) from None
        except httptools.HttpParserUpgrade as exc:
            raise httpx2.RemoteProtocolError("the server upgraded the connection") from exc
        except httptools.HttpParserError as exc:
            if self._answer.done:  # past the answer's end: the answer stands, the connection is not kept
                self._answer.extra = True
                return
            raise httpx2.RemoteProtocolError(f"malformed answer: {exc}") from exc
        if not self._answer.head_done and self._received > MAX_HEAD_BYTES:
            raise httpx2.RemoteProtocolError(f"the answer's head is larger than {MAX_HEAD_BYTES} bytes")


def _speaks_http1(sock: ssl.SSLSocket) -> None:
    """A TLS connection whose server chose another protocol than HTTP/1.1 (a context offering h2) is
    refused."""
    chosen = sock.selected_alpn_protocol()
    if chosen not in (None, "http/1.1"):
        raise ssl.SSLError(f"the server chose {chosen}, not HTTP/1.1")


class _NetworkStream:
    """The answer's ``network_stream`` extension, as httpx2's transport gives it: its socket, which an event
    stream's reader watches for the stream's end (``adapters.http_answers._finish_stream``) so that a
    whole stream lets its connection be kept."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def get_extra_info(self, info: str) -> object:
        return self._sock if info == "socket" else None


class _Body(httpx2.SyncByteStream):
    def __init__(self, exchange: _Exchange) -> None:
        self._exchange = exchange

    def __iter__(self) -> Iterator[bytes]:
        yield from self._exchange.chunks()

    def close(self) -> None:
        self._exchange.close()


class AnswerHeaders(Mapping[str, str]):
    """An answer's header fields as httpx2's ``Headers`` reads them: names in any case, a name sent more
    than once read as its values joined by ``", "``, every value decoded with the one encoding that
    decodes them all (ASCII, else UTF-8, else Latin-1)."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        encoding = _encoding_of(raw)
        self._fields: dict[str, str] = {}
        for name, value in raw:
            key = name.decode("latin-1").lower()
            text = value.decode(encoding)
            self._fields[key] = f"{self._fields[key]}, {text}" if key in self._fields else text

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


def _encoding_of(raw: list[tuple[bytes, bytes]]) -> str:
    for encoding in ("ascii", "utf-8"):
        try:
            for name, value in raw:
                name.decode(encoding)
                value.decode(encoding)
        except UnicodeDecodeError:
            continue
        return encoding
    return "iso-8859-1"


class LeanAnswer:
    """An answer :meth:`SocketTransport.send_bytes` read to its head: what of httpx2's ``Response`` the
    adapters read (``status_code``, ``headers``, ``extensions``' ``network_stream``, ``iter_bytes`` with the
    ``Content-Encoding`` undone, ``close``) without building its models. Closed, or read to its end, it
    gives its connection back as httpx2's answer does."""

    def __init__(self, answer: _Answer, exchange: _Exchange) -> None:
        self.status_code = answer.status
        self.reason_phrase = answer.reason.decode("latin-1")
        self.headers = AnswerHeaders(answer.headers)
        self.extensions: dict[str, object] = {
            "http_version": b"HTTP/1.1",
            "reason_phrase": answer.reason,
            "network_stream": _NetworkStream(exchange.sock),
        }
        self._exchange = exchange
        self._consumed = False

    def iter_raw(self) -> Iterator[bytes]:
        if self._consumed:
            raise httpx2.StreamConsumed()
        self._consumed = True
        try:
            yield from self._exchange.chunks()
        finally:
            self.close()

    def iter_bytes(self) -> Iterator[bytes]:
        """The body with its ``Content-Encoding`` undone by httpx2's own decoders, as httpx2 undoes it (the
        codings it supports and advertises, at most five, each call inflating at most 1 MiB: a small
        answer that inflates to gigabytes is refused by the reader's cap as it comes, not held whole)."""
        codings = [coding.strip().lower() for coding in self.headers.get("content-encoding", "").split(",")]
        decoder = MultiDecoder([coding for coding in codings if coding and coding != "identity"])
        if not decoder.children:
            yield from self.iter_raw()
            return
        for raw in self.iter_raw():
            yield from (chunk for chunk in decoder.decode(raw) if chunk)
        yield from (chunk for chunk in decoder.flush() if chunk)

    def close(self) -> None:
        self._exchange.close()

    def __enter__(self) -> LeanAnswer:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()


class SocketTransport(httpx2.BaseTransport):
    """HTTP/1.1 on sockets of its own, answers parsed by httptools (see the module's docstring).
    ``ssl_context``: how ``https`` connections are verified (by default as httpx2's own transport does:
    ``httpx2.create_ssl_context()``: the system's trust store, ``SSL_CERT_FILE``, ``SSL_CERT_DIR``)."""

    def __init__(
        self,
        *,
        max_connections: int = 100,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._max = max_connections
        self._expiry_s = keepalive_expiry_s
        self._ssl_context = ssl_context
        self._open: set[_Connection] = set()
        self._forget()
        _transports.add(self)

    def _forget(self) -> None:
        """No connections (at the start; in a forked child, whose parent's sockets are the parent's: their
        copies here are closed, which closes nothing of the parent's)."""
        for connection in self._open:
            connection.close()
        self._lock = threading.Lock()
        self._tls_lock = threading.Lock()
        self._free = threading.Condition(self._lock)
        self._idle: dict[tuple[bytes, bytes, int], list[_Connection]] = {}
        self._open = set()
        self._connecting = 0
        self._closed = False

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        scheme = url.raw_scheme
        if scheme not in _DEFAULT_PORTS:
            raise httpx2.UnsupportedProtocol(f"the URL's scheme is not http or https: {url}")
        if not url.raw_host:
            raise httpx2.UnsupportedProtocol(f"the URL has no host: {url}")
        method = request.method.encode("ascii")
        if method not in METHODS:
            raise httpx2.UnsupportedProtocol(f"this transport does not send {request.method}")
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        head, reusable = self._head(request, method)
        origin = (scheme, url.raw_host, url.port or _DEFAULT_PORTS[scheme])
        exchange, answer = self._exchange(origin, head + request.read(), timeouts, reusable=reusable)
        return httpx2.Response(
            answer.status,
            headers=answer.headers,
            stream=_Body(exchange),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": answer.reason,
                "network_stream": _NetworkStream(exchange.sock),
            },
        )

    def send_bytes(self, url: httpx2.URL, request: bytes, timeouts: Mapping[str, float | None]) -> LeanAnswer:
        """``request`` (its head, written by the caller, and its body) sent to ``url``'s origin as
        :meth:`handle_request` sends one, its answer returned at its head, without httpx2's models:
        :class:`LeanAnswer` (``adapters.lean_client``). The caller writes a head this transport would
        write: no body of unknown length, no line break in a header, ``Connection: close`` not asked.

        Raises:
            httpx2.HTTPError: as :meth:`handle_request` raises them.
        """
        scheme = url.raw_scheme
        if scheme not in _DEFAULT_PORTS or not url.raw_host:
            raise httpx2.UnsupportedProtocol(f"the URL is not an http or https URL with a host: {url}")
        origin = (scheme, url.raw_host, url.port or _DEFAULT_PORTS[scheme])
        exchange, answer = self._exchange(origin, request, timeouts, reusable=True)
        return LeanAnswer(answer, exchange)

    def _exchange(
        self,
        origin: tuple[bytes, bytes, int],
        request: bytes,
        timeouts: Mapping[str, float | None],
        *,
        reusable: bool,
    ) -> tuple[_Exchange, _Answer]:
        """``request`` written on a connection to ``origin`` and its answer read to the end of its head."""
        connection = self._take(origin, timeouts.get("pool"), timeouts.get("connect"))
        try:
            exchange = _Exchange(self, connection, timeouts.get("read"), reusable=reusable)
            self._write(connection, request, timeouts.get("write"))
            exchange.sent()
            return exchange, exchange.head()
        except BaseException:
            self._give_back(connection, keep=False)
            raise

    @staticmethod
    def _head(request: httpx2.Request, method: bytes) -> tuple[bytes, bool]:
        """The request's head, and whether its connection may carry another request after it (not when the
        request asks for its close)."""
        lines = [method, b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
        chunked = False
        reusable = True
        for name, value in request.headers.raw:
            if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name or b":" in name:
                raise httpx2.LocalProtocolError(f"a header ({name!r}) holds a line break or a colon")
            lowered = name.lower()
            if lowered == b"transfer-encoding":
                chunked = True
            elif lowered == b"connection" and b"close" in value.lower():
                reusable = False
            lines += (name, b": ", value, b"\r\n")
        if chunked:
            raise httpx2.LocalProtocolError("this transport sends bodies of a known length only")
        lines.append(b"\r\n")
        return b"".join(lines), reusable

    @staticmethod
    def _write(connection: _Connection, data: bytes, write_s: float | None) -> None:
        try:
            connection.sock.settimeout(write_s)
            connection.sock.sendall(data)
        except TimeoutError as exc:
            raise httpx2.WriteTimeout(f"the request was not written within {write_s} s") from exc
        except OSError as exc:
            raise httpx2.WriteError(str(exc) or type(exc).__name__) from exc

    def _take(
        self, origin: tuple[bytes, bytes, int], pool_s: float | None, connect_s: float | None
    ) -> _Connection:
        """A connection to ``origin``: an idle one still good, else a new one when there is room, else the
        first one given back within ``pool_s``."""
        idle = self._idle_or_room(origin, pool_s)
        if idle is not None:
            return idle
        try:  # the room is this request's until the connection is made, or not
            connection = _Connection(self._connect(origin, connect_s), origin)
        except BaseException:
            with self._lock:
                self._connecting -= 1
                self._free.notify()
            raise
        with self._lock:
            self._open.add(connection)
            self._connecting -= 1
        return connection

    def _idle_or_room(self, origin: tuple[bytes, bytes, int], pool_s: float | None) -> _Connection | None:
        """An idle connection to ``origin`` still good (the stale ones closed on the way), else None with the
        room for a new one kept (``_connecting``), waiting up to ``pool_s`` for either."""
        deadline = None if pool_s is None else time.monotonic() + pool_s
        with self._lock:
            while True:
                if self._closed:
                    raise httpx2.ConnectError("the transport is closed")
                idle = self._idle.get(origin)
                now = time.monotonic()
                while idle:
                    connection = idle.pop()
                    if now - connection.idle_since < self._expiry_s and not connection.readable():
                        return connection
                    self._open.discard(connection)
                    connection.close()  # a close of a socket does not wait
                if len(self._open) + self._connecting < self._max:
                    self._connecting += 1
                    return None
                if self._free_one_idle():
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise httpx2.PoolTimeout(f"no connection was free within {pool_s} s")
                self._free.wait(left)

    def _free_one_idle(self) -> bool:
        """Close the oldest idle connection to any origin (the pool is full, and a request to another origin
        waits); True if there was one. Called under the lock."""
        oldest: _Connection | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        self._idle[oldest.origin].remove(oldest)
        self._open.discard(oldest)
        oldest.close()
        return True

    def _connect(self, origin: tuple[bytes, bytes, int], connect_s: float | None) -> socket.socket:
        scheme, raw_host, port = origin
        host = raw_host.decode("ascii").strip("[]")
        try:
            sock = socket.create_connection((host, port), timeout=connect_s)
        except TimeoutError as exc:
            raise httpx2.ConnectTimeout(f"no connection to {host}:{port} within {connect_s} s") from exc
        except OSError as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == b"https":
                sock = self._tls().wrap_socket(sock, server_hostname=host)  # the handshake, within connect_s
                _speaks_http1(sock)
        except TimeoutError as exc:
            sock.close()
            raise httpx2.ConnectTimeout(f"no TLS handshake with {host}:{port} within {connect_s} s") from exc
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc
        return sock

    def _tls(self) -> ssl.SSLContext:
        """The context of this transport's TLS connections: the one given, else httpx2's default, made once
        (offering HTTP/1.1 alone, as httpx2's transport does)."""
        with self._tls_lock:
            if self._ssl_context is None:
                context = httpx2.create_ssl_context()
                context.set_alpn_protocols(["http/1.1"])
                self._ssl_context = context
            return self._ssl_context

    def _give_back(self, connection: _Connection, *, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed and connection in self._open:
                connection.idle_since = time.monotonic()
                self._idle.setdefault(connection.origin, []).append(connection)
            else:
                self._open.discard(connection)
                connection.close()
            self._free.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [connection for connections in self._idle.values() for connection in connections]
            self._idle.clear()
            for connection in idle:
                self._open.discard(connection)
            self._free.notify_all()
        for connection in idle:
            connection.close()
