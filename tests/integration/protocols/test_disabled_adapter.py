"""Rule 14 when the capabilities read fails: a create whose adapter version was disabled is refused as
disabled at once, whatever the failure (found in review: checked only at the create attempt, a disabled
version whose server broke was retried until its wait budget ran out, and one whose server moved to another
protocol version got that refusal as its receipt instead).

Real Postgres and Redis, longcall's MCP server with its fault switches, an in-process executor.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from ledger.states import OpState
from tests.support.fleet import McpServer
from workers.executor import Executor
from workers.runtime import Runtime
from workers.submission import validate_submission


def queued(executor: Executor, call_node_id: str) -> uuid.UUID:
    """An operation recorded and claimed, its create not made yet (as one waiting for the dispatcher)."""
    new = validate_submission(
        {"call_node_id": call_node_id, "server": "reports", "tool": "slow_report", "arguments": {}},
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    return executor.ledger.record_submission(new, lease_s=30).operation.id


@pytest.mark.parametrize(
    "fault",
    [
        {"status_503": {"tools/list": {"count": 50, "retry_after_s": 0}}},
        {"status_429": {"tools/list": {"count": 50, "retry_after_s": 0}}},
    ],
    ids=["capabilities-503", "capabilities-429"],
)
def test_a_disabled_version_whose_server_fails_the_capabilities_read_is_refused_as_disabled_at_once(
    runtimes: tuple[McpServer, Any], fault: dict[str, Any]
) -> None:
    mcp, make = runtimes
    runtime: Runtime = make()
    executor = Executor(runtime)
    op_id = queued(executor, "n/disabled-broken")
    mcp.faults(**fault)
    executor.ledger.set_adapter_disabled("mcp", "2025-11-25", disabled=True, actor="test")

    step = executor.advance(op_id, executor.ledger.get(op_id).poll_cursor)

    assert step.action == "accepted", step
    receipt = executor.ledger.receipt_for(op_id)
    assert receipt is not None
    assert receipt.terminal_state.value == "failed"
    assert "disabled" in executor.ledger.get(op_id).result["error"]["message"]
    kinds = [e["kind"] for e in executor.ledger.events(op_id)]
    assert "adapter_disabled" in kinds
    assert "capabilities_failed" not in kinds
    assert executor.ledger.get(op_id).state is OpState.ACCEPTED
    assert not [e for e in mcp.log() if e["method"] == "tools/call"]
