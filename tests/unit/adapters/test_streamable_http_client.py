from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator

import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters import Limits, Timeouts
from adapters.errors import (
    AnswerTooLarge,
    NotFound,
    NotSent,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    Transient,
)
from adapters.jsonrpc import Message, Request, Response
from adapters.streamable_http import (
    ACCEPT,
    Session,
    SessionGone,
    StreamableHttpClient,
    map_transport_error,
)
from tests.unit.adapters.mcp_fakes import URL, ChunkedStream, error_message, result_message, sse_body

SESSION = Session(session_id="abc", protocol_version="2025-11-25")
Handler = Callable[[httpx2.Request], httpx2.Response]


def client(
    handler: Handler, *, limits: Limits | None = None, token: str | None = None
) -> StreamableHttpClient:
    return StreamableHttpClient(
        httpx2.Client(transport=httpx2.MockTransport(handler)),
        URL,
        bearer_token=token,
        timeouts=Timeouts(read=2.0),
        limits=limits or Limits(),
        new_id=lambda: "req-1",
    )


def sse(messages: list[dict[str, object]], **headers: str) -> httpx2.Response:
    return httpx2.Response(
        200, content=sse_body(messages), headers={"content-type": "text/event-stream", **headers}
    )


def test_every_post_carries_accept_version_session_and_token() -> None:
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json=result_message("req-1", {}))

    client(handler, token="s3cret").request("ping", {}, session=SESSION, idempotent=True)
    headers = seen[0].headers
    assert headers["accept"] == ACCEPT == "application/json, text/event-stream"
    assert headers["mcp-protocol-version"] == "2025-11-25"
    assert headers["mcp-session-id"] == "abc"
    assert headers["authorization"] == "Bearer s3cret"
    assert json.loads(seen[0].content) == {"jsonrpc": "2.0", "id": "req-1", "method": "ping", "params": {}}


def test_a_stateless_session_sends_no_session_header() -> None:
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json=result_message("req-1", {}))

    client(handler).request("ping", {}, session=Session(None, "2025-11-25"), idempotent=True)
    assert "mcp-session-id" not in seen[0].headers


def test_json_answer_returns_the_response_and_the_session_header() -> None:
    answer = client(
        lambda _: httpx2.Response(
            200, json=result_message("req-1", {"ok": 1}), headers={"mcp-session-id": "new"}
        )
    ).request("initialize", {}, session=None, idempotent=True)
    assert answer.response == Response(id="req-1", result={"ok": 1})
    assert answer.session_id == "new"


def test_sse_answer_is_matched_by_id_among_interleaved_requests_and_notifications() -> None:
    messages = [
        {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}},
        {"jsonrpc": "2.0", "id": "srv-1", "method": "elicitation/create", "params": {"message": "ok?"}},
        result_message("req-1", {"done": True}),
        {"jsonrpc": "2.0", "method": "notifications/after", "params": {}},
    ]
    answer = client(lambda _: sse(messages)).request("tasks/result", {}, session=SESSION, idempotent=True)
    assert answer.response == Response(id="req-1", result={"done": True})
    assert [r.id for r in answer.server_requests] == ["srv-1"]
    assert [n.method for n in answer.notifications] == ["notifications/progress"]


def test_sse_events_without_data_and_priming_events_are_skipped() -> None:
    body = b"id: 1\r\ndata:\r\n\r\n: comment\r\n\r\nevent: message\r\nretry: 100\r\n\r\n" + sse_body(
        [result_message("req-1", {})]
    )
    answer = client(
        lambda _: httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})
    ).request("tasks/get", {}, session=SESSION, idempotent=True)
    assert answer.response == Response(id="req-1", result={})


def test_until_stops_reading_at_the_awaited_server_request() -> None:
    messages = [{"jsonrpc": "2.0", "id": "srv-1", "method": "elicitation/create", "params": {}}]

    def fail_after(_: httpx2.Request) -> httpx2.Response:
        # The stream would fail if read past the request: stopping early must not read on.
        stream = ChunkedStream([sse_body(messages)], fail=httpx2.ReadTimeout("blocked"))
        return httpx2.Response(200, stream=stream, headers={"content-type": "text/event-stream"})

    def is_request(message: Message) -> bool:
        return isinstance(message, Request)

    answer = client(fail_after).request(
        "tasks/result", {}, session=SESSION, idempotent=True, until=is_request
    )
    assert answer.response is None
    assert [r.method for r in answer.server_requests] == ["elicitation/create"]


def test_patient_read_that_times_out_returns_waited_out() -> None:
    def blocked(_: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200,
            stream=ChunkedStream([], fail=httpx2.ReadTimeout("no bytes")),
            headers={"content-type": "text/event-stream"},
        )

    answer = client(blocked).request("tasks/result", {}, session=SESSION, idempotent=True, patient=True)
    assert answer.waited_out
    assert answer.response is None


