"""Issue 19, item 0 and 6: nothing sent by name is lost to a Postgres, Redis or worker fault.

Real Postgres and Redis (a private ``redis-server`` where a test stops it), longcall's MCP server, and the
executor in this process or a real fleet. Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters.mcp_2025_11_25.adapter import McpTasksAdapter
from ledger.migrate import upgrade
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.fleet import (
    FleetParts,
    McpServer,
    fleet_config,
    in_process_runtime,
    running_fleet,
    start_mcp_server,
)
from workers.executor import Executor
from workers.submission import validate_submission

S = OpState


def submitted(executor: Executor, call_node_id: str, *, lease_s: float | None) -> Operation:
    """A submission recorded as ``longcall.submit`` records it; ``lease_s``: claimed by the submitting
    worker (which then dies before its create step), as the task's own insert claims it."""
    new = validate_submission(
        {
            "call_node_id": call_node_id,
            "server": "reports",
            "tool": "slow_report",
            "arguments": {"seconds": 5},
        },
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    return executor.ledger.record_submission(new, lease_s=lease_s).operation


def test_a_cancel_of_a_submission_whose_worker_died_before_its_create_ends_it_at_once(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The submitting worker claimed its row (a 30 s lease) and was killed before it recorded a create
    attempt. A cancel recorded now ends the operation cancelled at once, with no create: it does not wait
    out the dead worker's lease (no create can be in flight without a recorded attempt, and any step of the
    dead worker's claim is fenced by the bumped generation and cursor)."""
    mcp, executor = mcp_executor
    op = submitted(executor, "n/cancel-dead-claim", lease_s=30)
    assert op.lease_until is not None
    assert op.submit_attempted_at is None

    outcome = executor.request_cancel(op.id)

    after = executor.ledger.get(op.id)
    assert after.state is S.CANCELLED_ACCEPTED, (outcome, after.state)
    receipt = executor.ledger.receipt_for(op.id)
    assert receipt is not None
    assert receipt.terminal_state.value == "cancelled"
    assert "tools/call" not in [e["method"] for e in mcp.log()]


def test_a_cancel_while_a_create_attempt_is_recorded_keeps_the_claim_of_the_create(
    mcp_executor: tuple[McpServer, Executor],
) -> None:
    """The counterpart: once a create attempt is recorded, the create may be in flight, so the cancel waits
    in the state (an intent) and the claim stays the create step's."""
    _, executor = mcp_executor
    op = submitted(executor, "n/cancel-attempted", lease_s=30)
    op = executor.ledger.record_create_attempt(op.id, op.fence, descriptor_version=None, detail={})

    outcome = executor.request_cancel(op.id)

    after = executor.ledger.get(op.id)
    assert outcome.action == "cancel_recorded", outcome
    assert after.state is S.SUBMITTING
    assert after.cancel_generation == 1
    assert after.poll_cursor == op.poll_cursor
    assert after.lease_until == op.lease_until


# --------------------------------------------------------------------- item 6: a Redis outage


def test_a_cancel_sent_while_redis_is_down_is_recorded_and_sent_once_redis_is_back(
    private_redis_executor: tuple[McpServer, Executor, support.PrivateRedis],
) -> None:
    """The intent goes to the ledger first; the hot generation is best effort. With Redis down no control
    token can be had, so the cancel request is not sent (rule 4) and the step is due again shortly, its
    claim let go; once Redis is back the dispatcher sends it, and the server's task ends cancelled."""
    mcp, executor, hot = private_redis_executor
    op = submitted(executor, "n/cancel-redis-down", lease_s=None)
    claim = executor.dispatch_due()
    assert [c.op_id for c in claim] == [op.id]
    executor.advance(op.id, claim[0].cursor)
    assert executor.ledger.get(op.id).state is S.WORKING

    hot.stop()
    outcome = executor.request_cancel(op.id)

    after = executor.ledger.get(op.id)
    assert after.state is S.CANCEL_REQUESTED, outcome
    assert after.cancel_generation == 1
    assert after.lease_until is None
    assert after.next_poll_at is not None
    assert "tasks/cancel" not in [e["method"] for e in mcp.log()]

    hot.start()

    def cancelled() -> bool:
        for dispatch in executor.dispatch_due():
            assert dispatch.task == "longcall.cancel"
            executor.send_cancel(dispatch.op_id, dispatch.cursor)
        return executor.ledger.get(op.id).state is S.CANCELLED_ACCEPTED

    support.wait_for("the cancel to be sent and accepted after Redis is back", cancelled, timeout=20)
    assert [e["method"] for e in mcp.log()].count("tasks/cancel") == 1


# ------------------------------------------------- item 0: a Postgres fault right after a create answer


@pytest.fixture
def private_ledger(log_dir: Path) -> Iterator[tuple[support.PrivatePostgres, str]]:
    """A Postgres of this test's own (``initdb``/``pg_ctl``), migrated: the test stops and starts it."""
    with support.private_postgres(log_dir) as postgres:
        url = postgres.create_database("longcall")
        upgrade(url)
        yield postgres, url


def stop_postgres_after_the_create_answer(
    monkeypatch: pytest.MonkeyPatch, postgres: support.PrivatePostgres, down_s: float
) -> list[threading.Thread]:
    """The next create call returns its answer, and at that instant Postgres stops (immediate: every
    connection cut, as a crash or a failover) and comes back ``down_s`` later."""
    restarts: list[threading.Thread] = []
    real_create = McpTasksAdapter.create

    def create(self: McpTasksAdapter, *args: Any, **kwargs: Any) -> Any:
        answer = real_create(self, *args, **kwargs)
        if not restarts:
            postgres.stop()

            def come_back() -> None:
                time.sleep(down_s)
                postgres.start()

            restarts.append(threading.Thread(target=come_back, name="postgres comes back"))
            restarts[0].start()
        return answer

    monkeypatch.setattr(McpTasksAdapter, "create", create)
    return restarts


def executor_on(
    database_url: str, mcp: McpServer, tmp_path: Path, broker_prefix: str, **settings: Any
) -> Executor:
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=5000, control_qps=5000))
    return Executor(in_process_runtime(database_url, broker_prefix, config, **settings))


