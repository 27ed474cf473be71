"""Credentials (issue 8, item 16): the bearer token is read per request, a password in the server URL is
sent as basic auth and never shown (not in the URL httpx2 logs, not in ``url``)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator

import httpx2
import pytest

from adapters.base import Limits, Timeouts, redact_url
from adapters.errors import NoBearerToken, NotSent, NoWorkDone, Transient
from adapters.streamable_http import StreamableHttpClient
from workers.budget import server_wait_s

PASSWORD = "pw-s3cret-7Qx"


def client(url: str, token: object, seen: list[httpx2.Request]) -> StreamableHttpClient:
    def answer(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(202)

    http = httpx2.Client(transport=httpx2.MockTransport(answer))
    return StreamableHttpClient(http, url, bearer_token=token, timeouts=Timeouts(), limits=Limits())  # type: ignore[arg-type]


def tokens() -> Iterator[str]:
    yield from ("token-A", "token-B")


def test_the_token_provider_is_called_for_every_request() -> None:
    seen: list[httpx2.Request] = []
    rotating = tokens()
    sender = client("http://127.0.0.1:9/mcp", lambda: next(rotating), seen)
    for _ in range(2):
        sender.post_message({"jsonrpc": "2.0", "method": "notifications/initialized"}, session=None, what="n")
    assert [r.headers["authorization"] for r in seen] == ["Bearer token-A", "Bearer token-B"]


def test_a_token_that_cannot_be_read_sends_nothing() -> None:
    seen: list[httpx2.Request] = []

    def missing() -> str:
        raise LookupError("REPORTS_TOKEN is empty")

    sender = client("http://127.0.0.1:9/mcp", missing, seen)
    with pytest.raises(Transient, match="not sent"):
        sender.post_message({"jsonrpc": "2.0", "method": "notifications/initialized"}, session=None, what="n")
    assert seen == []


def test_a_password_in_the_url_is_sent_as_basic_auth_and_never_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[httpx2.Request] = []
    sender = client(f"http://lc-user:{PASSWORD}@127.0.0.1:9/mcp", None, seen)
    with caplog.at_level(logging.DEBUG):
        sender.post_message({"jsonrpc": "2.0", "method": "notifications/initialized"}, session=None, what="n")
    [request] = seen
    assert (
        request.headers["authorization"]
        == "Basic " + base64.b64encode(f"lc-user:{PASSWORD}".encode()).decode()
    )
    assert PASSWORD not in str(request.url)
    assert PASSWORD not in caplog.text
    assert "127.0.0.1:9/mcp" in caplog.text  # httpx2 did log the request
    assert sender.url == "http://lc-user:***@127.0.0.1:9/mcp"


def test_a_bearer_token_wins_over_the_urls_basic_auth() -> None:
    seen: list[httpx2.Request] = []
    sender = client(f"http://lc-user:{PASSWORD}@127.0.0.1:9/mcp", "token-A", seen)
    sender.post_message({"jsonrpc": "2.0", "method": "notifications/initialized"}, session=None, what="n")
    assert seen[0].headers["authorization"] == "Bearer token-A"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://u:p@h:1/mcp", "http://u:***@h:1/mcp"),
        ("https://u@h/x?y=1", "https://u@h/x?y=1"),
        ("http://h:1/mcp", "http://h:1/mcp"),
        ("http://u:p@ss@h/mcp", "http://u:***@h/mcp"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_create_whose_token_cannot_be_read_was_not_sent_never_an_unknown_outcome() -> None:
    """Rule 1: a ``tools/call`` whose bearer token could not be had never left: it is :class:`NotSent` (the
    create attempt is undone), not a bare Transient that the submit step takes for an unknown outcome."""
    seen: list[httpx2.Request] = []

    def unavailable() -> str:
        raise Transient(
            "the token endpoint https://as.example/token refused the request: HTTP 503", retry_after=4.0
        )

    sender = client("http://127.0.0.1:9/mcp", unavailable, seen)
    with pytest.raises(NoWorkDone, match="not sent: the bearer token could not be read") as raised:
        sender.request("tools/call", {"name": "slow_report", "arguments": {}}, session=None, idempotent=False)
    assert isinstance(raised.value, NotSent)
    assert isinstance(raised.value, NoBearerToken)
    assert raised.value.retry_after == 4.0  # the provider's own backoff is kept...
    assert server_wait_s(raised.value) is None  # ...and is no wait the server asked for: nothing held
    assert seen == []