def test_a_response_for_another_id_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="another request id"):
        client(lambda _: httpx2.Response(200, json=result_message("other", {}))).request(
            "tasks/get", {}, session=SESSION, idempotent=True
        )


def test_an_unknown_content_type_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation, match="content type"):
        client(lambda _: httpx2.Response(200, text="<html>")).request(
            "tasks/get", {}, session=SESSION, idempotent=True
        )


@pytest.mark.parametrize("mode", ["json", "sse"])
def test_an_oversized_answer_is_a_protocol_violation(mode: str) -> None:
    big = result_message("req-1", {"blob": "x" * 5000})

    def handler(_: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, json=big) if mode == "json" else sse([big])

    # Its own error (issue 19): an answer over the cap is a result too large to store, not a read to retry.
    with pytest.raises(AnswerTooLarge, match=r"the 1024-byte cap") as caught:
        client(handler, limits=Limits(max_body_bytes=1024)).request(
            "tasks/get", {}, session=SESSION, idempotent=True
        )
    assert isinstance(caught.value, ProtocolViolation)
    assert caught.value.limit == 1024
    if mode == "json":  # its Content-Length proves it before any byte of it is read
        assert caught.value.declared_bytes is not None
        assert caught.value.declared_bytes > 5000
        assert caught.value.read_bytes == 0
    else:
        assert caught.value.declared_bytes is None
        assert caught.value.read_bytes > 1024


@pytest.mark.parametrize(("idempotent", "error"), [(True, Transient), (False, OutcomeUnknown)])
def test_a_stream_that_ends_without_the_response(idempotent: bool, error: type[Exception]) -> None:
    with pytest.raises(error, match="ended without a response"):
        client(lambda _: sse([{"jsonrpc": "2.0", "method": "n", "params": {}}])).request(
            "tools/call", {}, session=SESSION, idempotent=idempotent
        )


@pytest.mark.parametrize(("idempotent", "error"), [(True, Transient), (False, OutcomeUnknown)])
def test_a_202_to_a_request_means_accepted_and_nothing_more(idempotent: bool, error: type[Exception]) -> None:
    with pytest.raises(error, match="accepted without an answer"):
        client(lambda _: httpx2.Response(202)).request(
            "tools/call", {}, session=SESSION, idempotent=idempotent
        )


def test_404_on_a_session_is_session_gone() -> None:
    body = {"jsonrpc": "2.0", "id": "server-error", "error": {"code": -32600, "message": "Session not found"}}
    with pytest.raises(SessionGone) as caught:
        client(lambda _: httpx2.Response(404, json=body)).request(
            "tasks/get", {}, session=SESSION, idempotent=True
        )
    assert isinstance(caught.value, NotFound)
    assert caught.value.session_gone


def test_404_without_a_session_is_a_rejection_of_the_endpoint() -> None:
    with pytest.raises(Rejected):
        client(lambda _: httpx2.Response(404)).request("initialize", {}, session=None, idempotent=True)


def test_429_with_retry_after_is_rate_limited() -> None:
    with pytest.raises(RateLimited) as caught:
        client(lambda _: httpx2.Response(429, headers={"retry-after": "3"})).request(
            "tasks/get", {}, session=SESSION, idempotent=True
        )
    assert caught.value.retry_after == 3.0


def test_post_message_accepts_202_and_maps_404_to_session_gone() -> None:
    client(lambda _: httpx2.Response(202)).post_message(
        {"jsonrpc": "2.0", "method": "n"}, session=SESSION, what="n"
    )
    with pytest.raises(SessionGone):
        client(lambda _: httpx2.Response(404)).post_message(
            {"jsonrpc": "2.0", "method": "n"}, session=SESSION, what="n"
        )


def raising(exc: Exception) -> Handler:
    def handler(_: httpx2.Request) -> httpx2.Response:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("exc", "idempotent", "expected"),
    [
        (httpx2.ConnectError("refused"), False, NotSent),
        (httpx2.ConnectTimeout("slow"), False, NotSent),
        (httpx2.PoolTimeout("busy"), False, NotSent),
        (httpx2.ReadTimeout("slow"), True, Transient),
        (httpx2.ReadTimeout("slow"), False, OutcomeUnknown),
        (httpx2.WriteTimeout("slow"), False, OutcomeUnknown),
        (httpx2.RemoteProtocolError("peer closed"), False, OutcomeUnknown),
        (httpx2.ReadError("reset"), True, Transient),
        (httpx2.UnsupportedProtocol("ftp"), True, Rejected),
        (httpx2.DecodingError("gzip"), True, ProtocolViolation),
    ],
)
def test_httpx_exceptions_are_mapped_at_the_edge_with_their_cause(
    exc: Exception, idempotent: bool, expected: type[Exception]
) -> None:
    with pytest.raises(expected) as caught:
        client(raising(exc)).request("tools/call", {}, session=SESSION, idempotent=idempotent)
    assert type(caught.value) is expected
    assert caught.value.__cause__ is exc


