"""A status read the server refuses (a 4xx that is not 404, 408 or 429) is not retried for ever, and an
operator's "found" for a task bound to an MCP session names that session (brief R: a silent stall).

The defect: an operation resolved ``--found`` without ``--session`` polled ``tasks/get`` without a session
for ever, each answer "HTTP 400 Missing session ID" counted as a failure that decided nothing.

Real Postgres and Redis, longcall's MCP server (a stateful one: every task is bound to the session that
created it) and in-process executors driving one step at a time; every loop is bounded.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx2
import pytest
from sqlalchemy import text

from ledger.reasons import ReconciliationReason
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.cli import run_cli
from tests.support.fleet import McpServer
from workers.executor import Executor
from workers.steps.poll import MAX_POLL_REJECTIONS
from workers.steps.reconciliation import Resolution
from workers.submission import validate_submission

S = OpState


def _submit(executor: Executor, call_node_id: str, arguments: dict[str, Any]) -> uuid.UUID:
    new = validate_submission(
        {"call_node_id": call_node_id, "server": "reports", "tool": "slow_report", "arguments": arguments},
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    submission, _step = executor.submit(new)
    return submission.operation.id


def _step(executor: Executor, op_id: uuid.UUID) -> str:
    claim = executor.ledger.claim(op_id, lease_s=30)
    assert claim is not None
    return executor.advance(op_id, claim.poll_cursor).action


def _set_session(ledger: Ledger, op_id: uuid.UUID, session_ref: str | None) -> None:
    """The row's recorded session, as the defect left it (none) or as it was."""
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET session_ref = :session WHERE id = :id"),
            {"session": session_ref, "id": op_id},
        )


# ------------------------------------------------------------------------------- a) the poll step


def test_status_reads_refused_again_and_again_go_to_an_operator_who_resolves_them(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """Every ``tasks/get`` without the task's session is refused "HTTP 400 Missing session ID": after
    :data:`MAX_POLL_REJECTIONS` refusals in a row the operation goes to an operator (PROTOCOL_VIOLATION,
    the server's answer in the record), not polled for ever. The operator's ``found`` with the session
    then polls normally."""
    _mcp, executor = mcp_executor
    ledger = executor.ledger
    op_id = _submit(executor, "n/rejected", {"seconds": 600})
    session = ledger.get(op_id).session_ref
    assert session is not None
    _set_session(ledger, op_id, None)

    actions = []
    for _ in range(3 * MAX_POLL_REJECTIONS):  # bounded: the defect polled for ever
        actions.append(_step(executor, op_id))
        if ledger.get(op_id).state is not S.WORKING:
            break
    assert actions == ["poll_failed"] * (MAX_POLL_REJECTIONS - 1) + ["manual_reconciliation"], actions
    assert ledger.get(op_id).state is S.MANUAL_RECONCILIATION
    [record] = ledger.reconciliations_for(op_id)
    assert record.reason == ReconciliationReason.PROTOCOL_VIOLATION
    assert record.detail["http_status"] == 400
    assert record.detail["rejections"] == MAX_POLL_REJECTIONS
    assert "Missing session ID" in record.detail["error"]

    remote_id = ledger.get(op_id).remote_id
    after = executor.resolve(
        op_id, Resolution("found", "the task is on the session that created it", "ops", remote_id, session)
    )
    assert (after.state, after.session_ref) == (S.WORKING, session)
    assert _step(executor, op_id) == "still_working"
    assert ledger.reconciliations_for(op_id)[0].resolved_at is not None


def test_refusals_short_of_the_bound_between_answers_end_normally(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """One refused read, then answers; then refusals one short of the bound, then answers: only refusals
    in a row count (an answer that changed nothing, counted on the row, ends a run too), and the operation
    ends ACCEPTED with its receipt. The task runs until the test finishes it on the server (a task of a few
    seconds could end mid-sequence on a loaded machine)."""
    mcp, executor = mcp_executor
    ledger = executor.ledger
    op_id = _submit(executor, "n/flaky", {"seconds": 3600})
    session = ledger.get(op_id).session_ref

    _set_session(ledger, op_id, None)
    assert _step(executor, op_id) == "poll_failed"
    _set_session(ledger, op_id, session)
    assert _step(executor, op_id) == "still_working"
    assert _step(executor, op_id) == "still_working"  # unchanged: no event, counted on the row

    _set_session(ledger, op_id, None)
    assert [_step(executor, op_id) for _ in range(MAX_POLL_REJECTIONS - 1)] == ["poll_failed"] * (
        MAX_POLL_REJECTIONS - 1
    )
    _set_session(ledger, op_id, session)
    assert _step(executor, op_id) == "still_working"
    _set_session(ledger, op_id, None)
    assert [_step(executor, op_id) for _ in range(MAX_POLL_REJECTIONS - 1)] == ["poll_failed"] * (
        MAX_POLL_REJECTIONS - 1
    )
    _set_session(ledger, op_id, session)
    remote_id = ledger.get(op_id).remote_id
    finished = httpx2.post(f"{mcp.control}/finish", json={"task_ids": [remote_id]}, timeout=10)
    assert remote_id in finished.raise_for_status().json()["finished"]

    def ended() -> bool:
        if ledger.get(op_id).state is S.WORKING:
            _step(executor, op_id)
        return ledger.get(op_id).state is not S.WORKING

    support.wait_for("the operation's end", ended, timeout=30, interval=0.2)
    assert ledger.get(op_id).state is S.ACCEPTED
    assert ledger.reconciliations_for(op_id) == []
    assert ledger.receipt_for(op_id) is not None


# ----------------------------------------------------------------------------- b) the operator's found


def test_found_without_the_session_is_refused_with_nothing_written(
    mcp_executor: tuple[McpServer, Executor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost create answer goes to an operator (MCP has no lookup by key). ``reconcile --found`` without
    ``--session`` for MCP 2025-11-25 (tasks bound to the session that created them) is refused, exit 1,
    one line naming --session; nothing is written. With the session, the operation is polled."""
    mcp, executor = mcp_executor
    ledger = executor.ledger
    mcp.faults(lose_create_response=1)
    op_id = _submit(executor, "n/lost", {"seconds": 600})
    assert ledger.get(op_id).state is S.MANUAL_RECONCILIATION
    [task] = [t for t in mcp.tasks() if t["tool"] == "slow_report"]
    events_before = len(ledger.events(op_id))

    refused = run_cli(
        monkeypatch, executor, "reconcile", str(op_id), "--found", task["taskId"], "--evidence", "seen"
    )
    assert refused.exit_code == 1, refused.output
    [line] = refused.output.strip().splitlines()
    assert "--session" in line, line
    assert ledger.get(op_id).state is S.MANUAL_RECONCILIATION
    assert len(ledger.events(op_id)) == events_before
    assert ledger.reconciliations_for(op_id)[0].resolved_at is None
    with pytest.raises(ValueError, match="--session"):
        executor.resolve(op_id, Resolution("found", "seen", "ops", remote_id=task["taskId"]))

    done = run_cli(
        monkeypatch,
        executor,
        "reconcile",
        str(op_id),
        "--found",
        task["taskId"],
        "--session",
        task["session"],
        "--evidence",
        "seen on the server's task list",
    )
    assert done.exit_code == 0, done.output
    op = ledger.get(op_id)
    assert (op.state, op.session_ref) == (S.WORKING, task["session"])
    assert _step(executor, op_id) == "still_working"
