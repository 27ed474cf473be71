"""The only port to the ledger database. Every public method is one transaction.

Every write that depends on where an operation stands is one guarded statement: ``UPDATE ... WHERE id = :id
AND state IN (:allowed) AND execution_epoch = :epoch AND cancel_generation = :gen [AND poll_cursor = :cursor]
RETURNING``. Zero rows is a stale writer: the refusal is recorded as an event in the same transaction, nothing
else changes, and :class:`StaleTransition` is raised after the commit (rule 5).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from sqlalchemy import (
    ClauseElement,
    Connection,
    Engine,
    Interval,
    Row,
    Table,
    bindparam,
    create_engine,
    func,
    insert,
    literal,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger import models
from ledger.digests import digest
from ledger.errors import (
    AdapterDisabled,
    AdmissionClosed,
    CallNodeConflict,
    OperationNotFound,
    StaleTransition,
)
from ledger.reasons import ReconciliationReason
from ledger.states import (
    ACCEPT_FROM,
    ACCEPT_TO,
    FINAL_STATES,
    NEVER_POLLED,
    IllegalTransition,
    OpState,
    TerminalKind,
    check_edges,
)

OP = cast(Table, models.ToolOperation.__table__)
EVENT = cast(Table, models.OperationEvent.__table__)
RECEIPT = cast(Table, models.TerminalReceipt.__table__)
OUTBOX = cast(Table, models.Outbox.__table__)
RECON = cast(Table, models.Reconciliation.__table__)
CONTROL = cast(Table, models.ExecutorControl.__table__)
CONTROL_AUDIT = cast(Table, models.ExecutorControlAudit.__table__)

CLAIM_DELAY = func.greatest(0, func.extract("epoch", OP.c.next_poll_at - func.now())).label("delay_s")
CLAIM_COLUMNS = (
    OP.c.id,
    OP.c.state,
    OP.c.poll_cursor,
    OP.c.execution_epoch,
    OP.c.cancel_generation,
    OP.c.lease_until,
    CLAIM_DELAY,
)

#: Columns a guarded write may set through ``values``. Identity, fencing and bookkeeping columns are
#: changed only by the dedicated code paths (state, generation bump, cursor claim, acceptance).
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


_Built = TypeVar("_Built")


class _Statements:
    """The ledger's hot statements, each built once per shape with a bind parameter for every value.

    Building a SQLAlchemy statement and deriving the cache key that finds its compiled form cost more CPU than
    running it; a statement built once keeps its key, so a call only binds its values. The shapes are few
    (the distinct column sets and flags the code writes with), so the cache stays small.
    """

    def __init__(self) -> None:
        self._built: dict[tuple[Hashable, ...], Any] = {}

    def get(self, build: Callable[..., _Built], *shape: Hashable) -> _Built:
        """``build(*shape)``, built on first use; ``build`` is a module-level function, part of the key."""
        key = (build, *shape)
        statement = self._built.get(key)
        if statement is None:
            statement = self._built.setdefault(key, build(*shape))
        return cast(_Built, statement)


STATEMENTS = _Statements()


def normalize_database_url(url: str) -> str:
    """Accept the usual ``postgresql://`` spellings and pin the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ValueError(
        f"LONGCALL_DATABASE_URL must be a postgresql:// URL, got {url.split('://', maxsplit=1)[0]}://..."
    )


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    return create_engine(
        normalize_database_url(url),
        # No pre-ping: it would double every ledger transaction. A connection the server dropped fails
        # its statement once (SQLAlchemy then discards the pool's stale connections) and the step is
        # retried under a new claim when its lease runs out; recycling bounds how old a connection gets.
        pool_recycle=600,
        pool_size=pool_size,
        max_overflow=pool_size,
        future=True,
    )


@dataclass(frozen=True, slots=True)
class Fence:
    """What a writer believes: its epoch and cancel generation, and the poll cursor it holds."""

    execution_epoch: int
    cancel_generation: int
    poll_cursor: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Operation:
    """A snapshot of one ``tool_operation`` row."""

    id: uuid.UUID
    call_node_id: str
    request_digest: str
    tool_name: str
    tool_descriptor_version: str | None
    body: Any
    server: str
    protocol: str
    protocol_version: str
    adapter_version: str
    remote_id: str | None
    session_ref: str | None
    submission_key: uuid.UUID
    submit_attempted_at: dt.datetime | None
    state: OpState
    server_state: str | None
    observed_terminal: TerminalKind | None
    status_message: str | None
    poll_cursor: int
    next_poll_at: dt.datetime | None
    poll_interval_ms: int | None
    lease_until: dt.datetime | None
    ttl_ms: int | None
    wait_deadline: dt.datetime | None
    expires_at: dt.datetime | None
    input_round: int
    input_request: Any
    input_schema_digest: str | None
    input_deadline: dt.datetime | None
    cancel_generation: int
    execution_epoch: int
    result: Any
    result_digest: str | None
    on_terminal: Any
    on_input: Any
    created_at: dt.datetime
    updated_at: dt.datetime
    event_seq: int

    @classmethod
    def from_row(cls, row: Row[Any] | Mapping[str, Any]) -> Operation:
        data = row._mapping if isinstance(row, Row) else row
        values = {name: data[name] for name in _OPERATION_FIELDS}
        values["state"] = OpState(values["state"])
        if values["observed_terminal"] is not None:
            values["observed_terminal"] = TerminalKind(values["observed_terminal"])
        return cls(**values)

    @property
    def fence(self) -> Fence:
        return Fence(self.execution_epoch, self.cancel_generation, self.poll_cursor)

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES


_OPERATION_FIELDS = tuple(f.name for f in dataclasses.fields(Operation))


@dataclass(frozen=True, slots=True)
class NewOperation:
    """What ``longcall.submit`` records before any remote call (rule 1)."""

    call_node_id: str
    request_digest: str
    server: str
    protocol: str
    protocol_version: str
    adapter_version: str
    tool_name: str
    body: Any
    on_terminal: Any = None
    on_input: Any = None
    ttl_ms: int | None = None
    wait_budget_s: float | None = None
    tool_descriptor_version: str | None = None


@dataclass(frozen=True, slots=True)
class NewReconciliation:
    """A reconciliation record opened in the same transaction as the write that needs it."""

    reason: ReconciliationReason
    deadline: dt.timedelta
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Submission:
    operation: Operation
    created: bool


@dataclass(frozen=True, slots=True)
class Claim:
    """A due operation claimed by ``claim_due``: work on it under this cursor, before the lease runs out."""

    op_id: uuid.UUID
    state: OpState
    poll_cursor: int
    execution_epoch: int
    cancel_generation: int
    lease_until: dt.datetime
    #: Seconds until the step is due (0 when it is due already).
    delay_s: float = 0.0

    @classmethod
    def from_row(cls, row: Row[Any]) -> Claim:
        return cls(
            row.id,
            OpState(row.state),
            row.poll_cursor,
            row.execution_epoch,
            row.cancel_generation,
            row.lease_until,
            float(row.delay_s or 0.0),
        )

    @property
    def fence(self) -> Fence:
        return Fence(self.execution_epoch, self.cancel_generation, self.poll_cursor)


