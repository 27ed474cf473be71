"""The ledger's SQL: its tables, the statement cache, the rule-13 reads a statement makes itself, the event
row a statement appends, and the hot reads, outbox and control statements; the guarded write and the
submission's insert are in ``ledger/write_statements.py``, the claims in ``ledger/claim_statements.py``, the
acceptance's in ``ledger/acceptance.py``; all of them rendered in docs/ledger-sql.md.

Builders are module-level functions of their shape (the columns a write sets, its flags); ``STATEMENTS`` keeps
what they build, so a transaction only binds values. Bind parameter names say where a value goes: ``fence_*``
in a guard, ``new_*`` in a SET list, ``event_*`` and ``then_*`` in the event rows a statement appends.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar, cast

from sqlalchemy import (
    ARRAY,
    Boolean,
    Integer,
    Interval,
    Table,
    Text,
    and_,
    bindparam,
    case,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    true,
    update,
)

from ledger import models

OP = cast(Table, models.ToolOperation.__table__)
EVENT = cast(Table, models.OperationEvent.__table__)
RECEIPT = cast(Table, models.TerminalReceipt.__table__)
OUTBOX = cast(Table, models.Outbox.__table__)
RECON = cast(Table, models.Reconciliation.__table__)
CONTROL = cast(Table, models.ExecutorControl.__table__)
CONTROL_AUDIT = cast(Table, models.ExecutorControlAudit.__table__)
CALL_NODE_CANCEL = cast(Table, models.CallNodeCancel.__table__)


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


def current_epoch() -> Any:
    """The control row's execution epoch, read by the statement itself (rule 13: a write or an acceptance of
    an older epoch is refused from the moment of the rollback, whatever the row still says)."""
    return select(CONTROL.c.execution_epoch).where(CONTROL.c.id == 1).scalar_subquery()


def current_owner() -> Any:
    """The control row's epoch owner (rule 13), read by the statement itself."""
    return select(CONTROL.c.epoch_owner).where(CONTROL.c.id == 1).scalar_subquery()


def owner_allows(param: str) -> Any:
    """Rule 13 in the statement itself: true unless the control row names an epoch owner and it is not the
    fleet ``:param`` (its executor identity). A NULL ``:param`` is a ledger that names no fleet (an
    operator's command, a test): never fenced. The owner is read by the statement (one init plan over the
    one control row), so a rollback that committed before it is obeyed whatever the caller last saw."""
    return func.coalesce(current_owner() == bindparam(param, type_=Text()), true())


def due_at(param: str) -> Any:
    """``now + :param``; when ``:param_capped``, never past the wait deadline or the expiry while they are
    still ahead. A deadline already past caps nothing: the step that meets it decides (rule 11, the wait
    budget's hand-over); it never makes a row due again at once, which would poll it in a tight loop and
    put it first in every claim (rule 3)."""
    return capped_due(bindparam(param, type_=Interval()), bindparam(f"{param}_capped", type_=Boolean()))


def capped_due(interval: Any, capped: Any) -> Any:
    """``now + interval``; when ``capped`` (a boolean SQL expression), never past the wait deadline or the
    expiry while they are still ahead (see :func:`due_at`)."""

    def ahead(deadline: Any) -> Any:
        return case((and_(capped, deadline > func.now()), deadline), else_=None)  # LEAST skips NULLs

    return func.least(func.now() + interval, ahead(OP.c.wait_deadline), ahead(OP.c.expires_at))


