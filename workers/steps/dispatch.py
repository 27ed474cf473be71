"""Rules 3 and 13: claim what is due, each server its share up to its room, as the messages the dispatcher
publishes.

Only rows of the current execution epoch are claimed; each claim bumps the row's poll cursor, which names
the message (its task id) and fences the step it runs. The polls of WORKING operations of one server travel
several to a message (:func:`messages`, ``poll_batch``), each member still under its own cursor; every other
step (a submission's, a cancel, a result fetch) is a message of its own, so none waits behind polls.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.states import OpState
from workers.hot import RATE_HEADROOM, burst_for
from workers.steps.context import StepContext

S = OpState

#: The task every poll runs under, a batch of them included.
POLL_TASK = "longcall.poll"
#: A step due sooner than this is sent without a countdown, and a batch member run without a wait.
COUNTDOWN_FLOOR_S = 0.005

#: Which task advances an operation in each state the dispatcher finds due.
TASK_FOR_STATE: Mapping[OpState, str] = {
    S.SUBMITTING: "longcall.poll",
    S.SUBMISSION_UNKNOWN: "longcall.poll",
    S.WORKING: "longcall.poll",
    S.CANCEL_REQUESTED: "longcall.cancel",
    S.TERMINAL_OBSERVED: "longcall.fetch_result",
    S.FETCHING_RESULT: "longcall.fetch_result",
}


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One message to publish: run ``task`` for the operation under the claim ``cursor``."""

    task: str
    op_id: uuid.UUID
    cursor: int
    #: Due this many seconds from now: at most one dispatch tick, so a short countdown, never a long ETA.
    delay_s: float = 0.0
    #: The operation's server and state as claimed: a WORKING operation's poll may share a message with
    #: other polls of its server (None: a message of its own).
    server: str | None = None
    state: OpState | None = None

    @property
    def task_id(self) -> str:
        return f"{self.task}:{self.op_id}:{self.cursor}"

    @property
    def batches(self) -> bool:
        return self.task == POLL_TASK and self.state is S.WORKING and self.server is not None


@dataclass(frozen=True, slots=True)
class Message:
    """One message the dispatcher publishes: ``task(**kwargs)`` under ``task_id``, sent ``delay_s`` from now
    (below :data:`COUNTDOWN_FLOOR_S`: at once)."""

    task: str
    kwargs: dict[str, Any]
    task_id: str
    delay_s: float
    #: How many claimed steps the message carries.
    size: int = 1

    @property
    def countdown(self) -> float | None:
        return self.delay_s if self.delay_s >= COUNTDOWN_FLOOR_S else None


def messages(dispatches: Sequence[Dispatch], poll_batch: int) -> list[Message]:
    """The messages of one tick's claims: each step that does not batch as one message of its own, first (a
    cancel or a fetch never waits behind polls in a queue), then the polls of WORKING operations, up to
    ``poll_batch`` of one server to a message.

    A batch goes with its earliest member's countdown, and each later member with the rest of its own delay
    as a wait (``[op_id, cursor, wait_s]``; due at once: ``[op_id, cursor]``) that the worker keeps before
    that member's step, so no poll is sent before its due time (rule 3: never sooner than a Retry-After);
    every delay is at most one dispatch tick, so is every wait. The task id is derived from the members
    (the first of them by id and cursor, and their count): the same batch published twice has one id, and
    its members run once each (the second copy finds their claims done, or superseded). A batch of one is
    the one-operation message of old (``op_id``, ``cursor``), the form a worker of every version takes."""
    singles = [d for d in dispatches if poll_batch <= 1 or not d.batches]
    by_server: dict[str, list[Dispatch]] = {}
    for dispatch in dispatches:
        if poll_batch > 1 and dispatch.batches:
            by_server.setdefault(str(dispatch.server), []).append(dispatch)
    out = [_single(d) for d in singles]
    for server in sorted(by_server):
        # By due time, then by id: a UUID's number orders as its text does, without making the text (and
        # compares in C, where the UUID's own comparison is a Python call).
        polls = sorted(by_server[server], key=lambda d: (d.delay_s, d.op_id.int))
        out.extend(_batch(polls[start : start + poll_batch]) for start in range(0, len(polls), poll_batch))
    return out