@dataclass(frozen=True, slots=True)
class TerminalEvidence:
    """Everything rule 8 matches before a receipt is written."""

    call_node_id: str
    request_digest: str
    remote_id: str | None
    tool_descriptor_version: str | None
    execution_epoch: int
    cancel_generation: int
    terminal_state: TerminalKind
    result: Any = None
    result_digest: str | None = None
    #: Kept on the receipt for audit only: what a cancelled task left, or what to know about the evidence
    #: (e.g. a result whose task id the server did not confirm).
    audit: Any = None


@dataclass(frozen=True, slots=True)
class Receipt:
    id: uuid.UUID
    op_id: uuid.UUID
    call_node_id: str
    request_digest: str
    remote_id: str | None
    tool_descriptor_version: str | None
    execution_epoch: int
    cancel_generation: int
    terminal_state: TerminalKind
    result_digest: str | None
    audit: Any
    accepted_at: dt.datetime

    @classmethod
    def from_row(cls, row: Row[Any], *, prefix: str = "") -> Receipt:
        data = row._mapping
        values = {f.name: data[prefix + f.name] for f in dataclasses.fields(cls)}
        values["terminal_state"] = TerminalKind(values["terminal_state"])
        return cls(**values)


AcceptanceOutcome = Literal["accepted", "already_accepted", "rejected", "effect_reconciliation"]


@dataclass(frozen=True, slots=True)
class Acceptance:
    outcome: AcceptanceOutcome
    receipt: Receipt | None = None
    outbox_id: int | None = None
    mismatches: tuple[str, ...] = ()

    @property
    def accepted(self) -> bool:
        return self.outcome == "accepted"


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    id: int
    kind: str
    op_id: uuid.UUID
    input_round: int | None
    payload: Any
    attempts: int


@dataclass(frozen=True, slots=True)
class DrainReport:
    dispatched: tuple[int, ...]
    failed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ControlState:
    execution_epoch: int
    admission_open: bool
    disabled_adapters: tuple[str, ...]
    rollout: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ReconciliationRecord:
    id: int
    op_id: uuid.UUID
    reason: ReconciliationReason
    opened_at: dt.datetime
    deadline: dt.datetime
    resolved_at: dt.datetime | None
    resolution: str | None
    detail: Any


def adapter_key(protocol: str, protocol_version: str) -> str:
    return f"{protocol}/{protocol_version}"