EVENT_COLUMNS = (
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


def event_from(  # noqa: PLR0917 - one row of an event, column by column
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


def insert_event() -> Any:
    return insert(EVENT)


def select_control() -> Any:
    return select(CONTROL).where(CONTROL.c.id == 1)


def select_disabled_adapters() -> Any:
    """The adapters disabled for new operations, the control row share-locked: a disable (an UPDATE of the
    row) waits for the transaction that read it, so what that transaction records was decided on what is
    true at its commit."""
    return select(CONTROL.c.disabled_adapters).where(CONTROL.c.id == 1).with_for_update(read=True)


def operation_columns(with_body: bool) -> list[Any]:
    """The row's columns, all of them or all but ``body`` (the arguments, up to ``max_body_bytes``)."""
    return [c for c in OP.c if with_body or c.name != "body"]


def select_operation_by_id(with_body: bool = True) -> Any:
    """The row, and the control row's epoch and owner as this statement reads them (``control_epoch``,
    ``control_epoch_owner``): what a step needs to know before it sends anything (rule 13), at no extra
    round trip."""
    return select(
        *operation_columns(with_body),
        current_epoch().label("control_epoch"),
        current_owner().label("control_epoch_owner"),
    ).where(OP.c.id == bindparam("op_id"))


def select_operations_by_ids() -> Any:
    """``select_operation_by_id`` (without the arguments) for the operations ``:op_ids``: a batch of polls'
    rows in one statement."""
    return select(
        *operation_columns(False),
        current_epoch().label("control_epoch"),
        current_owner().label("control_epoch_owner"),
    ).where(OP.c.id == func.any(bindparam("op_ids", type_=ARRAY(OP.c.id.type))))


def select_operation_by_call_node() -> Any:
    return select(OP).where(OP.c.call_node_id == bindparam("call_node_id"))


def select_ready_outbox(with_op: bool = False) -> Any:
    """Ready rows whose retry pause is over (``next_attempt_at``), in order, SKIP LOCKED. ``with_op``: one
    operation's only (``:op_id``), whole. Otherwise (the beat's drain) each row's id and the size of its
    stored payload (``pg_column_size``: as Postgres keeps it, read without detoasting it), for the drain to
    read no more of them at once than its byte budget allows (:func:`select_outbox_rows`)."""
    columns = (
        (OUTBOX,) if with_op else (OUTBOX.c.id, func.pg_column_size(OUTBOX.c.payload).label("stored_bytes"))
    )
    query = select(*columns).where(
        OUTBOX.c.status == "ready",
        or_(OUTBOX.c.next_attempt_at.is_(None), OUTBOX.c.next_attempt_at <= func.now()),
    )
    if with_op:
        query = query.where(OUTBOX.c.op_id == bindparam("op_id"))
    return query.order_by(OUTBOX.c.id).limit(bindparam("limit")).with_for_update(skip_locked=True)


def select_outbox_rows() -> Any:
    """The whole rows of ``:ids`` (the drain's, locked by its transaction already), in order."""
    return select(OUTBOX).where(OUTBOX.c.id.in_(bindparam("ids", expanding=True))).order_by(OUTBOX.c.id)


def update_outbox_dispatched() -> Any:
    return (
        update(OUTBOX)
        .where(OUTBOX.c.id.in_(bindparam("ids", expanding=True)))
        .values(
            status="dispatched",
            dispatched_at=func.now(),
            attempts=OUTBOX.c.attempts + 1,
            next_attempt_at=None,
        )
    )


def update_outbox_failed() -> Any:
    """A failed publish (``ledger/outbox.py``): the row's attempts, its error, its status (``ready`` or
    ``dead``) and its pause (``now + :new_pause``; NULL for a dead row)."""
    return (
        update(OUTBOX)
        .where(OUTBOX.c.id == bindparam("outbox_id"))
        .values(
            attempts=bindparam("new_attempts", type_=Integer()),
            last_error=bindparam("new_error", type_=Text()),
            status=bindparam("new_status", type_=Text()),
            next_attempt_at=func.now() + bindparam("new_pause", type_=Interval()),
        )
    )


def literal_json(value: Mapping[str, Any]) -> Any:
    return literal(dict(value), type_=models.Json)


def update_disabled_adapters(key: str, disabled: bool) -> Any:
    """The control row's ``disabled_adapters`` with ``key`` added (once, the list kept sorted by code point,
    as Python sorts it) or removed, computed from the row the UPDATE itself sees: never from a copy read
    earlier."""
    if not disabled:
        return CONTROL.c.disabled_adapters.op("-")(literal(key, type_=Text()))
    return text(
        '(SELECT jsonb_agg(listed.value ORDER BY listed.value COLLATE "C") FROM (SELECT DISTINCT value '
        "FROM jsonb_array_elements_text(executor_control.disabled_adapters || jsonb_build_array("
        "CAST(:adapter_key AS text)))) AS listed)"
    ).bindparams(adapter_key=key)