def test_connection_dropped_mid_stream_on_a_create_is_outcome_unknown() -> None:
    def dropped(_: httpx2.Request) -> httpx2.Response:
        stream = ChunkedStream(
            [b'event: message\r\ndata: {"jsonrpc"'], fail=httpx2.RemoteProtocolError("dropped")
        )
        return httpx2.Response(200, stream=stream, headers={"content-type": "text/event-stream"})

    with pytest.raises(OutcomeUnknown) as caught:
        client(dropped).request("tools/call", {}, session=SESSION, idempotent=False)
    assert isinstance(caught.value.__cause__, httpx2.RemoteProtocolError)


def test_map_transport_error_names_the_method() -> None:
    error = map_transport_error(httpx2.ReadTimeout("slow"), idempotent=False, method="tools/call")
    assert "tools/call" in str(error)


def test_error_responses_in_a_stream_are_returned_for_the_caller_to_classify() -> None:
    answer = client(lambda _: sse([error_message("req-1", -32602, "Task not found: x")])).request(
        "tasks/get", {}, session=SESSION, idempotent=True
    )
    assert answer.response is not None
    assert not isinstance(answer.response, Response)


def resumable(*legs: httpx2.Response) -> tuple[Handler, list[httpx2.Request]]:
    """A server whose POST stream closes early; each later GET (with Last-Event-ID) gets the next leg."""
    seen: list[httpx2.Request] = []
    answers = list(legs)

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return answers.pop(0)

    return handler, seen


def sse_raw(text: str) -> httpx2.Response:
    return httpx2.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def test_a_stream_closed_after_an_event_id_is_resumed_with_last_event_id() -> None:
    final = json.dumps(result_message("req-1", {"task": "ok"}))
    handler, seen = resumable(
        sse_raw("id: e1\r\nretry: 5\r\ndata:\r\n\r\n"),
        sse_raw(f"id: e2\r\nevent: message\r\ndata: {final}\r\n\r\n"),
    )
    answer = client(handler).request("tools/call", {}, session=SESSION, idempotent=False)
    assert answer.response == Response(id="req-1", result={"task": "ok"})
    post, get = seen
    assert (post.method, get.method) == ("POST", "GET")
    assert get.headers["last-event-id"] == "e1"
    assert get.headers["accept"] == "text/event-stream"
    assert get.headers["mcp-session-id"] == "abc"


def test_server_requests_before_the_break_are_kept_across_resumption() -> None:
    ask = json.dumps({"jsonrpc": "2.0", "id": "srv-1", "method": "elicitation/create", "params": {}})
    final = json.dumps(result_message("req-1", {}))
    handler, _ = resumable(
        sse_raw(f"id: 1\ndata: {ask}\n\n"),
        sse_raw(f"id: 2\ndata: {final}\n\n"),
    )
    answer = client(handler).request("tasks/result", {}, session=SESSION, idempotent=True)
    assert [r.id for r in answer.server_requests] == ["srv-1"]
    assert answer.response is not None


@pytest.mark.parametrize("status", [404, 405, 401])
@pytest.mark.parametrize(("idempotent", "error"), [(True, Transient), (False, OutcomeUnknown)])
def test_a_stream_the_server_cannot_resume_is_lost(
    idempotent: bool, error: type[Exception], status: int
) -> None:
    """Whatever refuses the resumption, a 404 for the session included: the request reached the server
    (its stream had begun), so its answer is lost, never "the session was gone before it ran"."""
    handler, seen = resumable(sse_raw("id: e1\ndata:\n\n"), httpx2.Response(status))
    with pytest.raises(error, match="could not be resumed"):
        client(handler).request("tools/call", {}, session=SESSION, idempotent=idempotent)
    assert len(seen) == 2


def test_resumption_is_bounded() -> None:
    legs = [sse_raw(f"id: e{n}\ndata:\n\n") for n in range(10)]
    handler, seen = resumable(*legs)
    with pytest.raises(OutcomeUnknown, match="closed without a response"):
        client(handler, limits=Limits(max_resumptions=2)).request(
            "tools/call", {}, session=SESSION, idempotent=False
        )
    assert [r.method for r in seen] == ["POST", "GET", "GET"]
    assert seen[-1].headers["last-event-id"] == "e1"


