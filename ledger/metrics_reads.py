"""What ``longcall metrics`` reads from the ledger at scrape time: counts and ages, and two lag histograms.

Read-only, in one REPEATABLE READ transaction (every figure of one scrape comes from one snapshot) under a
statement timeout, so a scrape never holds or waits on a worker's lock for long. Aggregation happens in
Postgres: a scrape moves a few rows whatever the size of the ledger.

What the figures mean (docs/operating.md, "Observability", lists the metrics built from them):

- UNKNOWN: operations in SUBMISSION_UNKNOWN or MANUAL_RECONCILIATION: those whose outcome no rule has
  decided (a lost create answer, or an operator's case). Their age runs from the event that moved them
  into that state (``updated_at`` when no such event is left).
- Cancel confirmation lag: from the first ``cancel_requested`` event of an operation to its cancelled
  receipt's ``accepted_at``. Operations that ended cancelled without a cancel request (the server cancelled
  on its own) are not in it; neither is a cancel that lost the race to a completion.
- Terminal detection lag: the ledger does not keep the server's own time of the end (a server's clock is
  not ours either), so this is the window polling leaves open: from the last moment the ledger knew the
  operation open (its last unchanged poll, ``last_polled_at``, or the event before, whichever is later) to
  the ``terminal_observed`` event. The server ended the operation somewhere in that window: an upper
  bound of the detection lag, driven by the poll interval. Only operations that were polled
  (``terminal_observed`` from WORKING, INPUT_REQUIRED or CANCEL_REQUESTED) count; a create that answered
  with the end itself has no lag.

Both histograms lose the operations whose events the retention removed (``LONGCALL_EVENT_RETENTION_S``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Float, and_, case, cast, func, literal, select, text

from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.statements import EVENT, OP, OUTBOX, RECEIPT, RECON
from ledger.states import OpState, TerminalKind

__all__ = [
    "DURATION_BUCKETS_S",
    "LAG_BUCKETS_S",
    "UNKNOWN_STATES",
    "CreateCount",
    "LagHistogram",
    "LedgerMetrics",
    "OperationCount",
    "OutboxDead",
    "OutboxLag",
    "ReceiptCount",
    "ReconciliationCount",
    "UnknownOperations",
    "read_metrics",
]

#: The states whose operations are UNKNOWN: no rule has decided their outcome yet.
UNKNOWN_STATES: tuple[OpState, ...] = (OpState.SUBMISSION_UNKNOWN, OpState.MANUAL_RECONCILIATION)

#: The lag histograms' upper bounds, in seconds (a poll interval is ~1 s, a gate 15 minutes).
LAG_BUCKETS_S: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)

#: The operation-duration histogram's upper bounds, in seconds (a report runs minutes, an export hours).
DURATION_BUCKETS_S: tuple[float, ...] = (
    1.0,
    5.0,
    15.0,
    60.0,
    300.0,
    900.0,
    1800.0,
    3600.0,
    14_400.0,
    86_400.0,
)

#: States a poll runs in: a terminal observed from one of them was found by polling.
_POLLED_FROM = (OpState.WORKING, OpState.INPUT_REQUIRED, OpState.CANCEL_REQUESTED)

#: How long one scrape's statements may run before Postgres cancels them.
STATEMENT_TIMEOUT_MS = 10_000


@dataclass(frozen=True, slots=True)
class OperationCount:
    server: str
    protocol: str
    state: str
    count: int


@dataclass(frozen=True, slots=True)
class UnknownOperations:
    server: str
    count: int
    oldest_age_s: float


@dataclass(frozen=True, slots=True)
class OutboxLag:
    kind: str
    ready: int
    oldest_age_s: float


@dataclass(frozen=True, slots=True)
class OutboxDead:
    """Dead-lettered outbox rows of one kind (rule 9): not published after their bounded attempts."""

    kind: str
    dead: int


@dataclass(frozen=True, slots=True)
class ReconciliationCount:
    reason: str
    open: int
    overdue: int


@dataclass(frozen=True, slots=True)
class LagHistogram:
    """One server's lags: ``buckets`` are (upper bound, how many lags were at most that), cumulative."""

    server: str
    count: int
    sum_s: float
    buckets: tuple[tuple[float, int], ...]


@dataclass(frozen=True, slots=True)
class ReceiptCount:
    """Receipts accepted so far of one server, protocol and terminal state (a counter: receipts are kept)."""

    server: str
    protocol: str
    terminal_state: str
    count: int


@dataclass(frozen=True, slots=True)
class CreateCount:
    """Operations a create was attempted for, of one server and protocol (a counter: rows are kept)."""

    server: str
    protocol: str
    count: int


