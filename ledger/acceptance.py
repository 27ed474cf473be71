"""The single acceptance point (rule 8): the guarded statement that matches every piece of evidence against
the row and inserts the receipt, the ready outbox row and its event after it, all in one transaction; or what
a refused acceptance records. Beside ``ledger/evidence.py`` (what the evidence must be, pure) and rendered
for PostgreSQL in docs/ledger-sql.md. ``Ledger`` inherits :class:`Acceptances`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import and_, bindparam, func, insert, literal, or_, select, update

from ledger.control import read_control
from ledger.digests import digest
from ledger.errors import OperationNotFound, UnstorableResult
from ledger.evidence import (
    EVIDENCE_FIELDS,
    evidence_problems,
    receipt_payload,
    row_mismatches,
    same_receipt,
)
from ledger.guarded import GuardedWrites
from ledger.reasons import ReconciliationReason
from ledger.records import Acceptance, Operation, Receipt, TerminalEvidence
from ledger.shadow import compare_on_receipt
from ledger.side_rows import open_reconciliation, record_stale
from ledger.statements import (
    EVENT,
    EVENT_COLUMNS,
    OP,
    OUTBOX,
    RECEIPT,
    STATEMENTS,
    current_epoch,
    owner_allows,
)
from ledger.states import ACCEPT_FROM, ACCEPT_TO, OpState, TerminalKind


class Acceptances(GuardedWrites):
    """The acceptance's transaction; ``Ledger`` inherits it."""

    #: How long an operator has for a record the acceptance opens itself (a late completion after an
    #: accepted cancel); set by ``Ledger``.
    reconcile_deadline: dt.timedelta

    def accept_terminal(self, op_id: uuid.UUID, evidence: TerminalEvidence) -> Acceptance:
        """The single acceptance point (rule 8): one transaction, receipt + ready outbox row + state + event.

        The row is matched on call node, request digest, remote id, tool descriptor version, execution epoch,
        cancel generation, the observed terminal state and the result digest; anything that does not match
        writes no receipt. The digest must be the stored result's (see :meth:`as_stored`): a result that
        digests differently once stored raises :class:`UnstorableResult` and is rolled back. A completion
        offered for an operation whose cancel was already accepted opens an EFFECT_RECONCILIATION_REQUIRED
        record instead (rule 6).
        """
        kind = TerminalKind(evidence.terminal_state)
        mismatches = evidence_problems(evidence)
        with self._tx() as conn:
            row = None
            if not mismatches:
                row = conn.execute(
                    STATEMENTS.get(accept_update, kind),
                    {
                        "fence_id": op_id,
                        **{f"ev_{f.name}": getattr(evidence, f.name) for f in EVIDENCE_FIELDS},
                        "ev_executor": self.executor_id,
                        "new_result": evidence.result if kind is not TerminalKind.CANCELLED else None,
                        "new_result_digest": evidence.result_digest,
                        "receipt_id": uuid.uuid4(),
                        "receipt_audit": evidence.audit,
                    },
                ).first()
            if row is not None:
                # The receipt went in with the move; the ready outbox row and the event go in together next.
                op = Operation.from_row(row)
                if op.result is not None and digest(op.result) != evidence.result_digest:
                    # Rolled back: a digest taken over another value than the one stored (see as_stored).
                    raise UnstorableResult(
                        f"the result as stored digests to {digest(op.result)}, not {evidence.result_digest}"
                    )
                receipt = Receipt.from_row(row, prefix="receipt_")
                outbox_id = conn.execute(
                    STATEMENTS.get(insert_terminal_outbox),
                    {
                        "queued_receipt_id": receipt.id,
                        "queued_op_id": op.id,
                        "queued_payload": {
                            "signature": op.on_terminal,
                            "receipt": receipt_payload(receipt, op.result),
                        },
                        "event_seq": op.event_seq,
                        "event_from_state": row.prior_state,
                        "event_to_state": op.state.value,
                        "event_server_state": op.server_state,
                        "event_poll_cursor": op.poll_cursor,
                        "event_cancel_generation": op.cancel_generation,
                        "event_execution_epoch": op.execution_epoch,
                        "event_detail": {
                            "receipt_id": str(receipt.id),
                            "terminal_state": kind.value,
                            "result_digest": evidence.result_digest,
                        },
                    },
                ).scalar_one()
                if op.routing == "shadow":
                    # Compared with the caller's legacy outcome in this transaction (ledger/shadow.py).
                    compare_on_receipt(conn, op.call_node_id, receipt)
                return Acceptance("accepted", receipt, outbox_id)

            current = conn.execute(select(OP).where(OP.c.id == op_id)).first()
            if current is None:
                raise OperationNotFound(op_id)
            op = Operation.from_row(current)
            existing = conn.execute(select(RECEIPT).where(RECEIPT.c.op_id == op_id)).first()
            held = Receipt.from_row(existing) if existing is not None else None
            if (
                held is not None
                and held.terminal_state is TerminalKind.CANCELLED
                and kind is not TerminalKind.CANCELLED
            ):
                open_reconciliation(
                    conn,
                    op,
                    ReconciliationReason.EFFECT_RECONCILIATION_REQUIRED,
                    deadline=self.reconcile_deadline,
                    detail={
                        "cancelled_receipt_id": str(held.id),
                        "late_terminal_state": kind.value,
                        "late_result_digest": evidence.result_digest,
                    },
                )
                return Acceptance("effect_reconciliation", held)
            if held is not None and not mismatches and same_receipt(held, evidence):
                return Acceptance("already_accepted", held)
            problems = mismatches or row_mismatches(op, evidence, kind)
            if not problems and not read_control(conn).owned_by(self.executor_id):
                problems = ["epoch_owner"]  # this fleet does not own the epoch (rule 13)
            record_stale(
                conn,
                op_id,
                attempted="accept_terminal",
                to_state=ACCEPT_TO[kind],
                expected={
                    "state": sorted(s.value for s in ACCEPT_FROM[kind]),
                    "execution_epoch": evidence.execution_epoch,
                    "cancel_generation": evidence.cancel_generation,
                },
                detail={"mismatches": list(problems), "terminal_state": kind.value},
            )
            return Acceptance("rejected", held, mismatches=tuple(problems))


