"""An unchanged poll writes (nearly) nothing (issue 21): a batch reads its members' rows in one statement,
the dispatcher's claim sets each WORKING row's next poll as the poll step would, and the polls that changed
nothing are recorded in one statement for the batch (``Ledger.record_unchanged_polls``).

Real Postgres and Redis, longcall's MCP server (its tasks poll every 2 s: a batch's members answer well
before their next poll, which the claim set, even on a loaded machine) and an in-process executor; the
ledger's statements are counted on its engine.
"""

from __future__ import annotations

import collections
import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg.errors
import pytest
import redis
import sqlalchemy.exc
from sqlalchemy import event, text

from ledger.events import EventKind
from ledger.records import POLL_JITTER_MAX_S, POLL_JITTER_SHARE, Fence, Operation, UnchangedPoll
from ledger.states import OpState
from tests import support
from tests.support.fleet import McpServer, fleet_config, in_process_runtime, start_mcp_server
from workers import logs, members
from workers.budget import rate_key
from workers.executor import Dispatch, Executor, PollMember
from workers.poll_batch import PollBatch
from workers.runtime import Runtime
from workers.steps.context import StepAction, StepOutcome
from workers.submission import validate_submission


@pytest.fixture
def mcp_executor(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, Executor]]:
    """As ``tests/integration/conftest.py``'s, with tasks that poll every 2 s: a batch's members answer
    well before the next poll their claims set (a record moves it to the interval after the read where that
    is later: its own tests below)."""
    mcp = start_mcp_server(log_dir, poll_interval_ms=2000)
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(database_url, broker_prefix, config, lease_s=30)
    try:
        yield mcp, Executor(runtime)
    finally:
        runtime.close()
        mcp.process.stop()


def _submit(executor: Executor, count: int) -> list[uuid.UUID]:
    ids = []
    for _ in range(count):
        new = validate_submission(
            {
                "call_node_id": f"node-{uuid.uuid4()}",
                "server": "reports",
                "tool": "slow_report",
                "arguments": {"seconds": 3600},
            },
            executor.rt.fleet,
            max_body_bytes=executor.rt.settings.max_body_bytes,
        )
        submission, _ = executor.submit(new)
        assert submission.operation.id is not None
        ids.append(submission.operation.id)
    for op_id in ids:
        assert executor.ledger.get(op_id).state is OpState.WORKING
    return ids


def _due_now(executor: Executor, ids: list[uuid.UUID], **columns: Any) -> None:
    """Make the rows due now (and set ``columns``), as a test's shortcut past their poll interval."""
    sets = ", ".join(["next_poll_at = now()", *(f"{name} = :{name}" for name in columns)])
    with executor.ledger.engine.begin() as conn:
        conn.execute(text(f"UPDATE tool_operation SET {sets} WHERE id = ANY(:ids)"), {"ids": ids, **columns})


def _claim(executor: Executor, count: int) -> list[Dispatch]:
    claimed: list[Dispatch] = []

    def all_claimed() -> bool:
        claimed.extend(executor.dispatch_due())
        return len(claimed) >= count

    support.wait_for(f"{count} claims", all_claimed, timeout=10)
    return claimed


@contextmanager
def _statements(executor: Executor) -> Iterator[list[str]]:
    """The SQL statements the executor's ledger sends inside the block."""
    sent: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    event.listen(executor.ledger.engine, "before_cursor_execute", seen)
    try:
        yield sent
    finally:
        event.remove(executor.ledger.engine, "before_cursor_execute", seen)


def _batch_on(runtime: Runtime, claims: list[Dispatch]) -> tuple[list[StepOutcome], list[str]]:
    """The batch of ``claims`` run to its end by an executor on ``runtime`` (closed after), and the statements
    its ledger sent."""
    executor = Executor(runtime)
    try:
        with _statements(executor) as sent:
            steps = executor.advance_batch([PollMember(d.op_id, d.cursor) for d in claims])
    finally:
        runtime.close()
    return steps, sent


def _writes(sent: list[str]) -> list[str]:
    """The statements that write (not a read, not a setting of the transaction's, such as a lock wait)."""
    return [s for s in sent if not s.lstrip().upper().startswith(("SELECT", "SET LOCAL"))]


