"""What the CPU cuts of one MCP HTTP request (issue 13) must keep: the same bytes on the wire, the same
answer read, SSE decoded the same whatever the framing."""

from __future__ import annotations

import json
from types import MappingProxyType

import httpx2

from adapters import UNMETERED, AdapterConfig, Limits, Timeouts
from adapters.aip151.transport import RestClient
from adapters.mcp_2026_07_28.transport import ExtHttp
from adapters.sse import SseDecoder, SseEvent
from adapters.streamable_http import Session, StreamableHttpClient
from tests.unit.adapters.mcp_fakes import URL, result_message

SESSION = Session(session_id="abc", protocol_version="2025-11-25")


def adapter_client(handler: httpx2.MockTransport, *, read_s: float = 2.0) -> StreamableHttpClient:
    return StreamableHttpClient(
        httpx2.Client(transport=handler),
        URL,
        bearer_token=None,
        timeouts=Timeouts(read=read_s),
        limits=Limits(),
        new_id=lambda: "req-1",
    )


def test_the_body_is_the_json_httpx_would_send_and_the_timeouts_are_per_request() -> None:
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json=result_message("req-1", {}))

    client = adapter_client(httpx2.MockTransport(handler), read_s=2.0)
    params = {"taskId": "tâche-1", "n": [1, 2.5, None]}
    client.request("tasks/get", params, session=SESSION, idempotent=True)
    client.request("tasks/get", params, session=SESSION, idempotent=True, read_timeout=7.0)
    reference = httpx2.Request(
        "POST", URL, json={"jsonrpc": "2.0", "id": "req-1", "method": "tasks/get", "params": params}
    )
    assert seen[0].content == reference.content  # compact, UTF-8 (not \\u escapes)
    assert seen[0].headers["content-type"] == "application/json"
    assert seen[0].headers["content-length"] == str(len(reference.content))
    assert seen[0].extensions["timeout"] == {"connect": 5.0, "read": 2.0, "write": 10.0, "pool": 5.0}
    assert seen[1].extensions["timeout"]["read"] == 7.0


def test_a_message_given_as_any_mapping_is_posted() -> None:
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(202)

    client = adapter_client(httpx2.MockTransport(handler))
    message = MappingProxyType({"jsonrpc": "2.0", "method": "notifications/initialized"})
    client.post_message(message, session=SESSION, what="initialized")
    assert seen[0].content == b'{"jsonrpc":"2.0","method":"notifications/initialized"}'


def test_a_json_answer_says_its_content_type() -> None:
    client = adapter_client(
        httpx2.MockTransport(lambda _: httpx2.Response(200, json=result_message("req-1", {})))
    )
    exchange = client.request("ping", {}, session=SESSION, idempotent=True)
    assert exchange.content_type == "application/json"


def feed_all(chunks: list[bytes]) -> list[SseEvent]:
    decoder = SseDecoder()
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.close()


def test_a_crlf_split_around_an_empty_chunk_is_still_one_line_ending() -> None:
    # ``data: a CR`` | nothing | ``LF data: b CRLF CRLF``: one event with two data lines.
    events = feed_all([b"data: a\r", b"", b"\ndata: b\r\n\r\n"])
    assert [event.data for event in events] == ["a\nb"]


def test_a_large_event_in_small_chunks_is_decoded_whole() -> None:
    text = "é" * 50_000  # two bytes each: chunks of 1000 bytes never split one, 999 would
    message = json.dumps(result_message("req-1", {"text": text}), ensure_ascii=False)
    body = f"id: 7\r\nevent: message\r\ndata: {message}\r\n\r\n".encode()
    events = feed_all([body[i : i + 999] for i in range(0, len(body), 999)])
    [event] = events
    assert event.id == "7"
    assert json.loads(event.data) == result_message("req-1", {"text": text})


def test_lone_crs_and_lfs_mixed_in_one_chunk() -> None:
    events = feed_all([b"data: a\rdata: b\n\rdata: c\r\n\n: comment\r\r\ndata: d\n\n"])
    assert [event.data for event in events] == ["a\nb", "c", "d"]


def test_the_extension_and_aip_transports_send_what_httpx_would_with_per_request_timeouts() -> None:
    """Issue 21: their timeouts and constant headers built once, the body encoded as ``json=`` would."""
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        if request.method == "GET":
            return httpx2.Response(200, json={"name": "operations/op-1", "done": False})
        return httpx2.Response(200, json=result_message(json.loads(request.content)["id"], {"ok": True}))

    timeouts = Timeouts(read=2.0)
    ext = ExtHttp(
        httpx2.Client(transport=httpx2.MockTransport(handler)),
        URL,
        server="s",
        bearer_token="tok",
        timeouts=timeouts,
        limits=Limits(),
    )
    for read_s in (None, 7.0, None):
        params = {"taskId": "tâche"}
        ext.call("tasks/get", params, name="t1", idempotent=True, budget=UNMETERED, read_timeout=read_s)
    body = json.loads(seen[0].content)
    reference = httpx2.Request("POST", URL, json=body)
    assert seen[0].content == reference.content
    assert seen[0].headers["mcp-method"] == "tasks/get"
    assert seen[0].headers["mcp-protocol-version"] == "2026-07-28"
    assert seen[0].headers["authorization"] == "Bearer tok"
    assert [r.extensions["timeout"]["read"] for r in seen] == [2.0, 7.0, 2.0]
    assert seen[0].extensions["timeout"] is not seen[2].extensions["timeout"]  # each request its own

    config = AdapterConfig(
        name="s", url="http://ops.test", protocol="aip151", protocol_version="v1", timeouts=timeouts
    )
    rest = RestClient(httpx2.Client(transport=httpx2.MockTransport(handler)), config)
    rest.send("GET", "/v1/operations/op-1", what="get", effect=False, budget=UNMETERED)
    assert seen[-1].extensions["timeout"] == {"connect": 5.0, "read": 2.0, "write": 10.0, "pool": 5.0}
