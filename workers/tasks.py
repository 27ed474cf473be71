"""Thin tasks: decode the arguments, call one executor function, map the typed outcome to a Celery action.

Task names and queues are public (DESIGN §7). Operation ids come from the ledger; a caller's task id is
never trusted for anything: every message carries (op_id, cursor) and the ledger fences the rest.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import kombu.exceptions
from celery import Celery, Task
from celery.exceptions import Reject

from ledger.errors import (
    AdapterDisabled,
    AdmissionClosed,
    CallNodeConflict,
    LegacyOutcomeRefused,
    OperationNotFound,
)
from ledger.records import DrainReport
from workers.delivery import outbox_retry, publisher
from workers.errors import (
    InputRefused,
    IntentNotRecorded,
    InvalidSubmission,
    NotCancellable,
    RequestRefused,
    SubmissionRefused,
)
from workers.executor import Dispatch, Executor, StepOutcome
from workers.faults import INFRASTRUCTURE, describe_fault, keep_trying
from workers.runtime import RuntimeHolder
from workers.submission import (
    NotRouted,
    canary_admission,
    operation_summary,
    parse_legacy_outcome,
    reply_size_refusal,
    validate_submission,
)

__all__ = ["RequestRefused", "SubmissionRefused", "publish_dispatches", "register_tasks"]

log = logging.getLogger("longcall")

R = TypeVar("R")

#: A dispatch due sooner than this is sent without a countdown.
COUNTDOWN_FLOOR_S = 0.005
#: The most outbox rows one ``longcall.drain_outbox`` run (and a step's own drain) publishes.
OUTBOX_DRAIN_LIMIT = 200
#: What a step drains of its own operation's rows (a receipt, an input request or two).
OWN_ROWS_DRAIN_LIMIT = 10


def publish_dispatches(app: Celery, dispatches: Sequence[Dispatch]) -> int:
    """Publish the claimed steps, one message each, over one producer; returns how many were sent.

    The task id names the claim (task, operation, cursor), so a message sent twice runs once: the second
    finds its cursor superseded. A dispatch due within the tick gets a short countdown, never a long ETA.
    Nobody waits on a step's result (the ledger is the record): the send says so, or Celery's Redis result
    backend subscribes to the task's result channel on every send and unsubscribes when the AsyncResult is
    collected (two Redis commands and about a third of the send's CPU; issue 13).
    """
    if not dispatches:
        return 0
    with app.producer_or_acquire() as producer:
        for dispatch in dispatches:
            kwargs = {"op_id": str(dispatch.op_id), "cursor": dispatch.cursor}
            app.send_task(
                dispatch.task,
                kwargs=kwargs,
                task_id=dispatch.task_id,
                countdown=dispatch.delay_s if dispatch.delay_s >= COUNTDOWN_FLOOR_S else None,
                producer=producer,
                ignore_result=True,
                # What Flower and the task events show, as Celery's saferepr would write it for these
                # plain values, without its pure-Python walk over them on every send.
                argsrepr="()",
                kwargsrepr=repr(kwargs),
            )
    return len(dispatches)


#: A fault of Postgres, Redis or the broker: the task sent by name is tried again, never failed.
FAULTS: tuple[type[BaseException], ...] = (
    *INFRASTRUCTURE,
    kombu.exceptions.OperationalError,
    ConnectionError,
    TimeoutError,
)
#: How long a task sent by name tries again in process (a Postgres restart or failover, Redis restarting)
#: before it hands its message back to the broker for a later try.
INLINE_RETRY_S = 30.0
#: The countdown of a message handed back, doubling per hand-back up to this.
HAND_BACK_MAX_S = 60.0


def through_faults(
    task: Task[Any, Any], what: str, run: Callable[[], R], *, retry_s: float, hold_s: float | None = None
) -> R:
    """``run()``, tried again through infrastructure faults (rule 3: bounded, then an operator told).

    ``run`` records an intent sent by name (a submission, a cancel, an input reply) and is safe to repeat:
    the ledger answers a repeat with what it recorded the first time (the call node's operation, the intent
    already recorded). Tried again here, with a growing pause, for :data:`INLINE_RETRY_S`; then the message
    goes back to the broker with a countdown (``Task.retry``: it stays in the broker, never only in this
    worker's memory; if even that publish fails, the message is rejected back to its queue); past
    ``retry_s`` (``intent_retry_s``) in all, the task fails with :class:`IntentNotRecorded`, logged at
    ERROR with the fault. ``hold_s``: how long the broker lets a worker hold a message
    (``Settings.max_held_delivery_s``): a hand-back's countdown stays well inside it."""
    try:
        return keep_trying(run, faults=FAULTS, for_s=min(INLINE_RETRY_S, retry_s), what=what)
    except FAULTS as exc:
        _hand_back(task, what, exc, retry_s=retry_s, most_s=_countdown_cap(hold_s))


def _countdown_cap(hold_s: float | None) -> float:
    """A hand-back's longest countdown: :data:`HAND_BACK_MAX_S`, and at most half of what the broker lets a
    worker hold a message (a countdown message is held by the worker that reserved it)."""
    return HAND_BACK_MAX_S if hold_s is None else max(1.0, min(HAND_BACK_MAX_S, hold_s / 2))


def _hand_back(
    task: Task[Any, Any], what: str, exc: BaseException, *, retry_s: float, most_s: float
) -> NoReturn:
    hand_backs = task.request.retries or 0
    countdown = min(most_s, 2.0 ** (hand_backs + 1))
    # Each hand-back follows INLINE_RETRY_S of tries in process.
    spent = sum(INLINE_RETRY_S + min(most_s, 2.0 ** (n + 1)) for n in range(hand_backs))
    if spent + INLINE_RETRY_S >= retry_s:
        log.error(
            "%s was NOT recorded: %s for about %.0f s (LONGCALL_INTENT_RETRY_S=%g); send it again once the "
            "fault is gone",
            what,
            describe_fault(exc),
            spent + INLINE_RETRY_S,
            retry_s,
        )
        raise IntentNotRecorded(
            f"{what} was not recorded: {describe_fault(exc)} for about {spent + INLINE_RETRY_S:.0f} s"
        ) from None
    log.warning("%s met %s; handed back to the broker, again in %.0f s", what, describe_fault(exc), countdown)
    try:
        raise task.retry(countdown=countdown, max_retries=None)
    except Reject:
        # The hand-back's own publish failed (the broker is the fault): back to its queue instead (if the
        # broker cannot take even that, the message stays unacknowledged there and is delivered again).
        raise Reject(describe_fault(exc), requeue=True) from None


def _log_failed_publishes(report: DrainReport) -> None:
    """The rows a drain could not publish: the ones it dead-lettered at ERROR (an operator's, rule 9), the
    rest, which stay ready for the next drain, at WARNING."""
    dead = set(report.dead)
    if dead:
        log.error(
            "outbox rows %s could not be published after their bounded attempts: dead-lettered "
            "(OUTBOX_UNDELIVERABLE; longcall reconcile --resend ID once the cause is gone)",
            sorted(dead),
        )
    ready = [row for row in report.failed if row not in dead]
    if ready:
        log.warning("outbox rows %s could not be published; they stay ready", ready)


def _op_id(value: Any) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise RequestRefused(f"op_id {value!r} is not an operation id (a UUID)") from None


# Internal steps keep no result in the backend (the ledger is the record; nobody waits on them); the tasks
# a caller may wait on (submit, cancel, provide_input) keep theirs.
def register_tasks(app: Celery, holder: RuntimeHolder) -> None:  # noqa: PLR0915 - one closure per task
    def executor() -> Executor:
        return Executor(holder.get())

    def follow(step: StepOutcome | None) -> None:
        """A step left a receipt or an input request in the outbox (committed with its state): drain it now,
        in this task, rather than as one more message (``longcall.drain_outbox``: a broker round trip, its
        events and a task's CPU for every operation; issue 13). The drain is the beat's own
        (``Ledger.drain_outbox``: SKIP LOCKED, at-least-once); if it fails, the message is sent instead, and
        the beat's drain still runs every ``outbox_interval_s``. Only the step's own operation's rows, up to
        the first failed publish: a backlog of others' rows, or a broker that fails slowly, stays with the
        beat's drain on ``longcall.outbox`` and never holds a poll or control slot."""
        if step is None or not step.drain_now:
            return
        try:
            runtime = holder.get()
            report = runtime.ledger.drain_outbox(
                publisher(app),
                limit=OWN_ROWS_DRAIN_LIMIT,
                op_id=step.op_id,
                retry=outbox_retry(runtime.settings),
            )
        except Exception:
            log.warning("draining the outbox after %s failed", step.op_id, exc_info=True)
        else:
            if not report.failed:
                return
            _log_failed_publishes(report)
        try:
            app.send_task("longcall.drain_outbox", queue="longcall.outbox", ignore_result=True)
        except Exception:  # the beat's drain runs every outbox_interval_s anyway
            log.warning("could not send longcall.drain_outbox; the beat's drain will publish", exc_info=True)

    @app.task(name="longcall.submit", shared=False, bind=True, max_retries=None)
    def submit(self: Task[Any, Any], /, **kwargs: Any) -> dict[str, Any]:
        runtime = holder.get()
        try:
            new = validate_submission(
                kwargs,
                runtime.fleet,
                max_body_bytes=runtime.settings.max_body_bytes,
                max_delay_s=runtime.settings.max_callback_delay_s,
            )
            # Routed in the insert's transaction, under the call node's lock (workers/submission.py). The
            # insert is tried again through a fault (a repeat finds the row the first try committed); once
            # the row is recorded, a fault in its first step leaves the step to the dispatcher
            # (``Executor.submit``), and the answer is the operation.
            submission, step = through_faults(
                self,
                f"longcall.submit of call node {new.call_node_id!r}",
                lambda: Executor(runtime).submit(new, admit=canary_admission(runtime.fleet, new)),
                retry_s=runtime.settings.intent_retry_s,
                hold_s=runtime.settings.max_held_delivery_s,
            )
        except NotRouted as exc:
            # Outside the canary: nothing is written, nothing is called; the caller keeps its legacy path.
            return exc.routing.answer()
        except (InvalidSubmission, CallNodeConflict, AdmissionClosed, AdapterDisabled) as exc:
            log.warning("longcall.submit refused: %s", exc)
            raise SubmissionRefused(str(exc)) from None
        follow(step)
        summary = operation_summary(submission.operation, created=submission.created)
        if step is not None:
            summary["step"] = step.action
            summary["state"] = step.state.value if step.state is not None else summary["state"]
        return summary

    @app.task(name="longcall.poll", shared=False, ignore_result=True)
    def poll(op_id: str, cursor: int) -> dict[str, Any]:
        step = executor().advance(_op_id(op_id), int(cursor))
        follow(step)
        return step.as_dict()

    @app.task(name="longcall.fetch_result", shared=False, ignore_result=True)
    def fetch_result(op_id: str, cursor: int) -> dict[str, Any]:
        step = executor().fetch_result(_op_id(op_id), int(cursor))
        follow(step)
        return step.as_dict()

    @app.task(name="longcall.cancel", shared=False, bind=True, max_retries=None)
    def cancel(self: Task[Any, Any], op_id: str, cursor: int | None = None) -> dict[str, Any]:
        """With ``op_id`` alone: an operator's or pipeline's cancel request (its intent tried again through
        a fault until it is recorded). With a cursor: the dispatcher sending (again) the protocol request of
        a cancel already recorded (a fault leaves it to the dispatcher, which claims it again)."""
        try:
            if cursor is None:
                target = _op_id(op_id)
                step = through_faults(
                    self,
                    f"longcall.cancel of {target}",
                    lambda: executor().request_cancel(target),
                    retry_s=holder.get().settings.intent_retry_s,
                    hold_s=holder.get().settings.max_held_delivery_s,
                )
            else:
                step = executor().send_cancel(_op_id(op_id), int(cursor))
        except (NotCancellable, OperationNotFound) as exc:
            raise RequestRefused(str(exc)) from None
        follow(step)
        return step.as_dict()

    @app.task(name="longcall.provide_input", shared=False, bind=True, max_retries=None)
    def provide_input(self: Task[Any, Any], op_id: str, input_round: int, response: Any) -> dict[str, Any]:
        if not isinstance(response, dict):
            raise RequestRefused("response must be the protocol's reply body, a JSON object")
        if isinstance(input_round, bool) or not isinstance(input_round, int):
            raise RequestRefused("input_round must be a whole number")
        too_big = reply_size_refusal(response, max_body_bytes=holder.get().settings.max_body_bytes)
        if too_big is not None:
            log.warning("longcall.provide_input refused for %s: %s", op_id, too_big)
            raise RequestRefused(too_big)
        target = _op_id(op_id)
        try:
            # The reply is stored with its round, tried again through a fault until it is (a repeat of the
            # same reply after a lost commit finds it stored); then sent, now or by the next step.
            step = through_faults(
                self,
                f"longcall.provide_input of {target} round {input_round}",
                lambda: executor().provide_input(target, input_round, response),
                retry_s=holder.get().settings.intent_retry_s,
                hold_s=holder.get().settings.max_held_delivery_s,
            )
        except (InputRefused, OperationNotFound) as exc:
            raise RequestRefused(str(exc)) from None
        follow(step)
        return step.as_dict()

    @app.task(name="longcall.record_legacy_outcome", shared=False)
    def record_legacy_outcome(**kwargs: Any) -> dict[str, Any]:
        """The caller's legacy outcome of a call node, beside its shadow operation's receipt (issue 12)."""
        runtime = holder.get()
        try:
            legacy = parse_legacy_outcome(kwargs, max_body_bytes=runtime.settings.max_body_bytes)
            comparison, outcome = runtime.ledger.record_legacy_outcome(
                legacy.call_node_id,
                legacy.terminal_state,
                result_digest=legacy.result_digest,
                detail=legacy.detail,
            )
        except (InvalidSubmission, LegacyOutcomeRefused) as exc:
            log.warning("longcall.record_legacy_outcome refused: %s", exc)
            raise RequestRefused(str(exc)) from None
        return {"outcome": outcome, **comparison.to_json()}

    @app.task(name="longcall.dispatch_due", shared=False, ignore_result=True)
    def dispatch_due() -> dict[str, int]:
        return {"dispatched": publish_dispatches(app, executor().dispatch_due())}

    @app.task(name="longcall.drain_outbox", shared=False, ignore_result=True)
    def drain_outbox(limit: int = OUTBOX_DRAIN_LIMIT) -> dict[str, int]:
        runtime = holder.get()
        report = runtime.ledger.drain_outbox(
            publisher(app), limit=limit, retry=outbox_retry(runtime.settings)
        )
        if report.failed:
            _log_failed_publishes(report)
        return {"dispatched": len(report.dispatched), "failed": len(report.failed), "dead": len(report.dead)}

    @app.task(name="longcall.reconcile", shared=False, ignore_result=True)
    def reconcile() -> dict[str, int]:
        return executor().reconcile()
