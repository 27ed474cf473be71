"""The guarded moves that carry an intent from outside the fleet: a cancel (rule 6), an answer to the
approval gate (rule 10), an operator's decision (rule 11). The same contract as ``ledger/moves.py``: one
guarded statement with its own event rows and side rows, one transaction each; ``Ledger`` inherits them.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from ledger.events import EventKind
from ledger.guarded import GuardedWrite, GuardedWrites
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, NewReconciliation, Operation, ServerStatus, due_in
from ledger.states import CANCEL_WAITS_IN, IllegalTransition, OpState, TerminalKind

S = OpState


class IntentMoves(GuardedWrites):
    """Cancel, input and operator moves; ``Ledger`` inherits them beside
    :class:`~ledger.moves.OperationMoves`."""

    # ------------------------------------------------------------------------------------- cancel (6)

    def request_cancel(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        from_state: OpState | tuple[OpState, ...],
        due_in_s: float = 0.0,
        resolution: str | None = None,
    ) -> Operation:
        """-> CANCEL_REQUESTED with the cancel generation bumped, so every writer of the old generation is
        fenced off; the cancel is due in ``due_in_s`` (at once by default) under a fresh claim: the lease goes
        too. ``from_state`` may name several states (WORKING and INPUT_REQUIRED: a poll moving the row between
        them does not refuse the cancel). ``resolution`` closes open records (a cancel of an operation an
        operator holds under a known remote id). Event ``cancel_requested``."""
        write = GuardedWrite(
            from_state if isinstance(from_state, tuple) else (from_state,),
            S.CANCEL_REQUESTED,
            EventKind.CANCEL_REQUESTED,
            {"generation": fence.cancel_generation + 1},
            {"next_poll_at": due_in(due_in_s), "lease_until": None},
            bump_generation=True,
            resolution=resolution,
        )
        return self._write(op_id, fence, write)

    def record_cancel_intent(self, op_id: uuid.UUID, fence: Fence, *, from_state: OpState) -> Operation:
        """Same state (one of ``CANCEL_WAITS_IN``), the cancel generation bumped: a cancel was requested and
        no remote operation is known to send it to yet (rule 6). The intent is the generation: the create's
        answer, a lookup that finds the operation or an operator who does, goes on to CANCEL_REQUESTED; a
        proof of "never created" ends the operation cancelled without a create. Lease and due time stay (a
        create may be in flight). Event ``cancel_requested``."""
        if from_state not in CANCEL_WAITS_IN:
            raise IllegalTransition(
                f"a cancel intent waits in {sorted(CANCEL_WAITS_IN)}, not in {from_state}"
            )
        write = GuardedWrite(
            (from_state,),
            None,
            EventKind.CANCEL_REQUESTED,
            {"generation": fence.cancel_generation + 1, "waits_for": "a remote operation to cancel"},
            bump_generation=True,
        )
        return self._write(op_id, fence, write)

    # -------------------------------------------------------------------------------------- input (10)

    def ask_for_input(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        from_state: OpState,
        input_round: int,
        request_json: Mapping[str, Any],
        schema_digest: str,
        deadline: dt.datetime,
        status: ServerStatus,
        gate_payload: Mapping[str, Any],
    ) -> Operation:
        """-> INPUT_REQUIRED for round ``input_round``, not polled until answered, and the approval gate's
        ``input_required`` outbox row (``gate_payload``) in the same transaction. ``request_json`` is the
        adapter's stored request (its ``method`` is named in the event). Event ``input_required``."""
        sets = {
            **status.columns(),
            "input_round": input_round,
            "input_request": dict(request_json),
            "input_schema_digest": schema_digest,
            "input_deadline": deadline,
            "lease_until": None,
        }
        write = GuardedWrite(
            (from_state,),
            S.INPUT_REQUIRED,
            EventKind.INPUT_REQUIRED,
            {"input_round": input_round, "method": request_json.get("method")},
            sets,
            input_outbox=gate_payload,
        )
        return self._write(op_id, fence, write)

    def record_input_reply(
        self, op_id: uuid.UUID, fence: Fence, *, input_round: int, action: str | None
    ) -> Operation:
        """INPUT_REQUIRED -> WORKING, polled at once, for the current round only (``input_round`` is in the
        guard): the reply is about to be sent. Event ``input_provided``."""
        write = GuardedWrite(
            (S.INPUT_REQUIRED,),
            S.WORKING,
            EventKind.INPUT_PROVIDED,
            {"input_round": input_round, "action": action},
            # The round's deadline is met; in WORKING the column bounds an unreadable request only.
            {"next_poll_at": due_in(0), "input_deadline": None},
            input_round=input_round,
        )
        return self._write(op_id, fence, write)

    def record_input_reply_failed(
        self, op_id: uuid.UUID, fence: Fence, *, input_round: int, answered: Mapping[str, Any], error: str
    ) -> Operation:
        """WORKING stays: the reply to round ``input_round`` was not delivered, so the same question seen
        again opens a new round (``answered`` is the stored request, now marked ``reply_failed``). Event
        ``input_reply_failed``."""
        write = GuardedWrite(
            (S.WORKING,),
            None,
            EventKind.INPUT_REPLY_FAILED,
            {"input_round": input_round, "error": error},
            {"input_request": {**answered, "reply_failed": True}},
            input_round=input_round,
        )
        return self._write(op_id, fence, write)

    def wait_for_input_request(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        status: ServerStatus,
        read_by: dt.datetime | None,
        next_poll_in_s: float,
    ) -> Operation:
        """WORKING stays. ``read_by`` set: the server waits for input whose request could not be read; it
        must be read by then (kept in ``input_deadline``), else an operator decides (rule 10). Event
        ``input_unreadable``. ``read_by`` None: that wait is over (the server moved on). Event ``polled``."""
        sets = {
            **status.columns(),
            "input_deadline": read_by,
            "next_poll_at": due_in(next_poll_in_s),
            "lease_until": None,
        }
        event = EventKind.INPUT_UNREADABLE if read_by is not None else EventKind.POLLED
        detail = {"server_state": status.server_state}
        if read_by is not None:
            detail["read_by"] = read_by.isoformat()
        return self._write(op_id, fence, GuardedWrite((S.WORKING,), None, event, detail, sets))

    # --------------------------------------------------------------------------------- operators (11)

    def hand_to_operator(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        from_state: OpState,
        reason: ReconciliationReason,
        detail: Mapping[str, Any],
        deadline_s: float,
    ) -> Operation:
        """-> MANUAL_RECONCILIATION, no longer polled, with a reconciliation record for ``reason`` due within
        ``deadline_s`` in the same transaction. Event ``manual_reconciliation``."""
        write = GuardedWrite(
            (from_state,),
            S.MANUAL_RECONCILIATION,
            EventKind.MANUAL_RECONCILIATION,
            {"reason": reason.value, **detail},
            {"next_poll_at": None, "lease_until": None},
            reconcile=NewReconciliation(reason, dt.timedelta(seconds=deadline_s), detail),
            after_intent="tolerate",
        )
        return self._write(op_id, fence, write)

    def resolve_found(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        remote_id: str,
        session_ref: str | None,
        detail: Mapping[str, Any],
        resolution: str,
        cancel_above: int | None = None,
    ) -> Operation:
        """MANUAL_RECONCILIATION -> WORKING, polled at once: the operator found it alive as ``remote_id``.
        Open records close with ``resolution``. Event ``resolved_found``. When the row's cancel generation is
        above ``cancel_above`` (by default the fence's: a cancel requested while the operator decided; 0: any
        cancel ever requested), -> CANCEL_REQUESTED instead, due at once: the cancel is sent (rule 6)."""
        sets = {
            "remote_id": remote_id,
            "session_ref": session_ref,
            "next_poll_at": due_in(0),
            "input_deadline": None,  # an input request still unreadable gets a fresh bound
        }
        write = GuardedWrite(
            (S.MANUAL_RECONCILIATION,),
            S.WORKING,
            EventKind.RESOLVED_FOUND,
            detail,
            sets,
            resolution=resolution,
            after_intent="route",
            route_above=fence.cancel_generation if cancel_above is None else cancel_above,
        )
        return self._write(op_id, fence, write)

    def resolve_terminal(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        remote_id: str | None,
        kind: TerminalKind,
        detail: Mapping[str, Any],
        resolution: str,
    ) -> Operation:
        """MANUAL_RECONCILIATION -> TERMINAL_OBSERVED, fetched at once: the operator found it ended as
        ``kind``. Open records close with ``resolution``. Event ``resolved_terminal``."""
        sets = {
            "remote_id": remote_id,
            "observed_terminal": kind.value,
            "server_state": None,
            "next_poll_at": due_in(0),
        }
        write = GuardedWrite(
            (S.MANUAL_RECONCILIATION,),
            S.TERMINAL_OBSERVED,
            EventKind.RESOLVED_TERMINAL,
            {**detail, "terminal": kind.value},
            sets,
            resolution=resolution,
            after_intent="tolerate",
        )
        return self._write(op_id, fence, write)