def test_a_stream_without_event_ids_is_not_resumed() -> None:
    handler, seen = resumable(sse([{"jsonrpc": "2.0", "method": "n", "params": {}}]))
    with pytest.raises(OutcomeUnknown, match="ended without a response"):
        client(handler).request("tools/call", {}, session=SESSION, idempotent=False)
    assert len(seen) == 1


_other = st.one_of(
    st.builds(
        lambda n: {"jsonrpc": "2.0", "method": f"notifications/n{n}", "params": {"n": n}},
        st.integers(0, 99),
    ),
    st.builds(
        lambda n: {"jsonrpc": "2.0", "id": f"srv-{n}", "method": "elicitation/create", "params": {"n": n}},
        st.integers(0, 99),
    ),
)


@given(
    before=st.lists(_other, max_size=5),
    after=st.lists(_other, max_size=3),
    newline=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=10),
)
def test_the_response_is_found_among_any_interleaving_and_chunking(
    before: list[dict[str, object]], after: list[dict[str, object]], newline: str, cuts: list[int]
) -> None:
    messages = [*before, result_message("req-1", {"ok": True}), *after]
    raw = sse_body(messages, newline=newline)
    bounds = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    chunks = [raw[a:b] for a, b in itertools.pairwise(bounds)]

    def handler(_: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, stream=ChunkedStream(chunks), headers={"content-type": "text/event-stream"}
        )

    answer = client(handler).request("tasks/result", {}, session=SESSION, idempotent=True)
    assert answer.response == Response(id="req-1", result={"ok": True})
    assert [r.id for r in answer.server_requests] == [m["id"] for m in before if "id" in m]
    assert [n.method for n in answer.notifications] == [m["method"] for m in before if "id" not in m]


SSE_HEADERS = {"content-type": "text/event-stream"}


class _CutStream(httpx2.SyncByteStream):
    """An event stream whose connection breaks after ``text``."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __iter__(self) -> Iterator[bytes]:
        yield self._text.encode()
        raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body")


def _asks(message: Message) -> bool:
    return isinstance(message, Request) and message.method == "elicitation/create"


def test_a_patient_read_resumes_a_stream_cut_under_a_server_request() -> None:
    """Issue 8 item 5: the stream that was to carry the server's question is cut after an event id; only
    resuming it (Last-Event-ID) brings the question back, patient read or not."""
    ask = json.dumps({"jsonrpc": "2.0", "id": "srv-1", "method": "elicitation/create", "params": {}})
    handler, seen = resumable(
        httpx2.Response(200, stream=_CutStream("id: s-0\r\ndata: \r\n\r\n"), headers=SSE_HEADERS),
        sse_raw(f"id: s-1\r\nevent: message\r\ndata: {ask}\r\n\r\n"),
    )
    answer = client(handler).request(
        "tasks/result", {}, session=SESSION, idempotent=True, read_timeout=1.0, until=_asks, patient=True
    )
    assert [r.id for r in answer.server_requests] == ["srv-1"]
    assert [r.method for r in seen] == ["POST", "GET"]
    assert seen[1].headers["last-event-id"] == "s-0"


def test_a_patient_read_of_a_stream_closed_after_an_event_id_resumes_it() -> None:
    ask = json.dumps({"jsonrpc": "2.0", "id": "srv-1", "method": "elicitation/create", "params": {}})
    handler, seen = resumable(
        sse_raw("id: s-0\r\ndata: \r\n\r\n"), sse_raw(f"id: s-1\r\ndata: {ask}\r\n\r\n")
    )
    answer = client(handler).request(
        "tasks/result", {}, session=SESSION, idempotent=True, read_timeout=1.0, until=_asks, patient=True
    )
    assert [r.id for r in answer.server_requests] == ["srv-1"]
    assert len(seen) == 2


def test_a_patient_read_of_a_cut_stream_without_event_ids_is_not_resumed() -> None:
    handler, seen = resumable(httpx2.Response(200, stream=_CutStream("data: \r\n\r\n"), headers=SSE_HEADERS))
    with pytest.raises(Transient):
        client(handler).request(
            "tasks/result", {}, session=SESSION, idempotent=True, read_timeout=1.0, until=_asks, patient=True
        )
    assert len(seen) == 1


def test_a_patient_read_whose_resumptions_run_out_has_waited_out() -> None:
    legs = [sse_raw(f"id: e{n}\ndata:\n\n") for n in range(10)]
    handler, seen = resumable(*legs)
    answer = client(handler, limits=Limits(max_resumptions=2)).request(
        "tasks/result", {}, session=SESSION, idempotent=True, read_timeout=1.0, until=_asks, patient=True
    )
    assert (answer.response, answer.waited_out) == (None, True)
    assert [r.method for r in seen] == ["POST", "GET", "GET"]