def _single(dispatch: Dispatch) -> Message:
    kwargs = {"op_id": str(dispatch.op_id), "cursor": dispatch.cursor}
    return Message(dispatch.task, kwargs, dispatch.task_id, dispatch.delay_s)


def _batch(members: Sequence[Dispatch]) -> Message:
    if len(members) == 1:
        return _single(members[0])
    first = members[0].delay_s
    ops: list[list[Any]] = []
    for member in members:
        wait = member.delay_s - first
        op: list[Any] = [str(member.op_id), member.cursor]
        ops.append([*op, round(wait, 3)] if wait >= COUNTDOWN_FLOOR_S else op)
    lead = min(members, key=lambda d: (d.op_id.int, d.cursor))  # the least by id's text and cursor
    task_id = f"{POLL_TASK}:batch:{lead.op_id}:{lead.cursor}:{len(members)}"
    return Message(POLL_TASK, {"ops": ops}, task_id, first, size=len(members))


def tick_room(poll_qps: float, control_qps: float, tick_s: float) -> int:
    """The rows a dispatch tick claims of one server at most: what its two buckets hand out in one tick,
    their bursts included (``workers.hot``: ``RATE_HEADROOM`` of each rate, ``burst_for`` ahead), at least
    one. A claimed poll the bucket has no slot for is handed back unsent, having cost its share of a
    message, of the batch's read and of its slot booking, and the claim and the hand-back. The room was
    twice the buckets' rates a tick until 2026-12-06: a server whose polls outran a 10/s budget had 40 rows
    a second claimed for 8 slots, 16 now. Past the room, due rows wait in the ledger at no cost (those
    that are not polls claimed first, within :func:`control_room`; each in due order)."""
    return max(1, math.ceil(_handed_out(poll_qps, tick_s) + _handed_out(control_qps, tick_s)))


def control_room(control_qps: float, tick_s: float) -> int:
    """Of a server's room (:func:`tick_room`), the rows that are not polls a tick claims first at most (a
    cancel to send or confirm, a result to fetch, a create's or a lookup's retry): what its control bucket,
    which pays their requests, hands out in one tick, at least one. More would come back without a token,
    and keep its polls from the poll budget meanwhile."""
    return max(1, math.ceil(_handed_out(control_qps, tick_s)))


def _handed_out(qps: float, tick_s: float) -> float:
    """What a bucket of ``qps`` hands out in one tick, its burst included (``workers.hot``)."""
    return qps * RATE_HEADROOM * tick_s + burst_for(qps)


def dispatch_due(ctx: StepContext, limit: int | None = None) -> list[Dispatch]:
    """Claim what is due, at most what each server's buckets hand out in a tick (:func:`tick_room`), and
    at most ``limit`` (``dispatch_batch``) in all, shared by the servers: every server's most
    overdue row before any server's second, the rest in proportion to the rooms, and servers level on that
    taken in a rotation that moves on every tick (``Ledger.claim_due_by_server``), so every configured
    server gets its share of every tick whatever the others have due (rule 3), and with more servers than
    the batch each is reached within ``ceil(servers / batch)`` ticks. A poll storm then waits in the ledger,
    ordered by due time, instead of churning through the broker and the buckets. The buckets remain the
    guarantee (rule 4). One statement claims for every server (issue 13: a tick's cost must not grow with
    the number of configured servers), and takes the rows over into the current epoch as it reads it (rule
    13): a tick is one transaction."""
    settings = ctx.settings
    servers = sorted(ctx.runtime.fleet.servers.items())
    rooms = [
        (name, tick_room(server.poll_qps, server.control_qps, settings.dispatch_interval_s))
        for name, server in servers
    ]
    claims = ctx.ledger.claim_due_by_server(
        rooms,
        limit=limit or settings.dispatch_batch,
        lease_s=settings.lease_s,
        epoch="current",
        horizon_s=settings.dispatch_interval_s,
        # The claim sets each WORKING row's next poll (rule 3), so an unchanged poll writes only its count.
        default_poll_ms={name: server.default_poll_interval_ms for name, server in servers},
        control_rooms={
            name: control_room(server.control_qps, settings.dispatch_interval_s) for name, server in servers
        },
    )
    return [
        Dispatch(TASK_FOR_STATE[c.state], c.op_id, c.poll_cursor, c.delay_s, c.server, c.state)
        for c in claims
        if c.state in TASK_FOR_STATE
    ]
