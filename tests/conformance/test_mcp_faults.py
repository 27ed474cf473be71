"""The adapter's error mapping against a real server that misbehaves on demand.

Only longcall's own server has fault switches (``McpPeer.control_url``), so these tests run on its three
modes. Each switch is used up by the request it targets; the test then shows the adapter recovers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx2
import pytest

from adapters import (
    AdapterConfig,
    McpTasksAdapter,
    NotFound,
    NoWorkDone,
    OutcomeUnknown,
    RateLimited,
    RemoteRef,
    RemoteStatus,
    Timeouts,
    TooManyRequests,
    Transient,
)
from tests.conformance.conftest import McpPeer, reset_faults

LONGCALL_PEERS = ["longcall-stateful", "longcall-stateless", "longcall-json"]
pytestmark = [
    pytest.mark.conformance,
    pytest.mark.parametrize("mcp_peer", LONGCALL_PEERS, indirect=True),
]

TTL_MS = 120_000
WAIT_S = 20.0


@pytest.fixture
def peer(mcp_peer: McpPeer) -> Iterator[McpPeer]:
    assert mcp_peer.control_url is not None
    reset_faults(mcp_peer)
    yield mcp_peer
    reset_faults(mcp_peer)


@pytest.fixture
def make_adapter(peer: McpPeer) -> Iterator[Callable[..., McpTasksAdapter]]:
    clients: list[httpx2.Client] = []

    def build(*, read: float = 10.0) -> McpTasksAdapter:
        client = httpx2.Client()
        clients.append(client)
        timeouts = Timeouts(connect=5.0, read=read, write=5.0, pool=5.0, input_wait=3.0)
        config = AdapterConfig(
            name=peer.name, url=peer.url, protocol="mcp", protocol_version="2025-11-25", timeouts=timeouts
        )
        return McpTasksAdapter(config, client)

    yield build
    for client in clients:
        client.close()


@pytest.fixture
def adapter(make_adapter: Callable[..., McpTasksAdapter]) -> McpTasksAdapter:
    return make_adapter()


def set_faults(peer: McpPeer, switches: Mapping[str, Any]) -> None:
    with httpx2.Client(timeout=5.0) as client:
        client.post(f"{peer.control_url}/faults", json=dict(switches)).raise_for_status()


def server_tasks(peer: McpPeer) -> list[dict[str, Any]]:
    with httpx2.Client(timeout=5.0) as client:
        answer = client.get(f"{peer.control_url}/tasks")
        answer.raise_for_status()
        tasks: list[dict[str, Any]] = answer.json()["tasks"]
        return tasks


def start(adapter: McpTasksAdapter, seconds: float) -> RemoteRef:
    created = adapter.create("slow_report", {"seconds": seconds}, submission_key="k", ttl_ms=TTL_MS)
    assert created.ref is not None
    return created.ref


def wait_terminal(adapter: McpTasksAdapter, ref: RemoteRef) -> RemoteStatus:
    deadline = time.monotonic() + WAIT_S
    while True:
        status = adapter.get(ref, read_input=False)
        if status.terminal is not None:
            return status
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"{ref.remote_id} still {status.server_state} after {WAIT_S}s")
        time.sleep(min(0.2, remaining))  # bounded poll interval


def test_429_on_poll_is_rate_limited_with_retry_after_then_polling_resumes(
    adapter: McpTasksAdapter, peer: McpPeer
) -> None:
    ref = start(adapter, 0.1)
    set_faults(peer, {"status_429": {"tasks/get": {"count": 1, "retry_after_s": 2}}})
    with pytest.raises(RateLimited) as caught:
        adapter.get(ref)
    assert caught.value.retry_after == 2.0
    assert wait_terminal(adapter, ref).server_state == "completed"


def test_429_on_create_proves_no_work_and_creates_nothing(adapter: McpTasksAdapter, peer: McpPeer) -> None:
    adapter.capabilities("slow_report")
    before = len(server_tasks(peer))
    set_faults(peer, {"status_429": {"tools/call": {"count": 1, "retry_after_s": 3}}})
    with pytest.raises(TooManyRequests) as caught:
        adapter.create("slow_report", {"seconds": 0.1}, submission_key="k", ttl_ms=TTL_MS)
    assert isinstance(caught.value, NoWorkDone)
    assert caught.value.retry_after == 3.0
    assert len(server_tasks(peer)) == before


@pytest.mark.parametrize("status", [503, 408, 500])
def test_an_error_status_after_the_task_was_created_is_an_unknown_outcome(
    adapter: McpTasksAdapter, peer: McpPeer, status: int
) -> None:
    """A gateway may answer 503 (408, 500) after the origin created the task: never "no work done"."""
    adapter.capabilities("slow_report")
    before = len(server_tasks(peer))
    set_faults(peer, {"status_after_create": {"status": status, "count": 1}})
    with pytest.raises(OutcomeUnknown) as caught:
        adapter.create("slow_report", {"seconds": 0.1}, submission_key="k", ttl_ms=TTL_MS)
    assert not isinstance(caught.value, NoWorkDone)
    assert len(server_tasks(peer)) == before + 1


def test_a_lost_create_answer_is_outcome_unknown_though_the_task_exists(
    adapter: McpTasksAdapter, peer: McpPeer
) -> None:
    adapter.capabilities("slow_report")
    before = len(server_tasks(peer))
    submitted = datetime.now(UTC) - timedelta(seconds=1)
    set_faults(peer, {"lose_create_response": 1})
    with pytest.raises(OutcomeUnknown):
        adapter.create("slow_report", {"seconds": 0.1}, submission_key="lost-1", ttl_ms=TTL_MS)
    assert len(server_tasks(peer)) == before + 1
    lookup = adapter.lookup_by_key("lost-1", tool="slow_report", submitted_after=submitted)
    assert lookup.proof == "unprovable"
    if peer.listing:
        assert lookup.candidates, "the orphan is listed as a candidate for the operator"


def test_a_slow_create_past_the_read_timeout_is_outcome_unknown(
    make_adapter: Callable[..., McpTasksAdapter], peer: McpPeer
) -> None:
    adapter = make_adapter(read=0.5)
    adapter.capabilities("slow_report")
    set_faults(peer, {"delay_ms": {"tools/call": 1500}})
    with pytest.raises(OutcomeUnknown):
        adapter.create("slow_report", {"seconds": 0.1}, submission_key="k", ttl_ms=TTL_MS)


def test_a_slow_poll_past_the_read_timeout_is_transient(
    make_adapter: Callable[..., McpTasksAdapter], peer: McpPeer
) -> None:
    adapter = make_adapter(read=0.5)
    ref = start(adapter, 0.1)
    set_faults(peer, {"delay_ms": {"tasks/get": 1500}})
    with pytest.raises(Transient) as caught:
        adapter.get(ref)
    assert not isinstance(caught.value, RateLimited)


@pytest.mark.parametrize("fault", ["truncate_result", "drop_result"])
def test_a_cut_result_is_transient_and_the_retry_gets_it_whole(
    adapter: McpTasksAdapter, peer: McpPeer, fault: str
) -> None:
    ref = start(adapter, 0.1)
    status = wait_terminal(adapter, ref)
    set_faults(peer, {fault: 1})
    with pytest.raises(Transient):
        adapter.result(ref, status=status)
    result = adapter.result(ref, status=status)
    assert result.outcome == "completed"
    assert result.payload["content"][0]["text"] == "report ready after 0.1s"


def test_an_expired_task_is_not_found(adapter: McpTasksAdapter, peer: McpPeer) -> None:
    set_faults(peer, {"expire_early": {"after_ms": 0}})
    ref = start(adapter, 0.1)
    deadline = time.monotonic() + WAIT_S
    gone: NotFound | None = None
    while gone is None and time.monotonic() < deadline:
        try:
            adapter.get(ref)
        except NotFound as exc:
            gone = exc
        else:
            time.sleep(0.1)  # bounded poll interval until the purge shows
    assert gone is not None, f"{ref.remote_id} never expired"
    assert not gone.session_gone
    assert "expired" in str(gone)


def test_cancel_racing_completion_reports_already_terminal_and_keeps_the_result(
    adapter: McpTasksAdapter, peer: McpPeer
) -> None:
    ref = start(adapter, 10)
    set_faults(peer, {"complete_on_cancel": 1})
    outcome = adapter.cancel(ref)
    assert outcome.kind == "already_terminal"
    assert outcome.status is None
    assert outcome.message is not None
    assert "completed" in outcome.message
    status = adapter.get(ref)
    assert status.server_state == "completed"
    assert adapter.result(ref, status=status).outcome == "completed"


def test_forced_input_declined_ends_failed(
    adapter: McpTasksAdapter, make_adapter: Callable[..., McpTasksAdapter], peer: McpPeer
) -> None:
    set_faults(peer, {"force_input_required": 1})
    ref = start(adapter, 0.1)
    deadline = time.monotonic() + WAIT_S
    status = adapter.get(ref)
    while status.input_request is None:
        if time.monotonic() > deadline:
            pytest.fail(f"no input request for {ref.remote_id}: {status}")
        time.sleep(0.1)  # bounded poll interval
        status = adapter.get(ref)
    assert status.server_state == "input_required"
    make_adapter().reply_input(ref, status.input_request, {"action": "decline"})
    final = wait_terminal(adapter, ref)
    assert final.server_state == "failed"
    result = adapter.result(ref, status=final)
    assert result.outcome == "failed"
    assert result.is_error
