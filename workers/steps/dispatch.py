"""Rules 3 and 13: claim what is due, each server its share up to its room, as the messages the dispatcher
publishes.

Only rows of the current execution epoch are claimed; each claim bumps the row's poll cursor, which names
the message (its task id) and fences the step it runs.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from ledger.states import OpState
from workers.steps.context import StepContext

S = OpState

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

    @property
    def task_id(self) -> str:
        return f"{self.task}:{self.op_id}:{self.cursor}"


def dispatch_due(ctx: StepContext, limit: int | None = None) -> list[Dispatch]:
    """Claim what is due, at most what each server's budgets can take before the next tick (twice that, for
    slack), and at most ``limit`` (``dispatch_batch``) in all, shared by the servers: every server's most
    overdue row before any server's second, the rest in proportion to the rooms, and servers level on that
    taken in a rotation that moves on every tick (``Ledger.claim_due_by_server``), so every configured
    server gets its share of every tick whatever the others have due (rule 3), and with more servers than
    the batch each is reached within ``ceil(servers / batch)`` ticks. A poll storm then waits in the ledger,
    ordered by due time, instead of churning through the broker and the buckets. The buckets remain the
    guarantee (rule 4). One statement claims for every server (issue 13: a tick's cost must not grow with
    the number of configured servers), and takes the rows over into the current epoch as it reads it (rule
    13): a tick is one transaction."""
    settings = ctx.settings
    rooms = [
        (name, max(1, math.ceil((server.poll_qps + server.control_qps) * settings.dispatch_interval_s * 2)))
        for name, server in sorted(ctx.runtime.fleet.servers.items())
    ]
    claims = ctx.ledger.claim_due_by_server(
        rooms,
        limit=limit or settings.dispatch_batch,
        lease_s=settings.lease_s,
        epoch="current",
        horizon_s=settings.dispatch_interval_s,
    )
    return [
        Dispatch(TASK_FOR_STATE[c.state], c.op_id, c.poll_cursor, c.delay_s)
        for c in claims
        if c.state in TASK_FOR_STATE
    ]
