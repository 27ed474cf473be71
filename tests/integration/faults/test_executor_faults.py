"""The terminal-state protocol under faults (issue 4): workers killed mid-call, pollers answering out of
order, cancel racing completion in both orders, and the hot Redis restarted mid-run.

Real processes (longcall's MCP server, longcall workers, beat, a pipeline worker), real Postgres and Redis.
Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import text

from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import (
    Fleet,
    FleetParts,
    free_port,
    running_fleet,
)
from tests.support.ledger_rows import evidence_for
from workers.executor import Executor, StepOutcome
from workers.hot import bucket_key
from workers.submission import validate_submission

S = OpState


def kinds(ledger: Ledger, op_id: uuid.UUID) -> list[str]:
    return [e["kind"] for e in ledger.events(op_id)]


def in_order(sequence: list[str], *wanted: str) -> bool:
    """``wanted`` occurs in ``sequence`` in this order (other items may come between)."""
    rest = iter(sequence)
    return all(any(item == w for item in rest) for w in wanted)


def methods(fleet: Fleet) -> list[str]:
    return [e["method"] for e in fleet.mcp.log()]


def receipt_rows(ledger: Ledger, op_id: uuid.UUID) -> int:
    with ledger.engine.begin() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM terminal_receipt WHERE op_id = :id"), {"id": op_id}
        ).scalar_one()
    return int(count)


def kill_pool_of(fleet: Fleet, *task_ids: str) -> Callable[[], bool]:
    """SIGKILL the pool processes of the worker that received one of ``task_ids``; its main process lives.
    Returns a probe: has one of the killed messages run again since?

    Only the pool children die, on purpose: the main process sees them go (WorkerLostError), and with
    ``task_acks_late`` + ``task_reject_on_worker_lost`` it rejects the message with requeue, so the task is
    redelivered at once. A kill -9 of the whole process group (``CeleryProcess.kill``) would leave the
    message unacknowledged in the broker's "unacked" hash until the Redis transport's visibility timeout
    (1 h in ``workers.app``) restores it: that is a different (and much slower) test.

    A message runs again in one of two ways, and the probe takes either. The broker delivers it again (a
    second "received" line). Or, when the killed child had not yet told the main process that it took the
    job (a loaded machine: the child was running it, its word still in the pipe), the main process puts the
    job back into its new pool (billiard's ``on_partial_read``): no second delivery, but a run that ends,
    which the killed run never does.
    """
    worker = support.wait_for(
        f"the worker that received {task_ids}",
        lambda: next(filter(None, map(fleet.worker_that_received, task_ids)), None),
    )
    received = sum(map(fleet.received_count, task_ids))
    ended = sum(map(fleet.ended_count, task_ids))
    killed = worker.kill_children()
    assert killed, f"{worker.name} has no pool processes to kill"
    support.wait_for(
        f"{worker.name} to see its pool processes die",
        lambda: "WorkerLostError" in worker.log(),
        timeout=15,
    )
    return lambda: (
        sum(map(fleet.received_count, task_ids)) > received or sum(map(fleet.ended_count, task_ids)) > ended
    )


# ---------------------------------------------------------------------------------- 1. kill -9 in submit


def test_kill_9_during_the_create_call_never_creates_twice(fleet: Fleet) -> None:
    fleet.mcp.faults(delay_ms={"tools/call": 5000})
    sent = fleet.submit_nowait("n/killed-submit", "slow_report", {"seconds": 60})
    support.wait_for("the tools/call to reach the server", lambda: "tools/call" in methods(fleet), timeout=30)
    op = fleet.ledger.find_by_call_node("n/killed-submit")
    assert op is not None
    assert (op.state, op.submit_attempted_at is not None) == (S.SUBMITTING, True)  # committed before the call

    ran_again = kill_pool_of(fleet, sent.id)

    # The submit message runs again (reject on worker lost): the second run finds the operation, which the
    # dispatcher takes over when the lease runs out, and rule 1 sends it to SUBMISSION_UNKNOWN.
    support.wait_for("the submit message to run again", ran_again, timeout=30)
    answer = sent.get(timeout=30)
    assert (answer["op_id"], answer["created"]) == (str(op.id), False)
    op = fleet.wait_state(op.id, S.MANUAL_RECONCILIATION, timeout=45)

    [record] = fleet.ledger.reconciliations_for(op.id)
    assert (record.reason.value, record.resolved_at) == ("SUBMISSION_UNKNOWN", None)
    assert record.detail["submission_key"] == str(op.submission_key)
    assert fleet.ledger.find_by_submission_key(op.submission_key) == op
    assert (op.remote_id, op.next_poll_at, op.lease_until) == (None, None, None)  # nobody polls it
    assert fleet.ledger.receipt_for(op.id) is None
    assert fleet.receipts() == []

    events = fleet.ledger.events(op.id)
    trail = [e["kind"] for e in events]
    expected = ("submitted", "create_attempted", "submission_unknown", "manual_reconciliation")
    assert in_order(trail, *expected), trail
    assert "created" not in trail
    unknown = next(e for e in events if e["kind"] == "submission_unknown")
    assert (unknown["from_state"], unknown["to_state"]) == ("SUBMITTING", "SUBMISSION_UNKNOWN")
    assert "attempted before" in unknown["detail"]["why"]
    manual = next(e for e in events if e["kind"] == "manual_reconciliation")
    assert (manual["from_state"], manual["to_state"]) == ("SUBMISSION_UNKNOWN", "MANUAL_RECONCILIATION")
    assert manual["detail"]["reason"] == "SUBMISSION_UNKNOWN"

    # The server did create the task (the answer went to a dead process): one create, ever.
    support.wait_for("the delayed create to finish on the server", lambda: len(fleet.mcp.tasks()) == 1)
    assert methods(fleet).count("tools/call") == 1


# ------------------------------------------------------------------------------------ 2. kill -9 in poll


@pytest.mark.parametrize(
    ("method", "in_state"), [("tasks/get", S.WORKING), ("tasks/result", S.FETCHING_RESULT)]
)
def test_kill_9_during_a_poll_gives_one_receipt_delivered_once(
    fleet: Fleet, method: str, in_state: OpState
) -> None:
    """Killed while the poll's ``tasks/get`` is in flight, or while the result fetch the poll went on to
    (``tasks/result``) is."""
    fleet.mcp.faults(delay_ms={method: 3000})
    op_id = fleet.submit("n/killed-poll", "slow_report", {"seconds": 1})
    support.wait_for(f"a {method} to reach the server", lambda: method in methods(fleet), timeout=30)
    op = fleet.ledger.get(op_id)
    step_ids = [f"{task}:{op_id}:{op.poll_cursor}" for task in ("longcall.poll", "longcall.fetch_result")]
    assert op.state is in_state

    ran_again = kill_pool_of(fleet, *step_ids)
    after = fleet.ledger.get(op_id)  # the answer in flight was never written: its process is gone
    assert (after.state, after.event_seq) == (in_state, op.event_seq)
    fleet.mcp.faults(delay_ms={})

    support.wait_for("the step's message to run again", ran_again)
    receipt = fleet.wait_receipt("n/killed-poll", timeout=45)
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == (
        "completed",
        "report ready after 1s",
    )
    support.wait_for("the outbox and the pipeline to settle", fleet.settled)
    assert [r["call_node_id"] for r in fleet.receipts()] == ["n/killed-poll"]
    assert receipt_rows(fleet.ledger, op_id) == 1
    assert fleet.ledger.get(op_id).state is S.ACCEPTED
    assert methods(fleet).count("tools/call") == 1
    assert len(fleet.mcp.tasks()) == 1


def test_kill_9_during_the_cancel_call_gives_one_cancelled_receipt(fleet: Fleet) -> None:
    """The cancel's ACK dies with the worker: the cancel is sent again under a new claim, and the one
    receipt is the cancelled one."""
    op_id = fleet.submit("n/killed-cancel", "slow_report", {"seconds": 60})
    fleet.wait_state(op_id, S.WORKING)
    fleet.mcp.faults(delay_ms={"tasks/cancel": 3000})
    sent = fleet.send_nowait("longcall.cancel", op_id=str(op_id))
    support.wait_for("the tasks/cancel to reach the server", lambda: "tasks/cancel" in methods(fleet))
    op = fleet.ledger.get(op_id)
    assert op.state is S.CANCEL_REQUESTED
    # The task sends the cancel itself when it claims the row; when another step holds the row's lease, it
    # records the intent and ends, and the dispatcher's step sends the cancel under the next claim. The
    # message to kill is the one whose tasks/cancel is in flight: that step's when there is one. (Seen in a
    # full run: the task had ended "cancel_requested", the step's run was killed and ran again, and a probe
    # of the task's message alone waited for a run that never comes.)
    step_id = f"longcall.cancel:{op_id}:{op.poll_cursor}"
    by_step = fleet.worker_that_received(step_id) is not None
    ran_again = kill_pool_of(fleet, step_id, sent.id)
    fleet.mcp.faults(delay_ms={})
    support.wait_for("the cancel message to run again", ran_again)
    # The redelivery never cancels twice: it finds the cancel recorded, or (if the dispatcher's resend under
    # a new claim was quicker) already accepted; the generation below proves one cancel request.
    expected = ("cancel_requested",) if by_step else ("already_requested", "already_final")
    assert sent.get(timeout=30)["action"] in expected

    receipt = fleet.wait_receipt("n/killed-cancel", timeout=45)
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    support.wait_for("the outbox and the pipeline to settle", fleet.settled)
    assert [r["terminal_state"] for r in fleet.receipts()] == ["cancelled"]
    assert receipt_rows(fleet.ledger, op_id) == 1
    op = fleet.ledger.get(op_id)
    assert (op.state, op.cancel_generation) == (S.CANCELLED_ACCEPTED, 1)
    assert fleet.ledger.reconciliations_for(op_id) == []
    assert fleet.mcp.tasks()[0]["status"] == "cancelled"


# ------------------------------------------------------------------------ 3. two pollers out of order


def test_two_pollers_answering_out_of_order_never_move_the_state_back(
    runtimes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mcp, make = runtimes
    first, second = Executor(make()), Executor(make())
    ledger = first.ledger
    submission, created = first.submit(
        validate_submission(
            {
                "call_node_id": "n/reordered",
                "server": "reports",
                "tool": "slow_report",
                "arguments": {"seconds": 1},
            },
            first.rt.fleet,
            max_body_bytes=first.rt.settings.max_body_bytes,
        )
    )
    op_id = submission.operation.id
    assert created is not None
    assert created.action == "created"
    assert ledger.get(op_id).state is S.WORKING

    # The older poller: claimed with a short lease, its tasks/get sees "working" and its answer is held by
    # the server until the newer poller's tasks/result answer has gone out (the reorder fault): by then the
    # newer poller has written the terminal state it saw, so the older answer is the last to arrive.
    mcp.faults(reorder=1, reorder_release="tasks/result")
    # Its worker cannot renew its lease (frozen, or cut off from Postgres), so the lease runs out while its
    # answer is on the way: a live step's keeper would renew it within what is left (workers/lease.py).
    monkeypatch.setattr(first.ledger, "renew_lease", lambda *_, **__: False)
    old_claim = ledger.claim(op_id, lease_s=0.3)
    assert old_claim is not None
    outcomes: dict[str, StepOutcome] = {}
    older = threading.Thread(
        target=lambda: outcomes.__setitem__("older", first.advance(op_id, old_claim.poll_cursor))
    )
    older.start()
    try:
        support.wait_for(
            "the older poll to reach the server",
            lambda: [e["method"] for e in mcp.log()].count("tasks/get") == 1,
        )
        support.wait_for(
            "the task to complete on the server", lambda: mcp.tasks()[0]["status"] == "completed"
        )
        # The newer poller takes over once the older lease ran out (a new cursor), and sees "completed".
        new_claim = support.wait_for("the older lease to run out", lambda: ledger.claim(op_id, lease_s=30))
        assert new_claim.poll_cursor == old_claim.poll_cursor + 1
        outcomes["newer"] = second.advance(op_id, new_claim.poll_cursor)
    finally:
        older.join(timeout=20)
    assert not older.is_alive()

    assert outcomes["newer"].action == "accepted"
    assert outcomes["older"].action == "stale"
    op = ledger.get(op_id)
    assert (op.state, op.server_state, op.observed_terminal) == (
        S.ACCEPTED,
        "completed",
        TerminalKind.COMPLETED,
    )
    receipt = ledger.receipt_for(op_id)
    assert receipt is not None
    assert receipt.terminal_state is TerminalKind.COMPLETED

    events = ledger.events(op_id)
    [stale] = [e for e in events if e["kind"] == "stale_write_rejected"]
    assert stale["detail"]["attempted"] == "polled"
    assert stale["detail"]["write_detail"] == {"server_state": "working"}  # the older answer
    assert stale["detail"]["expected"]["poll_cursor"] == old_claim.poll_cursor
    assert stale["detail"]["found"]["poll_cursor"] == new_claim.poll_cursor
    # The older answer arrived last: the newer poller had already observed the terminal state.
    seq_of = {e["kind"]: e["seq"] for e in events}
    assert seq_of["terminal_observed"] < stale["seq"]
    # The state never moved backwards: once terminal was observed, no write went back to WORKING.
    states = [e["to_state"] for e in events if e["kind"] != "stale_write_rejected"]
    observed_at = states.index("TERMINAL_OBSERVED")
    assert "WORKING" not in states[observed_at:], states
    polled = [e["server_state"] for e in events if e["kind"] in ("polled", "terminal_observed")]
    assert polled == ["completed"], polled


# ------------------------------------------------------------------------- 4. cancel racing completion


@pytest.mark.parametrize("held_in", [S.TERMINAL_OBSERVED, S.FETCHING_RESULT])
def test_a_cancel_after_completion_was_observed_never_gives_a_cancelled_receipt(
    fleet_parts: FleetParts, held_in: OpState
) -> None:
    """The order test_executor does not cover: a poll has already seen ``completed`` when the cancel comes.

    TERMINAL_OBSERVED is held by a control budget so small that the result fetch finds no token (one
    control call per 5.6 s: the create took the token); FETCHING_RESULT by a slow ``tasks/result``."""
    server = {"control_qps": 0.2} if held_in is S.TERMINAL_OBSERVED else {}
    with running_fleet(fleet_parts, server=server) as fleet:
        if held_in is S.FETCHING_RESULT:
            fleet.mcp.faults(delay_ms={"tasks/result": 4000})
        op_id = fleet.submit("n/observed", "slow_report", {"seconds": 0.3})
        op = fleet.wait_state(op_id, held_in, timeout=20)
        assert (op.observed_terminal, op.server_state) == (TerminalKind.COMPLETED, "completed")

        try:
            answer: Any = fleet.send("longcall.cancel", op_id=str(op_id))
        except Exception as exc:  # noqa: BLE001 - a refusal is a right answer too; what matters follows
            answer = exc
        receipt = fleet.wait_receipt("n/observed", timeout=30)
        assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == (
            "completed",
            "report ready after 0.3s",
        ), answer
        support.wait_for("the outbox and the pipeline to settle", fleet.settled)
        assert [r["terminal_state"] for r in fleet.receipts()] == ["completed"]
        op = fleet.ledger.get(op_id)
        assert (op.state, op.cancel_generation) == (S.ACCEPTED, 0)
        assert receipt_rows(fleet.ledger, op_id) == 1
        assert fleet.ledger.reconciliations_for(op_id) == []
        assert "cancel_requested" not in kinds(fleet.ledger, op_id)
        assert fleet.mcp.tasks()[0]["status"] == "completed"


def test_a_cancel_while_a_poll_carries_the_completion_gives_the_completed_receipt(fleet: Fleet) -> None:
    """The task completed on the server and a poll is bringing that answer when the cancel comes: the cancel
    is recorded (CANCEL_REQUESTED fences the poll off), the server says it is already completed, and the
    completion is accepted; the late poll's write is refused."""
    fleet.mcp.faults(delay_ms={"tasks/get": 3000})
    op_id = fleet.submit("n/poll-carries-completion", "slow_report", {"seconds": 0.3})
    support.wait_for("a poll to reach the server", lambda: "tasks/get" in methods(fleet))
    support.wait_for(
        "the task to complete on the server", lambda: fleet.mcp.tasks()[0]["status"] == "completed"
    )
    assert fleet.ledger.get(op_id).state is S.WORKING  # the poll's answer is still on its way
    fleet.mcp.faults(delay_ms={})  # only the poll in flight stays slow

    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/poll-carries-completion")
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == (
        "completed",
        "report ready after 0.3s",
    )
    stale = support.wait_for(
        "the late poll's write to be refused",
        lambda: [e for e in fleet.ledger.events(op_id) if e["kind"] == "stale_write_rejected"] or None,
    )
    assert stale[0]["detail"]["write_detail"] == {"server_state": "completed"}
    support.wait_for("the outbox and the pipeline to settle", fleet.settled)
    assert [r["terminal_state"] for r in fleet.receipts()] == ["completed"]
    assert receipt_rows(fleet.ledger, op_id) == 1
    op = fleet.ledger.get(op_id)
    assert (op.state, op.cancel_generation) == (S.ACCEPTED, 1)
    assert fleet.ledger.reconciliations_for(op_id) == []
    trail = kinds(fleet.ledger, op_id)
    assert in_order(trail, "cancel_requested", "terminal_observed", "terminal_accepted"), trail
    [observed] = [e for e in fleet.ledger.events(op_id) if e["kind"] == "terminal_observed"]
    assert observed["from_state"] == "CANCEL_REQUESTED"  # the cancel step learnt of the completion


def test_a_completion_offered_after_an_accepted_cancel_is_never_accepted(fleet: Fleet) -> None:
    op_id = fleet.submit("n/cancelled-first", "slow_report", {"seconds": 2})
    fleet.wait_state(op_id, S.WORKING)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/cancelled-first")
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    op = fleet.ledger.get(op_id)
    assert (op.state, op.cancel_generation) == (S.CANCELLED_ACCEPTED, 1)

    # The task would have completed 2 s after its creation; the server stopped it, and it stays cancelled.
    created_at = op.created_at.timestamp()
    support.wait_for(
        "the time the task would have completed, with the task still cancelled",
        lambda: time.time() > created_at + 3 and fleet.mcp.tasks()[0]["status"] == "cancelled",
    )
    assert fleet.mcp.tasks()[0]["result"] is None

    # Something later offers a completion that matches the row in every field: it is not accepted.
    late = fleet.ledger.accept_terminal(op_id, evidence_for(op, TerminalKind.COMPLETED))
    assert late.outcome == "effect_reconciliation"
    assert late.receipt is not None
    assert late.receipt.terminal_state is TerminalKind.CANCELLED
    [record] = fleet.ledger.reconciliations_for(op_id)
    assert (record.reason.value, record.resolved_at) == ("EFFECT_RECONCILIATION_REQUIRED", None)
    assert record.detail["late_terminal_state"] == "completed"
    assert record.detail["cancelled_receipt_id"] == receipt["receipt_id"]

    support.wait_for("the outbox and the pipeline to settle", fleet.settled)
    assert [r["terminal_state"] for r in fleet.receipts()] == ["cancelled"]
    assert receipt_rows(fleet.ledger, op_id) == 1
    op = fleet.ledger.get(op_id)
    assert (op.state, op.observed_terminal, op.result) == (S.CANCELLED_ACCEPTED, TerminalKind.CANCELLED, None)
    assert methods(fleet).count("tasks/result") == 0


# ------------------------------------------------------------------------ 5. the hot Redis restarted


def start_redis(port: int, data_dir: Path, log_dir: Path, name: str) -> support.CeleryProcess:
    """A throwaway redis-server that keeps nothing on disk (a restart loses every key)."""
    return support.start_celery_like(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data_dir),
        ],
        env={},
        log_dir=log_dir,
        name=name,
        ready_marker="Ready to accept connections",
    )