def accept_update(kind: TerminalKind) -> Any:
    """Rule 8's one guarded statement: every piece of evidence in the guard (``ev_*``); the receipt
    (``receipt_id``, ``receipt_audit``) is inserted from the accepted row by the same statement, and returned
    with it as ``receipt_*`` columns. Nothing accepted, no receipt."""
    observed_ok = OP.c.observed_terminal == kind.value
    if kind is TerminalKind.CANCELLED:
        observed_ok = or_(
            observed_ok,
            OP.c.state == OpState.CANCEL_REQUESTED.value,
            # A cancel requested before any create was attempted: nothing ever ran on the server.
            and_(
                OP.c.state == OpState.SUBMITTING.value,
                OP.c.submit_attempted_at.is_(None),
                OP.c.cancel_generation > 0,
            ),
        )
    prior = select(OP.c.id, OP.c.state).where(OP.c.id == bindparam("fence_id")).with_for_update().cte("prior")
    moved = (
        update(OP)
        .where(
            OP.c.id == prior.c.id,
            OP.c.state.in_([s.value for s in ACCEPT_FROM[kind]]),
            *evidence_guard(),
            observed_ok,
        )
        .values(
            state=ACCEPT_TO[kind].value,
            observed_terminal=kind.value,
            result=bindparam("new_result", type_=OP.c.result.type),
            result_digest=bindparam("new_result_digest", type_=OP.c.result_digest.type),
            next_poll_at=None,
            lease_until=None,
            event_seq=OP.c.event_seq + 1,
            updated_at=func.now(),
        )
        .returning(*OP.c, prior.c.state.label("prior_state"))
        .cte("moved")
    )
    receipt = (
        insert(RECEIPT)
        .from_select(
            ["id", "op_id", *(f.name for f in EVIDENCE_FIELDS), "terminal_state", "result_digest", "audit"],
            select(
                bindparam("receipt_id", type_=RECEIPT.c.id.type),
                moved.c.id,
                *(moved.c[f.name] for f in EVIDENCE_FIELDS),
                literal(kind.value, type_=RECEIPT.c.terminal_state.type),
                moved.c.result_digest,
                bindparam("receipt_audit", type_=RECEIPT.c.audit.type),
            ),
        )
        .returning(*RECEIPT.c)
        .cte("receipt")
    )
    return select(moved, *(column.label(f"receipt_{column.name}") for column in receipt.c)).select_from(
        moved.join(receipt, receipt.c.op_id == moved.c.id)
    )


def evidence_guard() -> list[Any]:
    """Each of :data:`~ledger.evidence.EVIDENCE_FIELDS` matched against the row (``:ev_<name>``); the epoch
    also against the control row's as the statement reads it, and the epoch's owner against ``:ev_executor``
    (rule 13: every acceptance is made under a claim)."""
    guard: list[Any] = []
    for field in EVIDENCE_FIELDS:
        column = OP.c[field.name]
        if field.nullable:
            guard.append(column.is_not_distinct_from(bindparam(f"ev_{field.name}", type_=column.type)))
        else:
            guard.append(column == bindparam(f"ev_{field.name}"))
        if field.name == "execution_epoch":
            guard += [OP.c.execution_epoch == current_epoch(), owner_allows("ev_executor")]
    return guard


def insert_terminal_outbox() -> Any:
    """The accepted operation's ready outbox row (``queued_*``) and its ``terminal_accepted`` event
    (``event_*``), whose detail names the new outbox id; the statement returns that id."""
    queued = (
        insert(OUTBOX)
        .values(
            kind="terminal",
            receipt_id=bindparam("queued_receipt_id", type_=OUTBOX.c.receipt_id.type),
            op_id=bindparam("queued_op_id", type_=OUTBOX.c.op_id.type),
            payload=bindparam("queued_payload", type_=OUTBOX.c.payload.type),
        )
        .returning(OUTBOX.c.id)
        .cte("queued")
    )
    detail = bindparam("event_detail", type_=EVENT.c.detail.type).op("||")(
        func.jsonb_build_object(literal("outbox_id"), queued.c.id)
    )
    row = select(
        bindparam("queued_op_id", type_=EVENT.c.op_id.type),
        bindparam("event_seq", type_=EVENT.c.seq.type),
        literal("terminal_accepted", type_=EVENT.c.kind.type),
        bindparam("event_from_state", type_=EVENT.c.from_state.type),
        bindparam("event_to_state", type_=EVENT.c.to_state.type),
        bindparam("event_server_state", type_=EVENT.c.server_state.type),
        bindparam("event_poll_cursor", type_=EVENT.c.poll_cursor.type),
        bindparam("event_cancel_generation", type_=EVENT.c.cancel_generation.type),
        bindparam("event_execution_epoch", type_=EVENT.c.execution_epoch.type),
        detail,
    ).select_from(queued)
    appended = insert(EVENT).from_select(EVENT_COLUMNS, row).returning(EVENT.c.seq).cte("appended")
    return select(queued.c.id).add_cte(appended)
