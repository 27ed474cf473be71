"""The guarded moves that carry an intent from outside the fleet: a cancel (rule 6), an answer to the
approval gate (rule 10), an operator's decision (rule 11). The same contract as ``ledger/moves.py``: one
guarded statement with its own event rows and side rows, one transaction each; ``Ledger`` inherits them.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from ledger.digests import digest
from ledger.events import EventKind
from ledger.guarded import GuardedWrite, GuardedWrites
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, NewReconciliation, Operation, ServerStatus, due_after, due_in
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
            "input_reply": None,  # the new round has no reply yet
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
        self, op_id: uuid.UUID, fence: Fence, *, input_round: int, response: Mapping[str, Any]
    ) -> Operation:
        """INPUT_REQUIRED -> WORKING, due at once, for the current round only (``input_round`` is in the
        guard): the reply is stored with its round (``input_reply``, :func:`stored_reply`) before it is
        sent, so a step that finds it not yet taken by the server sends the same reply again (rule 10).
        Event ``input_provided``."""
        write = GuardedWrite(
            (S.INPUT_REQUIRED,),
            S.WORKING,
            EventKind.INPUT_PROVIDED,
            {"input_round": input_round, "action": response.get("action")},
            {
                # The round's deadline is met; in WORKING the column bounds an unreadable request only.
                "next_poll_at": due_in(0),
                "input_deadline": None,
                "input_reply": stored_reply(input_round, response),
            },
            input_round=input_round,
        )
        return self._write(op_id, fence, write)

    def record_input_reply_sent(
        self, op_id: uuid.UUID, fence: Fence, *, reply: Mapping[str, Any]
    ) -> Operation:
        """WORKING stays, polled at once, its claim let go: the server took the stored ``reply`` of the
        current round (its POST answered). Event ``input_reply_sent``."""
        round_ = int(reply["input_round"])
        sent = {
            **reply,
            "sent_at": dt.datetime.now(dt.UTC).isoformat(),
            "attempts": int(reply["attempts"]) + 1,
        }
        write = GuardedWrite(
            (S.WORKING,),
            None,
            EventKind.INPUT_REPLY_SENT,
            {"input_round": round_, "attempts": sent["attempts"]},
            {"input_reply": sent, "next_poll_at": due_in(0), "lease_until": None},
            input_round=round_,
            returns_body=False,
        )
        return self._write(op_id, fence, write)

    def record_input_reply_failed(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        reply: Mapping[str, Any],
        error: str,
        answered: Mapping[str, Any] | None = None,
        retry_in_s: float | None = None,
    ) -> Operation:
        """WORKING stays: the stored ``reply`` to its round was not delivered (event ``input_reply_failed``).
        ``retry_in_s``: it may not have arrived (a refused or cut connection, a 5xx, a timeout): it stays
        stored and is sent again then, by the step that finds it (its attempts and last error counted).
        Otherwise (``answered``: the stored request) the server refused it: the reply is given up and the
        request marked ``reply_failed``, so the same question seen again opens a new round: the row is due at
        once, its claim let go (as after a reply sent), for the next poll to see what the server asks now."""
        round_ = int(reply["input_round"])
        failed = {**reply, "attempts": int(reply["attempts"]) + 1, "last_error": error}
        sets: dict[str, Any] = {"input_reply": failed, "lease_until": None}
        if retry_in_s is not None:
            sets["next_poll_at"] = due_after(retry_in_s)
        else:
            failed["given_up"] = True
            sets.update(input_request={**(answered or {}), "reply_failed": True}, next_poll_at=due_in(0))
        write = GuardedWrite(
            (S.WORKING,),
            None,
            EventKind.INPUT_REPLY_FAILED,
            {"input_round": round_, "error": error, "sent_again": retry_in_s is not None},
            sets,
            input_round=round_,
            returns_body=False,
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
        input_reply: Mapping[str, Any] | None = None,
    ) -> Operation:
        """MANUAL_RECONCILIATION -> WORKING, polled at once: the operator found it alive as ``remote_id``.
        Open records close with ``resolution``. Event ``resolved_found``. When the row's cancel generation is
        above ``cancel_above`` (by default the fence's: a cancel requested while the operator decided; 0: any
        cancel ever requested), -> CANCEL_REQUESTED instead, due at once: the cancel is sent (rule 6).
        ``input_reply``: the current round's reply as it is to be kept from now on (its bound started
        again), when it holds one."""
        sets: dict[str, Any] = {
            "remote_id": remote_id,
            "session_ref": session_ref,
            "next_poll_at": due_in(0),
            "input_deadline": None,  # an input request still unreadable gets a fresh bound
        }
        if input_reply is not None:
            sets["input_reply"] = dict(input_reply)
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
        result: Mapping[str, Any] | None = None,
    ) -> Operation:
        """MANUAL_RECONCILIATION -> TERMINAL_OBSERVED, fetched at once: the operator found it ended as
        ``kind``. Open records close with ``resolution``. Event ``resolved_terminal``. ``result``: held for
        acceptance with its digest, when there is no remote operation to fetch it from."""
        sets: dict[str, Any] = {
            "remote_id": remote_id,
            "observed_terminal": kind.value,
            "server_state": None,
            "next_poll_at": due_in(0),
        }
        if result is not None:
            sets |= {"result": dict(result), "result_digest": digest(result)}
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


def stored_reply(input_round: int, response: Mapping[str, Any]) -> dict[str, Any]:
    """The ``input_reply`` of a round as first stored: the reply as the gate gave it, not yet sent."""
    return {
        "input_round": input_round,
        "response": dict(response),
        "recorded_at": dt.datetime.now(dt.UTC).isoformat(),
        "sent_at": None,
        "attempts": 0,
        "last_error": None,
    }