def test_a_batch_of_unchanged_polls_reads_once_and_writes_once(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    mcp, executor = mcp_executor
    ids = _submit(executor, 6)
    before = {op_id: executor.ledger.get(op_id) for op_id in ids}
    _due_now(executor, ids)
    claims = _claim(executor, 6)
    members = [PollMember(d.op_id, d.cursor) for d in claims]
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")

    with _statements(executor) as sent:
        steps = executor.advance_batch(members)

    assert [s.action for s in steps] == [StepAction.STILL_WORKING] * 6
    # the batch's read of its rows, and its one write (after its lock wait's setting)
    assert [s.split(" ", 1)[0] for s in sent] == ["SELECT", "SET", "UPDATE"], [s[:60] for s in sent]
    assert len(_writes(sent)) == 1
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before + 6
    for claim in claims:
        op = executor.ledger.get(claim.op_id)
        assert op.unchanged_polls == before[claim.op_id].unchanged_polls + 1
        assert op.event_seq == before[claim.op_id].event_seq  # no event
        assert op.lease_until is None  # the claim let go: a copy of the message does nothing
        assert op.last_polled_at is not None
        assert op.next_poll_at is not None
        assert op.next_poll_at > dt.datetime.now(dt.UTC)  # as the claim set it

    # The same batch again (a redelivered message): its members find their claims done, nothing is sent.
    with _statements(executor) as again:
        repeated = executor.advance_batch(members)
    assert [s.action for s in repeated] == [StepAction.NOTHING_TO_DO] * 6
    assert _writes(again) == []
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before + 6


def test_a_member_that_ran_past_the_next_poll_its_claim_set_is_recorded_with_its_batch(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """A process behind its polls runs members after the next poll their claims set. Such a member's
    unchanged poll is recorded in its batch's one statement, its next poll an interval (2 s, this server's)
    from its record, not written alone: a poll written alone costs a statement of its own, the process falls
    further behind, and more members run late (a process once behind stayed there, at twice the CPU a poll).
    """
    mcp, executor = mcp_executor
    ids = _submit(executor, 3)
    _due_now(executor, ids)
    claims = _claim(executor, 3)
    late, capped = claims[0].op_id, claims[1].op_id
    with executor.ledger.engine.begin() as conn:  # as if their members ran a while after their claims
        conn.execute(
            text("UPDATE tool_operation SET next_poll_at = now() - interval '1 second' WHERE id = ANY(:ids)"),
            {"ids": [late, capped]},
        )
        conn.execute(  # a wait deadline ahead, sooner than the interval: the record never sets a poll past it
            text("UPDATE tool_operation SET wait_deadline = now() + interval '1.9 seconds' WHERE id = :id"),
            {"id": capped},
        )
    before = {c.op_id: executor.ledger.get(c.op_id) for c in claims}
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")
    started = dt.datetime.now(dt.UTC)

    with _statements(executor) as sent:
        steps = executor.advance_batch([PollMember(c.op_id, c.cursor) for c in claims])

    assert [s.action for s in steps] == [StepAction.STILL_WORKING] * 3
    assert len(_writes(sent)) == 1, [s[:60] for s in _writes(sent)]
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before + 3
    for claim in claims:
        op = executor.ledger.get(claim.op_id)
        assert op.unchanged_polls == before[claim.op_id].unchanged_polls + 1
        assert op.event_seq == before[claim.op_id].event_seq  # no event
        assert op.lease_until is None
        if claim.op_id not in {late, capped}:
            # The claim's, or the interval after the read where that is later: never sooner than the claim's.
            claimed = before[claim.op_id].next_poll_at
            assert op.next_poll_at is not None
            assert claimed is not None
            assert op.next_poll_at >= claimed
    assert executor.ledger.get(capped).next_poll_at == before[capped].wait_deadline
    due = executor.ledger.get(late).next_poll_at
    assert due is not None
    # Never sooner than the server's interval after the poll (rule 3), nor a round later than that.
    assert started + dt.timedelta(seconds=2) <= due, due - started
    assert due <= dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2 * (1 + POLL_JITTER_SHARE)), due - started


def test_a_member_whose_claim_would_run_out_before_its_batchs_record_is_recorded_at_once(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """A batch's record of its unchanged polls may wait a few ticks (its stragglers, the process's next
    read) and a lock. A member whose lease has less than that left is recorded alone at once: else its lease
    could run out first, and its row, due, be claimed and polled again before the server's interval."""
    _mcp, executor = mcp_executor
    ids = _submit(executor, 3)
    _due_now(executor, ids)
    claims = _claim(executor, 3)
    short = claims[0].op_id
    with executor.ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET lease_until = now() + interval '3 seconds' WHERE id = :id"),
            {"id": short},
        )
    before = {c.op_id: executor.ledger.get(c.op_id) for c in claims}

    with _statements(executor) as sent:
        steps = executor.advance_batch([PollMember(c.op_id, c.cursor) for c in claims])

    assert [s.action for s in steps] == [StepAction.STILL_WORKING] * 3
    # The short one's record alone, then the batch's for the other two (a renewal of the short lease, by
    # the step's lease keeper on a slow machine, is not a record).
    records = [s for s in _writes(sent) if "unchanged_polls" in s]
    assert len(records) == 2, [s[:60] for s in _writes(sent)]
    for claim in claims:
        op = executor.ledger.get(claim.op_id)
        assert op.unchanged_polls == before[claim.op_id].unchanged_polls + 1
        assert op.lease_until is None
        assert op.event_seq == before[claim.op_id].event_seq


def test_a_record_sets_the_next_poll_no_sooner_than_the_interval_after_the_read(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """``Ledger.record_unchanged_polls`` sets the next poll at the later of the one the claim set and the
    read's time plus the interval (``UnchangedPoll.next_poll_due``), however long the record waited: a claim
    whose next poll has passed (the member ran late) or comes sooner (it ran a while after its claim) is
    moved to the interval after the read; a later one is kept; without a due, the claim's is kept."""
    _mcp, executor = mcp_executor
    ids = _submit(executor, 4)
    _due_now(executor, ids)
    claims = _claim(executor, 4)
    later, sooner, passed, no_due = (c.op_id for c in claims)
    set_due = (
        "UPDATE tool_operation SET next_poll_at = now() + CAST(:offset AS interval) WHERE id = ANY(:ids)"
    )
    with executor.ledger.engine.begin() as conn:
        conn.execute(text(set_due), {"offset": "10 seconds", "ids": [later]})
        conn.execute(text(set_due), {"offset": "0.5 seconds", "ids": [sooner]})
        conn.execute(text(set_due), {"offset": "-1 second", "ids": [passed, no_due]})
    snapshots = {c.op_id: executor.ledger.get(c.op_id) for c in claims}
    fences = {
        c.op_id: Fence(snapshots[c.op_id].execution_epoch, snapshots[c.op_id].cancel_generation, c.cursor)
        for c in claims
    }
    read = dt.datetime.now(dt.UTC)
    due = time.monotonic() + 2.0  # the read's time plus a 2 s interval
    time.sleep(0.3)  # the record waits

    written = executor.ledger.record_unchanged_polls(
        [UnchangedPoll(op_id, fences[op_id], None if op_id == no_due else due) for op_id in fences]
    )

    assert written == set(fences)
    assert executor.ledger.get(later).next_poll_at == snapshots[later].next_poll_at
    assert executor.ledger.get(no_due).next_poll_at == snapshots[no_due].next_poll_at
    for op_id in (sooner, passed):
        next_poll = executor.ledger.get(op_id).next_poll_at
        assert next_poll is not None
        # Two seconds from the read, not from the record later (clocks' skew, a loaded machine allowed).
        assert read + dt.timedelta(seconds=1.95) <= next_poll <= read + dt.timedelta(seconds=2.5), (
            op_id == sooner,
            next_poll - read,
        )


@pytest.fixture
def slow_tick(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, Executor]]:
    """An executor whose dispatch tick is 20 s: a batch's unchanged polls wait for the next batch's read
    (or 20 s) while the test looks; tasks that poll every 30 s. Its lease outlasts the longest a batch's
    record may wait (``Executor._record_may_wait``: five ticks and the lock wait), else each member would be
    recorded alone at once."""
    mcp = start_mcp_server(log_dir, poll_interval_ms=30_000)
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(database_url, broker_prefix, config, lease_s=150, dispatch_interval_s=20)
    try:
        yield mcp, Executor(runtime)
    finally:
        runtime.close()
        mcp.process.stop()


def _answered_unrecorded(executor: Executor, ids: list[uuid.UUID]) -> tuple[list[PollMember], PollBatch]:
    """A batch of ``ids`` started, every member answered (unchanged), none recorded yet."""
    _due_now(executor, ids)
    members = [PollMember(d.op_id, d.cursor) for d in _claim(executor, len(ids))]
    answered = threading.Semaphore(0)
    batch = executor.start_batch(members, on_step=lambda _step: answered.release())
    for _ in members:
        assert answered.acquire(timeout=10)
    with pytest.raises(TimeoutError):
        batch.wait(timeout_s=0.3)  # answered, not recorded yet
    return members, batch


def test_a_copy_of_a_batch_whose_claims_this_process_holds_reads_nothing_and_hands_nothing_back(
    slow_tick: tuple[McpServer, Executor],
) -> None:
    """A copy of a batch message taken while the first copy's members are answered and their record waits:
    not a statement, not a slot, not a hand-back (which would let the first copy's claims go early, and
    the dispatcher poll the rows again at once)."""
    mcp, executor = slow_tick
    ids = _submit(executor, 3)
    members, first = _answered_unrecorded(executor, ids)
    reads = sum(1 for e in mcp.log() if e["method"] == "tasks/get")

    with _statements(executor) as sent:
        copy = executor.start_batch(members).wait(timeout_s=5)

    assert [(s.action, s.detail.get("claim")) for s in copy] == [(StepAction.NOTHING_TO_DO, "running")] * 3
    assert sent == []
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads
    executor.rt.unrecorded.flush()
    assert [s.action for s in first.wait(timeout_s=10)] == [StepAction.STILL_WORKING] * 3


def test_a_record_that_waits_on_a_locked_row_lets_the_next_batch_be_read_alone(
    slow_tick: tuple[McpServer, Executor],
) -> None:
    """The earlier batch's record rides on the next batch's read; when a row it writes is locked past the
    record's lock wait (a takeover's update of every row, say), the next batch is read alone and runs, and
    the earlier batch finishes, its claims left to run out."""
    mcp, executor = slow_tick
    first_ids, second_ids = _submit(executor, 2), _submit(executor, 2)
    _members, first = _answered_unrecorded(executor, first_ids)
    _due_now(executor, second_ids)
    second = [PollMember(d.op_id, d.cursor) for d in _claim(executor, 2)]
    reads = sum(1 for e in mcp.log() if e["method"] == "tasks/get")

    with executor.ledger.engine.connect() as locker:
        locker.execute(text("SELECT 1 FROM tool_operation WHERE id = :id FOR UPDATE"), {"id": first_ids[0]})
        started = time.monotonic()
        second_batch = executor.start_batch(second)
        first_steps = first.wait(timeout_s=10)
        locker.rollback()
    assert time.monotonic() - started < 8
    assert [s.action for s in first_steps] == [StepAction.STILL_WORKING] * 2  # unrecorded: due when leased
    for op_id in first_ids:
        assert executor.ledger.get(op_id).lease_until is not None
    support.wait_for(
        "the second batch's status reads",
        lambda: sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads + 2,
        timeout=10,
    )
    executor.rt.unrecorded.flush()
    assert [s.action for s in second_batch.wait(timeout_s=10)] == [StepAction.STILL_WORKING] * 2


def test_a_record_flushed_alone_gives_up_on_a_locked_row_within_its_lock_wait(
    slow_tick: tuple[McpServer, Executor],
) -> None:
    """With no next batch to ride on, a process's waiting record is written on its own (``flush``, on the
    process's straggler thread). When a row it writes is locked (a takeover's update of every row, an
    operator's open transaction), it gives up after the same lock wait as a record on a read: the batch
    finishes, its claims left to run out. Before, the flush waited for the lock for as long as it was held,
    and with it the straggler thread every batch of the process finishes on."""
    _mcp, executor = slow_tick
    ids = _submit(executor, 2)
    _members, batch = _answered_unrecorded(executor, ids)

    with executor.ledger.engine.connect() as locker:
        locker.execute(text("SELECT 1 FROM tool_operation WHERE id = :id FOR UPDATE"), {"id": ids[0]})
        flushed = threading.Thread(target=executor.rt.unrecorded.flush, daemon=True)
        started = time.monotonic()
        flushed.start()
        flushed.join(timeout=8)
        gave_up_s = time.monotonic() - started
        locker.rollback()
    assert not flushed.is_alive(), "the flush still waits for the locked row"
    assert gave_up_s < 8
    assert [s.action for s in batch.wait(timeout_s=5)] == [StepAction.STILL_WORKING] * 2
    for op_id in ids:
        assert executor.ledger.get(op_id).lease_until is not None  # unrecorded: due when its lease runs out


def test_a_process_records_a_batchs_unchanged_polls_with_its_next_batchs_read(
    slow_tick: tuple[McpServer, Executor],
) -> None:
    """One commit for a batch's read and the earlier batch's record (issue 21: at most 0.1 ledger commits
    per unchanged poll): the first batch's unchanged polls stay claimed, unrecorded, until the second batch
    is read, and are written in the same transaction as that read."""
    _mcp, executor = slow_tick
    first_ids, second_ids = _submit(executor, 3), _submit(executor, 2)
    before = {op_id: executor.ledger.get(op_id).unchanged_polls for op_id in first_ids + second_ids}
    _first, first_batch = _answered_unrecorded(executor, first_ids)
    for op_id in first_ids:
        op = executor.ledger.get(op_id)
        assert (op.unchanged_polls, op.lease_until is not None) == (before[op_id], True)

    _due_now(executor, second_ids)
    second = [PollMember(d.op_id, d.cursor) for d in _claim(executor, 2)]
    answered = threading.Semaphore(0)
    seen: list[str] = []

    def sent(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement.lstrip().split()[0].upper())

    engine = executor.ledger.engine
    listeners: list[tuple[str, Any]] = [
        ("before_cursor_execute", sent),
        ("begin", lambda _conn: seen.append("BEGIN")),
        ("commit", lambda _conn: seen.append("COMMIT")),
    ]
    for name, listener in listeners:
        event.listen(engine, name, listener)
    try:
        second_batch = executor.start_batch(second, on_step=lambda _step: answered.release())
        first_steps = first_batch.wait(timeout_s=10)  # recorded by the second batch's read
    finally:
        for name, listener in listeners:
            event.remove(engine, name, listener)
    # The first batch's record and the second's read: one transaction, one commit.
    assert seen[:5] == ["BEGIN", "SET", "UPDATE", "SELECT", "COMMIT"], seen  # SET: its lock wait
    assert [s.action for s in first_steps] == [StepAction.STILL_WORKING] * 3
    for op_id in first_ids:
        op = executor.ledger.get(op_id)
        assert (op.unchanged_polls, op.lease_until) == (before[op_id] + 1, None)

    for _ in second:
        assert answered.acquire(timeout=10)
    executor.rt.unrecorded.flush()  # no third batch: the second's record now, not a tick (20 s) on
    assert [s.action for s in second_batch.wait(timeout_s=10)] == [StepAction.STILL_WORKING] * 2
    for op_id in second_ids:
        assert executor.ledger.get(op_id).unchanged_polls == before[op_id] + 1


def test_a_claim_handed_back_without_its_poll_is_due_at_once_not_a_round_later(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """What a worker of a fleet that does not own the epoch does with a poll message of the owner's (rule 13,
    ``Ledger.hand_back_claim``): the claim had set the row's next poll an interval on (2 s here); handed
    back, the row is due at once, for the owner's next tick."""
    _mcp, executor = mcp_executor
    [op_id] = _submit(executor, 1)
    _due_now(executor, [op_id])
    [claim] = _claim(executor, 1)
    claimed = executor.ledger.get(op_id)
    assert claimed.next_poll_at is not None
    assert claimed.next_poll_at > dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)

    assert executor.ledger.hand_back_claim(op_id, claim.cursor)
    op = executor.ledger.get(op_id)
    assert (op.lease_until, op.poll_cursor) == (None, claim.cursor)
    assert op.next_poll_at is not None
    assert op.next_poll_at <= dt.datetime.now(dt.UTC)


def test_a_claim_handed_back_later_never_puts_off_a_row_made_due_meanwhile(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """A hand-back's due time is a latest one: a row another writer made due at once while it was claimed
    (an intent, under its own fence) stays due at once."""
    _mcp, executor = mcp_executor
    [op_id] = _submit(executor, 1)
    _due_now(executor, [op_id])
    [claim] = _claim(executor, 1)
    with executor.ledger.engine.begin() as conn:
        conn.execute(text("UPDATE tool_operation SET next_poll_at = now() WHERE id = :id"), {"id": op_id})

    assert executor.ledger.hand_back_claims([(op_id, claim.cursor, 30.0)]) == {op_id}
    op = executor.ledger.get(op_id)
    assert op.lease_until is None
    assert op.next_poll_at is not None
    assert op.next_poll_at <= dt.datetime.now(dt.UTC)


def test_members_refused_a_slot_are_handed_back_in_one_statement_each_counted(
    mcp_executor: tuple[McpServer, Executor], database_url: str, broker_prefix: str, tmp_path: Path
) -> None:
    """A batch larger than its server's poll budget can take within a tick (rule 4): the members refused a
    slot are not started; their claims are handed back in one statement, each row due again when the
    bucket said and its ``no_token_count`` counted, no event (they were a read and a write each)."""
    mcp, executor = mcp_executor
    ids = _submit(executor, 6)
    before = {op_id: executor.ledger.get(op_id) for op_id in ids}
    _due_now(executor, ids)
    claims = _claim(executor, 6)
    config = tmp_path / "tight.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=1, control_qps=50))
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")
    steps, sent = _batch_on(in_process_runtime(database_url, broker_prefix, config, lease_s=30), claims)

    refused = [s for s in steps if s.action is EventKind.NO_TOKEN]
    sent_reads = sum(1 for e in mcp.log() if e["method"] == "tasks/get") - reads_before
    assert refused, steps
    assert len(refused) + sent_reads == 6
    assert sum(1 for s in sent if "claim_ids" in s) == 1, [s[:60] for s in sent]
    assert len(_writes(sent)) == 2, [s[:60] for s in sent]  # the hand-back, and the others' record
    handed_back = dt.datetime.now(dt.UTC)
    cursors = {d.op_id: d.cursor for d in claims}
    for step in refused:
        op = executor.ledger.get(step.op_id)
        assert (op.poll_cursor, op.lease_until) == (cursors[step.op_id], None)
        assert op.no_token_count == before[step.op_id].no_token_count + 1
        assert op.event_seq == before[step.op_id].event_seq  # no event
        assert op.next_poll_at is not None
        assert op.next_poll_at < handed_back + dt.timedelta(seconds=3)  # when the bucket said


def test_members_refused_a_slot_by_a_fleet_that_does_not_own_the_epoch_are_handed_back_as_the_step_would(
    mcp_executor: tuple[McpServer, Executor], database_url: str, broker_prefix: str, tmp_path: Path
) -> None:
    """Rule 13: after a rollback to another owner, this fleet's batch writes nothing of its own for its
    members, those refused a slot included: each claim is handed back due at once, for the owner, no
    ``no_token_count``, no status read."""
    mcp, executor = mcp_executor
    ids = _submit(executor, 6)
    before = {op_id: executor.ledger.get(op_id) for op_id in ids}
    _due_now(executor, ids)
    claims = _claim(executor, 6)
    executor.ledger.bump_epoch(actor="test", reason="a rollback to another fleet", owner="another-fleet")
    config = tmp_path / "tight.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=1, control_qps=50))
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")

    steps, _sent = _batch_on(in_process_runtime(database_url, broker_prefix, config, lease_s=30), claims)

    assert [s.action for s in steps] == [StepAction.NOT_OWNER] * 6, steps
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before
    for op_id in ids:
        op = executor.ledger.get(op_id)
        assert op.no_token_count == before[op_id].no_token_count
        assert op.lease_until is None
        assert op.next_poll_at is not None
        assert op.next_poll_at <= dt.datetime.now(dt.UTC)


def test_a_poll_whose_answer_changed_writes_its_event(mcp_executor: tuple[McpServer, Executor]) -> None:
    _mcp, executor = mcp_executor
    [changed, same] = _submit(executor, 2)
    _due_now(executor, [changed], status_message="an older message")
    _due_now(executor, [same])
    claims = _claim(executor, 2)
    seq = executor.ledger.get(changed).event_seq

    with _statements(executor) as sent:
        executor.advance_batch([PollMember(d.op_id, d.cursor) for d in claims])

    assert len(_writes(sent)) == 2  # the changed one's record_poll, and the unchanged one's count
    op = executor.ledger.get(changed)
    assert op.status_message is None
    assert op.event_seq == seq + 1
    assert executor.ledger.events(changed)[-1]["kind"] == EventKind.POLLED.value


def test_a_late_member_writes_nothing(mcp_executor: tuple[McpServer, Executor]) -> None:
    mcp, executor = mcp_executor
    [late] = _submit(executor, 1)
    _due_now(executor, [late])
    [claim] = _claim(executor, 1)
    with executor.ledger.engine.begin() as conn:  # claimed again meanwhile (its lease ran out)
        conn.execute(
            text("UPDATE tool_operation SET poll_cursor = poll_cursor + 1 WHERE id = :id"), {"id": late}
        )
    before = executor.ledger.get(late)
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")

    with _statements(executor) as sent:
        [step] = executor.advance_batch([PollMember(claim.op_id, claim.cursor)])

    assert step.action is StepAction.SUPERSEDED
    assert _writes(sent) == []
    assert executor.ledger.get(late) == before
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before


def test_the_claim_sets_the_next_poll_as_the_poll_step_would(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """``next_poll_ahead`` (SQL) against the poll step's rule (``StepContext.interval_s`` + ``spread``, never
    past a deadline still ahead): the row's kept interval, at least 0.1 s; the server's default without one;
    capped by a wait deadline ahead; a deadline already past caps nothing."""
    _mcp, executor = mcp_executor
    kept, floor, default, capped, past = _submit(executor, 5)
    _due_now(executor, [kept], poll_interval_ms=2000)
    _due_now(executor, [floor], poll_interval_ms=20)
    _due_now(executor, [default], poll_interval_ms=None)
    _due_now(executor, [capped], poll_interval_ms=60_000)
    _due_now(executor, [past], poll_interval_ms=3000)
    with executor.ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET wait_deadline = now() + interval '5 seconds' WHERE id = :id"),
            {"id": capped},
        )
        conn.execute(
            text("UPDATE tool_operation SET wait_deadline = now() - interval '5 seconds' WHERE id = :id"),
            {"id": past},
        )
    snapshots = {op_id: executor.ledger.get(op_id) for op_id in (kept, floor, default, capped, past)}
    start = dt.datetime.now(dt.UTC)
    _claim(executor, 5)
    end = dt.datetime.now(dt.UTC)

    def rule_s(snapshot: Operation) -> float:
        # The poll step's rule, asked as a step asks it: inside a log context of its own (the step context
        # notes the operation it reads about; called bare, that would stay bound for the next test).
        with logs.bind():
            return executor.ctx.interval_s(snapshot, None)

    for op_id, snapshot in snapshots.items():
        interval = rule_s(snapshot)
        jitter = min(POLL_JITTER_SHARE * interval, POLL_JITTER_MAX_S)
        due = executor.ledger.get(op_id).next_poll_at
        assert due is not None
        low = start + dt.timedelta(seconds=interval) - dt.timedelta(milliseconds=50)
        high = end + dt.timedelta(seconds=interval + jitter) + dt.timedelta(milliseconds=50)
        if op_id == capped:
            assert snapshot.wait_deadline is not None
            assert due == snapshot.wait_deadline
        else:
            assert low <= due <= high, (op_id == floor, op_id == default, interval, due - start)
    assert rule_s(snapshots[floor]) == 0.1
    assert rule_s(snapshots[default]) == 1.0


def test_a_batch_books_its_status_reads_in_one_redis_call(
    private_redis_executor: tuple[McpServer, Executor, support.PrivateRedis],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One bucket call per batch (rule 4, issue 21): six members' status reads are booked by one script
    call on the hot state's Redis, which also counts them for the request meter; nothing else is asked of
    it (the session is set up by a first batch, whose control requests take their own tokens). A member
    that comes to its slot late takes a token of its own (``late_slot_s``, tested in test_take_slots.py):
    on a loaded machine one may, so here none is late."""
    monkeypatch.setattr("workers.budget.late_slot_s", lambda _rate: 60.0)
    mcp, executor, hot = private_redis_executor
    ids = _submit(executor, 6)
    _due_now(executor, ids)
    executor.advance_batch([PollMember(d.op_id, d.cursor) for d in _claim(executor, 6)])
    _due_now(executor, ids)
    claims = _claim(executor, 6)
    client = redis.Redis.from_url(hot.url)
    client.config_resetstat()
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")

    steps = executor.advance_batch([PollMember(d.op_id, d.cursor) for d in claims])

    assert len(steps) == 6
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before + 6
    stats = client.info("commandstats")
    scripts = stats.get("cmdstat_evalsha", {}).get("calls", 0) + stats.get("cmdstat_eval", {}).get("calls", 0)
    assert scripts == 1, stats
    second = int(time.time())
    counted = sum(
        int(client.get(rate_key(executor.rt.hot.prefix, "reports", "poll", s)) or 0)
        for s in range(second - 5, second + 3)
    )
    assert counted == 12  # both batches' reads, each counted once
    client.close()


def test_polls_past_the_process_room_are_shed_and_handed_back_in_one_statement(
    mcp_executor: tuple[McpServer, Executor], database_url: str, broker_prefix: str
) -> None:
    """A worker process runs at most four batches' worth of one server's polls (``workers/members.py``):
    with a ``poll_batch`` of 1, four. The rest of a batch is answered DEFERRED at once, its claims handed
    back in one statement: not polled, each row's cursor as claimed and its lease cleared, due again a tick
    on (the soak at 10,000 in flight shed a third of its polls, each then a round of 25 s late)."""
    mcp, executor = mcp_executor
    ids = _submit(executor, 6)
    _due_now(executor, ids)
    claims = _claim(executor, 6)
    config = executor.rt.settings.config
    assert config is not None
    small = in_process_runtime(database_url, broker_prefix, config, lease_s=30, poll_batch=1)
    tick = dt.timedelta(seconds=small.settings.dispatch_interval_s)
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")
    steps, sent = _batch_on(small, claims)

    shed = [s.op_id for s in steps if s.detail.get("shed")]
    assert len(shed) == 2, steps
    assert all(s.action is StepAction.DEFERRED for s in steps if s.op_id in shed)
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before + 4
    assert sum(1 for s in sent if "claim_ids" in s) == 1, [s[:60] for s in sent]  # one hand-back for both
    cursors = {d.op_id: d.cursor for d in claims}
    handed_back = dt.datetime.now(dt.UTC)
    for op_id in shed:
        op = executor.ledger.get(op_id)
        assert (op.poll_cursor, op.lease_until, op.last_polled_at) == (cursors[op_id], None, None)
        # Due again a tick on, not where its claim had set it (2 s on: a round of polls skipped).
        assert op.next_poll_at is not None
        assert op.next_poll_at <= handed_back + tick + dt.timedelta(milliseconds=200), (
            op.next_poll_at - handed_back
        )


def test_shed_polls_whose_hand_back_fails_unexpectedly_leave_nothing_held_in_the_process(
    mcp_executor: tuple[McpServer, Executor],
    database_url: str,
    broker_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hand-back of a batch's shed polls fails with an error that is not an outage (raised here as
    psycopg files a read-only standby's refusal, which the engine now takes for one: any other error the
    same). The batch runs all the same: the shed
    polls are answered DEFERRED (due when their leases run out), the admitted ones are polled, and the
    process holds no room and no claim afterwards. An error escaping there had left the admitted members'
    room taken and their claims held for good: the process shed that server's polls ever after, and every
    shutdown waited its full bound."""
    _, executor = mcp_executor
    ids = _submit(executor, 6)
    _due_now(executor, ids)
    claims = _claim(executor, 6)
    config = executor.rt.settings.config
    assert config is not None
    small = in_process_runtime(database_url, broker_prefix, config, lease_s=30, poll_batch=1)

    def read_only(claims: object, **_: object) -> None:
        raise sqlalchemy.exc.InternalError(
            "UPDATE tool_operation ...",
            {},
            psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction"),
        )

    monkeypatch.setattr(small.ledger, "hand_back_claims", read_only)
    steps, _ = _batch_on(small, claims)

    actions = collections.Counter(s.action for s in steps)
    assert actions == {StepAction.DEFERRED: 2, StepAction.STILL_WORKING: 4}
    assert members.in_flight() == 0
    # A member leaves its room just after it answers: the batch may be done a moment before.
    support.wait_for("the batch's members to leave their room", lambda: not members.running(), timeout=5)
    again = in_process_runtime(database_url, broker_prefix, config, lease_s=30, poll_batch=1)
    _due_now(executor, ids)
    steps, _ = _batch_on(again, _claim(executor, 4))
    assert [s.action for s in steps] == [StepAction.STILL_WORKING] * 4  # the process's room is whole


class _NoTimer:
    """The growth timer of a process that cannot start its thread."""

    def at(self, when: float, finish: object) -> None:
        raise RuntimeError("can't start new thread")


@pytest.mark.parametrize("fails", ["member thread", "growth timer"])
def test_a_batch_whose_member_thread_cannot_start_lets_its_members_go_and_holds_nothing(
    mcp_executor: tuple[McpServer, Executor],
    monkeypatch: pytest.MonkeyPatch,
    fails: str,
) -> None:
    """The process cannot start a thread (``threading`` raises ``RuntimeError`` when it is at its limit of
    threads or of memory) for a server none of whose member threads is alive: the member thread itself, or
    the timer of the threads' growth (its first look, after the member thread started). The batch's members
    are answered DEFERRED, none of them sent (each due when its lease runs out), and the process holds
    neither their room nor their claims: the next batch, with threads to run on, polls them all. Before,
    the error escaped the batch with every member after the failure admitted and held for good: the process
    shed that server's polls ever after and never ran those claims again; and at the timer the member was
    queued already: it ran after being answered DEFERRED, its room and claim given back while it ran."""
    mcp, executor = mcp_executor
    ids = _submit(executor, 4)
    _due_now(executor, ids)
    claims = _claim(executor, 4)
    reads_before = sum(1 for e in mcp.log() if e["method"] == "tasks/get")

    def no_room(self: object) -> None:
        raise RuntimeError("can't start new thread")

    def started_idle(self: members._MemberThreads) -> None:
        self._threads += 1

    with monkeypatch.context() as patch:
        patch.setattr(members._process, "pools", {})  # no thread alive for the server: the submit starts one
        if fails == "member thread":
            patch.setattr(members._MemberThreads, "_start", no_room)
        else:
            # The member thread counted as started but running nothing, so that a member queued in spite of
            # the error stays in the queue for the test to see.
            patch.setattr(members._MemberThreads, "_start", started_idle)
            patch.setattr(members, "growth_timer", _NoTimer)
        steps = executor.advance_batch([PollMember(d.op_id, d.cursor) for d in claims])
        [pool] = members._process.pools.values()
        assert pool._queue == [], "a member was queued after its batch was told it would not run"

    assert [s.action for s in steps] == [StepAction.DEFERRED] * 4, steps
    assert sum(1 for e in mcp.log() if e["method"] == "tasks/get") == reads_before  # nothing was sent
    assert members.in_flight() == 0
    assert not members.running()
    # The same claims, run by a copy of the message with threads to run on, are polled (not "running").
    steps = executor.advance_batch([PollMember(d.op_id, d.cursor) for d in claims])
    assert [s.action for s in steps] == [StepAction.STILL_WORKING] * 4, steps
