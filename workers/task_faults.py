"""A message sent by name tried again through infrastructure faults, in the task, then by the broker.

A submission, a cancel or an input reply is an intent its sender cannot repeat at will: it is tried again
here through a fault of Postgres, Redis or the broker (rule 3: bounded, then an operator told). The
executor says what to try (``Executor.take_submission``, ``take_cancel``, ``take_reply`` with
``tries=``); this module says how, with Celery's own means (``Task.retry``, ``Reject``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import kombu.exceptions
from celery import Task
from celery.exceptions import Reject

from workers.errors import IntentNotRecorded
from workers.executor import Tries
from workers.faults import INFRASTRUCTURE, describe_fault, keep_trying
from workers.settings import Settings

log = logging.getLogger("longcall")

R = TypeVar("R")

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


def intent_tries(task: Task[Any, Any], settings: Settings) -> Tries:
    """How ``task`` tries what the executor gives it: :func:`through_faults`, for ``intent_retry_s`` in all,
    a hand-back's countdown within what the broker lets a worker hold a message."""

    def tries(what: str, run: Callable[[], R], /) -> R:
        return through_faults(
            task, what, run, retry_s=settings.intent_retry_s, hold_s=settings.max_held_delivery_s
        )

    return tries


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
