"""Retention (DESIGN §3): the history of final operations and delivered outbox rows is not kept forever.

The operation row and its terminal receipt stay for good (they are the record of what was promised and
accepted); an operation that is not final keeps every event, and an outbox row is deleted only once it was
dispatched, so nothing still owed to a pipeline is ever lost. Each call deletes at most ``limit`` rows of
each kind in one transaction, oldest first: a backlog is worked off over a few runs, never in one long lock.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import delete, func, select, tuple_

from ledger.guarded import GuardedWrites
from ledger.statements import EVENT, OP, OUTBOX
from ledger.states import FINAL_STATES


@dataclass(frozen=True, slots=True)
class Purged:
    """How many rows one retention run deleted."""

    events: int
    outbox_rows: int


class HistoryRetention(GuardedWrites):
    """The retention transaction; ``Ledger`` inherits it."""

    def purge_history(
        self, *, event_retention_s: float, outbox_retention_s: float, limit: int = 10_000
    ) -> Purged:
        """Delete the events of final operations older than ``event_retention_s`` and the dispatched outbox
        rows dispatched more than ``outbox_retention_s`` ago, at most ``limit`` of each, in one
        transaction."""
        old_events = (
            select(EVENT.c.op_id, EVENT.c.seq)
            .join(OP, OP.c.id == EVENT.c.op_id)
            .where(
                EVENT.c.at < func.now() - dt.timedelta(seconds=event_retention_s),
                OP.c.state.in_(sorted(s.value for s in FINAL_STATES)),
            )
            .order_by(EVENT.c.at)
            .limit(limit)
        )
        old_outbox = (
            select(OUTBOX.c.id)
            .where(
                OUTBOX.c.status == "dispatched",
                OUTBOX.c.dispatched_at < func.now() - dt.timedelta(seconds=outbox_retention_s),
            )
            .order_by(OUTBOX.c.dispatched_at)
            .limit(limit)
        )
        with self._tx() as conn:
            events = conn.execute(
                delete(EVENT).where(tuple_(EVENT.c.op_id, EVENT.c.seq).in_(old_events))
            ).rowcount
            outbox = conn.execute(delete(OUTBOX).where(OUTBOX.c.id.in_(old_outbox))).rowcount
        return Purged(events=int(events), outbox_rows=int(outbox))
