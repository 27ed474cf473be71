"""Building ledger rows for tests: a submitted operation, and an operation placed directly in any state."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text

from ledger.digests import digest, request_digest
from ledger.records import NewOperation, Operation, TerminalEvidence
from ledger.repository import Ledger
from ledger.states import NEVER_POLLED, REMOTE_ID_REQUIRED, TERMINAL_KNOWN, OpState, TerminalKind

RESULT = {"content": [{"type": "text", "text": "report ready"}], "isError": False}


def new_operation(
    call_node_id: str | None = None, *, arguments: Any = None, **overrides: Any
) -> NewOperation:
    arguments = {"month": "2026-11"} if arguments is None else arguments
    values: dict[str, Any] = {
        "call_node_id": call_node_id or f"node-{uuid.uuid4().hex[:8]}",
        "request_digest": request_digest(server="reports", tool="slow_report", arguments=arguments),
        "server": "reports",
        "protocol": "mcp",
        "protocol_version": "2025-11-25",
        "adapter_version": "longcall/test",
        "tool_name": "slow_report",
        "body": arguments,
        "on_terminal": {"task": "pipeline.record", "args": [], "kwargs": {}, "options": {}},
        "ttl_ms": 600_000,
        "wait_budget_s": 3600.0,
    }
    values.update(overrides)
    return NewOperation(**values)


def submit(ledger: Ledger, call_node_id: str | None = None, **overrides: Any) -> Operation:
    return ledger.record_submission(new_operation(call_node_id, **overrides)).operation


def place(ledger: Ledger, state: OpState, *, terminal: TerminalKind = TerminalKind.COMPLETED) -> Operation:
    """A fresh operation put straight into ``state`` with the columns that state requires (setup only)."""
    op = submit(ledger)
    sets: dict[str, str | None] = {"state": state.value}
    if state not in (OpState.SUBMITTING, OpState.NOT_FOUND_SAFE, OpState.SUBMISSION_UNKNOWN):
        sets["remote_id"] = f"task-{op.id.hex[:12]}"
    if state is not OpState.SUBMITTING:
        sets["submit_attempted_at"] = "now"
    if state in TERMINAL_KNOWN:
        sets["observed_terminal"] = (
            TerminalKind.CANCELLED.value if state is OpState.CANCELLED_ACCEPTED else terminal.value
        )
        sets["server_state"] = sets["observed_terminal"]
    if state is OpState.INPUT_REQUIRED:
        sets["input_request"] = '{"method": "elicitation/create"}'
        sets["input_round"] = "1"
        sets["input_deadline"] = "2999-01-01T00:00:00Z"
    if state is OpState.ACCEPTED:
        sets["result_digest"] = digest(RESULT)
    if state in NEVER_POLLED:
        sets["next_poll_at"] = None  # a new row is due at once; these states are never polled
    assignments = ", ".join(f"{column} = :{column}" for column in sets)
    with ledger.engine.begin() as conn:
        conn.execute(text(f"UPDATE tool_operation SET {assignments} WHERE id = :id"), {**sets, "id": op.id})
    return ledger.get(op.id)


def values_for(target: OpState, op: Operation) -> dict[str, Any]:
    """What a writer supplies with a move into ``target`` (the columns that state requires)."""
    values: dict[str, Any] = {}
    if target in REMOTE_ID_REQUIRED and op.remote_id is None:
        values["remote_id"] = f"task-{op.id.hex[:12]}"
    if target is OpState.SUBMISSION_UNKNOWN and op.submit_attempted_at is None:
        values["submit_attempted_at"] = op.created_at
    if target in TERMINAL_KNOWN and op.observed_terminal is None:
        values["observed_terminal"] = TerminalKind.COMPLETED
        values["server_state"] = "completed"
    if target is OpState.INPUT_REQUIRED:
        values.update(
            input_request={"method": "elicitation/create"},
            input_round=op.input_round + 1,
            input_deadline=op.created_at.replace(year=op.created_at.year + 1),
        )
    return values


def evidence_for(op: Operation, kind: TerminalKind, **overrides: Any) -> TerminalEvidence:
    """Evidence that matches ``op``: the test result for completed/failed, none for cancelled."""
    result = None if kind is TerminalKind.CANCELLED else overrides.get("result", RESULT)
    values: dict[str, Any] = {
        "call_node_id": op.call_node_id,
        "request_digest": op.request_digest,
        "remote_id": op.remote_id,
        "tool_descriptor_version": op.tool_descriptor_version,
        "execution_epoch": op.execution_epoch,
        "cancel_generation": op.cancel_generation,
        "terminal_state": kind,
        "result": result,
        "result_digest": digest(result) if result is not None else None,
    }
    values.update(overrides)
    return TerminalEvidence(**values)
