"""The ASGI pieces the demo servers need: the lifespan, body reading, plain answers, SSE streams, dropped
connections."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Message = dict[str, Any]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_TYPE = "application/json"
SSE_TYPE = "text/event-stream"


def dumps(payload: object) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


async def lifespan(receive: Receive, send: Send, on_shutdown: Callable[[], None] | None = None) -> None:
    """Answer uvicorn's lifespan messages; ``on_shutdown`` runs before the shutdown is acknowledged."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if on_shutdown is not None:
                on_shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


def request_headers(scope: Scope) -> dict[str, str]:
    """Header names lower-cased; a repeated header keeps its last value."""
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}


def _header_list(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone away (call after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(
    send: Send,
    status: int,
    body: bytes = b"",
    *,
    headers: Mapping[str, str] | None = None,
    content_type: str | None = JSON_TYPE,
) -> None:
    all_headers = dict(headers or {})
    if content_type is not None and body:
        all_headers["content-type"] = content_type
    all_headers["content-length"] = str(len(body))
    await send({"type": "http.response.start", "status": status, "headers": _header_list(all_headers)})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def sse_event(message: object) -> bytes:
    """One SSE event the way the Python SDK frames it: CRLF line ends, `event: message`, no id."""
    return b"event: message\r\ndata: " + dumps(message) + b"\r\n\r\n"


class SseStream:
    """A `text/event-stream` answer; headers go out with the first event (or on `close`)."""

    def __init__(self, send: Send, headers: Mapping[str, str]) -> None:
        self._send = send
        self._headers = {
            **headers,
            "content-type": SSE_TYPE,
            "cache-control": "no-cache, no-transform",
            "x-accel-buffering": "no",
        }
        self.started = False

    async def start(self) -> None:
        if not self.started:
            self.started = True
            start = {"type": "http.response.start", "status": 200, "headers": _header_list(self._headers)}
            await self._send(start)

    async def write(self, data: bytes) -> None:
        await self.start()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def event(self, message: object) -> None:
        await self.write(sse_event(message))

    async def close(self) -> None:
        await self.start()
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


#: The pause between two bytes of a dribbled answer (:func:`dribble_answer`).
DRIBBLE_BYTE_S = 0.1


async def dribble_answer(send: Send, body: bytes, headers: Mapping[str, str]) -> None:
    """Answer 200 with ``body`` (JSON) a byte at a time, :data:`DRIBBLE_BYTE_S` apart, head included, on the
    TCP connection under this request (as :func:`drop_connection` reaches it), then close it: every byte
    comes well within a client's read timeout, the whole answer far past it. A client that gives up is
    let go (the connection closed)."""
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None:
        raise ConnectionAbortedError("this server cannot dribble an answer (not running under uvicorn)")
    lines = [
        "HTTP/1.1 200 OK",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
        "x-padding: " + "." * 200,  # a head of some 30 s alone: what a client reads before its body
    ]
    answer = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    for byte in answer:
        if transport.is_closing() or getattr(cycle, "disconnected", False):
            break
        transport.write(bytes([byte]))
        await asyncio.sleep(DRIBBLE_BYTE_S)
    await drop_connection(send)


async def drop_connection(send: Send) -> None:
    """Close the TCP connection under this request without finishing (or starting) an answer.

    ASGI has no message for this, so it reaches for the transport of the uvicorn request cycle that
    `send` is bound to; the client sees the connection close with no (or a partial) response.
    """
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None:
        raise ConnectionAbortedError("this server cannot drop a connection (not running under uvicorn)")
    transport.close()
    # Let uvicorn see the closed connection (connection_lost runs on a later loop turn) before this
    # request's coroutine returns, so it does not try to answer with a 500. Bounded: 1 s at most.
    for _ in range(1000):
        if getattr(cycle, "disconnected", True):
            return
        await asyncio.sleep(0.001)
