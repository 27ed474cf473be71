"""Rule 6: a cancel is a request. First the intent (the generation CAS, the ledger's generation bumped:
CANCEL_REQUESTED, or an intent that waits for a remote operation), then the cancel request to the server,
then whatever the server says the task's end is. The request is control traffic (rule 4): no step of a
cancel waits for a poll token.

A client that stops waiting never comes here: that is not a cancel.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

from adapters import (
    AdapterError,
    AnswerTooLarge,
    NotFound,
    Rejected,
    RemoteStatus,
    RequestBudget,
    ToolAdapter,
    Unauthorized,
)
from ledger.errors import StaleTransition
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Claim, Fence, Operation
from ledger.states import CANCEL_WAITS_IN, OpState, TerminalKind
from workers.errors import NotCancellable, NoToken
from workers.steps.context import (
    TRY_AGAIN,
    StepAction,
    StepContext,
    StepOutcome,
    describe,
    no_token_delay,
    remote_ref,
    retry_s,
    server_status,
    unauthorized_pause,
)
from workers.steps.poll import observed, rejected_read
from workers.steps.result import accept, not_found, too_large

log = logging.getLogger(__name__)

#: How often the intent is tried again when the row moved under it (a poll between WORKING and
#: INPUT_REQUIRED, a create answering, another cancel) before the request is refused: each try reads the row
#: afresh, so only a row that keeps moving under every try exhausts them.
INTENT_TRIES = 8


def record_intent(ctx: StepContext, op: Operation) -> StepOutcome | Claim:
    """Record the intent (rule 6 as amended), in any state that is not final: the CAS on the hot generation,
    then the ledger's generation bumped. With a remote operation to cancel (WORKING, INPUT_REQUIRED, or an
    operator's MANUAL_RECONCILIATION under a known remote id): CANCEL_REQUESTED, and the claim under which
    the cancel request is sent now. Without one yet (SUBMITTING, SUBMISSION_UNKNOWN, an operator's
    operation with no remote id): the intent waits in the state (``record_cancel_intent``) and is applied
    by the step that learns of a remote operation, or ends the operation cancelled once "never created" is
    proved; a SUBMITTING row no create was attempted for is claimed, so its step ends it at once. A terminal
    state already observed is not cancelled: its outcome stands (never rewritten to cancelled).

    Raises:
        NotCancellable: the row moved under every one of ``INTENT_TRIES`` tries (nothing was recorded).
    """
    for _ in range(INTENT_TRIES):
        settled = _already_settled(op)
        if settled is not None:
            return settled
        _bump_hot_generation(ctx, op)
        fence = Fence(op.execution_epoch, op.cancel_generation)
        try:
            op = _record(ctx, op, fence)
        except StaleTransition:
            op = ctx.ledger.get(op.id)
            with contextlib.suppress(redis.RedisError):  # best effort, as above
                ctx.runtime.hot.seed_cancel_generation(op.id, op.cancel_generation)
            continue
        if op.state is OpState.CANCEL_REQUESTED or (
            op.state is OpState.SUBMITTING and op.submit_attempted_at is None
        ):
            # A SUBMITTING row no create was attempted for is taken whatever its lease (a submitting
            # worker killed after its insert holds one): its step ends it cancelled now, with no create.
            claim = ctx.ledger.claim(
                op.id, lease_s=ctx.settings.lease_s, cancel_before_create=op.state is OpState.SUBMITTING
            )
            if claim is not None:
                return claim
        return StepOutcome(
            op.id,
            StepAction.CANCEL_REQUESTED
            if op.state is OpState.CANCEL_REQUESTED
            else StepAction.CANCEL_RECORDED,
            op.state,
            detail={"cancel_generation": op.cancel_generation},
        )
    raise NotCancellable(f"operation {op.id} kept moving under {INTENT_TRIES} tries to record the cancel")


def _already_settled(op: Operation) -> StepOutcome | None:
    """The outcome when a cancel has nothing (more) to record: final, requested already, an intent waiting
    already, or a terminal state observed (its outcome stands: never rewritten to cancelled)."""
    if op.is_final:
        return StepOutcome(op.id, StepAction.ALREADY_FINAL, op.state)
    if op.state is OpState.CANCEL_REQUESTED:
        return StepOutcome(op.id, StepAction.ALREADY_REQUESTED, op.state)
    if op.state in (OpState.TERMINAL_OBSERVED, OpState.FETCHING_RESULT):
        return StepOutcome(
            op.id, StepAction.TERMINAL_OBSERVED, op.state, detail={"terminal": op.observed_terminal}
        )
    if op.state in CANCEL_WAITS_IN and not _cancel_now(op) and op.cancel_generation > 0:
        return StepOutcome(op.id, StepAction.CANCEL_RECORDED, op.state, detail={"already": True})
    return None


def _cancel_now(op: Operation) -> bool:
    """A remote operation is known to send the cancel to."""
    if op.state in (OpState.WORKING, OpState.INPUT_REQUIRED):
        return True
    return (
        op.state is OpState.MANUAL_RECONCILIATION
        and op.remote_id is not None
        and op.observed_terminal is None
    )


def _record(ctx: StepContext, op: Operation, fence: Fence) -> Operation:
    if op.state in (OpState.WORKING, OpState.INPUT_REQUIRED):
        # Either state: a poll that moves the row between them does not refuse the cancel. The lease goes
        # too: a poll in flight is fenced off by the generation, and the cancel is sent under a fresh claim
        # at once instead of after that poll's lease.
        return ctx.ledger.request_cancel(op.id, fence, from_state=(OpState.WORKING, OpState.INPUT_REQUIRED))
    if _cancel_now(op):
        return ctx.ledger.request_cancel(
            op.id,
            fence,
            from_state=op.state,
            resolution=f"cancel requested: the cancel is sent to {op.remote_id}",
        )
    return ctx.ledger.record_cancel_intent(op.id, fence, from_state=op.state)


def _bump_hot_generation(ctx: StepContext, op: Operation) -> None:
    """The CAS on the hot copy. The ledger is the record: a hot copy that differs from it (ahead: a cancel
    whose ledger write lost or is under way; behind: a Redis restored from an older copy, or restarted) is
    re-seeded from the ledger, and the ledger's guarded write decides who recorded the cancel."""
    hot = ctx.runtime.hot
    try:
        won, _ = hot.bump_cancel_generation(op.id, op.cancel_generation)
        if not won:
            hot.seed_cancel_generation(op.id, op.cancel_generation)
            hot.bump_cancel_generation(op.id, op.cancel_generation)
    except redis.RedisError:
        # Best effort (rule 6 as amended): a Redis outage never drops a cancel. The ledger's guarded write
        # records the intent and decides; the hot copy is re-seeded from the ledger by the next cancel.
        log.warning(
            "the hot cancel generation of %s could not be bumped; the ledger decides", op.id, exc_info=True
        )


