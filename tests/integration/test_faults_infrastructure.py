"""Issue 19, item 0 and 6: nothing sent by name is lost to a Postgres, Redis or worker fault.

Real Postgres and Redis (a private ``redis-server`` where a test stops it), longcall's MCP server, and the
executor in this process or a real fleet. Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

from ledger.records import Operation
from ledger.states import OpState
from tests.integration.fleet import McpServer
from workers.executor import Executor
from workers.submission import validate_submission

S = OpState


def submitted(executor: Executor, call_node_id: str, *, lease_s: float | None) -> Operation:
    """A submission recorded as ``longcall.submit`` records it; ``lease_s``: claimed by the submitting
    worker (which then dies before its create step), as the task's own insert claims it."""
    new = validate_submission(
        {"call_node_id": call_node_id, "server": "reports", "tool": "slow_report", "arguments": {"seconds": 5}},
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    return executor.ledger.record_submission(new, lease_s=lease_s).operation


def test_a_cancel_of_a_submission_whose_worker_died_before_its_create_ends_it_at_once(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The submitting worker claimed its row (a 30 s lease) and was killed before it recorded a create
    attempt. A cancel recorded now ends the operation cancelled at once, with no create: it does not wait
    out the dead worker's lease (no create can be in flight without a recorded attempt, and any step of the
    dead worker's claim is fenced by the bumped generation and cursor)."""
    mcp, executor = mcp_executor
    op = submitted(executor, "n/cancel-dead-claim", lease_s=30)
    assert op.lease_until is not None and op.submit_attempted_at is None

    outcome = executor.request_cancel(op.id)

    after = executor.ledger.get(op.id)
    assert after.state is S.CANCELLED_ACCEPTED, (outcome, after.state)
    receipt = executor.ledger.receipt_for(op.id)
    assert receipt is not None and receipt.terminal_state.value == "cancelled"
    assert "tools/call" not in [e["method"] for e in mcp.log()]


def test_a_cancel_while_a_create_attempt_is_recorded_keeps_the_claim_of_the_create(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The counterpart: once a create attempt is recorded, the create may be in flight, so the cancel waits
    in the state (an intent) and the claim stays the create step's."""
    _, executor = mcp_executor
    op = submitted(executor, "n/cancel-attempted", lease_s=30)
    op = executor.ledger.record_create_attempt(op.id, op.fence, descriptor_version=None, detail={})

    outcome = executor.request_cancel(op.id)

    after = executor.ledger.get(op.id)
    assert outcome.action == "cancel_recorded", outcome
    assert after.state is S.SUBMITTING and after.cancel_generation == 1
    assert after.poll_cursor == op.poll_cursor and after.lease_until == op.lease_until
