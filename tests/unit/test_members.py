"""A batch's members run side by side (``workers/members.py``), each with its own log context, on member
threads of their server's; a batch records its unchanged polls together, a straggler holding up that
record for a bound only (``workers/poll_batch.py``)."""

from __future__ import annotations

import contextvars
import functools
import threading
import time
import uuid

import pytest
from sqlalchemy.exc import OperationalError

from ledger.records import Fence, UnchangedPoll
from workers import logs, members
from workers.members import run_side_by_side
from workers.poll_batch import PollBatch
from workers.records_later import RecordNow
from workers.steps.context import StepAction, StepOutcome


def test_members_run_at_once_each_in_its_own_log_context_answers_in_order() -> None:
    ids = [uuid.uuid4() for _ in range(8)]
    # Every member waits for all the others: only members running at once get past it (bounded: a member
    # run one after another fails the wait instead of hanging).
    together = threading.Barrier(len(ids), timeout=10)

    def member(op_id: uuid.UUID) -> tuple[str | None, str | None]:
        with logs.bind(op_id, f"node-{op_id}"):
            together.wait()
            return logs.current()

    seen = run_side_by_side(member, ids, threads=len(ids))

    assert seen == [(str(op_id), f"node-{op_id}") for op_id in ids]
    assert logs.current() == (None, None)  # the caller's context is untouched


def test_a_single_member_runs_in_the_callers_thread() -> None:
    caller = threading.get_ident()

    assert run_side_by_side(lambda _: threading.get_ident(), [1], threads=4) == [caller]


def test_a_slow_servers_members_fill_its_own_threads_not_anothers() -> None:
    """Each server has its own member threads in the process: a server whose every member blocks leaves
    another server's members free to run at once."""
    release = threading.Event()
    blocked = [members.submit("slow-server", 2, functools.partial(release.wait, 10)) for _ in range(4)]
    fast = members.submit("fast-server", 2, threading.get_ident)
    try:
        assert fast.result(timeout=5) != threading.get_ident()
        assert not any(future.done() for future in blocked)
    finally:
        release.set()
    assert all(future.result(timeout=10) for future in blocked)


def test_a_claim_held_in_the_process_is_refused_to_a_copy_until_let_go() -> None:
    op_id = uuid.uuid4()
    assert members.hold_claim(op_id, 3)
    assert not members.hold_claim(op_id, 3)  # a copy of the same message, while the first is on its way
    assert members.hold_claim(op_id, 4)  # another claim of the same operation is another step
    assert members.in_flight() >= 2
    members.let_go(op_id, 3)
    members.let_go(op_id, 4)
    assert members.hold_claim(op_id, 3)
    members.let_go(op_id, 3)


def _step(op_id: uuid.UUID, *, unchanged: bool = True) -> StepOutcome:
    return StepOutcome(op_id, StepAction.STILL_WORKING, None, unchanged=unchanged)


def test_a_batch_records_its_unchanged_polls_in_one_call_when_the_last_member_is_done() -> None:
    ids = [uuid.uuid4() for _ in range(3)]
    recorded: list[list[uuid.UUID]] = []
    let_go: list[uuid.UUID] = []

    def record(polls: list[UnchangedPoll]) -> set[uuid.UUID]:
        recorded.append([poll.op_id for poll in polls])
        return {poll.op_id for poll in polls if poll.op_id != ids[1]}  # the second one's fence moved

    batch = PollBatch(3, RecordNow(record), bound_s=10.0)
    for index, op_id in enumerate(ids):
        batch.done(index, _step(op_id), Fence(1, 0, index), let_go=functools.partial(let_go.append, op_id))

    steps = batch.wait(timeout_s=5)
    assert recorded == [ids]
    assert [s.action for s in steps] == [StepAction.STILL_WORKING, StepAction.STALE, StepAction.STILL_WORKING]
    assert let_go == ids  # each claim let go once its poll was recorded


