"""Thin tasks: decode the arguments, call one executor function, map the typed outcome to a Celery action.

Task names and queues are public (DESIGN §7). Operation ids come from the ledger; a caller's task id is
never trusted for anything: every message carries (op_id, cursor) and the ledger fences the rest. A message
sent by name is tried through faults as ``workers/task_faults.py`` says; a step that left a receipt or an
input request in the outbox is followed by its drain (``workers/delivery.py`` ``follow``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from celery import Celery, Task

from ledger.errors import (
    AdapterDisabled,
    AdmissionClosed,
    CallNodeConflict,
    CallNodeNotRouted,
    LegacyOutcomeRefused,
    OperationNotFound,
)
from workers.delivery import drain, follow
from workers.errors import (
    InputRefused,
    InvalidSubmission,
    NotCancellable,
    RequestRefused,
    SubmissionRefused,
)
from workers.executor import Dispatch, Executor, PollMember, submit_answer
from workers.replies import check_reply
from workers.runtime import RuntimeHolder
from workers.steps.context import StepAction, StepOutcome
from workers.steps.dispatch import messages
from workers.submission import NotRouted, call_node_name
from workers.task_faults import intent_tries

__all__ = ["RequestRefused", "SubmissionRefused", "publish_dispatches", "register_tasks"]

log = logging.getLogger("longcall")

#: The most outbox rows one ``longcall.drain_outbox`` run publishes.
OUTBOX_DRAIN_LIMIT = 200
#: What ``longcall.submit`` answers with :class:`SubmissionRefused`: the check or the ledger refused it.
SUBMISSION_REFUSALS = (InvalidSubmission, CallNodeConflict, AdmissionClosed, AdapterDisabled)


def publish_dispatches(app: Celery, dispatches: Sequence[Dispatch], *, poll_batch: int = 1) -> int:
    """Publish the claimed steps over one producer, the polls of WORKING operations up to ``poll_batch`` of
    one server to a message (``workers.steps.dispatch.messages``); returns how many steps were sent.

    The task id names the claim (task, operation, cursor; a batch: its members), so a message sent twice
    runs once: the second finds its cursor superseded, or its claim done. A dispatch due within the tick
    gets a short countdown, never a long ETA. Nobody waits on a step's result (the ledger is the record): the
    send says so, or Celery's Redis result backend subscribes to the task's result channel on every send and
    unsubscribes when the AsyncResult is collected (two Redis commands and about a third of the send's CPU;
    issue 13).
    """
    if not dispatches:
        return 0
    sent = 0
    with app.producer_or_acquire() as producer:
        for message in messages(dispatches, poll_batch):
            kwargs = message.kwargs
            app.send_task(
                message.task,
                kwargs=kwargs,
                task_id=message.task_id,
                countdown=message.countdown,
                producer=producer,
                ignore_result=True,
                # What Flower and the task events show, as Celery's saferepr would write it for these
                # plain values, without its pure-Python walk over them on every send.
                argsrepr="()",
                kwargsrepr=repr(kwargs),
            )
            sent += message.size
    return sent


def _op_id(value: Any) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise RequestRefused(f"op_id {value!r} is not an operation id (a UUID)") from None


def _cancel(
    app: Celery,
    holder: RuntimeHolder,
    task: Task[Any, Any],
    executor: Executor,
    *,
    op_id: str | None,
    cursor: int | None,
    call_node_id: str | None,
) -> dict[str, Any]:
    """``longcall.cancel``'s body (see the task)."""
    if (op_id is None) == (call_node_id is None):
        raise RequestRefused("longcall.cancel takes op_id or call_node_id (one of them)")
    tries = intent_tries(task, holder.get().settings)
    try:
        if call_node_id is not None:
            if cursor is not None:
                raise RequestRefused("longcall.cancel takes a cursor with an op_id only")
            node = _call_node_id(call_node_id)
            try:
                step = executor.take_cancel_of_call_node(node, tries=tries)
            except CallNodeNotRouted as outside:
                return {
                    "op_id": None,
                    "call_node_id": node,
                    "action": StepAction.NOT_ROUTED.value,
                    "state": None,
                    "detail": {"why": str(outside), "percent": outside.percent},
                }
            if step is None:
                waits = "the call node's submission: it is ended cancelled, never created"
                return {
                    "op_id": None,
                    "call_node_id": node,
                    "action": StepAction.CANCEL_RECORDED.value,
                    "state": None,
                    "detail": {"waits_for": waits},
                }
        elif cursor is None:
            step = executor.take_cancel(_op_id(op_id), tries=tries)
        else:
            step = executor.send_cancel(_op_id(op_id), int(cursor))
    except (NotCancellable, OperationNotFound) as exc:
        raise RequestRefused(str(exc)) from None
    follow(app, holder, step)
    return step.as_dict()


