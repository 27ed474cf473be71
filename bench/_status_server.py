"""A small HTTP/1.1 server answering status reads, for ``bench/http_clients.py``: run in a process of its own.

It answers every JSON-RPC POST with a ``tasks/get``-sized "still working" result carrying the request's id
(the MCP transports match the answer by id), and every GET with an AIP-151 Operation that is not done. It
keeps connections alive and counts those it accepted: ``GET /_stats`` answers
``{"connections": n, "requests": m}``. Plain asyncio (no framework, no ASGI layer), so that the server takes
as little of the machine's CPU as it can while the client in the other process is measured.

Run: ``python bench/_status_server.py PORT [LATENCY_MS [CERT_FILE KEY_FILE]]`` (with a certificate and its
key it answers HTTPS; it prints ``listening`` once it accepts connections).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from dataclasses import dataclass

#: What a server says of a task still working (the MCP 2025-11-25 ``tasks/get`` result, as the demo
#: server answers it).
WORKING = {
    "taskId": "",
    "status": "working",
    "statusMessage": "still working",
    "createdAt": "2026-01-01T00:00:00Z",
    "lastUpdatedAt": "2026-01-01T00:00:00Z",
    "ttl": 3_600_000,
    "pollInterval": 5000,
}
#: An AIP-151 long-running operation not done yet.
OPERATION = {"name": "", "done": False, "metadata": {"progress": 10, "state": "RUNNING"}}


@dataclass
class Stats:
    connections: int = 0
    requests: int = 0


STATS = Stats()
#: How long the server takes to answer (``argv[2]``, ms): long enough that every member of a batch is
#: waiting for its answer at once, as on a real network, so a batch needs as many connections as members.
LATENCY_S = 0.0


def answer(status: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: keep-alive\r\n\r\n"
    )
    return head.encode("latin-1") + body


def reply(request_line: str, body: bytes) -> bytes:
    """The answer to one request."""
    method, _, rest = request_line.partition(" ")
    path = rest.partition(" ")[0]
    if path == "/_stats":
        return answer(
            "200 OK", json.dumps({"connections": STATS.connections, "requests": STATS.requests}).encode()
        )
    STATS.requests += 1
    if method == "GET":
        name = path.removeprefix("/v1/")  # the operation asked about
        return answer("200 OK", json.dumps({**OPERATION, "name": name}).encode())
    message = json.loads(body)
    params = message.get("params") or {}
    if "id" not in message:
        return answer("202 Accepted", b"")
    result = {**WORKING, "taskId": str(params.get("taskId", ""))}
    return answer("200 OK", json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}).encode())


class Connection(asyncio.Protocol):
    """One client connection: requests read one after another (HTTP/1.1 keep-alive, no pipelining needed)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.WriteTransport):
            self._transport = transport
        STATS.connections += 1

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            body = bytes(self._buffer[end + 4 : end + 4 + length])
            del self._buffer[: end + 4 + length]
            if self._transport is not None:
                asyncio.get_running_loop().call_later(LATENCY_S, self._transport.write, reply(head[0], body))


async def serve(port: int, tls: ssl.SSLContext | None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Connection, "127.0.0.1", port, backlog=1024, ssl=tls)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


if __name__ == "__main__":
    LATENCY_S = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.0
    asyncio.run(serve(int(sys.argv[1]), tls_context(*sys.argv[3:5]) if len(sys.argv) > 4 else None))
