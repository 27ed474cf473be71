"""Rule 6: a cancel is a request. First the intent (the generation CAS, CANCEL_REQUESTED), then the cancel
request to the server, then whatever the server says the task's end is.

A client that stops waiting never comes here: that is not a cancel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters import (
    AdapterError,
    NotFound,
    Rejected,
    RemoteStatus,
    ToolAdapter,
)
from ledger.errors import StaleTransition
from ledger.events import EventKind
from ledger.records import Claim, Fence, Operation
from ledger.states import OpState, TerminalKind
from workers.errors import NotCancellable
from workers.steps.context import TRY_AGAIN, StepContext, StepOutcome, describe, remote_ref
from workers.steps.poll import observed
from workers.steps.result import accept, not_found


def record_intent(ctx: StepContext, op: Operation) -> StepOutcome | Claim:
    """The CAS on the hot generation, then CANCEL_REQUESTED in the ledger. Returns the claim under which
    the cancel request is to be sent now, or the outcome when there is nothing (more) to send.

    Raises:
        NotCancellable: the operation is not WORKING or INPUT_REQUIRED.
    """
    if op.is_final or op.state is OpState.CANCEL_REQUESTED:
        return StepOutcome(op.id, "already_" + ("final" if op.is_final else "requested"), op.state)
    if op.state not in (OpState.WORKING, OpState.INPUT_REQUIRED):
        raise NotCancellable(
            f"operation {op.id} is {op.state}; a cancel applies once it is WORKING or INPUT_REQUIRED"
        )
    hot = ctx.runtime.hot
    won, hot_generation = hot.bump_cancel_generation(op.id, op.cancel_generation)
    if not won:
        if hot_generation > op.cancel_generation:
            # The hot copy ran ahead of the ledger (a cancel whose ledger write lost): the ledger wins.
            hot.seed_cancel_generation(op.id, op.cancel_generation)
            won, _ = hot.bump_cancel_generation(op.id, op.cancel_generation)
        if not won:
            return StepOutcome(op.id, "cancel_race_lost", op.state)
    try:
        # The lease goes too: a poll in flight is fenced off by the generation, and the cancel is sent under
        # a fresh claim at once instead of after that poll's lease.
        op = ctx.ledger.request_cancel(
            op.id, Fence(op.execution_epoch, op.cancel_generation), from_state=op.state
        )
    except StaleTransition:
        current = ctx.ledger.get(op.id)
        hot.seed_cancel_generation(op.id, current.cancel_generation)
        return StepOutcome(op.id, "cancel_raced", current.state)
    claim = ctx.ledger.claim(op.id, lease_s=ctx.settings.lease_s)
    if claim is None:
        return StepOutcome(op.id, "cancel_requested", op.state)
    return claim


def send(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome:
    """CANCEL_REQUESTED: send the cancel request; its answer, or a status read after it, tells the end."""
    adapter = ctx.adapter(op)
    try:
        outcome = adapter.cancel(remote_ref(op), budget=ctx.request_budget(op.server, "control"))
    except NotFound as exc:
        return not_found(ctx, op, fence, exc)
    except Rejected as exc:
        # No cancel on this server: the outcome comes from polling, as for AIP-151.
        return _after(
            ctx, op, fence, adapter, None, event=EventKind.CANCEL_REFUSED, detail={"error": describe(exc)}
        )
    except TRY_AGAIN as exc:
        # A lost ACK is resolved by asking again: a second cancel finds the task terminal.
        return ctx.retry_later(op, fence, exc, EventKind.CANCEL_FAILED)
    if outcome.kind == "cancelled":
        return accept(ctx, op, TerminalKind.CANCELLED, None, audit={"server_state": "cancelled"})
    return _after(ctx, op, fence, adapter, outcome.status, event=EventKind.CANCEL_PENDING, detail={})


def _after(
    ctx: StepContext,
    op: Operation,
    fence: Fence,
    adapter: ToolAdapter,
    status: RemoteStatus | None,
    *,
    event: EventKind,
    detail: Mapping[str, Any],
) -> StepOutcome:
    """Where the task stands after a cancel request that was not itself the evidence of a cancel."""
    if status is None or status.terminal is None:
        try:
            status = adapter.get(
                remote_ref(op), read_input=False, budget=ctx.request_budget(op.server, "control")
            )
        except NotFound as exc:
            return not_found(ctx, op, fence, exc)
        except AdapterError as exc:
            return ctx.retry_later(op, fence, exc, EventKind.CANCEL_READ_FAILED)
    if status.terminal == "cancelled":
        return accept(
            ctx, op, TerminalKind.CANCELLED, None, audit={"server_state": status.server_state, **detail}
        )
    if status.terminal is not None:
        return observed(ctx, op, fence, status)  # the completion won the race
    return ctx.reschedule(op, fence, ctx.interval_s(op, status), event, detail)
