"""A poll never reads the operation's arguments (issue 13): the step's read of its row and its reschedule's
returned row leave ``body`` out, so a poll costs the same for a 1 MB body as for an empty one; a submission's
step, which sends the arguments (the create) or asks by them (the lookup), still sends exactly what was
recorded.

Real Postgres and Redis, longcall's MCP server and an in-process executor driving one step at a time.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import event

from ledger.records import BODY_NOT_READ
from ledger.states import OpState
from tests.support.fleet import McpServer
from workers.errors import NoToken
from workers.executor import Executor
from workers.steps.submit import arguments_of
from workers.submission import validate_submission

#: Arguments of a size a bulk mutation may carry (the default max_body_bytes is 1 MiB).
ARGUMENTS = {"seconds": 3600, "rows": ["x" * 1000] * 200}


def _new(executor: Executor, call_node_id: str) -> Any:
    return validate_submission(
        {"call_node_id": call_node_id, "server": "reports", "tool": "slow_report", "arguments": ARGUMENTS},
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )


class Columns:
    """The result columns of every statement the engine ran, by statement."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def after(self, conn: Any, cursor: Any, *_: Any) -> None:
        self.seen.append([c[0] for c in cursor.description or []])


def test_a_poll_step_reads_and_writes_back_no_arguments(mcp_executor: tuple[McpServer, Executor]) -> None:
    _mcp, executor = mcp_executor
    submission, step = executor.submit(_new(executor, "node-poll"))
    assert step is not None
    assert step.state is OpState.WORKING
    op_id = submission.operation.id
    columns = Columns()
    event.listen(executor.ledger.engine, "after_cursor_execute", columns.after)
    try:
        for _ in range(3):
            claim = executor.ledger.claim(op_id, lease_s=30)
            assert claim is not None
            assert executor.advance(op_id, claim.poll_cursor).action == "still_working"
    finally:
        event.remove(executor.ledger.engine, "after_cursor_execute", columns.after)
    row_reads = [names for names in columns.seen if "poll_cursor" in names and "call_node_id" in names]
    assert len(row_reads) >= 6  # each step's read of its row and its reschedule's returned row
    assert all("body" not in names for names in row_reads), columns.seen
    # The arguments are where they were recorded, untouched.
    assert executor.ledger.get(op_id).body == ARGUMENTS
    assert executor.ledger.get(op_id, with_body=False).body is BODY_NOT_READ


def test_a_submission_stepped_by_the_dispatcher_sends_the_recorded_arguments(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The row is read without its arguments first; a SUBMITTING row is read whole before its create."""
    mcp, executor = mcp_executor
    submission = executor.ledger.record_submission(_new(executor, "node-submit"))  # no claim: not created
    op_id = submission.operation.id
    claim = executor.ledger.claim(op_id, lease_s=30)
    assert claim is not None
    assert claim.state is OpState.SUBMITTING
    outcome = executor.advance(op_id, claim.poll_cursor)
    assert outcome.state is OpState.WORKING, outcome
    (task,) = mcp.tasks()
    assert task["arguments"] == ARGUMENTS


def test_the_arguments_of_a_snapshot_read_without_them_are_the_recorded_ones(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    _mcp, executor = mcp_executor
    submission = executor.ledger.record_submission(_new(executor, "node-args"))
    lean = executor.ledger.get(submission.operation.id, with_body=False)
    assert lean.body is BODY_NOT_READ
    assert arguments_of(executor.ctx, lean) == ARGUMENTS
    assert arguments_of(executor.ctx, submission.operation) == ARGUMENTS
    assert uuid.UUID(str(lean.id)) == submission.operation.id


def test_a_poll_that_meets_a_503_or_no_token_reads_no_arguments(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The paths that reschedule without an answer (a 503, a missing token) leave the arguments out too."""
    mcp, executor = mcp_executor
    submission, _step = executor.submit(_new(executor, "node-retry"))
    op_id = submission.operation.id
    mcp.faults(status_503={"tasks/get": {"count": 1, "retry_after_s": 0}})
    columns = Columns()
    event.listen(executor.ledger.engine, "after_cursor_execute", columns.after)
    try:
        claim = executor.ledger.claim(op_id, lease_s=30)
        assert claim is not None
        assert executor.advance(op_id, claim.poll_cursor).action == "rate_limited"  # a 503 with Retry-After
        claim = executor.ledger.claim(op_id, lease_s=30)
        assert claim is not None
        op = executor.ledger.get(op_id, with_body=False)
        fence = op.fence
        outcome = executor.ctx.no_token(op, fence, NoToken(0.5))
    finally:
        event.remove(executor.ledger.engine, "after_cursor_execute", columns.after)
    assert outcome.action == "no_token"
    row_reads = [names for names in columns.seen if "poll_cursor" in names and "call_node_id" in names]
    assert len(row_reads) >= 4
    assert all("body" not in names for names in row_reads), columns.seen
    assert executor.ledger.get(op_id).body == ARGUMENTS
