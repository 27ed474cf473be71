"""The ledger's tables (DESIGN §3), as SQLAlchemy 2 typed models.

Table and column names are public: operators query them and outside tests check them. Invariants live here as
constraints so that the database itself refuses what the code must never do; every CHECK that mentions a
state is generated from ``ledger/states.py``, the event kinds' from ``ledger/events.py``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Sequence,
    SmallInteger,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.states import (
    NEVER_POLLED,
    REMOTE_ID_REQUIRED,
    TERMINAL_KNOWN,
    OpState,
    TerminalKind,
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

PROTOCOLS = ("mcp", "aip151")
OUTBOX_KINDS = ("terminal", "input_required")
#: ``dead``: a row that could not be published after its bounded attempts (rule 9), kept for an operator.
OUTBOX_STATUSES = ("ready", "dispatched", "dead")
ROUTINGS = ("live", "shadow")


def _in(column: str, values: Any) -> str:
    listed = ", ".join(f"'{v}'" for v in sorted(str(v) for v in values))
    return f"{column} IN ({listed})"


def _not_in(column: str, values: Any) -> str:
    listed = ", ".join(f"'{v}'" for v in sorted(str(v) for v in values))
    return f"{column} NOT IN ({listed})"


Timestamp = DateTime(timezone=True)
#: Python None is SQL NULL, never the JSON value null (the CHECKs test IS NULL).
Json = JSONB(none_as_null=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


#: The dispatch ticks' counter (rule 3): each tick takes the next value, which rotates the order in which
#: servers with equal shares of the tick are served, so that with more servers than ``dispatch_batch`` every
#: server is reached within ``ceil(servers / batch)`` ticks. A sequence, not a row: taking a value takes no
#: row lock and is outside every transaction, so two dispatchers never wait on each other for it.
DISPATCH_TICK = Sequence("dispatch_tick", metadata=Base.metadata)


class ToolOperation(Base):
    """One row per call node (toolOperation.v1)."""

    __tablename__ = "tool_operation"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    call_node_id: Mapped[str] = mapped_column(Text, unique=True)
    request_digest: Mapped[str] = mapped_column(Text)
    tool_name: Mapped[str] = mapped_column(Text)
    tool_descriptor_version: Mapped[str | None] = mapped_column(Text)
    body: Mapped[Any] = mapped_column(Json)
    server: Mapped[str] = mapped_column(Text)
    protocol: Mapped[str] = mapped_column(Text)
    protocol_version: Mapped[str] = mapped_column(Text)
    adapter_version: Mapped[str] = mapped_column(Text)
    remote_id: Mapped[str | None] = mapped_column(Text)
    session_ref: Mapped[str | None] = mapped_column(Text)
    submission_key: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    submit_attempted_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    state: Mapped[str] = mapped_column(Text)
    server_state: Mapped[str | None] = mapped_column(Text)
    observed_terminal: Mapped[str | None] = mapped_column(Text)
    status_message: Mapped[str | None] = mapped_column(Text)
    poll_cursor: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    next_poll_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    poll_interval_ms: Mapped[int | None] = mapped_column(Integer)
    lease_until: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    ttl_ms: Mapped[int | None] = mapped_column(BigInteger)
    wait_deadline: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    expires_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    input_round: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    input_request: Mapped[Any | None] = mapped_column(Json)
    input_schema_digest: Mapped[str | None] = mapped_column(Text)
    input_deadline: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    cancel_generation: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    execution_epoch: Mapped[int] = mapped_column(Integer)
    result: Mapped[Any | None] = mapped_column(Json)
    result_digest: Mapped[str | None] = mapped_column(Text)
    on_terminal: Mapped[Any | None] = mapped_column(Json)
    on_input: Mapped[Any | None] = mapped_column(Json)
    created_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())
    updated_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())
    event_seq: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    #: Polls whose answer changed nothing, and steps that found no token: counted here, not written as
    #: events (DESIGN §3: the event table grows with what happened, not with time).
    unchanged_polls: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    no_token_count: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    last_polled_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    #: ``live`` (delivered downstream) or ``shadow`` (driven and receipted, never delivered: its outcome is
    #: compared with the caller's legacy outcome in ``shadow_comparison``).
    routing: Mapped[str] = mapped_column(Text, server_default=text("'live'"))
    #: The reply to the current input round as stored before it is sent (rule 10): ``{"input_round",
    #: "response", "recorded_at", "sent_at", "attempts", "last_error"}``; a step that finds it not yet sent
    #: sends the same reply again.
    input_reply: Mapped[Any | None] = mapped_column(Json)

    __table_args__ = (
        UniqueConstraint("server", "remote_id"),
        CheckConstraint(_in("routing", ROUTINGS), name="routing_known"),
        # A shadow operation keeps no downstream signature: nothing it does can reach a pipeline.
        CheckConstraint(
            "routing = 'live' OR (on_terminal IS NULL AND on_input IS NULL)", name="shadow_never_delivered"
        ),
        CheckConstraint("unchanged_polls >= 0 AND no_token_count >= 0", name="poll_counters_non_negative"),
        CheckConstraint(_in("state", OpState), name="state_known"),
        CheckConstraint(_in("protocol", PROTOCOLS), name="protocol_known"),
        CheckConstraint(
            f"observed_terminal IS NULL OR {_in('observed_terminal', TerminalKind)}",
            name="observed_terminal_known",
        ),
        CheckConstraint("length(call_node_id) BETWEEN 1 AND 512", name="call_node_id_length"),
        CheckConstraint(
            f"remote_id IS NOT NULL OR {_not_in('state', REMOTE_ID_REQUIRED)}", name="remote_id_by_state"
        ),
        CheckConstraint(
            f"observed_terminal IS NOT NULL OR {_not_in('state', TERMINAL_KNOWN)}",
            name="observed_terminal_by_state",
        ),
        CheckConstraint(
            "submit_attempted_at IS NOT NULL OR state <> 'SUBMISSION_UNKNOWN'",
            name="submission_unknown_attempted",
        ),
        CheckConstraint(
            f"next_poll_at IS NULL OR {_not_in('state', NEVER_POLLED)}", name="not_polled_by_state"
        ),
        CheckConstraint(
            "state <> 'INPUT_REQUIRED' OR (input_request IS NOT NULL AND input_round >= 1 "
            "AND input_deadline IS NOT NULL)",
            name="input_required_has_request",
        ),
        CheckConstraint("state <> 'ACCEPTED' OR result_digest IS NOT NULL", name="accepted_has_digest"),
        CheckConstraint(
            "state <> 'CANCELLED_ACCEPTED' OR result IS NULL", name="cancelled_carries_no_result"
        ),
        CheckConstraint(
            "poll_cursor >= 0 AND cancel_generation >= 0 AND execution_epoch >= 1 AND input_round >= 0",
            name="counters_non_negative",
        ),
        # The due sweep scales with what is due, not with what is in flight.
        Index(
            "ix_tool_operation_due",
            "next_poll_at",
            postgresql_where=text("next_poll_at IS NOT NULL"),
        ),
        # The dispatcher claims per server, at most what that server's budgets can take in one tick.
        Index(
            "ix_tool_operation_server_due",
            "server",
            "next_poll_at",
            postgresql_where=text("next_poll_at IS NOT NULL"),
        ),
        # What is due and not a poll (a cancel, its confirmation, a result's fetch) is claimed first.
        Index(
            "ix_tool_operation_server_due_not_working",
            "server",
            "next_poll_at",
            postgresql_where=text("next_poll_at IS NOT NULL AND state <> 'WORKING'"),
        ),
        Index("ix_tool_operation_state", "state"),
    )


class OperationEvent(Base):
    """The ordered time series of one operation: every transition, rejected write and remote outcome."""

    __tablename__ = "operation_event"

    op_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("tool_operation.id"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.clock_timestamp())
    kind: Mapped[str] = mapped_column(Text)
    from_state: Mapped[str | None] = mapped_column(Text)
    to_state: Mapped[str | None] = mapped_column(Text)
    server_state: Mapped[str | None] = mapped_column(Text)
    poll_cursor: Mapped[int | None] = mapped_column(BigInteger)
    cancel_generation: Mapped[int | None] = mapped_column(Integer)
    execution_epoch: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[Any] = mapped_column(Json, server_default=text("'{}'::jsonb"))

    __table_args__ = (
        CheckConstraint("seq >= 1", name="seq_positive"),
        CheckConstraint(_in("kind", EventKind), name="kind_known"),
        # The retention of final operations' events finds the old ones without a scan.
        Index("ix_operation_event_at", "at"),
    )


class TerminalReceipt(Base):
    """Exactly one per operation and per call node: the single acceptance point's record (rule 8)."""

    __tablename__ = "terminal_receipt"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    op_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("tool_operation.id"), unique=True)
    call_node_id: Mapped[str] = mapped_column(Text, unique=True)
    request_digest: Mapped[str] = mapped_column(Text)
    remote_id: Mapped[str | None] = mapped_column(Text)
    tool_descriptor_version: Mapped[str | None] = mapped_column(Text)
    execution_epoch: Mapped[int] = mapped_column(Integer)
    cancel_generation: Mapped[int] = mapped_column(Integer)
    terminal_state: Mapped[str] = mapped_column(Text)
    result_digest: Mapped[str | None] = mapped_column(Text)
    audit: Mapped[Any | None] = mapped_column(Json)
    accepted_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())

    __table_args__ = (
        CheckConstraint(_in("terminal_state", TerminalKind), name="terminal_state_known"),
        CheckConstraint(
            "terminal_state = 'cancelled' OR result_digest IS NOT NULL", name="digest_unless_cancelled"
        ),
    )


