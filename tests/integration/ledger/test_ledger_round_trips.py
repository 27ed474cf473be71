"""What the ledger's hot statements cost the worker on the way to Postgres (issue 13): a one-statement
transaction sent without BEGIN and COMMIT, the guarded write's placeholder conversion cached, a result
shape described once. Real Postgres; each test fails on the code before the change it names."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg._queries
import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy import event, text

from ledger.errors import StaleTransition
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, ServerStatus
from ledger.repository import Ledger
from ledger.states import OpState
from tests.support.ledger_rows import place

pytestmark = pytest.mark.usefixtures("services")


class StatementLog:
    """Each statement the ledger's engine sent, with the connection's transaction status just after it."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, TransactionStatus]] = []

    def after(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        self.entries.append((statement, conn.connection.dbapi_connection.info.transaction_status))

    def take(self) -> list[tuple[str, TransactionStatus]]:
        entries, self.entries = self.entries, []
        return entries


@pytest.fixture
def statements(ledger: Ledger) -> Iterator[StatementLog]:
    log = StatementLog()
    event.listen(ledger.engine, "after_cursor_execute", log.after)
    try:
        yield log
    finally:
        event.remove(ledger.engine, "after_cursor_execute", log.after)


def claimed_working(ledger: Ledger) -> tuple[uuid.UUID, Fence]:
    op = place(ledger, OpState.WORKING)
    claim = ledger.claim(op.id, lease_s=60)
    assert claim is not None
    op = ledger.get(op.id)
    return op.id, Fence(op.execution_epoch, op.cancel_generation, op.poll_cursor)


def unchanged_poll(ledger: Ledger, op_id: uuid.UUID, fence: Fence) -> None:
    ledger.record_poll(
        op_id, fence, state=OpState.WORKING, status=ServerStatus("working"), next_poll_in_s=60.0
    )


def test_a_poll_s_read_claim_and_reschedule_each_run_outside_a_transaction_block(
    ledger: Ledger, statements: StatementLog
) -> None:
    """One statement is its own transaction: BEGIN and COMMIT around it are two round trips for nothing."""
    op_id, fence = claimed_working(ledger)
    statements.take()
    ledger.get(op_id)
    unchanged_poll(ledger, op_id, fence)  # lets the claim go
    claims = ledger.claim_due_by_server([("reports", 10)], limit=10, lease_s=60, horizon_s=3600.0)
    assert [c.op_id for c in claims] == [op_id]
    op = ledger.get(op_id)
    unchanged_poll(ledger, op_id, Fence(op.execution_epoch, op.cancel_generation, op.poll_cursor))
    assert ledger.claim(op_id, lease_s=60) is not None
    seen = statements.take()
    assert len(seen) == 6
    assert [status for _, status in seen] == [TransactionStatus.IDLE] * 6
    # ... and each one did its work: both claims moved the cursor, the first poll recorded the server's
    # state (an event), the second one changed nothing and was counted on the row.
    after = ledger.get(op_id)
    assert fence.poll_cursor is not None
    assert after.poll_cursor == fence.poll_cursor + 2
    assert after.server_state == "working"
    assert after.unchanged_polls == 1
    assert after.lease_until is not None


def test_a_write_with_side_rows_stays_one_transaction(ledger: Ledger, statements: StatementLog) -> None:
    """The reconciliation record goes in with the state change, or neither does."""
    op_id, fence = claimed_working(ledger)
    statements.take()
    op = ledger.hand_to_operator(
        op_id,
        fence,
        from_state=OpState.WORKING,
        reason=ReconciliationReason.DEADLINE_EXCEEDED,
        detail={"why": "test"},
        deadline_s=60,
    )
    assert op.state is OpState.MANUAL_RECONCILIATION
    seen = statements.take()
    assert len(seen) >= 2
    assert all(status is TransactionStatus.INTRANS for _, status in seen)


def test_a_refused_one_statement_write_still_records_the_stale_writer(ledger: Ledger) -> None:
    op_id, fence = claimed_working(ledger)
    unchanged_poll(ledger, op_id, fence)
    assert ledger.claim(op_id, lease_s=60) is not None  # another claim: the first one's cursor is stale
    with pytest.raises(StaleTransition):
        unchanged_poll(ledger, op_id, fence)
    kinds = [e["kind"] for e in ledger.events(op_id)]
    assert kinds[-1] == EventKind.STALE_WRITE_REJECTED.value
    assert ledger.get(op_id).server_state == "working"  # the first poll's write, not the refused one's
    assert ledger.get(op_id).unchanged_polls == 0


def test_the_guarded_write_is_converted_once(ledger: Ledger, statements: StatementLog) -> None:
    """psycopg caches its %(name)s -> $n conversion for statements up to 4,096 bytes by default; the guarded
    write is longer, and was parsed with a regular expression on every poll."""
    op_id, fence = claimed_working(ledger)
    unchanged_poll(ledger, op_id, fence)
    (guarded,) = [s for s, _ in statements.take() if s.startswith("WITH prior")]
    assert len(guarded.encode()) > 4096  # what this test is about: a statement past psycopg's default bound
    op = ledger.get(op_id)
    fence = Fence(op.execution_epoch, op.cancel_generation, op.poll_cursor)
    before = psycopg._queries._query2pg.cache_info()
    unchanged_poll(ledger, op_id, fence)
    after = psycopg._queries._query2pg.cache_info()
    assert after.hits > before.hits
    assert after.misses == before.misses


def test_a_result_shape_is_described_once_and_exactly(ledger: Ledger) -> None:
    with ledger.engine.connect() as conn:
        first = conn.execute(text("SELECT 1 AS a, 'x'::varchar(3) AS b")).cursor
        first_description = first.description
        second_description = conn.execute(text("SELECT 2 AS a, 'y'::varchar(3) AS b")).cursor.description
        other = conn.execute(text("SELECT 'z'::text AS a, 'y'::varchar(5) AS b")).cursor.description
        raw = conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        with psycopg.ClientCursor(raw) as plain:
            plain.execute("SELECT 'z'::text AS a, 'y'::varchar(5) AS b")
            expected = plain.description
    assert first_description is not None
    assert second_description is not None
    # The same shape: the very same Column objects, not 2 x N new ones.
    assert all(a is b for a, b in zip(first_description, second_description, strict=True))
    # Another shape (a type, a modifier) is described as psycopg describes it.
    assert other is not None
    assert expected is not None
    # (name, type oid, display size, internal size, precision, scale, null_ok), as psycopg's own cursor says
    assert [tuple(c) for c in other] == [tuple(c) for c in expected]
    assert [c[1] for c in other] != [c[1] for c in first_description]