class Ledger:
    """The repository. Construct it with an engine; every method owns exactly one transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_url(cls, url: str, *, pool_size: int = 5) -> Ledger:
        return cls(make_engine(url, pool_size=pool_size))

    def dispose(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    # ----------------------------------------------------------------------------------------- submit

    def record_submission(self, new: NewOperation, *, lease_s: float | None = None) -> Submission:
        """Insert the SUBMITTING row, or return the call node's existing operation (rule 1).

        Same call node and same request digest is the existing operation, never a second one; the same call
        node with a different digest raises :class:`CallNodeConflict`. The submission key is chosen here,
        once, and never regenerated. The new row is due at once; with ``lease_s`` it is also claimed by the
        caller (cursor 1), so the submitting worker can make the create call itself, and a crash before that
        leaves it to the dispatcher when the lease runs out.
        """
        with self._tx() as conn:
            control = self._control(conn)
            refusal: Exception | None = None
            if not control.admission_open:
                refusal = AdmissionClosed()
            elif adapter_key(new.protocol, new.protocol_version) in control.disabled_adapters:
                refusal = AdapterDisabled(new.protocol, new.protocol_version)
            if refusal is None:
                # Inserted unless the call node has its operation already (then it is read below): the usual
                # case, a new call node, costs no read first.
                row = conn.execute(
                    STATEMENTS.get(_insert_operation),
                    {
                        "new_id": uuid.uuid4(),
                        "new_call_node_id": new.call_node_id,
                        "new_request_digest": new.request_digest,
                        "new_tool_name": new.tool_name,
                        "new_tool_descriptor_version": new.tool_descriptor_version,
                        "new_body": new.body,
                        "new_server": new.server,
                        "new_protocol": new.protocol,
                        "new_protocol_version": new.protocol_version,
                        "new_adapter_version": new.adapter_version,
                        "new_submission_key": uuid.uuid4(),
                        "new_ttl_ms": new.ttl_ms,
                        # NULL intervals leave NULL deadlines: no wait budget, no lease.
                        "new_wait_budget": _interval(new.wait_budget_s),
                        "new_execution_epoch": control.execution_epoch,
                        "new_on_terminal": new.on_terminal,
                        "new_on_input": new.on_input,
                        "new_poll_cursor": 1 if lease_s is not None else 0,
                        "new_lease": _interval(lease_s),
                        "event_detail": {"server": new.server},
                    },
                ).first()
                if row is not None:
                    # The ``submitted`` event went in with the row, in the same statement.
                    return Submission(Operation.from_row(row), created=True)
            existing = self._find_by_call_node(conn, new.call_node_id)
            if existing is None:
                if refusal is not None:
                    raise refusal
                # The insert conflicted, so the row is committed and can be read.
                raise LookupError(
                    f"call node {new.call_node_id!r} conflicted but cannot be read"
                )  # pragma: no cover
            if existing.request_digest != new.request_digest:
                raise CallNodeConflict(new.call_node_id, existing.request_digest, new.request_digest)
            return Submission(existing, created=False)

    # ------------------------------------------------------------------------------------------- reads

    def get(self, op_id: uuid.UUID) -> Operation:
        with self._tx() as conn:
            row = conn.execute(STATEMENTS.get(_operation_by_id), {"op_id": op_id}).first()
        if row is None:
            raise OperationNotFound(op_id)
        return Operation.from_row(row)

    def find_by_call_node(self, call_node_id: str) -> Operation | None:
        with self._tx() as conn:
            return self._find_by_call_node(conn, call_node_id)

    def find_by_remote(self, server: str, remote_id: str) -> Operation | None:
        with self._tx() as conn:
            row = conn.execute(select(OP).where(OP.c.server == server, OP.c.remote_id == remote_id)).first()
        return Operation.from_row(row) if row is not None else None

    def find_by_submission_key(self, submission_key: uuid.UUID) -> Operation | None:
        with self._tx() as conn:
            row = conn.execute(select(OP).where(OP.c.submission_key == submission_key)).first()
        return Operation.from_row(row) if row is not None else None

    def events(self, op_id: uuid.UUID) -> list[dict[str, Any]]:
        with self._tx() as conn:
            rows = conn.execute(select(EVENT).where(EVENT.c.op_id == op_id).order_by(EVENT.c.seq)).all()
        return [dict(r._mapping) for r in rows]

    def receipt_for(self, op_id: uuid.UUID) -> Receipt | None:
        with self._tx() as conn:
            row = conn.execute(select(RECEIPT).where(RECEIPT.c.op_id == op_id)).first()
        return Receipt.from_row(row) if row is not None else None

    @staticmethod
    def _find_by_call_node(conn: Connection, call_node_id: str) -> Operation | None:
        row = conn.execute(STATEMENTS.get(_operation_by_call_node), {"call_node_id": call_node_id}).first()
        return Operation.from_row(row) if row is not None else None

    # ----------------------------------------------------------------------------- guarded transitions

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
        """Move the operation along one edge of the state table, or record a stale write and raise.

        ``then`` continues along a second edge in the same statement (two events, one transaction): for a
        step that always follows another, e.g. TERMINAL_OBSERVED -> FETCHING_RESULT.

        In the same transaction: ``reconcile`` opens a reconciliation record, ``input_outbox`` writes the
        approval gate's ``input_required`` outbox row for the row's new ``input_round``, and ``resolve``
        closes the operation's open reconciliation records with that resolution. ``input_round`` adds
        ``input_round = :round`` to the guard (a reply is accepted only for the current round).
        """
        sources = check_edges(from_states, to)
        if then is not None:
            check_edges([to], then)
        if to in FINAL_STATES or then in FINAL_STATES:
            raise IllegalTransition(f"{then or to} is reached only through accept_terminal (rule 8)")
        sets = _checked_values(values)
        if to in NEVER_POLLED:
            sets.setdefault("next_poll_at", None)
            sets.setdefault("lease_until", None)
        return self._guarded_write(
            op_id,
            fence,
            in_states=sources,
            to_state=to,
            sets=sets,
            event=event,
            detail=detail,
            bump_generation=bump_generation,
            input_round=input_round,
            reconcile=reconcile,
            input_outbox=input_outbox,
            resolve=resolve,
            then=then,
        )

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
        """A guarded write that keeps the state (e.g. a poll's bookkeeping). Final rows never change."""
        states = tuple(in_states)
        final = [s for s in states if s in FINAL_STATES]
        if final or not states:
            raise IllegalTransition(
                f"a final operation never changes (asked to update in {final or 'no'} state)"
            )
        return self._guarded_write(
            op_id,
            fence,
            in_states=states,
            to_state=None,
            sets=_checked_values(values),
            event=event,
            detail=detail,
            bump_generation=bump_generation,
        )

    def _guarded_write(
        self,
        op_id: uuid.UUID,
        fence: Fence,
        *,
        in_states: Sequence[OpState],
        to_state: OpState | None,
        sets: dict[str, Any],
        event: str,
        detail: Mapping[str, Any] | None,
        bump_generation: bool,
        input_round: int | None = None,
        reconcile: NewReconciliation | None = None,
        input_outbox: Mapping[str, Any] | None = None,
        resolve: str | None = None,
        then: OpState | None = None,
    ) -> Operation:
        stale: StaleTransition | None = None
        shape = _WriteShape(
            columns=tuple(sorted((name, isinstance(value, DueIn)) for name, value in sets.items())),
            to_state=to_state is not None,
            two_edges=then is not None,
            bump_generation=bump_generation,
            with_cursor=fence.poll_cursor is not None,
            with_round=input_round is not None,
        )
        params: dict[str, Any] = {
            "fence_id": op_id,
            "fence_states": [s.value for s in in_states],
            "fence_epoch": fence.execution_epoch,
            "fence_generation": fence.cancel_generation,
            "fence_cursor": fence.poll_cursor,
            "fence_round": input_round,
            "new_state": (then or to_state).value if to_state is not None else None,
            "event_kind": event,
            "event_detail": dict(detail or {}),
            "halfway_state": to_state.value if then is not None and to_state is not None else None,
            "then_kind": then.value.lower() if then is not None else None,
        }
        inline: dict[str, Any] = {}
        for name, value in sets.items():
            if isinstance(value, ClauseElement):
                inline[name] = value  # SQL of the caller's own: built for this call only
            else:
                params[f"new_{name}"] = value.interval() if isinstance(value, DueIn) else value
        with self._tx() as conn:
            statement = _guarded_update(shape, inline) if inline else STATEMENTS.get(_guarded_update, shape)
            row = conn.execute(statement, params).first()
            if row is not None:
                op = Operation.from_row(row)  # its event (or two) went in with the same statement
                if reconcile is not None:
                    self._open_reconciliation(
                        conn, op, reconcile.reason, reconcile.deadline, reconcile.detail
                    )
                if input_outbox is not None:
                    conn.execute(
                        insert(OUTBOX).values(
                            kind="input_required",
                            op_id=op.id,
                            input_round=op.input_round,
                            payload=dict(input_outbox),
                        )
                    )
                if resolve is not None:
                    conn.execute(
                        update(RECON)
                        .where(RECON.c.op_id == op.id, RECON.c.resolved_at.is_(None))
                        .values(resolved_at=func.now(), resolution=resolve)
                    )
                return op
            stale = self._record_stale(
                conn,
                op_id,
                attempted=event,
                to_state=to_state,
                expected={
                    "state": sorted(s.value for s in in_states),
                    **fence.as_dict(),
                    **({"input_round": input_round} if input_round is not None else {}),
                },
                detail=detail,
            )
        raise stale

    def _record_stale(
        self,
        conn: Connection,
        op_id: uuid.UUID,
        *,
        attempted: str,
        to_state: OpState | None,
        expected: dict[str, Any],
        detail: Mapping[str, Any] | None,
    ) -> StaleTransition:
        """Append a ``stale_write_rejected`` event; the row itself only advances its event counter."""
        current = conn.execute(
            update(OP)
            .where(OP.c.id == op_id)
            .values(event_seq=OP.c.event_seq + 1)
            .returning(
                OP.c.event_seq,
                OP.c.state,
                OP.c.server_state,
                OP.c.execution_epoch,
                OP.c.cancel_generation,
                OP.c.poll_cursor,
                OP.c.input_round,
            )
        ).first()
        if current is None:
            raise OperationNotFound(op_id)
        found = {
            "state": current.state,
            "execution_epoch": current.execution_epoch,
            "cancel_generation": current.cancel_generation,
            "poll_cursor": current.poll_cursor,
            "input_round": current.input_round,
        }
        if expected.get("poll_cursor") is None:
            expected = {k: v for k, v in expected.items() if k != "poll_cursor"}
        if isinstance(expected.get("state"), list) and current.state in expected["state"]:
            expected = {**expected, "state": current.state}
        conn.execute(
            insert(EVENT).values(
                op_id=op_id,
                seq=current.event_seq,
                kind="stale_write_rejected",
                from_state=current.state,
                to_state=to_state.value if to_state is not None else None,
                server_state=current.server_state,
                poll_cursor=current.poll_cursor,
                cancel_generation=current.cancel_generation,
                execution_epoch=current.execution_epoch,
                detail={
                    "attempted": attempted,
                    "expected": expected,
                    "found": found,
                    "write_detail": dict(detail or {}),
                },
            )
        )
        return StaleTransition(op_id, attempted, expected, found)

    @staticmethod
    def _append_event(
        conn: Connection,
        op: Operation,
        *,
        seq: int,
        kind: str,
        from_state: str | None,
        detail: Mapping[str, Any] | None,
    ) -> None:
        conn.execute(
            STATEMENTS.get(_insert_event),
            {
                "op_id": op.id,
                "seq": seq,
                "kind": kind,
                "from_state": from_state,
                "to_state": op.state.value,
                "server_state": op.server_state,
                "poll_cursor": op.poll_cursor,
                "cancel_generation": op.cancel_generation,
                "execution_epoch": op.execution_epoch,
                "detail": dict(detail or {}),
            },
        )

    def record_event(self, op_id: uuid.UUID, kind: str, detail: Mapping[str, Any] | None = None) -> None:
        """Append an event that changes nothing else (a refused input, a remote outcome worth keeping)."""
        with self._tx() as conn:
            row = conn.execute(
                update(OP).where(OP.c.id == op_id).values(event_seq=OP.c.event_seq + 1).returning(*OP.c)
            ).first()
            if row is None:
                raise OperationNotFound(op_id)
            op = Operation.from_row(row)
            self._append_event(
                conn, op, seq=op.event_seq, kind=kind, from_state=op.state.value, detail=detail
            )

    # ----------------------------------------------------------------------------------------- polling

    def claim_due(
        self,
        *,
        limit: int,
        lease_s: float,
        epoch: int | None = None,
        server: str | None = None,
        horizon_s: float = 0.0,
    ) -> list[Claim]:
        """Claim up to ``limit`` due operations (SKIP LOCKED), lease them and bump their poll cursor.

        A claim is not a transition; the step's outcome, written under the returned cursor, is. A lease that
        ran out (a crashed worker) makes the row claimable again, under a new cursor, so the crashed worker's
        late answer is fenced off. With ``epoch``, a row of an older execution epoch is taken over by it
        (rule 13): its old-epoch writers are refused from then on. With ``server``, only that server's rows.
        ``horizon_s`` also claims rows due within that many seconds; each claim says how long until it is
        due (``delay_s``), so a dispatcher that ticks every ``horizon_s`` can send each step on time.
        """
        if limit <= 0:
            return []
        with_server, with_epoch = server is not None, epoch is not None
        with self._tx() as conn:
            rows = conn.execute(
                STATEMENTS.get(_claim_due, with_server, with_epoch),
                {
                    "claim_horizon": dt.timedelta(seconds=horizon_s),
                    "claim_server": server,
                    "claim_limit": limit,
                    "claim_lease": dt.timedelta(seconds=lease_s),
                    "claim_epoch": epoch,
                },
            ).all()
        return [Claim.from_row(r) for r in rows]

    def claim(self, op_id: uuid.UUID, *, lease_s: float, epoch: int | None = None) -> Claim | None:
        """Claim one operation now, whether due or not, unless another worker holds its lease."""
        with_epoch = epoch is not None
        with self._tx() as conn:
            row = conn.execute(
                STATEMENTS.get(_claim_one, with_epoch),
                {"claim_id": op_id, "claim_lease": dt.timedelta(seconds=lease_s), "claim_epoch": epoch},
            ).first()
        return Claim.from_row(row) if row is not None else None

    # -------------------------------------------------------------------------------------- acceptance

    def accept_terminal(self, op_id: uuid.UUID, evidence: TerminalEvidence) -> Acceptance:
        """The single acceptance point (rule 8): one transaction, receipt + ready outbox row + state + event.

        The row is matched on call node, request digest, remote id, tool descriptor version, execution epoch,
        cancel generation, the observed terminal state and the result digest; anything that does not match
        writes no receipt. A completion offered for an operation whose cancel was already accepted opens an
        EFFECT_RECONCILIATION_REQUIRED record instead (rule 6).
        """
        kind = TerminalKind(evidence.terminal_state)
        mismatches = _evidence_problems(evidence)
        with self._tx() as conn:
            row = None
            if not mismatches:
                row = conn.execute(
                    STATEMENTS.get(_accept_update, kind),
                    {
                        "fence_id": op_id,
                        "ev_call_node_id": evidence.call_node_id,
                        "ev_request_digest": evidence.request_digest,
                        "ev_remote_id": evidence.remote_id,
                        "ev_tool_descriptor_version": evidence.tool_descriptor_version,
                        "ev_execution_epoch": evidence.execution_epoch,
                        "ev_cancel_generation": evidence.cancel_generation,
                        "new_result": evidence.result if kind is not TerminalKind.CANCELLED else None,
                        "new_result_digest": evidence.result_digest,
                        "receipt_id": uuid.uuid4(),
                        "receipt_audit": evidence.audit,
                    },
                ).first()
            if row is not None:
                # The receipt went in with the move; the ready outbox row and the event go in together next.
                op = Operation.from_row(row)
                receipt = Receipt.from_row(row, prefix="receipt_")
                outbox_id = conn.execute(
                    STATEMENTS.get(_queue_terminal),
                    {
                        "queued_receipt_id": receipt.id,
                        "queued_op_id": op.id,
                        "queued_payload": {
                            "signature": op.on_terminal,
                            "receipt": receipt_payload(receipt, op.result),
                        },
                        "event_seq": op.event_seq,
                        "event_from_state": row.prior_state,
                        "event_to_state": op.state.value,
                        "event_server_state": op.server_state,
                        "event_poll_cursor": op.poll_cursor,
                        "event_cancel_generation": op.cancel_generation,
                        "event_execution_epoch": op.execution_epoch,
                        "event_detail": {
                            "receipt_id": str(receipt.id),
                            "terminal_state": kind.value,
                            "result_digest": evidence.result_digest,
                        },
                    },
                ).scalar_one()
                return Acceptance("accepted", receipt, outbox_id)

            current = conn.execute(select(OP).where(OP.c.id == op_id)).first()
            if current is None:
                raise OperationNotFound(op_id)
            op = Operation.from_row(current)
            existing = conn.execute(select(RECEIPT).where(RECEIPT.c.op_id == op_id)).first()
            held = Receipt.from_row(existing) if existing is not None else None
            if (
                held is not None
                and held.terminal_state is TerminalKind.CANCELLED
                and kind is not TerminalKind.CANCELLED
            ):
                self._open_reconciliation(
                    conn,
                    op,
                    ReconciliationReason.EFFECT_RECONCILIATION_REQUIRED,
                    deadline=dt.timedelta(hours=24),
                    detail={
                        "cancelled_receipt_id": str(held.id),
                        "late_terminal_state": kind.value,
                        "late_result_digest": evidence.result_digest,
                    },
                )
                return Acceptance("effect_reconciliation", held)
            if held is not None and not mismatches and _same_receipt(held, evidence):
                return Acceptance("already_accepted", held)
            problems = mismatches or _row_mismatches(op, evidence, kind)
            self._record_stale(
                conn,
                op_id,
                attempted="accept_terminal",
                to_state=ACCEPT_TO[kind],
                expected={
                    "state": sorted(s.value for s in ACCEPT_FROM[kind]),
                    "execution_epoch": evidence.execution_epoch,
                    "cancel_generation": evidence.cancel_generation,
                },
                detail={"mismatches": list(problems), "terminal_state": kind.value},
            )
            return Acceptance("rejected", held, mismatches=tuple(problems))

    # ------------------------------------------------------------------------------------------ outbox

    def drain_outbox(self, publish: Callable[[OutboxMessage], None], *, limit: int = 100) -> DrainReport:
        """Claim ready outbox rows (SKIP LOCKED), hand each to ``publish`` and mark it dispatched.

        The rows stay locked until the transaction commits, so two drainers never deliver the same row; a
        crash after ``publish`` and before the commit leaves the row ready, and it is delivered again:
        delivery is at-least-once, and the outbox id is the consumer's dedupe key.
        """
        dispatched: list[int] = []
        failed: list[tuple[int, str]] = []
        with self._tx() as conn:
            rows = conn.execute(STATEMENTS.get(_claim_outbox), {"limit": limit}).all()
            for r in rows:
                message = OutboxMessage(r.id, r.kind, r.op_id, r.input_round, r.payload, r.attempts)
                try:
                    publish(message)
                except Exception as exc:  # noqa: BLE001 - any publish failure leaves the row ready
                    failed.append((r.id, f"{type(exc).__name__}: {exc}"[:500]))
                else:
                    dispatched.append(r.id)
            if dispatched:
                conn.execute(STATEMENTS.get(_outbox_dispatched), {"ids": dispatched})
            for outbox_id, error in failed:
                conn.execute(
                    update(OUTBOX)
                    .where(OUTBOX.c.id == outbox_id)
                    .values(attempts=OUTBOX.c.attempts + 1, last_error=error)
                )
        return DrainReport(tuple(dispatched), tuple(i for i, _ in failed))

    def ready_outbox_count(self) -> int:
        with self._tx() as conn:
            return int(conn.execute(select(func.count()).where(OUTBOX.c.status == "ready")).scalar_one())

    # ---------------------------------------------------------------------------------- reconciliation

    def open_reconciliation(
        self,
        op_id: uuid.UUID,
        reason: ReconciliationReason,
        *,
        deadline: dt.timedelta,
        detail: Mapping[str, Any] | None = None,
    ) -> ReconciliationRecord:
        with self._tx() as conn:
            row = conn.execute(select(OP).where(OP.c.id == op_id)).first()
            if row is None:
                raise OperationNotFound(op_id)
            return self._open_reconciliation(conn, Operation.from_row(row), reason, deadline, detail)

    def _open_reconciliation(
        self,
        conn: Connection,
        op: Operation,
        reason: ReconciliationReason,
        deadline: dt.timedelta,
        detail: Mapping[str, Any] | None,
    ) -> ReconciliationRecord:
        """Open one record per (operation, reason); an open one is returned as it is."""
        row = conn.execute(
            pg_insert(RECON)
            .values(
                op_id=op.id,
                reason=reason.value,
                deadline=func.now() + literal(deadline),
                detail=dict(detail or {}),
            )
            .on_conflict_do_nothing(
                index_elements=[RECON.c.op_id, RECON.c.reason],
                index_where=RECON.c.resolved_at.is_(None),
            )
            .returning(*RECON.c)
        ).first()
        if row is None:
            row = conn.execute(
                select(RECON).where(
                    RECON.c.op_id == op.id, RECON.c.reason == reason.value, RECON.c.resolved_at.is_(None)
                )
            ).one()
        else:
            seq = conn.execute(
                update(OP)
                .where(OP.c.id == op.id)
                .values(event_seq=OP.c.event_seq + 1)
                .returning(OP.c.event_seq)
            ).scalar_one()
            self._append_event(
                conn,
                op,
                seq=seq,
                kind="reconciliation_opened",
                from_state=op.state.value,
                detail={"reconciliation_id": row.id, "reason": reason.value, **dict(detail or {})},
            )
        return _recon(row)

    def resolve_reconciliation(self, record_id: int, *, resolution: str, detail: Mapping[str, Any]) -> bool:
        """Close one open record (e.g. an EFFECT_RECONCILIATION_REQUIRED the operator has dealt with)."""
        with self._tx() as conn:
            row = conn.execute(
                update(RECON)
                .where(RECON.c.id == record_id, RECON.c.resolved_at.is_(None))
                .values(
                    resolved_at=func.now(),
                    resolution=resolution,
                    detail=RECON.c.detail.op("||")(literal_json(detail)),
                )
                .returning(RECON.c.op_id)
            ).first()
            return row is not None

    def flag_overdue(self, record_id: int) -> None:
        """Mark an open record as reported past its deadline, with an event on its operation."""
        with self._tx() as conn:
            row = conn.execute(
                update(RECON)
                .where(RECON.c.id == record_id, RECON.c.resolved_at.is_(None))
                .values(detail=RECON.c.detail.op("||")(literal_json({"overdue_flagged": True})))
                .returning(RECON.c.op_id, RECON.c.reason)
            ).first()
            if row is None:
                return
            op_row = conn.execute(
                update(OP).where(OP.c.id == row.op_id).values(event_seq=OP.c.event_seq + 1).returning(*OP.c)
            ).one()
            op = Operation.from_row(op_row)
            self._append_event(
                conn,
                op,
                seq=op.event_seq,
                kind="reconciliation_overdue",
                from_state=op.state.value,
                detail={"reconciliation_id": record_id, "reason": row.reason},
            )

    def waiting_for_input(self, *, limit: int = 500) -> list[Operation]:
        """Operations whose server waits for an answer from the approval gate, oldest deadline first."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP)
                .where(OP.c.state == OpState.INPUT_REQUIRED.value)
                .order_by(OP.c.input_deadline)
                .limit(limit)
            ).all()
        return [Operation.from_row(r) for r in rows]

    def in_flight_by_adapter(self) -> dict[str, int]:
        """How many operations of each ``protocol/protocol_version`` are not final yet (rule 14)."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP.c.protocol, OP.c.protocol_version, func.count())
                .where(OP.c.state.not_in([s.value for s in FINAL_STATES]))
                .group_by(OP.c.protocol, OP.c.protocol_version)
            ).all()
        return {adapter_key(p, v): int(n) for p, v, n in rows}

    def overdue_inputs(self, *, limit: int = 100) -> list[Operation]:
        """Operations still waiting for input after their input deadline."""
        with self._tx() as conn:
            rows = conn.execute(
                select(OP)
                .where(OP.c.state == OpState.INPUT_REQUIRED.value, OP.c.input_deadline < func.now())
                .order_by(OP.c.input_deadline)
                .limit(limit)
            ).all()
        return [Operation.from_row(r) for r in rows]

    def reconciliations_for(self, op_id: uuid.UUID) -> list[ReconciliationRecord]:
        with self._tx() as conn:
            rows = conn.execute(select(RECON).where(RECON.c.op_id == op_id).order_by(RECON.c.id)).all()
        return [_recon(r) for r in rows]

    def open_reconciliations(self) -> list[ReconciliationRecord]:
        with self._tx() as conn:
            rows = conn.execute(
                select(RECON).where(RECON.c.resolved_at.is_(None)).order_by(RECON.c.deadline)
            ).all()
        return [_recon(r) for r in rows]

    # ---------------------------------------------------------------------------------- executor control

    def control(self) -> ControlState:
        with self._tx() as conn:
            return self._control(conn)

    @staticmethod
    def _control(conn: Connection) -> ControlState:
        row = conn.execute(STATEMENTS.get(_select_control)).one()
        return ControlState(
            execution_epoch=row.execution_epoch,
            admission_open=row.admission_open,
            disabled_adapters=tuple(row.disabled_adapters),
            rollout=dict(row.rollout),
        )

    def set_admission(self, *, open_: bool, actor: str) -> ControlState:
        return self._change_control(actor, "set_admission", {"admission_open": open_})

    def bump_epoch(self, *, actor: str) -> ControlState:
        return self._change_control(actor, "bump_epoch", {"execution_epoch": CONTROL.c.execution_epoch + 1})

    def set_adapter_disabled(
        self, protocol: str, protocol_version: str, *, disabled: bool, actor: str
    ) -> ControlState:
        key = adapter_key(protocol, protocol_version)
        with self._tx() as conn:
            current = set(self._control(conn).disabled_adapters)
        wanted = sorted(current | {key}) if disabled else sorted(current - {key})
        return self._change_control(
            actor, "disable_adapter" if disabled else "enable_adapter", {"disabled_adapters": wanted}
        )

    def _change_control(self, actor: str, action: str, values: Mapping[str, Any]) -> ControlState:
        with self._tx() as conn:
            before = conn.execute(select(CONTROL).where(CONTROL.c.id == 1).with_for_update()).one()
            conn.execute(update(CONTROL).where(CONTROL.c.id == 1).values(**values, updated_at=func.now()))
            after = self._control(conn)
            conn.execute(
                insert(CONTROL_AUDIT).values(
                    actor=actor,
                    action=action,
                    before=_control_json(dict(before._mapping)),
                    after=dataclasses.asdict(after) | {"disabled_adapters": list(after.disabled_adapters)},
                )
            )
            return after


