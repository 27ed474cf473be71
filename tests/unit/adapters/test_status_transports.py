"""The status reads' transports (issue 21): on sockets parsed by httptools
(``adapters/socket_transport.py``) and on the process's event loop (``adapters/loop_transport.py``). Behind
an httpx2 client each sends and answers as httpx2's own transport does, against a real HTTP server on
loopback: the request's headers and body as the client made them, the answer streamed, decoded and its
cookies kept by the client, the request's timeouts, every fault raised as the httpx2 error of the same
meaning (the adapters' ``map_transport_error`` tells a request never sent from one that may have reached the
server by it), its connections reused, and a forked child (a Celery prefork child) sending on connections
(and a loop) of its own.
"""

from __future__ import annotations

import collections
import gzip
import http.server
import json
import multiprocessing
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest

from adapters import AnswerTooLarge, Limits, OutcomeUnknown, RemoteRef, Timeouts, http_client, loop_transport
from adapters.http_answers import read_bounded
from adapters.lean_client import LeanClient
from adapters.loop_transport import LoopTransport
from adapters.socket_transport import SocketTransport
from adapters.streamable_http import StreamableHttpClient
from tests.support.http_servers import QuietHandler, serving
from workers.budget import BUDGET_HEADER, TokenBudget
from workers.remote import RemotePool, StatusReadsApart
from workers.request_outcomes import RequestOutcomes
from workers.runtime import Runtime
from workers.settings import FleetConfig, Settings

#: How long a forked child is given to stop once killed.
CHILD_STOP_S = 5.0
#: How long a request to the test's server may take here at most (bounds every wait of the tests).
ANSWER_S = 10.0
#: The pause between two bytes of a dribbled answer: far below a read timeout (the answers take 5 s whole).
DRIBBLE_S = 0.05


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.hits: collections.Counter[str] = collections.Counter()  # requests seen, by path
        self.release = threading.Event()  # lets /slow answer

    def process_request(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any
    ) -> None:
        self.connections += 1
        super().process_request(request, client_address)


class _Handler(QuietHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        self._route(body)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        self._route(b"")

    def _route(self, body: bytes) -> None:
        path = self.path
        self.server.hits[path] += 1
        if path == "/echo":
            seen = {"headers": [[k.lower(), v] for k, v in self.headers.items()], "body": body.decode()}
            self.answer(200, json.dumps(seen).encode(), "application/json", extra=(("Set-Cookie", "lb=a1"),))
        elif path.endswith(("/gzip", "/op-1")):
            name = path.removeprefix("/v1/").removeprefix("/")
            operation = json.dumps({"name": name, "done": False}).encode()
            self.answer(
                200, gzip.compress(operation), "application/json", extra=(("Content-Encoding", "gzip"),)
            )
        elif path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for n in range(3):
                event = f"id: {n}\ndata: {n}\n\n".encode()
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/long":
            self.answer(200, b"x" * 20_000_000, "application/octet-stream")  # more than any buffer holds
        elif path == "/cut":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'{"done":')
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif path == "/head-only":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.flush()
            time.sleep(0.1)  # the head is read alone
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif path == "/slow":
            self.server.release.wait(ANSWER_S)
            self.answer(200, b"{}", "application/json")
        elif path == "/closes-when-idle":
            # kept alive by its head, then closed by the server while idle (as a server's idle timeout does)
            self.answer(200, b"{}", "application/json")
            self.wfile.flush()
            time.sleep(0.1)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif path == "/interim":
            self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n")
            self.answer(200, b'{"final": true}', "application/json")
        elif path == "/to-close":
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b'{"whole": true}'
            )
            self.close_connection = True
        elif path == "/extra":
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}garbage past the end\r\n\r\n")
        elif path == "/closes-after":
            self.answer(200, b"{}", "application/json", extra=(("Connection", "close"),))
            self.close_connection = True
        elif path == "/endless-head":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            try:
                for n in range(100_000):  # 3 MB of header lines, never the head's end
                    self.wfile.write(f"X-Line-{n}: {'y' * 20}\r\n".encode())
            except OSError:
                pass  # the client gave up: what the test wants
            self.close_connection = True
        elif path == "/sse-answer":
            request_id = json.loads(body)["id"]
            sse = (
                f"event: message\ndata: {json.dumps({'jsonrpc': '2.0', 'id': request_id, 'result': {}})}\n\n"
            )
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(f"{len(sse):x}\r\n{sse}\r\n".encode())
            self.wfile.flush()
            time.sleep(0.005)  # the stream's end comes just after its response, as a server's does
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/held":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{")
            self.wfile.flush()
            self.server.release.wait(ANSWER_S)
            self.wfile.write(b"}")
        elif path in ("/dribble-head", "/dribble-body"):
            # A whole answer a byte at a time, each byte well within a read timeout, the whole far past it.
            body = b'{"pad": "' + b"z" * 40 + b'"}'
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            head += "X-Pad: " + "y" * 40 + "\r\n\r\n"
            whole = head.encode() + body
            at_once, dribbled = (b"", whole) if path == "/dribble-head" else (head.encode(), body)
            try:
                self.wfile.write(at_once)
                self.wfile.flush()
                for byte in dribbled:  # about 5 s for either part
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(DRIBBLE_S)
            except OSError:
                pass  # the client gave up: what the test wants
            self.close_connection = True
        elif path == "/bomb":
            # 16 MiB of zeros, gzipped twice: a few KiB on the wire
            layers = int(self.headers.get("x-layers", "2"))
            bomb = b"\0" * (16 * 2**20)
            for _ in range(layers):
                bomb = gzip.compress(bomb)
            coding = ", ".join(["gzip"] * layers)
            self.answer(200, bomb, "application/json", extra=(("Content-Encoding", coding),))
        elif path == "/task":
            request = json.loads(body)
            task = {
                "taskId": request["params"]["taskId"],
                "status": "working",
                "createdAt": "2026-01-01T00:00:00Z",
            }
            message = {"jsonrpc": "2.0", "id": request["id"], "result": task}
            self.answer(200, json.dumps(message).encode(), "application/json")
        elif path == "/hang-up":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        else:
            self.answer(429, b'{"error": "slow down"}', "application/json", extra=(("Retry-After", "3"),))


