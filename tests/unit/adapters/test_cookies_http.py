"""A cookie a server sets (a sticky-session load balancer) comes back on the client's next request, and a
response that sets none costs no cookie parsing (httpx built urllib stand-ins to parse every response)."""

from __future__ import annotations

import http.cookiejar
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from adapters import Limits, Timeouts
from adapters.jsonrpc import Response
from adapters.streamable_http import Session, StreamableHttpClient
from tests.unit.adapters.mcp_fakes import URL, result_message

SESSION = Session(session_id="abc", protocol_version="2025-11-25")
#: How long the local server's thread is waited for once it is asked to stop.
SERVER_STOP_S = 5.0


def adapter_client(http: httpx2.Client, url: str = URL) -> StreamableHttpClient:
    return StreamableHttpClient(
        http, url, bearer_token=None, timeouts=Timeouts(read=2.0), limits=Limits(), new_id=lambda: "req-1"
    )


def sticky(set_cookie: list[str], seen: list[httpx2.Request]) -> httpx2.MockTransport:
    """Answers every request; the first answer sets the cookies in ``set_cookie``."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        headers = [("set-cookie", value) for value in set_cookie] if len(seen) == 1 else []
        return httpx2.Response(200, json=result_message("req-1", {}), headers=headers)

    return httpx2.MockTransport(handler)


def test_a_cookie_the_server_sets_is_sent_back_on_the_next_request() -> None:
    seen: list[httpx2.Request] = []
    with httpx2.Client(transport=sticky(["lb=node-2; Path=/"], seen)) as http:
        client = adapter_client(http)
        client.request("tasks/get", {"taskId": "t1"}, session=SESSION, idempotent=True)
        client.request("tasks/get", {"taskId": "t1"}, session=SESSION, idempotent=True)
        client.post_message({"jsonrpc": "2.0", "method": "n"}, session=SESSION, what="notification")
    assert "cookie" not in seen[0].headers
    assert seen[1].headers["cookie"] == "lb=node-2"
    assert seen[2].headers["cookie"] == "lb=node-2"


def test_a_cookie_set_on_the_client_before_the_adapter_is_kept_and_sent() -> None:
    seen: list[httpx2.Request] = []
    with httpx2.Client(transport=sticky([], seen), cookies={"affinity": "a1"}) as http:
        before = http.cookies
        client = adapter_client(http)
        client.request("ping", {}, session=SESSION, idempotent=True)
        assert http.cookies.jar is before.jar  # the jar is shared, not copied
    assert seen[0].headers["cookie"] == "affinity=a1"


def test_a_response_without_set_cookie_is_not_parsed_for_cookies(monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx builds urllib stand-ins of every answer for its jar (~20 us a request); httpx2 only of the
    answers that set a cookie."""
    parsed: list[object] = []
    parse = http.cookiejar.CookieJar.extract_cookies

    def counting(self: http.cookiejar.CookieJar, response: Any, request: Any) -> None:
        parsed.append(response)
        parse(self, response, request)

    monkeypatch.setattr(http.cookiejar.CookieJar, "extract_cookies", counting)
    seen: list[httpx2.Request] = []
    with httpx2.Client(transport=sticky(["lb=node-2; Path=/"], seen)) as client_http:
        client = adapter_client(client_http)
        for _ in range(3):
            client.request("ping", {}, session=SESSION, idempotent=True)
    assert len(parsed) == 1  # only the answer that set the cookie
    assert seen[2].headers["cookie"] == "lb=node-2"


def test_a_later_set_cookie_replaces_the_value() -> None:
    answers = iter(["lb=node-2; Path=/", None, "lb=node-5; Path=/", None])
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        value = next(answers)
        headers = [] if value is None else [("Set-Cookie", value)]
        return httpx2.Response(200, json=result_message("req-1", {}), headers=headers)

    with httpx2.Client(transport=httpx2.MockTransport(handler)) as http:
        client = adapter_client(http)
        for _ in range(4):
            client.request("ping", {}, session=SESSION, idempotent=True)
    assert [r.headers.get("cookie") for r in seen] == [None, "lb=node-2", "lb=node-2", "lb=node-5"]


class _StickyHandler(http.server.BaseHTTPRequestHandler):
    """A load balancer's affinity cookie on the first answer; every answer echoes the Cookie it got."""

    protocol_version = "HTTP/1.1"
    answered = 0

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        request_id = json.loads(self.rfile.read(length))["id"]
        body = json.dumps(result_message(request_id, {"cookie": self.headers.get("cookie")})).encode()
        self.send_response(200)
        if type(self).answered == 0:
            self.send_header("Set-Cookie", "AWSALB=abc123; Path=/; HttpOnly")
        type(self).answered += 1
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        del format, args


@pytest.fixture
def sticky_server() -> Iterator[str]:
    _StickyHandler.answered = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StickyHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/mcp"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(SERVER_STOP_S)


def test_a_real_server_gets_its_affinity_cookie_back(sticky_server: str) -> None:
    with httpx2.Client(timeout=5.0) as http:
        client = adapter_client(http, sticky_server)
        answers = [
            client.request("tasks/get", {"taskId": "t1"}, session=SESSION, idempotent=True) for _ in range(3)
        ]
    echoed = [a.response.result["cookie"] if isinstance(a.response, Response) else a for a in answers]
    assert echoed == [None, "AWSALB=abc123", "AWSALB=abc123"]