@dataclass(frozen=True, slots=True)
class DueIn:
    """A ``next_poll_at`` value (see :func:`due_in`): bound as a parameter, so the statement is built once."""

    seconds: float

    def interval(self) -> dt.timedelta:
        return dt.timedelta(seconds=max(0.0, self.seconds))


def due_in(seconds: float) -> DueIn:
    """A ``next_poll_at`` value: ``seconds`` from the database's now, never past the wait budget or expiry."""
    return DueIn(seconds)


def _due_at(param: str) -> Any:
    return func.least(func.now() + bindparam(param, type_=Interval()), OP.c.wait_deadline, OP.c.expires_at)


def _interval(seconds: float | None) -> dt.timedelta | None:
    return dt.timedelta(seconds=seconds) if seconds is not None else None


# ----------------------------------------------------------------------------------- hot statements


@dataclass(frozen=True, slots=True)
class _WriteShape:
    """What a guarded write's statement depends on: the columns it sets (and which are ``due_in`` values),
    and its flags. Values are bound: ``fence_*`` in the guard, ``new_*`` in the SET list."""

    columns: tuple[tuple[str, bool], ...]
    to_state: bool
    two_edges: bool
    bump_generation: bool
    with_cursor: bool
    with_round: bool


def _guarded_update(shape: _WriteShape, inline: Mapping[str, Any] | None = None) -> Any:
    """``UPDATE ... WHERE id AND state IN AND epoch AND generation [AND cursor] [AND round] RETURNING``,
    the row locked first (``prior``) so the statement also returns the state it found, and the move's event
    (``event_kind``, ``event_detail``) appended from the updated row by the same statement: a stale write
    updates nothing, so it appends nothing either. A move along two edges appends two events, the first
    into ``halfway_state`` and the second, ``then_kind``, on to the row's state."""
    inline = inline or {}
    prior = select(OP.c.id, OP.c.state).where(OP.c.id == bindparam("fence_id")).with_for_update().cte("prior")
    sets: dict[str, Any] = {
        name: _due_at(f"new_{name}") if due else bindparam(f"new_{name}", type_=OP.c[name].type)
        for name, due in shape.columns
        if name not in inline
    }
    sets.update(inline)
    sets["event_seq"] = OP.c.event_seq + (2 if shape.two_edges else 1)
    sets["updated_at"] = func.now()
    if shape.to_state:
        sets["state"] = bindparam("new_state", type_=OP.c.state.type)
    if shape.bump_generation:
        sets["cancel_generation"] = OP.c.cancel_generation + 1
    where = [
        OP.c.id == prior.c.id,
        OP.c.state.in_(bindparam("fence_states", expanding=True)),
        OP.c.execution_epoch == bindparam("fence_epoch"),
        OP.c.cancel_generation == bindparam("fence_generation"),
    ]
    if shape.with_cursor:
        where.append(OP.c.poll_cursor == bindparam("fence_cursor"))
    if shape.with_round:
        where.append(OP.c.input_round == bindparam("fence_round"))
    moved = (
        update(OP)
        .where(*where)
        .values(sets)
        .returning(*OP.c, prior.c.state.label("prior_state"))
        .cte("moved")
    )
    detail = bindparam("event_detail", type_=EVENT.c.detail.type)
    kind = bindparam("event_kind", type_=EVENT.c.kind.type)
    if shape.two_edges:
        halfway = bindparam("halfway_state", type_=EVENT.c.to_state.type)
        events: Any = union_all(
            _event_from(moved, moved.c.event_seq - 1, kind, moved.c.prior_state, halfway, detail),
            _event_from(
                moved,
                moved.c.event_seq,
                bindparam("then_kind", type_=EVENT.c.kind.type),
                halfway,
                moved.c.state,
                literal_json({}),
            ),
        )
    else:
        events = _event_from(moved, moved.c.event_seq, kind, moved.c.prior_state, moved.c.state, detail)
    appended = insert(EVENT).from_select(_EVENT_COLUMNS, events).returning(EVENT.c.seq).cte("appended")
    return select(moved).add_cte(appended)


