"""Rule 3: poll a WORKING operation, and act on what a status read says.

:func:`observed` is where every status read lands (the poll's, the create's first answer, the read after
a cancel): a terminal state goes on to the result fetch in the same step, an input request opens a round,
anything else schedules the next poll from the server's hint plus jitter.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from typing import Any

from adapters import (
    AnswerTooLarge,
    NotFound,
    ProtocolViolation,
    RateLimited,
    Rejected,
    RemoteStatus,
)
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation, ServerStatus
from ledger.states import OpState, TerminalKind
from workers.budget import TokenBudget
from workers.errors import NoToken
from workers.steps.context import (
    TRY_AGAIN,
    StepAction,
    StepContext,
    StepOutcome,
    describe,
    remote_ref,
    retry_s,
    server_status,
)
from workers.steps.input_rounds import (
    AWAITING_INPUT_RECHECK_S,
    answered_already,
    answered_round,
    ask_for_input,
    pending_reply,
    send_reply,
    still_asked,
    unreadable_input,
)
from workers.steps.result import MAX_SAME_VIOLATIONS, fetch, not_found, too_large

#: How many status reads in a row the server may refuse (:class:`Rejected`: a 4xx other than 404, 408 and
#: 429, or a JSON-RPC error) before an operator gets the operation (PROTOCOL_VIOLATION, the server's answer
#: in the record). A refusal is definitive by the adapters' contract (the same read gets the same answer:
#: a task read without its session, a revoked credential), so it is not retried for ever, nor until a wait
#: budget of an hour (or none) runs out; the few reads allowed, paused 1, 2, 4 and 8 s, let a gateway's
#: passing refusal go by (about 15 s in all). Only refusals in a row count: any answer ends the run.
MAX_POLL_REJECTIONS = 5
#: The longest pause between two refused status reads.
REJECTION_PAUSE_MAX_S = 30.0


def reads_status(op: Operation, cursor: int, now: dt.datetime) -> bool:
    """The poll step of ``op`` under the claim ``cursor`` begins with a status read (:func:`poll`): the row
    is WORKING under that claim, with no stored input reply to send first and its wait budget not spent. A
    batch books the slots of those reads together (``ServerBudgets.book_slots``)."""
    return (
        op.state is OpState.WORKING
        and op.poll_cursor == cursor
        and op.lease_until is not None
        and pending_reply(op) is None
        and (op.wait_deadline is None or op.wait_deadline > now)
    )


def poll_scheduled(
    ctx: StepContext, op: Operation, fence: Fence, *, budget: TokenBudget | None = None
) -> StepOutcome:
    """:func:`poll` under a claim that set the next poll itself (a batch member: the dispatcher's claim,
    ``Ledger.claim_due_by_server`` with the servers' default intervals): an answer that changes nothing
    writes nothing (:func:`observed`). ``budget``: what pays the status read, when its batch booked its
    slot (``BookedSlots.budget``)."""
    return poll(ctx, op, fence, scheduled=True, budget=budget)


def poll(
    ctx: StepContext,
    op: Operation,
    fence: Fence,
    *,
    scheduled: bool = False,
    budget: TokenBudget | None = None,
) -> StepOutcome:
    """WORKING: one status read on the poll budget (``budget``, else a token of its own per request),
    unless the wait budget ran out; first, the stored reply of the current input round, when the server
    has not taken it yet (rule 10: :func:`send_reply`)."""
    if pending_reply(op) is not None:
        return send_reply(ctx, op, fence)
    if op.wait_deadline is not None and op.wait_deadline <= ctx.now():
        op = ctx.hand_to_operator(
            op,
            fence,
            ReconciliationReason.DEADLINE_EXCEEDED,
            {"why": "the wait budget ran out with the operation still open on the server"},
        )
        return StepOutcome(op.id, StepAction.WAIT_BUDGET_EXHAUSTED, op.state)
    try:
        if budget is None:
            budget = ctx.budget.per_request(op.server, "poll")
        status = ctx.adapter(op).get(remote_ref(op), budget=budget)
    except RateLimited as exc:
        ctx.budget.hold(op.server, exc)
        return ctx.retry_later(op, fence, exc, EventKind.RATE_LIMITED)
    except NotFound as exc:
        return not_found(ctx, op, fence, exc)
    except AnswerTooLarge as exc:
        # A status read that carries the result (the done AIP-151 Operation, the MCP tasks extension's
        # tasks/get) over the transport's cap: read again, it is the same answer (rule 7).
        return too_large(ctx, op, fence, exc)
    except Rejected as exc:
        return rejected_read(ctx, op, fence, exc)
    except ProtocolViolation as exc:
        return _violated_read(ctx, op, fence, exc)
    except TRY_AGAIN as exc:
        ctx.budget.hold(op.server, exc)
        return ctx.retry_later(op, fence, exc, EventKind.POLL_FAILED)
    return observed(ctx, op, fence, status, scheduled=scheduled)


def rejected_read(
    ctx: StepContext,
    op: Operation,
    fence: Fence,
    exc: Rejected,
    *,
    event: EventKind = EventKind.POLL_FAILED,
    step_detail: Mapping[str, Any] | None = None,
) -> StepOutcome:
    """The server refused the status read: read again after a growing pause, unless it refused the last
    :data:`MAX_POLL_REJECTIONS` - 1 reads as well; then an operator decides (``longcall reconcile``).

    ``event``: the kind the refusal is recorded as, and whose refusals count (the poll's ``poll_failed``,
    a cancel's ``cancel_read_failed``); ``step_detail``: what the step's own event keeps besides (a
    cancel's answer), in the event and the record."""
    rejections = _in_a_row(ctx, op, event, "rejections") + 1
    detail: dict[str, Any] = {
        **(step_detail or {}),
        "error": describe(exc),
        "http_status": exc.http_status,
        "code": exc.code,
        "rejections": rejections,
        # An answer that changed nothing is counted on the row, not written as an event: the count tells
        # whether one came after the previous refusal.
        "unchanged_polls": op.unchanged_polls,
    }
    if rejections >= MAX_POLL_REJECTIONS:
        op = ctx.hand_to_operator(
            op,
            fence,
            ReconciliationReason.PROTOCOL_VIOLATION,
            {
                **detail,
                "why": f"the server refused {rejections} status reads in a row",
                "remote_id": op.remote_id,
                "session_ref": op.session_ref,
            },
        )
        return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state)
    delay = min(REJECTION_PAUSE_MAX_S, 2.0 ** (rejections - 1))
    return ctx.reschedule(op, fence, delay, event, detail)


def _violated_read(ctx: StepContext, op: Operation, fence: Fence, exc: ProtocolViolation) -> StepOutcome:
    """The status read's answer broke the protocol: read again (a passing fault), unless the last
    :data:`~workers.steps.result.MAX_SAME_VIOLATIONS` - 1 reads met the same violation, with no answer
    between; then an operator decides (PROTOCOL_VIOLATION, the error in the record). The same answer every
    time is no passing fault: a done AIP-151 Operation (or an MCP tasks extension task) whose result is
    malformed is read by the poll, and was read every second until the wait deadline (rule 7)."""
    error = describe(exc)
    violations = _in_a_row(ctx, op, EventKind.POLL_FAILED, "violations", error=error) + 1
    detail: dict[str, Any] = {"error": error, "violations": violations, "unchanged_polls": op.unchanged_polls}
    if violations >= MAX_SAME_VIOLATIONS:
        op = ctx.hand_to_operator(
            op,
            fence,
            ReconciliationReason.PROTOCOL_VIOLATION,
            {
                **detail,
                "why": f"the status read met the same protocol violation {violations} times in a row",
                "remote_id": op.remote_id,
                "session_ref": op.session_ref,
            },
        )
        return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state)
    return ctx.reschedule(op, fence, retry_s(exc), EventKind.POLL_FAILED, detail)


def _in_a_row(ctx: StepContext, op: Operation, kind: EventKind, key: str, *, error: str | None = None) -> int:
    """How many failed status reads of one sort (``kind`` events whose detail counts ``key``: refusals,
    or violations with this same ``error``) came last, with no answer since: a read that failed without an
    answer (a timeout, a 5xx, a 429) neither counts nor ends the run; any other event, an answer of another
    sort, or an unchanged answer counted on the row since, ends it. Read only on a failed read: the events
    of one operation."""
    for event in reversed(ctx.ledger.events(op.id)):
        detail = event["detail"] if isinstance(event["detail"], dict) else {}
        if event["kind"] == kind.value and key in detail:
            if detail.get("unchanged_polls") != op.unchanged_polls:
                return 0
            if error is not None and detail.get("error") != error:
                return 0
            return int(detail[key])
        if event["kind"] == kind.value and {"rejections", "violations"} & detail.keys():
            return 0  # a failed read of the other sort: the server answered something else
        if event["kind"] not in (kind.value, EventKind.RATE_LIMITED.value):
            return 0
    return 0


def observed(
    ctx: StepContext, op: Operation, fence: Fence, status: RemoteStatus, *, scheduled: bool = False
) -> StepOutcome:
    """Act on one status read: fetch the result, open an input round, or poll again later. ``scheduled``:
    the claim set the next poll (:func:`poll_scheduled`), so an answer that changes nothing writes nothing
    here (:func:`_unchanged`): its count is recorded with its batch's."""
    if status.terminal is not None:
        return _terminal(ctx, op, fence, status, TerminalKind(status.terminal))
    interval = ctx.interval_s(op, status)
    if status.input_request is not None and not answered_already(op, status.input_request):
        return ask_for_input(ctx, op, fence, status, status.input_request)
    if status.input_request is not None or status.awaiting_input:
        # Still asking after the reply of this round was taken: bounded (rule 10).
        handed = still_asked(ctx, op, fence, status)
        if handed is not None:
            return handed
    if status.input_request is None and status.awaiting_input:
        if op.state is OpState.WORKING and answered_round(op) is None:
            return unreadable_input(ctx, op, fence, status, interval)
        interval = min(interval, AWAITING_INPUT_RECHECK_S)  # the request could not be read yet
    elif op.state is OpState.WORKING and op.input_deadline is not None:
        # The server no longer waits for a request we could not read: that bound is lifted.
        op = ctx.ledger.wait_for_input_request(
            op.id, fence, status=server_status(status), read_by=None, next_poll_in_s=ctx.jittered(interval)
        )
        return StepOutcome(op.id, StepAction.STILL_WORKING, op.state)
    if scheduled and _unchanged(op, status):
        # A member that ran late after its claim (a process behind its polls), or whose record waits, is
        # rescheduled by its batch's record, as a one-operation poll is by its write: never polled again
        # sooner than the interval after this read, and no statement of its own, which would put a process
        # behind further behind (``Ledger.record_unchanged_polls``).
        due = time.monotonic() + ctx.jittered(interval)
        return StepOutcome(op.id, StepAction.STILL_WORKING, op.state, unchanged=True, next_poll_due=due)
    op = ctx.ledger.record_poll(
        op.id,
        fence,
        state=op.state,
        status=server_status(status),
        next_poll_in_s=ctx.jittered(interval),
        claimed=scheduled,
    )
    return StepOutcome(op.id, StepAction.STILL_WORKING, op.state)


def _unchanged(op: Operation, status: RemoteStatus) -> bool:
    """The answer is the row's (DESIGN §3: same server state, message and poll interval, so ``record_poll``
    would only count it), it asks nothing, and its claim set the next poll."""
    kept = ServerStatus(op.server_state, op.status_message, op.poll_interval_ms)
    return (
        server_status(status) == kept
        and status.input_request is None
        and not status.awaiting_input
        and op.lease_until is not None
        and op.next_poll_at is not None
    )


def _terminal(
    ctx: StepContext, op: Operation, fence: Fence, status: RemoteStatus, kind: TerminalKind
) -> StepOutcome:
    """TERMINAL_OBSERVED; unless the end is a cancel (nothing to read), the result is read in this same
    step, its request's control token taken now (and passed to the fetch's budget: charged once). Without
    one, the fetch waits for its own step, in TERMINAL_OBSERVED."""
    wait: NoToken | None = None
    # A result carried by the status itself (the done AIP-151 Operation) is held without a request.
    reads = kind is not TerminalKind.CANCELLED and status.result is None
    if reads:
        try:
            ctx.budget.take(op.server, "control")
        except NoToken as no_token:
            wait = no_token
    op = ctx.ledger.observe_terminal(
        op.id,
        fence,
        from_state=op.state,
        kind=kind,
        status=server_status(status),
        fetch_now=wait is None,
        due_in_s=wait.wait_s if wait is not None else 0.0,
    )
    if wait is not None:
        return StepOutcome(op.id, StepAction.NO_TOKEN, op.state, detail={"wait_s": round(wait.wait_s, 3)})
    return fetch(ctx, op, fence, status, prepaid=1 if reads else 0)
