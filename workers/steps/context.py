"""What every step needs, in one small object, and the value every step returns.

A step is a function ``(ctx, op, fence) -> StepOutcome`` run under the caller's claim. :class:`StepContext`
carries the runtime (ledger, fleet, Redis, adapters), the servers' budgets (rule 4: :mod:`workers.budget`),
the clock, the jitter, the reschedule and the hand-over to an operator; each ledger write a step makes is
one of the ledger's named, guarded moves.
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import random
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from adapters import (
    AdapterError,
    OutcomeUnknown,
    ProtocolViolation,
    RemoteRef,
    RemoteStatus,
    ToolAdapter,
    Transient,
)
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import MIN_POLL_S, POLL_JITTER_MAX_S, POLL_JITTER_SHARE, Fence, Operation, ServerStatus
from ledger.repository import Ledger
from ledger.states import OpState
from workers import logs
from workers.budget import ServerBudgets
from workers.errors import NoToken
from workers.faults import LEDGER_UNAVAILABLE, describe_fault, keep_trying
from workers.hot import MAX_SERVER_WAIT_S
from workers.runtime import Runtime
from workers.settings import ServerConfig, Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The share of the lease for which a step retries a write through a Postgres fault (:meth:`StepContext.
#: durably`): the lease was renewed at most a third of it ago (``workers/lease.py``), so within this share
#: no other claim can have taken the row, whatever the keeper managed during the fault.
DURABLE_SHARE = 0.6

#: The shortest pause after a server's Retry-After.
RETRY_FLOOR_S = 0.5
#: How long after an operation's wait deadline a step rescheduled to it comes due: the deadline is then
#: past by the ledger's clock as well.
DEADLINE_SLACK_S = 0.05
#: What a failed read or cancel request leaves undecided: it is asked again later (a create's unknown
#: outcome is not one of these uses: it is looked up by key).
TRY_AGAIN: tuple[type[AdapterError], ...] = (Transient, ProtocolViolation, OutcomeUnknown)


class StepAction(enum.StrEnum):
    """What one step did, as its task's answer says it (``"action"``), besides a reschedule (which answers
    with the :class:`~ledger.events.EventKind` it recorded: ``no_token``, ``rate_limited``, ...)."""

    # --- the protocol's steps
    CREATED = "created"
    CREATE_RETRY = "create_retry"
    FOUND_BY_KEY = "found_by_key"
    STILL_WORKING = "still_working"
    NO_TOKEN = "no_token"  # noqa: S105 - the bucket had no token for the call, not a secret
    WAIT_BUDGET_EXHAUSTED = "wait_budget_exhausted"
    TERMINAL_OBSERVED = "terminal_observed"
    MANUAL_RECONCILIATION = "manual_reconciliation"
    # --- acceptance (rule 8): ``ledger.records.AcceptanceOutcome``, one member each
    ACCEPTED = "accepted"
    ALREADY_ACCEPTED = "already_accepted"
    REJECTED = "rejected"
    EFFECT_RECONCILIATION = "effect_reconciliation"
    # --- cancel (rule 6)
    CANCEL_RECORDED = "cancel_recorded"
    CANCEL_REQUESTED = "cancel_requested"
    ALREADY_REQUESTED = "already_requested"
    ALREADY_FINAL = "already_final"
    NOT_ROUTED = "not_routed"
    # --- input rounds (rule 10)
    INPUT_RECORDED = "input_recorded"
    INPUT_PROVIDED = "input_provided"
    INPUT_REPLY_REFUSED = "input_reply_refused"
    INPUT_REPLY_FAILED = "input_reply_failed"
    INPUT_REPLY_TO_OPERATOR = "input_reply_to_operator"
    INPUT_UNREADABLE = "input_unreadable"
    INPUT_UNREADABLE_TO_OPERATOR = "input_unreadable_to_operator"
    # --- what the executor answers without a step
    NOTHING_TO_DO = "nothing_to_do"
    SUPERSEDED = "superseded"
    STALE = "stale"
    NOT_OWNER = "not_owner"
    UNKNOWN_SERVER = "unknown_server"
    DEFERRED = "deferred"


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step did: a :class:`StepAction`, or the event a reschedule recorded. ``drain_now``: a receipt
    or an input request is waiting in the outbox."""

    op_id: uuid.UUID
    action: StepAction | EventKind
    state: OpState | None = None
    drain_now: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)
    #: A poll that changed nothing and wrote nothing (its next poll is the one its claim set, or an interval
    #: after the read if that is later): its count is the caller's to record, with its batch's
    #: (``Ledger.record_unchanged_polls``).
    unchanged: bool = False
    #: An unchanged poll's next poll at the earliest, on this process's ``time.monotonic()``: its read's
    #: time plus the server's interval, jittered (``UnchangedPoll.next_poll_due``, which its record keeps).
    next_poll_due: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The task's return value (JSON)."""
        return {
            "op_id": str(self.op_id),
            "action": self.action.value,
            "state": self.state.value if self.state else None,
            **({"detail": dict(self.detail)} if self.detail else {}),
        }


