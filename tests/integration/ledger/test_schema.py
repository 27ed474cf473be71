"""The schema itself refuses what the code must never do, by plain SQL (the migrations' round trips and drift
guard: tests/migrations/test_migrations.py)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from ledger.events import EventKind
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests.support.ledger_rows import evidence_for, place


def _receipt_sql(op_id: uuid.UUID, call_node_id: str, digest: str | None, state: str = "completed") -> str:
    digest_sql = "NULL" if digest is None else f"'{digest}'"
    return (
        "INSERT INTO terminal_receipt (id, op_id, call_node_id, request_digest, execution_epoch, "
        f"cancel_generation, terminal_state, result_digest) VALUES ('{uuid.uuid4()}', '{op_id}', "
        f"'{call_node_id}', 'sha256:x', 1, 0, '{state}', {digest_sql})"
    )


def test_second_receipt_for_the_same_call_node_is_refused(ledger: Ledger) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    other = place(ledger, OpState.FETCHING_RESULT)
    with ledger.engine.begin() as conn:
        conn.execute(text(_receipt_sql(op.id, op.call_node_id, "sha256:a")))
    # Same operation, and (from another operation) the same call node: both refused by the database.
    with pytest.raises(IntegrityError, match="uq_terminal_receipt_op_id"), ledger.engine.begin() as conn:
        conn.execute(text(_receipt_sql(op.id, "another-node", "sha256:b")))
    with (
        pytest.raises(IntegrityError, match="uq_terminal_receipt_call_node_id"),
        ledger.engine.begin() as conn,
    ):
        conn.execute(text(_receipt_sql(other.id, op.call_node_id, "sha256:b")))


def test_second_outbox_row_for_the_same_receipt_is_refused(ledger: Ledger) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert acceptance.receipt is not None
    with pytest.raises(IntegrityError, match="uq_outbox_receipt_id"), ledger.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (kind, receipt_id, op_id, payload) "
                f"VALUES ('terminal', '{acceptance.receipt.id}', '{op.id}', '{{}}')"
            )
        )


def test_completed_or_failed_receipt_without_digest_is_refused(ledger: Ledger) -> None:
    for state in ("completed", "failed"):
        op = place(ledger, OpState.FETCHING_RESULT)
        with pytest.raises(IntegrityError, match="digest_unless_cancelled"), ledger.engine.begin() as conn:
            conn.execute(text(_receipt_sql(op.id, op.call_node_id, None, state)))
    op = place(ledger, OpState.CANCEL_REQUESTED)
    with ledger.engine.begin() as conn:  # a cancelled receipt carries no digest
        conn.execute(text(_receipt_sql(op.id, op.call_node_id, None, "cancelled")))


def test_outbox_kind_ties_its_columns(ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)
    for values in (
        "('terminal', NULL, NULL)",  # a terminal row without its receipt
        "('input_required', NULL, NULL)",  # an input row without its round
    ):
        with pytest.raises(IntegrityError, match="kind_columns"), ledger.engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO outbox (kind, receipt_id, input_round, op_id, payload) "
                    f"SELECT k, r::uuid, i::int, '{op.id}', '{{}}' FROM (VALUES {values}) AS v(k, r, i)"
                )
            )


def test_remote_id_is_unique_per_server(ledger: Ledger) -> None:
    first = place(ledger, OpState.WORKING)
    second = place(ledger, OpState.SUBMITTING)
    with (
        pytest.raises(IntegrityError, match="uq_tool_operation_server_remote_id"),
        ledger.engine.begin() as conn,
    ):
        conn.execute(
            text("UPDATE tool_operation SET remote_id = :r WHERE id = :id"),
            {"r": first.remote_id, "id": second.id},
        )


def _event_sql(op_id: uuid.UUID, seq: int, kind: str) -> str:
    return f"INSERT INTO operation_event (op_id, seq, kind) VALUES ('{op_id}', {seq}, '{kind}')"


def test_every_event_kind_is_accepted_and_an_unknown_one_refused(ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)
    with ledger.engine.begin() as conn:
        for offset, kind in enumerate(EventKind, start=1):
            conn.execute(text(_event_sql(op.id, op.event_seq + offset, kind.value)))
    with pytest.raises(IntegrityError, match="ck_operation_event_kind_known"), ledger.engine.begin() as conn:
        conn.execute(text(_event_sql(op.id, op.event_seq + len(EventKind) + 1, "tasks/get")))
    with pytest.raises(IntegrityError, match="ck_operation_event_kind_known"), ledger.engine.begin() as conn:
        conn.execute(text(_event_sql(op.id, op.event_seq + len(EventKind) + 1, "TRANSITION")))
