"""The submission (rule 1): a call node's SUBMITTING row, inserted once under the call node's submission lock,
or the call node's existing operation; the canary's admission decided and recorded in the same transaction
(``ledger/routing.py``). ``Ledger`` inherits :class:`Submissions`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, Row, delete, func, literal, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.control import CANARY_PERCENT, ExecutorControlTransactions, read_control
from ledger.errors import AdapterDisabled, AdmissionClosed, CallNodeConflict, CallNodeNotRouted, NotAdmitted
from ledger.events import EventKind
from ledger.records import NewOperation, Operation, Submission, adapter_key
from ledger.routing import RECORDED_DECISION, RecordedDecision, read_decision, record_decision
from ledger.side_rows import append_event
from ledger.statements import CALL_NODE_CANCEL, OP, STATEMENTS, select_operation_by_call_node
from ledger.write_statements import insert_operation


class Submissions(ExecutorControlTransactions):
    """The submission's transaction; ``Ledger`` inherits it."""

    def record_submission(
        self,
        new: NewOperation,
        *,
        lease_s: float | None = None,
        admit: Callable[[Mapping[str, Any]], NewOperation] | None = None,
    ) -> Submission:
        """Insert the SUBMITTING row, or return the call node's existing operation (rule 1).

        Same call node and same request digest is the existing operation, never a second one; the same call
        node with a different digest raises :class:`CallNodeConflict`. The submission key is chosen here,
        once, and never regenerated. The new row is due at once; with ``lease_s`` it is also claimed by the
        caller (cursor 1), so the submitting worker can make the create call itself, and a crash before that
        leaves it to the dispatcher when the lease runs out. A fleet that does not own the epoch (rule 13)
        claims nothing: its submission is recorded unclaimed (cursor 0, no lease), due at once for the
        owner's dispatcher, so a submission the wrong fleet consumed is recorded, never lost, and that fleet
        makes no create.

        ``admit`` (the canary, ``workers/submission.py``) decides a call node that has no operation yet:
        given ``executor_control.rollout`` as this transaction reads it, it returns the operation to insert,
        or raises to insert nothing (the exception propagates; the transaction is rolled back). Every
        submission first takes the call node's submission lock (:func:`lock_submission`), held to its
        commit, and only then reads the rollout and the existing row: two submissions of one call node are
        decided one after the other, and the second sees the first one's row (READ COMMITTED: a statement
        after the lock sees what the lock's previous holder committed). A call node with an operation keeps
        it, whatever the rollout says now.

        While a canary percentage is set, the admission's decision is kept in ``routing_decision``
        (``ledger/routing.py``) in the same transaction, and a later submission of the call node is given
        that record (``rollout["recorded_decision"]``) to answer from, whatever the percentage is now. A
        :class:`~ledger.errors.NotAdmitted` decision is committed with nothing else, then raised.
        """
        not_admitted: NotAdmitted | None = None
        with self._tx() as conn:
            lock_submission(conn, new.call_node_id)
            control = read_control(conn)
            self._saw_ownership(control.execution_epoch, control.epoch_owner)
            if not control.owned_by(self.executor_id):
                lease_s = None  # for the owner's dispatcher (its claim decides; a rollback meanwhile fences)
            refusal: Exception | None = None
            if not control.admission_open:
                refusal = AdmissionClosed()
            elif adapter_key(new.protocol, new.protocol_version) in control.disabled_adapters:
                refusal = AdapterDisabled(new.protocol, new.protocol_version)
            if (
                refusal is None
                and admit is not None
                and self._find_by_call_node(conn, new.call_node_id) is None
            ):
                new, not_admitted = _admit_and_record(conn, new, control.rollout, admit)
            if refusal is None and not_admitted is None:
                # Inserted unless the call node has its operation already (then it is read below): without
                # ``admit``, the usual case, a new call node, costs no read first.
                row = insert_submitted(conn, new, execution_epoch=control.execution_epoch, lease_s=lease_s)
                if row is not None:
                    # The ``submitted`` event went in with the row, in the same statement; a cancel asked
                    # for by call node id before it is taken now, under the same lock.
                    row = take_call_node_cancel(conn, row)
                    return Submission(Operation.from_row(row), created=True)
            if not_admitted is None:
                existing = self._find_by_call_node(conn, new.call_node_id)
                if existing is None:
                    if refusal is not None:
                        raise refusal
                    # The insert conflicted, so the row is committed and can be read.
                    raise LookupError(
                        f"call node {new.call_node_id!r} conflicted but cannot be read"
                    )  # pragma: no cover
                if existing.request_digest != new.request_digest:
                    raise CallNodeConflict(new.call_node_id, existing.request_digest, new.request_digest)
                return Submission(existing, created=False)
        # Committed: the "not routed" decision (and nothing else) is recorded.
        raise not_admitted

    def cancel_call_node(self, call_node_id: str) -> Operation | None:
        """A cancel asked for by call node id: the call node's operation, to record the intent on as for a
        cancel by op id; or, when the call node has none yet, the intent recorded for its first submission
        (``call_node_cancel``), which inserts its row with the intent (:func:`take_call_node_cancel`), and
        None. Under the call node's submission lock: a submission decided at the same moment either comes
        first (its operation is answered here) or finds the intent. Asking twice records it once.

        Raises:
            CallNodeNotRouted: the canary answered the call node "not routed" (its decision is kept): it has
                no operation, and never will; nothing is recorded.
        """
        with self._tx() as conn:
            lock_submission(conn, call_node_id)
            op = self._find_by_call_node(conn, call_node_id)
            if op is None:
                decision = read_decision(conn, call_node_id)
                if decision is not None and not decision.routed:
                    raise CallNodeNotRouted(call_node_id, decision.percent)
                conn.execute(
                    pg_insert(CALL_NODE_CANCEL)
                    .values(call_node_id=call_node_id)
                    .on_conflict_do_nothing(index_elements=[CALL_NODE_CANCEL.c.call_node_id])
                )
            return op

    @staticmethod
    def _find_by_call_node(conn: Connection, call_node_id: str) -> Operation | None:
        row = conn.execute(
            STATEMENTS.get(select_operation_by_call_node), {"call_node_id": call_node_id}
        ).first()
        return Operation.from_row(row) if row is not None else None