def _call_node_id(value: Any) -> str:
    """A call node id as a submission's is checked (``workers.submission``), refused with the same reason."""
    try:
        return call_node_name(value)
    except InvalidSubmission as exc:
        raise RequestRefused(str(exc)) from None


def _members(ops: Any) -> list[PollMember]:
    """A batch's members, ``[op_id, cursor]`` or ``[op_id, cursor, wait_s]`` each (a dispatcher's
    ``workers.steps.dispatch.messages``)."""
    if not isinstance(ops, list) or not ops:
        raise RequestRefused("ops must be a non-empty list of [op_id, cursor] or [op_id, cursor, wait_s]")
    members = []
    for op in ops:
        if not isinstance(op, list) or len(op) not in (2, 3):
            raise RequestRefused(
                f"a member of ops must be [op_id, cursor] or [op_id, cursor, wait_s]: {op!r}"
            )
        try:
            cursor, wait_s = int(op[1]), float(op[2]) if len(op) == 3 else 0.0
        except (TypeError, ValueError):
            raise RequestRefused(f"a member of ops has no integer cursor or numeric wait: {op!r}") from None
        members.append(PollMember(_op_id(op[0]), cursor, wait_s))
    return members


def _poll_batch(
    app: Celery, holder: RuntimeHolder, executor: Executor, members: list[PollMember]
) -> dict[str, Any]:
    """Start a batch's members on their server's threads in this process and answer at once: the worker
    takes its next message while they run (a slow server's batch holds up no other message). Each member's
    step is followed by its drain, on its own thread, as it comes; the batch's answer is logged once every
    member is done."""

    def finished(steps: list[StepOutcome]) -> None:
        actions: dict[str, int] = {}
        for step in steps:
            actions[step.action.value] = actions.get(step.action.value, 0) + 1
        log.info("a batch of %d polls is done: %s", len(steps), actions)

    executor.start_batch(members, on_step=lambda step: follow(app, holder, step), on_finish=finished)
    return {"ops": len(members), "started": len(members)}


