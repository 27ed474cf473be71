"""Rules 1 and 2: the create call, and the lookup by submission key when its outcome is unknown.

Neither step calls the other. Each returns either its outcome or :class:`Moved` — the row went to the
other one's state (an unknown create outcome -> SUBMISSION_UNKNOWN; a server's proof of "never created"
-> SUBMITTING again, same key) — and :func:`advance_submission` runs the step for the new state in the same
claim, as the protocol asks: an unknown outcome is looked up at once, a proved-safe resubmission made at once.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from adapters import (
    SHIPPED,
    AdapterError,
    CapabilityRefused,
    Created,
    NotFound,
    NoWorkDone,
    ProtocolViolation,
    Rejected,
    RemoteResult,
    RemoteStatus,
    Unauthorized,
)
from ledger.errors import AdapterDisabled, UnstorableResult
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import BODY_NOT_READ, Fence, Operation, adapter_key
from ledger.states import OpState, TerminalKind
from workers.errors import NoToken
from workers.lease import keep_lease
from workers.steps.cancel import send as send_cancel
from workers.steps.context import (
    DEADLINE_SLACK_S,
    TRY_AGAIN,
    Moved,
    StepAction,
    StepContext,
    StepOutcome,
    describe,
    retry_s,
    server_status,
    unauthorized_pause,
)
from workers.steps.poll import observed
from workers.steps.result import accept, error_result, failed_here, fetch, result_json, storable, unstorable

#: A capabilities read or a lookup that failed decided nothing (a "not found" included: the lookup, not
#: the error, proves "never created"): ask again later.
ASK_AGAIN: tuple[type[AdapterError], ...] = (*TRY_AGAIN, NotFound)
#: How many times an operation may be submitted again after a proof of "never created" (each create's
#: answer lost, each lookup proving no operation): the next proof goes to an operator (rule 2's bound).
MAX_RESUBMISSIONS = 3
#: How long the lookups of one unknown create outcome may keep failing (a server down, a refusal that
#: never changes) before an operator decides (rule 2's bound; the wait budget bounds it too).
LOOKUP_RETRY_S = 300.0
#: What a capabilities read may end in short of an answer.
CAPABILITIES_FAILURES: tuple[type[Exception], ...] = (Rejected, NoToken, *ASK_AGAIN)


def advance_submission(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome:
    """SUBMITTING or SUBMISSION_UNKNOWN: create, or look up by key, until one of them has an outcome."""
    while True:
        step = create if op.state is OpState.SUBMITTING else lookup
        done = step(ctx, op, fence)
        if isinstance(done, StepOutcome):
            return done
        op = done.op


def _attempt_in_flight(ctx: StepContext, op: Operation, fence: Fence) -> bool:
    """The create attempt was recorded under this step's own claim (its ``create_attempted`` event carries
    this cursor), and the claim's lease is live: another copy of the step is making the create now. Were
    that copy dead, the lease runs out, and the dispatcher's next claim (a new cursor) finds the attempt
    unanswered: SUBMISSION_UNKNOWN then, as rule 1 says. An attempt of an earlier claim is unknown at once."""
    if fence.poll_cursor is None or op.lease_until is None or op.lease_until <= ctx.now():
        return False
    return ctx.ledger.create_attempt_cursor(op.id) == fence.poll_cursor


def create(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome | Moved:
    """SUBMITTING: capabilities first (rule 12), the attempt committed, then the one create call."""
    if op.submit_attempted_at is not None:
        if _attempt_in_flight(ctx, op, fence):
            # A copy of this very step (its message delivered again while the first copy runs): the first
            # copy is making the create, and records its answer; this one leaves it (rule 1: no second
            # create, and no "unknown" for an answer on its way).
            return StepOutcome(op.id, StepAction.NOTHING_TO_DO, op.state, detail={"claim": "running"})
        # Rule 1: a create was attempted and nothing was recorded after it; never call it again.
        return Moved(
            ctx.ledger.mark_submission_unknown(
                op.id,
                fence,
                detail={"why": "a create was attempted before and its answer was never recorded"},
            )
        )
    if op.cancel_generation > 0:
        # Rule 6: a cancel was requested before any create was attempted (or before the resubmission that
        # followed a proof of "never created"): nothing runs on the server, and no create is made.
        return accept(ctx, op, TerminalKind.CANCELLED, None, audit={"why": "cancelled before any create"})
    if op.wait_deadline is not None and op.wait_deadline <= ctx.now():
        # Rule 3: a create's retries end with the wait budget. Nothing was ever sent (no attempt is
        # recorded), so the operation ends failed without a create, its receipt saying why: the caller
        # stopped waiting, and a create made now could start work nobody waits for.
        return _answered_at_once(ctx, op, fence, _never_sent(op), EventKind.CREATE_NEVER_SENT)
    server = ctx.server(op)
    adapter = ctx.adapter(op)
    budget = ctx.budget.per_request(op.server, "control")
    try:
        capabilities = adapter.capabilities(op.tool_name, budget=budget)
    except CAPABILITIES_FAILURES as exc:
        ctx.budget.hold(op.server, exc)
        # Rule 14 before anything else the failure would decide: a version disabled because its server
        # moved on or broke answers here, not with the server's refusal, a retry or a token wait.
        if _disabled(ctx, op):
            return _refused_as_disabled(ctx, op, fence, AdapterDisabled(op.protocol, op.protocol_version))
        if isinstance(exc, Unauthorized):
            # Refused before any work (rule 1): the credentials may be put right (a rotated secret, a
            # client let in again); asked again after a growing pause, within the wait budget.
            detail = {"error": describe(exc)}
            return ctx.reschedule(
                op, fence, unauthorized_pause(ctx, op), EventKind.CAPABILITIES_FAILED, detail
            )
        if isinstance(exc, Rejected):
            return _answered_at_once(ctx, op, fence, error_result(exc), EventKind.REJECTED)
        if not isinstance(exc, AdapterError):  # NoToken: rescheduled by the step's guard
            raise
        return ctx.retry_later(op, fence, exc, EventKind.CAPABILITIES_FAILED)
    tool = server.tools.get(op.tool_name)
    try:
        op = ctx.ledger.record_create_attempt(
            op.id,
            fence,
            descriptor_version=capabilities.descriptor_digest,
            detail={"use_task": capabilities.use_task, "task_support": capabilities.task_support},
            unless_disabled=(op.protocol, op.protocol_version),
        )
    except AdapterDisabled as refusal:
        # Rule 14: a disabled adapter version makes no new remote operation, a queued create or a
        # resubmission included; the control row is read (FOR SHARE) in the attempt's own transaction, so no
        # attempt is recorded once a disable has committed, and a disable waits for an attempt being
        # recorded. The happy path reads it there only: one transaction, not a read before capabilities.
        return _refused_as_disabled(ctx, op, fence, refusal)
    try:
        created = adapter.create(
            op.tool_name,
            arguments_of(ctx, op),
            submission_key=str(op.submission_key),
            ttl_ms=op.ttl_ms or server.default_ttl_ms,
            sync_upper_bound_s=tool.sync_upper_bound_s if tool else None,
            budget=budget,
        )
    except Unauthorized as exc:
        # A 401 or 403 to the create: the server refused it before any work (rule 1), the attempt is undone
        # and the create made again after a growing pause (a 401 invalid_token renewed the token already:
        # TokenRenewed, a NoWorkDone, below).
        return _undo_attempt(ctx, op, fence, unauthorized_pause(ctx, op), describe(exc))
    except (CapabilityRefused, Rejected) as exc:
        return _answered_at_once(ctx, op, fence, error_result(exc), EventKind.REJECTED)
    except NoWorkDone as exc:
        ctx.budget.hold(op.server, exc)
        # Rule 1: only a 429, or a tools/call that never left, proves the server did no work: the attempt
        # is undone and the create made again, not before the server's Retry-After.
        return _undo_attempt(ctx, op, fence, retry_s(exc), describe(exc))
    except NoToken as no_token:
        # The request budget refused the create call itself: it was never sent.
        return _undo_attempt(ctx, op, fence, no_token.wait_s, describe(no_token))
    except AdapterError as exc:
        ctx.budget.hold(op.server, exc)
        # Anything else once the call may have gone out (a 503 or another 5xx, a 408, a timeout, a cut or
        # unreadable answer) is an unknown outcome: looked up by key, never created again blindly.
        detail = {"error": describe(exc)}
        return Moved(
            ctx.durably(
                lambda: ctx.ledger.mark_submission_unknown(op.id, fence, detail=detail),
                what=f"the unknown outcome of the create of {op.id}",
            )
        )
    return _created(ctx, op, fence, created)


def arguments_of(ctx: StepContext, op: Operation) -> Any:
    """The operation's arguments as recorded at submission: the snapshot's, or, for a snapshot read without
    them (``BODY_NOT_READ``, the poll path's read), the row's own. What a create sends and a lookup asks by
    is always the recorded body, never a stand-in."""
    if op.body is BODY_NOT_READ:
        return ctx.ledger.get(op.id).body
    return op.body


def _undo_attempt(ctx: StepContext, op: Operation, fence: Fence, retry_in_s: float, why: str) -> StepOutcome:
    """The create was proved not to have done any work: the attempt is undone (durably: lost, the next step
    would find an attempt and no answer, an unknown outcome for an operator), and the create is due again
    after the server's wait, or at the wait deadline if that comes first (then it ends never sent: nothing
    is sent sooner than the server asked)."""
    if op.wait_deadline is not None:
        left_s = (op.wait_deadline - ctx.now()).total_seconds()
        retry_in_s = min(retry_in_s, max(0.0, left_s) + DEADLINE_SLACK_S)
    op = ctx.durably(
        lambda: ctx.ledger.undo_create_attempt(op.id, fence, retry_in_s=retry_in_s, detail={"error": why}),
        what=f"the refused create of {op.id}",
    )
    return StepOutcome(op.id, StepAction.CREATE_RETRY, op.state)


def lookup(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome | Moved:
    """SUBMISSION_UNKNOWN (rule 2): ask by submission key; only a server's proof of "never created"
    allows a resubmission, anything unproved goes to an operator. With a cancel recorded, a protocol whose
    lookup repeats the create (``lookup_may_create``) is not asked: the repeat would make the operation if
    the first create never arrived, a create after its cancel (rule 6); an operator decides."""
    spec = SHIPPED.find(op.protocol, op.protocol_version)
    if op.cancel_generation > 0 and spec is not None and spec.lookup_may_create:
        op = ctx.hand_to_operator(
            op,
            fence,
            ReconciliationReason.SUBMISSION_UNKNOWN,
            {
                "why": "a cancel was requested while the create's outcome is unknown, and a lookup on "
                f"{op.protocol} {op.protocol_version} repeats the create, which would make the operation "
                "if the first never arrived: --found sends the cancel, --never-created ends it cancelled "
                "with no create",
                "submission_key": str(op.submission_key),
            },
        )
        return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state)
    adapter = ctx.adapter(op)
    try:
        found = adapter.lookup_by_key(
            str(op.submission_key),
            tool=op.tool_name,
            submitted_after=op.created_at,
            arguments=arguments_of(ctx, op),
            budget=ctx.budget.per_request(op.server, "control"),
        )
    except ASK_AGAIN as exc:
        ctx.budget.hold(op.server, exc)
        failing_s = _lookups_failing_s(ctx, op)
        spent = op.wait_deadline is not None and op.wait_deadline <= ctx.now()
        if spent or (failing_s is not None and failing_s >= LOOKUP_RETRY_S):
            # Rule 2: the lookup's retries have a bound; the create may have been sent, so an operator.
            op = ctx.hand_to_operator(
                op,
                fence,
                ReconciliationReason.SUBMISSION_UNKNOWN,
                {
                    "why": "the wait budget ran out with the create's outcome unknown"
                    if spent
                    else f"the lookup by submission key kept failing for {failing_s:.0f} s",
                    "error": describe(exc),
                    "submission_key": str(op.submission_key),
                },
            )
            return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state)
        return ctx.retry_later(op, fence, exc, EventKind.LOOKUP_FAILED)
    if found.proof == "found" and found.ref is not None:
        op = ctx.ledger.record_found_by_key(
            op.id,
            fence,
            remote_id=found.ref.remote_id,
            session_ref=found.ref.session_ref,
            detail={"detail": found.detail},
        )
        if op.state is OpState.CANCEL_REQUESTED:
            return _cancel_now(ctx, op, fence)
        return StepOutcome(op.id, StepAction.FOUND_BY_KEY, op.state)
    if found.proof == "never_created" and (resubmitted_n := _resubmissions(ctx, op)) >= MAX_RESUBMISSIONS:
        # Rule 2: the create <-> lookup loop has a bound. Every create's answer was lost and every lookup
        # proved it never created: something between longcall and the server eats the answers.
        op = ctx.hand_to_operator(
            op,
            fence,
            ReconciliationReason.SUBMISSION_UNKNOWN,
            {
                "why": f"proved never created after each of {resubmitted_n + 1} creates whose answers were "
                "lost; not created again without an operator",
                "detail": found.detail,
                "submission_key": str(op.submission_key),
            },
        )
        return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state)
    if found.proof == "never_created":
        # Made at once by this step (the create below), under its claim: the lease stays.
        resubmitted = ctx.ledger.resubmit(
            op.id, fence, from_state=op.state, detail={"detail": found.detail}, keep_claim=True
        )
        return Moved(resubmitted)
    op = ctx.hand_to_operator(
        op,
        fence,
        ReconciliationReason.SUBMISSION_UNKNOWN,
        {
            "why": found.detail,
            "submission_key": str(op.submission_key),
            "candidates": [c.remote_id for c in found.candidates],
        },
    )
    return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state)


def _resubmissions(ctx: StepContext, op: Operation) -> int:
    """How many times the operation was submitted again after a proof of "never created" (read only on
    such a proof: the events of one operation)."""
    return sum(1 for event in ctx.ledger.events(op.id) if event["kind"] == EventKind.RESUBMISSION.value)


def _lookups_failing_s(ctx: StepContext, op: Operation) -> float | None:
    """How long the lookups of this unknown outcome have been failing: since the first ``lookup_failed``
    after the latest ``submission_unknown``; None when none failed yet (read only on a failed lookup)."""
    first: dt.datetime | None = None
    for event in ctx.ledger.events(op.id):
        if event["kind"] == EventKind.SUBMISSION_UNKNOWN.value:
            first = None
        elif event["kind"] == EventKind.LOOKUP_FAILED.value and first is None:
            first = event["at"]
    return (ctx.now() - first).total_seconds() if first is not None else None


def _created(ctx: StepContext, op: Operation, fence: Fence, created: Created) -> StepOutcome:
    if created.sync_result is not None:
        return _answered_at_once(ctx, op, fence, created.sync_result, EventKind.RAN_SYNCHRONOUSLY)
    if created.ref is None or created.status is None:
        raise ProtocolViolation("create answered neither a task nor a result")
    status, ref = created.status, created.ref
    next_poll_in_s = ctx.jittered(ctx.interval_s(op, status))
    # Durably: the server holds the task now, and only this answer names it (rule 1).
    op = ctx.durably(
        lambda: ctx.ledger.record_created(
            op.id,
            fence,
            remote_id=ref.remote_id,
            session_ref=ref.session_ref,
            status=server_status(status),
            expires_at=_expiry(ctx, status),
            next_poll_in_s=next_poll_in_s,
            # The step goes on with what the answer says: the claim stays to its end (rule 3).
            keep_claim=status.terminal is not None or status.input_request is not None,
        ),
        what=f"the create answer of {op.id} ({ref.remote_id})",
    )
    if op.state is OpState.CANCEL_REQUESTED:
        return _cancel_now(ctx, op, fence)
    if status.terminal is not None or status.input_request is not None:
        return observed(ctx, op, fence, status)
    return StepOutcome(op.id, StepAction.CREATED, op.state, detail={"remote_id": op.remote_id})


def _cancel_now(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome:
    """The remote id is recorded and a cancel was requested meanwhile (rule 6): the row went to
    CANCEL_REQUESTED with it, and the cancel is sent now, under the same claim and the row's generation. Its
    lease is renewed under that generation while the cancel is in flight: the step's own keeper renews
    under the create's, which the cancel's moved past (refused once the row is CANCEL_REQUESTED), and a
    cancel slower than the lease would otherwise be claimed again, and sent twice."""
    cancelling = Fence(op.execution_epoch, op.cancel_generation, fence.poll_cursor)
    with keep_lease(ctx.ledger, op.id, cancelling, ctx.settings.lease_s, lease_until=op.lease_until):
        return send_cancel(ctx, op, cancelling)


def _answered_at_once(
    ctx: StepContext, op: Operation, fence: Fence, result: RemoteResult, why: EventKind
) -> StepOutcome:
    """The create call itself gave the final answer (SUBMITTING -> TERMINAL_OBSERVED -> FETCHING_RESULT,
    the result held), which is then accepted like any other. An answer that cannot be stored and delivered
    exactly is held as nothing and goes to an operator (RESULT_UNSTORABLE): the call is never made again."""
    unstorable_why: UnstorableResult | None = None
    try:
        held = storable(ctx, result_json(result))
    except UnstorableResult as exc:
        held, unstorable_why = None, exc
    op = ctx.durably(
        lambda: ctx.ledger.hold_create_result(
            op.id,
            fence,
            kind=TerminalKind(result.outcome),
            server_state=result.server_state,
            result=held,
            event=why,
        ),
        what=f"the create's own answer of {op.id}",
    )
    if unstorable_why is not None:
        return unstorable(ctx, op, fence, unstorable_why, result)
    return fetch(ctx, op, fence)


def _disabled(ctx: StepContext, op: Operation) -> bool:
    """Whether the operation's adapter version is disabled for new operations now (rule 14)."""
    return adapter_key(op.protocol, op.protocol_version) in ctx.ledger.control().disabled_adapters


def _refused_as_disabled(
    ctx: StepContext, op: Operation, fence: Fence, refusal: AdapterDisabled
) -> StepOutcome:
    """Answered at once, with no create call: the pipeline hears why (rule 14)."""
    return _answered_at_once(ctx, op, fence, failed_here(str(refusal)), EventKind.ADAPTER_DISABLED)


def _never_sent(op: Operation) -> RemoteResult:
    """The failed result of a create the wait budget ended before it could be sent."""
    budget = op.wait_deadline - op.created_at if op.wait_deadline is not None else None
    return failed_here(
        f"the wait budget ({budget.total_seconds():.0f} s) ran out before the create of {op.tool_name!r} "
        f"on {op.server!r} could be sent (the server refused it before any work, or no control token was "
        f"had: {op.no_token_count} times without a token); no create was made"
        if budget is not None
        else f"the create of {op.tool_name!r} on {op.server!r} could not be sent; no create was made"
    )


def _expiry(ctx: StepContext, status: RemoteStatus) -> dt.datetime | None:
    if status.ttl_ms is None:
        return None
    created = status.created_at or ctx.now()
    return created + dt.timedelta(milliseconds=status.ttl_ms)
