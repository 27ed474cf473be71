"""What ``longcall gate`` (the launch gate) reads from the ledger: one read-only snapshot of the evidence.

Read-only, in one REPEATABLE READ transaction (every figure of one gate comes from one snapshot) under a
statement timeout; aggregation happens in Postgres, and each list of the rows behind a failing figure is
capped at ``limit`` (its full count comes with it). The gate reads what the ledger still holds: events of
final operations and dispatched outbox rows older than their retention (``LONGCALL_EVENT_RETENTION_S``,
``LONGCALL_OUTBOX_RETENTION_S``) are gone and no longer count.

What each figure means (``console.launch_gate`` sets them against the targets):

- Shadow comparisons: compared rows (``diverged`` decided) and the diverged ones.
- The newest ``simulation_run`` (by ``finished_at``), or None.
- Second operations: an operation row whose events show more remote work than one operation. Two rows for
  one call node cannot exist (``call_node_id`` is UNIQUE, and a duplicate submission with the same digest
  returns the existing row), so what can go wrong is inside one row: a second create sent (more
  ``create_attempted`` events than one plus the attempts undone by proof: ``create_refused_before_work``,
  ``never_created``, ``resolved_never_created``), or a second remote id bound (more distinct remote ids in
  the ``created`` events and the row's own ``remote_id`` than one plus the never-created proofs).
- Cancel confirmation lag: from an operation's first ``cancel_requested`` event to its terminal receipt's
  ``accepted_at`` (cancelled, or the completion that won the race); a cancel with no receipt yet counts
  with its age so far (a lower bound), so a cancel that never ends cannot hide.
- UNKNOWN age: each reconciliation record (what no rule decided), from ``opened_at`` to ``resolved_at``
  (open: to now); each SUBMISSION_UNKNOWN that ended without an operator (an AIP-151 create found by its
  request id, a proof of never created: no record), from the event into it to the event out of it (one
  handed to an operator counts once, by its record); and each operation in SUBMISSION_UNKNOWN now without
  an open record (from the event that moved it there); overdue = an open record past its ``deadline``.
- Downstream advances: dispatched ``terminal`` outbox rows of live operations (a shadow operation's row
  names no task: nothing reaches the pipeline); traceable = its receipt exists, belongs to the same
  operation, and is the receipt its payload delivered (``payload.receipt.receipt_id``).
- Unconfigured servers (rule 14): operations not final on a server the configuration given to the read
  does not name (removed or renamed), by server; with an operator or not, they count until they are final.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, TextClause, text

__all__ = [
    "Behind",
    "GateFigures",
    "LagFigures",
    "ShadowFigures",
    "SimulationFigures",
    "read_gate",
]

#: How long one gate's statements may run before Postgres cancels them.
STATEMENT_TIMEOUT_MS = 30_000


@dataclass(frozen=True, slots=True)
class Behind:
    """The rows behind a figure: the first ``names`` (at most the read's limit) and how many in all."""

    names: tuple[str, ...]
    total: int


@dataclass(frozen=True, slots=True)
class ShadowFigures:
    compared: int
    pending: int
    diverged: Behind


@dataclass(frozen=True, slots=True)
class SimulationFigures:
    id: int
    finished_at: dt.datetime
    seed: int
    series: int
    protocols: Any
    divergences: int
    second_operations: int
    max_receipts_per_call_node: int
    advances_without_receipt: int
    late_completions_advanced: int
    passed: bool


@dataclass(frozen=True, slots=True)
class LagFigures:
    """``count`` lags, their 99th percentile (None without any), the open ones among them, and the rows at
    or above the target."""

    count: int
    p99_s: float | None
    open: int
    over: Behind


@dataclass(frozen=True, slots=True)
class GateFigures:
    shadow: ShadowFigures
    simulation: SimulationFigures | None
    operations: int
    second_operations: int
    second_operation_ops: Behind
    cancel: LagFigures
    unknown: LagFigures
    overdue: Behind
    advances: int
    untraceable: Behind
    #: Operations not final on servers the configuration does not name, and those servers (``"server: N in
    #: flight"`` each; ``total``: how many servers).
    unconfigured_operations: int = 0
    unconfigured: Behind = field(default_factory=lambda: Behind((), 0))


def read_gate(
    engine: Engine,
    *,
    cancel_target_s: float,
    unknown_target_s: float,
    limit: int = 10,
    configured_servers: Sequence[str] | None = None,
) -> GateFigures:
    """Every ledger figure of one gate, from one snapshot; lists of what is behind a figure hold at most
    ``limit`` names. With ``configured_servers``, the operations in flight on any other server are read
    too (``unconfigured``)."""
    with engine.connect() as connection:
        conn = connection.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            conn.execute(text(f"SET LOCAL statement_timeout = {int(STATEMENT_TIMEOUT_MS)}"))
            conn.execute(text("SET TRANSACTION READ ONLY"))
            second_total, second_ops = _second_operations(conn, limit)
            unconfigured_total, unconfigured = (
                _unconfigured(conn, configured_servers, limit)
                if configured_servers is not None
                else (0, Behind((), 0))
            )
            advances, untraceable = _advances(conn, limit)
            return GateFigures(
                shadow=_shadow(conn, limit),
                simulation=_simulation(conn),
                operations=int(conn.execute(text("SELECT count(*) FROM tool_operation")).scalar_one()),
                second_operations=second_total,
                second_operation_ops=second_ops,
                cancel=_lags(conn, _CANCEL_LAGS, cancel_target_s, limit),
                unknown=_lags(conn, _UNKNOWN_AGES, unknown_target_s, limit),
                overdue=_overdue(conn, limit),
                advances=advances,
                untraceable=untraceable,
                unconfigured_operations=unconfigured_total,
                unconfigured=unconfigured,
            )


def _composed(*parts: str) -> TextClause:
    """A statement wrapped around one of this module's constant queries (no value is ever spliced in:
    values are bound)."""
    return text("".join(parts))


def _behind(rows: list[Any], total: int) -> Behind:
    return Behind(tuple(str(row[0]) for row in rows), total)


def _shadow(conn: Connection, limit: int) -> ShadowFigures:
    compared, pending, diverged = conn.execute(
        text(
            "SELECT count(*) FILTER (WHERE diverged IS NOT NULL), count(*) FILTER (WHERE diverged IS NULL), "
            "count(*) FILTER (WHERE diverged) FROM shadow_comparison"
        )
    ).one()
    rows = conn.execute(
        text(
            "SELECT 'call node ' || call_node_id || ' (legacy ' || legacy_terminal_state || ', longcall ' "
            "|| coalesce(longcall_terminal_state, '-') || ')' FROM shadow_comparison WHERE diverged "
            "ORDER BY compared_at, call_node_id LIMIT :limit"
        ),
        {"limit": limit},
    ).all()
    return ShadowFigures(int(compared), int(pending), _behind(list(rows), int(diverged)))


def _simulation(conn: Connection) -> SimulationFigures | None:
    row = (
        conn.execute(
            text(
                "SELECT id, finished_at, seed, series, protocols, divergences, second_operations, "
                "max_receipts_per_call_node, advances_without_receipt, late_completions_advanced, passed "
                "FROM simulation_run ORDER BY finished_at DESC, id DESC LIMIT 1"
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else SimulationFigures(**dict(row))


_SECOND_OPERATIONS = """
WITH per_op AS (
  SELECT e.op_id,
    count(*) FILTER (WHERE e.kind = 'create_attempted') AS attempts,
    count(*) FILTER (WHERE e.kind = 'create_refused_before_work') AS refused,
    count(*) FILTER (WHERE e.kind IN ('never_created', 'resolved_never_created')) AS proofs,
    array_remove(array_agg(DISTINCT e.detail->>'remote_id') FILTER (WHERE e.kind = 'created'), NULL)
      AS created_ids
  FROM operation_event e
  WHERE e.kind IN ('create_attempted', 'create_refused_before_work', 'never_created',
                   'resolved_never_created', 'created')
  GROUP BY e.op_id
), counted AS (
  SELECT o.id, o.call_node_id, o.server, o.created_at,
    greatest(
      0,
      p.attempts - 1 - p.refused - p.proofs,
      (SELECT count(DISTINCT r) FROM unnest(p.created_ids || o.remote_id) AS r WHERE r IS NOT NULL)
        - 1 - p.proofs
    ) AS extra
  FROM per_op p JOIN tool_operation o ON o.id = p.op_id
)
SELECT 'op ' || id || ' (call node ' || call_node_id || ', ' || server || ': ' || extra || ' more)' AS name,
  extra, count(*) OVER () AS ops, sum(extra) OVER () AS total
FROM counted WHERE extra > 0
ORDER BY created_at, id
LIMIT :limit
"""


def _second_operations(conn: Connection, limit: int) -> tuple[int, Behind]:
    rows = conn.execute(text(_SECOND_OPERATIONS), {"limit": limit}).all()
    if not rows:
        return 0, Behind((), 0)
    return int(rows[0].total), _behind(list(rows), int(rows[0].ops))


_CANCEL_LAGS = """
WITH requested AS (
  SELECT op_id, min(at) AS at FROM operation_event WHERE kind = 'cancel_requested' GROUP BY op_id
)
SELECT 'op ' || o.id || ' (call node ' || o.call_node_id || ', ' || o.server || ', '
    || CASE WHEN r.id IS NULL THEN 'no receipt yet, ' || o.state ELSE r.terminal_state END || ')' AS name,
  greatest(0.0, extract(epoch FROM coalesce(r.accepted_at, now()) - q.at)::float8) AS lag_s,
  r.id IS NULL AS open
FROM requested q JOIN tool_operation o ON o.id = q.op_id LEFT JOIN terminal_receipt r ON r.op_id = o.id
"""

_UNKNOWN_AGES = """
SELECT 'op ' || c.op_id || ' (record ' || c.id || ', ' || c.reason
    || CASE WHEN c.resolved_at IS NULL THEN ', open' ELSE ', resolved' END || ')' AS name,
  greatest(0.0, extract(epoch FROM coalesce(c.resolved_at, now()) - c.opened_at)::float8) AS lag_s,
  c.resolved_at IS NULL AS open
FROM reconciliation c
UNION ALL
SELECT 'op ' || o.id || ' (SUBMISSION_UNKNOWN, ' || o.server || ', resolved: ' || x.kind || ')' AS name,
  greatest(0.0, extract(epoch FROM x.at - e.at)::float8) AS lag_s,
  false AS open
FROM operation_event e
JOIN tool_operation o ON o.id = e.op_id
CROSS JOIN LATERAL (
  SELECT l.kind, l.at, l.to_state FROM operation_event l
  WHERE l.op_id = e.op_id AND l.seq > e.seq AND l.from_state = 'SUBMISSION_UNKNOWN'
    AND l.to_state IS DISTINCT FROM 'SUBMISSION_UNKNOWN'
  ORDER BY l.seq LIMIT 1
) x
WHERE e.to_state = 'SUBMISSION_UNKNOWN' AND e.from_state IS DISTINCT FROM 'SUBMISSION_UNKNOWN'
  AND x.to_state IS DISTINCT FROM 'MANUAL_RECONCILIATION'
UNION ALL
SELECT 'op ' || o.id || ' (SUBMISSION_UNKNOWN, ' || o.server || ')' AS name,
  greatest(0.0, extract(epoch FROM now() - coalesce(
    (SELECT max(e.at) FROM operation_event e
     WHERE e.op_id = o.id AND e.to_state = o.state AND e.from_state IS DISTINCT FROM o.state),
    o.updated_at))::float8) AS lag_s,
  true AS open
FROM tool_operation o
WHERE o.state = 'SUBMISSION_UNKNOWN'
  AND NOT EXISTS (SELECT 1 FROM reconciliation c WHERE c.op_id = o.id AND c.resolved_at IS NULL)
"""


def _lags(conn: Connection, lags_sql: str, target_s: float, limit: int) -> LagFigures:
    count, p99, open_ = conn.execute(
        _composed(
            "SELECT count(*), percentile_disc(0.99) WITHIN GROUP (ORDER BY lag_s), "
            "count(*) FILTER (WHERE open) FROM (",
            lags_sql,
            ") AS lags",
        )
    ).one()
    over = conn.execute(
        _composed(
            "SELECT name || ': ' || round(lag_s::numeric, 1) || ' s', count(*) OVER () FROM (",
            lags_sql,
            ") AS lags WHERE lag_s >= :target ORDER BY lag_s DESC, name LIMIT :limit",
        ),
        {"target": target_s, "limit": limit},
    ).all()
    total = int(over[0][1]) if over else 0
    return LagFigures(int(count), None if p99 is None else float(p99), int(open_), _behind(list(over), total))


def _overdue(conn: Connection, limit: int) -> Behind:
    rows = conn.execute(
        text(
            "SELECT 'op ' || op_id || ' (record ' || id || ', ' || reason || ', deadline ' "
            "|| to_char(deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') || ')', "
            "count(*) OVER () FROM reconciliation WHERE resolved_at IS NULL AND deadline < now() "
            "ORDER BY deadline, id LIMIT :limit"
        ),
        {"limit": limit},
    ).all()
    return _behind(list(rows), int(rows[0][1]) if rows else 0)


_ADVANCES = """
SELECT x.id, x.op_id,
  (r.id IS NOT NULL AND r.op_id = x.op_id AND x.payload->'receipt'->>'receipt_id' = r.id::text) AS traceable
FROM outbox x JOIN tool_operation o ON o.id = x.op_id LEFT JOIN terminal_receipt r ON r.id = x.receipt_id
WHERE x.kind = 'terminal' AND x.status = 'dispatched' AND o.routing = 'live'
"""


def _advances(conn: Connection, limit: int) -> tuple[int, Behind]:
    total, untraceable = conn.execute(
        _composed("SELECT count(*), count(*) FILTER (WHERE NOT traceable) FROM (", _ADVANCES, ") AS a")
    ).one()
    rows = conn.execute(
        _composed(
            "SELECT 'outbox ' || id || ' (op ' || op_id || ')' FROM (",
            _ADVANCES,
            ") AS a WHERE NOT traceable ORDER BY id LIMIT :limit",
        ),
        {"limit": limit},
    ).all()
    return int(total), _behind(list(rows), int(untraceable))


def _unconfigured(conn: Connection, configured: Sequence[str], limit: int) -> tuple[int, Behind]:
    rows = conn.execute(
        text(
            "SELECT server || ': ' || count(*) || ' in flight', sum(count(*)) OVER (), count(*) OVER () "
            "FROM tool_operation WHERE state NOT IN ('ACCEPTED', 'CANCELLED_ACCEPTED') "
            "AND server <> ALL(:configured) GROUP BY server ORDER BY server LIMIT :limit"
        ),
        {"configured": list(configured), "limit": limit},
    ).all()
    if not rows:
        return 0, Behind((), 0)
    return int(rows[0][1]), _behind(list(rows), int(rows[0][2]))
