"""The MCP 2025-11-25 adapter against every real peer: the same tests, each peer's documented quirks.

Where a peer deviates from the spec the test asserts the peer's actual behaviour (named in
``McpPeer.quirks``) and what the adapter makes of it. Nothing is skipped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta

import httpx2
import pytest

from adapters import (
    AdapterConfig,
    CapabilityRefused,
    InputRequest,
    McpTasksAdapter,
    NotFound,
    Rejected,
    RemoteRef,
    RemoteResult,
    RemoteStatus,
    ResultNotReady,
    Timeouts,
    WrongTaskMode,
)
from adapters.mcp_2025_11_25.wire import NO_INPUT_DURING_SYNC_CALL, RELATED_TASK
from tests.conformance.conftest import McpPeer

pytestmark = pytest.mark.conformance

TTL_MS = 120_000
WAIT_S = 30.0
SYNC_BOUND_S = 20.0
MakeAdapter = Callable[..., McpTasksAdapter]


@pytest.fixture
def make_adapter(mcp_peer: McpPeer) -> Iterator[MakeAdapter]:
    """Build adapters for the peer, each with its own httpx2.Client (as separate workers would)."""
    clients: list[httpx2.Client] = []

    def build(*, input_wait: float = 3.0) -> McpTasksAdapter:
        client = httpx2.Client()
        clients.append(client)
        config = AdapterConfig(
            name=mcp_peer.name,
            url=mcp_peer.url,
            protocol="mcp",
            protocol_version="2025-11-25",
            timeouts=Timeouts(connect=5.0, read=20.0, write=5.0, pool=5.0, input_wait=input_wait),
        )
        return McpTasksAdapter(config, client)

    yield build
    for client in clients:
        client.close()


@pytest.fixture
def adapter(make_adapter: MakeAdapter) -> McpTasksAdapter:
    return make_adapter()


def wait_for(
    adapter: McpTasksAdapter,
    ref: RemoteRef,
    done: Callable[[RemoteStatus], bool],
    *,
    timeout_s: float = WAIT_S,
    read_input: bool = False,
) -> RemoteStatus:
    """Poll at the server's pollInterval until ``done`` holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = adapter.get(ref, read_input=read_input)
        if done(status):
            return status
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail(f"task {ref.remote_id} still {status.server_state} after {timeout_s}s")
        # Polling at the server's own interval, bounded by the deadline.
        time.sleep(min((status.poll_interval_ms or 200) / 1000, remaining, 0.5))


def is_terminal(status: RemoteStatus) -> bool:
    return status.terminal is not None


def text_of(result: RemoteResult) -> str:
    content = result.payload.get("content")
    assert isinstance(content, list)
    return "".join(block["text"] for block in content if block.get("type") == "text")


def start(adapter: McpTasksAdapter, tool: str, arguments: Mapping[str, object]) -> RemoteRef:
    created = adapter.create(tool, arguments, submission_key="k-" + tool, ttl_ms=TTL_MS)
    assert created.ref is not None
    assert created.status is not None
    assert created.status.server_state == "working"
    assert created.ref.session_ref == adapter.session_ref
    return created.ref


# ---- negotiation ---------------------------------------------------------------------------------


def test_capabilities_follow_the_server_and_tool_declarations(
    adapter: McpTasksAdapter, mcp_peer: McpPeer
) -> None:
    slow = adapter.capabilities("slow_report")
    quick = adapter.capabilities("quick_lookup")
    ask = adapter.capabilities("ask_approval")
    assert slow.server_task_calls is mcp_peer.tasks
    assert quick.task_support == "forbidden"
    assert not quick.use_task
    if mcp_peer.tasks:
        assert (slow.task_support, ask.task_support) == ("optional", "required")
        assert slow.use_task
        assert ask.use_task
    else:
        assert not slow.use_task
        assert not ask.use_task
    assert slow.descriptor_digest.startswith("sha256:")
    assert slow.descriptor_digest != quick.descriptor_digest
    assert (adapter.session_ref is None) is mcp_peer.stateless


