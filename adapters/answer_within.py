"""httpx2's own transport with every answer bounded in time as a whole, its head included.

httpx2's transport (httpcore2) applies a request's ``read`` timeout to each read of the socket, not to the
answer: a server that sends its answer a byte at a time, each byte within the timeout, holds the caller for
as long as it likes. The adapters bound an answer's body themselves (``adapters.http_answers.Deadline``,
checked between the body's chunks), but the head is read inside the transport, before the adapter sees the
answer: a head dribbled a byte at a time held a Celery worker process (a create, a result, a cancel) or a
member thread (a status read) without end, and nothing said why.

Here the read timeout bounds the whole answer, counted from the moment the request was written: each read
of the socket waits at most what is left of it, and one past it is a ``ReadTimeout``, raised as httpx2's
transport raises any read past its timeout (so the adapters' mapping of faults is unchanged: the request
may have reached the server). An adapter's read timeout is already its whole answer's budget (its
``Deadline`` is the same number of seconds), so the only change is that the head is bounded too, and a body
ends at the deadline instead of a read timeout after it.

``adapters.socket_transport`` (the status reads) bounds its answers the same way, itself.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable
from typing import Any

import httpcore2
import httpx2

__all__ = ["WholeAnswerBackend", "answer_within_transport", "late", "read_wait"]


def read_wait(written_at: float | None, read_s: float | None) -> float | None:
    """How long the next read of an answer may wait: what is left of its read timeout ``read_s`` since its
    request was written at ``written_at`` (``time.monotonic``), at most 0 once its time is up; ``read_s``
    itself before the request was written, None when the request has no read timeout."""
    if read_s is None or written_at is None:
        return read_s
    return written_at + read_s - time.monotonic()


def late(read_s: float) -> str:
    """What a read past its answer's time says."""
    return f"the answer did not come whole within {read_s:g} s"


class _Stream(httpcore2.NetworkStream):
    """A connection whose reads end when the answer's time is up: the read timeout after the last write
    (a request's head and body are written before its answer is read; the next request on the connection
    writes again, and its answer has a time of its own)."""

    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner
        self._written_at: float | None = None

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        wait_s = read_wait(self._written_at, timeout)
        if wait_s is None or timeout is None:
            return self._inner.read(max_bytes, None)
        if wait_s <= 0:
            raise httpcore2.ReadTimeout(late(timeout))
        try:
            return self._inner.read(max_bytes, wait_s)
        except httpcore2.ReadTimeout as exc:
            raise httpcore2.ReadTimeout(late(timeout)) from exc

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            self._inner.write(buffer, timeout)
        finally:
            # Also when the write failed: httpcore2 then reads what the server may have answered before it
            # closed, and that read has a time of its own, not the previous request's on this connection.
            self._written_at = time.monotonic()

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore2.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class WholeAnswerBackend(httpcore2.NetworkBackend):
    """httpcore2's network backend (its sockets) with each answer bounded as a whole (see the module)."""

    def __init__(self, inner: httpcore2.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.NetworkStream:
        return _Stream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore2.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def answer_within_transport(limits: httpx2.Limits | None = None) -> httpx2.HTTPTransport:
    """httpx2's transport as httpx2 makes it (``limits``, by default its own; TLS verified as it verifies),
    its connections on :class:`WholeAnswerBackend`."""
    transport = httpx2.HTTPTransport() if limits is None else httpx2.HTTPTransport(limits=limits)
    # httpx2's transport takes no network backend: its pool's is wrapped (its arguments all kept; a pool
    # made again would build a second TLS context, about 25 ms).
    pool = transport._pool
    if not isinstance(pool, httpcore2.ConnectionPool) or not hasattr(pool, "_network_backend"):
        # An httpx2 or httpcore2 that keeps them otherwise: refused loudly, never a transport left unbounded.
        raise TypeError(f"httpx2's transport holds a {type(pool).__name__} this module cannot bound")
    pool._network_backend = WholeAnswerBackend(pool._network_backend)
    return transport
