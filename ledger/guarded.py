"""The one guarded write behind every named move (``ledger/moves.py``), and its side rows.

A :class:`GuardedWrite` says where a move may start, where it ends, what it sets and which side rows it owns;
``GuardedWrites._write`` runs it as one guarded statement (``ledger.write_statements.guarded_update``): alone,
in autocommit, when the move owns no side rows (the statement is its own transaction), else in one transaction
with them. A refused write (zero rows: a stale writer) changed nothing; the refusal is then recorded in a
transaction of its own and :class:`StaleTransition` raised after its commit. The recorded ``found`` is the row
as that second transaction reads it: a writer that moved the row in between shows there (a diagnostic only;
nothing decides on it).
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Connection, Engine, insert, select

from ledger.errors import AdapterDisabled, StaleTransition
from ledger.events import EventKind
from ledger.records import DueIn, Fence, NewReconciliation, Operation, adapter_key
from ledger.side_rows import open_reconciliation, record_stale, resolve_open_reconciliations
from ledger.statements import OP, OUTBOX, STATEMENTS, select_disabled_adapters
from ledger.states import FINAL_STATES, NEVER_POLLED, IllegalTransition, OpState, TerminalKind, check_edges
from ledger.write_statements import WriteShape, guarded_update

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
class GuardedWrite:
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
    #: A quiet write (DESIGN §3): its event is appended only when one of these columns changes (never,
    #: when empty); otherwise the write counts itself in ``counter`` on the row.
    quiet_unless_changed: tuple[str, ...] | None = None
    counter: str | None = None
    #: A cancel intent recorded while the writer was in flight (rule 6): "strict" refuses the write,
    #: "tolerate" makes it anyway where an intent waits (``CANCEL_WAITS_IN``: the intent stays, the generation
    #: with it), "route" too, and goes to CANCEL_REQUESTED instead of ``to`` when the row's generation is
    #: above ``route_above``.
    after_intent: Literal["strict", "tolerate", "route"] = "strict"
    route_above: int = 0
    #: ``(protocol, protocol_version)``: the write is refused (:class:`AdapterDisabled`, nothing written)
    #: when this adapter is in ``executor_control.disabled_adapters`` as the write's own transaction reads it.
    unless_disabled: tuple[str, str] | None = None
    #: The snapshot it returns holds the arguments; False: ``body`` is ``BODY_NOT_READ`` (a write on the
    #: poll path, whose caller never sends them).
    returns_body: bool = True
    #: Adds ``submit_attempted_at IS NULL`` to the guard: the create attempt is recorded once, whatever
    #: copies of its step run under the same claim (rule 1).
    only_unattempted: bool = False
    #: Adds ``lease_until IS NOT NULL`` to the guard: under a claim the dispatcher made (a batch member's
    #: poll), a copy of the same step (a message delivered twice, both copies running) that recorded it
    #: already let the claim go; this write is then refused quietly (:class:`StaleTransition`, no event).
    only_claimed: bool = False


class GuardedWrites:
    """The engine, its transactions and the guarded write; the base of ``OperationMoves`` and ``Ledger``."""

    engine: Engine
    #: The executor identity of the fleet writing (rule 13): a write under a claim (a fence with a poll
    #: cursor) is refused unless the control row names no epoch owner or names this one. None: a ledger
    #: that names no fleet (an operator's command, a test), never fenced by the owner.
    executor_id: str | None = None

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _one_statement(self) -> Iterator[Connection]:
        """For a transaction that is one statement: run it in autocommit, where it is its own transaction
        on the server (as atomic, its row locks held to its end, one ``xact_commit``) without the BEGIN and
        COMMIT round trips around it: one round trip instead of three. The pool's connection is lent in
        autocommit and goes back in the engine's isolation level."""
        with self._autocommit_engine.connect() as conn:
            yield conn

    @functools.cached_property
    def _autocommit_engine(self) -> Engine:
        """The engine, its pool shared, lending connections in autocommit."""
        return self.engine.execution_options(isolation_level="AUTOCOMMIT")

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
        write = GuardedWrite(tuple(from_states), to, event, {}, sets, bump_generation=bump_generation)
        return self._write(op_id, fence, write)

    def _write(self, op_id: uuid.UUID, fence: Fence, write: GuardedWrite) -> Operation:
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
            if write.after_intent == "route":
                check_edges(write.in_states, OpState.CANCEL_REQUESTED)
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
            quiet_unless_changed=write.quiet_unless_changed,
            counter=write.counter,
            after_intent=write.after_intent,
            with_body=write.returns_body,
            only_unattempted=write.only_unattempted,
            only_claimed=write.only_claimed,
        )
        end = write.then or write.to
        params: dict[str, Any] = {
            "fence_id": op_id,
            "fence_states": [s.value for s in write.in_states],
            "fence_epoch": fence.execution_epoch,
            "fence_generation": fence.cancel_generation,
            "fence_cursor": fence.poll_cursor,
            "fence_executor": self.executor_id,
            "fence_round": write.input_round,
            "new_state": end.value if end is not None else None,
            "event_kind": write.event.value,
            "event_detail": dict(write.detail),
            "halfway_state": write.to.value if write.then is not None and write.to is not None else None,
            "then_kind": write.then_event.value if write.then_event is not None else None,
            "then_detail": {},
            "fence_route_above": write.route_above,
        }
        for name, value in sets.items():
            params[f"new_{name}"] = value.interval() if isinstance(value, DueIn) else value
            if isinstance(value, DueIn):
                params[f"new_{name}_capped"] = value.capped
        # The usual write (a poll's reschedule, a state change with its events) is one statement.
        alone = write.unless_disabled is None and not _has_side_rows(write)
        if alone:
            with self._one_statement() as conn:
                row = conn.execute(STATEMENTS.get(guarded_update, shape), params).first()
            if row is not None:
                # its event (or two) went in with the same statement
                return Operation.from_row(row, with_body=write.returns_body)
        with self._tx() as conn:
            if not alone:
                if write.unless_disabled is not None:
                    disabled = conn.execute(STATEMENTS.get(select_disabled_adapters)).scalar_one()
                    if adapter_key(*write.unless_disabled) in disabled:
                        raise AdapterDisabled(*write.unless_disabled)
                row = conn.execute(STATEMENTS.get(guarded_update, shape), params).first()
                if row is not None:
                    # its event (or two) went in with the same statement
                    op = Operation.from_row(row, with_body=write.returns_body)
                    self._side_rows(conn, op, write)
                    return op
            # Refused: the stale writer's refusal, in a transaction of its own (the refused statement
            # changed nothing, so nothing is lost between the two).
            if write.only_claimed and (done := _recorded_by_a_copy(conn, op_id, fence, write)) is not None:
                raise done
            stale = record_stale(
                conn,
                op_id,
                attempted=write.event.value,
                to_state=write.to,
                expected={
                    "state": sorted(s.value for s in write.in_states),
                    **fence.as_dict(),
                    **({"input_round": write.input_round} if write.input_round is not None else {}),
                    **({"submit_attempted_at": None} if write.only_unattempted else {}),
                },
                detail=write.detail,
            )
        raise stale

    @staticmethod
    def _side_rows(conn: Connection, op: Operation, write: GuardedWrite) -> None:
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


