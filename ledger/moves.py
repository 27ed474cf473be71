"""The guarded moves of one operation, each named for what it does (DESIGN §5).

Every move is one guarded statement, ``UPDATE ... WHERE id = :id AND state IN (:allowed) AND execution_epoch =
:epoch AND cancel_generation = :gen [AND poll_cursor = :cursor] [AND input_round = :round] RETURNING``, that
appends its own event row(s); the side rows a move owns (a reconciliation record, the approval gate's outbox
row, the closing of open records) go into the same transaction. Zero rows is a stale writer: the refusal is
recorded as a ``stale_write_rejected`` event in the same transaction, nothing else changes, and
:class:`StaleTransition` is raised after the commit (rule 5).

Each move writes the columns and the event kinds its step of the protocol needs, nothing else; callers never
name columns. ``Ledger`` inherits these moves; its other transactions live in ``ledger/repository.py``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, insert, update

from ledger.digests import digest
from ledger.errors import OperationNotFound
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import DueIn, Fence, NewReconciliation, Operation, ServerStatus, due_in
from ledger.side_rows import append_event, open_reconciliation, record_stale, resolve_open_reconciliations
from ledger.statements import OP, OUTBOX, STATEMENTS, WriteShape, guarded_update
from ledger.states import FINAL_STATES, NEVER_POLLED, IllegalTransition, OpState, TerminalKind, check_edges

S = OpState

#: The columns the generic edge move (tests only) may set; identity, fencing and bookkeeping columns are
#: changed only by the named moves, claims and acceptance.
WRITABLE_COLUMNS = frozenset(
    {
        "tool_descriptor_version",
        "remote_id",
        "session_ref",
        "submit_attempted_at",
        "server_state",
        "observed_terminal",
        "status_message",
        "next_poll_at",
        "poll_interval_ms",
        "lease_until",
        "wait_deadline",
        "expires_at",
        "input_round",
        "input_request",
        "input_schema_digest",
        "input_deadline",
        "result",
        "result_digest",
        "protocol_version",
    }
)


@dataclass(frozen=True, slots=True)
class _Write:
    """One guarded write: where it may start, where it ends, what it sets and which side rows it owns."""

    in_states: tuple[OpState, ...]
    to: OpState | None
    event: EventKind
    detail: Mapping[str, Any]
    sets: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: A second edge in the same statement (two events, one transaction), with its own event.
    then: OpState | None = None
    then_event: EventKind | None = None
    then_names_key: bool = False
    bump_generation: bool = False
    #: Adds ``input_round = :round`` to the guard: a reply is taken for the current round only.
    input_round: int | None = None
    reconcile: NewReconciliation | None = None
    input_outbox: Mapping[str, Any] | None = None
    #: Closes the operation's open reconciliation records with this resolution.
    resolution: str | None = None


class OperationMoves:
    """The named guarded moves; ``Ledger`` is built on this. Every method owns exactly one transaction."""

    engine: Engine

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    # ------------------------------------------------------------------------------ create (rules 1, 2)

    def record_create_attempt(
        self, op_id: uuid.UUID, fence: Fence, *, descriptor_version: str | None, detail: Mapping[str, Any]
    ) -> Operation:
        """SUBMITTING stays: the create call is about to be made (``submit_attempted_at`` is set, so it is
        never made again blindly) for the tool descriptor of this version. Event ``create_attempted``."""
        sets = {"submit_attempted_at": dt.datetime.now(dt.UTC), "tool_descriptor_version": descriptor_version}
        return self._write(
            op_id, fence, _Write((S.SUBMITTING,), None, EventKind.CREATE_ATTEMPTED, detail, sets)
        )

    def undo_create_attempt(
        self, op_id: uuid.UUID, fence: Fence, *, retry_in_s: float, detail: Mapping[str, Any]
    ) -> Operation:
        """SUBMITTING stays: the server refused the create before any work (rate limit, transient), so the
        attempt is undone and the create is due again in ``retry_in_s``. Event
        ``create_refused_before_work``."""
        sets = {"submit_attempted_at": None, "next_poll_at": due_in(retry_in_s), "lease_until": None}
        write = _Write((S.SUBMITTING,), None, EventKind.CREATE_REFUSED_BEFORE_WORK, detail, sets)
        return self._write(op_id, fence, write)

    def mark_submission_unknown(
        self, op_id: uuid.UUID, fence: Fence, *, detail: Mapping[str, Any]
    ) -> Operation:
        """SUBMITTING -> SUBMISSION_UNKNOWN, due at once for a lookup by key: a create was attempted and its
        answer is lost. Event ``submission_unknown``."""
        write = _Write(
            (S.SUBMITTING,),
            S.SUBMISSION_UNKNOWN,
            EventKind.SUBMISSION_UNKNOWN,
            detail,
            {"next_poll_at": due_in(0)},
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
    ) -> Operation:
        """SUBMITTING -> WORKING: the create call returned a queryable remote id; the first poll is due in
        ``next_poll_in_s``. Event ``created``."""
        sets = {
            "remote_id": remote_id,
            "session_ref": session_ref,
            **status.columns(),
            "expires_at": expires_at,
            "next_poll_at": due_in(next_poll_in_s),
            "lease_until": None,
        }
        detail = {"remote_id": remote_id, "server_state": status.server_state}
        return self._write(op_id, fence, _Write((S.SUBMITTING,), S.WORKING, EventKind.CREATED, detail, sets))

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
        Event ``found_by_key``."""
        sets = {
            "remote_id": remote_id,
            "session_ref": session_ref,
            "next_poll_at": due_in(0),
            "lease_until": None,
        }
        write = _Write((S.SUBMISSION_UNKNOWN,), S.WORKING, EventKind.FOUND_BY_KEY, detail, sets)
        return self._write(op_id, fence, write)

    def resubmit(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        from_state: OpState,
        detail: Mapping[str, Any],
        resolution: str | None = None,
    ) -> Operation:
        """-> NOT_FOUND_SAFE -> SUBMITTING in one statement: "never created" was proved, by the server's
        lookup (from SUBMISSION_UNKNOWN, event ``never_created``) or by an operator (from
        MANUAL_RECONCILIATION, event ``resolved_never_created``), and the same submission key is submitted
        again at once (event ``resubmission``, naming the key). ``resolution`` closes open records."""
        event = (
            EventKind.NEVER_CREATED
            if from_state is S.SUBMISSION_UNKNOWN
            else EventKind.RESOLVED_NEVER_CREATED
        )
        write = _Write(
            (from_state,),
            S.NOT_FOUND_SAFE,
            event,
            detail,
            {"submit_attempted_at": None, "next_poll_at": due_in(0), "lease_until": None},
            then=S.SUBMITTING,
            then_event=EventKind.RESUBMISSION,
            then_names_key=True,
            resolution=resolution,
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
        the final answer (event ``rejected`` or ``ran_synchronously``, then ``fetching_result``); the whole
        result and its digest are held for acceptance."""
        if event not in (EventKind.REJECTED, EventKind.RAN_SYNCHRONOUSLY):
            raise IllegalTransition(
                f"a create's own final answer is rejected or ran_synchronously, not {event}"
            )
        sets = {
            "observed_terminal": kind.value,
            "server_state": server_state,
            "result": result,
            "result_digest": digest(result),
            "next_poll_at": due_in(0),
        }
        write = _Write(
            (S.SUBMITTING,),
            S.TERMINAL_OBSERVED,
            event,
            {"outcome": kind.value},
            sets,
            then=S.FETCHING_RESULT,
            then_event=EventKind.FETCHING_RESULT,
        )
        return self._write(op_id, fence, write)

    # ------------------------------------------------------------------------------------ polling (3)

    def record_poll(
        self, op_id: uuid.UUID, fence: Fence, *, state: OpState, status: ServerStatus, next_poll_in_s: float
    ) -> Operation:
        """Same state: the server still works on it; its status is kept and the next poll is due in
        ``next_poll_in_s``. Event ``polled``."""
        sets = {**status.columns(), "next_poll_at": due_in(next_poll_in_s), "lease_until": None}
        detail = {"server_state": status.server_state}
        return self._write(op_id, fence, _Write((state,), None, EventKind.POLLED, detail, sets))

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
        in ``delay_s``, its lease released. ``event`` says why."""
        sets = {"next_poll_at": due_in(delay_s), "lease_until": None}
        return self._write(op_id, fence, _Write((state,), None, event, detail, sets))

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
        write = _Write(
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
        write = _Write((S.TERMINAL_OBSERVED,), S.FETCHING_RESULT, EventKind.FETCHING_RESULT, {})
        return self._write(op_id, fence, write)

    def correct_observed_terminal(
        self, op_id: uuid.UUID, fence: Fence, *, state: OpState, kind: TerminalKind, was: TerminalKind | None
    ) -> Operation:
        """Same state: the result says the outcome was ``kind``, not ``was`` (e.g. "completed" with an error
        result is a failure). Event ``outcome_from_result``."""
        detail = {"was": was.value if was is not None else None, "now": kind.value}
        write = _Write(
            (state,), None, EventKind.OUTCOME_FROM_RESULT, detail, {"observed_terminal": kind.value}
        )
        return self._write(op_id, fence, write)

    # ------------------------------------------------------------------------------------- cancel (6)

    def request_cancel(
        self, op_id: uuid.UUID, fence: Fence, *, from_state: OpState, due_in_s: float = 0.0
    ) -> Operation:
        """-> CANCEL_REQUESTED with the cancel generation bumped, so every writer of the old generation is
        fenced off; the cancel is due in ``due_in_s`` (at once by default) under a fresh claim: the lease goes
        too. Event ``cancel_requested``."""
        write = _Write(
            (from_state,),
            S.CANCEL_REQUESTED,
            EventKind.CANCEL_REQUESTED,
            {"generation": fence.cancel_generation + 1},
            {"next_poll_at": due_in(due_in_s), "lease_until": None},
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
        write = _Write(
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
        write = _Write(
            (S.INPUT_REQUIRED,),
            S.WORKING,
            EventKind.INPUT_PROVIDED,
            {"input_round": input_round, "action": action},
            {"next_poll_at": due_in(0)},
            input_round=input_round,
        )
        return self._write(op_id, fence, write)

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
        write = _Write(
            (from_state,),
            S.MANUAL_RECONCILIATION,
            EventKind.MANUAL_RECONCILIATION,
            {"reason": reason.value, **detail},
            {"next_poll_at": None, "lease_until": None},
            reconcile=NewReconciliation(reason, dt.timedelta(seconds=deadline_s), detail),
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
    ) -> Operation:
        """MANUAL_RECONCILIATION -> WORKING, polled at once: the operator found it alive as ``remote_id``.
        Open records close with ``resolution``. Event ``resolved_found``."""
        sets = {"remote_id": remote_id, "session_ref": session_ref, "next_poll_at": due_in(0)}
        write = _Write(
            (S.MANUAL_RECONCILIATION,),
            S.WORKING,
            EventKind.RESOLVED_FOUND,
            detail,
            sets,
            resolution=resolution,
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
        write = _Write(
            (S.MANUAL_RECONCILIATION,),
            S.TERMINAL_OBSERVED,
            EventKind.RESOLVED_TERMINAL,
            {**detail, "terminal": kind.value},
            sets,
            resolution=resolution,
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

    # ------------------------------------------------------------------------------------ generic write

    def _edge_move(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        to: OpState | None,
        *,
        from_states: Iterable[OpState],
        values: Mapping[str, Any] | None = None,
        event: EventKind = EventKind.TRANSITION,
        bump_generation: bool = False,
    ) -> Operation:
        """Any edge of the state table (or, with ``to=None``, a write that keeps the state), setting whatever
        ``values`` says: for the exhaustive transition tests and the state machine test only. workers/ never
        calls it; every protocol step has its named move above."""
        sets = dict(values or {})
        refused = sorted(set(sets) - WRITABLE_COLUMNS)
        if refused:
            raise IllegalTransition(f"columns {refused} are not written through values=")
        if isinstance(sets.get("observed_terminal"), TerminalKind):
            sets["observed_terminal"] = sets["observed_terminal"].value
        write = _Write(tuple(from_states), to, event, {}, sets, bump_generation=bump_generation)
        return self._write(op_id, fence, write)

    def _write(self, op_id: uuid.UUID, fence: Fence, write: _Write) -> Operation:
        """The one guarded statement behind every move, its side rows, or the stale writer's refusal."""
        sets = dict(write.sets)
        if write.to is None:
            final = [s for s in write.in_states if s in FINAL_STATES]
            if final or not write.in_states:
                raise IllegalTransition(
                    f"a final operation never changes (asked to update in {final or 'no'} state)"
                )
        else:
            check_edges(write.in_states, write.to)
            if write.then is not None:
                check_edges([write.to], write.then)
            if write.to in FINAL_STATES or write.then in FINAL_STATES:
                raise IllegalTransition(
                    f"{write.then or write.to} is reached only through accept_terminal (rule 8)"
                )
            if (write.then or write.to) in NEVER_POLLED:
                sets.setdefault("next_poll_at", None)
                sets.setdefault("lease_until", None)
        if (write.then is None) != (write.then_event is None):
            raise IllegalTransition("a second edge needs its own event, and an event its edge")
        shape = WriteShape(
            columns=tuple(sorted((name, isinstance(value, DueIn)) for name, value in sets.items())),
            to_state=write.to is not None,
            two_edges=write.then is not None,
            bump_generation=write.bump_generation,
            with_cursor=fence.poll_cursor is not None,
            with_round=write.input_round is not None,
            then_names_key=write.then_names_key,
        )
        end = write.then or write.to
        params: dict[str, Any] = {
            "fence_id": op_id,
            "fence_states": [s.value for s in write.in_states],
            "fence_epoch": fence.execution_epoch,
            "fence_generation": fence.cancel_generation,
            "fence_cursor": fence.poll_cursor,
            "fence_round": write.input_round,
            "new_state": end.value if end is not None else None,
            "event_kind": write.event.value,
            "event_detail": dict(write.detail),
            "halfway_state": write.to.value if write.then is not None and write.to is not None else None,
            "then_kind": write.then_event.value if write.then_event is not None else None,
            "then_detail": {},
        }
        for name, value in sets.items():
            params[f"new_{name}"] = value.interval() if isinstance(value, DueIn) else value
        with self._tx() as conn:
            row = conn.execute(STATEMENTS.get(guarded_update, shape), params).first()
            if row is not None:
                op = Operation.from_row(row)  # its event (or two) went in with the same statement
                self._side_rows(conn, op, write)
                return op
            stale = record_stale(
                conn,
                op_id,
                attempted=write.event.value,
                to_state=write.to,
                expected={
                    "state": sorted(s.value for s in write.in_states),
                    **fence.as_dict(),
                    **({"input_round": write.input_round} if write.input_round is not None else {}),
                },
                detail=write.detail,
            )
        raise stale

    @staticmethod
    def _side_rows(conn: Connection, op: Operation, write: _Write) -> None:
        if write.reconcile is not None:
            reconcile = write.reconcile
            open_reconciliation(conn, op, reconcile.reason, reconcile.deadline, reconcile.detail)
        if write.input_outbox is not None:
            conn.execute(
                insert(OUTBOX).values(
                    kind="input_required",
                    op_id=op.id,
                    input_round=op.input_round,
                    payload=dict(write.input_outbox),
                )
            )
        if write.resolution is not None:
            resolve_open_reconciliations(conn, op.id, write.resolution)

    # ------------------------------------------------------------ until workers/ calls the named moves

    def transition(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        to: OpState,
        *,
        from_states: Iterable[OpState],
        values: Mapping[str, Any] | None = None,
        event: str = "transition",
        detail: Mapping[str, Any] | None = None,
        bump_generation: bool = False,
        input_round: int | None = None,
        reconcile: NewReconciliation | None = None,
        input_outbox: Mapping[str, Any] | None = None,
        resolve: str | None = None,
        then: OpState | None = None,
    ) -> Operation:
        """Deprecated: the executor's generic move before the named moves; removed once it is unused."""
        sets = dict(values or {})
        if isinstance(sets.get("observed_terminal"), TerminalKind):
            sets["observed_terminal"] = sets["observed_terminal"].value
        write = _Write(
            tuple(from_states),
            to,
            EventKind(event),
            dict(detail or {}),
            sets,
            then=then,
            then_event=EventKind(then.value.lower()) if then is not None else None,
            bump_generation=bump_generation,
            input_round=input_round,
            reconcile=reconcile,
            input_outbox=input_outbox,
            resolution=resolve,
        )
        return self._write(op_id, fence, write)

    def update(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        in_states: Iterable[OpState],
        values: Mapping[str, Any],
        event: str,
        detail: Mapping[str, Any] | None = None,
        bump_generation: bool = False,
    ) -> Operation:
        """Deprecated: a guarded write that keeps the state; removed once workers/ uses the named moves."""
        sets = dict(values)
        if isinstance(sets.get("observed_terminal"), TerminalKind):
            sets["observed_terminal"] = sets["observed_terminal"].value
        write = _Write(
            tuple(in_states),
            None,
            EventKind(event),
            dict(detail or {}),
            sets,
            bump_generation=bump_generation,
        )
        return self._write(op_id, fence, write)
