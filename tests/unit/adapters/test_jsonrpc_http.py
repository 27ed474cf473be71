from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from adapters.errors import (
    AdapterError,
    NoWorkDone,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    TooManyRequests,
    Transient,
)
from adapters.jsonrpc import (
    ErrorResponse,
    Notification,
    Request,
    Response,
    classify_http_status,
    decode_json,
    parse_message,
    parse_messages,
    parse_retry_after,
)
from tests.unit.adapters.mcp_fakes import wire, wire_messages

NOW = datetime(2026, 11, 30, 8, 0, 0, tzinfo=UTC)


def test_messages_of_every_kind_in_the_input_required_stream_are_classified() -> None:
    entry = wire("sse")["42 [A] tasks/result (input_required) SSE stream"]
    kinds = [type(parse_message(m)) for m in wire_messages(entry)]
    assert kinds == [Request, Response]


def test_a_status_notification_is_a_notification() -> None:
    message = parse_message(
        {
            "jsonrpc": "2.0",
            "method": "notifications/tasks/status",
            "params": {"taskId": "t", "status": "working"},
        }
    )
    assert message == Notification(
        method="notifications/tasks/status", params={"taskId": "t", "status": "working"}
    )


def test_transport_error_with_the_non_standard_server_error_id_keeps_code_and_message() -> None:
    body = wire("sse")["51 [A] tasks/get after DELETE (same session id)"]["body"]
    message = parse_message(body)
    assert isinstance(message, ErrorResponse)
    assert (message.id, message.code, message.message) == ("server-error", -32600, "Session not found")


@pytest.mark.parametrize(
    "value",
    [
        {"id": 1, "result": {}},
        {"jsonrpc": "1.0", "id": 1, "result": {}},
        {"jsonrpc": "2.0", "id": True, "result": {}},
        {"jsonrpc": "2.0", "id": 1, "result": []},
        {"jsonrpc": "2.0", "id": 1, "error": {"code": "x", "message": "m"}},
        {"jsonrpc": "2.0", "id": 1},
        {"jsonrpc": "2.0", "method": 5},
        {"jsonrpc": "2.0", "method": "m", "params": [1]},
        [1, 2],
    ],
)
def test_malformed_messages_are_protocol_violations(value: object) -> None:
    with pytest.raises(ProtocolViolation):
        parse_message(value)


def test_a_batch_body_is_a_list_of_messages() -> None:
    batch = [{"jsonrpc": "2.0", "method": "n"}, {"jsonrpc": "2.0", "id": 3, "result": {}}]
    assert [type(m) for m in parse_messages(batch)] == [Notification, Response]


def test_invalid_json_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation):
        decode_json(b"{not json")


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("7", 7.0),
        (" 0 ", 0.0),
        ("Mon, 30 Nov 2026 08:00:30 GMT", 30.0),
        ("Mon, 30 Nov 2026 07:59:00 GMT", 0.0),
        ("soon", None),
        ("-5", None),
        (None, None),
    ],
)
def test_retry_after_reads_seconds_and_http_dates(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header, now=NOW) == seconds


def _status(
    status: int, *, idempotent: bool = True, headers: dict[str, str] | None = None, body: object = None
) -> AdapterError:
    raw = json.dumps(body).encode() if body is not None else b""
    return classify_http_status(status, headers=headers or {}, body=raw, idempotent=idempotent, now=NOW)


def test_406_not_acceptable_is_a_rejection_with_the_server_text() -> None:
    error = _status(
        406,
        body={
            "jsonrpc": "2.0",
            "id": "server-error",
            "error": {
                "code": -32600,
                "message": "Not Acceptable: Client must accept both application/json and text/event-stream",
            },
        },
    )
    assert isinstance(error, Rejected)
    assert (error.http_status, error.code) == (406, -32600)
    assert "Not Acceptable" in str(error)


def test_400_missing_session_from_the_transcript_is_a_rejection() -> None:
    body = wire("sse")["48 [A] tasks/get without Mcp-Session-Id"]["body"]
    error = _status(400, body=body)
    assert isinstance(error, Rejected)
    assert error.http_status == 400
    assert "Missing session ID" in str(error)


def test_400_bad_protocol_version_from_the_transcript_is_a_rejection() -> None:
    body = wire("sse")["43 [A] tools/list with bad MCP-Protocol-Version"]["body"]
    error = _status(400, body=body)
    assert isinstance(error, Rejected)
    assert "Unsupported protocol version" in str(error)


RETRY_AFTER = [("12", 12.0), ("Mon, 30 Nov 2026 08:01:00 GMT", 60.0), (None, None)]


@pytest.mark.parametrize("idempotent", [True, False])
@pytest.mark.parametrize(("header", "seconds"), RETRY_AFTER)
def test_429_proves_no_work_was_done_for_any_request(
    idempotent: bool, header: str | None, seconds: float | None
) -> None:
    error = _status(429, idempotent=idempotent, headers={"retry-after": header} if header else {})
    assert type(error) is TooManyRequests
    assert isinstance(error, RateLimited)
    assert isinstance(error, NoWorkDone)
    assert error.retry_after == seconds


@pytest.mark.parametrize(("header", "seconds"), RETRY_AFTER)
def test_503_is_a_rate_limit_for_a_read(header: str | None, seconds: float | None) -> None:
    error = _status(503, idempotent=True, headers={"retry-after": header} if header else {})
    assert type(error) is RateLimited
    assert not isinstance(error, NoWorkDone)
    assert error.retry_after == seconds


@pytest.mark.parametrize("status", [408, 500, 502, 503, 504])
@pytest.mark.parametrize(("header", "seconds"), RETRY_AFTER)
def test_408_and_5xx_to_a_request_with_an_effect_are_an_unknown_outcome(
    status: int, header: str | None, seconds: float | None
) -> None:
    # Rule 1: a gateway may answer any of these after the origin did the work (a created task).
    error = _status(status, idempotent=False, headers={"retry-after": header} if header else {})
    assert type(error) is OutcomeUnknown
    assert error.retry_after == seconds


@pytest.mark.parametrize("status", [408, 500, 502, 504])
def test_408_and_server_errors_are_transient_for_reads(status: int) -> None:
    error = _status(status, idempotent=True)
    assert type(error) is Transient
    assert not isinstance(error, NoWorkDone)


@pytest.mark.parametrize("status", [401, 403, 405, 413, 415])
def test_other_client_errors_are_rejections(status: int) -> None:
    error = _status(status, body="plain text")
    assert isinstance(error, Rejected)
    assert error.http_status == status


def test_a_redirect_is_a_protocol_violation() -> None:
    assert isinstance(_status(307), ProtocolViolation)
