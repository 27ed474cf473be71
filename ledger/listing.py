"""What ``longcall list`` reads: the operations in flight (or, filtered, those that ended), one line each with
the last error its steps recorded. ``Ledger`` inherits :class:`OperationListing`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Collection
from typing import Any

from sqlalchemy import Text, cast, select, true

from ledger.guarded import GuardedWrites
from ledger.records import LISTED_AT_MOST, Operation
from ledger.statements import EVENT, OP
from ledger.states import FINAL_STATES, OpState

__all__ = ["LISTED_AT_MOST", "LastError", "OperationLine", "OperationListing"]


@dataclasses.dataclass(frozen=True, slots=True)
class OperationLine:
    """One operation as ``longcall list`` shows it. ``last_error``: the newest event that recorded an error
    (a failed poll, a refused create, a rate limit, ...), its kind and when; None: none so far."""

    op_id: uuid.UUID
    call_node_id: str
    server: str
    protocol: str
    state: OpState
    server_state: str | None
    status_message: str | None
    remote_id: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    unchanged_polls: int
    last_polled_at: dt.datetime | None
    next_poll_at: dt.datetime | None
    last_error: str | None
    last_error_kind: str | None
    last_error_at: dt.datetime | None


@dataclasses.dataclass(frozen=True, slots=True)
class LastError:
    """The newest error an operation's steps recorded: its text, the event's kind, and when."""

    error: str
    kind: str
    at: dt.datetime


def _last_error() -> Any:
    """The newest event with an error in its detail (the caller names the operation)."""
    return (
        select(
            EVENT.c.detail["error"].astext.label("error"),
            EVENT.c.kind.label("kind"),
            EVENT.c.at.label("at"),
        )
        .where(EVENT.c.detail.has_key("error"))
        .order_by(EVENT.c.seq.desc())
        .limit(1)
    )


class OperationListing(GuardedWrites):
    """The listing's reads; ``Ledger`` inherits them."""

    def last_error(self, op_id: uuid.UUID) -> LastError | None:
        """The newest error an operation's steps recorded (an event whose detail has one), or None."""
        with self._tx() as conn:
            row = conn.execute(_last_error().where(EVENT.c.op_id == op_id)).first()
        return LastError(row.error, row.kind, row.at) if row is not None else None

    def find_by_id_prefix(self, prefix: str) -> list[Operation]:
        """The operations whose op id starts with ``prefix`` (lower-case hexadecimal and dashes, as ids are
        written), two at most: one names the operation, two say the prefix is too short."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP).where(cast(OP.c.id, Text).startswith(prefix, autoescape=True)).limit(2)
            ).all()
        return [Operation.from_row(row) for row in rows]

    def list_operations(
        self,
        *,
        states: Collection[OpState] | None = None,
        server: str | None = None,
        since: dt.datetime | None = None,
        limit: int = 50,
    ) -> list[OperationLine]:
        """The newest ``limit`` operations (created last first) in ``states`` (None: every state that is not
        final, what is in flight), of ``server`` if given, created at or after ``since`` if given."""
        if not 0 < limit <= LISTED_AT_MOST:
            raise ValueError(f"limit must be between 1 and {LISTED_AT_MOST}, got {limit}")
        wanted = [s.value for s in (states if states is not None else set(OpState) - FINAL_STATES)]
        last_error = _last_error().where(EVENT.c.op_id == OP.c.id).lateral("last_error")
        query = (
            select(
                OP.c.id,
                OP.c.call_node_id,
                OP.c.server,
                OP.c.protocol,
                OP.c.state,
                OP.c.server_state,
                OP.c.status_message,
                OP.c.remote_id,
                OP.c.created_at,
                OP.c.updated_at,
                OP.c.unchanged_polls,
                OP.c.last_polled_at,
                OP.c.next_poll_at,
                last_error.c.error,
                last_error.c.kind,
                last_error.c.at,
            )
            .select_from(OP.outerjoin(last_error, true()))
            .where(OP.c.state.in_(wanted))
            .order_by(OP.c.created_at.desc(), OP.c.id)
            .limit(limit)
        )
        if server is not None:
            query = query.where(OP.c.server == server)
        if since is not None:
            query = query.where(OP.c.created_at >= since)
        with self._tx() as conn:
            rows = conn.execute(query).all()
        return [
            OperationLine(
                row.id,
                row.call_node_id,
                row.server,
                row.protocol,
                OpState(row.state),
                row.server_state,
                row.status_message,
                row.remote_id,
                row.created_at,
                row.updated_at,
                int(row.unchanged_polls),
                row.last_polled_at,
                row.next_poll_at,
                row.error,
                row.kind,
                row.at,
            )
            for row in rows
        ]
