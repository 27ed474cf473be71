"""The canary's decisions, kept (issue 12): ``routing_decision`` holds the answer ``longcall.submit`` gave a
call node while a canary percentage was set, so that a later submission of the same call node (a caller's
retry, a redelivered ``longcall.submit``) gets the same answer whatever the percentage is now.

Why: a call node answered "not routed" runs on the caller's legacy path. Decided afresh after a raise of the
canary it would be routed live too: two operations for one call node. The decision is written in the
submission's transaction, under the call node's submission lock (``Ledger.record_submission``), so the
decision a submission acts on and the one recorded are the same; a "not routed" decision is committed with
nothing else (no operation, nothing sent).

The ledger does not decide (``workers/submission.py::canary_admission`` does): it reads the record and hands
it to the admission inside the rollout mapping, under :data:`RECORDED_DECISION`, and records what the
admission decided when there was no record yet. A decision is recorded only while a canary percentage is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Connection, Table, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger import models

ROUTING_DECISION = cast(Table, models.RoutingDecision.__table__)

#: The key of the rollout mapping an admission is given that carries the call node's recorded decision
#: (absent when it has none): ``{"routed": bool, "percent": P}``.
RECORDED_DECISION = "recorded_decision"


@dataclass(frozen=True, slots=True)
class RecordedDecision:
    """One row of ``routing_decision``: whether the call node was routed live, at which percentage."""

    routed: bool
    percent: float | int

    def to_json(self) -> dict[str, Any]:
        return {"routed": self.routed, "percent": self.percent}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> RecordedDecision:
        return cls(routed=bool(value["routed"]), percent=_plain(float(value["percent"])))


def read_decision(conn: Connection, call_node_id: str) -> RecordedDecision | None:
    row = conn.execute(
        select(ROUTING_DECISION.c.routed, ROUTING_DECISION.c.percent).where(
            ROUTING_DECISION.c.call_node_id == call_node_id
        )
    ).first()
    return RecordedDecision(routed=row.routed, percent=_plain(row.percent)) if row is not None else None


def record_decision(conn: Connection, call_node_id: str, decision: RecordedDecision) -> None:
    """Keep the call node's decision; the first one stays (the caller holds the submission lock, so there
    is no concurrent first)."""
    conn.execute(
        pg_insert(ROUTING_DECISION)
        .values(call_node_id=call_node_id, routed=decision.routed, percent=float(decision.percent))
        .on_conflict_do_nothing(index_elements=[ROUTING_DECISION.c.call_node_id])
    )


def _plain(percent: float) -> float | int:
    """5.0 as 5 (as the rollout stores and ``longcall.submit`` answers a percentage), 0.5 as 0.5."""
    return int(percent) if float(percent).is_integer() else float(percent)
