"""The guarded moves of one operation, each named for what it does (DESIGN §5).

Every move is one guarded statement, ``UPDATE ... WHERE id = :id AND state IN (:allowed) AND execution_epoch =
:epoch AND cancel_generation = :gen [AND poll_cursor = :cursor] [AND input_round = :round] RETURNING``, that
appends its own event row(s); the side rows a move owns (a reconciliation record, the approval gate's outbox
row, the closing of open records) go into the same transaction. Zero rows is a stale writer: nothing
changed, the refusal is recorded as a ``stale_write_rejected`` event (in a transaction of its own when the
move was one statement, see ``ledger/guarded.py``), and :class:`StaleTransition` is raised after the commit
(rule 5).

Each move writes the columns and the event kinds its step of the protocol needs, nothing else; callers never
name columns. ``Ledger`` inherits these moves; ``ledger/repository.py`` says where its others live.
"""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, and_, func, or_, text, update

from ledger.digests import digest
from ledger.errors import OperationNotFound
from ledger.events import EventKind
from ledger.guarded import GuardedWrite, GuardedWrites
from ledger.records import Fence, Operation, ServerStatus, UnchangedPoll, due_after, due_in
from ledger.side_rows import append_event
from ledger.statements import OP, STATEMENTS
from ledger.states import CANCEL_WAITS_IN, IllegalTransition, OpState, TerminalKind
from ledger.write_statements import update_unchanged_polls

S = OpState

#: A lease renewal's own statement timeout (``set_config(..., is_local)``: this transaction only).
RENEWAL_TIMEOUT = text("SELECT set_config('statement_timeout', :ms, true)")
#: How long a record of unchanged polls waits for a row lock another transaction holds (a takeover's update
#: of every row, an operator's open transaction) before it gives up: its claims then run out.
RECORD_LOCK_WAIT_S = 2.0
RECORD_LOCK_WAIT = f"{RECORD_LOCK_WAIT_S:g}s"