def test_unlisted_tool_is_rejected_by_name(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    with pytest.raises(Rejected, match="no_such_tool"):
        adapter.capabilities("no_such_tool")


# ---- the task life cycle -------------------------------------------------------------------------


def test_create_get_result_happy_path(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    if not mcp_peer.tasks:
        with pytest.raises(CapabilityRefused, match=rf"slow_report.*{mcp_peer.name}"):
            adapter.create("slow_report", {"seconds": 0.2}, submission_key="k", ttl_ms=TTL_MS)
        created = adapter.create(
            "slow_report",
            {"seconds": 0.2},
            submission_key="k",
            ttl_ms=TTL_MS,
            sync_upper_bound_s=SYNC_BOUND_S,
        )
        assert created.ref is None
        assert created.sync_result is not None
        assert created.sync_result.outcome == "completed"
        assert text_of(created.sync_result) == "report ready after 0.2s"
        return
    ref = start(adapter, "slow_report", {"seconds": 0.3})
    status = wait_for(adapter, ref, is_terminal)
    assert status.server_state == "completed"
    assert status.terminal == "completed"
    assert status.created_at is not None
    assert status.ttl_ms is not None
    result = adapter.result(ref, status=status)
    assert result.outcome == "completed"
    assert not result.is_error
    assert text_of(result) == "report ready after 0.3s"
    assert result.task_verified
    meta = result.payload.get("_meta", {})
    assert RELATED_TASK not in meta


def test_failed_tool_is_a_failed_outcome(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    arguments = {"seconds": 0.1, "fail": True}
    if not mcp_peer.tasks:
        created = adapter.create(
            "slow_report", arguments, submission_key="k", ttl_ms=TTL_MS, sync_upper_bound_s=SYNC_BOUND_S
        )
        assert created.sync_result is not None
        assert created.sync_result.outcome == "failed"
        assert created.sync_result.is_error
        return
    ref = start(adapter, "slow_report", arguments)
    status = wait_for(adapter, ref, is_terminal)
    expected_state = "completed" if "is_error_is_completed" in mcp_peer.quirks else "failed"
    assert status.server_state == expected_state
    result = adapter.result(ref, status=status)
    assert result.outcome == "failed"
    assert result.server_state == expected_state
    assert result.error is not None
    assert result.error.message
    # FastMCP leaves the related-task _meta out of an isError result: kept, but marked unverified.
    assert result.task_verified is ("result_meta_missing_on_error" not in mcp_peer.quirks)


def test_result_before_terminal_is_not_fetched(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    if not mcp_peer.tasks:
        assert not adapter.capabilities("slow_report").use_task
        return
    ref = start(adapter, "slow_report", {"seconds": 20})
    with pytest.raises(ResultNotReady):
        adapter.result(ref)
    assert adapter.cancel(ref).kind == "cancelled"


def test_cancel_running_task_is_cancelled(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    if not mcp_peer.tasks:
        adapter.capabilities("slow_report")
        ghost = RemoteRef(
            remote_id="no-such-task", session_ref=adapter.session_ref, protocol_version="2025-11-25"
        )
        with pytest.raises(Rejected, match="does not implement tasks/cancel"):
            adapter.cancel(ghost)
        with pytest.raises(Rejected, match="does not implement tasks/get"):
            adapter.cancel(ghost, read_status_first=True)
        return
    ref = start(adapter, "slow_report", {"seconds": 30})
    outcome = adapter.cancel(ref)
    assert outcome.kind == "cancelled"
    assert outcome.status is not None
    assert outcome.status.server_state == "cancelled"
    assert outcome.status.terminal == "cancelled"
    after = adapter.get(ref)
    assert after.server_state == "cancelled"
    result = adapter.result(ref, status=after)
    assert result.outcome == "cancelled"
    if "result_of_cancelled_is_empty" in mcp_peer.quirks:
        assert result.error is None
        assert not result.payload.get("content")
    elif "result_of_cancelled_is_-32603" in mcp_peer.quirks:
        assert result.error is not None
        assert result.error.code == -32603
    else:
        assert result.error is not None
        assert result.error.code == -32602


def test_cancel_completed_task_reports_already_terminal(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    if not mcp_peer.tasks:
        assert not adapter.capabilities("slow_report").use_task
        return
    ref = start(adapter, "slow_report", {"seconds": 0.1})
    wait_for(adapter, ref, is_terminal)
    # A peer that would answer "cancelled" for a completed task (quirk cancel_completed_succeeds) is one
    # to configure with read_status_before_cancel: the adapter reads the state first and sends no cancel
    # for a terminal task. Any other peer answers the cancel itself with -32602 "already terminal".
    read_first = "cancel_completed_succeeds" in mcp_peer.quirks
    outcome = adapter.cancel(ref, read_status_first=read_first)
    assert outcome.kind == "already_terminal"
    if read_first:
        assert outcome.status is not None
        assert outcome.status.server_state == "completed"
    else:
        assert outcome.status is None
        assert outcome.message is not None
    assert adapter.get(ref).server_state == "completed"
    assert adapter.result(ref).outcome == "completed"


def test_a_fresh_adapter_resumes_from_the_stored_reference(
    adapter: McpTasksAdapter, make_adapter: MakeAdapter, mcp_peer: McpPeer
) -> None:
    if not mcp_peer.tasks:
        assert adapter.capabilities("slow_report").server_task_calls is False
        return
    ref = start(adapter, "slow_report", {"seconds": 0.3})
    stored = json.loads(json.dumps(ref.to_json()))
    other_worker = make_adapter()
    resumed = RemoteRef.from_json(stored)
    assert resumed == ref
    status = wait_for(other_worker, resumed, is_terminal)
    assert status.remote_id == ref.remote_id
    assert status.server_state == "completed"
    assert text_of(other_worker.result(resumed, status=status)) == "report ready after 0.3s"
    assert other_worker.session_ref is None  # it never initialized a session of its own


def test_unknown_task_id_is_not_found(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    adapter.capabilities("slow_report")
    ghost = RemoteRef(
        remote_id="00000000000000000000000000000000",
        session_ref=adapter.session_ref,
        protocol_version="2025-11-25",
    )
    if not mcp_peer.tasks:
        with pytest.raises(Rejected, match="does not implement tasks/get"):
            adapter.get(ghost)
        return
    with pytest.raises(NotFound) as caught:
        adapter.get(ghost)
    assert caught.value.code == -32602
    assert not caught.value.session_gone
    if "error_messages_prefixed" in mcp_peer.quirks:
        assert "MCP error -32602" in str(caught.value)
    with pytest.raises(NotFound):
        adapter.result(ghost, status=_fake_terminal(ghost))


def _fake_terminal(ref: RemoteRef) -> RemoteStatus:
    return RemoteStatus(
        remote_id=ref.remote_id,
        server_state="completed",
        terminal="completed",
        status_message=None,
        poll_interval_ms=None,
        ttl_ms=None,
        created_at=None,
        last_updated_at=None,
    )


def test_ended_session_is_not_found_and_the_adapter_reinitializes(
    adapter: McpTasksAdapter, mcp_peer: McpPeer
) -> None:
    if not mcp_peer.tasks:
        assert adapter.capabilities("slow_report").server_task_calls is False
        return
    ref = start(adapter, "slow_report", {"seconds": 0.2})
    if mcp_peer.stateless:
        # No session to end: any holder of the id can read the task.
        assert ref.session_ref is None
        assert wait_for(adapter, ref, is_terminal).server_state == "completed"
        return
    assert ref.session_ref is not None
    headers = {"Mcp-Session-Id": ref.session_ref, "MCP-Protocol-Version": "2025-11-25"}
    with httpx2.Client(timeout=5.0) as client:
        assert client.delete(mcp_peer.url, headers=headers).status_code in (200, 204)
    with pytest.raises(NotFound) as caught:
        adapter.get(ref)
    assert caught.value.session_gone
    assert adapter.session_ref is not None
    assert adapter.session_ref != ref.session_ref
    follow_up = start(adapter, "slow_report", {"seconds": 0.1})
    assert follow_up.session_ref == adapter.session_ref


# ---- input_required ------------------------------------------------------------------------------


def test_input_required_round_trip(make_adapter: MakeAdapter, mcp_peer: McpPeer) -> None:
    adapter = make_adapter()
    if not mcp_peer.tasks:
        # No task support declared: ask_approval runs synchronously and elicits on the tools/call stream.
        # The adapter refuses that request (nobody can answer a synchronous call later), so the call ends
        # with the server relaying the refusal, instead of hanging to its bound or being answered for a
        # human; the code is not a task-mode code, so it is no WrongTaskMode.
        with pytest.raises(Rejected, match="cannot answer elicitation/create") as caught:
            adapter.create(
                "ask_approval",
                {"question": "Ship?"},
                submission_key="k",
                ttl_ms=TTL_MS,
                sync_upper_bound_s=10,
            )
        assert not isinstance(caught.value, WrongTaskMode)
        assert caught.value.code == NO_INPUT_DURING_SYNC_CALL
        return
    ref = start(adapter, "ask_approval", {"question": "Ship?"})
    if "elicitation_not_on_result_stream" in mcp_peer.quirks:
        # FastMCP keeps the task `working` and sends an elicitation/create without the related-task
        # _meta on the GET stream: nothing ties it to the task, so the adapter never attributes it.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert adapter.get(ref).server_state == "working"
            time.sleep(0.3)  # bounded: a few polls over 1.5 s
        assert adapter.read_input_request(ref) is None
        assert adapter.cancel(ref).kind == "cancelled"
        return
    if not mcp_peer.elicitation:
        status = wait_for(
            adapter, ref, lambda s: s.terminal is not None or s.server_state == "input_required"
        )
        if status.terminal is None:
            assert "elicitation_hangs_in_json" in mcp_peer.quirks
            short = make_adapter(input_wait=0.5)
            assert short.get(ref).input_request is None
            assert adapter.cancel(ref).kind == "cancelled"
        else:
            # Stateless mcp 1.30 cannot tell the client declared elicitation: it fails the task.
            assert status.server_state == "failed"
            assert adapter.result(ref, status=status).outcome == "failed"
        return
    status = wait_for(
        adapter, ref, lambda s: s.input_request is not None or s.terminal is not None, read_input=True
    )
    request = status.input_request
    assert request is not None, status
    assert status.server_state == "input_required"
    assert request.method == "elicitation/create"
    assert request.task_id == ref.remote_id
    assert request.schema is not None
    assert "approved" in request.schema.get("properties", {})
    assert request.params["_meta"][RELATED_TASK]["taskId"] == ref.remote_id
    # The approval comes back later, possibly to another worker: the request round-trips through JSON.
    stored = InputRequest.from_json(json.loads(json.dumps(request.to_json())))
    assert stored == request
    other_worker = make_adapter()
    other_worker.reply_input(ref, stored, {"action": "accept", "content": {"approved": True}})
    final = wait_for(other_worker, ref, is_terminal)
    assert final.server_state == "completed"
    result = other_worker.result(ref, status=final)
    assert result.outcome == "completed"
    assert text_of(result) == "approved"


# ---- synchronous fallback ------------------------------------------------------------------------


def test_tool_without_task_support_runs_synchronously_only_with_a_bound(
    adapter: McpTasksAdapter, mcp_peer: McpPeer
) -> None:
    with pytest.raises(CapabilityRefused) as caught:
        adapter.create("quick_lookup", {"key": "k1"}, submission_key="k", ttl_ms=TTL_MS)
    assert "quick_lookup" in str(caught.value)
    assert mcp_peer.name in str(caught.value)
    created = adapter.create(
        "quick_lookup", {"key": "k1"}, submission_key="k", ttl_ms=TTL_MS, sync_upper_bound_s=SYNC_BOUND_S
    )
    assert created.ref is None
    assert created.sync_result is not None
    assert created.sync_result.outcome == "completed"
    assert created.sync_result.server_state is None
    assert text_of(created.sync_result) == "value:k1"


# ---- listing and lookup --------------------------------------------------------------------------


def test_listing_where_declared(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    facts = adapter.server_facts()
    if not facts.can_list:
        assert not mcp_peer.listing
        with pytest.raises(Rejected, match="tasks/list"):
            adapter.list_tasks()
        return
    ref = start(adapter, "slow_report", {"seconds": 0.1})
    listed = {status.remote_id for status in adapter.list_tasks_all()}
    if "list_always_empty" in mcp_peer.quirks:
        assert listed == set()
    else:
        assert mcp_peer.listing
        assert ref.remote_id in listed


def test_lookup_by_key_never_claims_proof(adapter: McpTasksAdapter, mcp_peer: McpPeer) -> None:
    before = datetime.now(UTC) - timedelta(seconds=5)
    lookup = adapter.lookup_by_key("3f0c-key", tool="slow_report", submitted_after=before)
    assert lookup.proof == "unprovable"
    assert lookup.ref is None
    assert "no idempotency key" in lookup.detail