@dataclass(frozen=True, slots=True)
class Moved:
    """The step moved the row to a state whose own step runs next, in the same claim (see
    :func:`workers.steps.submit.advance_submission`)."""

    op: Operation


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def spread(interval: float) -> float:
    """The default jitter: up to 5 % of the interval, at most a quarter second (``ledger.records``: the claim
    that sets the next poll ahead draws it the same way)."""
    return random.uniform(0.0, min(POLL_JITTER_SHARE * interval, POLL_JITTER_MAX_S))  # noqa: S311 - spreading load, not a secret


@dataclass(frozen=True, slots=True)
class StepContext:
    """What every step needs: the runtime, the servers' budgets, the clock, the jitter, and the moves every
    step shares (reschedule, retry later, hand to an operator)."""

    runtime: Runtime
    jitter: Callable[[float], float] = spread
    clock: Callable[[], dt.datetime] = utc_now

    @property
    def ledger(self) -> Ledger:
        return self.runtime.ledger

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def budget(self) -> ServerBudgets:
        """Rule 4: a token per request (:meth:`~ServerBudgets.take`, :meth:`~ServerBudgets.per_request`) and
        a server's wait held for the fleet (:meth:`~ServerBudgets.hold`)."""
        runtime = self.runtime
        return ServerBudgets(runtime.hot, runtime.remote.server, runtime.settings.dispatch_interval_s)

    def now(self) -> dt.datetime:
        return self.clock()

    def server(self, op: Operation) -> ServerConfig:
        logs.note_operation(op.id, op.call_node_id)  # what the step logs from here on is about ``op``
        return self.runtime.remote.server(op.server)

    def adapter(self, op: Operation) -> ToolAdapter:
        """The adapter of the protocol and version recorded on the operation at submit (rule 14). A step that
        catches the error of one of its calls records the wait the server asked for first
        (:meth:`ServerBudgets.hold`)."""
        logs.note_operation(op.id, op.call_node_id)
        return self.runtime.remote.adapter(
            op.server, protocol=op.protocol, protocol_version=op.protocol_version
        )

    # ----------------------------------------------------------------- what a remote call answered (1, 3)

    def durably(self, write: Callable[[], T], *, what: str) -> T:
        """``write()``, a ledger write that records what a remote call just answered (a create's remote id,
        its synchronous result, its proof that no work was done), tried again through a Postgres fault for
        as long as the step's claim is surely still its own (:data:`DURABLE_SHARE` of the lease; the lease
        keeper renews it meanwhile when it can), so that a database restart or failover right after the
        answer does not lose it: a create answer lost so would send the operation to an operator while the
        server holds the task. A repeat after a commit whose answer was lost meets the fence (the row moved
        on: refused as stale), never a second effect. Past the bound the fault is raised: the step ends,
        and its row is the dispatcher's when the lease runs out."""
        for_s = self.settings.lease_s * DURABLE_SHARE
        try:
            return keep_trying(write, faults=LEDGER_UNAVAILABLE, for_s=for_s, what=f"recording {what}")
        except LEDGER_UNAVAILABLE as exc:
            log.error("recording %s failed for good: %s", what, describe_fault(exc))  # noqa: TRY400 - re-raised
            raise

    # --------------------------------------------------------------------------- moves every step shares

    def reschedule(
        self, op: Operation, fence: Fence, delay_s: float, event: EventKind, detail: Mapping[str, Any]
    ) -> StepOutcome:
        """Nothing to decide now: due again in ``delay_s``, the claim let go; never past the operation's wait
        deadline while it is ahead (rule 3): a server's long wait, or a hold, that outlasts the deadline
        hands the operation to its deadline path then (the fleet-wide hold still refuses its requests), not
        a silent wait past it."""
        delay_s = self.until_deadline(op, delay_s)
        self.ledger.reschedule(op.id, fence, state=op.state, delay_s=delay_s, event=event, detail=detail)
        return StepOutcome(op.id, event, op.state, detail={"delay_s": round(delay_s, 3)})

    def until_deadline(self, op: Operation, delay_s: float) -> float:
        """``delay_s``, never past ``op``'s wait deadline (and its slack) while the deadline is ahead."""
        if op.wait_deadline is None:
            return delay_s
        left = (op.wait_deadline - self.now()).total_seconds()
        if left <= 0:
            return delay_s  # the deadline is past: the step that met it decides, never a tight loop
        return min(delay_s, left + DEADLINE_SLACK_S)

    def retry_later(self, op: Operation, fence: Fence, exc: AdapterError, event: EventKind) -> StepOutcome:
        """A failure that decided nothing: again after the server's Retry-After, or a short pause."""
        return self.reschedule(op, fence, retry_s(exc), event, {"error": describe(exc)})

    def no_token(self, op: Operation, fence: Fence, no_token: NoToken) -> StepOutcome:
        delay = no_token_delay(no_token)
        return self.reschedule(op, fence, delay, EventKind.NO_TOKEN, {"wait_s": round(no_token.wait_s, 3)})

    def hand_to_operator(
        self, op: Operation, fence: Fence, reason: ReconciliationReason, detail: Mapping[str, Any]
    ) -> Operation:
        """MANUAL_RECONCILIATION with an open record (rule 11): an operator decides, before the deadline."""
        return self.ledger.hand_to_operator(
            op.id,
            fence,
            from_state=op.state,
            reason=reason,
            detail=detail,
            deadline_s=self.settings.reconcile_deadline_s,
        )

    # --------------------------------------------------------------------------------- poll timing (3)

    def interval_s(self, op: Operation, status: RemoteStatus | None) -> float:
        """The server's poll interval hint (this answer's, else the last one kept), else the default."""
        if status is not None and status.poll_interval_ms is not None:
            return max(MIN_POLL_S, status.poll_interval_ms / 1000)
        if op.poll_interval_ms is not None:
            return max(MIN_POLL_S, op.poll_interval_ms / 1000)
        return self.server(op).default_poll_interval_ms / 1000

    def jittered(self, interval: float) -> float:
        return interval + self.jitter(interval)