@dataclass
class Served:
    url: str
    server: _Server


@pytest.fixture
def served() -> Iterator[Served]:
    server = _Server()
    # a request still waiting (a failed test) is answered
    with serving(server, before_stop=server.release.set) as url:
        yield Served(url, server)


def _reads_transport(kind: str) -> httpx2.BaseTransport:
    return LoopTransport(max_connections=8) if kind == "loop" else SocketTransport(max_connections=8)


@pytest.fixture(params=["sockets", "loop"])
def client(request: pytest.FixtureRequest) -> Iterator[httpx2.Client]:
    """An adapter's client (``adapters.http_client``) whose every request goes on one status reads'
    transport."""
    with http_client(
        Timeouts(connect=2.0, read=ANSWER_S),
        connections=4,
        wrap_transport=lambda _inner: _reads_transport(request.param),
    ) as made:
        yield made


@pytest.fixture
def loop_client() -> Iterator[httpx2.Client]:
    """An adapter's client whose every request goes on the loop."""
    with http_client(
        Timeouts(connect=2.0, read=ANSWER_S),
        connections=4,
        wrap_transport=lambda _inner: LoopTransport(max_connections=8),
    ) as made:
        yield made


def test_the_request_goes_as_the_client_made_it_and_the_answer_comes_back_whole(
    served: Served, client: httpx2.Client
) -> None:
    answer = client.post(
        served.url + "/echo", json={"jsonrpc": "2.0", "id": 1}, headers={"Authorization": "Bearer t"}
    )
    assert answer.status_code == 200
    seen = answer.json()
    headers = dict(seen["headers"])
    assert json.loads(seen["body"]) == {"jsonrpc": "2.0", "id": 1}
    assert headers["authorization"] == "Bearer t"
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(seen["body"]))
    assert headers["user-agent"].startswith("python-httpx")  # the client's, nothing of aiohttp's
    assert [name for name, _ in seen["headers"]].count("host") == 1
    assert answer.http_version == "HTTP/1.1"
    assert answer.reason_phrase == "OK"
    # the client keeps the cookie the answer set, and sends it back
    again = client.get(served.url + "/echo").json()
    assert ["cookie", "lb=a1"] in again["headers"]


def test_an_encoded_answer_is_decoded_by_the_client(served: Served, client: httpx2.Client) -> None:
    assert client.get(served.url + "/gzip").json() == {"name": "gzip", "done": False}


def test_an_answer_is_streamed_chunk_by_chunk_as_the_server_sends_it(
    served: Served, client: httpx2.Client
) -> None:
    with client.stream("GET", served.url + "/stream") as answer:
        assert answer.headers["content-type"] == "text/event-stream"
        seen = [(time.monotonic(), chunk) for chunk in answer.iter_bytes()]
    assert b"".join(chunk for _, chunk in seen) == b"".join(
        f"id: {n}\ndata: {n}\n\n".encode() for n in range(3)
    )
    # the events as they came (the server sends them 0.05 s apart), not the body read whole first
    assert seen[-1][0] - seen[0][0] >= 0.05


def test_an_error_status_is_an_answer(served: Served, client: httpx2.Client) -> None:
    answer = client.get(served.url + "/refused")
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == "3"


def test_connections_are_reused_and_one_not_read_to_its_end_is_closed(
    served: Served, client: httpx2.Client
) -> None:
    for _ in range(5):
        client.get(served.url + "/echo").json()
    assert served.server.connections == 1
    with client.stream("GET", served.url + "/long") as answer:
        next(answer.iter_bytes())  # the rest is left unread: the connection cannot carry the next answer
    client.get(served.url + "/echo").json()
    assert served.server.connections == 2


def test_a_refused_connection_is_a_connect_error_never_sent(client: httpx2.Client) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(httpx2.ConnectError):
        client.get(f"http://127.0.0.1:{port}/echo")


def test_an_answer_later_than_the_read_timeout_is_a_read_timeout(
    served: Served, client: httpx2.Client
) -> None:
    started = time.monotonic()
    with pytest.raises(httpx2.ReadTimeout):
        client.get(served.url + "/slow", timeout=httpx2.Timeout(2.0, read=0.3))
    assert time.monotonic() - started < ANSWER_S / 2