def test_a_straggler_holds_up_its_batchs_record_for_the_bound_only() -> None:
    """Two members answered, the third is slow: the two are recorded when the bound passes, the
    straggler alone when it answers, and the batch finishes then."""
    ids = [uuid.uuid4() for _ in range(3)]
    recorded: list[tuple[float, list[uuid.UUID]]] = []
    first_recorded = threading.Event()

    def record(polls: list[UnchangedPoll]) -> set[uuid.UUID]:
        recorded.append((time.monotonic(), [poll.op_id for poll in polls]))
        first_recorded.set()
        return {poll.op_id for poll in polls}

    finished: list[list[StepOutcome]] = []
    batch = PollBatch(3, RecordNow(record), bound_s=0.2, on_finish=finished.append)
    started = time.monotonic()
    batch.done(0, _step(ids[0]), Fence(1, 0, 1))
    batch.done(1, _step(ids[1]), Fence(1, 0, 1))
    assert first_recorded.wait(5)
    assert recorded[0][1] == ids[:2]
    assert 0.15 <= recorded[0][0] - started < 2.0  # at the bound, not at the straggler's answer
    assert not finished
    with pytest.raises(TimeoutError):
        batch.wait(timeout_s=0.05)

    batch.done(2, _step(ids[2]), Fence(1, 0, 1))
    assert [ids for _, ids in recorded] == [ids[:2], ids[2:]]
    assert len(finished) == 1
    assert [s.op_id for s in finished[0]] == ids


def test_a_batch_whose_record_fails_leaves_its_answers_and_lets_its_claims_go() -> None:
    op_id = uuid.uuid4()
    let_go: list[uuid.UUID] = []

    def record(_polls: list[UnchangedPoll]) -> set[uuid.UUID]:
        raise OperationalError("UPDATE", {}, ConnectionError("the ledger went away"))

    batch = PollBatch(1, RecordNow(record), bound_s=1.0)
    batch.done(0, _step(op_id), Fence(1, 0, 1), let_go=functools.partial(let_go.append, op_id))
    [step] = batch.wait(timeout_s=5)
    assert step.action is StepAction.STILL_WORKING  # due again when its lease runs out
    assert let_go == [op_id]


def test_a_process_starts_no_more_members_than_its_room_and_frees_it_as_they_end() -> None:
    """Past its room a process sheds polls instead of queueing them past their leases (the soak at 10,000
    in flight queued hundreds of members a process, load 34, 5.7 ms of CPU a poll, each one polled late)."""
    server, other = f"room-{uuid.uuid4()}", f"room-{uuid.uuid4()}"
    assert members.admit(server, 10, per_server=4, per_process=1000) == 4
    assert members.admit(server, 3, per_server=4, per_process=1000) == 0  # its room is full
    assert members.admit(other, 3, per_server=4, per_process=1000) == 3  # another server's is not
    members.leave(server)
    assert members.admit(server, 3, per_server=4, per_process=1000) == 1
    for _ in range(4):
        members.leave(server)
    for _ in range(3):
        members.leave(other)
    assert members.admit(server, 5, per_server=4, per_process=0) == 0  # the process's room is full
    assert members.say_shed(server)
    assert not members.say_shed(server)  # said once per ten seconds


def _server() -> str:
    return f"threads-{uuid.uuid4()}"


def test_members_answered_at_once_run_on_one_thread_not_one_each() -> None:
    """A server whose members answer at once is served by the fewest threads that keep up: a thread each
    would cost every member its hand-offs of the interpreter lock (issue 21)."""
    server = _server()
    futures = [members.submit(server, 64, threading.get_ident) for _ in range(64)]
    used = {future.result(timeout=10) for future in futures}
    assert len(used) <= 2
    assert members._process.pools[server].threads() <= 2


