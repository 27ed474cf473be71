"""The rows a transaction writes beside its guarded move, on the caller's connection (never a transaction of
their own): an event that changes nothing else, a stale writer's refusal, a reconciliation record."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.errors import OperationNotFound, StaleTransition
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Operation, ReconciliationRecord
from ledger.statements import EVENT, OP, RECON, STATEMENTS, insert_event
from ledger.states import OpState


def append_event(
    conn: Connection,
    op: Operation,
    *,
    seq: int,
    kind: EventKind,
    from_state: str | None,
    detail: Mapping[str, Any] | None,
) -> None:
    """One ``operation_event`` row at ``seq`` (already taken from the row's ``event_seq``)."""
    conn.execute(
        STATEMENTS.get(insert_event),
        {
            "op_id": op.id,
            "seq": seq,
            "kind": EventKind(kind).value,
            "from_state": from_state,
            "to_state": op.state.value,
            "server_state": op.server_state,
            "poll_cursor": op.poll_cursor,
            "cancel_generation": op.cancel_generation,
            "execution_epoch": op.execution_epoch,
            "detail": dict(detail or {}),
        },
    )


def record_stale(
    conn: Connection,
    op_id: uuid.UUID,
    *,
    attempted: str,
    to_state: OpState | None,
    expected: dict[str, Any],
    detail: Mapping[str, Any] | None,
) -> StaleTransition:
    """Append a ``stale_write_rejected`` event; the row itself only advances its event counter. The caller
    raises the returned error after its commit."""
    current = conn.execute(
        update(OP)
        .where(OP.c.id == op_id)
        .values(event_seq=OP.c.event_seq + 1)
        .returning(
            OP.c.event_seq,
            OP.c.state,
            OP.c.server_state,
            OP.c.execution_epoch,
            OP.c.cancel_generation,
            OP.c.poll_cursor,
            OP.c.input_round,
        )
    ).first()
    if current is None:
        raise OperationNotFound(op_id)
    found = {
        "state": current.state,
        "execution_epoch": current.execution_epoch,
        "cancel_generation": current.cancel_generation,
        "poll_cursor": current.poll_cursor,
        "input_round": current.input_round,
    }
    if expected.get("poll_cursor") is None:
        expected = {k: v for k, v in expected.items() if k != "poll_cursor"}
    if isinstance(expected.get("state"), list) and current.state in expected["state"]:
        expected = {**expected, "state": current.state}
    conn.execute(
        insert(EVENT).values(
            op_id=op_id,
            seq=current.event_seq,
            kind=EventKind.STALE_WRITE_REJECTED.value,
            from_state=current.state,
            to_state=to_state.value if to_state is not None else None,
            server_state=current.server_state,
            poll_cursor=current.poll_cursor,
            cancel_generation=current.cancel_generation,
            execution_epoch=current.execution_epoch,
            detail={
                "attempted": attempted,
                "expected": expected,
                "found": found,
                "write_detail": dict(detail or {}),
            },
        )
    )
    return StaleTransition(op_id, attempted, expected, found)


def open_reconciliation(
    conn: Connection,
    op: Operation,
    reason: ReconciliationReason,
    deadline: dt.timedelta,
    detail: Mapping[str, Any] | None,
) -> ReconciliationRecord:
    """Open one record per (operation, reason), with a ``reconciliation_opened`` event; an open one is
    returned as it is."""
    row = conn.execute(
        pg_insert(RECON)
        .values(
            op_id=op.id,
            reason=reason.value,
            deadline=func.now() + literal(deadline),
            detail=dict(detail or {}),
        )
        .on_conflict_do_nothing(
            index_elements=[RECON.c.op_id, RECON.c.reason],
            index_where=RECON.c.resolved_at.is_(None),
        )
        .returning(*RECON.c)
    ).first()
    if row is None:
        row = conn.execute(
            select(RECON).where(
                RECON.c.op_id == op.id, RECON.c.reason == reason.value, RECON.c.resolved_at.is_(None)
            )
        ).one()
    else:
        seq = conn.execute(
            update(OP).where(OP.c.id == op.id).values(event_seq=OP.c.event_seq + 1).returning(OP.c.event_seq)
        ).scalar_one()
        append_event(
            conn,
            op,
            seq=seq,
            kind=EventKind.RECONCILIATION_OPENED,
            from_state=op.state.value,
            detail={"reconciliation_id": row.id, "reason": reason.value, **dict(detail or {})},
        )
    return ReconciliationRecord.from_row(row)


def resolve_open_reconciliations(conn: Connection, op_id: uuid.UUID, resolution: str) -> None:
    """Close every open record of the operation with ``resolution`` (an operator's decision)."""
    conn.execute(
        update(RECON)
        .where(RECON.c.op_id == op_id, RECON.c.resolved_at.is_(None))
        .values(resolved_at=func.now(), resolution=resolution)
    )
