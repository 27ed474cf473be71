"""Rule 3: the record of the polls that changed nothing, in a worker process (:class:`RecordLater`).

A worker process records what its batches (``workers/poll_batch.py``) handed over with its next batch's
read of its rows, in the same transaction (``Ledger.record_then_read``: one commit where there were two), or
one dispatch tick after the first was handed over when no batch came first. So a busy process adds no commit
of its own for its unchanged polls, and an idle one records them within a tick.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from ledger.records import UnchangedPoll
from workers.members import Stragglers

__all__ = ["RecordLater", "RecordNow", "Recorder", "Records", "Settle", "Taken"]

log = logging.getLogger("longcall")

#: Records unchanged polls (``Ledger.record_unchanged_polls``): the operations whose record was written.
Recorder = Callable[[list[UnchangedPoll]], set[uuid.UUID]]
#: Told how a record went: the operations whose record was written, or the fault that stopped it.
Settle = Callable[[set[uuid.UUID] | Exception], None]


class Records:
    """Where a batch hands over its unchanged polls to be recorded (:meth:`put`); each hand-over is settled
    once, with what was written or the fault."""

    def put(self, polls: list[UnchangedPoll], settle: Settle) -> None:
        raise NotImplementedError


class RecordNow(Records):
    """Records each hand-over at once, in the caller's thread (one statement each)."""

    def __init__(self, record: Recorder) -> None:
        self._record = record

    def put(self, polls: list[UnchangedPoll], settle: Settle) -> None:
        Taken([(polls, settle)]).record(self._record)


class Taken:
    """Hand-overs taken to be recorded together (:attr:`polls`), and settled together."""

    def __init__(self, entries: list[tuple[list[UnchangedPoll], Settle]]) -> None:
        self._entries = entries
        self.polls = [poll for polls, _ in entries for poll in polls]

    def record(self, record: Recorder) -> None:
        """Record them in one call, and settle each hand-over with its outcome."""
        if not self._entries:
            return
        try:
            written = record(self.polls)
        except Exception as exc:  # noqa: BLE001 -- every hand-over is settled, whatever stopped its record
            self.settle(exc)
            return
        self.settle(written)

    def settle(self, result: set[uuid.UUID] | Exception) -> None:
        for _, settle in self._entries:
            try:
                settle(result)
            except Exception:
                log.exception("settling the record of unchanged polls failed")


class RecordLater(Records):
    """A worker process's hand-overs (every batch's, every server's) recorded together: by the next batch's
    read of its rows, in the same transaction (:meth:`take`, then ``Ledger.record_then_read``), or at the
    latest ``bound_s`` after the first one waiting was handed over (:meth:`flush`, on the process's straggler
    thread), in one statement. A hand-over's claims stay held (the row is not claimed again) until it is
    recorded; the claim already set each row's next poll, so that costs no poll its time while the bound is
    within the poll interval."""

    def __init__(self, record: Recorder, *, bound_s: float) -> None:
        self._record = record
        self._bound_s = bound_s
        self._lock = threading.Lock()
        self._waiting: list[tuple[list[UnchangedPoll], Settle]] = []
        self._flush_set = False

    def put(self, polls: list[UnchangedPoll], settle: Settle) -> None:
        with self._lock:
            self._waiting.append((polls, settle))
            set_flush, self._flush_set = not self._flush_set, True
        if set_flush:
            try:
                Stragglers.of_process().at(time.monotonic() + self._bound_s, self.flush)
            except RuntimeError:
                # No timer thread (the process at its limit of threads): what waits goes with the next
                # batch's read, and the next hand-over sets the flush again.
                with self._lock:
                    self._flush_set = False
                log.warning("no timer for the record of unchanged polls", exc_info=True)

    def take(self) -> Taken:
        """What waits to be recorded, taken (to be recorded by the caller, and settled by it)."""
        with self._lock:
            taken, self._waiting = self._waiting, []
        return Taken(taken)

    def flush(self) -> None:
        """Record what waits, now."""
        with self._lock:
            self._flush_set = False
        self.take().record(self._record)
