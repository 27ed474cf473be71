"""Rule 3: poll a WORKING operation, and act on what a status read says.

:func:`observed` is where every status read lands (the poll's, the create's first answer, the read after
a cancel): a terminal state goes on to the result fetch in the same step, an input request opens a round,
anything else schedules the next poll from the server's hint plus jitter.
"""

from __future__ import annotations

from adapters import (
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    RemoteStatus,
    Transient,
)
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation
from ledger.states import TerminalKind
from workers.errors import NoToken
from workers.steps.context import StepContext, StepOutcome, remote_ref, server_status
from workers.steps.input_rounds import ask_for_input
from workers.steps.result import fetch, not_found

#: How soon to look again when the server says it waits for input whose request could not be read yet.
AWAITING_INPUT_RECHECK_S = 1.0


def poll(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome:
    """WORKING: one status read on the poll budget, unless the wait budget ran out."""
    if op.wait_deadline is not None and op.wait_deadline <= ctx.now():
        op = ctx.hand_to_operator(
            op,
            fence,
            ReconciliationReason.DEADLINE_EXCEEDED,
            {"why": "the wait budget ran out with the operation still open on the server"},
        )
        return StepOutcome(op.id, "wait_budget_exhausted", op.state)
    ctx.take(op.server, "poll")
    try:
        status = ctx.adapter(op).get(remote_ref(op), budget=ctx.request_budget(op.server, "poll"))
    except RateLimited as exc:
        return ctx.retry_later(op, fence, exc, EventKind.RATE_LIMITED)
    except NotFound as exc:
        return not_found(ctx, op, fence, exc)
    except (Transient, ProtocolViolation, OutcomeUnknown, Rejected) as exc:
        return ctx.retry_later(op, fence, exc, EventKind.POLL_FAILED)
    return observed(ctx, op, fence, status)


def observed(ctx: StepContext, op: Operation, fence: Fence, status: RemoteStatus) -> StepOutcome:
    """Act on one status read: fetch the result, open an input round, or poll again later."""
    if status.terminal is not None:
        return _terminal(ctx, op, fence, status, TerminalKind(status.terminal))
    if status.input_request is not None:
        return ask_for_input(ctx, op, fence, status, status.input_request)
    interval = ctx.interval_s(op, status)
    if status.awaiting_input:
        interval = min(interval, AWAITING_INPUT_RECHECK_S)  # the request could not be read yet
    op = ctx.ledger.record_poll(
        op.id, fence, state=op.state, status=server_status(status), next_poll_in_s=ctx.jittered(interval)
    )
    return StepOutcome(op.id, "still_working", op.state)


def _terminal(
    ctx: StepContext, op: Operation, fence: Fence, status: RemoteStatus, kind: TerminalKind
) -> StepOutcome:
    """TERMINAL_OBSERVED; unless the end is a cancel (nothing to read), the result is read in this same
    step, with a control token taken now. Without one, the fetch waits for its own step."""
    if kind is not TerminalKind.CANCELLED:
        try:
            ctx.take(op.server, "control")
        except NoToken as no_token:
            op = ctx.ledger.observe_terminal(
                op.id,
                fence,
                from_state=op.state,
                kind=kind,
                status=server_status(status),
                fetch_now=False,
                due_in_s=no_token.wait_s,
            )
            return StepOutcome(op.id, "no_token", op.state, detail={"wait_s": round(no_token.wait_s, 3)})
    op = ctx.ledger.observe_terminal(
        op.id,
        fence,
        from_state=op.state,
        kind=kind,
        status=server_status(status),
        fetch_now=True,
        due_in_s=0,
    )
    return fetch(ctx, op, fence, status, token_taken=True)
