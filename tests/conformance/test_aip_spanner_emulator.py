"""The AIP-151 adapter against a real Google ``google.longrunning.Operations``: the Cloud Spanner emulator.

Operations are made over the emulator's REST gateway (CreateInstance, CreateDatabase, UpdateDatabaseDdl;
Spanner's creates take no AIP-155 request id, so the adapter's create route is not used here) and read
through the adapter as the fleet builds it: ``default_registry().build(AdapterConfig(protocol="aip151",
protocol_version="v1"), httpx2.Client())``. What the emulator does (reference/aip-151.md §5.2): every
operation is done in its create answer; Get and List work; NOT_FOUND is ``404 {"code": 5, ...}`` (the bare
grpc-gateway envelope); Cancel and Delete are ``501 {"code": 12}``; an ``Empty`` response is written the
Go way (``"value": {}``). Missing emulator binaries fail the module naming the Debian package.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from adapters.aip151 import AipOperationsAdapter
from adapters.aip151.wire import StatusNotFound
from adapters.base import AdapterConfig, RemoteRef, RemoteStatus, Timeouts, ToolAdapter
from adapters.errors import NotFound, Rejected
from adapters.registry import default_registry
from tests.conformance.spanner import SpannerEmulator, start_spanner_emulator

pytestmark = pytest.mark.conformance

PROJECT = "longcall-conformance"
INSTANCE_TYPE = "type.googleapis.com/google.spanner.admin.instance.v1.Instance"
DATABASE_TYPE = "type.googleapis.com/google.spanner.admin.database.v1.Database"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"
HTTP_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpannerEmulator]:
    started = start_spanner_emulator(Path(tmp_path_factory.mktemp("spanner")))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def rest(emulator: SpannerEmulator) -> Iterator[httpx2.Client]:
    """A plain client on the emulator's REST root, for making operations (not for reading them)."""
    with httpx2.Client(base_url=emulator.rest_root, timeout=HTTP_TIMEOUT_S) as client:
        yield client


@pytest.fixture
def adapter(emulator: SpannerEmulator) -> Iterator[ToolAdapter]:
    with httpx2.Client() as http:
        config = AdapterConfig(
            name="spanner-emulator",
            url=emulator.rest_root,
            protocol="aip151",
            protocol_version="v1",
            timeouts=Timeouts(connect=5.0, read=HTTP_TIMEOUT_S, write=5.0, pool=5.0),
        )
        yield default_registry().build(config, http)


@pytest.fixture(scope="module")
def instance(rest: httpx2.Client) -> dict[str, Any]:
    """The CreateInstance Operation of one instance for the module."""
    return create_instance(rest, f"i{uuid.uuid4().hex[:10]}")


def create_instance(rest: httpx2.Client, instance_id: str) -> dict[str, Any]:
    body = {
        "instanceId": instance_id,
        "instance": {"config": "emulator-config", "displayName": instance_id, "nodeCount": 1},
    }
    answer = rest.post(f"/v1/projects/{PROJECT}/instances", json=body)
    assert answer.status_code == 200, answer.text
    op: dict[str, Any] = answer.json()
    return op


def create_database(rest: httpx2.Client, instance_name: str) -> dict[str, Any]:
    database_id = f"d{uuid.uuid4().hex[:10]}"
    answer = rest.post(
        f"/v1/{instance_name}/databases", json={"createStatement": f"CREATE DATABASE `{database_id}`"}
    )
    assert answer.status_code == 200, answer.text
    op: dict[str, Any] = answer.json()
    return op


def instance_name(op: dict[str, Any]) -> str:
    name: str = op["response"]["name"]
    return name


def ref(name: str) -> RemoteRef:
    return RemoteRef(remote_id=name, session_ref=None, protocol_version="v1", protocol="aip151")


def test_registry_builds_the_aip151_adapter(adapter: ToolAdapter) -> None:
    assert isinstance(adapter, ToolAdapter)
    assert (adapter.protocol, adapter.protocol_version) == ("aip151", "v1")


def test_create_instance_operation_is_done_in_its_create_answer(instance: dict[str, Any]) -> None:
    """The peer's own shape, which the rest of the module relies on (AIP-133: done at once is allowed)."""
    assert instance["done"] is True
    assert instance["name"].startswith(f"projects/{PROJECT}/instances/")
    assert "/operations/" in instance["name"]
    assert instance["response"]["@type"] == INSTANCE_TYPE


def test_get_instance_operation_completed_with_the_typed_response(
    adapter: ToolAdapter, instance: dict[str, Any]
) -> None:
    status = adapter.get(ref(instance["name"]))
    assert status.remote_id == instance["name"]
    assert status.terminal == "completed"
    assert status.poll_interval_ms is None  # AIP-151 has no poll hint on the wire
    assert status.raw["done"] is True
    result = adapter.result(ref(instance["name"]), status=status)
    assert result.outcome == "completed"
    assert result.is_error is False
    response = result.payload["response"]
    assert response["@type"] == INSTANCE_TYPE  # an Any of a type the adapter has no descriptor for, as JSON
    assert response["name"] == instance_name(instance)
    assert result.payload["metadata"]["@type"].endswith("CreateInstanceMetadata")