def give_cancel_history(ledger: Ledger, op: Operation) -> Operation:
    """Through the ledger's own named moves: an earlier cancel whose ``tasks/cancel`` found nothing
    (UNKNOWN_NOT_FOUND), which an operator resolved as still running. The operation is WORKING again with
    cancel generation 1, a value only the ledger holds once Redis has lost its keys."""
    fence = Fence(op.execution_epoch, op.cancel_generation)
    # Not sent again before the next step: due in an hour.
    op = ledger.request_cancel(op.id, fence, from_state=S.WORKING, due_in_s=3600)
    fence = Fence(op.execution_epoch, op.cancel_generation)
    op = ledger.hand_to_operator(
        op.id,
        fence,
        from_state=S.CANCEL_REQUESTED,
        reason=ReconciliationReason.UNKNOWN_NOT_FOUND,
        detail={},
        deadline_s=3600,
    )
    assert op.remote_id is not None
    return ledger.resolve_found(
        op.id,
        fence,
        remote_id=op.remote_id,
        session_ref=op.session_ref,
        detail={"actor": "test"},
        resolution="found by test: the task is still running",
    )


@pytest.mark.parametrize("down_until_a_step_fails", [False, True], ids=["restart", "outage"])
def test_a_restarted_hot_redis_is_reseeded_from_the_ledger(
    down_until_a_step_fails: bool,
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    log_dir: Path,
) -> None:
    port = free_port()
    hot_url = f"redis://127.0.0.1:{port}/0"
    hot = redis.Redis.from_url(hot_url, socket_timeout=5)
    servers = [start_redis(port, tmp_path, log_dir, "hot-redis")]
    # Buckets, the cancel CAS and longcall's result backend go to the hot Redis; the broker (and with it the
    # pipeline app, whose result backend is the broker Redis) stays on 6379. So nothing here waits on a
    # longcall task's AsyncResult: every wait is on the ledger or on the pipeline's sink.
    env = {"LONGCALL_REDIS_URL": hot_url, "LONGCALL_BROKER_URL": support.REDIS_URL}
    bucket = bucket_key(f"{broker_prefix}longcall:", "reports", "poll")
    try:
        with running_fleet(
            FleetParts(ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir), env=env
        ) as fleet:
            fleet.submit_nowait("n/before-restart", "slow_report", {"seconds": 120})
            op = fleet.wait_operation("n/before-restart", S.WORKING)
            support.wait_for("a poll to go through the hot bucket", lambda: hot.exists(bucket) == 1)
            op = give_cancel_history(fleet.ledger, op)
            assert (op.state, op.cancel_generation) == (S.WORKING, 1)
            assert redis_client.exists(bucket) == 0  # the buckets are not on the broker's Redis

            run_id = hot.info("server")["run_id"]
            subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], check=True, timeout=10)
            servers[0].proc.wait(timeout=15)
            if down_until_a_step_fails:
                support.wait_for(
                    "a worker step to fail on the missing Redis",
                    lambda: any("Error 111 connecting" in w.log() for w in fleet.workers()),
                )
            servers.append(start_redis(port, tmp_path, log_dir, "hot-redis-again"))
            assert hot.info("server")["run_id"] != run_id  # a new server, which kept nothing

            # Polling resumes on the new Redis (its buckets start afresh).
            restarted = time.time()
            support.wait_for(
                "a poll after the restart",
                lambda: any(e["method"] == "tasks/get" and e["t"] > restarted for e in fleet.mcp.log()),
            )
            assert fleet.ledger.get(op.id).state is S.WORKING

            # The cancel's CAS finds no hot generation: it is re-seeded from the ledger, and the cancel wins.
            fleet.send_nowait("longcall.cancel", op_id=str(op.id))
            op = fleet.wait_state(op.id, S.CANCELLED_ACCEPTED)
            # Re-seeded from the ledger's 1 (not from nothing, 0) and bumped: hot copy and ledger agree.
            assert op.cancel_generation == 2
            assert hot.get(f"{broker_prefix}longcall:cancel:{op.id}") == b"2"
            assert "cancel_race_lost" not in fleet.workers()[0].log() + fleet.workers()[1].log()
            receipt = fleet.wait_receipt("n/before-restart")
            assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)

            # The token buckets work again: a new operation goes all the way.
            fleet.submit_nowait("n/after-restart", "slow_report", {"seconds": 0.3})
            after = fleet.wait_operation("n/after-restart", S.ACCEPTED, timeout=30)
            assert fleet.wait_receipt("n/after-restart")["terminal_state"] == "completed"
            control = bucket_key(f"{broker_prefix}longcall:", "reports", "control")
            assert hot.exists(bucket) == 1 or hot.exists(control)
            assert fleet.ledger.receipt_for(after.id) is not None
            assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == 2
    finally:
        hot.close()
        for server in servers:
            server.stop()
