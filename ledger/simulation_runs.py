"""The simulation's reads and writes of the ledger (issue 12): its runs in ``simulation_run`` (what the
launch gate reads of the last one), the per-series checks' counts, and the scripted lease expiry (the
simulation's clock: a crashed worker's lease is run out rather than waited for)."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, func, insert, select, update

from ledger.events import EventKind
from ledger.models import SimulationRun
from ledger.repository import Ledger
from ledger.statements import EVENT, OP, OUTBOX, RECEIPT, RECON

RUN = cast(Table, SimulationRun.__table__)


@dataclass(frozen=True)
class SimulationRunRow:
    id: int
    started_at: dt.datetime
    finished_at: dt.datetime
    seed: int
    series: int
    protocols: list[str]
    divergences: int
    second_operations: int
    max_receipts_per_call_node: int
    advances_without_receipt: int
    late_completions_advanced: int
    series_per_s: float
    failures: Any
    passed: bool


def record_run(ledger: Ledger, **values: Any) -> int:
    """Write one run; returns its id."""
    with ledger.engine.begin() as conn:
        return int(conn.execute(insert(RUN).values(**values).returning(RUN.c.id)).scalar_one())


def last_run(ledger: Ledger) -> SimulationRunRow | None:
    """The most recently finished run, or None."""
    with ledger.engine.begin() as conn:
        row = conn.execute(select(RUN).order_by(RUN.c.finished_at.desc(), RUN.c.id.desc()).limit(1)).first()
    return SimulationRunRow(**row._mapping) if row is not None else None


@dataclass(frozen=True)
class SeriesFacts:
    """What the per-series checks read of the ledger, in one transaction (one snapshot, one round of
    BEGIN/COMMIT instead of one per read)."""

    state: str
    receipts: list[dict[str, Any]]
    operations: int
    cancel_accepted: bool
    deliveries: list[dict[str, Any]]


def series_facts(ledger: Ledger, op_id: uuid.UUID, call_node_id: str) -> SeriesFacts:
    """The operation's state, its call node's receipts and operation rows, whether a cancel was accepted in
    its history, and its terminal outbox rows (ready or dispatched: every row is delivered at
    least once), each terminal row's receipt as its payload names it."""
    with ledger.engine.begin() as conn:
        state = conn.execute(select(OP.c.state).where(OP.c.id == op_id)).scalar_one()
        receipts = [
            dict(r)
            for r in conn.execute(select(RECEIPT).where(RECEIPT.c.call_node_id == call_node_id)).mappings()
        ]
        operations = conn.execute(select(func.count()).where(OP.c.call_node_id == call_node_id)).scalar_one()
        cancels = conn.execute(
            # A refused acceptance's stale_write_rejected event names the state it tried for: not a cancel.
            select(func.count()).where(
                EVENT.c.op_id == op_id,
                EVENT.c.to_state == "CANCELLED_ACCEPTED",
                EVENT.c.kind != EventKind.STALE_WRITE_REJECTED.value,
            )
        ).scalar_one()
        rows = conn.execute(
            select(OUTBOX.c.receipt_id, OUTBOX.c.payload).where(
                OUTBOX.c.op_id == op_id, OUTBOX.c.kind == "terminal"
            )
        ).all()
    return SeriesFacts(
        state=str(state),
        receipts=receipts,
        operations=int(operations),
        cancel_accepted=int(cancels) > 0,
        deliveries=[_delivery(r.receipt_id, r.payload) for r in rows],
    )


def _delivery(receipt_id: Any, payload: Any) -> dict[str, Any]:
    return {**dict((payload or {}).get("receipt") or {}), "row_receipt_id": receipt_id}


def open_reasons(ledger: Ledger, op_id: uuid.UUID) -> list[str]:
    with ledger.engine.begin() as conn:
        rows = conn.execute(
            select(RECON.c.reason).where(RECON.c.op_id == op_id, RECON.c.resolved_at.is_(None))
        )
        return sorted(str(r.reason) for r in rows)


def run_out_lease(ledger: Ledger, op_id: uuid.UUID) -> None:
    """The simulation's clock: a lease a crashed worker held has run out (as ``lease_s`` later would)."""
    with ledger.engine.begin() as conn:
        conn.execute(
            update(OP)
            .where(OP.c.id == op_id, OP.c.lease_until.is_not(None))
            .values(lease_until=func.now() - dt.timedelta(seconds=1))
        )


def relax_durability(ledger: Ledger) -> None:
    """For the simulation's own scratch database only: commits do not wait for the WAL flush (a crash of
    Postgres may lose the last runs' rows, never corrupt them): the run's figure is the executor's, not the
    disk's. Applies to new connections."""
    with ledger.engine.begin() as conn:
        name = conn.execute(select(func.current_database())).scalar_one()
        conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    ledger.engine.dispose()
