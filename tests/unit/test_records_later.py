"""A worker process records its batches' unchanged polls with its next batch's read, or within a bound when
no batch comes (``workers/records_later.py``); a batch finishes only once its unchanged polls are recorded
(``workers/poll_batch.py``)."""

from __future__ import annotations

import functools
import threading
import time
import uuid

import pytest
from sqlalchemy.exc import OperationalError

from ledger.records import Fence, UnchangedPoll
from workers.members import Stragglers
from workers.poll_batch import PollBatch
from workers.records_later import RecordLater
from workers.steps.context import StepAction, StepOutcome


def _step(op_id: uuid.UUID) -> StepOutcome:
    return StepOutcome(op_id, StepAction.STILL_WORKING, None, unchanged=True)


class _Recorder:
    """A ``Ledger.record_unchanged_polls`` stand-in: the calls it took, and when."""

    def __init__(self, *, refuse: set[uuid.UUID] | None = None) -> None:
        self.calls: list[tuple[float, list[uuid.UUID]]] = []
        self.called = threading.Event()
        self._refuse = refuse or set()

    def __call__(self, polls: list[UnchangedPoll]) -> set[uuid.UUID]:
        self.calls.append((time.monotonic(), [poll.op_id for poll in polls]))
        self.called.set()
        return {poll.op_id for poll in polls} - self._refuse


def test_two_batches_unchanged_polls_wait_for_the_next_read_and_finish_with_it() -> None:
    recorder = _Recorder()
    later = RecordLater(recorder, bound_s=30.0)
    first, second = [uuid.uuid4(), uuid.uuid4()], [uuid.uuid4()]
    let_go: list[uuid.UUID] = []
    finished: list[list[StepOutcome]] = []
    batches = [PollBatch(len(ids), later, bound_s=30.0, on_finish=finished.append) for ids in (first, second)]
    for batch, ids in zip(batches, (first, second), strict=True):
        for index, op_id in enumerate(ids):
            batch.done(index, _step(op_id), Fence(1, 0, 7), let_go=functools.partial(let_go.append, op_id))

    # Every member answered, nothing recorded yet: the batches are not finished, their claims still held.
    assert not finished
    assert let_go == []
    taken = later.take()
    assert [poll.op_id for poll in taken.polls] == first + second  # one record for both batches
    assert later.take().polls == []  # taken once
    taken.settle({first[0], second[0]})  # first[1]'s fence moved meanwhile

    assert [[s.action for s in steps] for steps in finished] == [
        [StepAction.STILL_WORKING, StepAction.STALE],
        [StepAction.STILL_WORKING],
    ]
    assert sorted(let_go) == sorted(first + second)
    assert recorder.calls == []  # the read recorded them, not the recorder


def test_unchanged_polls_no_read_takes_are_recorded_at_the_bound_in_one_call() -> None:
    recorder = _Recorder()
    later = RecordLater(recorder, bound_s=0.3)
    ids = [uuid.uuid4() for _ in range(3)]
    started = time.monotonic()
    batches = [PollBatch(1, later, bound_s=30.0) for _ in ids]
    for batch, op_id in zip(batches, ids, strict=True):
        batch.done(0, _step(op_id), Fence(1, 0, 1))

    assert recorder.called.wait(5)
    [(at, recorded)] = recorder.calls
    assert recorded == ids
    assert 0.25 <= at - started < 3.0  # at the bound after the first hand-over, not before
    for batch in batches:
        assert [s.action for s in batch.wait(timeout_s=5)] == [StepAction.STILL_WORKING]


def test_a_record_that_meets_a_fault_finishes_its_batches_and_lets_their_claims_go() -> None:
    later = RecordLater(_Recorder(), bound_s=30.0)
    op_id = uuid.uuid4()
    let_go: list[uuid.UUID] = []
    batch = PollBatch(1, later, bound_s=30.0)
    batch.done(0, _step(op_id), Fence(1, 0, 1), let_go=lambda: let_go.append(op_id))

    later.take().settle(OperationalError("UPDATE", {}, ConnectionError("the ledger went away")))
    [step] = batch.wait(timeout_s=5)
    assert step.action is StepAction.STILL_WORKING  # due again when its lease runs out
    assert let_go == [op_id]


class _NoTimer:
    def at(self, when: float, finish: object) -> None:
        raise RuntimeError("can't start new thread")


def test_a_hand_over_whose_flush_could_not_be_set_has_it_set_by_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process's timer cannot start its thread at the first hand-over: the flush is not set (what waits
    goes with a batch's read), and the next hand-over sets it, so both are recorded at the bound. Before, the
    flush was taken for set: with no batch's read to come, nothing waiting was ever recorded."""
    recorder = _Recorder()
    later = RecordLater(recorder, bound_s=0.05)
    first, second = uuid.uuid4(), uuid.uuid4()
    with monkeypatch.context() as patch:
        patch.setattr(Stragglers, "of_process", _NoTimer)
        later.put([UnchangedPoll(first, Fence(1, 0, 7))], lambda _result: None)
    later.put([UnchangedPoll(second, Fence(1, 0, 7))], lambda _result: None)
    assert recorder.called.wait(timeout=5), "nothing was recorded"
    assert recorder.calls[0][1] == [first, second]


def test_an_unchanged_polls_next_poll_is_due_its_interval_from_its_answer_not_from_its_record() -> None:
    """The record of an unchanged poll may come ticks after its answer: the due it carries is the answer's
    time plus the interval (``StepOutcome.next_poll_due``, set by the poll step at its read, carried into
    ``UnchangedPoll.next_poll_due``), not the record's."""
    later = RecordLater(_Recorder(), bound_s=10.0)
    batch = PollBatch(2, later, bound_s=10.0)
    op_id = uuid.uuid4()
    answered = time.monotonic()
    step = StepOutcome(op_id, StepAction.STILL_WORKING, None, unchanged=True, next_poll_due=answered + 2.0)
    batch.done(0, step, Fence(1, 0, 1))
    batch.done(1, _step(uuid.uuid4()), Fence(1, 0, 1))  # the last: handed over
    time.sleep(0.3)  # the process's record comes later

    first, second = later.take().polls
    assert first.op_id == op_id
    assert first.next_poll_due is not None
    assert answered + 2.0 <= first.next_poll_due <= answered + 2.25
    assert second.next_poll_due is None  # no interval given: the claim's next poll is kept