def test_members_that_wait_for_their_answers_get_threads_of_their_own() -> None:
    """Members whose answers take long (each waits for all the others here) have one more thread started
    while the first waiting one is past its time, up to the server's size: all of them run at once."""
    server = _server()
    together = threading.Barrier(8, timeout=10)
    started = time.monotonic()
    futures = [members.submit(server, 8, together.wait) for _ in range(8)]
    assert sorted(future.result(timeout=15) for future in futures) == list(range(8))
    assert time.monotonic() - started < 5.0  # grown a thread per GROW_EVERY_S, past GROW_AFTER_S
    assert members._process.pools[server].threads() == 8


def test_a_member_starts_at_its_time_and_an_earlier_one_is_not_held_behind_a_later_one() -> None:
    server = _server()
    now = time.monotonic()
    later = members.submit(server, 4, time.monotonic, not_before=now + 0.4)
    sooner = members.submit(server, 4, time.monotonic, not_before=now + 0.1)
    assert sooner.result(timeout=5) >= now + 0.1
    assert later.result(timeout=5) >= now + 0.4
    assert sooner.result() < later.result()
    assert members._process.pools[server].threads() == 1  # the member waiting for its time held no thread


def test_a_member_thread_not_needed_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(members, "IDLE_EXIT_S", 0.1)
    server = _server()
    assert members.submit(server, 4, threading.get_ident).result(timeout=5)
    threads = members._process.pools[server]
    deadline = time.monotonic() + 5
    while threads.threads():
        assert time.monotonic() < deadline, "an idle member thread never ended"
        time.sleep(0.02)
    assert members.submit(server, 4, lambda: 7).result(timeout=5) == 7  # and a new one comes when needed


def test_a_members_exception_is_its_futures() -> None:
    def fails() -> None:
        raise ValueError("the member's own")

    future = members.submit(_server(), 2, fails)
    with pytest.raises(ValueError, match="the member's own"):
        future.result(timeout=5)


_SEEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("test_members_seen", default=None)


def test_nothing_a_member_sets_in_its_context_is_left_for_the_next_one_on_its_thread() -> None:
    """A charged budget's label or a log context a member leaves behind (a charge its request never
    followed) is not the next member's: each runs in a context of its own."""
    server = _server()

    def leaves() -> int:
        _SEEN.set("the first member's")
        return threading.get_ident()

    def reads() -> tuple[int, str | None]:
        return threading.get_ident(), _SEEN.get()

    first = members.submit(server, 4, leaves).result(timeout=5)
    thread, seen = members.submit(server, 4, reads).result(timeout=5)
    assert thread == first  # the same thread ran both
    assert seen is None


def test_the_threads_grow_while_the_batches_timer_is_held_up() -> None:
    """The looks at whether a server's threads keep up run on a timer of their own: a batch's record held up
    by a slow ledger (on the batches' timer) holds up no server's growth."""
    release = threading.Event()

    def held_up() -> None:
        release.wait(20)

    members.Stragglers.of_process().at(time.monotonic(), held_up)
    try:
        together = threading.Barrier(4, timeout=10)
        futures = [members.submit(_server_for_growth, 4, together.wait) for _ in range(4)]
        assert sorted(future.result(timeout=15) for future in futures) == list(range(4))
    finally:
        release.set()


_server_for_growth = f"threads-{uuid.uuid4()}"


def test_a_timer_whose_thread_could_not_start_starts_it_at_its_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process at its limit of threads: a timer's first call cannot start the timer's thread, and says
    so (nothing registered). Its next call, once a thread can be started, starts it and is called. Before,
    the thread was taken for started: the timer never ran anything again in the process (no batch's bound,
    no growth of the member threads)."""
    timer = members.Stragglers()
    real = threading.Thread

    class Refused(real):  # type: ignore[misc,valid-type]
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patch:
        patch.setattr(threading, "Thread", Refused)
        with pytest.raises(RuntimeError):
            timer.at(time.monotonic(), lambda: None)
    called = threading.Event()
    timer.at(time.monotonic(), called.set)
    assert called.wait(timeout=5), "the timer's thread was never started again"