_EVENT_COLUMNS = (
    "op_id",
    "seq",
    "kind",
    "from_state",
    "to_state",
    "server_state",
    "poll_cursor",
    "cancel_generation",
    "execution_epoch",
    "detail",
)


def _event_from(  # noqa: PLR0917 - one row of an event, column by column
    moved: Any, seq: Any, kind: Any, from_state: Any, to_state: Any, detail: Any
) -> Any:
    """An ``operation_event`` row from the moved row, as ``_append_event`` writes it."""
    return select(
        moved.c.id,
        seq,
        kind,
        from_state,
        to_state,
        moved.c.server_state,
        moved.c.poll_cursor,
        moved.c.cancel_generation,
        moved.c.execution_epoch,
        detail,
    )


def _accept_update(kind: TerminalKind) -> Any:
    """Rule 8's one guarded statement: every piece of evidence in the guard (``ev_*``); the receipt
    (``receipt_id``, ``receipt_audit``) is inserted from the accepted row by the same statement, and returned
    with it as ``receipt_*`` columns. Nothing accepted, no receipt."""
    observed_ok = OP.c.observed_terminal == kind.value
    if kind is TerminalKind.CANCELLED:
        observed_ok = or_(observed_ok, OP.c.state == OpState.CANCEL_REQUESTED.value)
    prior = select(OP.c.id, OP.c.state).where(OP.c.id == bindparam("fence_id")).with_for_update().cte("prior")
    moved = (
        update(OP)
        .where(
            OP.c.id == prior.c.id,
            OP.c.state.in_([s.value for s in ACCEPT_FROM[kind]]),
            OP.c.call_node_id == bindparam("ev_call_node_id"),
            OP.c.request_digest == bindparam("ev_request_digest"),
            OP.c.remote_id.is_not_distinct_from(bindparam("ev_remote_id", type_=OP.c.remote_id.type)),
            OP.c.tool_descriptor_version.is_not_distinct_from(
                bindparam("ev_tool_descriptor_version", type_=OP.c.tool_descriptor_version.type)
            ),
            OP.c.execution_epoch == bindparam("ev_execution_epoch"),
            OP.c.cancel_generation == bindparam("ev_cancel_generation"),
            observed_ok,
        )
        .values(
            state=ACCEPT_TO[kind].value,
            observed_terminal=kind.value,
            result=bindparam("new_result", type_=OP.c.result.type),
            result_digest=bindparam("new_result_digest", type_=OP.c.result_digest.type),
            next_poll_at=None,
            lease_until=None,
            event_seq=OP.c.event_seq + 1,
            updated_at=func.now(),
        )
        .returning(*OP.c, prior.c.state.label("prior_state"))
        .cte("moved")
    )
    receipt = (
        insert(RECEIPT)
        .from_select(
            [
                "id",
                "op_id",
                "call_node_id",
                "request_digest",
                "remote_id",
                "tool_descriptor_version",
                "execution_epoch",
                "cancel_generation",
                "terminal_state",
                "result_digest",
                "audit",
            ],
            select(
                bindparam("receipt_id", type_=RECEIPT.c.id.type),
                moved.c.id,
                moved.c.call_node_id,
                moved.c.request_digest,
                moved.c.remote_id,
                moved.c.tool_descriptor_version,
                moved.c.execution_epoch,
                moved.c.cancel_generation,
                literal(kind.value, type_=RECEIPT.c.terminal_state.type),
                moved.c.result_digest,
                bindparam("receipt_audit", type_=RECEIPT.c.audit.type),
            ),
        )
        .returning(*RECEIPT.c)
        .cte("receipt")
    )
    return select(moved, *(column.label(f"receipt_{column.name}") for column in receipt.c)).select_from(
        moved.join(receipt, receipt.c.op_id == moved.c.id)
    )