def test_get_database_operation_completed_with_the_typed_response(
    adapter: ToolAdapter, rest: httpx2.Client, instance: dict[str, Any]
) -> None:
    created = create_database(rest, instance_name(instance))
    assert "/databases/" in created["name"]
    status = adapter.get(ref(created["name"]))
    assert status.terminal == "completed"
    assert status.result is not None
    assert status.result.payload["response"]["@type"] == DATABASE_TYPE
    assert status.result.payload["response"]["state"] == "READY"


def test_result_reads_the_operation_when_no_status_is_given(
    adapter: ToolAdapter, instance: dict[str, Any]
) -> None:
    result = adapter.result(ref(instance["name"]))
    assert result.outcome == "completed"
    assert result.payload["name"] == instance["name"]


def test_go_style_empty_response_is_completed_and_kept_as_sent(
    adapter: ToolAdapter, rest: httpx2.Client, instance: dict[str, Any]
) -> None:
    database = create_database(rest, instance_name(instance))["response"]["name"]
    ddl = {
        "statements": ["CREATE TABLE T (K INT64) PRIMARY KEY (K)"],
        "operationId": f"ddl_{uuid.uuid4().hex[:8]}",
    }
    answer = rest.patch(f"/v1/{database}/ddl", json=ddl)
    assert answer.status_code == 200, answer.text
    name = answer.json()["name"]
    assert answer.json()["response"] == {"@type": EMPTY_TYPE, "value": {}}  # the peer writes it the Go way
    result = adapter.result(ref(name), status=adapter.get(ref(name)))
    assert result.outcome == "completed"
    assert result.is_error is False
    assert result.payload["response"] == {"@type": EMPTY_TYPE, "value": {}}


def test_list_operations_of_an_instance(adapter: ToolAdapter, rest: httpx2.Client) -> None:
    assert isinstance(adapter, AipOperationsAdapter)  # listing is this adapter's, not the ToolAdapter's
    op = create_instance(rest, f"l{uuid.uuid4().hex[:10]}")
    listed: list[RemoteStatus] = adapter.list_operations(f"{instance_name(op)}/operations")
    assert [s.remote_id for s in listed] == [op["name"]]
    assert listed[0].terminal == "completed"


def test_list_operations_pages_through_every_page(adapter: ToolAdapter, rest: httpx2.Client) -> None:
    assert isinstance(adapter, AipOperationsAdapter)
    op = create_instance(rest, f"m{uuid.uuid4().hex[:10]}")
    databases = [create_database(rest, instance_name(op)) for _ in range(2)]
    names = {d["name"] for d in databases}
    for database in databases:
        collection = database["name"].rpartition("/operations/")[0] + "/operations"
        listed = adapter.list_operations(collection, page_size=1)
        assert {s.remote_id for s in listed} <= names
        assert database["name"] in {s.remote_id for s in listed}


def test_unknown_operation_is_not_found_from_the_bare_grpc_gateway_envelope(
    adapter: ToolAdapter, rest: httpx2.Client, instance: dict[str, Any]
) -> None:
    name = f"{instance_name(instance)}/operations/never-made"
    raw = rest.get(f"/v1/{name}")
    assert raw.status_code == 404
    assert raw.json()["code"] == 5  # no {"error": ...} wrapper, the gRPC code
    assert "error" not in raw.json()
    with pytest.raises(NotFound) as caught:
        adapter.get(ref(name))
    assert caught.value.code == 5
    assert "Operation not found" in str(caught.value)
    # The server's own NOT_FOUND (a google.rpc.Status), not a proxy's plain 404: the kind of answer a lookup
    # by key takes as proof of "never created" (issue 19).
    assert isinstance(caught.value, StatusNotFound)


def test_operation_of_an_unknown_instance_is_not_found(adapter: ToolAdapter) -> None:
    with pytest.raises(NotFound):
        adapter.get(ref(f"projects/{PROJECT}/instances/no-such-instance/operations/x"))


def test_cancel_is_unimplemented_and_the_operation_is_unchanged(
    adapter: ToolAdapter, rest: httpx2.Client, instance: dict[str, Any]
) -> None:
    name = instance["name"]
    raw = rest.post(f"/v1/{name}:cancel", json={})
    assert raw.status_code == 501
    assert raw.json() == {"code": 12}  # no message at all
    with pytest.raises(Rejected) as caught:
        adapter.cancel(ref(name))
    assert caught.value.code == 12
    assert adapter.get(ref(name)).terminal == "completed"  # the outcome is read by polling, as ever


def test_cancel_with_read_status_first_sends_no_cancel_for_a_done_operation(
    adapter: ToolAdapter, instance: dict[str, Any]
) -> None:
    outcome = adapter.cancel(ref(instance["name"]), read_status_first=True)
    assert outcome.kind == "already_terminal"
    assert outcome.status is not None
    assert outcome.status.terminal == "completed"


def test_missing_emulator_fails_naming_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LONGCALL_SPANNER_EMULATOR_DIR", str(tmp_path))
    with pytest.raises(AssertionError, match="google-cloud-cli-spanner-emulator"):
        start_spanner_emulator(tmp_path)