def insert_submitted(
    conn: Connection, new: NewOperation, *, execution_epoch: int, lease_s: float | None
) -> Row[Any] | None:
    """Insert the call node's SUBMITTING row and its ``submitted`` event (one statement); None when the
    call node has its operation already. The caller holds the call node's submission lock."""
    return conn.execute(
        STATEMENTS.get(insert_operation),
        {
            "new_id": uuid.uuid4(),
            "new_call_node_id": new.call_node_id,
            "new_request_digest": new.request_digest,
            "new_tool_name": new.tool_name,
            "new_tool_descriptor_version": new.tool_descriptor_version,
            "new_body": new.body,
            "new_server": new.server,
            "new_protocol": new.protocol,
            "new_protocol_version": new.protocol_version,
            "new_adapter_version": new.adapter_version,
            "new_submission_key": uuid.uuid4(),
            "new_ttl_ms": new.ttl_ms,
            # NULL intervals leave NULL deadlines: no wait budget, no lease.
            "new_wait_budget": _interval(new.wait_budget_s),
            "new_execution_epoch": execution_epoch,
            "new_on_terminal": new.on_terminal,
            "new_on_input": new.on_input,
            "new_poll_cursor": 1 if lease_s is not None else 0,
            "new_routing": new.routing,
            "new_lease": _interval(lease_s),
            "event_detail": {"server": new.server},
        },
    ).first()


def take_call_node_cancel(conn: Connection, row: Row[Any]) -> Row[Any]:
    """The SUBMITTING ``row`` just inserted, with the cancel asked for by its call node id before it
    (``Ledger.cancel_call_node``) taken, if there was one: its generation bumped and a ``cancel_requested``
    event written, as ``record_cancel_intent`` records a cancel that waits for a remote operation; no create
    was attempted, so its submit step ends it cancelled without one. The caller holds the call node's
    submission lock, in the transaction that inserted the row."""
    taken = conn.execute(
        delete(CALL_NODE_CANCEL)
        .where(CALL_NODE_CANCEL.c.call_node_id == row.call_node_id)
        .returning(CALL_NODE_CANCEL.c.requested_at)
    ).first()
    if taken is None:
        return row
    moved = conn.execute(
        update(OP)
        .where(OP.c.id == row.id)
        .values(cancel_generation=OP.c.cancel_generation + 1, event_seq=OP.c.event_seq + 1)
        .returning(*OP.c)
    ).one()
    append_event(
        conn,
        Operation.from_row(moved),
        seq=moved.event_seq,
        kind=EventKind.CANCEL_REQUESTED,
        from_state=moved.state,
        detail={
            "generation": moved.cancel_generation,
            "by_call_node_id": True,
            "requested_at": taken.requested_at.isoformat(),
            "waits_for": "nothing: no create was attempted",
        },
    )
    return moved


def _admit_and_record(
    conn: Connection,
    new: NewOperation,
    rollout: Mapping[str, Any],
    admit: Callable[[Mapping[str, Any]], NewOperation],
) -> tuple[NewOperation, NotAdmitted | None]:
    """The admission of a call node that has no operation (under its submission lock): given its recorded
    decision if it has one, else the rollout alone, whose decision is then recorded when a canary
    percentage is set. Returns the operation to insert, or the :class:`NotAdmitted` to raise after the
    commit."""
    recorded = read_decision(conn, new.call_node_id)
    given = dict(rollout) if recorded is None else {**rollout, RECORDED_DECISION: recorded.to_json()}
    set_percent = rollout.get(CANARY_PERCENT)
    percent = (
        set_percent
        if recorded is None and isinstance(set_percent, int | float) and not isinstance(set_percent, bool)
        else None
    )
    try:
        admitted = admit(given)
    except NotAdmitted as exc:
        if percent is not None:
            record_decision(conn, new.call_node_id, RecordedDecision(routed=False, percent=percent))
        return new, exc
    if percent is not None:
        routed = admitted.routing == "live"
        record_decision(conn, new.call_node_id, RecordedDecision(routed=routed, percent=percent))
    return admitted, None


#: The advisory lock key of a call node's submission: hashtextextended(prefix || call_node_id, 0).
SUBMISSION_LOCK_PREFIX = "longcall.submission:"


def lock_submission(conn: Connection, call_node_id: str) -> None:
    """The call node's submission lock, held until the caller's transaction ends (see
    :meth:`Ledger.record_submission`)."""
    key = func.hashtextextended(literal(SUBMISSION_LOCK_PREFIX) + literal(call_node_id), 0)
    conn.execute(select(func.pg_advisory_xact_lock(key)))


def _interval(seconds: float | None) -> dt.timedelta | None:
    return dt.timedelta(seconds=seconds) if seconds is not None else None