def test_a_postgres_restart_right_after_a_create_answer_still_records_the_remote_id(
    private_ledger: tuple[support.PrivatePostgres, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    log_dir: Path,
    broker_prefix: str,
) -> None:
    """The server answered the create with its task; Postgres went away before that answer was recorded,
    for 3 s. The write is tried again within the step's lease, so the operation is WORKING under the task
    the server holds: never SUBMISSION_UNKNOWN, an operator asked while the server works on the task."""
    postgres, url = private_ledger
    mcp = start_mcp_server(log_dir, poll_interval_ms=200)
    executor = executor_on(url, mcp, tmp_path, broker_prefix, lease_s=30)
    restarts = stop_postgres_after_the_create_answer(monkeypatch, postgres, down_s=3.0)
    try:
        new = validate_submission(
            {
                "call_node_id": "n/pg-after-create",
                "server": "reports",
                "tool": "slow_report",
                "arguments": {"seconds": 2},
            },
            executor.rt.fleet,
            max_body_bytes=executor.rt.settings.max_body_bytes,
        )
        submission, step = executor.submit(new)
        restarts[0].join(timeout=60)

        assert step is not None
        op = executor.ledger.get(submission.operation.id)
        assert op.state in (S.WORKING, S.TERMINAL_OBSERVED, S.FETCHING_RESULT), (step, op.state)
        tasks = mcp.tasks()
        assert len(tasks) == 1
        assert op.remote_id == tasks[0]["taskId"]
        assert "submission_unknown" not in [e["kind"] for e in executor.ledger.events(op.id)]
    finally:
        for restart in restarts:  # Postgres is back before the fixture stops it
            restart.join(timeout=60)
        executor.rt.close()
        mcp.process.stop()


def test_a_submission_whose_first_step_outlasts_its_lease_in_a_fault_answers_with_the_operation(
    private_ledger: tuple[support.PrivatePostgres, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    log_dir: Path,
    broker_prefix: str,
) -> None:
    """Postgres stays away longer than the step may try (a 2 s lease): the submission is recorded, so the
    caller's answer is the operation ("deferred"), never a failure; once Postgres is back, the dispatcher
    takes the row over and, the create's answer being unrecorded, asks for it by key (rule 1): the
    operation is never created twice."""
    postgres, url = private_ledger
    mcp = start_mcp_server(log_dir, poll_interval_ms=200)
    executor = executor_on(url, mcp, tmp_path, broker_prefix, lease_s=2)
    restarts = stop_postgres_after_the_create_answer(monkeypatch, postgres, down_s=4.0)
    try:
        new = validate_submission(
            {
                "call_node_id": "n/pg-long-fault",
                "server": "reports",
                "tool": "slow_report",
                "arguments": {"seconds": 2},
            },
            executor.rt.fleet,
            max_body_bytes=executor.rt.settings.max_body_bytes,
        )
        submission, step = executor.submit(new)
        assert step is not None
        assert step.action == "deferred", step
        restarts[0].join(timeout=60)

        def stepped() -> Operation | None:
            for dispatch in executor.dispatch_due():
                executor.advance(dispatch.op_id, dispatch.cursor)
            op = executor.ledger.get(submission.operation.id)
            return op if op.state is not S.SUBMITTING else None

        op = support.wait_for("the dispatcher to take the submission on", stepped, timeout=30)
        assert op.state in (S.SUBMISSION_UNKNOWN, S.MANUAL_RECONCILIATION), op.state
        assert len(mcp.tasks()) == 1
        assert [e["method"] for e in mcp.log()].count("tools/call") == 1
    finally:
        for restart in restarts:  # Postgres is back before the fixture stops it
            restart.join(timeout=60)
        executor.rt.close()
        mcp.process.stop()


# ------------------------------------------- item 0: messages sent by name while Postgres is down, a fleet


def test_messages_sent_by_name_while_postgres_is_down_are_recorded_once_it_is_back(
    private_ledger: tuple[support.PrivatePostgres, str], tmp_path: Path, log_dir: Path, redis_client: Any
) -> None:
    """A fleet on a Postgres of its own; one operation running. Postgres stops (immediate); while it is
    down a pipeline sends a new submission, a cancel of the running operation and a cancel by call node id
    of a call node not submitted yet, by name, once each. It comes back 6 s later: the submission answers
    with its operation (never FAILURE, its message never acknowledged as a failure and forgotten), the
    cancel is recorded and carried out, the early cancel is kept and ends its call node's submission
    cancelled with no create, and the server holds one task per call node that was created."""
    postgres, url = private_ledger
    ledger = Ledger.from_url(url)
    prefix = f"lc-pgdown-{uuid.uuid4().hex[:8]}:"
    parts = FleetParts(ledger, url, prefix, redis_client, tmp_path, log_dir)
    try:
        with running_fleet(parts, env={"LONGCALL_LEASE_S": "10"}) as fleet:
            running = fleet.submit("n/pg-running", "slow_report", {"seconds": 60})
            fleet.wait_state(running, S.WORKING)

            postgres.stop()
            submitted = fleet.submit_nowait("n/pg-while-down", "slow_report", {"seconds": 2})
            cancelled = fleet.send_nowait("longcall.cancel", op_id=str(running))
            # A cancel by call node id for a call node not submitted yet (issue 22): kept for it.
            early = fleet.send_nowait("longcall.cancel", call_node_id="n/pg-early")
            time.sleep(6)  # Postgres stays down this long (a restart, a failover): the messages wait
            assert submitted.state in ("PENDING", "RETRY", "STARTED"), submitted.state
            postgres.start()
            ledger.engine.dispose()  # the test's own pooled connections died with the server

            answer = submitted.get(timeout=60)
            assert answer["call_node_id"] == "n/pg-while-down"
            assert cancelled.get(timeout=60)["op_id"] == str(running)  # an answer, not a failure
            assert early.get(timeout=60)["action"] == "cancel_recorded"
            fleet.submit("n/pg-early", "slow_report", {"seconds": 2})
            assert fleet.wait_receipt("n/pg-early", timeout=60)["terminal_state"] == "cancelled"
            receipt = fleet.wait_receipt("n/pg-while-down", timeout=60)
            assert receipt["terminal_state"] == "completed"
            fleet.wait_state(running, S.CANCELLED_ACCEPTED, timeout=60)
            tasks = fleet.mcp.tasks()
            assert sorted(t["arguments"]["seconds"] for t in tasks) == [2, 60]
    finally:
        ledger.dispose()