def test_a_server_that_hangs_up_without_an_answer_is_a_protocol_error(
    served: Served, client: httpx2.Client
) -> None:
    with pytest.raises(httpx2.RemoteProtocolError):
        client.post(served.url + "/hang-up", json={})


def test_an_answer_cut_short_is_an_error_of_the_read(served: Served, client: httpx2.Client) -> None:
    with pytest.raises((httpx2.RemoteProtocolError, httpx2.ReadError)):  # as httpx2's own transport raises
        client.get(served.url + "/cut").read()


def test_a_body_cut_before_its_first_byte_is_raised_while_it_is_read_not_when_it_is_sent(
    served: Served, client: httpx2.Client
) -> None:
    """As httpx2's own transport: the answer's head is an answer; what the body meets is met reading it (an
    event stream cut there is resumed: ``adapters.http_answers._until_cut``)."""
    with client.stream("GET", served.url + "/head-only") as answer:
        assert answer.status_code == 200
        with pytest.raises((httpx2.RemoteProtocolError, httpx2.ReadError)):
            answer.read()


def test_a_get_whose_connection_is_hung_up_is_sent_once(served: Served, client: httpx2.Client) -> None:
    """Never sent again by the transport (aiohttp would send an idempotent request again on a broken
    connection): a request no token paid for (rule 4). The step that made it retries it, with a token."""
    with pytest.raises(httpx2.RemoteProtocolError):
        client.get(served.url + "/hang-up")
    assert served.server.hits["/hang-up"] == 1


class _Spy(httpx2.BaseTransport):
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.closed = False

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        self.seen.append(request.url.path)
        return httpx2.Response(200, request=request)

    def close(self) -> None:
        self.closed = True


def test_only_the_requests_a_poll_paid_for_go_on_the_loop() -> None:
    inner, loop = _Spy(), _Spy()
    with httpx2.Client(transport=StatusReadsApart(inner, loop)) as routed:
        routed.get("http://server/status", headers={BUDGET_HEADER: "poll"})
        routed.post("http://server/create", headers={BUDGET_HEADER: "control"})
        routed.post("http://server/unpaid")
    assert loop.seen == ["/status"]
    assert inner.seen == ["/create", "/unpaid"]
    assert inner.closed
    assert loop.closed


