"""Issue 19, items 3 and 11: a create's retries end with the wait budget, and no move lets go of a claim
while its step goes on.

longcall's MCP server with its fault switches and the executor in this process (one step at a time), real
Postgres and Redis. Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ledger.errors import StaleTransition
from ledger.states import OpState
from tests import support
from tests.support.fleet import McpServer, in_process_executor, run_due
from workers.executor import Executor
from workers.steps.context import StepOutcome
from workers.submission import validate_submission

S = OpState


def submitted(executor: Executor, call_node_id: str, **extra: Any) -> uuid.UUID:
    new = validate_submission(
        {
            "call_node_id": call_node_id,
            "server": "reports",
            "tool": "slow_report",
            "arguments": {"seconds": 30},
            **extra,
        },
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    return executor.ledger.record_submission(new).operation.id


def claimed_step_in_background(
    executor: Executor, call_node_id: str
) -> tuple[uuid.UUID, int, threading.Thread, list[StepOutcome]]:
    """A submission claimed by the dispatcher and its step started on a thread: the operation, the claim's
    cursor, the thread and where the step's outcome goes when it ends."""
    op_id = submitted(executor, call_node_id)
    [dispatch] = executor.dispatch_due()
    outcomes: list[StepOutcome] = []
    step = threading.Thread(target=lambda: outcomes.append(executor.advance(op_id, dispatch.cursor)))
    step.start()
    return op_id, dispatch.cursor, step, outcomes


# ------------------------------------------------------------------ item 3: a create that never goes out


