"""Rule 3's lease keeper (``workers/lease.py``): one keeper thread per process renews every claim in flight.

Real Postgres: each renewal is the ledger's guarded UPDATE, and a lease is seen to move by reading
``lease_until``. Leases here are short (renewed every 0.2 s) so a renewal is seen quickly; every wait is
bounded (``support.wait_for``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from ledger.events import EventKind
from ledger.records import Fence, Operation
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.ledger_rows import place
from workers import lease
from workers.lease import keep_lease
from workers.settings import FleetConfig, ServerConfig
from workers.submission import validate_submission

SERVER = ServerConfig(protocol="mcp", protocol_version="2025-11-25", url="http://127.0.0.1:9/mcp")
#: Renewed every 0.2 s.
LEASE_S = 0.6
#: Long enough for a few renewals on a loaded two-core machine.
WAIT_S = 20.0


def claimed(ledger: Ledger, call_node_id: str) -> Operation:
    """A new operation, claimed by its submitter (cursor 1) with a lease of ``LEASE_S``."""
    new = validate_submission(
        {"call_node_id": call_node_id, "server": "reports", "tool": "slow_report", "arguments": {}},
        FleetConfig(servers={"reports": SERVER}),
        max_body_bytes=1024,
    )
    op = ledger.record_submission(new, lease_s=LEASE_S).operation
    assert op.poll_cursor is not None
    assert op.lease_until is not None
    return op


def wait_renewed(ledger: Ledger, op_id: uuid.UUID, times: int = 2) -> None:
    """Until ``lease_until`` has moved forward ``times`` times from what it is now."""
    seen = [ledger.get(op_id).lease_until]

    def moved() -> bool:
        now = ledger.get(op_id).lease_until
        assert now is not None, "the lease was let go"
        if now != seen[-1]:
            last = seen[-1]
            assert last is None or now > last, (last, now)
            seen.append(now)
        return len(seen) > times

    support.wait_for(f"{op_id}'s lease to be renewed {times} times", moved, timeout=WAIT_S, interval=0.02)


def count_thread_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads started from now on (until the test ends)."""
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    return started


def record_renewals(monkeypatch: pytest.MonkeyPatch, ledger: Ledger) -> dict[uuid.UUID, list[bool]]:
    """What each renewal of each operation answered, in order."""
    answers: dict[uuid.UUID, list[bool]] = {}
    renew = ledger.renew_lease

    def recorded(op_id: uuid.UUID, fence: Fence, *, lease_s: float) -> bool:
        answer = renew(op_id, fence, lease_s=lease_s)
        answers.setdefault(op_id, []).append(answer)
        return answer

    monkeypatch.setattr(ledger, "renew_lease", recorded)
    return answers


