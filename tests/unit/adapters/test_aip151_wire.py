"""AIP-151 on the wire: Operation JSON, both error envelopes, RetryInfo, and the create built from a route
(pure functions, reference/aip-151.md §2)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters.aip151.wire import (
    StatusNotFound,
    build_create,
    classify_error,
    operation_path,
    parse_duration,
    parse_error_body,
    parse_operation,
    parse_operation_page,
)
from adapters.base import ToolRoute
from adapters.errors import (
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    TooManyRequests,
    Transient,
    Unauthorized,
)

NAME = "projects/demo/operations/op-1"
META = {"@type": "type.googleapis.com/google.protobuf.Struct", "value": {"state": "RUNNING"}}
EMPTY_PY = {"@type": "type.googleapis.com/google.protobuf.Empty"}
EMPTY_GO = {"@type": "type.googleapis.com/google.protobuf.Empty", "value": {}}
ROUTE = ToolRoute(create="POST /v1/projects/{project}/reports:run", request_id_field="requestId")


def test_a_running_operation_omits_done() -> None:
    status = parse_operation({"name": NAME, "metadata": META}, server="s")
    assert (status.remote_id, status.server_state, status.terminal, status.result) == (
        NAME,
        "done=false",
        None,
        None,
    )
    assert status.poll_interval_ms is None
    assert status.ttl_ms is None
    assert parse_operation({"name": NAME, "done": False}, server="s").terminal is None


def test_a_response_is_completed_and_the_result_is_the_done_operation() -> None:
    op = {"name": NAME, "metadata": META, "done": True, "response": {"@type": "x/y.Report", "rows": 3}}
    status = parse_operation(op, server="s")
    assert (status.terminal, status.server_state) == ("completed", "done=true response")
    assert status.result is not None
    assert status.result.outcome == "completed"
    assert not status.result.is_error
    assert status.result.payload == op


@pytest.mark.parametrize("empty", [EMPTY_PY, EMPTY_GO, {"@type": "type.example.com/unknown.Thing", "a": [1]}])
def test_any_values_are_kept_as_json_whatever_their_type(empty: dict[str, Any]) -> None:
    status = parse_operation({"name": NAME, "done": True, "response": empty}, server="s")
    assert status.terminal == "completed"
    assert status.result is not None
    assert status.result.payload["response"] == empty


def test_error_code_1_is_cancelled_and_other_codes_fail() -> None:
    cancelled = parse_operation(
        {"name": NAME, "done": True, "error": {"code": 1, "message": "x"}}, server="s"
    )
    assert (cancelled.terminal, cancelled.server_state) == ("cancelled", "done=true error CANCELLED")
    details = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "BOOM"}]
    failed = parse_operation(
        {"name": NAME, "done": True, "error": {"code": 13, "message": "boom", "details": details}}, server="s"
    )
    assert (failed.terminal, failed.server_state, failed.status_message) == (
        "failed",
        "done=true error INTERNAL",
        "boom",
    )
    assert failed.result is not None
    assert failed.result.error is not None
    assert (failed.result.error.code, failed.result.error.data) == (13, details)
    assert failed.result.is_error


def test_done_with_neither_is_completed_without_a_response() -> None:
    status = parse_operation({"name": NAME, "done": True}, server="s")
    assert (status.terminal, status.server_state) == ("completed", "done=true neither")
    assert status.result is not None
    assert "response" not in status.result.payload


@pytest.mark.parametrize(
    "op",
    [
        [],
        {"name": 3},
        {"name": NAME, "done": "true"},
        {"name": NAME, "done": True, "error": {"code": 1}, "response": EMPTY_PY},
        {"name": NAME, "response": EMPTY_PY},
        {"name": NAME, "done": True, "response": "x"},
        {"name": NAME, "done": True, "error": {"code": "13"}},
        {"metadata": META},
        {"name": "../../etc/passwd"},
        {"name": "/abs/operations/1"},
        {"name": "projects/p/operations/1?x=1"},
    ],
)
def test_what_is_not_an_operation_is_a_protocol_violation(op: object) -> None:
    with pytest.raises(ProtocolViolation):
        parse_operation(op, server="s")


def test_another_operations_answer_is_refused() -> None:
    with pytest.raises(ProtocolViolation, match="asked for"):
        parse_operation({"name": "projects/demo/operations/op-2"}, server="s", expected_name=NAME)


def test_an_operation_read_by_name_keeps_that_name_when_the_answer_leaves_it_out() -> None:
    status = parse_operation({"done": True, "response": EMPTY_PY}, server="s", expected_name=NAME)
    assert status.remote_id == NAME


def test_a_done_validate_only_operation_may_have_no_name() -> None:
    status = parse_operation({"done": True, "response": EMPTY_PY}, server="s")
    assert status.remote_id == ""
    assert status.terminal == "completed"


def test_the_operation_path_is_built_from_its_name() -> None:
    assert operation_path(NAME) == "/v1/projects/demo/operations/op-1"
    assert operation_path("operations/abc:1") == "/v1/operations/abc:1"
    spanner = "projects/p/instances/i/databases/d/operations/_auto_op_1a2b"
    assert operation_path(spanner) == "/v1/" + spanner


def test_a_list_page_and_its_token() -> None:
    ops, token = parse_operation_page({"operations": [{"name": NAME}], "nextPageToken": "t2"}, server="s")
    assert [o.remote_id for o in ops] == [NAME]
    assert token == "t2"
    assert parse_operation_page({}, server="s") == ([], None)


# ------------------------------------------------------------------------------------------- errors


def _aip193(http: int, status: str, delay: str | None = None) -> bytes:
    details: list[dict[str, Any]] = []
    if delay is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay})
    return json.dumps(
        {"error": {"code": http, "status": status, "message": "m", "details": details}}
    ).encode()


def _gateway(code: int, delay: str | None = None) -> bytes:
    details: list[dict[str, Any]] = []
    if delay is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay})
    return json.dumps({"code": code, "message": "m", "details": details}).encode()


def test_both_envelopes_are_read() -> None:
    assert parse_error_body(404, _aip193(404, "NOT_FOUND")).status == "NOT_FOUND"
    assert parse_error_body(404, _gateway(5)).status == "NOT_FOUND"
    gateway = parse_error_body(429, _gateway(8, "2.5s"))
    assert (gateway.code, gateway.status, gateway.retry_delay_s) == (8, "RESOURCE_EXHAUSTED", 2.5)
    assert parse_error_body(502, b"<html>bad gateway</html>").status == "INTERNAL"


@pytest.mark.parametrize("body", [_aip193(429, "RESOURCE_EXHAUSTED", "2.5s"), _gateway(8, "2.5s")])
def test_retry_info_and_retry_after_the_longer_wins(body: bytes) -> None:
    _, error = classify_error(429, {"retry-after": "1"}, body, effect=True, what="x")
    assert isinstance(error, TooManyRequests)
    assert error.retry_after == 2.5
    _, error = classify_error(429, {"retry-after": "4"}, body, effect=False, what="x")
    assert isinstance(error, TooManyRequests)
    assert error.retry_after == 4.0


def test_unavailable_is_rate_limited_for_a_read_and_unknown_for_an_effect() -> None:
    body = _aip193(503, "UNAVAILABLE", "3s")
    _, read = classify_error(503, {}, body, effect=False, what="x")
    _, effect = classify_error(503, {}, body, effect=True, what="x")
    assert isinstance(read, RateLimited)
    assert read.retry_after == 3.0
    assert isinstance(effect, OutcomeUnknown)
    assert effect.retry_after == 3.0
    _, other = classify_error(500, {}, _gateway(13), effect=False, what="x")
    assert type(other) is Transient


@pytest.mark.parametrize(
    ("http", "body", "kind"),
    [
        # The server's own NOT_FOUND (a google.rpc.Status): the proof a lookup by key needs (issue 19).
        (404, _aip193(404, "NOT_FOUND"), StatusNotFound),
        (404, _gateway(5), StatusNotFound),
        (404, b"404 page not found", NotFound),  # a proxy's or a router's: a plain NotFound only
        (501, _aip193(501, "UNIMPLEMENTED"), Rejected),
        (501, _gateway(12), Rejected),
        (400, _aip193(400, "FAILED_PRECONDITION"), Rejected),
        (403, _gateway(7), Unauthorized),  # PERMISSION_DENIED: a Rejected that names the credentials
    ],
)
def test_definitive_answers(http: int, body: bytes, kind: type[Exception]) -> None:
    _, error = classify_error(http, {}, body, effect=True, what="x")
    assert type(error) is kind
    if isinstance(error, NotFound):  # only the service's own NOT_FOUND is the server's word on the task
        assert error.servers_word is (kind is StatusNotFound)


def test_failed_precondition_keeps_its_grpc_code() -> None:
    _, error = classify_error(400, {}, _aip193(400, "FAILED_PRECONDITION"), effect=True, what="x")
    assert isinstance(error, Rejected)
    assert error.code == 9
    assert error.http_status == 400


@pytest.mark.parametrize(("text", "seconds"), [("2.5s", 2.5), ("1s", 1.0), ("0.000000001s", 1e-9)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", [None, 3, "3", "-1s", "1m", {"seconds": 1}])
def test_bad_durations_are_none(text: object) -> None:
    assert parse_duration(text) is None


# ------------------------------------------------------------------------------------------- create


def test_the_create_fills_the_path_and_puts_the_key_in_the_body() -> None:
    request = build_create("run", ROUTE, {"project": "demo", "seconds": 2}, "key-1")
    assert (request.method, request.path) == ("POST", "/v1/projects/demo/reports:run")
    assert request.body == {"seconds": 2, "requestId": "key-1"}


def test_a_placeholder_value_is_escaped() -> None:
    request = build_create("run", ROUTE, {"project": "a/../b?c"}, "k")
    assert request.path == "/v1/projects/a%2F..%2Fb%3Fc/reports:run"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"seconds": 2}, "needs the argument"),
        ({"project": ["x"]}, "needs the argument"),
        ({"project": ""}, "needs the argument"),
        ({"project": "demo", "requestId": "mine"}, "leave it out"),
    ],
)
def test_arguments_that_do_not_fit_the_route_are_refused(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(Rejected, match=message):
        build_create("run", ROUTE, arguments, "k")


def test_a_tool_without_a_route_is_refused() -> None:
    with pytest.raises(Rejected, match="no create route"):
        build_create("run", ToolRoute(), {}, "k")
