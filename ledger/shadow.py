"""Shadow comparisons (issue 12): a shadow operation's receipt beside the caller's legacy outcome.

A shadow operation (``tool_operation.routing = 'shadow'``) is driven and receipted like any other, but keeps
no downstream signature (a CHECK says so), so nothing it does reaches a pipeline. The caller ran its legacy
path for the same call node and reports that outcome (``longcall.record_legacy_outcome``); the two meet in
``shadow_comparison``. They arrive in either order: whichever comes second sets ``diverged``.

Race safety: both sides take one transaction-scoped advisory lock on the call node before they read the
other side (the receipt side inside the acceptance transaction itself, :func:`compare_on_receipt`). Under
READ COMMITTED the statement after the lock sees whatever the other side committed before releasing it, so
one of the two always sees the other: never two "first" arrivals, never a comparison left open.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal, cast

from sqlalchemy import Connection, Row, Table, func, insert, literal, select, update

from ledger import models
from ledger.errors import LegacyOutcomeRefused
from ledger.guarded import GuardedWrites
from ledger.records import Receipt
from ledger.statements import OP, RECEIPT
from ledger.states import TerminalKind

SHADOW = cast(Table, models.ShadowComparison.__table__)

#: The advisory lock key of a call node's comparison: hashtextextended(prefix || call_node_id, 0).
LOCK_PREFIX = "longcall.shadow_comparison:"

LegacyRecording = Literal["recorded", "compared", "already_recorded"]


@dataclass(frozen=True, slots=True)
class ShadowComparison:
    """One ``shadow_comparison`` row."""

    call_node_id: str
    legacy_terminal_state: TerminalKind
    legacy_result_digest: str | None
    legacy_detail: Any
    recorded_at: dt.datetime
    longcall_terminal_state: TerminalKind | None
    longcall_result_digest: str | None
    diverged: bool | None
    compared_at: dt.datetime | None

    @classmethod
    def from_row(cls, row: Row[Any]) -> ShadowComparison:
        values = {f.name: row._mapping[f.name] for f in dataclasses.fields(cls)}
        values["legacy_terminal_state"] = TerminalKind(values["legacy_terminal_state"])
        if values["longcall_terminal_state"] is not None:
            values["longcall_terminal_state"] = TerminalKind(values["longcall_terminal_state"])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in ("legacy_terminal_state", "longcall_terminal_state"):
            data[key] = data[key].value if data[key] is not None else None
        for key in ("recorded_at", "compared_at"):
            data[key] = data[key].isoformat() if data[key] is not None else None
        return data


def diverges(
    legacy_state: str, legacy_digest: str | None, longcall_state: str, longcall_digest: str | None
) -> bool:
    """Any difference is a divergence: the terminal states differ, or both digests are known and differ."""
    if legacy_state != longcall_state:
        return True
    return legacy_digest is not None and longcall_digest is not None and legacy_digest != longcall_digest


def lock_call_node(conn: Connection, call_node_id: str) -> None:
    """The call node's comparison lock, held until the caller's transaction ends."""
    key = func.hashtextextended(literal(LOCK_PREFIX) + literal(call_node_id), 0)
    conn.execute(select(func.pg_advisory_xact_lock(key)))


def compare_on_receipt(conn: Connection, call_node_id: str, receipt: Receipt) -> bool | None:
    """In the acceptance transaction of a shadow operation: complete the comparison when the legacy outcome
    came first (returns ``diverged``); None when it has not come yet (its recording will compare)."""
    lock_call_node(conn, call_node_id)
    row = conn.execute(select(SHADOW).where(SHADOW.c.call_node_id == call_node_id).with_for_update()).first()
    if row is None or row.compared_at is not None:
        return None if row is None else bool(row.diverged)
    diverged = diverges(
        row.legacy_terminal_state,
        row.legacy_result_digest,
        receipt.terminal_state.value,
        receipt.result_digest,
    )
    conn.execute(
        update(SHADOW)
        .where(SHADOW.c.call_node_id == call_node_id)
        .values(
            longcall_terminal_state=receipt.terminal_state.value,
            longcall_result_digest=receipt.result_digest,
            diverged=diverged,
            compared_at=func.now(),
        )
    )
    return diverged


class ShadowComparisons(GuardedWrites):
    """The shadow transactions of ``Ledger``."""

    def record_legacy_outcome(
        self,
        call_node_id: str,
        terminal_state: TerminalKind,
        *,
        result_digest: str | None = None,
        detail: Any = None,
    ) -> tuple[ShadowComparison, LegacyRecording]:
        """Record the caller's legacy outcome of a call node, compared at once when longcall's receipt is
        there already (``compared``), else when it arrives (``recorded``). The same outcome again (a
        redelivered message) changes nothing (``already_recorded``).

        Raises:
            LegacyOutcomeRefused: the call node's operation runs live, or another legacy outcome was
                recorded for it; nothing was written.
        """
        with self._tx() as conn:
            lock_call_node(conn, call_node_id)
            routing = conn.execute(select(OP.c.routing).where(OP.c.call_node_id == call_node_id)).scalar()
            if routing is not None and routing != "shadow":
                raise LegacyOutcomeRefused(
                    f"call node {call_node_id!r} was routed {routing}, not shadowed: its receipt is its only "
                    "outcome, there is no legacy outcome to compare"
                )
            existing = conn.execute(select(SHADOW).where(SHADOW.c.call_node_id == call_node_id)).first()
            if existing is not None:
                held = ShadowComparison.from_row(existing)
                if (held.legacy_terminal_state, held.legacy_result_digest) == (terminal_state, result_digest):
                    return held, "already_recorded"
                raise LegacyOutcomeRefused(
                    f"call node {call_node_id!r} has a legacy outcome already "
                    f"({held.legacy_terminal_state.value}, digest {held.legacy_result_digest}); "
                    f"refused: {terminal_state.value}, digest {result_digest}"
                )
            values: dict[str, Any] = {
                "call_node_id": call_node_id,
                "legacy_terminal_state": terminal_state.value,
                "legacy_result_digest": result_digest,
                "legacy_detail": detail,
            }
            receipt = None
            if routing == "shadow":
                receipt = conn.execute(
                    select(RECEIPT.c.terminal_state, RECEIPT.c.result_digest).where(
                        RECEIPT.c.call_node_id == call_node_id
                    )
                ).first()
            if receipt is not None:
                values |= {
                    "longcall_terminal_state": receipt.terminal_state,
                    "longcall_result_digest": receipt.result_digest,
                    "diverged": diverges(
                        terminal_state.value, result_digest, receipt.terminal_state, receipt.result_digest
                    ),
                    "compared_at": func.now(),
                }
            row = conn.execute(insert(SHADOW).values(values).returning(*SHADOW.c)).one()
            return ShadowComparison.from_row(row), "compared" if receipt is not None else "recorded"

    def shadow_comparison(self, call_node_id: str) -> ShadowComparison | None:
        with self._tx() as conn:
            row = conn.execute(select(SHADOW).where(SHADOW.c.call_node_id == call_node_id)).first()
        return ShadowComparison.from_row(row) if row is not None else None

    def shadow_comparisons(self, *, diverged_only: bool = False, limit: int = 500) -> list[ShadowComparison]:
        """The comparisons, newest first (only the diverged ones with ``diverged_only``)."""
        query = select(SHADOW).order_by(SHADOW.c.recorded_at.desc()).limit(limit)
        if diverged_only:
            query = query.where(SHADOW.c.diverged.is_(True))
        with self._tx() as conn:
            rows = conn.execute(query).all()
        return [ShadowComparison.from_row(r) for r in rows]