def _queue_terminal() -> Any:
    """The accepted operation's ready outbox row (``queued_*``) and its ``terminal_accepted`` event
    (``event_*``), whose detail names the new outbox id; the statement returns that id."""
    queued = (
        insert(OUTBOX)
        .values(
            kind="terminal",
            receipt_id=bindparam("queued_receipt_id", type_=OUTBOX.c.receipt_id.type),
            op_id=bindparam("queued_op_id", type_=OUTBOX.c.op_id.type),
            payload=bindparam("queued_payload", type_=OUTBOX.c.payload.type),
        )
        .returning(OUTBOX.c.id)
        .cte("queued")
    )
    detail = bindparam("event_detail", type_=EVENT.c.detail.type).op("||")(
        func.jsonb_build_object(literal("outbox_id"), queued.c.id)
    )
    row = select(
        bindparam("queued_op_id", type_=EVENT.c.op_id.type),
        bindparam("event_seq", type_=EVENT.c.seq.type),
        literal("terminal_accepted", type_=EVENT.c.kind.type),
        bindparam("event_from_state", type_=EVENT.c.from_state.type),
        bindparam("event_to_state", type_=EVENT.c.to_state.type),
        bindparam("event_server_state", type_=EVENT.c.server_state.type),
        bindparam("event_poll_cursor", type_=EVENT.c.poll_cursor.type),
        bindparam("event_cancel_generation", type_=EVENT.c.cancel_generation.type),
        bindparam("event_execution_epoch", type_=EVENT.c.execution_epoch.type),
        detail,
    ).select_from(queued)
    appended = insert(EVENT).from_select(_EVENT_COLUMNS, row).returning(EVENT.c.seq).cte("appended")
    return select(queued.c.id).add_cte(appended)