class Outbox(Base):
    """What must reach the pipeline after a commit: downstream advances and approval-gate requests."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    kind: Mapped[str] = mapped_column(Text)
    receipt_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("terminal_receipt.id"), unique=True
    )
    op_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("tool_operation.id"))
    input_round: Mapped[int | None] = mapped_column(Integer)
    payload: Mapped[Any] = mapped_column(Json)
    status: Mapped[str] = mapped_column(Text, server_default=text("'ready'"))
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())
    dispatched_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    #: A row whose publish failed is not tried again before this (a growing pause; rule 9).
    next_attempt_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)

    __table_args__ = (
        CheckConstraint(_in("kind", OUTBOX_KINDS), name="kind_known"),
        CheckConstraint(_in("status", OUTBOX_STATUSES), name="status_known"),
        CheckConstraint(
            "(kind = 'terminal' AND receipt_id IS NOT NULL AND input_round IS NULL) OR "
            "(kind = 'input_required' AND input_round IS NOT NULL AND receipt_id IS NULL)",
            name="kind_columns",
        ),
        CheckConstraint(
            "(status = 'dispatched') = (dispatched_at IS NOT NULL)", name="dispatched_when_dispatched"
        ),
        Index(
            "uq_outbox_input_round",
            "op_id",
            "input_round",
            unique=True,
            postgresql_where=text("kind = 'input_required'"),
        ),
        Index("ix_outbox_ready", "id", postgresql_where=text("status = 'ready'")),
        Index("ix_outbox_op_id", "op_id"),
        Index("ix_outbox_dispatched_at", "dispatched_at", postgresql_where=text("status = 'dispatched'")),
    )


class Reconciliation(Base):
    """What no rule can decide: an operator resolves it, with evidence, before its deadline."""

    __tablename__ = "reconciliation"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    op_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("tool_operation.id"))
    reason: Mapped[str] = mapped_column(Text)
    opened_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())
    deadline: Mapped[dt.datetime] = mapped_column(Timestamp)
    resolved_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)
    resolution: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[Any] = mapped_column(Json, server_default=text("'{}'::jsonb"))

    __table_args__ = (
        CheckConstraint(_in("reason", ReconciliationReason), name="reason_known"),
        CheckConstraint("(resolved_at IS NULL) = (resolution IS NULL)", name="resolved_with_resolution"),
        Index(
            "uq_reconciliation_open",
            "op_id",
            "reason",
            unique=True,
            postgresql_where=text("resolved_at IS NULL"),
        ),
        Index("ix_reconciliation_open_deadline", "deadline", postgresql_where=text("resolved_at IS NULL")),
    )


class ExecutorControl(Base):
    """The single control row: current execution epoch, admission, disabled adapters, rollout."""

    __tablename__ = "executor_control"

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    execution_epoch: Mapped[int] = mapped_column(Integer, server_default=text("1"))
    admission_open: Mapped[bool] = mapped_column(Boolean, server_default=text("true"))
    disabled_adapters: Mapped[Any] = mapped_column(Json, server_default=text("'[]'::jsonb"))
    rollout: Mapped[Any] = mapped_column(Json, server_default=text("'{}'::jsonb"))
    updated_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())
    #: The executor identity (``LONGCALL_EXECUTOR_ID``) that owns the current epoch, recorded by
    #: ``longcall rollback`` (rule 13): a fleet of another identity claims and writes nothing. NULL: any
    #: fleet.
    epoch_owner: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        CheckConstraint("execution_epoch >= 1", name="epoch_positive"),
    )


class ExecutorControlAudit(Base):
    """Every change to executor_control, who made it and what it was before and after."""

    __tablename__ = "executor_control_audit"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())
    actor: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(Text)
    before: Mapped[Any] = mapped_column(Json)
    after: Mapped[Any] = mapped_column(Json)
    #: Why the operator made the change (``--reason``); None for changes recorded before it was asked.
    reason: Mapped[str | None] = mapped_column(Text)


class ShadowComparison(Base):
    """A shadow operation's outcome beside the caller's legacy outcome for the same call node.

    The legacy outcome may arrive before or after longcall's receipt; ``diverged`` is set once both are
    known (terminal states differ, or both completed with different result digests when the legacy digest
    is given)."""

    __tablename__ = "shadow_comparison"

    call_node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    legacy_terminal_state: Mapped[str] = mapped_column(Text)
    legacy_result_digest: Mapped[str | None] = mapped_column(Text)
    legacy_detail: Mapped[Any | None] = mapped_column(Json)
    recorded_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())
    longcall_terminal_state: Mapped[str | None] = mapped_column(Text)
    longcall_result_digest: Mapped[str | None] = mapped_column(Text)
    diverged: Mapped[bool | None] = mapped_column(Boolean)
    compared_at: Mapped[dt.datetime | None] = mapped_column(Timestamp)

    __table_args__ = (
        CheckConstraint(_in("legacy_terminal_state", TerminalKind), name="legacy_state_known"),
        CheckConstraint(
            f"longcall_terminal_state IS NULL OR {_in('longcall_terminal_state', TerminalKind)}",
            name="longcall_state_known",
        ),
        CheckConstraint("(diverged IS NULL) = (compared_at IS NULL)", name="compared_with_verdict"),
    )


class RoutingDecision(Base):
    """The canary's answer to a call node (``ledger/routing.py``), kept so that every later submission of
    the call node gets the same one: recorded with the submission, under its lock, while a canary
    percentage is set. A "not routed" call node has this row and no operation."""

    __tablename__ = "routing_decision"

    call_node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    routed: Mapped[bool] = mapped_column(Boolean)
    percent: Mapped[float] = mapped_column(Float)
    decided_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())

    __table_args__ = (CheckConstraint("percent >= 0 AND percent <= 100", name="percent_in_range"),)


class CallNodeCancel(Base):
    """A cancel asked for by call node id before the call node had an operation (``longcall.cancel`` with
    ``call_node_id``): recorded under the call node's submission lock, and taken by the call node's first
    submission, in the transaction that inserts its row, which is then born with the intent (its cancel
    generation bumped: it ends cancelled without a create). A pipeline that cancels as it submits loses no
    cancel to the order its two messages were taken in."""

    __tablename__ = "call_node_cancel"

    call_node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    requested_at: Mapped[dt.datetime] = mapped_column(Timestamp, server_default=func.now())


class SimulationRun(Base):
    """One run of ``longcall gate simulate``: what the launch gate reads of the simulation."""

    __tablename__ = "simulation_run"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=False), primary_key=True)
    started_at: Mapped[dt.datetime] = mapped_column(Timestamp)
    finished_at: Mapped[dt.datetime] = mapped_column(Timestamp, index=True)
    seed: Mapped[int] = mapped_column(BigInteger)
    series: Mapped[int] = mapped_column(Integer)
    protocols: Mapped[Any] = mapped_column(Json)
    divergences: Mapped[int] = mapped_column(Integer)
    second_operations: Mapped[int] = mapped_column(Integer)
    max_receipts_per_call_node: Mapped[int] = mapped_column(Integer)
    advances_without_receipt: Mapped[int] = mapped_column(Integer)
    late_completions_advanced: Mapped[int] = mapped_column(Integer)
    series_per_s: Mapped[float] = mapped_column(Float)
    failures: Mapped[Any | None] = mapped_column(Json)
    passed: Mapped[bool] = mapped_column(Boolean)

    __table_args__ = (CheckConstraint("series >= 0", name="series_non_negative"),)
