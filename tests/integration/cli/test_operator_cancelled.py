"""``longcall reconcile OP --terminal cancelled`` is held against the server's own word.

A completed or failed end named by an operator is checked by the result's read (the result wins); a
cancelled one has no result to read, so it was taken as the operator said it: an operation whose task had
completed, or still ran, could be ended cancelled, a receipt that is not the server's view (and a task left
running untracked). Now one status read, charged to the server's control budget, decides: the operator's
"cancelled" is taken when the server says cancelled or no longer knows the task; otherwise it is refused,
nothing written, the message naming what the server said and what to do.

Real Postgres and Redis, longcall's MCP server and an in-process executor; the command runs in this
process (``CliRunner``).
"""

from __future__ import annotations

import uuid

import httpx2
import pytest
from click.testing import Result
from sqlalchemy import text

from console.common import EXIT_REFUSED
from ledger.reasons import ReconciliationReason
from ledger.records import Operation
from ledger.states import OpState, TerminalKind
from tests.support.cli import run_cli
from tests.support.fleet import McpServer, run_due
from workers.executor import Executor
from workers.steps.context import remote_ref
from workers.submission import validate_submission

S = OpState


def _with_operator(executor: Executor, call_node_id: str) -> Operation:
    """A task created and running on the server (a ten-minute report), its operation handed to an operator."""
    new = validate_submission(
        {
            "call_node_id": call_node_id,
            "server": "reports",
            "tool": "slow_report",
            "arguments": {"seconds": 600},
        },
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    submission, _step = executor.submit(new)
    op = executor.ledger.get(submission.operation.id)
    assert (op.state, op.remote_id is not None) == (S.WORKING, True), op
    return executor.ledger.hand_to_operator(
        op.id,
        op.fence,
        from_state=S.WORKING,
        reason=ReconciliationReason.UNKNOWN_NOT_FOUND,
        detail={"why": "test"},
        deadline_s=3600,
    )


def _status_reads(mcp: McpServer, remote_id: str | None) -> list[str | None]:
    """The budgets the server's ``tasks/get`` of ``remote_id`` were charged to, in order."""
    return [e["budget"] for e in mcp.log() if e["method"] == "tasks/get" and e["task_id"] == remote_id]


def _refused(result: Result) -> str:
    assert result.exit_code == EXIT_REFUSED, result.output
    return " ".join(result.output.split())


def test_cancelled_is_refused_while_the_server_says_the_task_runs_or_ended_otherwise(
    mcp_executor: tuple[McpServer, Executor], monkeypatch: pytest.MonkeyPatch
) -> None:
    mcp, executor = mcp_executor
    op = _with_operator(executor, "n/still-running")
    assert op.remote_id is not None
    events = len(executor.ledger.events(op.id))

    said = _refused(
        run_cli(monkeypatch, executor, "reconcile", str(op.id), "--terminal", "cancelled", "--evidence", "x")
    )
    assert f"the server says {op.remote_id} on reports is 'working', not ended" in said, said
    assert f"--found {op.remote_id}" in said
    assert _status_reads(mcp, op.remote_id)[-1] == "control"  # read, and charged to the control budget
    assert executor.ledger.get(op.id).state is S.MANUAL_RECONCILIATION
    assert len(executor.ledger.events(op.id)) == events  # nothing written

    finished = httpx2.post(f"{mcp.control}/finish", json={"task_ids": [op.remote_id]}, timeout=10)
    assert op.remote_id in finished.raise_for_status().json()["finished"]
    said = _refused(
        run_cli(monkeypatch, executor, "reconcile", str(op.id), "--terminal", "cancelled", "--evidence", "x")
    )
    assert "ended completed ('completed'), not cancelled" in said, said
    assert "--terminal completed" in said
    assert executor.ledger.get(op.id).state is S.MANUAL_RECONCILIATION
    assert len(executor.ledger.events(op.id)) == events

    # What the server says is taken: completed, its result read and accepted.
    done = run_cli(
        monkeypatch, executor, "reconcile", str(op.id), "--terminal", "completed", "--evidence", "read"
    )
    assert done.exit_code == 0, done.output
    [step] = run_due(executor)
    assert (step.op_id, step.action) == (op.id, "accepted"), step
    receipt = executor.ledger.receipt_for(op.id)
    assert receipt is not None
    assert receipt.terminal_state is TerminalKind.COMPLETED


def test_cancelled_is_taken_when_the_server_says_cancelled_or_no_longer_knows_the_task(
    mcp_executor: tuple[McpServer, Executor], monkeypatch: pytest.MonkeyPatch
) -> None:
    mcp, executor = mcp_executor
    cancelled = _with_operator(executor, "n/cancelled-there")
    adapter = executor.rt.remote.adapter(
        "reports", protocol=cancelled.protocol, protocol_version=cancelled.protocol_version
    )
    adapter.cancel(remote_ref(cancelled))  # cancelled on the server by other means than longcall's step
    gone = _with_operator(executor, "n/purged-there")
    with executor.ledger.engine.begin() as conn:  # a task the server purged: unknown to it now
        conn.execute(
            text("UPDATE tool_operation SET remote_id = :r WHERE id = :id"),
            {"r": f"gone-{uuid.uuid4()}", "id": gone.id},
        )
    gone = executor.ledger.get(gone.id)

    for op in (cancelled, gone):
        result = run_cli(
            monkeypatch, executor, "reconcile", str(op.id), "--terminal", "cancelled", "--evidence", "seen"
        )
        assert result.exit_code == 0, result.output
        assert _status_reads(mcp, op.remote_id)[-1:] == ["control"]
        [event] = [e for e in executor.ledger.events(op.id) if e["kind"] == "resolved_terminal"]
        assert event["detail"]["status_read"].startswith(
            "cancelled" if op is cancelled else "the server does not know it"
        ), event
    steps = {step.op_id: step.action for step in run_due(executor)}
    assert steps == {cancelled.id: "accepted", gone.id: "accepted"}, steps
    for op in (cancelled, gone):
        receipt = executor.ledger.receipt_for(op.id)
        assert receipt is not None
        assert receipt.terminal_state is TerminalKind.CANCELLED


def test_cancelled_is_refused_on_a_not_found_that_is_not_the_servers_word_on_the_task(
    mcp_executor: tuple[McpServer, Executor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status read is answered HTTP 404 for the MCP session the task is bound to (the session ended):
    that says nothing of the task, which may have completed or still run. Refused, nothing written (a
    first version of the check took any not-found as the server's word)."""
    _mcp, executor = mcp_executor
    op = _with_operator(executor, "n/session-gone")
    with executor.ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET session_ref = :s WHERE id = :id"),
            {"s": "ended-session", "id": op.id},
        )
    events = len(executor.ledger.events(op.id))

    said = _refused(
        run_cli(monkeypatch, executor, "reconcile", str(op.id), "--terminal", "cancelled", "--evidence", "x")
    )
    assert "not in the server's own words" in said, said
    assert executor.ledger.get(op.id).state is S.MANUAL_RECONCILIATION
    assert len(executor.ledger.events(op.id)) == events
