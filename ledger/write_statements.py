"""The statements that move an operation: the guarded write behind every named move (its shape,
:class:`WriteShape`, and its builder, :func:`guarded_update`), and the submission's insert. Each appends its
own event rows in the same statement. Rendered for PostgreSQL in docs/ledger-sql.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Float,
    Interval,
    Text,
    and_,
    bindparam,
    case,
    false,
    func,
    insert,
    literal,
    literal_column,
    or_,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.statements import (
    EVENT,
    EVENT_COLUMNS,
    OP,
    capped_due,
    current_epoch,
    due_at,
    event_from,
    operation_columns,
    owner_allows,
)
from ledger.states import CANCEL_WAITS_IN, OpState


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
    #: The guard also asks ``lease_until IS NOT NULL`` (the claim is still held: a copy of the same step
    #: under the same claim has not recorded it already).
    only_claimed: bool = False


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
    if shape.only_claimed:
        where.append(OP.c.lease_until.is_not(None))
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


def update_unchanged_polls() -> Any:
    """The polls of a batch that changed nothing, in one statement (DESIGN §3: counted on the row, no
    event): for each ``(:op_ids[i], :epochs[i], :generations[i], :cursors[i])`` still WORKING under that
    fence and still claimed (a copy of the batch that ran already let the claim go), ``unchanged_polls`` + 1,
    ``last_polled_at`` now, the lease let go; the next poll's due time is the later of the one its claim set
    and, when ``:next_in[i]`` is given, that many seconds from now (the read's time plus the interval),
    never past a deadline ahead, as ``record_poll`` sets it: never sooner than the interval after the read,
    however late the member ran or its record came. Only the epoch's owner writes (rule 13). Returns the ids
    written."""
    members = (
        func.unnest(
            bindparam("op_ids", type_=ARRAY(OP.c.id.type)),
            bindparam("epochs", type_=ARRAY(BigInteger())),
            bindparam("generations", type_=ARRAY(BigInteger())),
            bindparam("cursors", type_=ARRAY(BigInteger())),
            bindparam("next_in", type_=ARRAY(Float())),
        )
        .table_valued("id", "epoch", "generation", "cursor", "next_in")
        .render_derived(name="members")
    )
    rescheduled = capped_due(members.c.next_in * literal_column("interval '1 second'"), true())
    return (
        update(OP)
        .where(
            OP.c.id == members.c.id,
            OP.c.state == OpState.WORKING.value,
            OP.c.execution_epoch == members.c.epoch,
            OP.c.execution_epoch == current_epoch(),
            OP.c.cancel_generation == members.c.generation,
            OP.c.poll_cursor == members.c.cursor,
            OP.c.lease_until.is_not(None),
            owner_allows("fence_executor"),
        )
        .values(
            unchanged_polls=OP.c.unchanged_polls + 1,
            last_polled_at=func.now(),
            next_poll_at=case(
                (members.c.next_in.is_(None), OP.c.next_poll_at),
                else_=func.greatest(OP.c.next_poll_at, rescheduled),
            ),
            lease_until=None,
            updated_at=func.now(),
        )
        .returning(OP.c.id)
    )