def _insert_operation() -> Any:
    """The SUBMITTING row (rule 1) and its ``submitted`` event (``event_detail``); a concurrent insert of the
    same call node inserts neither."""
    plain = (
        "id",
        "call_node_id",
        "request_digest",
        "tool_name",
        "tool_descriptor_version",
        "body",
        "server",
        "protocol",
        "protocol_version",
        "adapter_version",
        "submission_key",
        "ttl_ms",
        "execution_epoch",
        "on_terminal",
        "on_input",
        "poll_cursor",
    )
    inserted = (
        pg_insert(OP)
        .values(
            {
                **{name: bindparam(f"new_{name}", type_=OP.c[name].type) for name in plain},
                "state": OpState.SUBMITTING.value,
                "wait_deadline": func.now() + bindparam("new_wait_budget", type_=Interval()),
                "event_seq": 1,
                "next_poll_at": func.now(),
                "lease_until": func.now() + bindparam("new_lease", type_=Interval()),
            }
        )
        .on_conflict_do_nothing(index_elements=[OP.c.call_node_id])
        .returning(*OP.c)
        .cte("inserted")
    )
    event = _event_from(
        inserted,
        inserted.c.event_seq,
        literal("submitted", type_=EVENT.c.kind.type),
        literal(None, type_=EVENT.c.from_state.type),
        inserted.c.state,
        bindparam("event_detail", type_=EVENT.c.detail.type),
    )
    appended = insert(EVENT).from_select(_EVENT_COLUMNS, event).returning(EVENT.c.seq).cte("appended")
    return select(inserted).add_cte(appended)


