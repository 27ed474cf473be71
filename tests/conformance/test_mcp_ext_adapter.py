"""Conformance: the MCP tasks extension adapter (2026-07-28) against a real peer, FastMCP 4.1.4 with
fastmcp-tasks 4.1.4 (tests/conformance/peers/fastmcp_ext_tasks.py, installed by scripts/install-peers).

Known deviations of the peer, handled here (reference/mcp-tasks-extension.md §2.4): ``ttlMs`` counts from
completion (a working task outlives ``createdAt + ttlMs``; the adapter never treats ``ttlMs`` as an
expiry of a task that still answers), no ``subscriptions/listen`` (the adapter polls only),
``lastUpdatedAt`` always now (never used for change detection), ``Mcp-Name`` not required (its presence
is asserted in the unit tests).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx2
import pytest

from adapters import (
    AdapterConfig,
    CapabilityRefused,
    NotFound,
    RemoteRef,
    RemoteStatus,
    default_registry,
)
from adapters.base import Limits, Timeouts
from adapters.mcp_2026_07_28 import McpExtTasksAdapter
from adapters.mcp_2026_07_28.transport import ExtHttp
from tests.conformance.conftest import McpPeer, PeerSpec, _python_peer, start_peer
from tests.support import wait_for

RUNTIME = "fastmcp-ext-4.1"
PEER = PeerSpec(RUNTIME, RUNTIME, _python_peer(RUNTIME, "fastmcp_ext_tasks.py"), listing=False)
SHORT_TTL_S = 1.5
SHORT_TTL_PEER = PeerSpec(
    f"{RUNTIME}-ttl",
    RUNTIME,
    _python_peer(RUNTIME, "fastmcp_ext_tasks.py", "--ttl-s", str(SHORT_TTL_S)),
    listing=False,
)


class Counter:
    """A request budget that counts the HTTP requests an adapter sends."""

    def __init__(self) -> None:
        self.requests = 0

    def charge(self) -> None:
        self.requests += 1


@pytest.fixture(scope="module")
def ext_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpPeer]:
    yield from start_peer(PEER, tmp_path_factory.mktemp("peer-ext"))


@pytest.fixture(scope="module")
def short_ttl_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpPeer]:
    yield from start_peer(SHORT_TTL_PEER, tmp_path_factory.mktemp("peer-ext-ttl"))


@pytest.fixture
def http() -> Iterator[httpx2.Client]:
    with httpx2.Client() as client:
        yield client


def adapter_for(peer: McpPeer, http: httpx2.Client) -> McpExtTasksAdapter:
    config = AdapterConfig(name="ext", url=peer.url, protocol="mcp", protocol_version="2026-07-28")
    adapter = default_registry().build(config, http)
    assert isinstance(adapter, McpExtTasksAdapter)
    return adapter


def until_terminal(adapter: McpExtTasksAdapter, ref: RemoteRef, timeout: float = 20.0) -> RemoteStatus:
    def probe() -> RemoteStatus | None:
        status = adapter.get(ref)
        return status if status.terminal is not None else None

    return wait_for(f"task {ref.remote_id} to end", probe, timeout=timeout, interval=0.1)


def test_a_task_is_created_and_polled_to_its_inline_result(ext_peer: McpPeer, http: httpx2.Client) -> None:
    adapter = adapter_for(ext_peer, http)
    caps = adapter.capabilities("slow_job")
    assert (caps.protocol_version, caps.task_support, caps.can_list) == ("2026-07-28", "optional", False)
    created = adapter.create("slow_job", {"steps": 3, "step_s": 0.2}, submission_key="k1", ttl_ms=60_000)
    assert created.ref is not None
    assert created.status is not None
    assert (created.ref.protocol_version, created.ref.session_ref) == ("2026-07-28", None)
    assert created.status.server_state == "working"
    assert created.status.poll_interval_ms == 200  # the tool's own hint
    assert created.status.ttl_ms is not None
    status = until_terminal(adapter, created.ref)
    assert status.server_state == "completed"
    assert status.result is not None
    budget = Counter()
    result = adapter.result(created.ref, status=status, budget=budget)
    assert budget.requests == 0  # the status already carried the result: no extra request
    assert result.outcome == "completed"
    assert result.payload["content"][0]["text"] == "slow_job finished 3 steps"


def test_a_status_message_follows_the_progress(ext_peer: McpPeer, http: httpx2.Client) -> None:
    adapter = adapter_for(ext_peer, http)
    created = adapter.create("slow_job", {"steps": 4, "step_s": 0.3}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    seen = wait_for(
        "a progress message",
        lambda: adapter.get(created.ref).status_message if created.ref else None,
        timeout=10,
    )
    assert seen.startswith("step ")
    until_terminal(adapter, created.ref)


def test_a_tool_error_is_a_failed_outcome_of_a_completed_task(ext_peer: McpPeer, http: httpx2.Client) -> None:
    adapter = adapter_for(ext_peer, http)
    created = adapter.create("tool_error", {}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    status = until_terminal(adapter, created.ref)
    result = adapter.result(created.ref, status=status)
    assert (status.server_state, result.outcome, result.is_error) == ("completed", "failed", True)
    assert result.error is not None
    assert "invalid input" in result.error.message


def test_a_json_rpc_error_is_a_failed_task_with_the_error_inline(
    ext_peer: McpPeer, http: httpx2.Client
) -> None:
    adapter = adapter_for(ext_peer, http)
    created = adapter.create("protocol_error", {}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    status = until_terminal(adapter, created.ref)
    result = adapter.result(created.ref, status=status)
    assert (status.server_state, result.outcome) == ("failed", "failed")
    assert result.error is not None
    assert (result.error.code, result.error.message) == (-32603, "upstream API rate limit exceeded")


def test_cancel_is_an_acknowledgement_and_the_cancelled_end_comes_from_polling(
    ext_peer: McpPeer, http: httpx2.Client
) -> None:
    adapter = adapter_for(ext_peer, http)
    created = adapter.create("slow_job", {"steps": 50, "step_s": 0.2}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    outcome = adapter.cancel(created.ref)
    assert (outcome.kind, outcome.status) == ("acknowledged", None)
    status = until_terminal(adapter, created.ref)
    assert status.server_state == "cancelled"
    assert status.result is None
    assert adapter.result(created.ref, status=status).outcome == "cancelled"


def test_a_cancel_of_a_completed_task_is_acknowledged_and_the_completion_stays(
    ext_peer: McpPeer, http: httpx2.Client
) -> None:
    adapter = adapter_for(ext_peer, http)
    created = adapter.create("slow_job", {"steps": 1, "step_s": 0.05}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    until_terminal(adapter, created.ref)
    assert adapter.cancel(created.ref).kind == "acknowledged"
    assert adapter.get(created.ref).server_state == "completed"
    # read_status_first sends no cancel for a task already terminal
    budget = Counter()
    assert adapter.cancel(created.ref, read_status_first=True, budget=budget).kind == "already_terminal"
    assert budget.requests == 1


def test_an_input_round_trip(ext_peer: McpPeer, http: httpx2.Client) -> None:
    adapter = adapter_for(ext_peer, http)
    created = adapter.create("ask_name", {"greeting": "Hello"}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    ref = created.ref

    def round_shown() -> RemoteStatus | None:
        seen = adapter.get(ref)
        return seen if seen.input_request is not None else None

    status = wait_for("the input round", round_shown, timeout=10)
    request = status.input_request
    assert request is not None
    assert request.task_id == ref.remote_id
    (key,) = request.params  # the inputRequests map as sent
    assert request.params[key]["method"] == "elicitation/create"
    again = adapter.get(ref).input_request
    assert again is not None
    assert again.request_id == request.request_id
    assert adapter.check_reply(request, {"other": {"action": "accept", "content": {"name": "x"}}}) is not None
    assert adapter.check_reply(request, {key: {"action": "accept", "content": {"name": 5}}}) is not None
    answer = {key: {"action": "accept", "content": {"name": "Luca"}}}
    assert adapter.check_reply(request, answer) is None
    adapter.reply_input(ref, request, answer)
    status = until_terminal(adapter, ref)
    assert adapter.result(ref, status=status).payload["content"][0]["text"] == "Hello, Luca!"


def test_without_the_opt_in_a_required_task_tool_is_a_definite_32021(
    ext_peer: McpPeer, http: httpx2.Client
) -> None:
    wire = ExtHttp(http, ext_peer.url, server="ext", bearer_token=None, timeouts=Timeouts(), limits=Limits())
    with pytest.raises(CapabilityRefused) as refused:
        wire.call(
            "tools/call",
            {"name": "must_be_task", "arguments": {"x": 1}},
            name="must_be_task",
            idempotent=False,
            budget=Counter(),
            opt_in=False,
        )
    assert refused.value.code == -32021
    with pytest.raises(CapabilityRefused):
        wire.call("tasks/get", {"taskId": "x"}, name="x", idempotent=True, budget=Counter(), opt_in=False)
    # the adapter always opts in: the same tool is a task
    adapter = adapter_for(ext_peer, http)
    created = adapter.create("must_be_task", {"x": 7}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    assert adapter.result(created.ref, status=until_terminal(adapter, created.ref)).outcome == "completed"


def test_an_unknown_task_is_not_found_and_its_cancel_already_terminal(
    ext_peer: McpPeer, http: httpx2.Client
) -> None:
    adapter = adapter_for(ext_peer, http)
    ref = RemoteRef("no-such-task", None, "2026-07-28")
    with pytest.raises(NotFound):
        adapter.get(ref)
    assert adapter.cancel(ref).kind == "already_terminal"


def test_a_lost_create_answer_is_unprovable(ext_peer: McpPeer, http: httpx2.Client) -> None:
    found = adapter_for(ext_peer, http).lookup_by_key(
        "sub-1", tool="slow_job", submitted_after=datetime.now(UTC)
    )
    assert (found.proof, found.ref) == ("unprovable", None)
    assert "no idempotency key" in found.detail
    assert "tasks/list" in found.detail


def test_expiry_is_counted_from_completion_then_not_found(
    short_ttl_peer: McpPeer, http: httpx2.Client
) -> None:
    """The peer's deviation: ttlMs counts from completion. A task still working past createdAt + ttlMs is
    followed as working (never expired by the client); once it ended and ttlMs passed, it is NotFound."""
    adapter = adapter_for(short_ttl_peer, http)
    created = adapter.create("slow_job", {"steps": 3, "step_s": 0.8}, submission_key="k", ttl_ms=60_000)
    assert created.ref is not None
    assert created.status is not None
    assert created.status.ttl_ms == int(SHORT_TTL_S * 1000)
    ref = created.ref
    started = time.monotonic()
    wait_for("createdAt + ttlMs to pass", lambda: time.monotonic() - started > SHORT_TTL_S + 0.2 or None)
    assert adapter.get(ref).server_state == "working"
    until_terminal(adapter, ref)
    ended = datetime.now(UTC)

    def gone() -> bool | None:
        try:
            adapter.get(ref)
        except NotFound:
            return True
        return None

    wait_for("the ended task to expire", gone, timeout=SHORT_TTL_S + 10, interval=0.2)
    assert datetime.now(UTC) - ended >= timedelta(seconds=SHORT_TTL_S * 0.5)
