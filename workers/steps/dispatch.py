"""Rules 3 and 13: claim what is due, server by server, as the messages the dispatcher publishes.

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
    """Claim what is due, server by server, at most what each server's budgets can take before the next
    tick (twice that, for slack): a poll storm then waits in the ledger, ordered by due time, instead of
    churning through the broker and the buckets. The buckets remain the guarantee (rule 4)."""
    settings = ctx.settings
    epoch = ctx.ledger.control().execution_epoch
    dispatches: list[Dispatch] = []
    budget = limit or settings.dispatch_batch
    for name, server in sorted(ctx.runtime.fleet.servers.items()):
        share = math.ceil((server.poll_qps + server.control_qps) * settings.dispatch_interval_s * 2)
        room = min(budget - len(dispatches), max(1, share))
        if room <= 0:
            break
        claims = ctx.ledger.claim_due(
            limit=room,
            lease_s=settings.lease_s,
            epoch=epoch,
            server=name,
            horizon_s=settings.dispatch_interval_s,
        )
        dispatches.extend(
            Dispatch(TASK_FOR_STATE[c.state], c.op_id, c.poll_cursor, c.delay_s)
            for c in claims
            if c.state in TASK_FOR_STATE
        )
    return dispatches