# Internal steps keep no result in the backend (the ledger is the record; nobody waits on them); the tasks
# a caller may wait on (submit, cancel, provide_input) keep theirs.
def register_tasks(app: Celery, holder: RuntimeHolder) -> None:
    def executor() -> Executor:
        return Executor(holder.get())

    # A refusal is expected: Celery logs it as one line, "raised expected: <the reason>", at INFO, without a
    # traceback (its ERROR with a traceback is for what nobody expected).
    @app.task(name="longcall.submit", shared=False, bind=True, max_retries=None, throws=(SubmissionRefused,))
    def submit(self: Task[Any, Any], /, **kwargs: Any) -> dict[str, Any]:
        try:
            submission, step = executor().take_submission(
                kwargs, tries=intent_tries(self, holder.get().settings)
            )
        except NotRouted as exc:
            # Outside the canary: nothing is written, nothing is called; the caller keeps its legacy path.
            return exc.routing.answer()
        except SUBMISSION_REFUSALS as exc:
            node = kwargs.get("call_node_id")
            raise SubmissionRefused(
                f"call node {node!r}: {exc}" if isinstance(node, str) else str(exc)
            ) from None
        follow(app, holder, step)
        return submit_answer(submission, step)

    @app.task(name="longcall.poll", shared=False, ignore_result=True)
    def poll(op_id: str | None = None, cursor: int | None = None, ops: Any = None) -> dict[str, Any]:
        """One operation's step (``op_id``, ``cursor``: every phase's, and every dispatcher's of old), or a
        batch of polls of one server (``ops``), run side by side, each under its own cursor."""
        if ops is None:
            if op_id is None or cursor is None:
                raise RequestRefused("longcall.poll needs op_id and cursor, or ops")
            step = executor().advance(_op_id(op_id), int(cursor))
            follow(app, holder, step)
            return step.as_dict()
        return _poll_batch(app, holder, executor(), _members(ops))

    @app.task(name="longcall.fetch_result", shared=False, ignore_result=True)
    def fetch_result(op_id: str, cursor: int) -> dict[str, Any]:
        step = executor().fetch_result(_op_id(op_id), int(cursor))
        follow(app, holder, step)
        return step.as_dict()

    @app.task(name="longcall.cancel", shared=False, bind=True, max_retries=None, throws=(RequestRefused,))
    def cancel(
        self: Task[Any, Any],
        op_id: str | None = None,
        cursor: int | None = None,
        call_node_id: str | None = None,
    ) -> dict[str, Any]:
        """With ``op_id`` or ``call_node_id`` alone: an operator's or pipeline's cancel request (its intent
        tried again through a fault until it is recorded). A call node with no operation yet has the intent
        recorded for its first submission, which is then ended cancelled without a create (the answer's
        ``op_id`` is None). With a cursor (and an ``op_id``): the dispatcher sending (again) the protocol
        request of a cancel already recorded (a fault leaves it to the dispatcher, which claims it again)."""
        return _cancel(app, holder, self, executor(), op_id=op_id, cursor=cursor, call_node_id=call_node_id)

    @app.task(
        name="longcall.provide_input", shared=False, bind=True, max_retries=None, throws=(RequestRefused,)
    )
    def provide_input(self: Task[Any, Any], op_id: str, input_round: int, response: Any) -> dict[str, Any]:
        check_reply(op_id, input_round, response, max_body_bytes=holder.get().settings.max_body_bytes)
        target = _op_id(op_id)
        try:
            step = executor().take_reply(
                target, input_round, response, tries=intent_tries(self, holder.get().settings)
            )
        except (InputRefused, OperationNotFound) as exc:
            raise RequestRefused(str(exc)) from None
        follow(app, holder, step)
        return step.as_dict()

    @app.task(name="longcall.record_legacy_outcome", shared=False, throws=(RequestRefused,))
    def record_legacy_outcome(**kwargs: Any) -> dict[str, Any]:
        """The caller's legacy outcome of a call node, beside its shadow operation's receipt (issue 12)."""
        try:
            comparison, outcome = executor().record_legacy_outcome(kwargs)
        except (InvalidSubmission, LegacyOutcomeRefused) as exc:
            raise RequestRefused(str(exc)) from None
        return {"outcome": outcome, **comparison.to_json()}

    # beat's ticks send no task events: Flower and the event stream show the operations' tasks, not four
    # dispatch ticks a second (the ticks' own figures are in the workers' logs and ``longcall metrics``).
    @app.task(name="longcall.dispatch_due", shared=False, ignore_result=True, send_events=False)
    def dispatch_due() -> dict[str, int]:
        poll_batch = holder.get().settings.poll_batch
        return {"dispatched": publish_dispatches(app, executor().dispatch_due(), poll_batch=poll_batch)}

    @app.task(name="longcall.drain_outbox", shared=False, ignore_result=True, send_events=False)
    def drain_outbox(limit: int = OUTBOX_DRAIN_LIMIT) -> dict[str, int]:
        report = drain(app, holder.get(), limit)
        return {"dispatched": len(report.dispatched), "failed": len(report.failed), "dead": len(report.dead)}

    @app.task(name="longcall.reconcile", shared=False, ignore_result=True, send_events=False)
    def reconcile() -> dict[str, int]:
        return executor().reconcile()
