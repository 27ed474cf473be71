"""The claims: a dispatcher's tick over many servers, the claims of due rows and of one row, and the hand-back
of a claim. Each bumps the poll cursor (the fence of every write under the claim) and sets the lease in one
statement, SKIP LOCKED where it takes many rows. Rendered for PostgreSQL in docs/ledger-sql.md.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Float,
    Integer,
    Interval,
    Text,
    and_,
    bindparam,
    case,
    func,
    literal,
    literal_column,
    or_,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy import cast as sql_cast

from ledger.models import DISPATCH_TICK
from ledger.records import MIN_POLL_S, POLL_JITTER_MAX_S, POLL_JITTER_SHARE
from ledger.statements import OP, current_epoch, owner_allows
from ledger.states import OpState


def _delay(due_at: Any) -> Any:
    """Seconds until ``due_at`` (0 when it is past): what a claimed step waits before it runs."""
    return func.greatest(0, func.extract("epoch", due_at - func.now())).label("delay_s")


CLAIM_DELAY = _delay(OP.c.next_poll_at)
#: The state whose claims are polls (a status read on the poll budget; the only state that is due besides
#: those of a cancel, a fetch, a create's or a lookup's retry): a server's other due rows are claimed first.
#: A constant in the SQL, so that the planner matches the partial index's predicate.
WORKING: Any = literal_column(f"'{OpState.WORKING.value}'")
#: What a claim returns, in this order (``ledger.records.Claim.from_row`` reads them by position).
CLAIM_COLUMNS = (
    OP.c.id,
    OP.c.state,
    OP.c.server,
    OP.c.poll_cursor,
    OP.c.execution_epoch,
    OP.c.cancel_generation,
    OP.c.lease_until,
    CLAIM_DELAY,
)


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


def next_poll_ahead(servers: Any) -> Any:
    """A WORKING row's next poll, set by the claim that sends its poll (rule 3, as the poll step would set
    it were the answer unchanged: ``workers/steps/poll.py``): from its due time (now, when overdue), its kept
    poll interval (at least ``MIN_POLL_S``) or its server's default (``:claim_default_poll_ms``, by the
    server's place in ``:claim_servers``), plus a jitter of up to ``POLL_JITTER_SHARE`` of it (at most
    ``POLL_JITTER_MAX_S``), never past the wait deadline or the expiry while they are ahead. Any other
    state's due time is left as it is."""
    defaults = (
        func.unnest(servers, bindparam("claim_default_poll_ms", type_=ARRAY(Integer())))
        .table_valued("server", "ms")
        .render_derived(name="defaults")
    )
    default_ms = select(defaults.c.ms).where(defaults.c.server == OP.c.server).scalar_subquery()
    default_s = sql_cast(default_ms, Float()) / 1000.0
    kept_s = func.greatest(literal(MIN_POLL_S, Float()), sql_cast(OP.c.poll_interval_ms, Float()) / 1000.0)
    interval_s = case((OP.c.poll_interval_ms.is_not(None), kept_s), else_=default_s)
    jitter_s = func.random() * func.least(
        literal(POLL_JITTER_SHARE, Float()) * interval_s, literal(POLL_JITTER_MAX_S, Float())
    )
    second = literal(dt.timedelta(seconds=1), Interval())
    due = func.greatest(func.now(), OP.c.next_poll_at) + (interval_s + jitter_s) * second

    def ahead(deadline: Any) -> Any:
        return case((deadline > func.now(), deadline), else_=None)  # LEAST skips NULLs

    scheduled = func.least(due, ahead(OP.c.wait_deadline), ahead(OP.c.expires_at))
    return case((OP.c.state == OpState.WORKING.value, scheduled), else_=OP.c.next_poll_at)


