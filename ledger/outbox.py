"""The outbox's transactions (rule 9): the drain, the pace of its retries, dead letters, an operator's resend.

A row whose publish fails is tried again after a pause that doubles from ``first_pause_s`` up to
``max_pause_s`` (``outbox.next_attempt_at``; a drain passes the rows still paused by). After
``max_attempts`` failed attempts it is dead-lettered: ``outbox.status = 'dead'``, an OUTBOX_UNDELIVERABLE
reconciliation record on its operation with the error, an ``outbox_dead_lettered`` event; ``longcall status``
and the metrics (``longcall_outbox_dead_rows``, ``longcall_outbox_dead_total``) show it, and ``longcall
reconcile --resend OUTBOX_ID`` puts it back to ready (``outbox_resent``), resolving the record once none of
the operation's rows is dead.

A broker that is out of reach is not the row's fault. The publisher says so by raising
:class:`~ledger.errors.PublishUnavailable` (``workers/delivery.py``: a connection refused, reset or timed
out, a broker restarting): the attempt is not counted, the drain stops there (every other row would meet the
same broker, each with its own connection timeout, while holding its lock), and the row waits
``first_pause_s``. So an outage of any length dead-letters nothing, and delivery resumes within a drain
interval of the broker's return. The outage itself is what bounds that loop, and an operator sees it:
``longcall_outbox_ready`` and ``longcall_outbox_oldest_ready_age_seconds`` climb, and each row's
``last_error`` (``longcall status``) says the broker could not be reached. Every other failure (a refusal by
the broker: a queue declared with other arguments, a permission, a missing exchange; a signature Celery
cannot send) counts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, func, select, update

from ledger.errors import PublishRefusedForGood, PublishUnavailable
from ledger.events import EventKind
from ledger.guarded import GuardedWrites
from ledger.reasons import ReconciliationReason
from ledger.records import DrainReport, Operation, OutboxMessage
from ledger.redact import publish_error
from ledger.side_rows import append_event, open_reconciliation
from ledger.statements import (
    OP,
    OUTBOX,
    RECON,
    STATEMENTS,
    literal_json,
    operation_columns,
    select_outbox_rows,
    select_ready_outbox,
    update_outbox_dispatched,
    update_outbox_failed,
)

UNDELIVERABLE = ReconciliationReason.OUTBOX_UNDELIVERABLE

#: How much stored payload one drain of the beat's reads at once, at most (``pg_column_size``: a receipt's
#: result as Postgres keeps it, compressed or not): a backlog of large receipts (after a broker outage, each
#: up to ``max_result_bytes``) goes out a part at a time, never ``limit`` of them in one worker's memory. A
#: row larger than this alone is drained alone. A step's drain of its own operation's rows (at most
#: ``workers.delivery.OWN_ROWS_DRAIN_LIMIT``) reads them whole.
DRAIN_STORED_BYTES = 32 * 1024 * 1024


def within_bytes(sizes: Sequence[Row[Any]], max_bytes: int) -> list[int]:
    """The ids of the first rows whose stored payloads add up to at most ``max_bytes``, and the first row
    always (a receipt larger than the budget is still delivered, alone)."""
    ids: list[int] = []
    total = 0
    for r in sizes:
        total += r.stored_bytes or 0
        if ids and total > max_bytes:
            break
        ids.append(r.id)
    return ids


@dataclass(frozen=True, slots=True)
class OutboxRetry:
    """How often a failed publish is tried again (``Settings.outbox_max_attempts``,
    ``outbox_retry_max_s``; the first pause is the beat's drain interval, ``outbox_interval_s``)."""

    max_attempts: int = 10
    max_pause_s: float = 300.0
    first_pause_s: float = 1.0

    def pause_s(self, attempts: int) -> float:
        """The pause after the ``attempts``-th failed attempt: 1, 2, 4, ... times ``first_pause_s``, at most
        ``max_pause_s``."""
        return min(self.max_pause_s, self.first_pause_s * 2.0 ** min(max(attempts - 1, 0), 60))


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One outbox row as ``longcall status`` shows it (its payload left out)."""

    id: int
    kind: str
    input_round: int | None
    status: str
    attempts: int
    last_error: str | None
    created_at: dt.datetime
    next_attempt_at: dt.datetime | None
    dispatched_at: dt.datetime | None

    @classmethod
    def from_row(cls, row: Row[Any]) -> OutboxRow:
        return cls(**{f.name: row._mapping[f.name] for f in dataclasses.fields(cls)})


@dataclass(frozen=True, slots=True)
class OutboxResend:
    """What ``resend_outbox`` found: the row's status before (``"dead"``: it was put back to ready; None: no
    such row), its operation, and the reconciliation records the resend resolved."""

    outbox_id: int
    found: str | None
    op_id: uuid.UUID | None = None
    resolved: tuple[int, ...] = ()

    @property
    def resent(self) -> bool:
        return self.found == "dead"


#: The outbox columns ``longcall status`` reads, :class:`OutboxRow`'s fields (never the payload: a receipt
#: carries its whole result).
_SHOWN = tuple(OUTBOX.c[f.name] for f in dataclasses.fields(OutboxRow))


class OutboxTransactions(GuardedWrites):
    """The outbox's transactions; ``Ledger`` inherits them."""

    #: How long an operator has for a record the ledger opens itself (``Ledger.reconcile_deadline``).
    reconcile_deadline: dt.timedelta

    def drain_outbox(
        self,
        publish: Callable[[OutboxMessage], None],
        *,
        limit: int = 100,
        op_id: uuid.UUID | None = None,
        retry: OutboxRetry | None = None,
        max_bytes: int = DRAIN_STORED_BYTES,
    ) -> DrainReport:
        """Claim ready outbox rows whose pause is over (SKIP LOCKED), hand each to ``publish`` and mark it
        dispatched; a failed publish is paced, counted and dead-lettered by ``retry`` (the module's
        docstring).

        The rows stay locked until the transaction commits, so two drainers never deliver the same row; a
        crash after ``publish`` and before the commit leaves the row ready, and it is delivered again:
        delivery is at-least-once, and the outbox id is the consumer's dedupe key. With ``op_id``: that
        operation's rows only, and the drain stops at the first failed publish (the rest stays ready, for
        the beat's drain): a step draining what it wrote never waits behind a backlog or a slow broker.
        Without it, the rows read at once hold at most ``max_bytes`` of stored payload
        (:data:`DRAIN_STORED_BYTES`), the first row whatever its size; the rest waits for the next drain.
        """
        retry = retry or OutboxRetry()
        dispatched: list[int] = []
        failed: list[tuple[Row[Any], str, bool, bool]] = []  # the row, why, counted, refused for good
        dead: list[int] = []
        with self._tx() as conn:
            rows = self._ready_rows(conn, limit, op_id, max_bytes)
            for r in rows:
                message = OutboxMessage(r.id, r.kind, r.op_id, r.input_round, r.payload, r.attempts)
                try:
                    publish(message)
                except PublishUnavailable as exc:
                    failed.append((r, publish_error(exc.__cause__ or exc), False, False))
                    break  # the broker is out of reach: every other row would meet it too
                except Exception as exc:  # noqa: BLE001 - any other publish failure is counted against the row
                    failed.append((r, publish_error(exc), True, isinstance(exc, PublishRefusedForGood)))
                    if op_id is not None:
                        break
                else:
                    dispatched.append(r.id)
            if dispatched:
                conn.execute(STATEMENTS.get(update_outbox_dispatched), {"ids": dispatched})
            for r, error, counted, for_good in failed:
                attempts = r.attempts + 1 if counted else r.attempts
                to_dead = counted and (for_good or attempts >= retry.max_attempts)
                pause = retry.pause_s(attempts) if counted else retry.first_pause_s
                conn.execute(
                    STATEMENTS.get(update_outbox_failed),
                    {
                        "outbox_id": r.id,
                        "new_attempts": attempts,
                        "new_error": error,
                        "new_status": "dead" if to_dead else "ready",
                        "new_pause": None if to_dead else dt.timedelta(seconds=pause),
                    },
                )
                if to_dead:
                    self._dead_letter(conn, r, attempts, error)
                    dead.append(r.id)
        return DrainReport(tuple(dispatched), tuple(r.id for r, *_ in failed), dead=tuple(dead))

    @staticmethod
    def _ready_rows(
        conn: Connection, limit: int, op_id: uuid.UUID | None, max_bytes: int
    ) -> Sequence[Row[Any]]:
        """The drain's rows, locked: one operation's (``op_id``), or the first ready ones within
        ``max_bytes`` of stored payload."""
        if op_id is not None:
            whole = STATEMENTS.get(select_ready_outbox, True)
            return conn.execute(whole, {"limit": limit, "op_id": op_id}).all()
        sizes = conn.execute(STATEMENTS.get(select_ready_outbox, False), {"limit": limit}).all()
        ids = within_bytes(sizes, max_bytes)
        return conn.execute(STATEMENTS.get(select_outbox_rows), {"ids": ids}).all() if ids else []

    def _dead_letter(self, conn: Connection, row: Row[Any], attempts: int, error: str) -> None:
        """The dead row's OUTBOX_UNDELIVERABLE record (one open record per operation: a second dead row of
        the operation is added to its ``outbox_ids``) and its ``outbox_dead_lettered`` event."""
        op = Operation.from_row(
            conn.execute(select(*operation_columns(False)).where(OP.c.id == row.op_id)).one(), with_body=False
        )
        about = {"outbox_id": row.id, "kind": row.kind, "input_round": row.input_round}
        record = open_reconciliation(
            conn,
            op,
            UNDELIVERABLE,
            self.reconcile_deadline,
            {**about, "outbox_ids": [row.id], "attempts": attempts, "error": error},
        )
        if row.id not in record.detail.get("outbox_ids", []):
            conn.execute(
                update(RECON)
                .where(RECON.c.id == record.id)
                .values(
                    detail=RECON.c.detail.op("||")(
                        literal_json({"outbox_ids": [*record.detail.get("outbox_ids", []), row.id]})
                    )
                )
            )
        self._append_outbox_event(
            conn,
            op,
            EventKind.OUTBOX_DEAD_LETTERED,
            {**about, "attempts": attempts, "error": error, "reconciliation_id": record.id},
        )

    @staticmethod
    def _append_outbox_event(
        conn: Connection, op: Operation, kind: EventKind, detail: dict[str, Any]
    ) -> None:
        seq = conn.execute(
            update(OP).where(OP.c.id == op.id).values(event_seq=OP.c.event_seq + 1).returning(OP.c.event_seq)
        ).scalar_one()
        append_event(conn, op, seq=seq, kind=kind, from_state=op.state.value, detail=detail)

    def ready_outbox_count(self) -> int:
        with self._tx() as conn:
            return int(conn.execute(select(func.count()).where(OUTBOX.c.status == "ready")).scalar_one())

    def outbox_for(self, op_id: uuid.UUID) -> list[OutboxRow]:
        """The operation's outbox rows, oldest first (``longcall status``)."""
        with self._tx() as conn:
            rows = conn.execute(select(*_SHOWN).where(OUTBOX.c.op_id == op_id).order_by(OUTBOX.c.id)).all()
        return [OutboxRow.from_row(r) for r in rows]

    def resend_outbox(self, outbox_id: int, *, actor: str, evidence: str) -> OutboxResend:
        """An operator puts a dead-lettered row back to ready, its attempts reset (the next drain sends it),
        with an ``outbox_resent`` event naming who and why; once none of the operation's rows is dead, its
        open OUTBOX_UNDELIVERABLE record is resolved. A row that is not dead is left as it is (``found``
        says what it is)."""
        with self._tx() as conn:
            row = conn.execute(
                select(OUTBOX.c.id, OUTBOX.c.op_id, OUTBOX.c.status, OUTBOX.c.attempts, OUTBOX.c.last_error)
                .where(OUTBOX.c.id == outbox_id)
                .with_for_update()
            ).first()
            if row is None:
                return OutboxResend(outbox_id, None)
            if row.status != "dead":
                return OutboxResend(outbox_id, row.status, row.op_id)
            conn.execute(
                update(OUTBOX)
                .where(OUTBOX.c.id == outbox_id)
                .values(status="ready", attempts=0, last_error=None, next_attempt_at=None)
            )
            op = Operation.from_row(
                conn.execute(select(*operation_columns(False)).where(OP.c.id == row.op_id)).one(),
                with_body=False,
            )
            still_dead = conn.execute(
                select(func.count()).where(OUTBOX.c.op_id == row.op_id, OUTBOX.c.status == "dead")
            ).scalar_one()
            records = conn.execute(
                select(RECON.c.id, RECON.c.detail)
                .where(
                    RECON.c.op_id == row.op_id,
                    RECON.c.reason == UNDELIVERABLE.value,
                    RECON.c.resolved_at.is_(None),
                )
                .with_for_update()
            ).all()
            resolved: list[int] = []
            for record in records:
                left = [i for i in (record.detail or {}).get("outbox_ids", []) if i != outbox_id]
                detail = RECON.c.detail.op("||")(literal_json({"outbox_ids": left}))
                values: dict[str, Any] = {"detail": detail}
                if not still_dead:
                    values |= {"resolved_at": func.now(), "resolution": f"resent by {actor}: {evidence}"}
                    resolved.append(record.id)
                conn.execute(update(RECON).where(RECON.c.id == record.id).values(values))
            self._append_outbox_event(
                conn,
                op,
                EventKind.OUTBOX_RESENT,
                {
                    "outbox_id": outbox_id,
                    "actor": actor,
                    "evidence": evidence,
                    "attempts": row.attempts,
                    "last_error": row.last_error,
                    "resolved": resolved,
                },
            )
        return OutboxResend(outbox_id, "dead", row.op_id, tuple(resolved))