def test_a_create_refused_until_the_wait_budget_ends_ends_failed_without_a_create(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The server answers every create with 429 (no work done: the attempt is undone and made again after
    its Retry-After). Past the 3 s wait budget the operation ends failed, its receipt saying the create was
    never sent, and no create goes out after the budget: not retried for ever, not made hours later."""
    mcp, executor = mcp_executor
    mcp.faults(status_429={"tools/call": {"count": 1000, "retry_after_s": 1}})
    op_id = submitted(executor, "n/never-sent", wait_budget_s=3)

    def ended() -> bool:
        run_due(executor)
        return executor.ledger.get(op_id).state is S.ACCEPTED

    support.wait_for("the operation to end after its wait budget", ended, timeout=20)
    op = executor.ledger.get(op_id)
    receipt = executor.ledger.receipt_for(op_id)
    assert receipt is not None
    assert receipt.terminal_state.value == "failed"
    assert "wait budget" in op.result["error"]["message"]
    assert "create_never_sent" in [e["kind"] for e in executor.ledger.events(op_id)]
    assert op.wait_deadline is not None
    calls = [e["t"] for e in mcp.log() if e["method"] == "tools/call"]
    assert calls, "the 429s were not exercised"
    assert max(calls) <= op.wait_deadline.timestamp() + 0.5  # nothing sent once the budget was spent
    assert mcp.tasks() == []


# ----------------------------------------------------- item 11: a claim is held to the end of its step


def test_a_cancel_sent_by_the_create_step_keeps_its_claim_until_the_step_ends(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """A cancel was requested while the create was in flight: the create's answer moves the row to
    CANCEL_REQUESTED and the same step sends the cancel. While that cancel is in flight (held 3 s by the
    server), the row stays claimed: a dispatcher tick claims nothing, so no second step of the operation
    runs beside it (before, the move let go of the lease and a tick sent a second cancel)."""
    mcp, executor = mcp_executor
    mcp.faults(delay_ms={"tools/call": 1500, "tasks/cancel": 3000})
    op_id, _, step, stepped = claimed_step_in_background(executor, "n/cancel-keeps-claim")
    try:
        support.wait_for(
            "the create to be attempted",
            lambda: executor.ledger.get(op_id).submit_attempted_at is not None,
            timeout=10,
        )
        assert executor.request_cancel(op_id).action == "cancel_recorded"
        support.wait_for(
            "the create to answer and the cancel to go out",
            lambda: "tasks/cancel" in [e["method"] for e in mcp.log()],
            timeout=15,
        )
        op = executor.ledger.get(op_id)
        assert op.state is S.CANCEL_REQUESTED
        assert op.lease_until is not None, "the claim was let go while its step sends the cancel"
        assert executor.dispatch_due() == []
    finally:
        step.join(timeout=30)
    assert stepped, "the create step did not end"
    assert executor.ledger.get(op_id).state is S.CANCELLED_ACCEPTED
    assert [e["method"] for e in mcp.log()].count("tasks/cancel") == 1


def test_a_cancel_the_create_step_sends_keeps_its_lease_renewed_past_the_lease(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> None:
    """The same with a 2 s lease and a cancel the server holds 5 s: the step's lease is renewed under the
    cancel's generation while the cancel is in flight, so no tick claims the row and no second cancel is sent
    (before, the renewals kept the create's generation, were refused once the row was CANCEL_REQUESTED, and
    the lease ran out under the step)."""
    with in_process_executor(database_url, broker_prefix, tmp_path, log_dir, lease_s=2) as (mcp, executor):
        mcp.faults(delay_ms={"tools/call": 1000, "tasks/cancel": 5000})
        op_id, _, step, stepped = claimed_step_in_background(executor, "n/cancel-keeps-lease")
        try:
            support.wait_for(
                "the create to be attempted",
                lambda: executor.ledger.get(op_id).submit_attempted_at is not None,
                timeout=10,
            )
            assert executor.request_cancel(op_id).action == "cancel_recorded"
            support.wait_for(
                "the create to answer and the cancel to go out",
                lambda: "tasks/cancel" in [e["method"] for e in mcp.log()],
                timeout=15,
            )
            watched_until = time.monotonic() + 3.5  # past the 2 s lease, within the 5 s cancel
            while time.monotonic() < watched_until:
                assert executor.dispatch_due() == [], "the row was claimed while its step sends the cancel"
                time.sleep(0.2)
        finally:
            step.join(timeout=30)
        assert stepped, "the create step did not end"
        assert executor.ledger.get(op_id).state is S.CANCELLED_ACCEPTED
        assert [e["method"] for e in mcp.log()].count("tasks/cancel") == 1


# ----------------------------------------- found in review: one claim, two copies of its step (rule 1)


def test_a_create_attempt_is_recorded_once_under_one_claim(mcp_executor: tuple[McpServer, Executor]) -> None:
    """Two copies of one step under the same claim (a message delivered again while its first copy still
    runs: a RabbitMQ redelivery after the consumer's connection dropped, a Redis visibility timeout) both
    read the row before either recorded its attempt. Only the first may record it: the second is refused
    as stale and makes no create (before, both attempts were recorded and both went on to a create)."""
    _, executor = mcp_executor
    op_id = submitted(executor, "n/attempt-once")
    [dispatch] = executor.dispatch_due()
    op = executor.ledger.get(op_id)
    assert op.poll_cursor == dispatch.cursor
    executor.ledger.record_create_attempt(op_id, op.fence, descriptor_version=None, detail={})
    with pytest.raises(StaleTransition):
        executor.ledger.record_create_attempt(op_id, op.fence, descriptor_version=None, detail={})
    kinds = [e["kind"] for e in executor.ledger.events(op_id)]
    assert kinds.count("create_attempted") == 1, kinds


def test_a_second_copy_of_a_create_step_makes_no_second_create(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The same, end to end: two copies of the create step of one claim, the create held 2 s by the server
    so both are in flight: the server holds one task, and the operation follows it."""
    mcp, executor = mcp_executor
    mcp.faults(delay_ms={"tools/list": 1000})
    op_id = submitted(executor, "n/create-once")
    [dispatch] = executor.dispatch_due()
    outcomes: list[StepOutcome] = []
    copies = [
        threading.Thread(target=lambda: outcomes.append(executor.advance(op_id, dispatch.cursor)))
        for _ in range(2)
    ]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.join(timeout=30)
    assert len(outcomes) == 2, outcomes
    assert [e["method"] for e in mcp.log()].count("tools/call") == 1, outcomes
    assert len(mcp.tasks()) == 1
    assert executor.ledger.get(op_id).remote_id == mcp.tasks()[0]["taskId"]


def test_a_copy_of_a_create_step_that_comes_while_the_create_is_in_flight_leaves_it_to_its_first_copy(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """A copy of the create step of one claim comes after its first copy recorded the attempt, while that
    create is in flight (a RabbitMQ redelivery after the consumer's connection dropped). Rule 1 forbids a
    second create; the copy also must not declare the create's outcome unknown: the first copy is alive and
    records the answer. The copy does nothing, and the operation follows the one task (before, the copy
    moved the row to SUBMISSION_UNKNOWN, the answer was refused when it came, and an MCP operation whose task
    ran was handed to an operator). Were the first copy dead, its lease would run out and the dispatcher's
    next claim would find the attempt unanswered (SUBMISSION_UNKNOWN), as before."""
    mcp, executor = mcp_executor
    mcp.faults(delay_ms={"tools/call": 3000})
    op_id, cursor, step, first = claimed_step_in_background(executor, "n/late-copy")
    try:
        support.wait_for(
            "the create to reach the server",
            lambda: "tools/call" in [e["method"] for e in mcp.log()],
            timeout=15,
        )
        copy = executor.advance(op_id, cursor)
        assert (copy.action, executor.ledger.get(op_id).state) == ("nothing_to_do", S.SUBMITTING), copy
    finally:
        step.join(timeout=30)
    assert first, "the first copy did not end"
    op = executor.ledger.get(op_id)
    assert op.state is S.WORKING, (first, op.state)
    assert op.remote_id == mcp.tasks()[0]["taskId"]
    assert [e["method"] for e in mcp.log()].count("tools/call") == 1
    assert executor.ledger.reconciliations_for(op_id) == []
    assert "submission_unknown" not in [e["kind"] for e in executor.ledger.events(op_id)]


def test_a_create_attempt_of_an_earlier_claim_is_unknown_to_the_next_claim(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The other side of the test above: the attempt was recorded under a claim whose lease ran out (its
    step died with its worker). The dispatcher's next claim finds it unanswered: SUBMISSION_UNKNOWN at once
    (rule 1), no create."""
    mcp, executor = mcp_executor
    op_id = submitted(executor, "n/earlier-claim")
    [dispatch] = executor.dispatch_due()
    op = executor.ledger.get(op_id)
    assert op.poll_cursor == dispatch.cursor
    executor.ledger.record_create_attempt(op_id, op.fence, descriptor_version=None, detail={})
    with executor.ledger.engine.begin() as conn:  # as if its step had died with its worker
        conn.execute(
            text("UPDATE tool_operation SET lease_until = now(), next_poll_at = now() WHERE id = :id"),
            {"id": op_id},
        )
    [again] = executor.dispatch_due()
    assert again.cursor != dispatch.cursor
    outcome = executor.advance(op_id, again.cursor)
    assert executor.ledger.get(op_id).state in (S.SUBMISSION_UNKNOWN, S.MANUAL_RECONCILIATION), outcome
    assert "submission_unknown" in [e["kind"] for e in executor.ledger.events(op_id)]
    assert "tools/call" not in [e["method"] for e in mcp.log()]