@pytest.mark.parametrize("status_reads", ["httptools", "aiohttp", "httpx2"])
def test_a_workers_status_read_reaches_the_server_every_way(
    served: Served, status_reads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the worker's own pool of adapters, paid by a poll's budget (``Settings.status_reads``): on
    the transport the setting names, and on no other."""
    fleet = FleetConfig.model_validate(
        {"servers": {"ops": {"protocol": "aip151", "protocol_version": "v1", "url": served.url}}}
    )
    sent_on: list[tuple[str, str]] = []
    for name, transport in (("aiohttp", LoopTransport), ("httptools", SocketTransport)):

        def counted(
            self: httpx2.BaseTransport,
            request: httpx2.Request,
            name: str = name,
            send: Any = transport.handle_request,
        ) -> httpx2.Response:
            sent_on.append((name, request.url.path))
            return send(self, request)  # type: ignore[no-any-return]

        monkeypatch.setattr(transport, "handle_request", counted)
    send_bytes = SocketTransport.send_bytes

    def sent_itself(self: SocketTransport, url: httpx2.URL, request: bytes, timeouts: Any) -> Any:
        sent_on.append(("httptools itself", url.path))  # by the client itself (adapters.lean_client)
        return send_bytes(self, url, request, timeouts)

    monkeypatch.setattr(SocketTransport, "send_bytes", sent_itself)
    runtime = Runtime(settings=Settings(status_reads=status_reads), fleet=fleet)  # type: ignore[arg-type]
    try:
        adapter = runtime.remote.adapter("ops")
        ref = RemoteRef(
            remote_id="operations/op-1", session_ref=None, protocol_version="v1", protocol="aip151"
        )
        status = adapter.get(ref, budget=TokenBudget("poll", lambda **_: None))
    finally:
        runtime.close()
    assert status.terminal is None
    assert status.remote_id == "operations/op-1"
    # on sockets, a GET with neither body nor query is sent by the adapter's client itself
    way = {"httpx2": None, "aiohttp": "aiohttp", "httptools": "httptools itself"}[status_reads]
    assert sent_on == ([] if way is None else [(way, "/v1/operations/op-1")])


def test_the_status_reads_go_on_sockets_by_default() -> None:
    assert Settings().status_reads == "httptools"


def test_a_request_the_loop_never_answers_times_out_never_hangs(
    served: Served, loop_client: httpx2.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member thread waits for the loop no longer than the request's timeouts and a margin allow."""
    loop_client.get(served.url + "/echo")  # the loop and the session are made
    monkeypatch.setattr(loop_transport, "LOOP_MARGIN_S", 0.2)
    wedged = threading.Event()
    loop_transport.process_loop().call_soon_threadsafe(wedged.wait, ANSWER_S)  # the loop does nothing else
    try:
        started = time.monotonic()
        with pytest.raises(httpx2.ReadTimeout, match="the event loop did not answer"):
            loop_client.get(served.url + "/echo", timeout=httpx2.Timeout(0.1))
        assert time.monotonic() - started < ANSWER_S / 2
    finally:
        wedged.set()
    assert loop_client.get(served.url + "/echo").status_code == 200  # and the loop goes on once it is free


# -- sockets parsed by httptools: what httpx2's own pool does, done by the transport itself ----------------


@pytest.fixture
def sockets() -> Iterator[SocketTransport]:
    transport = SocketTransport(max_connections=2)
    try:
        yield transport
    finally:
        transport.close()


def _timeout(**phases: float) -> httpx2.Timeout:
    return httpx2.Timeout(ANSWER_S, **phases)


def test_a_connection_the_server_closed_while_idle_is_not_written_on(
    served: Served, sockets: SocketTransport
) -> None:
    """The request goes on a new connection, once: it is not written on the closed one and then sent again."""
    with httpx2.Client(transport=sockets, timeout=ANSWER_S) as client:
        assert client.get(served.url + "/closes-when-idle").json() == {}
        deadline = time.monotonic() + ANSWER_S
        while served.server.hits["/closes-when-idle"] < 1 or not _closed_by_server(sockets):
            assert time.monotonic() < deadline, "the server never closed its idle connection"
            time.sleep(0.02)
        assert client.get(served.url + "/echo").status_code == 200
    assert served.server.connections == 2
    assert served.server.hits["/echo"] == 1


def _closed_by_server(transport: SocketTransport) -> bool:
    return any(c.readable() for idle in transport._idle.values() for c in idle)


def test_a_connection_idle_past_its_expiry_is_not_reused(served: Served) -> None:
    with (
        SocketTransport(keepalive_expiry_s=0.05) as transport,
        httpx2.Client(transport=transport, timeout=ANSWER_S) as client,
    ):
        client.get(served.url + "/echo")
        time.sleep(0.1)
        client.get(served.url + "/echo")
    assert served.server.connections == 2


def test_a_request_past_the_pool_waits_for_a_connection_then_times_out_never_sent(served: Served) -> None:
    """At most ``max_connections`` at once; one past them waits its ``pool`` timeout for one to be free: a
    ``PoolTimeout`` (never sent), and once one is free, the next request takes it."""
    with (
        SocketTransport(max_connections=1) as transport,
        httpx2.Client(transport=transport, timeout=ANSWER_S) as client,
        client.stream("GET", served.url + "/held") as held,
    ):
        started = time.monotonic()
        with pytest.raises(httpx2.PoolTimeout):
            client.get(served.url + "/echo", timeout=_timeout(pool=0.2))
        assert 0.2 <= time.monotonic() - started < ANSWER_S / 2
        assert served.server.hits["/echo"] == 0
        served.server.release.set()
        assert held.read() == b"{}"
        assert client.get(served.url + "/echo").status_code == 200
    assert served.server.connections == 1


def test_an_interim_answer_is_skipped_for_the_final_one(served: Served, sockets: SocketTransport) -> None:
    with httpx2.Client(transport=sockets, timeout=ANSWER_S) as client:
        answer = client.get(served.url + "/interim")
        assert (answer.status_code, answer.json()) == (200, {"final": True})
        assert "link" not in answer.headers
        assert client.get(served.url + "/echo").status_code == 200
    assert served.server.connections == 1


def test_a_body_that_runs_to_the_connections_end_is_read_whole_and_the_connection_not_kept(
    served: Served, sockets: SocketTransport
) -> None:
    with httpx2.Client(transport=sockets, timeout=ANSWER_S) as client:
        assert client.get(served.url + "/to-close").json() == {"whole": True}
        assert client.get(served.url + "/echo").status_code == 200
    assert served.server.connections == 2


def test_bytes_past_the_answers_end_leave_the_answer_whole_and_the_connection_unused(
    served: Served, sockets: SocketTransport
) -> None:
    with httpx2.Client(transport=sockets, timeout=ANSWER_S) as client:
        assert client.get(served.url + "/extra").json() == {}
        assert client.get(served.url + "/echo").status_code == 200
    assert served.server.connections == 2


@pytest.mark.parametrize("value", ["a\r\nInjected: yes", "a\nb"])
def test_a_header_with_a_line_break_is_refused_unsent(
    served: Served, sockets: SocketTransport, value: str
) -> None:
    request = httpx2.Request("GET", served.url + "/echo", headers={"X-Note": value})
    with pytest.raises(httpx2.LocalProtocolError):
        sockets.handle_request(request)
    assert served.server.connections == 0


@pytest.mark.parametrize("method", ["HEAD", "CONNECT"])
def test_a_method_whose_answer_the_parser_cannot_frame_is_refused_unsent(
    served: Served, sockets: SocketTransport, method: str
) -> None:
    with pytest.raises(httpx2.UnsupportedProtocol):
        sockets.handle_request(httpx2.Request(method, served.url + "/echo"))
    assert served.server.connections == 0


def test_a_write_that_cannot_finish_is_a_write_timeout(sockets: SocketTransport) -> None:
    """A server that reads nothing: the request's ``write`` timeout ends the write (the request may be on
    its way: not "never sent")."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/big"
        body = b"x" * 64_000_000
        started = time.monotonic()
        with pytest.raises(httpx2.WriteTimeout):
            sockets.handle_request(
                httpx2.Request(
                    "POST", url, content=body, extensions={"timeout": _timeout(write=0.2).as_dict()}
                )
            )
        assert time.monotonic() - started < ANSWER_S / 2


def _child_sends(transport: httpx2.BaseTransport, url: str, out: Any) -> None:
    with httpx2.Client(transport=transport, timeout=ANSWER_S) as forked:
        out.put(forked.post(url, content=b"child").json()["body"])


@pytest.mark.parametrize("kind", ["sockets", "loop"])
def test_a_forked_child_opens_connections_of_its_own(served: Served, kind: str) -> None:
    """A Celery prefork child: its parent's idle connection (and loop thread) are the parent's (the same
    socket in both processes would mix their answers); the child opens its own, and the parent goes on
    with its own."""
    transport = _reads_transport(kind)
    with httpx2.Client(transport=transport, timeout=ANSWER_S) as parents:
        assert parents.post(served.url + "/echo", content=b"parent").json()["body"] == "parent"
        fork = multiprocessing.get_context("fork")
        out = fork.Queue()
        child = fork.Process(target=_child_sends, args=(transport, served.url + "/echo", out))
        child.start()
        child.join(ANSWER_S)
        if child.is_alive():
            child.kill()
            child.join(CHILD_STOP_S)
        assert child.exitcode == 0
        assert out.get(timeout=ANSWER_S) == "child"
        assert parents.post(served.url + "/echo", content=b"again").json()["body"] == "again"
    assert served.server.connections == 2


def test_https_is_verified_by_the_context_given(tmp_path: Any) -> None:
    """A server whose certificate the context trusts answers; the same server to httpx2's default trust
    (the system's store, where the test's authority is not) is a ``ConnectError``: never sent."""
    import trustme  # noqa: PLC0415 - the tests' only TLS

    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1")
    server = _Server()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    certificate.configure_cert(server_context)
    server.socket = server_context.wrap_socket(server.socket, server_side=True)
    trusting = ssl.create_default_context()
    authority.configure_trust(trusting)
    with serving(server, before_stop=server.release.set) as url:
        https = url.replace("http://", "https://")
        with SocketTransport(ssl_context=trusting) as transport, httpx2.Client(transport=transport) as client:
            assert client.post(https + "/echo", content=b"tls").json()["body"] == "tls"
            assert client.post(https + "/echo", content=b"again").json()["body"] == "again"
        with (
            SocketTransport() as transport,
            httpx2.Client(transport=transport) as client,
            pytest.raises(httpx2.ConnectError),
        ):
            client.post(https + "/echo", content=b"untrusted")
    assert server.hits["/echo"] == 2


def test_an_answer_that_closes_its_connection_or_a_request_that_asks_it_leaves_it_unused(
    served: Served, sockets: SocketTransport
) -> None:
    with httpx2.Client(transport=sockets, timeout=ANSWER_S) as client:
        assert client.get(served.url + "/closes-after").json() == {}
        assert client.get(served.url + "/echo", headers={"Connection": "close"}).status_code == 200
        assert client.get(served.url + "/echo").status_code == 200
    assert served.server.connections == 3


def test_an_answer_whose_head_never_ends_is_refused_past_its_bound(
    served: Served, sockets: SocketTransport
) -> None:
    """Held in memory up to ``MAX_HEAD_BYTES``, not for as long as the server sends header lines."""
    with (
        httpx2.Client(transport=sockets, timeout=ANSWER_S) as client,
        pytest.raises(httpx2.RemoteProtocolError, match="head is larger"),
    ):
        client.get(served.url + "/endless-head")


def test_an_event_stream_read_to_its_response_keeps_its_connection(served: Served) -> None:
    """An MCP answer as an event stream: the adapters' reader waits for the stream's end after the response
    (``_finish_stream``, on the answer's socket), so the next read finds the connection open."""
    with SocketTransport(max_connections=2) as transport:
        _read_event_streams(httpx2.Client(transport=transport, timeout=ANSWER_S), served.url, 3)
    assert served.server.connections == 1


def _read_event_streams(client: httpx2.Client, url: str, count: int) -> None:
    """``count`` MCP requests answered as event streams, each read to its response."""
    streams = StreamableHttpClient(
        client,
        url + "/sse-answer",
        bearer_token=None,
        timeouts=Timeouts(read=ANSWER_S),
        limits=Limits(),
        new_id=lambda: "req-1",
    )
    for _ in range(count):
        exchange = streams.request("tasks/get", {}, session=None, idempotent=True)
        assert exchange.response is not None


def test_a_request_waiting_for_the_pool_takes_the_connection_given_back(served: Served) -> None:
    with (
        SocketTransport(max_connections=1) as transport,
        httpx2.Client(transport=transport, timeout=ANSWER_S) as client,
        client.stream("GET", served.url + "/held") as held,
    ):
        waiting: list[float] = []

        def wait_then_read() -> None:
            started = time.monotonic()
            assert client.get(served.url + "/echo", timeout=_timeout(pool=ANSWER_S)).status_code == 200
            waiting.append(time.monotonic() - started)

        waiter = threading.Thread(target=wait_then_read)
        waiter.start()
        time.sleep(0.1)  # the waiter is in the pool's queue by now (it cannot be anywhere else for long)
        assert served.server.hits["/echo"] == 0
        served.server.release.set()
        assert held.read() == b"{}"
        waiter.join(ANSWER_S)
        assert not waiter.is_alive()
    assert len(waiting) == 1
    assert waiting[0] < ANSWER_S / 2
    assert served.server.connections == 1


def test_a_certificate_for_another_name_is_a_connect_error_never_sent() -> None:
    import trustme  # noqa: PLC0415 - the tests' only TLS

    authority = trustme.CA()
    server = _Server()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("example.org").configure_cert(server_context)
    server.socket = server_context.wrap_socket(server.socket, server_side=True)
    trusting = ssl.create_default_context()
    authority.configure_trust(trusting)
    with (
        serving(server, before_stop=server.release.set) as url,
        SocketTransport(ssl_context=trusting) as transport,
        httpx2.Client(transport=transport, timeout=ANSWER_S) as client,
        pytest.raises(httpx2.ConnectError),
    ):
        client.post(url.replace("http://", "https://") + "/echo", content=b"misnamed")
    assert server.hits["/echo"] == 0


@pytest.fixture(params=["sockets", "httpx2"])
def whole_answer_client(request: pytest.FixtureRequest) -> Iterator[httpx2.Client]:
    """An adapter's client on the status reads' sockets, or on httpx2's own transport (every other request:
    ``adapters.answer_within``)."""
    wrap = (lambda _inner: SocketTransport(max_connections=8)) if request.param == "sockets" else None
    with http_client(Timeouts(connect=2.0, read=ANSWER_S), connections=4, wrap_transport=wrap) as made:
        yield made


@pytest.mark.parametrize("part", ["head", "body"])
def test_an_answer_dribbled_a_byte_at_a_time_ends_at_its_read_timeout(
    served: Served, whole_answer_client: httpx2.Client, part: str
) -> None:
    """A server that sends each byte within the read timeout, and the answer far past it, holds the caller
    the read timeout, not the answer's 5 s: the head is read inside the transport, before the adapters'
    own deadline can see it, and a worker held there (a Celery process on a create, a member thread on a
    status read) stalled for as long as the server liked."""
    started = time.monotonic()
    with pytest.raises(httpx2.ReadTimeout, match="whole within"):
        whole_answer_client.get(served.url + f"/dribble-{part}", timeout=httpx2.Timeout(2.0, read=0.5))
    assert time.monotonic() - started < 1.5


def test_an_answer_within_its_read_timeout_after_a_slow_one_on_the_same_connection_is_whole(
    served: Served, whole_answer_client: httpx2.Client
) -> None:
    """The answer's time starts when its own request is written, not when its connection was made: a
    connection kept 0.3 s idle after each answer carries the next request with a time of its own (0.5 s),
    three times over, never a read timeout."""
    for _ in range(3):
        served.server.release.set()  # /slow answers at once
        answer = whole_answer_client.get(served.url + "/slow", timeout=httpx2.Timeout(2.0, read=0.5))
        assert answer.json() == {}
        time.sleep(0.3)
        answer = whole_answer_client.get(served.url + "/echo", timeout=httpx2.Timeout(2.0, read=0.5))
        assert answer.status_code == 200
    assert served.server.connections == 1


def test_a_create_whose_answer_is_dribbled_ends_unknown_within_its_read_budget(served: Served) -> None:
    """Through an adapter's client (httpx2's transport, as a create goes): the dribbled head ends as a
    request that may have reached the server, within the read budget, not when the server is done."""
    with http_client(Timeouts(connect=2.0, read=0.5)) as made:
        streams = StreamableHttpClient(
            made,
            served.url + "/dribble-head",
            bearer_token=None,
            timeouts=Timeouts(connect=2.0, read=0.5),
            limits=Limits(),
        )
        started = time.monotonic()
        with pytest.raises(OutcomeUnknown):
            streams.request("tools/call", {"name": "t", "arguments": {}}, session=None, idempotent=False)
        assert time.monotonic() - started < 1.5


# -- the status reads sent by the adapter's client itself (adapters.lean_client) ----------------------------


class _Route:
    """A route that takes every request while ``taking``, and keeps each one's outcome."""

    def __init__(self, transport: SocketTransport, *, taking: bool = True) -> None:
        self._transport = transport
        self.taking = taking
        self.taken = 0
        self.outcomes: list[int | None] = []

    @property
    def transport(self) -> SocketTransport:
        return self._transport

    def label(self) -> str | None:
        if not self.taking:
            return None
        self.taken += 1
        return "poll"

    def counted(self, status: int | None) -> None:
        self.outcomes.append(status)


@pytest.fixture
def lean() -> Iterator[tuple[LeanClient, _Route]]:
    """An adapter's client (``adapters.http_client``: a :class:`LeanClient`) whose status reads' route takes
    every request, on the same sockets as its transport."""
    transport = SocketTransport(max_connections=8)
    with http_client(
        Timeouts(connect=2.0, read=ANSWER_S), connections=4, wrap_transport=lambda _inner: transport
    ) as made:
        assert isinstance(made, LeanClient)
        route = _Route(transport)
        made.route = route
        yield made, route


_MCP_HEADERS = {
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "MCP-Protocol-Version": "2025-11-25",
    "Mcp-Session-Id": "s-1",
    "Authorization": "Bearer t",
}


def _echo(client: httpx2.Client, url: str) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """What the server saw of a POST (its header lines but the bucket's label, sorted; its body) and the
    answer's status and content type."""
    with client.stream(
        "POST", url + "/echo", content=b'{"jsonrpc":"2.0","id":1}', headers=_MCP_HEADERS
    ) as answer:
        seen = json.loads(b"".join(answer.iter_bytes()))
        content_type = answer.headers.get("Content-Type") or ""
    lines = sorted((name, value) for name, value in seen["headers"] if name != BUDGET_HEADER.lower())
    return answer.status_code, content_type, lines, seen["body"].encode()


def test_a_lean_read_goes_as_httpx2_sends_it_and_reads_the_same(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    client, route = lean
    route.taking = False
    full = _echo(client, served.url)
    client.cookies.clear()  # the answer set a cookie: with one in its jar the client sends it by httpx2
    route.taking = True
    mine = _echo(client, served.url)
    assert route.taken == 1
    assert mine == full
    # ... and with the label the route gave, and each header once
    client.cookies.clear()  # kept from the lean answer too: with it the next request goes by httpx2
    with client.stream("POST", served.url + "/echo", content=b"{}", headers=_MCP_HEADERS) as answer:
        seen = json.loads(b"".join(answer.iter_bytes()))
    assert [BUDGET_HEADER.lower(), "poll"] in seen["headers"]
    assert len({name for name, _ in seen["headers"]}) == len(seen["headers"])
    assert served.server.connections == 1  # on the transport's kept connection, as the others


def test_a_lean_read_is_counted_with_its_answer_or_its_absence(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    client, route = lean
    with client.stream("POST", served.url + "/refused", content=b"{}", headers=_MCP_HEADERS) as answer:
        assert answer.status_code == 429
        assert answer.headers["Retry-After"] == "3"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with (
        pytest.raises(httpx2.ConnectError),
        client.stream("POST", f"http://127.0.0.1:{port}/echo", content=b"{}", headers=_MCP_HEADERS),
    ):
        pass
    assert route.outcomes == [429, None]


def test_a_lean_read_decodes_a_compressed_answer(served: Served, lean: tuple[LeanClient, _Route]) -> None:
    client, route = lean
    with client.stream("POST", served.url + "/gzip", content=b"{}", headers=_MCP_HEADERS) as answer:
        assert json.loads(b"".join(answer.iter_bytes())) == {"name": "gzip", "done": False}
    assert route.taken == 1


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/hang-up", httpx2.RemoteProtocolError),
        ("/cut", httpx2.RemoteProtocolError),
        ("/dribble-body", httpx2.ReadTimeout),
    ],
)
def test_a_lean_reads_fault_is_the_httpx2_error_of_the_same_meaning(
    served: Served, lean: tuple[LeanClient, _Route], path: str, error: type[Exception]
) -> None:
    client, route = lean
    timeout = {"timeout": {"connect": 2.0, "read": 0.5, "write": 2.0, "pool": 2.0}}
    with (
        pytest.raises(error),
        client.stream(
            "POST", served.url + path, content=b"{}", headers=_MCP_HEADERS, extensions=timeout
        ) as a,
    ):
        b"".join(a.iter_bytes())
    assert route.taken == 1


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {"json": {"a": 1}},  # a body httpx2 encodes
        {"content": b"{}", "headers": {"X-Bad": "a\r\nInjected: yes"}},  # refused unsent, by the transport
        {"content": b"{}", "headers": {"Host": "elsewhere"}},  # a Host of its own
        {"content": b"{}", "params": {"q": "1"}},
    ],
)
def test_a_request_the_lean_client_cannot_send_as_httpx2_would_goes_through_httpx2(
    served: Served, lean: tuple[LeanClient, _Route], request_kwargs: dict[str, Any]
) -> None:
    client, route = lean
    try:
        with client.stream("POST", served.url + "/echo", **request_kwargs) as answer:
            answer.read()
    except httpx2.LocalProtocolError:
        assert "X-Bad" in request_kwargs.get("headers", {})  # the transport's refusal, nothing sent
    assert route.taken == 0


