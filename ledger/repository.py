"""The only port to the ledger database. Every public method of ``Ledger`` is one transaction.

``Ledger`` holds the reads, the claims and the reconciliation records; it inherits the rest, one room per
subject: the submission (rule 1) from ``ledger/submissions.py``, the single acceptance point (rule 8) from
``ledger/acceptance.py``, the guarded moves of an operation, each named for what it does, from
:class:`ledger.moves.OperationMoves` and :class:`ledger.intent_moves.IntentMoves`, the executor control
transactions from ``ledger/control.py``, the outbox's (its drain, dead letters and resends) from
``ledger/outbox.py``. The SQL is in ``ledger/statements.py`` (tables, reads, the outbox),
``ledger/write_statements.py`` (the guarded write, the submission's insert) and ``ledger/claim_statements.py``
(the claims), rendered in docs/ledger-sql.md; the records are in ``ledger/records.py``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from sqlalchemy import Connection, Engine, func, select, text, update
from sqlalchemy.exc import DBAPIError

from ledger.acceptance import Acceptances
from ledger.claim_statements import (
    update_claim_due,
    update_claim_due_by_server,
    update_claim_one,
    update_release_claims,
)
from ledger.control import ExecutorControlTransactions
from ledger.engine import make_engine
from ledger.errors import OperationNotFound
from ledger.events import EventKind
from ledger.intent_moves import IntentMoves
from ledger.listing import OperationListing
from ledger.moves import RECORD_LOCK_WAIT, OperationMoves
from ledger.outbox import OutboxTransactions
from ledger.reasons import ReconciliationReason
from ledger.records import Claim, Operation, Receipt, ReconciliationRecord, UnchangedPoll, adapter_key
from ledger.results import ResultStorage
from ledger.retention import HistoryRetention
from ledger.shadow import ShadowComparisons
from ledger.side_rows import append_event, open_reconciliation
from ledger.statements import (
    EVENT,
    OP,
    RECEIPT,
    RECON,
    STATEMENTS,
    literal_json,
    select_operation_by_id,
    select_operations_by_ids,
)
from ledger.states import FINAL_STATES, OpState
from ledger.submissions import Submissions

#: The seed's gate: what no rule can decide is resolved by an operator within 15 minutes.
DEFAULT_RECONCILE_DEADLINE_S = 900.0


class Ledger(
    Submissions,
    OperationListing,
    Acceptances,
    OperationMoves,
    IntentMoves,
    ExecutorControlTransactions,
    HistoryRetention,
    OutboxTransactions,
    ResultStorage,
    ShadowComparisons,
):
    """The repository. Construct it with an engine; every method owns exactly one transaction.

    ``reconcile_deadline_s`` is how long an operator has for a record the ledger opens itself (a late
    completion after an accepted cancel); the seed's gate by default.

    ``executor_id`` is the identity of the fleet this ledger works for (``LONGCALL_EXECUTOR_ID``, rule 13):
    once a rollback names another owner of the epoch, its claims take nothing and its writes under a claim
    are refused. None (the default: an operator's command, a test, an embedding): any owner, never fenced.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        reconcile_deadline_s: float = DEFAULT_RECONCILE_DEADLINE_S,
        executor_id: str | None = None,
    ) -> None:
        self.engine = engine
        self.reconcile_deadline = dt.timedelta(seconds=reconcile_deadline_s)
        self.executor_id = executor_id

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        pool_size: int = 5,
        reconcile_deadline_s: float = DEFAULT_RECONCILE_DEADLINE_S,
        executor_id: str | None = None,
    ) -> Ledger:
        return cls(
            make_engine(url, pool_size=pool_size),
            reconcile_deadline_s=reconcile_deadline_s,
            executor_id=executor_id,
        )

    def dispose(self) -> None:
        self.engine.dispose()

    # record_submission: ledger/submissions.py

    # ------------------------------------------------------------------------------------------- reads

    def get(self, op_id: uuid.UUID, *, with_body: bool = True) -> Operation:
        """The operation's row; ``with_body=False`` reads all of it but the arguments (``body`` is then
        ``BODY_NOT_READ``): what a step that never sends them reads."""
        with self._one_statement() as conn:
            row = conn.execute(STATEMENTS.get(select_operation_by_id, with_body), {"op_id": op_id}).first()
        if row is None:
            raise OperationNotFound(op_id)
        # The control row's epoch and owner came with it: what owns_epoch(max_age_s=...) answers from.
        self._saw_ownership(row.control_epoch, row.control_epoch_owner)
        return Operation.from_row(row, with_body=with_body)

    def get_many(self, op_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Operation]:
        """The rows of ``op_ids`` that exist, read without the arguments, by id, in one statement (a batch of
        polls' read: one per batch, not one per member)."""
        if not op_ids:
            return {}
        with self._one_statement() as conn:
            return self._read_many(conn, op_ids)

    def _read_many(self, conn: Connection, op_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Operation]:
        """:meth:`get_many`'s statement on ``conn``, the epoch's owner noted as the rows saw it."""
        rows = conn.execute(STATEMENTS.get(select_operations_by_ids), {"op_ids": list(op_ids)}).all()
        if rows:
            self._saw_ownership(rows[0].control_epoch, rows[0].control_epoch_owner)
        return {op.id: op for op in Operation.from_rows(rows, with_body=False)}

    def record_then_read(
        self, unchanged: Sequence[UnchangedPoll], op_ids: Sequence[uuid.UUID]
    ) -> tuple[set[uuid.UUID] | DBAPIError, dict[uuid.UUID, Operation]]:
        """:meth:`record_unchanged_polls` of ``unchanged`` (the process's earlier batches'), then
        :meth:`get_many` of ``op_ids`` (the next batch's), in one transaction: the operations whose record
        was written, and the rows read. One commit where the two would make two: a worker process taking
        batches one after another records each one's unchanged polls on the next one's read.

        The record waits at most :data:`RECORD_LOCK_WAIT` for a row another transaction holds (a takeover's
        update of every row, say). When it fails so, the rows are read alone and the record's error is
        answered in place of the ids: the earlier batches' claims then run out, and this batch is not held
        up by them. A failure of the read itself is raised."""
        if not unchanged:
            return set(), self.get_many(op_ids)
        params = self._unchanged_params(unchanged)
        try:
            with self._tx() as conn:
                conn.execute(text(f"SET LOCAL lock_timeout = '{RECORD_LOCK_WAIT}'"))
                written = self._record_unchanged(conn, params)
                return written, self._read_many(conn, op_ids)
        except DBAPIError as exc:
            return exc, self.get_many(op_ids)

    def find_by_call_node(self, call_node_id: str) -> Operation | None:
        with self._tx() as conn:
            return self._find_by_call_node(conn, call_node_id)

    def find_by_remote(self, server: str, remote_id: str) -> Operation | None:
        with self._tx() as conn:
            row = conn.execute(select(OP).where(OP.c.server == server, OP.c.remote_id == remote_id)).first()
        return Operation.from_row(row) if row is not None else None

    def find_by_submission_key(self, submission_key: uuid.UUID) -> Operation | None:
        with self._tx() as conn:
            row = conn.execute(select(OP).where(OP.c.submission_key == submission_key)).first()
        return Operation.from_row(row) if row is not None else None

    def events(self, op_id: uuid.UUID) -> list[dict[str, Any]]:
        with self._tx() as conn:
            rows = conn.execute(select(EVENT).where(EVENT.c.op_id == op_id).order_by(EVENT.c.seq)).all()
        return [dict(r._mapping) for r in rows]

    def create_attempt_cursor(self, op_id: uuid.UUID) -> int | None:
        """The poll cursor of the claim that recorded the operation's last create attempt (its
        ``create_attempted`` event); None when none was recorded."""
        with self._tx() as conn:
            cursor = conn.execute(
                select(EVENT.c.poll_cursor)
                .where(EVENT.c.op_id == op_id, EVENT.c.kind == EventKind.CREATE_ATTEMPTED.value)
                .order_by(EVENT.c.seq.desc())
                .limit(1)
            ).scalar()
        return None if cursor is None else int(cursor)

    def receipt_for(self, op_id: uuid.UUID) -> Receipt | None:
        with self._tx() as conn:
            row = conn.execute(select(RECEIPT).where(RECEIPT.c.op_id == op_id)).first()
        return Receipt.from_row(row) if row is not None else None

    # ----------------------------------------------------------------------------------------- polling

    def claim_due(
        self,
        *,
        limit: int,
        lease_s: float,
        epoch: int | None = None,
        server: str | None = None,
        horizon_s: float = 0.0,
    ) -> list[Claim]:
        """Claim up to ``limit`` due operations (SKIP LOCKED), lease them and bump their poll cursor.

        A claim is not a transition; the step's outcome, written under the returned cursor, is. A lease that
        ran out (a crashed worker) makes the row claimable again, under a new cursor, so the crashed worker's
        late answer is fenced off. With ``epoch``, a row of an older execution epoch is taken over by it
        (rule 13): its old-epoch writers are refused from then on. With ``server``, only that server's rows.
        ``horizon_s`` also claims rows due within that many seconds; each claim says how long until it is
        due (``delay_s``), so a dispatcher that ticks every ``horizon_s`` can send each step on time. A fleet
        that does not own the epoch (rule 13: ``executor_id``) claims nothing, and locks nothing.
        """
        if limit <= 0:
            return []
        with_server, with_epoch = server is not None, epoch is not None
        with self._tx() as conn:
            rows = conn.execute(
                STATEMENTS.get(update_claim_due, with_server, with_epoch),
                {
                    "claim_horizon": dt.timedelta(seconds=horizon_s),
                    "claim_server": server,
                    "claim_limit": limit,
                    "claim_lease": dt.timedelta(seconds=lease_s),
                    "claim_epoch": epoch,
                    "claim_executor": self.executor_id,
                },
            ).all()
        return [Claim.from_row(r) for r in rows]

    def claim_due_by_server(
        self,
        rooms: Sequence[tuple[str, int]],
        *,
        limit: int,
        lease_s: float,
        epoch: int | Literal["current"] | None = None,
        horizon_s: float = 0.0,
        default_poll_ms: Mapping[str, int] | None = None,
        control_rooms: Mapping[str, int] | None = None,
    ) -> list[Claim]:
        """:meth:`claim_due` for many servers in one statement and one transaction: each ``(server, room)``
        claims at most ``room`` of that server's due rows (its rows that are not polls first, at most
        ``control_rooms[server]`` of them, by default its whole room: what its control budget hands out in
        a tick; then its polls; each in due order), and all of them together at most
        ``limit`` (issue 13: one claim per tick, not one per configured server), shared by the servers
        (rule 3): every server's first due row before any server's second, the rest in proportion to the
        rooms, servers level on that taken in a rotation that moves on by ``limit`` every tick
        (``ledger.claim_statements.update_claim_due_by_server``). ``epoch="current"`` takes the claimed rows
        over into the control row's epoch as the statement reads it (the dispatcher's tick: no control read
        of its own). With ``default_poll_ms`` (each server's default poll interval), the claim also sets each
        WORKING row's next poll ahead (``ledger.claim_statements.next_poll_ahead``): a poll that changes
        nothing then writes only its count (:meth:`record_unchanged_polls`)."""
        rooms = [(server, room) for server, room in rooms if room > 0]
        if limit <= 0 or not rooms:
            return []
        with self._one_statement() as conn:
            rows = conn.execute(
                STATEMENTS.get(
                    update_claim_due_by_server,
                    "current" if epoch == "current" else epoch is not None,
                    default_poll_ms is not None,
                ),
                {
                    "claim_servers": [server for server, _ in rooms],
                    "claim_rooms": [room for _, room in rooms],
                    "claim_control_rooms": [
                        min(room, (control_rooms or {}).get(server, room)) for server, room in rooms
                    ],
                    "claim_horizon": dt.timedelta(seconds=horizon_s),
                    "claim_limit": limit,
                    "claim_lease": dt.timedelta(seconds=lease_s),
                    "claim_epoch": None if epoch == "current" else epoch,
                    "claim_executor": self.executor_id,
                    "claim_default_poll_ms": [(default_poll_ms or {}).get(server, 0) for server, _ in rooms],
                },
            ).all()
        return [Claim.from_row(r) for r in rows]

    def claim(
        self,
        op_id: uuid.UUID,
        *,
        lease_s: float,
        epoch: int | None = None,
        cancel_before_create: bool = False,
    ) -> Claim | None:
        """Claim one operation now, whether due or not, unless another worker holds its lease (or this fleet
        does not own the epoch, rule 13: then None, as for a held lease). ``cancel_before_create``: a
        SUBMITTING row with a cancel requested and no create attempt recorded is claimed whatever its lease
        (see ``ledger.claim_statements.update_claim_one``)."""
        with_epoch = epoch is not None
        with self._one_statement() as conn:
            row = conn.execute(
                STATEMENTS.get(update_claim_one, with_epoch, cancel_before_create),
                {
                    "claim_id": op_id,
                    "claim_lease": dt.timedelta(seconds=lease_s),
                    "claim_epoch": epoch,
                    "claim_executor": self.executor_id,
                },
            ).first()
        return Claim.from_row(row) if row is not None else None

    def hand_back_claim(self, op_id: uuid.UUID, poll_cursor: int) -> bool:
        """Let go of the claim ``poll_cursor`` without running its step: its lease is cleared, the row is due
        at once (its claim may have set its next poll an interval on) and no event is appended, so the row
        is the next claim's. What a worker of a fleet that does not own the epoch does with a step message
        of the owner's it took from a shared broker (rule 13): the owner's dispatcher claims the row again
        at its next tick instead of waiting for the lease to run out. The message came at its due time
        (its countdown), so due at once is never sooner than it was. False when the claim is not the row's
        any more."""
        return op_id in self.hand_back_claims([(op_id, poll_cursor, 0.0)])

    def hand_back_claims(
        self, claims: Sequence[tuple[uuid.UUID, int, float]], *, no_token: bool = False
    ) -> set[uuid.UUID]:
        """:meth:`hand_back_claim` for many ``(op_id, poll_cursor, due_in_s)`` in one statement (the polls a
        worker process sheds from a batch), each row due again ``due_in_s`` from now; the ids let go.
        ``no_token``: handed back for want of a token (each row's ``no_token_count`` counts it, no event, as
        ``reschedule`` counts one)."""
        if not claims:
            return set()
        with self._one_statement() as conn:
            rows = conn.execute(
                STATEMENTS.get(update_release_claims),
                {
                    "claim_ids": [op_id for op_id, _, _ in claims],
                    "claim_cursors": [cursor for _, cursor, _ in claims],
                    "claim_due_in_s": [max(0.0, due_in) for _, _, due_in in claims],
                    "claim_no_token": 1 if no_token else 0,
                },
            ).all()
        return {row.id for row in rows}

    # accept_terminal: ledger/acceptance.py

    # ------------------------------------------------------------------------------------------ outbox

    # drain_outbox, ready_outbox_count, outbox_for, resend_outbox: ledger/outbox.py

    # ---------------------------------------------------------------------------------- reconciliation

    def open_reconciliation(
        self,
        op_id: uuid.UUID,
        reason: ReconciliationReason,
        *,
        deadline: dt.timedelta,
        detail: Mapping[str, Any] | None = None,
    ) -> ReconciliationRecord:
        with self._tx() as conn:
            row = conn.execute(select(OP).where(OP.c.id == op_id)).first()
            if row is None:
                raise OperationNotFound(op_id)
            return open_reconciliation(conn, Operation.from_row(row), reason, deadline, detail)

    def resolve_reconciliation(self, record_id: int, *, resolution: str, detail: Mapping[str, Any]) -> bool:
        """Close one open record (e.g. an EFFECT_RECONCILIATION_REQUIRED the operator has dealt with)."""
        with self._tx() as conn:
            return _close_record(conn, record_id, resolution, detail)

    def close_reconciliation(
        self, record_id: int, *, resolution: str, detail: Mapping[str, Any]
    ) -> tuple[Literal["closed", "not_open", "holds_operation"], uuid.UUID | None]:
        """An operator closes one open record as handled, unless it is what holds its operation with an
        operator: the operation's last open record while it is in MANUAL_RECONCILIATION (closing it would
        leave the operation waiting with nothing to say so; the operation is resolved instead, which closes
        its records). Returns what happened and the record's operation. The operation's row is locked
        first, so two operators closing its last two records one each are decided one after the other,
        and a move of the operation waits (or is waited for)."""
        with self._tx() as conn:
            op_id = conn.execute(
                select(RECON.c.op_id).where(RECON.c.id == record_id, RECON.c.resolved_at.is_(None))
            ).scalar_one_or_none()
            if op_id is None:
                return "not_open", None
            state = conn.execute(select(OP.c.state).where(OP.c.id == op_id).with_for_update()).scalar_one()
            others = conn.execute(
                select(func.count()).where(
                    RECON.c.op_id == op_id, RECON.c.resolved_at.is_(None), RECON.c.id != record_id
                )
            ).scalar_one()
            if state == OpState.MANUAL_RECONCILIATION.value and others == 0:
                return "holds_operation", op_id
            closed = _close_record(conn, record_id, resolution, detail)
            return ("closed" if closed else "not_open"), op_id

    def flag_overdue(self, record_id: int) -> None:
        """Mark an open record as reported past its deadline, with an event on its operation."""
        with self._tx() as conn:
            row = conn.execute(
                update(RECON)
                .where(RECON.c.id == record_id, RECON.c.resolved_at.is_(None))
                .values(detail=RECON.c.detail.op("||")(literal_json({"overdue_flagged": True})))
                .returning(RECON.c.op_id, RECON.c.reason)
            ).first()
            if row is None:
                return
            op_row = conn.execute(
                update(OP).where(OP.c.id == row.op_id).values(event_seq=OP.c.event_seq + 1).returning(*OP.c)
            ).one()
            op = Operation.from_row(op_row)
            append_event(
                conn,
                op,
                seq=op.event_seq,
                kind=EventKind.RECONCILIATION_OVERDUE,
                from_state=op.state.value,
                detail={"reconciliation_id": record_id, "reason": row.reason},
            )

    def waiting_for_input(self, *, limit: int = 500) -> list[Operation]:
        """Operations whose server waits for an answer from the approval gate, oldest deadline first."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP)
                .where(OP.c.state == OpState.INPUT_REQUIRED.value)
                .order_by(OP.c.input_deadline)
                .limit(limit)
            ).all()
        return [Operation.from_row(r) for r in rows]

    def unreadable_inputs(self, *, limit: int = 500) -> list[tuple[Operation, ReconciliationRecord | None]]:
        """Operations whose server waits for input whose request could not be read (rule 10): still
        WORKING within the bound kept in ``input_deadline`` (no record yet), or with an operator under an
        open INPUT_UNREADABLE record."""
        unreadable = ReconciliationReason.INPUT_UNREADABLE.value
        with self._tx() as conn:
            waiting = conn.execute(
                select(OP)
                .where(OP.c.state == OpState.WORKING.value, OP.c.input_deadline.is_not(None))
                .order_by(OP.c.input_deadline)
                .limit(limit)
            ).all()
            records = conn.execute(
                select(RECON)
                .where(RECON.c.reason == unreadable, RECON.c.resolved_at.is_(None))
                .order_by(RECON.c.opened_at)
                .limit(limit)
            ).all()
            handed = {
                row.id: Operation.from_row(row)
                for row in conn.execute(select(OP).where(OP.c.id.in_([r.op_id for r in records]))).all()
            }
        found: list[tuple[Operation, ReconciliationRecord | None]] = [
            (Operation.from_row(row), None) for row in waiting
        ]
        for row in records:
            record = ReconciliationRecord.from_row(row)
            found.append((handed[record.op_id], record))
        return found

    def in_flight_by_server(self) -> dict[str, int]:
        """How many operations of each server are not final yet (rule 14: a server the configuration no
        longer names is reported with its count)."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP.c.server, func.count())
                .where(OP.c.state.not_in([s.value for s in FINAL_STATES]))
                .group_by(OP.c.server)
            ).all()
        return {server: int(n) for server, n in rows}

    def unconfigured_in_flight(self, configured: Sequence[str], *, limit: int = 100) -> list[Operation]:
        """Operations not final and not with an operator yet, on a server not in ``configured``, oldest
        first (rule 14: what ``longcall.reconcile`` hands over, each under a claim of its own)."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP)
                .where(
                    OP.c.server.not_in(list(configured)),
                    # IN, not NOT IN: the state index finds the few rows in flight among all the final ones.
                    OP.c.state.in_(
                        [
                            s.value
                            for s in OpState
                            if s not in FINAL_STATES and s is not OpState.MANUAL_RECONCILIATION
                        ]
                    ),
                )
                .order_by(OP.c.created_at)
                .limit(limit)
            ).all()
        return [Operation.from_row(r) for r in rows]

    def in_flight_by_adapter(self) -> dict[str, int]:
        """How many operations of each ``protocol/protocol_version`` are not final yet (rule 14)."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP.c.protocol, OP.c.protocol_version, func.count())
                .where(OP.c.state.not_in([s.value for s in FINAL_STATES]))
                .group_by(OP.c.protocol, OP.c.protocol_version)
            ).all()
        return {adapter_key(p, v): int(n) for p, v, n in rows}

    def overdue_inputs(self, *, limit: int = 100) -> list[Operation]:
        """Operations still waiting for input after their input deadline."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP)
                .where(OP.c.state == OpState.INPUT_REQUIRED.value, OP.c.input_deadline < func.now())
                .order_by(OP.c.input_deadline)
                .limit(limit)
            ).all()
        return [Operation.from_row(r) for r in rows]

    def reconciliations_for(self, op_id: uuid.UUID) -> list[ReconciliationRecord]:
        with self._tx() as conn:
            rows = conn.execute(select(RECON).where(RECON.c.op_id == op_id).order_by(RECON.c.id)).all()
        return [ReconciliationRecord.from_row(r) for r in rows]

    def open_reconciliations(self) -> list[ReconciliationRecord]:
        with self._tx() as conn:
            rows = conn.execute(
                select(RECON).where(RECON.c.resolved_at.is_(None)).order_by(RECON.c.deadline)
            ).all()
        return [ReconciliationRecord.from_row(r) for r in rows]


def _close_record(conn: Connection, record_id: int, resolution: str, detail: Mapping[str, Any]) -> bool:
    """Close one open reconciliation record with ``resolution``, ``detail`` merged into its own; False when
    it is not open."""
    row = conn.execute(
        update(RECON)
        .where(RECON.c.id == record_id, RECON.c.resolved_at.is_(None))
        .values(
            resolved_at=func.now(),
            resolution=resolution,
            detail=RECON.c.detail.op("||")(literal_json(detail)),
        )
        .returning(RECON.c.id)
    ).first()
    return row is not None
