"""Rule 3: one batched ``longcall.poll`` on its way in a worker process (:class:`PollBatch`), and the record
of the polls that changed nothing (``workers.records_later``).

A batch's members run on their server's member threads (``workers/members.py``) and answer one by one; the
polls that changed nothing are handed over together (one ``Ledger.record_unchanged_polls`` statement for
them) when the last member is done, or :data:`STRAGGLER_BOUND_TICKS` dispatch ticks after the first
unchanged one was, whichever comes first: a slow member holds up the others' record (and so their claims,
which the record lets go) for that long only, and is handed over alone when it is done.

A worker process records what its batches handed over with its next batch's read of its rows
(``workers.records_later.RecordLater``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable

from ledger.records import Fence, UnchangedPoll
from workers.faults import INFRASTRUCTURE, describe_fault
from workers.members import Stragglers
from workers.records_later import Records
from workers.steps.context import StepAction, StepOutcome

__all__ = ["STRAGGLER_BOUND_TICKS", "PollBatch", "Unchanged"]

log = logging.getLogger("longcall")

#: How many dispatch ticks after a batch's first unchanged poll its unchanged polls are handed over at the
#: latest, whether or not every member is done (a second at the default tick: the members of one batch
#: answer within a few milliseconds of each other on a quiet machine, within some hundreds on a loaded one;
#: a member slower than that is a straggler, and is handed over alone).
STRAGGLER_BOUND_TICKS = 4.0

#: An unchanged poll to record: the member's place in the batch, what its record writes, and what lets its
#: claim go in this process once it is recorded.
Unchanged = tuple[int, UnchangedPoll, Callable[[], None] | None]


class PollBatch:
    """The members of one message, answered as they come (:meth:`done`: ``on_step`` is called with each);
    :meth:`wait` gives their answers in the members' order once every one is done and recorded, and
    ``on_finish`` is called with them then."""

    def __init__(
        self,
        size: int,
        records: Records,
        *,
        bound_s: float,
        on_step: Callable[[StepOutcome], None] | None = None,
        on_finish: Callable[[list[StepOutcome]], None] | None = None,
    ) -> None:
        self._records = records
        self._on_finish = on_finish
        self._bound_s = bound_s
        self._on_step = on_step
        self._lock = threading.Lock()
        self._outcomes: list[StepOutcome | None] = [None] * size
        self._left = size
        self._unrecorded: list[Unchanged] = []
        self._unsettled = 0  # hand-overs not recorded yet
        self._bound_set = False
        self._finishing = False
        self._finished = threading.Event()
        if size == 0:
            self._finish_if_done()

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
                self._unrecorded.append((index, UnchangedPoll(step.op_id, fence, step.next_poll_due), let_go))
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
            self._finish_if_done()
        elif set_bound:
            Stragglers.of_process().at(time.monotonic() + self._bound_s, self._flush)

    def wait(self, timeout_s: float | None = None) -> list[StepOutcome]:
        """Every member's answer, in order, once all are done (``TimeoutError`` past ``timeout_s``)."""
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"a batch of {len(self._outcomes)} polls was not done in {timeout_s} s")
        with self._lock:
            return [step for step in self._outcomes if step is not None]

    def _flush(self) -> None:
        """Hand over the unchanged polls answered so far to be recorded together; once recorded, a member
        whose fence moved meanwhile is answered STALE. Through a fault, they stay claimed until their leases
        run out, and are due when their claims said."""
        with self._lock:
            taken, self._unrecorded = self._unrecorded, []
            self._bound_set = False
            if not taken:
                return
            self._unsettled += 1
        polls = [poll for _, poll, _ in taken]
        self._records.put(polls, functools.partial(self._settle, taken))

    def _settle(self, taken: list[Unchanged], result: set[uuid.UUID] | Exception) -> None:
        try:
            if isinstance(result, INFRASTRUCTURE):
                log.warning(
                    "recording %d unchanged polls met %s; they are due again when their leases run out",
                    len(taken),
                    describe_fault(result),
                )
            elif isinstance(result, Exception):
                log.error("recording %d unchanged polls failed", len(taken), exc_info=result)
            else:
                with self._lock:
                    for index, poll, _ in taken:
                        if poll.op_id not in result:
                            self._outcomes[index] = StepOutcome(
                                poll.op_id, StepAction.STALE, None, detail={"unchanged": "not recorded"}
                            )
        finally:
            # Whatever the record met, the claims are this process's no more (a copy may run them).
            for _, _, let_go in taken:
                if let_go is not None:
                    let_go()
            with self._lock:
                self._unsettled -= 1
            self._finish_if_done()

    def _finish_if_done(self) -> None:
        """Finish once every member is done and every hand-over recorded (once)."""
        with self._lock:
            if self._left or self._unsettled or self._finishing:
                return
            self._finishing = True
        self._finished.set()
        if self._on_finish is not None:
            try:
                self._on_finish(self.wait(0))
            except Exception:
                log.exception("what follows a batch of %d polls failed", len(self._outcomes))