def test_fifty_steps_in_a_row_start_no_thread_and_a_long_step_is_still_renewed(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unchanged polls one after the other: the keeper is started once, on first use, and never again; a
    step that runs longer than its lease has its lease renewed while it is inside the block."""
    op = claimed(ledger, "n/fifty")
    with keep_lease(ledger, op.id, op.fence, LEASE_S):  # the keeper is started here at the latest
        pass
    started = count_thread_starts(monkeypatch)
    for _ in range(50):
        with keep_lease(ledger, op.id, op.fence, LEASE_S):
            pass
    assert started == []

    with keep_lease(ledger, op.id, op.fence, LEASE_S):
        wait_renewed(ledger, op.id)
    assert started == []


def test_two_claims_in_flight_at_once_are_both_renewed(ledger: Ledger) -> None:
    first, second = claimed(ledger, "n/first"), claimed(ledger, "n/second")
    with (
        keep_lease(ledger, first.id, first.fence, LEASE_S),
        keep_lease(ledger, second.id, second.fence, LEASE_S),
    ):
        wait_renewed(ledger, first.id)
        wait_renewed(ledger, second.id)


def test_a_claim_whose_fence_moved_stops_being_renewed_and_the_others_go_on(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first step's claim is let go and taken over by another worker (a new cursor) while the step is
    still inside its block: its next renewal finds the fence moved, and there is no renewal after that one;
    the new claim's lease is the new claim's; the second step's lease goes on being renewed."""
    answers = record_renewals(monkeypatch, ledger)
    taken, other = claimed(ledger, "n/taken"), claimed(ledger, "n/other")
    with (
        keep_lease(ledger, taken.id, taken.fence, LEASE_S),
        keep_lease(ledger, other.id, other.fence, LEASE_S),
    ):
        wait_renewed(ledger, taken.id, times=1)
        ledger.reschedule(
            taken.id,
            taken.fence,
            state=OpState.SUBMITTING,
            delay_s=0,
            event=EventKind.NO_TOKEN,
            detail={},
        )
        takeover = ledger.claim(taken.id, lease_s=30)
        assert takeover is not None
        assert takeover.poll_cursor == (taken.poll_cursor or 0) + 1
        lease_of_the_takeover = ledger.get(taken.id).lease_until

        support.wait_for(
            "a renewal to find the fence moved", lambda: False in answers[taken.id], timeout=WAIT_S
        )
        renewals_of_taken = len(answers[taken.id])
        renewals_of_other = len(answers[other.id])
        support.wait_for(
            "three more renewals of the other claim",
            lambda: len(answers[other.id]) >= renewals_of_other + 3,
            timeout=WAIT_S,
        )
        assert len(answers[taken.id]) == renewals_of_taken
        assert answers[taken.id][-1] is False
        assert all(answers[other.id])
        assert ledger.get(taken.id).lease_until == lease_of_the_takeover


def test_a_failed_renewal_is_logged_and_tried_again(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    op = claimed(ledger, "n/flaky")
    renew = ledger.renew_lease
    failures = [RuntimeError("the database went away")]

    def flaky(op_id: uuid.UUID, fence: Fence, *, lease_s: float) -> bool:
        if failures:
            raise failures.pop()
        return renew(op_id, fence, lease_s=lease_s)

    monkeypatch.setattr(ledger, "renew_lease", flaky)
    with (
        caplog.at_level(logging.WARNING, logger="longcall.lease"),
        keep_lease(ledger, op.id, op.fence, LEASE_S),
    ):
        wait_renewed(ledger, op.id)
    assert failures == []
    [failed] = [r for r in caplog.records if r.name == "longcall.lease"]
    assert failed.getMessage() == f"renewing the lease of {op.id} failed"
    assert failed.exc_info is not None


def test_a_stuck_renewal_holds_the_step_at_most_its_lease_and_the_keeper_goes_on_after_it(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal that does not come back (a stuck database): the step leaves its block within ``lease_s``
    all the same; once the renewal comes back, the keeper renews the other claims again."""
    stuck, later = claimed(ledger, "n/stuck"), claimed(ledger, "n/later")
    renew = ledger.renew_lease
    entered, release = threading.Event(), threading.Event()

    def stalling(op_id: uuid.UUID, fence: Fence, *, lease_s: float) -> bool:
        if op_id == stuck.id:
            entered.set()
            assert release.wait(WAIT_S), "the test never released the stuck renewal"
        return renew(op_id, fence, lease_s=lease_s)

    monkeypatch.setattr(ledger, "renew_lease", stalling)
    with keep_lease(ledger, stuck.id, stuck.fence, LEASE_S):
        assert entered.wait(WAIT_S)
        left_at = time.monotonic()
    assert time.monotonic() - left_at < LEASE_S + 1.0  # waited for the renewal, then gave up on it

    with keep_lease(ledger, later.id, later.fence, LEASE_S):
        release.set()
        wait_renewed(ledger, later.id)


def test_a_forked_child_starts_its_own_keeper(ledger: Ledger, database_url: str, tmp_path: Path) -> None:
    """Celery prefork forks after the parent may have started its keeper: in the child that thread does not
    run, so the child's first ``keep_lease`` starts a keeper of its own, and the child's lease is renewed."""
    op = claimed(ledger, "n/forked")
    with keep_lease(ledger, op.id, op.fence, LEASE_S):  # the parent's keeper runs
        pass
    assert lease.KEEPER_NAME in [t.name for t in threading.enumerate()]
    failure = tmp_path / "child-failure.txt"

    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        _exit_with(failure, lambda: _renewed_in_a_child(database_url, op))

    deadline = time.monotonic() + WAIT_S + 10
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish in time")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0, failure.read_text() if failure.exists() else done


def _renewed_in_a_child(database_url: str, op: Operation) -> None:
    assert [t.name for t in threading.enumerate()] == [threading.current_thread().name]
    child_ledger = Ledger.from_url(database_url)  # the parent's pooled connections are the parent's
    with keep_lease(child_ledger, op.id, op.fence, LEASE_S):
        wait_renewed(child_ledger, op.id)
    assert lease.KEEPER_NAME in [t.name for t in threading.enumerate()]


def _exit_with(failure: Path, body: Callable[[], None]) -> None:
    code = 1
    try:
        body()
        code = 0
    except BaseException:  # noqa: BLE001 - the child reports anything to the parent, then exits
        failure.write_text(traceback.format_exc())
    finally:
        os._exit(code)


def test_a_renewal_stuck_behind_a_row_lock_gives_up_in_time_and_the_other_claims_are_renewed(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """One keeper renews a process's claims one after another, so a renewal waiting on a lock must not hold
    the others: its statement timeout (a third of the lease) ends it, it is logged and tried again, and the
    other claim's lease keeps moving while the first row stays locked (found in review: unbounded, one
    stuck renewal stopped every renewal of the process)."""
    stuck, other = claimed(ledger, "n/stuck"), claimed(ledger, "n/other")
    holder = ledger.engine.connect()
    holder.begin()
    holder.exec_driver_sql("SELECT id FROM tool_operation WHERE id = %s FOR UPDATE", (stuck.id,))
    try:
        with (
            caplog.at_level(logging.WARNING, logger="longcall.lease"),
            keep_lease(ledger, stuck.id, stuck.fence, LEASE_S),
            keep_lease(ledger, other.id, other.fence, LEASE_S),
        ):
            wait_renewed(ledger, other.id, times=3)
    finally:
        holder.rollback()
        holder.close()
    assert any("statement timeout" in str(r.exc_info[1]) for r in caplog.records if r.exc_info), [
        r.getMessage() for r in caplog.records
    ]


class KeeperKilled(BaseException):
    """What ends the keeper's thread here: not an ``Exception``, which a renewal's own failure is (caught, and
    tried again)."""


def test_a_keeper_that_died_is_replaced_by_the_next_claim(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Were the keeper thread to end (not by a renewal's own error: those are caught), the next claim starts
    another instead of waiting for renewals that never come. The keeper dies for real here: one that only
    looked dead (its thread swapped for an ended one) kept running beside its successor, and two keepers
    renewing one claim at once could move its lease back (seen in a full run: the earlier transaction
    committed last)."""

    def killed(*args: object, **kwargs: object) -> bool:
        raise KeeperKilled

    first = claimed(ledger, "n/first-keeper")
    keeper = lease._keeper
    with caplog.at_level(logging.ERROR, logger="longcall.lease"), monkeypatch.context() as patch:
        patch.setattr(ledger, "renew_lease", killed)
        with keep_lease(ledger, first.id, first.fence, LEASE_S):
            dying = keeper._thread
            assert dying is not None
            dying.join(timeout=WAIT_S)
            assert not dying.is_alive(), "the keeper's first renewal did not end its thread"
    assert "the lease keeper stopped; the next claim starts another" in caplog.messages
    second = claimed(ledger, "n/second-keeper")
    with keep_lease(ledger, second.id, second.fence, LEASE_S):
        assert keeper._thread is not dying
        wait_renewed(ledger, second.id)
    assert [t.name for t in threading.enumerate()].count(lease.KEEPER_NAME) == 1


def test_a_create_in_flight_keeps_its_lease_through_a_cancel_intent_and_a_cancel_that_fences_it_does_not(
    ledger: Ledger,
) -> None:
    """A cancel recorded while a create is in flight (its attempt recorded) bumps the generation and keeps
    the lease on purpose: the create's answer takes the operation on to its cancel. The step's lease is
    still renewed, so that no other step takes the row for an unknown outcome and refuses that answer
    when it comes (a long synchronous call's result was lost so). A cancel that fences the step (of a
    WORKING operation) lets the lease go, and the renewal stops."""
    op = claimed(ledger, "n/create-in-flight")
    attempted = ledger.record_create_attempt(op.id, op.fence, descriptor_version=None, detail={})
    ledger.record_cancel_intent(op.id, attempted.fence, from_state=OpState.SUBMITTING)
    assert ledger.get(op.id).cancel_generation == op.cancel_generation + 1

    assert ledger.renew_lease(op.id, op.fence, lease_s=30) is True
    lease_until = ledger.get(op.id).lease_until
    assert lease_until is not None
    assert (lease_until - ledger.get(op.id).updated_at).total_seconds() > 20

    working = place(ledger, OpState.WORKING)
    claim = ledger.claim(working.id, lease_s=30)
    assert claim is not None
    fence = Fence(working.execution_epoch, working.cancel_generation, claim.poll_cursor)
    ledger.request_cancel(working.id, fence, from_state=OpState.WORKING)
    assert ledger.renew_lease(working.id, fence, lease_s=30) is False


def test_a_step_that_starts_late_in_its_lease_is_renewed_before_the_lease_runs_out(ledger: Ledger) -> None:
    """A step that starts when little of its claim's lease is left (its message queued behind others): the
    first renewal comes within what is left, not a third of a whole lease from the step's start, after the
    lease ran out (before, a step starting 25 s into a 30 s lease had its row claimed again under it)."""
    new = validate_submission(
        {"call_node_id": "n/late-start", "server": "reports", "tool": "slow_report", "arguments": {}},
        FleetConfig(servers={"reports": SERVER}),
        max_body_bytes=1024,
    )
    op = ledger.record_submission(new, lease_s=1.5).operation  # 1.5 s left of a 30 s lease
    found = op.lease_until
    assert found is not None
    with keep_lease(ledger, op.id, op.fence, 30.0, lease_until=found):
        support.wait_for(
            "the lease to be renewed to 30 s",
            lambda: (until := ledger.get(op.id).lease_until) is not None and until > found,
            timeout=1.4,
            interval=0.02,
        )
    renewed = ledger.get(op.id).lease_until
    assert renewed is not None
    assert (renewed - found).total_seconds() > 20