def no_token_delay(no_token: NoToken) -> float:
    """When a step refused a token is due again: the bucket's wait, and a little spread, so operations
    refused together do not all come back at the same instant."""
    return no_token.wait_s + random.uniform(0.0, 0.05)  # noqa: S311 - spreading load, not a secret


#: The pauses after a request refused for its credentials (401, 403): 1 s, doubling to this.
UNAUTHORIZED_PAUSE_MAX_S = 60.0


def unauthorized_pause(ctx: StepContext, op: Operation) -> float:
    """1 s after the first refusal of this operation's credentials (a 401 or 403 after the token's one
    renewal), doubling with each (its events that say so), to :data:`UNAUTHORIZED_PAUSE_MAX_S`: a fleet with
    a wrong or revoked credential asks the server a few times a minute per operation, not at once. The
    create, the cancel and the input reply wait so (the server did no work; the intent is kept)."""
    refusals = sum(
        1
        for event in ctx.ledger.events(op.id)
        if isinstance(event["detail"], dict)
        and str(event["detail"].get("error", "")).startswith("Unauthorized:")
    )
    return min(UNAUTHORIZED_PAUSE_MAX_S, 2.0**refusals)


def retry_s(exc: AdapterError) -> float:
    """Never sooner than the server's Retry-After (at most :data:`~workers.hot.MAX_SERVER_WAIT_S`: a server
    asking for a day parks nothing that long); without one, a short pause."""
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        return min(max(RETRY_FLOOR_S, float(retry_after)), MAX_SERVER_WAIT_S)
    return 1.0


def server_status(status: RemoteStatus) -> ServerStatus:
    """What the ledger keeps of a status read."""
    return ServerStatus(status.server_state, status.status_message, status.poll_interval_ms)


def remote_ref(op: Operation) -> RemoteRef:
    if op.remote_id is None:
        raise ValueError(f"operation {op.id} has no remote id in state {op.state}")
    return RemoteRef(op.remote_id, op.session_ref, op.protocol_version, op.protocol)


def describe(exc: BaseException) -> str:
    """An error as an event keeps it: its class and message, bounded."""
    return f"{type(exc).__name__}: {exc}"[:500]
