"""Rule 3: one batched ``longcall.poll`` on its way in a worker process (:class:`PollBatch`).

Its members run on their server's member threads (``workers/members.py``) and answer one by one; the polls
that changed nothing are recorded together (``Ledger.record_unchanged_polls``, one statement), when the last
member is done or :data:`STRAGGLER_BOUND_TICKS` dispatch ticks after the first unchanged one was, whichever
comes first: a slow member holds up the others' record (and so their claims, which the record lets go) for
that long only, and writes its own when it is done.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from ledger.records import Fence
from workers.faults import INFRASTRUCTURE, describe_fault
from workers.members import Stragglers
from workers.steps.context import StepAction, StepOutcome

__all__ = ["STRAGGLER_BOUND_TICKS", "PollBatch", "Unchanged"]

log = logging.getLogger("longcall")

#: How many dispatch ticks after a batch's first unchanged poll its unchanged polls are recorded at the
#: latest, whether or not every member is done (a second at the default tick: the members of one batch
#: answer within a few milliseconds of each other on a quiet machine, within some hundreds on a loaded one;
#: a member slower than that is a straggler, and records its poll alone).
STRAGGLER_BOUND_TICKS = 4.0

#: An unchanged poll to record: the member's place in the batch, its operation, its claim's fence, and what
#: lets its claim go in this process once it is recorded.
Unchanged = tuple[int, uuid.UUID, Fence, Callable[[], None] | None]
#: Records unchanged polls (``Ledger.record_unchanged_polls``): the operations whose record was written.
Recorder = Callable[[list[tuple[uuid.UUID, Fence]]], set[uuid.UUID]]


class PollBatch:
    """The members of one message, answered as they come (:meth:`done`: ``on_step`` is called with each);
    :meth:`wait` gives their answers in the members' order once every one is done and recorded, and
    ``on_finish`` is called with them then."""

    def __init__(
        self,
        size: int,
        record: Recorder,
        *,
        bound_s: float,
        on_step: Callable[[StepOutcome], None] | None = None,
        on_finish: Callable[[list[StepOutcome]], None] | None = None,
    ) -> None:
        self._record = record
        self._on_finish = on_finish
        self._bound_s = bound_s
        self._on_step = on_step
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._outcomes: list[StepOutcome | None] = [None] * size
        self._left = size
        self._unrecorded: list[Unchanged] = []
        self._bound_set = False
        self._finished = threading.Event()
        if size == 0:
            self._finished.set()
            if on_finish is not None:
                on_finish([])

    def done(
        self,
        index: int,
        step: StepOutcome,
        fence: Fence | None = None,
        *,
        let_go: Callable[[], None] | None = None,
    ) -> None:
        """Member ``index`` answered ``step``; an unchanged poll (``step.unchanged``) under ``fence`` waits
        for its record with the batch's. ``let_go``: called once the member's step is recorded (its claim
        held in this process until then: ``workers.members.hold_claim``)."""
        set_bound = False
        with self._lock:
            self._outcomes[index] = step
            self._left -= 1
            last = self._left == 0
            if step.unchanged and fence is not None:
                self._unrecorded.append((index, step.op_id, fence, let_go))
                if not last and not self._bound_set:
                    self._bound_set = set_bound = True
            elif let_go is not None:
                let_go()
        if self._on_step is not None:
            try:
                self._on_step(step)
            except Exception:
                log.exception("what follows the poll of %s failed", step.op_id)
        if last:
            self._flush()
            self._finished.set()
            if self._on_finish is not None:
                try:
                    self._on_finish(self.wait(0))
                except Exception:
                    log.exception("what follows a batch of %d polls failed", len(self._outcomes))
        elif set_bound:
            Stragglers.of_process().at(time.monotonic() + self._bound_s, self._flush)

    def wait(self, timeout_s: float | None = None) -> list[StepOutcome]:
        """Every member's answer, in order, once all are done (``TimeoutError`` past ``timeout_s``)."""
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"a batch of {len(self._outcomes)} polls was not done in {timeout_s} s")
        with self._lock:
            return [step for step in self._outcomes if step is not None]

    def _flush(self) -> None:
        """Record the unchanged polls answered so far, in one statement; a member whose fence moved meanwhile
        is answered STALE. Through a fault, they stay claimed until their leases run out, and are due when
        their claims said."""
        with self._flush_lock:
            with self._lock:
                taken, self._unrecorded = self._unrecorded, []
                self._bound_set = False
            if not taken:
                return
            try:
                self._record_taken(taken)
            finally:
                # Whatever the record met, the claims are this process's no more (a copy may run them).
                for *_, let_go in taken:
                    if let_go is not None:
                        let_go()

    def _record_taken(self, taken: list[Unchanged]) -> None:
        try:
            written = self._record([(op_id, fence) for _, op_id, fence, _ in taken])
        except INFRASTRUCTURE as exc:
            log.warning(
                "recording %d unchanged polls met %s; they are due again when their leases run out",
                len(taken),
                describe_fault(exc),
            )
            return
        with self._lock:
            for index, op_id, _, _ in taken:
                if op_id not in written:
                    self._outcomes[index] = StepOutcome(
                        op_id, StepAction.STALE, None, detail={"unchanged": "not recorded"}
                    )