def _claim_values(with_epoch: bool) -> dict[str, Any]:
    """A claim bumps the cursor and sets the lease (``claim_lease``); with ``claim_epoch``, it takes the row
    over into that execution epoch (rule 13)."""
    values: dict[str, Any] = {
        "poll_cursor": OP.c.poll_cursor + 1,
        "lease_until": func.now() + bindparam("claim_lease", type_=Interval()),
    }
    if with_epoch:
        values["execution_epoch"] = func.greatest(
            OP.c.execution_epoch, bindparam("claim_epoch", type_=OP.c.execution_epoch.type)
        )
    return values


def _claim_due(with_server: bool, with_epoch: bool) -> Any:
    conditions = [
        OP.c.next_poll_at <= func.now() + bindparam("claim_horizon", type_=Interval()),
        or_(OP.c.lease_until.is_(None), OP.c.lease_until < func.now()),
    ]
    if with_server:
        conditions.append(OP.c.server == bindparam("claim_server"))
    due = (
        select(OP.c.id)
        .where(*conditions)
        .order_by(OP.c.next_poll_at)
        .limit(bindparam("claim_limit"))
        .with_for_update(skip_locked=True)
        .cte("due")
    )
    return update(OP).where(OP.c.id == due.c.id).values(_claim_values(with_epoch)).returning(*CLAIM_COLUMNS)


def _claim_one(with_epoch: bool) -> Any:
    return (
        update(OP)
        .where(
            OP.c.id == bindparam("claim_id"),
            or_(OP.c.lease_until.is_(None), OP.c.lease_until < func.now()),
        )
        .values(_claim_values(with_epoch))
        .returning(*CLAIM_COLUMNS)
    )


def _insert_event() -> Any:
    return insert(EVENT)


def _select_control() -> Any:
    return select(CONTROL).where(CONTROL.c.id == 1)


def _operation_by_id() -> Any:
    return select(OP).where(OP.c.id == bindparam("op_id"))


def _operation_by_call_node() -> Any:
    return select(OP).where(OP.c.call_node_id == bindparam("call_node_id"))


def _claim_outbox() -> Any:
    return (
        select(OUTBOX)
        .where(OUTBOX.c.status == "ready")
        .order_by(OUTBOX.c.id)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
    )


def _outbox_dispatched() -> Any:
    return (
        update(OUTBOX)
        .where(OUTBOX.c.id.in_(bindparam("ids", expanding=True)))
        .values(status="dispatched", dispatched_at=func.now(), attempts=OUTBOX.c.attempts + 1)
    )


def literal_json(value: Mapping[str, Any]) -> Any:
    return literal(dict(value), type_=models.Json)


def receipt_payload(receipt: Receipt, result: Any) -> dict[str, Any]:
    """The receipt as the downstream task receives it (``outbox_id`` is added when it is delivered)."""
    return {
        "receipt_id": str(receipt.id),
        "op_id": str(receipt.op_id),
        "call_node_id": receipt.call_node_id,
        "request_digest": receipt.request_digest,
        "remote_id": receipt.remote_id,
        "terminal_state": receipt.terminal_state.value,
        "result_digest": receipt.result_digest,
        "result": result if receipt.terminal_state is not TerminalKind.CANCELLED else None,
        "execution_epoch": receipt.execution_epoch,
        "cancel_generation": receipt.cancel_generation,
        "accepted_at": receipt.accepted_at.isoformat(),
    }


def _checked_values(values: Mapping[str, Any] | None) -> dict[str, Any]:
    sets = dict(values or {})
    refused = sorted(set(sets) - WRITABLE_COLUMNS)
    if refused:
        raise IllegalTransition(f"columns {refused} are not written through values=")
    for key in ("observed_terminal",):
        if isinstance(sets.get(key), TerminalKind):
            sets[key] = sets[key].value
    return sets


def _evidence_problems(evidence: TerminalEvidence) -> list[str]:
    """What is wrong with the evidence on its own, before it is matched against the row."""
    problems: list[str] = []
    kind = TerminalKind(evidence.terminal_state)
    if kind is TerminalKind.CANCELLED:
        if evidence.result is not None:
            problems.append("result: a cancelled terminal never carries a result (use audit)")
    elif evidence.result is None or evidence.result_digest is None:
        problems.append("result: a completed or failed terminal needs the whole result and its digest")
    elif digest(evidence.result) != evidence.result_digest:
        problems.append("result_digest: does not match the result")
    return problems


def _same_receipt(receipt: Receipt, evidence: TerminalEvidence) -> bool:
    """A replay of the evidence that was accepted (a redelivered task): answered with the held receipt."""
    return (
        receipt.call_node_id == evidence.call_node_id
        and receipt.request_digest == evidence.request_digest
        and receipt.remote_id == evidence.remote_id
        and receipt.tool_descriptor_version == evidence.tool_descriptor_version
        and receipt.execution_epoch == evidence.execution_epoch
        and receipt.cancel_generation == evidence.cancel_generation
        and receipt.terminal_state is TerminalKind(evidence.terminal_state)
        and receipt.result_digest == evidence.result_digest
    )


def _row_mismatches(op: Operation, evidence: TerminalEvidence, kind: TerminalKind) -> list[str]:
    checks = {
        "state": op.state in ACCEPT_FROM[kind],
        "call_node_id": op.call_node_id == evidence.call_node_id,
        "request_digest": op.request_digest == evidence.request_digest,
        "remote_id": op.remote_id == evidence.remote_id,
        "tool_descriptor_version": op.tool_descriptor_version == evidence.tool_descriptor_version,
        "execution_epoch": op.execution_epoch == evidence.execution_epoch,
        "cancel_generation": op.cancel_generation == evidence.cancel_generation,
        "terminal_state": op.observed_terminal is kind
        or (kind is TerminalKind.CANCELLED and op.state is OpState.CANCEL_REQUESTED),
    }
    return [name for name, ok in checks.items() if not ok]


def _recon(row: Row[Any]) -> ReconciliationRecord:
    return ReconciliationRecord(
        id=row.id,
        op_id=row.op_id,
        reason=ReconciliationReason(row.reason),
        opened_at=row.opened_at,
        deadline=row.deadline,
        resolved_at=row.resolved_at,
        resolution=row.resolution,
        detail=row.detail,
    )


def _control_json(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "execution_epoch": mapping["execution_epoch"],
        "admission_open": mapping["admission_open"],
        "disabled_adapters": list(mapping["disabled_adapters"]),
        "rollout": dict(mapping["rollout"]),
    }