def test_a_read_to_a_url_with_a_transport_mounted_for_it_goes_through_httpx2_to_that_transport(
    served: Served,
) -> None:
    mounted = _Spy()
    with (
        SocketTransport(max_connections=2) as transport,
        LeanClient(transport=transport, mounts={served.url: mounted}) as client,
    ):
        route = client.route = _Route(transport)
        with client.stream("POST", served.url + "/echo", content=b"{}", headers=_MCP_HEADERS) as answer:
            assert answer.status_code == 200
    assert route.taken == 0
    assert mounted.seen == ["/echo"]
    assert served.server.hits["/echo"] == 0


def test_a_lean_read_inflates_a_compressed_answer_a_bounded_piece_at_a_time(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    """As httpx2 inflates: at most 1 MiB a piece, so a small answer that inflates to far more is refused by
    the reader's cap as it comes, never held whole."""
    client, route = lean
    headers = {**_MCP_HEADERS, "X-Layers": "2"}
    with client.stream("POST", served.url + "/bomb", content=b"{}", headers=headers) as answer:
        pieces = answer.iter_bytes()
        first = [len(next(pieces)) for _ in range(3)]
    assert route.taken == 1
    assert max(first) <= 2**20
    with (
        client.stream("POST", served.url + "/bomb", content=b"{}", headers=headers) as answer,
        pytest.raises(AnswerTooLarge),
    ):
        read_bounded(answer, 4 * 2**20, None)


def test_a_lean_read_refuses_more_codings_than_httpx2_undoes(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    client, _ = lean
    headers = {**_MCP_HEADERS, "X-Layers": "6"}
    with (
        client.stream("POST", served.url + "/bomb", content=b"{}", headers=headers) as answer,
        pytest.raises(httpx2.DecodingError),
    ):
        b"".join(answer.iter_bytes())


def test_a_cookie_a_lean_answer_sets_is_kept_and_sent_back(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    """A sticky-session load balancer's cookie set on a status read is kept as httpx2 keeps it: the next
    request goes through httpx2 with it."""
    client, route = lean
    _echo(client, served.url)  # the answer sets lb=a1
    assert route.taken == 1
    assert client.cookies.get("lb") == "a1"
    with client.stream("POST", served.url + "/echo", content=b"{}", headers=_MCP_HEADERS) as answer:
        seen = json.loads(answer.read())
    assert ["cookie", "lb=a1"] in seen["headers"]
    assert route.taken == 1


def test_a_url_with_a_user_and_password_goes_through_httpx2_with_basic_auth(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    client, route = lean
    url = served.url.replace("http://", "http://user:secret@")
    with client.stream("POST", url + "/echo", content=b"{}", headers={"Accept": "*/*"}) as answer:
        seen = json.loads(answer.read())
    assert route.taken == 0
    assert dict(seen["headers"])["authorization"].startswith("Basic ")


def test_a_client_with_a_cookie_sends_its_reads_through_httpx2_with_it(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    client, route = lean
    route.taking = False
    _echo(client, served.url)  # the answer sets the load balancer's cookie
    route.taking = True
    with client.stream("POST", served.url + "/echo", content=b"{}", headers=_MCP_HEADERS) as answer:
        seen = json.loads(answer.read())
    assert ["cookie", "lb=a1"] in seen["headers"]
    assert route.taken == 0


def test_a_lean_event_stream_answer_is_read_to_its_response_and_keeps_its_connection(
    served: Served, lean: tuple[LeanClient, _Route]
) -> None:
    client, route = lean
    _read_event_streams(client, served.url, 3)
    assert route.taken == 3
    assert served.server.connections == 1


class _Outcomes(RequestOutcomes):
    """The counts kept here (no Redis): what ``answered`` adds."""

    def __init__(self) -> None:  # no Redis, no flush
        self.added: list[tuple[str, str, str]] = []

    def add(self, server: str, budget: str, outcome: str) -> None:
        self.added.append((server, budget, outcome))


def test_a_workers_mcp_status_read_goes_lean_and_is_counted_under_poll(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the worker's own pool of adapters: an MCP server's ``tasks/get`` paid by a poll's budget is
    sent by the client itself on the status reads' sockets (``SocketTransport.send_bytes``) and counted under
    ``poll``; a request another budget paid for goes through httpx2, counted under its own."""
    sent: list[bytes] = []
    send_bytes = SocketTransport.send_bytes

    def spied(self: SocketTransport, url: httpx2.URL, request: bytes, timeouts: Any) -> Any:
        sent.append(request.split(b"\r\n\r\n", 1)[1])
        return send_bytes(self, url, request, timeouts)

    monkeypatch.setattr(SocketTransport, "send_bytes", spied)
    fleet = FleetConfig.model_validate(
        {
            "servers": {
                "mcp": {"protocol": "mcp", "protocol_version": "2025-11-25", "url": served.url + "/task"}
            }
        }
    )
    outcomes = _Outcomes()
    pool = RemotePool(fleet, outcomes=outcomes)
    ref = RemoteRef(remote_id="t1", session_ref=None, protocol_version="2025-11-25", protocol="mcp")
    try:
        adapter = pool.adapter("mcp")
        status = adapter.get(ref, budget=TokenBudget("poll", lambda **_: None))
        assert status.terminal is None
        assert status.remote_id == "t1"
        assert [json.loads(body)["method"] for body in sent] == ["tasks/get"]
        adapter.get(ref, budget=TokenBudget("control", lambda **_: None))
    finally:
        pool.close()
    assert len(sent) == 1
    assert outcomes.added == [("mcp", "poll", "ok"), ("mcp", "control", "ok")]
