"""The ledger's records: frozen snapshots of rows and the values the transactions take and return.

Pure data: no SQL is run here. ``Operation`` mirrors one ``tool_operation`` row; the others are what goes into
a transaction (``NewOperation``, ``TerminalEvidence``, ``ServerStatus``, ``DueIn``) or comes out of one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import operator
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ledger.reasons import ReconciliationReason
from ledger.states import FINAL_STATES, OpState, TerminalKind

if TYPE_CHECKING:
    from sqlalchemy import Row


@dataclass(frozen=True, slots=True)
class Fence:
    """What a writer believes: its epoch and cancel generation, and the poll cursor it holds."""

    execution_epoch: int
    cancel_generation: int
    poll_cursor: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class UnchangedPoll:
    """A poll that changed nothing, to be recorded with its batch's (``Ledger.record_unchanged_polls``):
    its operation and its claim's fence. ``next_poll_due``: this process's ``time.monotonic()`` when the
    next poll is due at the earliest (the read's time plus the server's interval, jittered). The record sets
    the next poll at the later of that and the one the claim set, never past a deadline ahead (as
    :func:`due_in`); None keeps the claim's."""

    op_id: uuid.UUID
    fence: Fence
    next_poll_due: float | None = None


class _BodyNotRead:
    """What :attr:`Operation.body` holds in a snapshot read without the arguments (``with_body=False``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<body not read>"

    def __reduce__(self) -> str:
        return "BODY_NOT_READ"  # a copy or an unpickled snapshot holds the same marker, never a look-alike


#: The most lines one listing (``ledger.listing``, ``longcall list --limit``) reads.
LISTED_AT_MOST = 10_000

#: The body of an operation read without its arguments: a status read, its reschedule and what follows
#: them never send the arguments, so the poll path does not fetch them (issue 13: a 1 MB body made every
#: poll read and parse it twice). The create and the lookup by key read them (``Ledger.get``, the create
#: attempt's own row); ``workers.steps.submit.arguments_of`` reads them for a snapshot that lacks them.
BODY_NOT_READ: Any = _BodyNotRead()


@dataclass(frozen=True, slots=True)
class Operation:
    """A snapshot of one ``tool_operation`` row (``body`` is :data:`BODY_NOT_READ` in a snapshot read
    without the arguments)."""

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
    #: Polls that changed nothing and steps that found no token, counted instead of written as events.
    unchanged_polls: int
    no_token_count: int
    last_polled_at: dt.datetime | None
    #: ``live`` or ``shadow`` (driven and receipted, never delivered downstream: ``ledger/shadow.py``).
    routing: str = "live"
    #: The stored reply of the current input round (rule 10; see ``ledger/models.py``), or None.
    input_reply: Any = None

    @classmethod
    def from_row(cls, row: Row[Any] | Mapping[str, Any], *, with_body: bool = True) -> Operation:
        """The snapshot of a row; ``with_body=False`` for a row selected without ``body``."""
        if not isinstance(row, Mapping):  # a Row (SQLAlchemy is not imported to ask: the CLI reads it lazily)
            return cls.from_rows([row], with_body=with_body)[0]
        names = _OPERATION_FIELDS if with_body else _OPERATION_FIELDS_WITHOUT_BODY
        return cls._from_values([row[name] for name in names], with_body=with_body)

    @classmethod
    def from_rows(cls, rows: Sequence[Row[Any]], *, with_body: bool = True) -> list[Operation]:
        """The snapshots of the rows of one result. They are read by position, their columns' places found
        once (:func:`_field_values`), not by 43 lookups of a name each: a batch of polls reads its members'
        rows together (``Ledger.get_many``)."""
        if not rows:
            return []
        names = _OPERATION_FIELDS if with_body else _OPERATION_FIELDS_WITHOUT_BODY
        pick = _field_values(rows[0]._fields, names)
        return [cls._from_values(list(pick(row)), with_body=with_body) for row in rows]

    @classmethod
    def _from_values(cls, values: list[Any], *, with_body: bool) -> Operation:
        """The snapshot of a row's values in the order of the fields (without ``body`` unless
        ``with_body``)."""
        if not with_body:
            values.insert(_BODY, BODY_NOT_READ)
        values[_STATE] = OpState(values[_STATE])
        if values[_OBSERVED_TERMINAL] is not None:
            values[_OBSERVED_TERMINAL] = TerminalKind(values[_OBSERVED_TERMINAL])
        return cls(*values)

    @property
    def fence(self) -> Fence:
        return Fence(self.execution_epoch, self.cancel_generation, self.poll_cursor)

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES


_OPERATION_FIELDS = tuple(f.name for f in dataclasses.fields(Operation))
_OPERATION_FIELDS_WITHOUT_BODY = tuple(name for name in _OPERATION_FIELDS if name != "body")
#: Where ``Operation``'s fields that ``from_row`` fills or converts are, in the order of its fields.
_BODY = _OPERATION_FIELDS.index("body")
_STATE = _OPERATION_FIELDS.index("state")
_OBSERVED_TERMINAL = _OPERATION_FIELDS.index("observed_terminal")


@functools.lru_cache(maxsize=64)
def _field_values(columns: tuple[str, ...], names: tuple[str, ...]) -> Callable[[Sequence[Any]], Any]:
    """What takes the values of ``names``, in that order, from a row whose columns are ``columns``. A
    name that two columns share is read by name (the row's mapping says it is ambiguous, as before)."""
    if len(set(columns)) != len(columns):
        return lambda row: tuple(row._mapping[name] for name in names)  # type: ignore[attr-defined]
    return operator.itemgetter(*(columns.index(name) for name in names))


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
    #: ``shadow``: run beside the caller's legacy path and never delivered (no signatures are kept).
    routing: str = "live"


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
    #: The operation's server (what a dispatcher batches polls by).
    server: str | None = None

    @classmethod
    def from_row(cls, row: Row[Any]) -> Claim:
        """A claim's row, its columns in the order of ``ledger.claim_statements.CLAIM_COLUMNS`` (read by
        position: a tick claims hundreds of rows)."""
        columns: Sequence[Any] = row
        op_id, state, server, poll_cursor, execution_epoch, cancel_generation, lease_until, delay_s = columns
        return cls(
            op_id,
            OpState(state),
            poll_cursor,
            execution_epoch,
            cancel_generation,
            lease_until,
            float(delay_s or 0.0),
            server,
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
    #: Every row whose publish failed, dead-lettered or not.
    failed: tuple[int, ...]
    #: The failed rows this drain dead-lettered (``outbox.status = 'dead'``, rule 9).
    dead: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ControlState:
    execution_epoch: int
    admission_open: bool
    disabled_adapters: tuple[str, ...]
    rollout: Mapping[str, Any]
    #: The executor identity that owns the current epoch (rule 13, recorded by ``longcall rollback``); None:
    #: every fleet works in it.
    epoch_owner: str | None = None

    def owned_by(self, executor_id: str | None) -> bool:
        """Whether a fleet running as ``executor_id`` may claim and write in the current epoch (a None
        ``executor_id``, a ledger that names no fleet, may)."""
        return owns(self.epoch_owner, executor_id)


@dataclass(frozen=True, slots=True)
class EpochOwnership:
    """Who owns the current execution epoch (rule 13), and whether the fleet that asked (``executor_id``;
    None: a ledger that names no fleet, e.g. an operator's command) is it."""

    execution_epoch: int
    epoch_owner: str | None
    executor_id: str | None

    @property
    def owns(self) -> bool:
        return owns(self.epoch_owner, self.executor_id)


def owns(epoch_owner: str | None, executor_id: str | None) -> bool:
    """Rule 13: an epoch without an owner is every fleet's; a ledger that names no fleet is never fenced."""
    return epoch_owner is None or executor_id is None or epoch_owner == executor_id


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

    @classmethod
    def from_row(cls, row: Row[Any]) -> ReconciliationRecord:
        values = {f.name: row._mapping[f.name] for f in dataclasses.fields(cls)}
        values["reason"] = ReconciliationReason(values["reason"])
        return cls(**values)


def adapter_key(protocol: str, protocol_version: str) -> str:
    return f"{protocol}/{protocol_version}"


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """Where the server says the remote operation stands, as the ledger keeps it (verbatim words)."""

    server_state: str | None
    status_message: str | None = None
    poll_interval_ms: int | None = None

    def columns(self) -> dict[str, Any]:
        return {
            "server_state": self.server_state,
            "status_message": self.status_message,
            "poll_interval_ms": self.poll_interval_ms,
        }


@dataclass(frozen=True, slots=True)
class DueIn:
    """A ``next_poll_at`` value (see :func:`due_in`, :func:`due_after`): bound as parameters, so the
    statement is built once."""

    seconds: float
    #: Never past the wait deadline or the expiry while they are ahead (a poll's schedule); not capped: a
    #: time the row must not be due before (a Retry-After, the wait for a token).
    capped: bool = True

    def interval(self) -> dt.timedelta:
        return dt.timedelta(seconds=max(0.0, self.seconds))


#: The poll schedule (rule 3), one home for the step that writes it (``workers/steps/context.py``) and the
#: claim that sets it ahead (``ledger/claim_statements.py``): a poll interval is at least ``MIN_POLL_S``, and
#: its jitter up to ``POLL_JITTER_SHARE`` of it, at most ``POLL_JITTER_MAX_S``.
MIN_POLL_S = 0.1
POLL_JITTER_SHARE = 0.05
POLL_JITTER_MAX_S = 0.25


def due_in(seconds: float) -> DueIn:
    """A ``next_poll_at`` value: ``seconds`` from the database's now, never past the wait budget or expiry
    still ahead (a deadline already past never makes the row due sooner)."""
    return DueIn(seconds)


def due_after(seconds: float) -> DueIn:
    """A ``next_poll_at`` value not sooner than ``seconds`` from the database's now, deadlines or not: a
    server's Retry-After, or the wait for a token (rule 3: nothing is due sooner than a Retry-After)."""
    return DueIn(seconds, capped=False)
