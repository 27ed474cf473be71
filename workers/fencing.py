"""Rule 13 at the broker: a worker whose fleet does not own the execution epoch stops taking longcall's
messages, and takes them again once it does.

The ledger fences a non-owner already (it claims nothing, every write under a claim is refused, a step it
takes from a shared broker hands its claim back and sends nothing). But a fleet that keeps running beside
the owner on the same broker still takes the owner's messages off the shared queues, and an idle one wins
that race nearly every time: the owner's dispatcher claims a row, publishes its step while its own worker
is busy running the tick, the other fleet's idle worker takes the step and hands it back, and so on every
tick (seen: one operation claimed 500 times in two minutes, never polled). So a worker checks, every
:data:`OWNER_CHECK_S`, whether its fleet owns the epoch; if not, it cancels its consumers of longcall's
queues (``Consumer.cancel_task_queue``: the worker stays up, visible in Flower, and says why), and when
its fleet owns the epoch again (a later ``longcall rollback --owner`` naming it) it consumes them again.

The check runs in a thread of the worker's main process on a connection of its own; the consumer is
changed in the worker's event loop (``Consumer.call_soon`` hands the change over, thread-safely).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from ledger.engine import make_engine
from ledger.records import EpochOwnership
from ledger.repository import Ledger
from workers.faults import describe_fault
from workers.settings import Settings

__all__ = ["OWNER_CHECK_S", "ConsumptionFence"]

log = logging.getLogger("longcall.fencing")

#: How often a worker asks whether its fleet owns the execution epoch.
OWNER_CHECK_S = 5.0
#: How long the check may wait for a connection (a database that is down is asked again later).
CONNECT_TIMEOUT_S = 3


class ConsumptionFence:
    """One worker's fence: stops its consumers of ``queues`` while its fleet does not own the epoch."""

    def __init__(self, consumer: Any, settings: Settings, queues: Iterable[str]) -> None:
        self._consumer = consumer
        self._settings = settings
        self._queues = tuple(queues)
        self._cancelled: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._ledger: Ledger | None = None
        self._thread = threading.Thread(target=self._run, name="epoch fence", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(OWNER_CHECK_S):
            ownership = self._ownership()
            if ownership is None:
                continue
            if not ownership.owns and not self._cancelled:
                self._consumer.call_soon(self._cancel, ownership)
            elif ownership.owns and self._cancelled:
                self._consumer.call_soon(self._resume)

    def _ownership(self) -> EpochOwnership | None:
        """Who owns the epoch now; None when the ledger cannot be read (asked again later)."""
        try:
            if self._ledger is None:
                engine = make_engine(
                    self._settings.database_url, pool_size=1, connect_timeout_s=CONNECT_TIMEOUT_S
                )
                self._ledger = Ledger(engine, executor_id=self._settings.executor_id)
            return self._ledger.epoch_ownership()
        except Exception as exc:  # noqa: BLE001 - the fence never stops a worker; it asks again
            log.debug("could not read the epoch's owner: %s", describe_fault(exc))
            return None

    def _cancel(self, ownership: EpochOwnership) -> None:
        """In the event loop: stop consuming longcall's queues (those this worker consumes)."""
        consuming = [q for q in self._queues if self._consumer.task_consumer.consuming_from(q)]
        for queue in consuming:
            self._consumer.cancel_task_queue(queue)
        self._cancelled = tuple(consuming)
        log.warning(
            "this fleet (executor %s) does not own execution epoch %s (owned by %s): this worker stopped "
            "consuming %s; it resumes if its fleet owns the epoch again (longcall rollback --owner %s); else "
            "stop this fleet",
            self._settings.executor_id,
            ownership.execution_epoch,
            ownership.epoch_owner,
            ", ".join(consuming) or "nothing",
            self._settings.executor_id,
        )

    def _resume(self) -> None:
        """In the event loop: consume again the queues :meth:`_cancel` stopped."""
        for queue in self._cancelled:
            self._consumer.add_task_queue(queue)
        log.warning(
            "this fleet (executor %s) owns the execution epoch again: consuming %s",
            self._settings.executor_id,
            ", ".join(self._cancelled),
        )
        self._cancelled = ()
