"""Transient faults of the fleet's own infrastructure, as opposed to refusals and bugs.

A fault of Postgres (the ledger) or Redis (the buckets, the holds, the cancel CAS) says nothing about the
operation: the work is tried again, never turned into a failure that is acknowledged and forgotten. Each
part names its own faults (``ledger.errors.UNAVAILABLE``, ``workers.hot.UNAVAILABLE``); the broker's are
added where Celery is known (``workers/task_faults.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ledger.errors import UNAVAILABLE as LEDGER_UNAVAILABLE
from workers.hot import UNAVAILABLE as HOT_UNAVAILABLE

__all__ = ["INFRASTRUCTURE", "LEDGER_UNAVAILABLE", "describe_fault", "keep_trying", "pause_s"]

log = logging.getLogger("longcall")

T = TypeVar("T")

#: A fault of the ledger or of the hot state.
INFRASTRUCTURE: tuple[type[Exception], ...] = (*LEDGER_UNAVAILABLE, *HOT_UNAVAILABLE)

#: The first pause after a fault, and the longest.
FIRST_PAUSE_S = 0.2
MAX_PAUSE_S = 2.0


def pause_s(attempt: int) -> float:
    """The pause before try ``attempt + 1`` (``attempt`` from 0): 0.2 s, doubling, at most 2 s."""
    return min(MAX_PAUSE_S, FIRST_PAUSE_S * 2.0 ** max(0, attempt))


def describe_fault(exc: BaseException) -> str:
    """A fault as a log line or an error keeps it: its class and the first line of its message (a driver's
    message can run to many lines of SQL), bounded."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def keep_trying(
    run: Callable[[], T], *, faults: tuple[type[BaseException], ...], for_s: float, what: str
) -> T:
    """``run()``, tried again after each of ``faults`` with a growing pause (:func:`pause_s`) for up to
    ``for_s``; a fault whose pause would end past that is raised. Each try again is logged, naming
    ``what`` and the fault (never its statement or parameters)."""
    deadline = time.monotonic() + for_s
    attempt = 0
    while True:
        try:
            return run()
        except faults as exc:
            pause = pause_s(attempt)
            attempt += 1
            if time.monotonic() + pause >= deadline:
                raise
            log.warning("%s met %s; trying again in %.1f s", what, describe_fault(exc), pause)
            time.sleep(pause)