@dataclass(frozen=True, slots=True)
class LedgerMetrics:
    operations: tuple[OperationCount, ...]
    unknown: tuple[UnknownOperations, ...]
    outbox: tuple[OutboxLag, ...]
    reconciliations: tuple[ReconciliationCount, ...]
    cancel_lag: tuple[LagHistogram, ...]
    detection_lag: tuple[LagHistogram, ...]
    outbox_dead: tuple[OutboxDead, ...] = ()
    receipts: tuple[ReceiptCount, ...] = ()
    creates: tuple[CreateCount, ...] = ()
    #: Outbox rows ever dead-lettered (each opened an OUTBOX_UNDELIVERABLE record; records are kept).
    outbox_dead_total: int = 0
    #: From an operation's submission to its receipt, per server.
    duration: tuple[LagHistogram, ...] = ()


def read_metrics(engine: Engine, *, buckets: Sequence[float] = LAG_BUCKETS_S) -> LedgerMetrics:
    """Every ledger figure of one scrape, from one snapshot."""
    bounds = tuple(sorted(float(b) for b in buckets))
    with engine.connect() as connection:
        conn = connection.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            conn.execute(text(f"SET LOCAL statement_timeout = {int(STATEMENT_TIMEOUT_MS)}"))
            conn.execute(text("SET TRANSACTION READ ONLY"))
            return LedgerMetrics(
                operations=_operations(conn),
                unknown=_unknown(conn),
                outbox=_outbox(conn),
                reconciliations=_reconciliations(conn),
                cancel_lag=_histograms(conn, _cancel_lags(), bounds),
                detection_lag=_histograms(conn, _detection_lags(), bounds),
                outbox_dead=_outbox_dead(conn),
                receipts=_receipts(conn),
                creates=_creates(conn),
                outbox_dead_total=_outbox_dead_total(conn),
                duration=_histograms(conn, _durations(), DURATION_BUCKETS_S),
            )


def _seconds(interval: Any) -> Any:
    return cast(func.extract("epoch", interval), Float)


def _operations(conn: Connection) -> tuple[OperationCount, ...]:
    rows = conn.execute(
        select(OP.c.server, OP.c.protocol, OP.c.state, func.count())
        .group_by(OP.c.server, OP.c.protocol, OP.c.state)
        .order_by(OP.c.server, OP.c.protocol, OP.c.state)
    ).all()
    return tuple(OperationCount(server, protocol, state, int(n)) for server, protocol, state, n in rows)


def _unknown(conn: Connection) -> tuple[UnknownOperations, ...]:
    entered = (
        select(func.max(EVENT.c.at))
        .where(
            EVENT.c.op_id == OP.c.id,
            EVENT.c.to_state == OP.c.state,
            EVENT.c.from_state.is_distinct_from(OP.c.state),
        )
        .scalar_subquery()
    )
    since = func.coalesce(entered, OP.c.updated_at)
    rows = conn.execute(
        select(OP.c.server, func.count(), func.max(_seconds(func.now() - since)))
        .where(OP.c.state.in_([s.value for s in UNKNOWN_STATES]))
        .group_by(OP.c.server)
        .order_by(OP.c.server)
    ).all()
    return tuple(UnknownOperations(server, int(n), max(0.0, float(age or 0.0))) for server, n, age in rows)


def _outbox(conn: Connection) -> tuple[OutboxLag, ...]:
    rows = conn.execute(
        select(OUTBOX.c.kind, func.count(), func.max(_seconds(func.now() - OUTBOX.c.created_at)))
        .where(OUTBOX.c.status == "ready")
        .group_by(OUTBOX.c.kind)
        .order_by(OUTBOX.c.kind)
    ).all()
    return tuple(OutboxLag(kind, int(n), max(0.0, float(age or 0.0))) for kind, n, age in rows)


def _outbox_dead(conn: Connection) -> tuple[OutboxDead, ...]:
    rows = conn.execute(
        select(OUTBOX.c.kind, func.count())
        .where(OUTBOX.c.status == "dead")
        .group_by(OUTBOX.c.kind)
        .order_by(OUTBOX.c.kind)
    ).all()
    return tuple(OutboxDead(kind, int(n)) for kind, n in rows)


def _receipts(conn: Connection) -> tuple[ReceiptCount, ...]:
    rows = conn.execute(
        select(OP.c.server, OP.c.protocol, RECEIPT.c.terminal_state, func.count())
        .select_from(RECEIPT.join(OP, OP.c.id == RECEIPT.c.op_id))
        .group_by(OP.c.server, OP.c.protocol, RECEIPT.c.terminal_state)
        .order_by(OP.c.server, OP.c.protocol, RECEIPT.c.terminal_state)
    ).all()
    return tuple(ReceiptCount(server, protocol, state, int(n)) for server, protocol, state, n in rows)


