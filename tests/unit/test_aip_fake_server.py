"""longcall's demo AIP-151 server (demo_server.aip151): each AIP point it is faithful on and every switch.

One real server process on loopback for the module (started by ``tests.support.aip_server``); its switches and
request log are reset before each test. Timing tests use operations of a fraction of a second and poll
with a bound (``wait_done``), never a bare sleep.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from demo_server.aip151_model import (
    EMPTY_TYPE,
    ERROR_INFO_TYPE,
    METADATA_TYPE,
    RESPONSE_TYPE,
    RETRY_INFO_TYPE,
    STRUCT_TYPE,
)
from tests import support
from tests.support.aip_server import AipServer, start_aip_server

WAIT_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AipServer]:
    started = start_aip_server(Path(tmp_path_factory.mktemp("aip151")), "--page-size", "2")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def aip(server: AipServer) -> AipServer:
    server.reset()
    return server


@pytest.fixture
def http() -> Iterator[httpx2.Client]:
    with httpx2.Client(timeout=WAIT_S) as client:
        yield client


def project() -> str:
    """A project of this test's own, so ListOperations sees only this test's operations."""
    return f"p-{uuid.uuid4().hex[:10]}"


def run(aip: AipServer, http: httpx2.Client, proj: str = "demo", **body: Any) -> httpx2.Response:
    return http.post(aip.run_url(proj), json={"seconds": 0, **body})


def get(aip: AipServer, http: httpx2.Client, name: str) -> httpx2.Response:
    return http.get(f"{aip.root}/v1/{name}")


def wait_done(aip: AipServer, http: httpx2.Client, name: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        op: dict[str, Any] = get(aip, http, name).json()
        return op if op.get("done") else None

    return support.wait_for(f"{name} to be done", probe, timeout=WAIT_S)


# ---- the lifecycle -------------------------------------------------------------------------------------


def test_running_operation_omits_done_then_completes_with_a_typed_response(
    aip: AipServer, http: httpx2.Client
) -> None:
    created = run(aip, http, "demo", seconds=0.3)
    assert created.status_code == 200
    op = created.json()
    assert op["name"].startswith("projects/demo/operations/")
    assert "done" not in op  # proto3 JSON leaves the default out
    assert "response" not in op
    assert "error" not in op
    assert op["metadata"]["@type"] == METADATA_TYPE
    assert op["metadata"]["state"] == "RUNNING"
    done = wait_done(aip, http, op["name"])
    assert done["done"] is True
    assert done["response"]["@type"] == RESPONSE_TYPE
    assert done["response"]["rows"] == 42
    assert done["metadata"]["state"] == "SUCCEEDED"
    assert "endTime" in done["metadata"]
    assert "error" not in done


def test_zero_seconds_is_done_in_the_create_answer(aip: AipServer, http: httpx2.Client) -> None:
    op = run(aip, http, seconds=0).json()
    assert op["done"] is True
    assert op["response"]["@type"] == RESPONSE_TYPE


def test_error_outcome_is_a_status_with_the_grpc_code_and_error_info(
    aip: AipServer, http: httpx2.Client
) -> None:
    op = run(aip, http, outcome="error").json()
    assert op["done"] is True
    assert op["error"]["code"] == 13
    assert op["error"]["details"][0]["@type"] == ERROR_INFO_TYPE
    assert "response" not in op


def test_empty_outcome_python_and_go_forms(aip: AipServer, http: httpx2.Client) -> None:
    assert run(aip, http, outcome="empty").json()["response"] == {"@type": EMPTY_TYPE}
    aip.faults(go_empty=True)
    assert run(aip, http, outcome="empty").json()["response"] == {"@type": EMPTY_TYPE, "value": {}}


def test_none_outcome_is_done_with_neither_response_nor_error(aip: AipServer, http: httpx2.Client) -> None:
    op = run(aip, http, outcome="none").json()
    assert op["done"] is True
    assert "response" not in op
    assert "error" not in op


def test_well_known_types_writes_struct_anys(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(well_known_types=True)
    op = run(aip, http).json()
    assert op["metadata"]["@type"] == STRUCT_TYPE
    assert op["metadata"]["value"]["state"] == "SUCCEEDED"
    assert op["response"] == {"@type": STRUCT_TYPE, "value": {**op["response"]["value"], "rows": 42}}


def test_emit_default_done_writes_done_false(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(emit_default_done=True)
    assert run(aip, http, seconds=30).json()["done"] is False


def test_go_empty_response_and_unknown_type_switches(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(go_empty_response=True)
    assert run(aip, http).json()["response"] == {"@type": EMPTY_TYPE, "value": {}}
    aip.faults(go_empty_response=False, unknown_type_response=True)
    response = run(aip, http).json()["response"]
    assert response["@type"] == "type.googleapis.com/longcall.demo.v1.NotInAnyDescriptorPool"
    assert response["extra"] == {"nested": [1, 2, 3]}


@pytest.mark.parametrize(
    "body",
    [
        {"seconds": -1},
        {"seconds": "5"},
        {"seconds": True},
        {},
        {"seconds": 1, "outcome": "maybe"},
        {"seconds": 1, "requestId": ""},
        {"seconds": 1, "requestId": "x" * 37},
        {"seconds": 1, "colour": "red"},
    ],
)
def test_bad_run_request_is_invalid_argument(
    aip: AipServer, http: httpx2.Client, body: dict[str, Any]
) -> None:
    answer = http.post(aip.run_url(), json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert aip.operations()["operations"] == []


def test_body_that_is_not_a_json_object_is_invalid_argument(aip: AipServer, http: httpx2.Client) -> None:
    for raw in (b"not json", b"[1]"):
        answer = http.post(aip.run_url(), content=raw)
        assert answer.status_code == 400
        assert answer.json()["error"]["status"] == "INVALID_ARGUMENT"


# ---- get, list, delete, expiry ----------------------------------------------------------------------------


def test_unknown_operation_is_not_found_in_the_aip193_envelope(aip: AipServer, http: httpx2.Client) -> None:
    answer = get(aip, http, "projects/demo/operations/nope")
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == 404
    assert error["status"] == "NOT_FOUND"
    assert error["details"][0]["@type"] == ERROR_INFO_TYPE


def test_grpc_gateway_envelope_is_the_bare_status_with_the_grpc_code(
    aip: AipServer, http: httpx2.Client
) -> None:
    aip.faults(envelope="grpc_gateway")
    answer = get(aip, http, "projects/demo/operations/nope")
    assert answer.status_code == 404
    body = answer.json()
    assert "error" not in body
    assert body["code"] == 5
    assert "not found" in body["message"]


def test_unknown_route_is_not_found(aip: AipServer, http: httpx2.Client) -> None:
    assert http.get(f"{aip.root}/v1/projects/demo/widgets").status_code == 404
    assert http.put(f"{aip.root}/v1/projects/demo/operations/x").status_code == 404


def test_list_pages_with_an_opaque_token(aip: AipServer, http: httpx2.Client) -> None:
    proj = project()
    names = [run(aip, http, proj, seconds=30).json()["name"] for _ in range(3)]
    url = f"{aip.root}/v1/projects/{proj}/operations"
    first = http.get(url).json()  # the server's page size is 2
    assert [op["name"] for op in first["operations"]] == names[:2]
    second = http.get(url, params={"pageToken": first["nextPageToken"]}).json()
    assert [op["name"] for op in second["operations"]] == names[2:]
    assert "nextPageToken" not in second
    assert [op["name"] for op in http.get(url, params={"pageSize": 5}).json()["operations"]] == names


@pytest.mark.parametrize(
    "params", [{"pageToken": "garbage!"}, {"pageSize": "-1"}, {"pageSize": "x"}, {"bogus": "1"}]
)
def test_bad_list_parameters_are_invalid_argument(
    aip: AipServer, http: httpx2.Client, params: dict[str, str]
) -> None:
    answer = http.get(f"{aip.root}/v1/projects/demo/operations", params=params)
    assert answer.status_code == 400
    assert answer.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_delete_forgets_without_cancelling_then_not_found(aip: AipServer, http: httpx2.Client) -> None:
    name = run(aip, http, seconds=30).json()["name"]
    answer = http.delete(f"{aip.root}/v1/{name}")
    assert answer.status_code == 200
    assert answer.json() == {}
    gone = get(aip, http, name)
    assert gone.status_code == 404
    assert "deleted" in gone.json()["error"]["message"]
    assert name in aip.operations()["deleted"]


def test_expiry_after_done_is_not_found(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(expire_after_done_s=0.3)
    name = run(aip, http, seconds=0.2).json()["name"]
    wait_done(aip, http, name)

    def expired() -> httpx2.Response | None:
        answer = get(aip, http, name)
        return answer if answer.status_code == 404 else None

    gone = support.wait_for("the operation to expire", expired, timeout=WAIT_S)
    assert "expired" in gone.json()["error"]["message"]
    assert name in aip.operations()["expired"]


def test_a_running_operation_never_expires(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(expire_after_done_s=0)
    name = run(aip, http, seconds=30).json()["name"]
    assert get(aip, http, name).status_code == 200


# ---- cancel ---------------------------------------------------------------------------------------------


def test_cancel_of_running_answers_empty_then_done_with_cancelled(
    aip: AipServer, http: httpx2.Client
) -> None:
    name = run(aip, http, seconds=30).json()["name"]
    answer = http.post(f"{aip.root}/v1/{name}:cancel")  # empty body, as google-api-core's REST client sends
    assert answer.status_code == 200
    assert answer.json() == {}
    op = get(aip, http, name).json()
    assert op["done"] is True
    assert op["error"]["code"] == 1
    assert "response" not in op
    assert op["metadata"]["cancelRequested"] is True
    assert op["metadata"]["state"] == "CANCELLED"


def test_cancel_takes_effect_later_with_cancel_takes_ms(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(cancel_takes_ms=300)
    name = run(aip, http, seconds=30).json()["name"]
    assert http.post(f"{aip.root}/v1/{name}:cancel", json={}).json() == {}
    assert "done" not in get(aip, http, name).json()  # only acknowledged so far
    assert wait_done(aip, http, name)["error"]["code"] == 1


def test_complete_on_cancel_lets_completion_win(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(complete_on_cancel=1)
    name = run(aip, http, seconds=30).json()["name"]
    assert http.post(f"{aip.root}/v1/{name}:cancel").json() == {}
    op = get(aip, http, name).json()
    assert op["done"] is True
    assert op["response"]["@type"] == RESPONSE_TYPE
    assert "error" not in op


def test_completion_before_a_slow_cancel_lands_wins(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(cancel_takes_ms=5000)
    name = run(aip, http, seconds=0.3).json()["name"]
    http.post(f"{aip.root}/v1/{name}:cancel")
    assert "response" in wait_done(aip, http, name)


@pytest.mark.parametrize(
    ("mode", "status", "grpc_status"),
    [
        ("failed_precondition", 400, "FAILED_PRECONDITION"),
        ("unimplemented", 501, "UNIMPLEMENTED"),
        ("empty", 200, None),
    ],
)
def test_cancel_of_done_is_configurable(
    aip: AipServer, http: httpx2.Client, mode: str, status: int, grpc_status: str | None
) -> None:
    aip.faults(cancel_of_done=mode)
    name = run(aip, http).json()["name"]
    answer = http.post(f"{aip.root}/v1/{name}:cancel")
    assert answer.status_code == status
    if grpc_status is None:
        assert answer.json() == {}
    else:
        assert answer.json()["error"]["status"] == grpc_status
    assert "response" in get(aip, http, name).json()  # unchanged


def test_cancel_of_unknown_operation_is_not_found(aip: AipServer, http: httpx2.Client) -> None:
    assert http.post(f"{aip.root}/v1/projects/demo/operations/nope:cancel").status_code == 404


# ---- request_id (AIP-155) ---------------------------------------------------------------------------------


def test_same_request_id_returns_the_same_operation(aip: AipServer, http: httpx2.Client) -> None:
    rid = str(uuid.uuid4())
    first = run(aip, http, seconds=30, requestId=rid).json()
    again = run(aip, http, seconds=30, requestId=rid).json()
    assert again["name"] == first["name"]
    assert len(aip.operations()["operations"]) == 1


def test_same_request_id_with_another_body_answers_the_earlier_response(
    aip: AipServer, http: httpx2.Client
) -> None:
    rid = str(uuid.uuid4())
    first = run(aip, http, seconds=30, requestId=rid).json()
    assert run(aip, http, seconds=5, outcome="error", requestId=rid).json()["name"] == first["name"]
    aip.faults(request_id_conflict="already_exists")
    conflict = run(aip, http, seconds=5, requestId=rid)
    assert conflict.status_code == 409
    assert conflict.json()["error"]["status"] == "ALREADY_EXISTS"
    assert len(aip.operations()["operations"]) == 1


def test_request_id_of_a_deleted_operation_answers_its_last_state(
    aip: AipServer, http: httpx2.Client
) -> None:
    rid = str(uuid.uuid4())
    name = run(aip, http, requestId=rid).json()["name"]
    http.delete(f"{aip.root}/v1/{name}")
    again = run(aip, http, requestId=rid).json()
    assert again["name"] == name
    assert again["done"] is True
    assert aip.operations()["operations"] == []


def test_ignore_request_id_and_the_dedupe_window_make_a_second_operation(
    aip: AipServer, http: httpx2.Client
) -> None:
    rid = str(uuid.uuid4())
    aip.faults(ignore_request_id=True)
    assert (
        run(aip, http, seconds=30, requestId=rid).json()["name"]
        != run(aip, http, seconds=30, requestId=rid).json()["name"]
    )
    aip.faults(ignore_request_id=False, request_id_window_s=0.2)
    rid = str(uuid.uuid4())
    first = run(aip, http, seconds=30, requestId=rid).json()["name"]
    assert run(aip, http, seconds=30, requestId=rid).json()["name"] == first
    time.sleep(0.25)  # the window is a duration the server measures; nothing to poll for
    assert run(aip, http, seconds=30, requestId=rid).json()["name"] != first


def test_missing_project_is_not_found_and_creates_nothing(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(missing_projects=["gone"])
    answer = run(aip, http, "gone", requestId=str(uuid.uuid4()))
    assert answer.status_code == 404
    assert answer.json()["error"]["details"][0]["reason"] == "PROJECT_NOT_FOUND"
    assert aip.operations()["operations"] == []


# ---- faults: lost create answers, 429/503, delays -----------------------------------------------------


def test_lose_create_response_creates_then_drops_the_connection(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(lose_create_response=1)
    rid = str(uuid.uuid4())
    with pytest.raises(httpx2.RemoteProtocolError):
        run(aip, http, seconds=30, requestId=rid)
    ops = aip.operations()["operations"]
    assert [op["requestId"] for op in ops] == [rid]
    assert run(aip, http, seconds=30, requestId=rid).json()["name"] == ops[0]["name"]  # recovered by key
    assert [e["status"] for e in aip.log()] == [None, 200]


def test_status_after_create_answers_503_after_creating(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(status_after_create={"count": 1})
    answer = run(aip, http, seconds=30)
    assert answer.status_code == 503
    assert answer.json()["error"]["status"] == "UNAVAILABLE"
    assert len(aip.operations()["operations"]) == 1


def test_429_carries_retry_info_and_retry_after_and_does_nothing(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(status_429={"RunReport": {"count": 1, "retry_after_s": 3}})
    refused = run(aip, http)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "3"
    error = refused.json()["error"]
    assert error["status"] == "RESOURCE_EXHAUSTED"
    assert {"@type": RETRY_INFO_TYPE, "retryDelay": "3s"} in error["details"]
    assert aip.operations()["operations"] == []
    assert run(aip, http).status_code == 200  # the count is used up
    entries = aip.log()
    assert [e["inside_retry_after"] for e in entries] == [False, True]


def test_503_for_any_rpc_in_the_grpc_gateway_envelope(aip: AipServer, http: httpx2.Client) -> None:
    aip.faults(envelope="grpc_gateway", status_503={"*": {"count": 2, "retry_after_s": 1}})
    name = "projects/demo/operations/whatever"
    for answer in (get(aip, http, name), http.post(f"{aip.root}/v1/{name}:cancel")):
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["code"] == 14
        assert {"@type": RETRY_INFO_TYPE, "retryDelay": "1s"} in answer.json()["details"]
    assert get(aip, http, name).status_code == 404


def test_rate_limit_window_refuses_every_request_until_it_ends(aip: AipServer, http: httpx2.Client) -> None:
    name = run(aip, http).json()["name"]
    aip.faults(rate_limit_window={"rpc": "GetOperation", "seconds": 0.5})
    refused = get(aip, http, name)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"  # the time left, rounded up
    assert run(aip, http).status_code == 200  # another RPC is not limited
    support.wait_for("the window to end", lambda: get(aip, http, name).status_code == 200, timeout=WAIT_S)


def test_rate_limit_window_can_open_later(aip: AipServer, http: httpx2.Client) -> None:
    name = run(aip, http).json()["name"]
    switches = aip.faults(rate_limit_window={"seconds": 5, "start_in_s": 0.4, "retry_after_s": 3})
    assert switches["rate_limit_window"]["opens_at"] > time.time()
    assert get(aip, http, name).status_code == 200  # not open yet

    def refused() -> httpx2.Response | None:
        answer = get(aip, http, name)
        return answer if answer.status_code == 429 else None

    answer = support.wait_for("the window to open", refused, timeout=WAIT_S)
    assert answer.headers["retry-after"] == "3"


def test_delay_ms_holds_the_answer(aip: AipServer, http: httpx2.Client) -> None:
    name = run(aip, http).json()["name"]
    aip.faults(delay_ms={"GetOperation": 300})
    started = time.monotonic()
    assert get(aip, http, name).status_code == 200
    assert time.monotonic() - started >= 0.3


def test_log_records_method_path_rpc_status_and_time(aip: AipServer, http: httpx2.Client) -> None:
    before = time.time()
    name = run(aip, http).json()["name"]
    get(aip, http, name)
    entries = aip.log()
    assert [(e["method"], e["rpc"], e["status"]) for e in entries] == [
        ("POST", "RunReport", 200),
        ("GET", "GetOperation", 200),
    ]
    assert entries[1]["path"] == f"/v1/{name}"
    assert all(before <= e["t"] <= time.time() for e in entries)


@pytest.mark.parametrize(
    "switches",
    [
        {"status_429": {"Nope": {"count": 1}}},
        {"envelope": "xml"},
        {"no_such_switch": 1},
        {"expire_after_done_s": -1},
    ],
)
def test_bad_fault_switches_are_refused(
    aip: AipServer, http: httpx2.Client, switches: dict[str, Any]
) -> None:
    assert http.post(f"{aip.control}/faults", json=switches).status_code == 400


def test_reset_restores_the_command_line_defaults(tmp_path: Path, http: httpx2.Client) -> None:
    own = start_aip_server(tmp_path, "--envelope", "grpc_gateway", "--cancel-of-done", "unimplemented")
    try:
        own.faults(envelope="aip193", cancel_of_done="empty")
        own.reset()
        switches = http.get(f"{own.control}/faults").json()
        assert (switches["envelope"], switches["cancel_of_done"]) == ("grpc_gateway", "unimplemented")
    finally:
        own.stop()