def _recorded_by_a_copy(
    conn: Connection, op_id: uuid.UUID, fence: Fence, write: GuardedWrite
) -> StaleTransition | None:
    """The refusal of an ``only_claimed`` write whose claim (its cursor, its epoch and generation) is still
    the row's but let go: a copy of the same step recorded it, which is no stale writer's doing (no event).
    None: another refusal, recorded as such."""
    row = conn.execute(
        select(
            OP.c.state, OP.c.execution_epoch, OP.c.cancel_generation, OP.c.poll_cursor, OP.c.lease_until
        ).where(OP.c.id == op_id)
    ).first()
    if row is None or row.lease_until is not None:
        return None
    found = {
        "state": row.state,
        "execution_epoch": row.execution_epoch,
        "cancel_generation": row.cancel_generation,
        "poll_cursor": row.poll_cursor,
    }
    if (row.execution_epoch, row.cancel_generation, row.poll_cursor) != (
        fence.execution_epoch,
        fence.cancel_generation,
        fence.poll_cursor,
    ) or row.state not in {s.value for s in write.in_states}:
        return None
    return StaleTransition(op_id, write.event.value, {**fence.as_dict(), "lease_until": "held"}, found)


def _has_side_rows(write: GuardedWrite) -> bool:
    """Whether the write adds rows of its own besides the operation's events (then it is a transaction)."""
    return write.reconcile is not None or write.input_outbox is not None or write.resolution is not None
