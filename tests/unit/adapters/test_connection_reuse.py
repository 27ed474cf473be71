"""A server's connections are reused from one poll batch to the next (issue 21): the client of a server keeps
as many connections alive as a batch has members, so the members of every batch after the first find theirs
open. httpx and httpx2 keep 20 by default: a batch of 32 closed 12 of its connections and opened 12 again
every batch.

A real HTTP server on loopback counts the TCP connections it accepts, and answers nothing until the whole
batch is waiting for its answer (as over a real network, where every member's request is in flight at once).
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from adapters import Limits, RemoteRef, Timeouts, http_client
from adapters.streamable_http import Session, StreamableHttpClient
from tests.support.http_servers import QuietHandler, serving
from tests.unit.adapters.mcp_fakes import result_message
from workers.runtime import Runtime
from workers.settings import FleetConfig, Settings

#: A batch larger than the 20 connections an httpx2 client keeps alive by default.
BATCH = 32
ROUNDS = 3
#: The longest a request waits for the rest of its batch to arrive before the server gives up on it.
BATCH_WAIT_S = 20.0


class _ConnectionsCounted(http.server.ThreadingHTTPServer):
    """A server on loopback that counts the TCP connections it accepts."""

    daemon_threads = True
    connections = 0

    def process_request(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any
    ) -> None:
        self.connections += 1  # called in the serving thread alone, once per connection accepted
        super().process_request(request, client_address)


class _CountingServer(_ConnectionsCounted):
    """Counts the connections it accepts; holds each answer until ``BATCH`` requests are waiting."""

    # The listen backlog: a batch's connections arrive at once (socketserver's default of 5 drops the rest
    # of the SYNs, retried a second and more later: under CI's load, past the batch's wait, which then
    # fails every request of the batch with "Server disconnected").
    request_queue_size = 4 * BATCH

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _BatchHandler)
        self.batch = threading.Barrier(BATCH, timeout=BATCH_WAIT_S)


class _BatchHandler(QuietHandler):
    """An MCP ``tasks/get`` answer to a POST, an AIP-151 Operation to a GET, once the batch is all here."""

    server: _CountingServer

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        task = {
            "taskId": request["params"]["taskId"],
            "status": "working",
            "createdAt": "2026-01-01T00:00:00Z",
        }
        self._answer(result_message(request["id"], task))

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        self._answer({"name": self.path.removeprefix("/v1/"), "done": False})

    def _answer(self, message: dict[str, Any]) -> None:
        self.server.batch.wait()
        self.answer(200, json.dumps(message).encode(), "application/json")


@dataclass
class Served:
    url: str
    server: _CountingServer


@pytest.fixture
def counting_server() -> Iterator[Served]:
    server = _CountingServer()
    # a request still waiting (a failed test) is answered
    with serving(server, before_stop=server.batch.abort) as url:
        yield Served(url, server)


def in_batches(read: Callable[[], object]) -> None:
    """``ROUNDS`` batches of ``BATCH`` status reads side by side, as a worker runs a poll batch."""
    with ThreadPoolExecutor(BATCH) as threads:
        for _ in range(ROUNDS):
            for future in [threads.submit(read) for _ in range(BATCH)]:
                future.result()


def test_the_adapters_client_keeps_a_batchs_connections_alive(counting_server: Served) -> None:
    with http_client(Timeouts(), connections=BATCH) as http:
        client = StreamableHttpClient(
            http, counting_server.url + "/mcp", bearer_token=None, timeouts=Timeouts(), limits=Limits()
        )
        session = Session(session_id="s1", protocol_version="2025-11-25")
        in_batches(lambda: client.request("tasks/get", {"taskId": "t1"}, session=session, idempotent=True))
    assert counting_server.server.connections == BATCH  # 56 with the default 20 kept: 32, then 12 a batch


def test_a_workers_clients_keep_as_many_connections_as_its_poll_batch(counting_server: Served) -> None:
    """Through the worker's own pool of adapters: ``poll_batch`` sets how many connections each keeps."""
    fleet = FleetConfig.model_validate(
        {"servers": {"ops": {"protocol": "aip151", "protocol_version": "v1", "url": counting_server.url}}}
    )
    runtime = Runtime(settings=Settings(poll_batch=BATCH), fleet=fleet)
    try:
        adapter = runtime.remote.adapter("ops")
        ref = RemoteRef(
            remote_id="operations/op-1", session_ref=None, protocol_version="v1", protocol="aip151"
        )
        in_batches(lambda: adapter.get(ref))
    finally:
        runtime.close()
    assert counting_server.server.connections == BATCH


class _AcceptingServer(_ConnectionsCounted):
    """Counts the connections it accepts; answers every POST ``202 Accepted`` with an empty body, as an MCP
    server answers a notification or a response (``notifications/initialized``, an input reply)."""

    def __init__(self, *, body_never_comes: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _AcceptingHandler)
        self.body_never_comes = body_never_comes
        self.stop = threading.Event()


class _AcceptingHandler(QuietHandler):
    server: _AcceptingServer

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        if not self.server.body_never_comes:
            self.answer(202, b"", "application/json")
            return
        # a 202 that declares a body of 10 bytes and sends 2 of them
        self.send_response(202)
        self.send_header("Content-Length", "10")
        self.end_headers()
        self.wfile.write(b"{}")
        self.wfile.flush()
        self.server.stop.wait(10)
        self.close_connection = True


def test_a_202_keeps_its_connection_for_the_next_message() -> None:
    """A 202's empty body is read to its end, so the connection goes back to the pool: a session's
    ``notifications/initialized`` and the requests after it share one connection (before, the answer was
    left unread and httpx2 closed the connection, one more TCP and TLS handshake per session started)."""
    server = _AcceptingServer()
    with serving(server) as url, http_client(Timeouts(), connections=4) as http:
        client = StreamableHttpClient(
            http, url + "/mcp", bearer_token=None, timeouts=Timeouts(), limits=Limits()
        )
        session = Session(session_id="s1", protocol_version="2025-11-25")
        for _ in range(3):
            client.post_message(
                {"jsonrpc": "2.0", "method": "notifications/initialized"},
                session=session,
                what="notification",
            )
    assert server.connections == 1


def test_a_202_whose_short_body_never_comes_is_still_accepted_within_the_read_timeout() -> None:
    """The message was accepted at the 202: a body that then stalls costs its connection, never the
    message's outcome, and is waited for no longer than the read timeout."""
    server = _AcceptingServer(body_never_comes=True)
    with serving(server, before_stop=server.stop.set) as url, http_client(Timeouts(read=0.5)) as http:
        client = StreamableHttpClient(
            http, url + "/mcp", bearer_token=None, timeouts=Timeouts(read=0.5), limits=Limits()
        )
        session = Session(session_id="s1", protocol_version="2025-11-25")
        started = time.monotonic()
        client.post_message({"jsonrpc": "2.0", "id": "r1", "result": {}}, session=session, what="reply")
        assert time.monotonic() - started < 5.0
