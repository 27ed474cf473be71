"""The AIP-151 adapter against longcall's faithful AIP-151 server (one real process for the module, its
switches, operations and request log reset before each test), built the standard way
(``default_registry().build``), plus the credentials through an httpx2 mock transport."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest

from adapters import (
    AdapterConfig,
    CapabilityRefused,
    InputRequest,
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    RemoteRef,
    RemoteStatus,
    ResultNotReady,
    ToolAdapter,
    TooManyRequests,
    default_registry,
)
from adapters.aip151 import DEDUPE_TRUST_S, AipOperationsAdapter
from adapters.base import ToolRoute
from tests import support
from tests.support.aip_server import AipServer, start_aip_server

WAIT_S = 10.0
TOOLS = {
    "run_report": ToolRoute(create="POST /v1/projects/{project}/reports:run", request_id_field="requestId"),
    "no_route": ToolRoute(),
}


class Refusal(Exception):
    pass


class CountingBudget:
    """Counts charges and the server's request log length at each; refuses charge number ``refuse``."""

    def __init__(self, aip: AipServer | None = None, *, refuse: int | None = None) -> None:
        self.aip = aip
        self.refuse = refuse
        self.charges = 0
        self.log_at_charge: list[int] = []

    def charge(self) -> None:
        self.charges += 1
        if self.aip is not None:
            self.log_at_charge.append(len(self.aip.log()))
        if self.refuse == self.charges:
            raise Refusal("no token")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AipServer]:
    started = start_aip_server(Path(tmp_path_factory.mktemp("aip151-adapter")), "--page-size", "2")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def aip(server: AipServer) -> AipServer:
    server.reset()
    return server


@pytest.fixture
def adapter(aip: AipServer) -> Iterator[ToolAdapter]:
    with httpx2.Client() as client:
        yield default_registry().build(
            AdapterConfig(
                name="reports", url=aip.root, protocol="aip151", protocol_version="v1", tools=TOOLS
            ),
            client,
        )


def key() -> str:
    return str(uuid.uuid4())


def args(seconds: float = 0.0, outcome: str = "response", project: str = "demo") -> dict[str, Any]:
    return {"project": project, "seconds": seconds, "outcome": outcome}


def wait_done(adapter: ToolAdapter, ref: RemoteRef) -> RemoteStatus:
    def done() -> RemoteStatus | None:
        status = adapter.get(ref)
        return status if status.terminal is not None else None

    return support.wait_for("the operation to be done", done, timeout=WAIT_S)


def test_the_registry_builds_it_and_it_is_a_tool_adapter(adapter: ToolAdapter) -> None:
    assert isinstance(adapter, AipOperationsAdapter)
    assert isinstance(adapter, ToolAdapter)
    assert (adapter.protocol, adapter.protocol_version) == ("aip151", "v1")


def test_capabilities_come_from_the_configuration_and_send_nothing(
    aip: AipServer, adapter: ToolAdapter
) -> None:
    budget = CountingBudget()
    caps = adapter.capabilities("run_report", budget=budget)
    assert (caps.use_task, caps.task_support, caps.can_cancel) == (True, "required", True)
    assert caps.descriptor_digest.startswith("sha256:")
    for tool in ("no_route", "unknown"):
        with pytest.raises(CapabilityRefused, match="no create route"):
            adapter.capabilities(tool)
    assert budget.charges == 0
    assert aip.log() == []


def test_create_then_follow_to_a_response(aip: AipServer, adapter: ToolAdapter) -> None:
    submission = key()
    created = adapter.create("run_report", args(0.3), submission_key=submission, ttl_ms=60_000)
    assert created.ref is not None
    assert created.status is not None
    assert created.ref.remote_id.startswith("projects/demo/operations/")
    assert (created.ref.protocol, created.status.terminal) == ("aip151", None)
    sent = aip.operations()["operations"]
    assert [(o["requestId"], o["request"].get("project")) for o in sent] == [(submission, None)]
    status = wait_done(adapter, created.ref)
    assert (status.terminal, status.server_state) == ("completed", "done=true response")
    before = len(aip.log())
    result = adapter.result(created.ref, status=status)
    assert len(aip.log()) == before  # the done Operation is the result: nothing more is read
    assert result.outcome == "completed"
    assert result.payload["response"]["@type"].endswith("Report")
    assert result.payload["name"] == created.ref.remote_id