class OperationMoves(GuardedWrites):
    """The named guarded moves; ``Ledger`` is built on this. Every method owns exactly one transaction."""

    # ------------------------------------------------------------------------------ create (rules 1, 2)

    def record_create_attempt(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        descriptor_version: str | None,
        detail: Mapping[str, Any],
        unless_disabled: tuple[str, str] | None = None,
    ) -> Operation:
        """SUBMITTING stays: the create call is about to be made (``submit_attempted_at`` is set, so it is
        never made again blindly) for the tool descriptor of this version. Event ``create_attempted``. The
        guard asks that no attempt is recorded yet: two copies of one step under the same claim (a message
        delivered again while its first copy runs) record one attempt, and only that copy makes the create;
        the other is refused as stale (rule 1).

        Raises:
            AdapterDisabled: ``unless_disabled`` names an adapter (protocol, version) that is disabled for new
                operations (rule 14), as this same transaction reads the control row: nothing is written.
        """
        sets = {"submit_attempted_at": dt.datetime.now(dt.UTC), "tool_descriptor_version": descriptor_version}
        write = GuardedWrite(
            (S.SUBMITTING,),
            None,
            EventKind.CREATE_ATTEMPTED,
            detail,
            sets,
            unless_disabled=unless_disabled,
            only_unattempted=True,
        )
        return self._write(op_id, fence, write)

    def undo_create_attempt(
        self, op_id: uuid.UUID, fence: Fence, *, retry_in_s: float, detail: Mapping[str, Any]
    ) -> Operation:
        """SUBMITTING stays: the server refused the create before any work (rate limit, transient), so the
        attempt is undone and the create is due again in ``retry_in_s`` (not sooner, deadlines or not). Event
        ``create_refused_before_work``."""
        sets = {"submit_attempted_at": None, "next_poll_at": due_after(retry_in_s), "lease_until": None}
        write = GuardedWrite(
            (S.SUBMITTING,),
            None,
            EventKind.CREATE_REFUSED_BEFORE_WORK,
            detail,
            sets,
            after_intent="tolerate",
        )
        return self._write(op_id, fence, write)

    def mark_submission_unknown(
        self, op_id: uuid.UUID, fence: Fence, *, detail: Mapping[str, Any]
    ) -> Operation:
        """SUBMITTING -> SUBMISSION_UNKNOWN, due at once for a lookup by key: a create was attempted and its
        answer is lost. Event ``submission_unknown``."""
        write = GuardedWrite(
            (S.SUBMITTING,),
            S.SUBMISSION_UNKNOWN,
            EventKind.SUBMISSION_UNKNOWN,
            detail,
            {"next_poll_at": due_in(0)},
            after_intent="tolerate",
        )
        return self._write(op_id, fence, write)

    def record_created(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        remote_id: str,
        session_ref: str | None,
        status: ServerStatus,
        expires_at: dt.datetime | None,
        next_poll_in_s: float,
        keep_claim: bool = False,
    ) -> Operation:
        """SUBMITTING -> WORKING: the create call returned a queryable remote id; the first poll is due in
        ``next_poll_in_s``. Event ``created``. A cancel requested meanwhile never orphans the remote id: it
        is recorded all the same, and the operation goes to CANCEL_REQUESTED instead (rule 6), its claim
        kept for the step that sends the cancel. ``keep_claim``: the step goes on anyway (the create's
        answer was terminal, or asks for input): the lease stays; otherwise the claim is let go."""
        sets = {
            "remote_id": remote_id,
            "session_ref": session_ref,
            **status.columns(),
            "expires_at": expires_at,
            "next_poll_at": due_in(next_poll_in_s),
            **({} if keep_claim else {"lease_until": None}),
        }
        detail = {"remote_id": remote_id, "server_state": status.server_state}
        write = GuardedWrite(
            (S.SUBMITTING,), S.WORKING, EventKind.CREATED, detail, sets, after_intent="route"
        )
        return self._write(op_id, fence, write)

    def record_found_by_key(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        remote_id: str,
        session_ref: str | None,
        detail: Mapping[str, Any],
    ) -> Operation:
        """SUBMISSION_UNKNOWN -> WORKING, polled at once: a lookup by submission key found the operation.
        Event ``found_by_key``. With a cancel requested (the generation above 0): -> CANCEL_REQUESTED, due
        at once, the claim kept for the step that sends it (rule 6); otherwise the claim is let go."""
        sets = {
            "remote_id": remote_id,
            "session_ref": session_ref,
            "next_poll_at": due_in(0),
            "lease_until": None,
        }
        write = GuardedWrite(
            (S.SUBMISSION_UNKNOWN,), S.WORKING, EventKind.FOUND_BY_KEY, detail, sets, after_intent="route"
        )
        return self._write(op_id, fence, write)

    def resubmit(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        from_state: OpState,
        detail: Mapping[str, Any],
        resolution: str | None = None,
        keep_claim: bool = False,
    ) -> Operation:
        """-> NOT_FOUND_SAFE -> SUBMITTING in one statement: "never created" was proved, by the server's
        lookup (from SUBMISSION_UNKNOWN, event ``never_created``) or by an operator (from
        MANUAL_RECONCILIATION, event ``resolved_never_created``), and the same submission key is submitted
        again at once (event ``resubmission``, naming the key). ``resolution`` closes open records.

        ``keep_claim``: the step that proved it goes on to the create itself, under its claim, so the lease
        stays (and is renewed); otherwise (an operator's decision) the row is let go, due at once, for the
        dispatcher. Letting go of a claim whose step goes on let a tick claim the row under it: two steps
        of one operation at once, the first one's create answer refused as stale."""
        event = (
            EventKind.NEVER_CREATED
            if from_state is S.SUBMISSION_UNKNOWN
            else EventKind.RESOLVED_NEVER_CREATED
        )
        write = GuardedWrite(
            (from_state,),
            S.NOT_FOUND_SAFE,
            event,
            detail,
            {
                "submit_attempted_at": None,
                "next_poll_at": due_in(0),
                **({} if keep_claim else {"lease_until": None}),
            },
            then=S.SUBMITTING,
            then_event=EventKind.RESUBMISSION,
            then_names_key=True,
            resolution=resolution,
            # A cancel intent stays with the row: the create step then ends it cancelled, with no create.
            after_intent="tolerate",
        )
        return self._write(op_id, fence, write)

    def hold_create_result(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        kind: TerminalKind,
        server_state: str | None,
        result: Any,
        event: EventKind,
    ) -> Operation:
        """SUBMITTING -> TERMINAL_OBSERVED -> FETCHING_RESULT in one statement: the create call itself gave
        the final answer (event ``rejected`` or ``ran_synchronously``, then ``fetching_result``), or
        longcall refused it before any remote call (event ``adapter_disabled``, or ``create_never_sent``: the
        create can never be sent, e.g. its server is no longer configured); the whole result and its
        digest are held for acceptance. ``result=None``: the answer could not be stored (an operator
        decides next, in the same step: :meth:`hand_to_operator` from FETCHING_RESULT)."""
        if event not in (
            EventKind.REJECTED,
            EventKind.RAN_SYNCHRONOUSLY,
            EventKind.ADAPTER_DISABLED,
            EventKind.CREATE_NEVER_SENT,
        ):
            raise IllegalTransition(
                "a create's own final answer is rejected, ran_synchronously, adapter_disabled or "
                f"create_never_sent, not {event}"
            )
        sets = {
            "observed_terminal": kind.value,
            "server_state": server_state,
            "result": result,
            "result_digest": digest(result) if result is not None else None,
            "next_poll_at": due_in(0),
        }
        write = GuardedWrite(
            (S.SUBMITTING,),
            S.TERMINAL_OBSERVED,
            event,
            {"outcome": kind.value},
            sets,
            then=S.FETCHING_RESULT,
            then_event=EventKind.FETCHING_RESULT,
            after_intent="tolerate",  # the create's own end wins over a cancel requested meanwhile
        )
        return self._write(op_id, fence, write)

    # ------------------------------------------------------------------------------------ polling (3)

    def record_poll(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        state: OpState,
        status: ServerStatus,
        next_poll_in_s: float,
        claimed: bool = False,
    ) -> Operation:
        """Same state: the server still works on it; its status is kept and the next poll is due in
        ``next_poll_in_s``. Event ``polled`` when the server state, its message or its poll interval
        changed; an answer that changed nothing is counted on the row (``unchanged_polls``) instead. The
        snapshot returned is read without the arguments (``body`` is ``BODY_NOT_READ``). ``claimed``: the
        poll runs under a claim the dispatcher made (a batch member's); a copy of it that recorded the poll
        already let the claim go, and this one is refused quietly (``GuardedWrite.only_claimed``)."""
        sets = {
            **status.columns(),
            "next_poll_at": due_in(next_poll_in_s),
            "lease_until": None,
            "last_polled_at": dt.datetime.now(dt.UTC),
        }
        detail = {"server_state": status.server_state}
        write = GuardedWrite(
            (state,),
            None,
            EventKind.POLLED,
            detail,
            sets,
            quiet_unless_changed=tuple(status.columns()),
            counter="unchanged_polls",
            returns_body=False,  # its callers go on without the arguments (BODY_NOT_READ)
            only_claimed=claimed,
        )
        return self._write(op_id, fence, write)

    def record_unchanged_polls(self, members: Sequence[UnchangedPoll]) -> set[uuid.UUID]:
        """Polls that changed nothing (the server's state, message and interval as the row keeps them),
        each under its claim's fence, in one statement for all of them (a batch's): counted on the row
        (``unchanged_polls``, ``last_polled_at``), the claim let go, no event (DESIGN §3); the next poll is
        due when the claim that sent the poll set it (``Ledger.claim_due_by_server`` with its default
        intervals), or at its ``next_poll_due`` when that is later (see :class:`UnchangedPoll`). A
        member whose fence moved, or whose claim was let go already (a copy of its message ran it), is not
        written: it is left out of the ids returned, and nothing is recorded for it.

        It waits at most :data:`RECORD_LOCK_WAIT` for a row another transaction holds, then raises (the
        process's straggler thread, which writes it when no batch's read comes first, is never held up by a
        lock for longer)."""
        if not members:
            return set()
        params = self._unchanged_params(members)
        with self._tx() as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{RECORD_LOCK_WAIT}'"))
            return self._record_unchanged(conn, params)

    def _unchanged_params(self, members: Sequence[UnchangedPoll]) -> dict[str, Any]:
        """:meth:`record_unchanged_polls`' binds. Each due is taken as seconds from now before the
        transaction begins: the database's ``now()`` (the transaction's start) comes after, so the next poll
        it sets is never before the due (rule 3)."""
        for member in members:
            if member.fence.poll_cursor is None:
                raise ValueError("an unchanged poll is recorded under its claim's cursor")
        now = time.monotonic()
        return {
            "op_ids": [m.op_id for m in members],
            "epochs": [m.fence.execution_epoch for m in members],
            "generations": [m.fence.cancel_generation for m in members],
            "cursors": [m.fence.poll_cursor for m in members],
            "next_in": [
                None if m.next_poll_due is None else max(0.0, m.next_poll_due - now) for m in members
            ],
            "fence_executor": self.executor_id,
        }

    @staticmethod
    def _record_unchanged(conn: Connection, params: Mapping[str, Any]) -> set[uuid.UUID]:
        """:meth:`record_unchanged_polls`' statement with its binds (:meth:`_unchanged_params`), on ``conn``
        (in the caller's transaction)."""
        rows = conn.execute(STATEMENTS.get(update_unchanged_polls), params).all()
        return {row.id for row in rows}

    def reschedule(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        state: OpState,
        delay_s: float,
        event: EventKind,
        detail: Mapping[str, Any],
    ) -> Operation:
        """Same state: the step could not finish now (no token, rate limited, a failed call) and is due again
        in ``delay_s`` (not sooner, deadlines or not: a Retry-After holds), its lease released. ``event``
        says why; a missing token (``no_token``) is counted on the row (``no_token_count``), not written as
        an event. The snapshot returned is read without the arguments (``body`` is ``BODY_NOT_READ``)."""
        sets = {"next_poll_at": due_after(delay_s), "lease_until": None}
        quiet = event is EventKind.NO_TOKEN
        write = GuardedWrite(
            (state,),
            None,
            event,
            detail,
            sets,
            quiet_unless_changed=() if quiet else None,
            counter="no_token_count" if quiet else None,
            after_intent="tolerate",  # where a cancel intent waits, it stays; the step is due again anyway
            returns_body=False,  # a step that could not finish now sends nothing (BODY_NOT_READ)
        )
        return self._write(op_id, fence, write)

    def renew_lease(self, op_id: uuid.UUID, fence: Fence, *, lease_s: float) -> bool:
        """Same state, no event: the step that holds the claim ``fence`` is still running (a slow create, a
        synchronous call, a large result), so its lease runs ``lease_s`` from now (rule 3). Only a lease
        still held is renewed (a move that let the claim go cleared it), under the same epoch, generation
        and cursor. False when the fence moved or the lease is gone: the keeper stops, nothing is recorded
        (the step's own next write meets the fence and is refused as stale).

        A cancel intent recorded while the step runs (a state of ``CANCEL_WAITS_IN``: a create in flight)
        bumps the generation and keeps the lease on purpose: the create's answer, when it comes, takes the
        operation on to its cancel. So there a higher generation does not stop the renewal: a long create
        (a synchronous call, a slow server) lost its lease at the next renewal, another step then took the
        row for an unknown outcome, and the create's answer was refused when it came (a synchronous call's
        result lost, an operator asked about a task that had run)."""
        generation = or_(
            OP.c.cancel_generation == fence.cancel_generation,
            and_(
                OP.c.cancel_generation > fence.cancel_generation,
                OP.c.state.in_([s.value for s in CANCEL_WAITS_IN]),
            ),
        )
        guard = [
            OP.c.id == op_id,
            OP.c.execution_epoch == fence.execution_epoch,
            generation,
            OP.c.lease_until.is_not(None),
        ]
        if fence.poll_cursor is not None:
            guard.append(OP.c.poll_cursor == fence.poll_cursor)
        renewal = (
            update(OP)
            .where(*guard)
            .values(lease_until=func.now() + dt.timedelta(seconds=lease_s))
            .returning(OP.c.id)
        )
        with self._tx() as conn:
            # Bounded: one process renews all its claims one after another (workers/lease.py), so a renewal
            # stuck behind a lock must not hold the others past their next due time.
            conn.execute(RENEWAL_TIMEOUT, {"ms": str(max(100, math.ceil(lease_s * 1000 / 3)))})
            return conn.execute(renewal).first() is not None

    # ------------------------------------------------------------------------- result, accept (7, 8)

    def observe_terminal(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        from_state: OpState,
        kind: TerminalKind,
        status: ServerStatus,
        fetch_now: bool,
        due_in_s: float = 0.0,
    ) -> Operation:
        """-> TERMINAL_OBSERVED (event ``terminal_observed``). With ``fetch_now`` the caller keeps its claim
        and fetches at once: -> FETCHING_RESULT in the same statement (event ``fetching_result``); otherwise
        the fetch is due in ``due_in_s``, its lease released."""
        sets: dict[str, Any] = {**status.columns(), "observed_terminal": kind.value}
        if fetch_now:
            sets["next_poll_at"] = due_in(0)
        else:
            sets.update(next_poll_at=due_in(due_in_s), lease_until=None)
        write = GuardedWrite(
            (from_state,),
            S.TERMINAL_OBSERVED,
            EventKind.TERMINAL_OBSERVED,
            {"server_state": status.server_state},
            sets,
            then=S.FETCHING_RESULT if fetch_now else None,
            then_event=EventKind.FETCHING_RESULT if fetch_now else None,
        )
        return self._write(op_id, fence, write)

    def start_fetch(self, op_id: uuid.UUID, fence: Fence) -> Operation:
        """TERMINAL_OBSERVED -> FETCHING_RESULT. Event ``fetching_result``."""
        write = GuardedWrite((S.TERMINAL_OBSERVED,), S.FETCHING_RESULT, EventKind.FETCHING_RESULT, {})
        return self._write(op_id, fence, write)

    def correct_observed_terminal(
        self, op_id: uuid.UUID, fence: Fence, *, state: OpState, kind: TerminalKind, was: TerminalKind | None
    ) -> Operation:
        """Same state: the result says the outcome was ``kind``, not ``was`` (e.g. "completed" with an error
        result is a failure). Event ``outcome_from_result``."""
        detail = {"was": was.value if was is not None else None, "now": kind.value}
        write = GuardedWrite(
            (state,), None, EventKind.OUTCOME_FROM_RESULT, detail, {"observed_terminal": kind.value}
        )
        return self._write(op_id, fence, write)

    # ------------------------------------------------------------------------------------------ events

    def record_event(
        self, op_id: uuid.UUID, kind: EventKind, detail: Mapping[str, Any] | None = None
    ) -> None:
        """Append an event that changes nothing else (a refused input, a remote outcome worth keeping)."""
        with self._tx() as conn:
            row = conn.execute(
                update(OP).where(OP.c.id == op_id).values(event_seq=OP.c.event_seq + 1).returning(*OP.c)
            ).first()
            if row is None:
                raise OperationNotFound(op_id)
            op = Operation.from_row(row)
            append_event(conn, op, seq=op.event_seq, kind=kind, from_state=op.state.value, detail=detail)