def _creates(conn: Connection) -> tuple[CreateCount, ...]:
    rows = conn.execute(
        select(OP.c.server, OP.c.protocol, func.count())
        .where(OP.c.submit_attempted_at.is_not(None))
        .group_by(OP.c.server, OP.c.protocol)
        .order_by(OP.c.server, OP.c.protocol)
    ).all()
    return tuple(CreateCount(server, protocol, int(n)) for server, protocol, n in rows)


def _outbox_dead_total(conn: Connection) -> int:
    reason = ReconciliationReason.OUTBOX_UNDELIVERABLE.value
    return int(conn.execute(select(func.count()).where(RECON.c.reason == reason)).scalar_one())


def _durations() -> Any:
    """(server, lag_s) per operation with a receipt: from its submission to the receipt's acceptance."""
    return (
        select(
            OP.c.server.label("server"),
            func.greatest(literal(0.0), _seconds(RECEIPT.c.accepted_at - OP.c.created_at)).label("lag_s"),
        )
        .select_from(RECEIPT.join(OP, OP.c.id == RECEIPT.c.op_id))
        .subquery("lags")
    )


def _reconciliations(conn: Connection) -> tuple[ReconciliationCount, ...]:
    rows = conn.execute(
        select(
            RECON.c.reason,
            func.count(),
            func.count().filter(RECON.c.deadline < func.now()),
        )
        .where(RECON.c.resolved_at.is_(None))
        .group_by(RECON.c.reason)
        .order_by(RECON.c.reason)
    ).all()
    return tuple(ReconciliationCount(reason, int(n), int(late)) for reason, n, late in rows)


def _cancel_lags() -> Any:
    """(server, lag_s) per operation with a cancelled receipt and a cancel request."""
    requested = (
        select(EVENT.c.op_id, func.min(EVENT.c.at).label("at"))
        .where(EVENT.c.kind == EventKind.CANCEL_REQUESTED.value)
        .group_by(EVENT.c.op_id)
        .subquery("requested")
    )
    return (
        select(
            OP.c.server.label("server"),
            func.greatest(literal(0.0), _seconds(RECEIPT.c.accepted_at - requested.c.at)).label("lag_s"),
        )
        .select_from(
            RECEIPT.join(OP, OP.c.id == RECEIPT.c.op_id).join(requested, requested.c.op_id == OP.c.id)
        )
        .where(RECEIPT.c.terminal_state == TerminalKind.CANCELLED.value)
        .subquery("lags")
    )


def _detection_lags() -> Any:
    """(server, lag_s) per operation whose end a poll observed: see the module's docstring."""
    observed = (
        select(EVENT.c.op_id, func.min(EVENT.c.seq).label("seq"))
        .where(
            EVENT.c.kind == EventKind.TERMINAL_OBSERVED.value,
            EVENT.c.from_state.in_([s.value for s in _POLLED_FROM]),
        )
        .group_by(EVENT.c.op_id)
        .subquery("observed")
    )
    seen = EVENT.alias("seen")
    before = EVENT.alias("before")
    last_known_event = (
        select(func.max(before.c.at))
        .where(before.c.op_id == seen.c.op_id, before.c.seq < seen.c.seq)
        .scalar_subquery()
    )
    last_poll = case((OP.c.last_polled_at < seen.c.at, OP.c.last_polled_at), else_=None)
    open_until = func.greatest(last_known_event, last_poll)
    return (
        select(
            OP.c.server.label("server"),
            func.greatest(literal(0.0), _seconds(seen.c.at - open_until)).label("lag_s"),
        )
        .select_from(
            observed.join(seen, and_(seen.c.op_id == observed.c.op_id, seen.c.seq == observed.c.seq)).join(
                OP, OP.c.id == observed.c.op_id
            )
        )
        .where(open_until.is_not(None))
        .subquery("lags")
    )


def _histograms(conn: Connection, lags: Any, bounds: tuple[float, ...]) -> tuple[LagHistogram, ...]:
    columns = [func.count().filter(lags.c.lag_s <= bound) for bound in bounds]
    rows = conn.execute(
        select(lags.c.server, func.count(), func.coalesce(func.sum(lags.c.lag_s), 0.0), *columns)
        .group_by(lags.c.server)
        .order_by(lags.c.server)
    ).all()
    return tuple(
        LagHistogram(
            server=row[0],
            count=int(row[1]),
            sum_s=float(row[2]),
            buckets=tuple((bound, int(n)) for bound, n in zip(bounds, row[3:], strict=True)),
        )
        for row in rows
    )