def update_claim_due_by_server(with_epoch: bool | Literal["current"], schedule: bool = False) -> Any:
    """``update_claim_due`` for many servers in one statement: for each ``claim_servers[i]``, at most
    ``claim_rooms[i]`` (and ``claim_limit``) of its due rows (SKIP LOCKED: first its rows that are not polls,
    at most ``claim_control_rooms[i]``, in due order on ``ix_tool_operation_server_due_not_working``; then
    its polls in due order on ``ix_tool_operation_server_due``), and at most ``claim_limit`` over all of
    them, shared by the servers (rule 3: every configured server gets its share of every tick, whatever the
    others have due).

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

    ``schedule``: the claim also sets each WORKING row's next poll (:func:`next_poll_ahead`), so that a poll
    that changes nothing needs no write of its schedule (``Ledger.record_unchanged_polls``).
    """
    servers = bindparam("claim_servers", type_=ARRAY(Text()))
    room_list = bindparam("claim_rooms", type_=ARRAY(Integer()))
    control_list = bindparam("claim_control_rooms", type_=ARRAY(Integer()))
    limit = bindparam("claim_limit", type_=Integer())
    rooms = (
        func.unnest(servers, room_list, control_list)
        .table_valued("server", "room", "control_room", with_ordinality="ord")
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

    def per_server(urgent: bool, quota: Any, name: str) -> Any:
        """A server's due and free rows, at most ``quota``, in due order, locked (SKIP LOCKED): those that
        are not its polls (``urgent``: a cancel to send or confirm, a result to fetch, a create's or a
        lookup's retry: the partial index ``ix_tool_operation_server_due_not_working``) or its polls."""
        return (
            select(OP.c.id, OP.c.next_poll_at)
            .where(*due_and_free(), OP.c.state != WORKING if urgent else OP.c.state == WORKING)
            .order_by(OP.c.next_poll_at)
            .limit(quota)
            .with_for_update(skip_locked=True)
            .lateral(name)
        )

    # Within a server's quota, what is not a poll comes first (rule 3: a cancel or a fetch never waits
    # behind a backlog of polls), at most what its control budget hands out in a tick (its requests are
    # paid by that budget: more would only come back without a token, and keep the polls from the poll
    # budget), then its polls, most overdue first.
    with_quota = rooms.join(final_quotas, final_quotas.c.ord == rooms.c.ord)
    urgent_rows = per_server(True, func.least(final_quotas.c.quota, rooms.c.control_room), "urgent_rows")
    urgent = (
        select(rooms.c.ord, urgent_rows.c.id, urgent_rows.c.next_poll_at)
        .select_from(with_quota.join(urgent_rows, true()))
        .cte("urgent")
    )
    urgent_n = select(urgent.c.ord, func.count().label("n")).group_by(urgent.c.ord).cte("urgent_n")
    poll_rows = per_server(False, final_quotas.c.quota - func.coalesce(urgent_n.c.n, 0), "poll_rows")
    polls = select(poll_rows.c.id, poll_rows.c.next_poll_at).select_from(
        with_quota.outerjoin(urgent_n, urgent_n.c.ord == rooms.c.ord).join(poll_rows, true())
    )
    both = union_all(select(urgent.c.id, urgent.c.next_poll_at), polls).subquery("both_rows")
    due = (
        select(both.c.id, both.c.next_poll_at)
        .limit(limit)  # no more than the quotas make: it tells the planner how few rows the update joins
        .cte("due")
    )
    values = _claim_values(with_epoch)
    if schedule:
        values["next_poll_at"] = next_poll_ahead(servers)
    # The delay is the row's due time as the claim found it (RETURNING reads the new values otherwise).
    columns = (*CLAIM_COLUMNS[:-1], _delay(due.c.next_poll_at)) if schedule else CLAIM_COLUMNS
    return update(OP).where(OP.c.id == due.c.id).values(values).returning(*columns)


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


def update_release_claims() -> Any:
    """Let go of the claims ``(:claim_ids[i], :claim_cursors[i])`` in one statement, each row due again in
    ``:claim_due_in_s[i]`` seconds at the latest (its lease cleared; no event): the next tick claims it again
    then. The claim that sent a WORKING row's poll set its next poll an interval on
    (:func:`next_poll_ahead`); a claim handed back without its poll must not keep that, or the row would
    skip a round of polls. ``:claim_no_token`` 1: handed back because the server's budget had no token for
    the requests: each row is due in exactly ``due_in_s``, never sooner, and its ``no_token_count`` counts
    it. Returns the ids let go (a claim no longer the row's is left alone)."""
    claims = (
        func.unnest(
            bindparam("claim_ids", type_=ARRAY(OP.c.id.type)),
            bindparam("claim_cursors", type_=ARRAY(BigInteger())),
            bindparam("claim_due_in_s", type_=ARRAY(Float())),
        )
        .table_valued("id", "cursor", "due_in_s")
        .render_derived(name="claims")
    )
    second = literal(dt.timedelta(seconds=1), Interval())
    no_token = bindparam("claim_no_token", type_=Integer())
    return (
        update(OP)
        .where(
            OP.c.id == claims.c.id,
            OP.c.poll_cursor == claims.c.cursor,
            OP.c.lease_until.is_not(None),
        )
        .values(
            lease_until=None,
            # Handed back for want of a token: due when the bucket said, not sooner (rule 4, as a reschedule
            # would); else never later than it is (a row another writer made due at once stays so).
            next_poll_at=case(
                (no_token == 1, func.now() + claims.c.due_in_s * second),
                else_=func.least(OP.c.next_poll_at, func.now() + claims.c.due_in_s * second),
            ),
            no_token_count=OP.c.no_token_count + no_token,
        )
        .returning(OP.c.id)
    )