def test_an_operation_done_at_once_is_created_done(adapter: ToolAdapter) -> None:
    created = adapter.create("run_report", args(0, "error"), submission_key=key(), ttl_ms=1)
    assert created.status is not None
    assert created.status.terminal == "failed"
    assert created.status.result is not None
    assert created.status.result.error is not None
    assert created.status.result.error.code == 13


@pytest.mark.parametrize(
    ("switches", "outcome", "response"),
    [
        ({"go_empty": True}, "empty", {"@type": "type.googleapis.com/google.protobuf.Empty", "value": {}}),
        ({}, "empty", {"@type": "type.googleapis.com/google.protobuf.Empty"}),
        ({"unknown_type_response": True}, "response", None),
        ({}, "none", None),
    ],
)
def test_empty_unknown_any_and_neither_are_completed_and_kept(
    aip: AipServer, adapter: ToolAdapter, switches: dict[str, Any], outcome: str, response: Any
) -> None:
    aip.faults(**switches)
    created = adapter.create("run_report", args(0, outcome), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    result = adapter.result(created.ref)
    assert result.outcome == "completed"
    if outcome == "none":
        assert "response" not in result.payload
    elif response is not None:
        assert result.payload["response"] == response
    else:
        assert "@type" in result.payload["response"]


def test_result_before_done_is_not_ready(adapter: ToolAdapter) -> None:
    created = adapter.create("run_report", args(30), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    with pytest.raises(ResultNotReady):
        adapter.result(created.ref)


def test_a_lost_create_answer_is_found_by_repeating_the_create(aip: AipServer, adapter: ToolAdapter) -> None:
    aip.faults(lose_create_response=1)
    submission = key()
    with pytest.raises(OutcomeUnknown):
        adapter.create("run_report", args(5), submission_key=submission, ttl_ms=1)
    found = adapter.lookup_by_key(
        submission, tool="run_report", arguments=args(5), submitted_after=datetime.now(UTC)
    )
    assert found.proof == "found"
    assert found.ref is not None
    names = [o["name"] for o in aip.operations()["operations"]]
    assert names == [found.ref.remote_id]  # one operation on the server


def test_a_503_after_the_create_is_unknown_and_the_lookup_finds_it(
    aip: AipServer, adapter: ToolAdapter
) -> None:
    aip.faults(status_after_create={"count": 1, "status": "UNAVAILABLE"})
    submission = key()
    with pytest.raises(OutcomeUnknown):
        adapter.create("run_report", args(5), submission_key=submission, ttl_ms=1)
    found = adapter.lookup_by_key(submission, tool="run_report", arguments=args(5))
    assert found.proof == "found"
    assert len(aip.operations()["operations"]) == 1


def test_not_found_to_the_create_is_a_refusal_and_to_the_lookup_the_proof(
    aip: AipServer, adapter: ToolAdapter
) -> None:
    aip.faults(missing_projects=["gone"])
    with pytest.raises(Rejected) as refused:
        adapter.create("run_report", args(project="gone"), submission_key=key(), ttl_ms=1)
    assert refused.value.http_status == 404
    found = adapter.lookup_by_key(key(), tool="run_report", arguments=args(project="gone"))
    assert (found.proof, found.ref) == ("never_created", None)
    assert aip.operations()["operations"] == []


def test_a_lookup_past_the_dedupe_window_is_unprovable_and_sends_nothing(
    aip: AipServer, adapter: ToolAdapter
) -> None:
    old = datetime.now(UTC) - timedelta(seconds=DEDUPE_TRUST_S + 5)
    found = adapter.lookup_by_key(key(), tool="run_report", arguments=args(), submitted_after=old)
    assert found.proof == "unprovable"
    assert "second operation" in found.detail
    assert aip.log() == []
    assert adapter.lookup_by_key(key(), tool="run_report").proof == "unprovable"  # no arguments


def test_another_refusal_of_the_repeated_create_is_unprovable(aip: AipServer, adapter: ToolAdapter) -> None:
    aip.faults(request_id_conflict="already_exists")
    submission = key()
    adapter.create("run_report", args(5), submission_key=submission, ttl_ms=1)
    found = adapter.lookup_by_key(submission, tool="run_report", arguments=args(6))
    assert found.proof == "unprovable"


def test_cancel_is_acknowledged_and_its_outcome_polled(aip: AipServer, adapter: ToolAdapter) -> None:
    aip.faults(cancel_takes_ms=200)
    created = adapter.create("run_report", args(30), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    outcome = adapter.cancel(created.ref)
    assert (outcome.kind, outcome.status) == ("acknowledged", None)
    status = wait_done(adapter, created.ref)
    assert (status.terminal, status.server_state) == ("cancelled", "done=true error CANCELLED")


def test_a_cancel_that_loses_the_race_is_a_completion(aip: AipServer, adapter: ToolAdapter) -> None:
    aip.faults(complete_on_cancel=1)
    created = adapter.create("run_report", args(0.3), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    assert adapter.cancel(created.ref).kind == "acknowledged"
    assert wait_done(adapter, created.ref).terminal == "completed"


@pytest.mark.parametrize(
    ("cancel_of_done", "kind"), [("failed_precondition", "already_terminal"), ("empty", "acknowledged")]
)
def test_cancel_of_a_done_operation(
    aip: AipServer, adapter: ToolAdapter, cancel_of_done: str, kind: str
) -> None:
    aip.faults(cancel_of_done=cancel_of_done)
    created = adapter.create("run_report", args(0), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    assert adapter.cancel(created.ref).kind == kind
    assert adapter.get(created.ref).terminal == "completed"  # never rewritten


def test_cancel_unimplemented_is_a_refusal(aip: AipServer, adapter: ToolAdapter) -> None:
    aip.faults(cancel_of_done="unimplemented", envelope="grpc_gateway")
    created = adapter.create("run_report", args(0), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    with pytest.raises(Rejected) as refused:
        adapter.cancel(created.ref)
    assert refused.value.code == 12


def test_read_status_first_sends_no_cancel_for_a_done_operation(aip: AipServer, adapter: ToolAdapter) -> None:
    created = adapter.create("run_report", args(0), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    outcome = adapter.cancel(created.ref, read_status_first=True)
    assert outcome.kind == "already_terminal"
    assert [e["rpc"] for e in aip.log()] == ["RunReport", "GetOperation"]


@pytest.mark.parametrize("envelope", ["aip193", "grpc_gateway"])
def test_deleted_expired_and_unknown_operations_are_not_found(
    aip: AipServer, adapter: ToolAdapter, envelope: str
) -> None:
    aip.faults(envelope=envelope, expire_after_done_s=0.2)
    created = adapter.create("run_report", args(0), submission_key=key(), ttl_ms=1)
    assert created.ref is not None

    def expired() -> bool:
        try:
            adapter.get(created.ref)  # type: ignore[arg-type]
        except NotFound:
            return True
        return False

    support.wait_for("the operation to expire", expired, timeout=WAIT_S)
    with pytest.raises(NotFound):
        adapter.get(RemoteRef("projects/demo/operations/nope", None, "v1", "aip151"))


@pytest.mark.parametrize("envelope", ["aip193", "grpc_gateway"])
def test_a_429_carries_the_longer_of_retry_info_and_retry_after(
    aip: AipServer, adapter: ToolAdapter, envelope: str
) -> None:
    created = adapter.create("run_report", args(30), submission_key=key(), ttl_ms=1)
    assert created.ref is not None
    aip.faults(envelope=envelope, status_429={"GetOperation": {"count": 1, "retry_after_s": 3}})
    with pytest.raises(TooManyRequests) as limited:
        adapter.get(created.ref)
    assert limited.value.retry_after is not None
    assert limited.value.retry_after == 3.0
    aip.faults(status_503={"GetOperation": {"count": 1, "retry_after_s": 1}})
    with pytest.raises(RateLimited) as unavailable:
        adapter.get(created.ref)
    assert unavailable.value.retry_after is not None
    assert unavailable.value.retry_after == 1.0


def test_a_429_to_the_create_did_no_work(aip: AipServer, adapter: ToolAdapter) -> None:
    aip.faults(status_429={"RunReport": {"count": 1, "retry_after_s": 1}})
    with pytest.raises(TooManyRequests):
        adapter.create("run_report", args(), submission_key=key(), ttl_ms=1)
    assert aip.operations()["operations"] == []


def test_list_operations_reads_every_page(aip: AipServer, adapter: ToolAdapter) -> None:
    assert isinstance(adapter, AipOperationsAdapter)
    project = f"p-{uuid.uuid4().hex[:8]}"
    made = [
        adapter.create("run_report", args(0, project=project), submission_key=key(), ttl_ms=1)
        for _ in range(5)
    ]
    listed = adapter.list_operations(f"projects/{project}/operations")
    assert sorted(s.remote_id for s in listed) == sorted(c.ref.remote_id for c in made if c.ref is not None)
    assert [e["rpc"] for e in aip.log()].count("ListOperations") == 3  # page size 2


def test_every_request_is_charged_once_before_it_is_sent(aip: AipServer, adapter: ToolAdapter) -> None:
    budget = CountingBudget(aip)
    created = adapter.create("run_report", args(0), submission_key=key(), ttl_ms=1, budget=budget)
    assert created.ref is not None
    adapter.get(created.ref, budget=budget)
    adapter.cancel(created.ref, read_status_first=True, budget=budget)
    adapter.lookup_by_key(created.ref.remote_id, tool="run_report", arguments=args(), budget=budget)
    assert budget.charges == len(aip.log()) == 4
    assert budget.log_at_charge == [0, 1, 2, 3]


def test_a_refused_charge_sends_nothing_and_passes_unchanged(aip: AipServer, adapter: ToolAdapter) -> None:
    budget = CountingBudget(refuse=1)
    with pytest.raises(Refusal):
        adapter.create("run_report", args(), submission_key=key(), ttl_ms=1, budget=budget)
    with pytest.raises(Refusal):
        adapter.get(
            RemoteRef("projects/demo/operations/x", None, "v1", "aip151"), budget=CountingBudget(refuse=1)
        )
    assert aip.log() == []


def test_there_are_no_input_rounds(adapter: ToolAdapter) -> None:
    ref = RemoteRef("projects/demo/operations/x", None, "v1", "aip151")
    request = InputRequest(
        request_id=1, method="elicitation/create", params={}, schema=None, task_id=ref.remote_id
    )
    with pytest.raises(CapabilityRefused, match="no input rounds"):
        adapter.reply_input(ref, request, {"action": "accept"})
    assert adapter.check_reply(request, {}) is not None


def test_a_name_that_is_not_a_resource_path_is_never_followed(aip: AipServer, adapter: ToolAdapter) -> None:
    with pytest.raises(ProtocolViolation):
        adapter.get(RemoteRef("../_control/faults", None, "v1", "aip151"))
    assert aip.log() == []


# ----------------------------------------------------------------------------------- credentials


def _mock(seen: list[httpx2.Request]) -> httpx2.Client:
    def answer(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json={"name": "operations/1"})

    return httpx2.Client(transport=httpx2.MockTransport(answer))


def test_the_bearer_token_is_read_before_every_request() -> None:
    seen: list[httpx2.Request] = []
    tokens = iter(["one", "two"])
    config = AdapterConfig(
        name="s",
        url="http://h",
        protocol="aip151",
        protocol_version="v1",
        token_provider=lambda: next(tokens),
    )
    with _mock(seen) as client:
        adapter = AipOperationsAdapter(config, client)
        ref = RemoteRef("operations/1", None, "v1", "aip151")
        adapter.get(ref)
        adapter.get(ref)
    assert [r.headers["authorization"] for r in seen] == ["Bearer one", "Bearer two"]
    assert str(seen[0].url) == "http://h/v1/operations/1"


def test_userinfo_in_the_url_is_basic_auth_and_never_in_the_url() -> None:
    seen: list[httpx2.Request] = []
    config = AdapterConfig(name="s", url="http://u:secret@h/", protocol="aip151", protocol_version="v1")
    with _mock(seen) as client:
        AipOperationsAdapter(config, client).get(RemoteRef("operations/1", None, "v1", "aip151"))
    assert seen[0].headers["authorization"] == "Basic " + base64.b64encode(b"u:secret").decode()
    assert "secret" not in str(seen[0].url)


def test_a_wrong_pair_is_refused() -> None:
    with httpx2.Client() as client, pytest.raises(ValueError, match="speaks aip151 v1"):
        AipOperationsAdapter(
            AdapterConfig(name="s", url="http://h", protocol="mcp", protocol_version="v1"), client
        )