def send(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome:
    """CANCEL_REQUESTED: send the cancel request; its answer, or a status read after it, tells the end.

    Every request goes to the control budget (rule 4): a poll storm never delays a cancel. The order is the
    seed's, ``tasks/cancel`` first (a ``-32602`` answer -> the terminal state is read); a status read
    before it only for a server configured so (``read_status_before_cancel``: one that would answer
    "cancelled" for a task already completed).

    One budget for the step: the status read after the cancel is charged as its follow-up (on a control
    budget slower than one slot per dispatch tick a fresh budget's first charge would find no token, and
    the whole step, cancel included, would be redone for ever). A cancel answered whose status read finds
    no token is recorded as answered: it is read later, never sent again.

    Past the wait deadline, a cancel that cannot be sent (a 5xx, a timeout, a 429, no control token) is not
    retried for ever: the status read decides (a terminal state wins), else an operator (DEADLINE_EXCEEDED,
    the last error)."""
    adapter = ctx.adapter(op)
    budget = ctx.budget.per_request(op.server, "control")

    def after(status: RemoteStatus | None, event: EventKind, detail: Mapping[str, Any]) -> StepOutcome:
        """Where the task stands after this cancel request (:func:`_after`), on its adapter and budget."""
        return _after(ctx, op, fence, adapter, status, event=event, detail=detail, budget=budget)

    answered = _answer_event(ctx, op)
    if answered is not None and (answered.answer != _UNSENT or _budget_spent(ctx, op)):
        # The server took (or refused) this generation's cancel already: sending it again tells nothing new.
        # The outcome is polled for, on the control budget, until the operation is done or its wait budget
        # runs out (then an operator decides). A cancel that could not be sent past the wait deadline is
        # not sent again either: its one final status read, put off by the server's wait, is made now.
        return _after(
            ctx,
            op,
            fence,
            adapter,
            None,
            event=EventKind.CANCEL_FAILED if answered.answer == _UNSENT else EventKind.CANCEL_PENDING,
            detail={_ANSWER: answered.answer, **({"error": answered.error} if answered.error else {})},
            budget=budget,
            quiet=True,
            answered_at=answered.at,
        )
    try:
        outcome = adapter.cancel(
            remote_ref(op),
            budget=budget,
            read_status_first=ctx.server(op).read_status_before_cancel,
        )
    except NoToken as no_token:
        if not _budget_spent(ctx, op):
            raise  # rescheduled as any step without a token: never past the wait deadline
        # Past the wait deadline with no token to send the cancel: not put off for the bucket's wait (a hold
        # renewed would keep it there for ever). The status read decides, else an operator.
        error = f"no control token for the cancel (none for {no_token.wait_s:.1f} s more)"
        return after(None, EventKind.CANCEL_FAILED, {_ANSWER: _UNSENT, "error": error})
    except NotFound as exc:
        return not_found(ctx, op, fence, exc)
    except AnswerTooLarge as exc:
        return too_large(ctx, op, fence, exc)  # the status read first carried a result over the cap
    except Unauthorized as exc:
        # The credentials refused (after the token's one renewal), not the cancel: the server did nothing
        # with it, so the intent stays and the cancel is sent again after a growing pause, within the wait
        # budget (then the status read decides, as for any cancel that could not be sent).
        if _budget_spent(ctx, op):
            return after(None, EventKind.CANCEL_FAILED, {_ANSWER: _UNSENT, "error": describe(exc)})
        detail = {"error": describe(exc)}
        return ctx.reschedule(op, fence, unauthorized_pause(ctx, op), EventKind.CANCEL_FAILED, detail)
    except Rejected as exc:
        # No cancel on this server: the outcome comes from polling, as for AIP-151.
        return after(None, EventKind.CANCEL_REFUSED, {"error": describe(exc), _ANSWER: "refused"})
    except TRY_AGAIN as exc:
        ctx.budget.hold(op.server, exc)  # before the status read below: it must meet the server's wait
        if _budget_spent(ctx, op):
            # Past the wait deadline: not retried for ever. The status read decides (a terminal state
            # wins), else an operator, told the cancel could not be sent and why.
            return after(None, EventKind.CANCEL_FAILED, {_ANSWER: _UNSENT, "error": describe(exc)})
        # A lost ACK is resolved by asking again: a second cancel finds the task terminal.
        return ctx.retry_later(op, fence, exc, EventKind.CANCEL_FAILED)
    if outcome.kind == "cancelled":
        return accept(ctx, op, TerminalKind.CANCELLED, None, audit={"server_state": "cancelled"})
    # "acknowledged", an acknowledgement only (AIP-151, the MCP tasks extension): the end is polled for; done
    # with a cancelled error accepts the cancel, a completion that won the race is accepted as completed.
    # "already_terminal": the terminal state the server holds is read, never rewritten to cancelled.
    return after(outcome.status, EventKind.CANCEL_PENDING, {_ANSWER: outcome.kind})


#: The event detail that records the server's answer to this generation's cancel request, when it leaves
#: the outcome to polling and sending the request again would add nothing ("acknowledged", "refused").
_ANSWER = "cancel_answer"
#: The answers after which the request is not sent again in this generation and epoch.
_ANSWERED = ("acknowledged", "refused", "already_terminal")
#: :data:`_ANSWER` of a cancel that could not be sent (or its answer was lost) past the wait deadline.
_UNSENT = "unsent"
#: Past the wait deadline, how long the one final status read after a cancel that could not be sent may
#: wait for a control token (the server's Retry-After to that cancel, held fleet-wide); a longer wait, or
#: no token then either: an operator decides without it.
FINAL_READ_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class _Answer:
    """The server's answer to this generation's cancel request (see :data:`_ANSWER`), when it was recorded,
    and the error that kept it from being sent (for :data:`_UNSENT`)."""

    answer: str
    at: dt.datetime
    error: str | None


def _answer_event(ctx: StepContext, op: Operation) -> _Answer | None:
    """The server's answer to this generation's cancel request in this epoch, when it was an
    acknowledgement or a refusal, or the request could not be sent past the wait deadline (its final status
    read put off); None when the request is still to be sent."""
    for event in reversed(ctx.ledger.events(op.id)):
        if (
            event["cancel_generation"] != op.cancel_generation
            or event["execution_epoch"] != op.execution_epoch
        ):
            break
        detail = event.get("detail")
        if isinstance(detail, Mapping) and detail.get(_ANSWER) in (*_ANSWERED, _UNSENT):
            error = detail.get("error")
            return _Answer(str(detail[_ANSWER]), event["at"], str(error) if error is not None else None)
    return None


def _after(
    ctx: StepContext,
    op: Operation,
    fence: Fence,
    adapter: ToolAdapter,
    status: RemoteStatus | None,
    *,
    event: EventKind,
    detail: Mapping[str, Any],
    budget: RequestBudget,
    quiet: bool = False,
    answered_at: dt.datetime | None = None,
) -> StepOutcome:
    """Where the task stands after a cancel request that was not itself the evidence of a cancel.
    ``quiet``: the server's answer is recorded already (an event with :data:`_ANSWER`, at ``answered_at``).
    ``budget``: the step's, so a status read after the cancel is charged as its follow-up.

    A terminal answer wins; once the wait budget has run out with the operation still open (or its status
    unreadable), an operator decides (:func:`_never_carried_out`): a cancel the server acknowledged but never
    carried out is not polled for ever."""
    if status is None or status.terminal is None:
        try:
            status = adapter.get(remote_ref(op), read_input=False, budget=budget)
        except NoToken as no_token:
            return _read_later(
                ctx, op, fence, no_token, event=event, detail=detail, quiet=quiet, answered_at=answered_at
            )
        except NotFound as exc:
            return not_found(ctx, op, fence, exc)
        except AnswerTooLarge as exc:
            return too_large(ctx, op, fence, exc)  # a status read carrying a result over the cap
        except AdapterError as exc:
            ctx.budget.hold(op.server, exc)
            if _budget_spent(ctx, op):
                return _never_carried_out(
                    ctx, op, fence, detail, answered_at=answered_at, status=None, error=describe(exc)
                )
            if isinstance(exc, Rejected):
                # Refused reads are bounded as the poll's are: an operator after a few in a row, not reads
                # every second until the wait deadline. The cancel's answer is kept with each refusal, so
                # the step that comes back reads again and never sends the cancel a second time.
                return rejected_read(
                    ctx, op, fence, exc, event=EventKind.CANCEL_READ_FAILED, step_detail=detail
                )
            # The cancel's answer goes with the failed read (as with a refused one), so the step that comes
            # back reads again and never sends the cancel a second time.
            error = {**detail, "error": describe(exc)}
            return ctx.reschedule(op, fence, retry_s(exc), EventKind.CANCEL_READ_FAILED, error)
    if status.terminal == "cancelled":
        return accept(
            ctx, op, TerminalKind.CANCELLED, None, audit={"server_state": status.server_state, **detail}
        )
    if status.terminal is not None:
        return observed(ctx, op, fence, status)  # the completion won the race
    if _budget_spent(ctx, op):
        return _never_carried_out(ctx, op, fence, detail, answered_at=answered_at, status=status)
    interval = ctx.interval_s(op, status)
    if quiet:
        # Polled for since the server's answer was recorded: counted on the row like an unchanged poll (an
        # event only when the server's state changed), not one event per read while the cancel lands.
        op = ctx.ledger.record_poll(
            op.id, fence, state=op.state, status=server_status(status), next_poll_in_s=ctx.jittered(interval)
        )
        return StepOutcome(op.id, event, op.state, detail={"delay_s": round(interval, 3)})
    return ctx.reschedule(op, fence, interval, event, detail)


def _read_later(
    ctx: StepContext,
    op: Operation,
    fence: Fence,
    no_token: NoToken,
    *,
    event: EventKind,
    detail: Mapping[str, Any],
    quiet: bool,
    answered_at: dt.datetime | None,
) -> StepOutcome:
    """No control token for the status read. Its cancel answered in this step: the answer is recorded (an
    event with :data:`_ANSWER`), so the step that comes back reads the status and never sends the cancel
    again. Already recorded: the step is rescheduled as any step without a token (never past the wait
    deadline, :meth:`~workers.steps.context.StepContext.reschedule`).

    Past the wait deadline the wait ends here, whatever keeps the token away: an operator decides
    (DEADLINE_EXCEEDED, no token for the read named). One exception, so that every cancel that could not be
    sent gets its final status read: a cancel refused just now with a server's wait (its Retry-After, held
    fleet-wide) is read once after that wait, when it is at most :data:`FINAL_READ_WAIT_S`."""
    if _budget_spent(ctx, op):
        if detail.get(_ANSWER) == _UNSENT and not quiet and no_token.wait_s <= FINAL_READ_WAIT_S:
            delay = no_token_delay(no_token)
            return ctx.reschedule(
                op, fence, delay, event, {**detail, "no_token_s": round(no_token.wait_s, 3)}
            )
        return _never_carried_out(
            ctx,
            op,
            fence,
            detail,
            answered_at=answered_at,
            status=None,
            error=f"no control token for the status read (none for {no_token.wait_s:.1f} s more)",
        )
    if quiet:
        raise no_token
    delay = no_token_delay(no_token)
    return ctx.reschedule(op, fence, delay, event, {**detail, "no_token_s": round(no_token.wait_s, 3)})


def _budget_spent(ctx: StepContext, op: Operation) -> bool:
    return op.wait_deadline is not None and op.wait_deadline <= ctx.now()


def _never_carried_out(
    ctx: StepContext,
    op: Operation,
    fence: Fence,
    detail: Mapping[str, Any],
    *,
    answered_at: dt.datetime | None,
    status: RemoteStatus | None,
    error: str | None = None,
) -> StepOutcome:
    """The wait budget ran out in CANCEL_REQUESTED with the operation still open on the server: an operator
    decides (DEADLINE_EXCEEDED, as :func:`~workers.steps.poll.poll` does for WORKING), told when the server
    answered the cancel and that it never carried it out."""
    answer = str(detail.get(_ANSWER) or "sent")
    at = (answered_at or ctx.now()).astimezone(dt.UTC).isoformat()
    if answer == _UNSENT:
        why = (
            f"the cancel could not be sent or confirmed by the wait deadline (last error at {at}: "
            f"{detail.get('error')})"
        )
    elif answer == "already_terminal":
        why = f"the server answered at {at} that the operation was terminal already, yet it never ended"
    elif answer == "acknowledged":
        why = f"the cancel was acknowledged at {at} and never carried out"
    elif answer == "refused":
        why = f"the cancel was refused at {at} (no cancel on this server) and the operation never ended"
    else:
        why = f"the cancel was sent at {at} and never carried out"
    why += ": the wait budget ran out with the operation still open on the server"
    if error is not None:
        why += f" (its status could not be read: {error})"
    op = ctx.hand_to_operator(
        op,
        fence,
        ReconciliationReason.DEADLINE_EXCEEDED,
        {
            "why": why,
            _ANSWER: answer,
            f"{answer}_at": at,
            "wait_deadline": op.wait_deadline.isoformat() if op.wait_deadline else None,
            "server_state": status.server_state if status is not None else None,
            **({"error": error} if error is not None else {}),
        },
    )
    return StepOutcome(op.id, StepAction.WAIT_BUDGET_EXHAUSTED, op.state)
