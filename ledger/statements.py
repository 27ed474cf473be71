"""The ledger's SQL: tables, and every hot statement, built once per shape with bound values.

Builders are module-level functions of their shape (the columns a write sets, its flags); ``STATEMENTS`` keeps
what they build, so a transaction only binds values. Bind parameter names say where a value goes: ``fence_*``
in a guard, ``new_*`` in a SET list, ``event_*`` and ``then_*`` in the event rows a statement appends.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from sqlalchemy import (
    ARRAY,
    Boolean,
    Float,
    Integer,
    Interval,
    Table,
    Text,
    and_,
    bindparam,
    case,
    false,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger import models
from ledger.models import DISPATCH_TICK
from ledger.states import ACCEPT_FROM, ACCEPT_TO, CANCEL_WAITS_IN, OpState, TerminalKind

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
    capped = bindparam(f"{param}_capped", type_=Boolean())

    def ahead(deadline: Any) -> Any:
        return case((and_(capped, deadline > func.now()), deadline), else_=None)  # LEAST skips NULLs

    return func.least(
        func.now() + bindparam(param, type_=Interval()), ahead(OP.c.wait_deadline), ahead(OP.c.expires_at)
    )


# ----------------------------------------------------------------------------------- hot statements


@dataclass(frozen=True, slots=True)
class WriteShape:
    """What a guarded write's statement depends on: the columns it sets (and which are ``due_in`` values),
    and its flags. Values are bound: ``fence_*`` in the guard, ``new_*`` in the SET list."""

    columns: tuple[tuple[str, bool], ...]
    to_state: bool
    two_edges: bool
    bump_generation: bool
    with_cursor: bool
    with_round: bool
    #: The second event's detail names the row's submission key (a resubmission says which key it reuses).
    then_names_key: bool = False
    #: A quiet write appends its event only when one of these columns changes (never, when empty) and
    #: otherwise counts itself in ``counter`` (DESIGN §3: an unchanged poll, a missing token). None: a
    #: write that always appends its event.
    quiet_unless_changed: tuple[str, ...] | None = None
    counter: str | None = None
    #: How the write treats a cancel intent recorded while its writer was in flight (rule 6): "strict"
    #: refuses it (the generation must match), "tolerate" writes anyway in a state where an intent waits,
    #: "route" does too and goes to CANCEL_REQUESTED instead of ``new_state`` when the row's generation is
    #: above ``fence_route_above``.
    after_intent: str = "strict"
    #: The row it returns includes ``body`` (the arguments); False for a write on the poll path.
    with_body: bool = True
    #: The guard also asks ``submit_attempted_at IS NULL`` (the create attempt, recorded once).
    only_unattempted: bool = False


def guarded_update(shape: WriteShape) -> Any:
    """``UPDATE ... WHERE id AND state IN AND epoch AND generation [AND cursor AND owner] [AND round]
    RETURNING`` (the owner: a write under a claim is the epoch owner's, ``fence_executor``; rule 13),
    the row locked first (``prior``) so the statement also returns the state it found, and the move's event
    (``event_kind``, ``event_detail``) appended from the updated row by the same statement: a stale write
    updates nothing, so it appends nothing either. A move along two edges appends two events, the first
    into ``halfway_state`` and the second, ``then_kind`` with ``then_detail``, on to the row's state."""
    quiet = shape.quiet_unless_changed
    watched = [OP.c[name] for name in quiet or ()]
    prior = (
        select(OP.c.id, OP.c.state, *watched)
        .where(OP.c.id == bindparam("fence_id"))
        .with_for_update()
        .cte("prior")
    )
    sets: dict[str, Any] = {
        name: due_at(f"new_{name}") if due else bindparam(f"new_{name}", type_=OP.c[name].type)
        for name, due in shape.columns
    }
    sets["event_seq"] = OP.c.event_seq + (2 if shape.two_edges else 1)
    if quiet is not None:
        if shape.counter is None or shape.two_edges:
            raise ValueError("a quiet write names its counter and moves along one edge at most")
        # SET sees the row as it was: "changed" compares the stored values with the new ones.
        changed: Any = or_(false(), *(column.is_distinct_from(sets[column.name]) for column in watched))
        sets["event_seq"] = OP.c.event_seq + case((changed, 1), else_=0)
        sets[shape.counter] = OP.c[shape.counter] + case((changed, 0), else_=1)
    sets["updated_at"] = func.now()
    if shape.to_state:
        sets["state"] = bindparam("new_state", type_=OP.c.state.type)
        if shape.after_intent == "route":
            routed = OP.c.cancel_generation > bindparam("fence_route_above")
            sets["state"] = case(
                (routed, literal(OpState.CANCEL_REQUESTED.value, type_=OP.c.state.type)),
                else_=sets["state"],
            )
            if "lease_until" in sets:
                # Routed, the writer's step goes on to send the cancel under its claim: the lease stays
                # (rule 3: no move lets go of a claim while its step goes on).
                sets["lease_until"] = case((routed, OP.c.lease_until), else_=sets["lease_until"])
    if shape.bump_generation:
        sets["cancel_generation"] = OP.c.cancel_generation + 1
    generation_ok: Any = OP.c.cancel_generation == bindparam("fence_generation")
    if shape.after_intent != "strict":
        generation_ok = or_(
            generation_ok,
            and_(
                OP.c.cancel_generation > bindparam("fence_generation"),
                OP.c.state.in_([s.value for s in CANCEL_WAITS_IN]),
            ),
        )
    where = [
        OP.c.id == prior.c.id,
        OP.c.state.in_(bindparam("fence_states", expanding=True)),
        OP.c.execution_epoch == bindparam("fence_epoch"),
        OP.c.execution_epoch == current_epoch(),
        generation_ok,
    ]
    if shape.with_cursor:
        # A write under a claim: only the epoch's owner makes one (rule 13). A write without a cursor (an
        # intent sent by name: a cancel, an input reply; an operator's decision) is any fleet's to record.
        where.append(OP.c.poll_cursor == bindparam("fence_cursor"))
        where.append(owner_allows("fence_executor"))
    if shape.with_round:
        where.append(OP.c.input_round == bindparam("fence_round"))
    if shape.only_unattempted:
        where.append(OP.c.submit_attempted_at.is_(None))
    moved = (
        update(OP)
        .where(*where)
        .values(sets)
        .returning(*operation_columns(shape.with_body), prior.c.state.label("prior_state"))
        .cte("moved")
    )
    detail = bindparam("event_detail", type_=EVENT.c.detail.type)
    kind = bindparam("event_kind", type_=EVENT.c.kind.type)
    if shape.two_edges:
        halfway = bindparam("halfway_state", type_=EVENT.c.to_state.type)
        then_detail: Any = bindparam("then_detail", type_=EVENT.c.detail.type)
        if shape.then_names_key:
            then_detail = then_detail.op("||")(
                func.jsonb_build_object(literal("submission_key"), sql_cast(moved.c.submission_key, Text))
            )
        events: Any = union_all(
            event_from(moved, moved.c.event_seq - 1, kind, moved.c.prior_state, halfway, detail),
            event_from(
                moved,
                moved.c.event_seq,
                bindparam("then_kind", type_=EVENT.c.kind.type),
                halfway,
                moved.c.state,
                then_detail,
            ),
        )
    else:
        events = event_from(moved, moved.c.event_seq, kind, moved.c.prior_state, moved.c.state, detail)
    if quiet is not None:
        if not quiet:
            return select(moved)
        events = events.where(or_(*(prior.c[c.name].is_distinct_from(moved.c[c.name]) for c in watched)))
    appended = insert(EVENT).from_select(EVENT_COLUMNS, events).returning(EVENT.c.seq).cte("appended")
    return select(moved).add_cte(appended)


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


def accept_update(kind: TerminalKind) -> Any:
    """Rule 8's one guarded statement: every piece of evidence in the guard (``ev_*``); the receipt
    (``receipt_id``, ``receipt_audit``) is inserted from the accepted row by the same statement, and returned
    with it as ``receipt_*`` columns. Nothing accepted, no receipt."""
    observed_ok = OP.c.observed_terminal == kind.value
    if kind is TerminalKind.CANCELLED:
        observed_ok = or_(
            observed_ok,
            OP.c.state == OpState.CANCEL_REQUESTED.value,
            # A cancel requested before any create was attempted: nothing ever ran on the server.
            and_(
                OP.c.state == OpState.SUBMITTING.value,
                OP.c.submit_attempted_at.is_(None),
                OP.c.cancel_generation > 0,
            ),
        )
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
            OP.c.execution_epoch == current_epoch(),
            owner_allows("ev_executor"),  # every acceptance is made under a claim (rule 13)
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


def insert_terminal_outbox() -> Any:
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
    appended = insert(EVENT).from_select(EVENT_COLUMNS, row).returning(EVENT.c.seq).cte("appended")
    return select(queued.c.id).add_cte(appended)


def insert_operation() -> Any:
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
        "routing",
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
    event = event_from(
        inserted,
        inserted.c.event_seq,
        literal("submitted", type_=EVENT.c.kind.type),
        literal(None, type_=EVENT.c.from_state.type),
        inserted.c.state,
        bindparam("event_detail", type_=EVENT.c.detail.type),
    )
    appended = insert(EVENT).from_select(EVENT_COLUMNS, event).returning(EVENT.c.seq).cte("appended")
    return select(inserted).add_cte(appended)


def _claim_values(with_epoch: bool | Literal["current"]) -> dict[str, Any]:
    """A claim bumps the cursor and sets the lease (``claim_lease``); with ``claim_epoch``, it takes the row
    over into that execution epoch (rule 13); with ``"current"``, into the control row's epoch as the
    statement itself reads it (no read of the control row before the claim)."""
    values: dict[str, Any] = {
        "poll_cursor": OP.c.poll_cursor + 1,
        "lease_until": func.now() + bindparam("claim_lease", type_=Interval()),
    }
    if with_epoch == "current":
        values["execution_epoch"] = func.greatest(OP.c.execution_epoch, current_epoch())
    elif with_epoch:
        values["execution_epoch"] = func.greatest(
            OP.c.execution_epoch, bindparam("claim_epoch", type_=OP.c.execution_epoch.type)
        )
    return values


def update_claim_due(with_server: bool, with_epoch: bool) -> Any:
    conditions = [
        OP.c.next_poll_at <= func.now() + bindparam("claim_horizon", type_=Interval()),
        or_(OP.c.lease_until.is_(None), OP.c.lease_until < func.now()),
        owner_allows("claim_executor"),  # a fleet that does not own the epoch claims nothing (rule 13)
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


def update_claim_due_by_server(with_epoch: bool | Literal["current"]) -> Any:
    """``update_claim_due`` for many servers in one statement: for each ``claim_servers[i]``, at most
    ``claim_rooms[i]`` (and ``claim_limit``) of its due rows (in due order, SKIP LOCKED, an index scan on
    ``ix_tool_operation_server_due`` each), and at most ``claim_limit`` over all of them, shared by the
    servers (rule 3: every configured server gets its share of every tick, whatever the others have due).

    The share: each server's due rows are ranked (1 = its most overdue) and the tick takes the ``claim_limit``
    first by ``(rank - 1) / room``, so every server's first due row comes before any server's second, and
    past the first rows the limit is shared in proportion to the rooms (the servers' budgets per tick).
    Servers level on that order are taken in a rotation that moves on by ``claim_limit`` at every tick
    (``dispatch_tick``, a sequence: one value per tick): with more servers than the limit, consecutive ticks
    take the next servers, and every server is reached within ``ceil(servers / claim_limit)`` ticks, whether
    the ticks come a second or a millisecond apart, from one dispatcher or several.

    The rows are counted first, reading and locking nothing, and only each server's quota is then locked
    (SKIP LOCKED: a row another dispatcher holds is left to it, and this tick claims that much less); the
    quotas are the ranking above done on the counts alone (Postgres refuses a window function at the level
    of a ``FOR UPDATE``). So that a backlog costs about the rows claimed, not all a server could take, each
    server is counted at first only up to twice its share of the limit were every server busy (``first``):
    enough whenever most servers are; a server whose count reached that bound while it could matter (it
    took all of it, or the limit was not filled) is counted again up to its room, and the quotas follow
    those counts. Every value a quota depends on is thus exact.
    """
    servers = bindparam("claim_servers", type_=ARRAY(Text()))
    room_list = bindparam("claim_rooms", type_=ARRAY(Integer()))
    limit = bindparam("claim_limit", type_=Integer())
    rooms = (
        func.unnest(servers, room_list)
        .table_valued("server", "room", with_ordinality="ord")
        .render_derived(name="rooms")
    )

    def due_and_free() -> list[Any]:
        return [
            OP.c.server == rooms.c.server,
            OP.c.next_poll_at <= func.now() + bindparam("claim_horizon", type_=Interval()),
            or_(OP.c.lease_until.is_(None), OP.c.lease_until < func.now()),
            # A fleet that does not own the epoch claims nothing, and locks nothing (rule 13).
            owner_allows("claim_executor"),
        ]

    def counted(cap: Any, name: str) -> Any:
        """(ord, n): each server's due and free rows, at most ``cap`` of them, read in due order."""
        peek = select(OP.c.id).where(*due_and_free()).order_by(OP.c.next_poll_at).limit(cap).lateral()
        return (
            select(rooms.c.ord, func.count(peek.c.id).label("n"))
            .select_from(rooms.join(peek, true()))
            .group_by(rooms.c.ord)
            .subquery(name)
        )

    # The rotation's tick, taken once (two quota rounds read it); the first server's position: tick * limit,
    # modulo the servers (each factor reduced first: the product of two bigints could overflow).
    tick = select(func.nextval(DISPATCH_TICK.name).label("value")).cte("tick")
    count = func.cardinality(servers)
    first_turn = ((select(tick.c.value).scalar_subquery() % count) * (limit % count)) % count

    def quotas(waiting: Any, name: str) -> Any:
        """(ord, quota): the ``claim_limit`` first places over ``waiting``'s counts, by share then turn."""
        place = func.generate_series(1, waiting.c.n).table_valued("rank").render_derived(name=f"{name}_place")
        share = sql_cast(place.c.rank - 1, Float()) / waiting.c.room
        turn = (waiting.c.ord - 1 - first_turn + count) % count
        taken = (
            select(waiting.c.ord)
            .select_from(waiting.join(place, true()))
            .order_by(share, turn)
            .limit(limit)
            .subquery(f"{name}_taken")
        )
        return select(taken.c.ord, func.count().label("quota")).group_by(taken.c.ord).cte(name)

    full = func.least(rooms.c.room, limit)
    listed = func.unnest(room_list).table_valued("room").render_derived(name="listed")
    all_rooms = select(func.sum(listed.c.room)).scalar_subquery()
    bound = func.least(full, func.ceil(2.0 * limit * rooms.c.room / all_rooms) + 1)
    first = counted(bound, "first_count")
    first_waiting = (
        select(rooms.c.ord, rooms.c.room, bound.label("bound"), full.label("full"), first.c.n)
        .select_from(rooms.join(first, first.c.ord == rooms.c.ord))
        .cte("first_waiting")
    )
    first_quotas = quotas(first_waiting, "first_quotas")
    unfilled = limit > func.coalesce(select(func.sum(first_quotas.c.quota)).scalar_subquery(), 0)
    recount = (
        select(first_waiting.c.ord)
        .select_from(first_waiting.outerjoin(first_quotas, first_quotas.c.ord == first_waiting.c.ord))
        .where(
            first_waiting.c.n == first_waiting.c.bound,
            first_waiting.c.bound < first_waiting.c.full,
            or_(func.coalesce(first_quotas.c.quota, 0) == first_waiting.c.bound, unfilled),
        )
        .subquery("recount")
    )
    again_peek = select(OP.c.id).where(*due_and_free()).order_by(OP.c.next_poll_at).limit(full).lateral()
    again = (
        select(rooms.c.ord, func.count(again_peek.c.id).label("n"))
        .select_from(rooms.join(recount, recount.c.ord == rooms.c.ord).join(again_peek, true()))
        .group_by(rooms.c.ord)
        .subquery("again")
    )
    waiting = (
        select(
            first_waiting.c.ord, first_waiting.c.room, func.coalesce(again.c.n, first_waiting.c.n).label("n")
        )
        .select_from(first_waiting.outerjoin(again, again.c.ord == first_waiting.c.ord))
        .cte("waiting")
    )
    final_quotas = quotas(waiting, "quotas")
    per_server = (
        select(OP.c.id)
        .where(*due_and_free())
        .order_by(OP.c.next_poll_at)
        .limit(final_quotas.c.quota)
        .with_for_update(skip_locked=True)
        .lateral("per_server")
    )
    due = (
        select(per_server.c.id)
        .select_from(rooms.join(final_quotas, final_quotas.c.ord == rooms.c.ord).join(per_server, true()))
        .limit(limit)  # no more than the quotas make: it tells the planner how few rows the update joins
        .cte("due")
    )
    return update(OP).where(OP.c.id == due.c.id).values(_claim_values(with_epoch)).returning(*CLAIM_COLUMNS)


def update_claim_one(with_epoch: bool, cancel_before_create: bool = False) -> Any:
    """Claim one row whose lease is free or ran out. ``cancel_before_create``: also a SUBMITTING row with a
    cancel requested and no create attempt recorded, whatever its lease: no create can be in flight without
    a recorded attempt, and the step that held the claim (a worker killed after its insert) is fenced by the
    cursor this claim bumps and by the bumped generation (rule 6: a cancel never waits out a dead lease)."""
    free: Any = or_(OP.c.lease_until.is_(None), OP.c.lease_until < func.now())
    if cancel_before_create:
        free = or_(
            free,
            and_(
                OP.c.state == OpState.SUBMITTING.value,
                OP.c.submit_attempted_at.is_(None),
                OP.c.cancel_generation > 0,
            ),
        )
    return (
        update(OP)
        .where(OP.c.id == bindparam("claim_id"), free, owner_allows("claim_executor"))
        .values(_claim_values(with_epoch))
        .returning(*CLAIM_COLUMNS)
    )


def update_release_claim() -> Any:
    """Let go of the claim ``claim_cursor`` on ``claim_id`` (its lease cleared, nothing else): the row is
    due again as it was."""
    return (
        update(OP)
        .where(
            OP.c.id == bindparam("claim_id"),
            OP.c.poll_cursor == bindparam("claim_cursor"),
            OP.c.lease_until.is_not(None),
        )
        .values(lease_until=None)
        .returning(OP.c.id)
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


def select_operation_by_call_node() -> Any:
    return select(OP).where(OP.c.call_node_id == bindparam("call_node_id"))


def select_ready_outbox(with_op: bool = False) -> Any:
    """Ready rows whose retry pause is over (``next_attempt_at``), in order, SKIP LOCKED; ``with_op``: one
    operation's only (``:op_id``)."""
    query = select(OUTBOX).where(
        OUTBOX.c.status == "ready",
        or_(OUTBOX.c.next_attempt_at.is_(None), OUTBOX.c.next_attempt_at <= func.now()),
    )
    if with_op:
        query = query.where(OUTBOX.c.op_id == bindparam("op_id"))
    return query.order_by(OUTBOX.c.id).limit(bindparam("limit")).with_for_update(skip_locked=True)


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
