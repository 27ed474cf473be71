"""Issue 8, items 4, 7 and 11: a cancel is accepted in every non-final state and never dropped by a race, a
poll storm never delays a cancel, and a rollback fences a step already in flight.

Real processes (longcall's MCP server, longcall workers, beat, a pipeline worker), real Postgres and Redis;
the ``longcall`` command runs as its own process. Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from ledger.errors import StaleTransition
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation, ServerStatus
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet
from tests.support.ledger_rows import evidence_for, place
from workers.executor import Executor
from workers.submission import validate_submission

S = OpState

#: Long enough that no lease runs out under a create or a fetch the tests hold for a few seconds.
LONG_LEASE = {"LONGCALL_LEASE_S": "12"}


def methods(fleet: Fleet) -> list[str]:
    return [e["method"] for e in fleet.mcp.log()]


def kinds(ledger: Ledger, op_id: uuid.UUID) -> list[str]:
    return [e["kind"] for e in ledger.events(op_id)]


def receipts_of(ledger: Ledger, op_id: uuid.UUID) -> list[dict[str, Any]]:
    with ledger.engine.begin() as conn:
        rows = conn.execute(
            text("SELECT * FROM terminal_receipt WHERE op_id = :id"), {"id": op_id}
        ).mappings()
        return [dict(r) for r in rows]


def longcall(fleet: Fleet, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The ``longcall`` command as an operator runs it, against this fleet's ledger and broker."""
    return subprocess.run(
        [sys.executable, "-m", "console", *args],
        cwd=support.REPO,
        env=support.celery_env(fleet.env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def slow_lease_fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    with running_fleet(fleet_parts, env=LONG_LEASE) as fleet:
        yield fleet


# -------------------------------------------------------------------- item 4: every non-final state


def test_a_cancel_during_a_slow_create_cancels_the_one_task_the_create_made(slow_lease_fleet: Fleet) -> None:
    """The intent is recorded while the create call is in flight (SUBMITTING); the create's answer is still
    recorded (its remote id is never orphaned) and goes straight on to the cancel."""
    fleet = slow_lease_fleet
    fleet.mcp.faults(delay_ms={"tools/call": 8000})
    fleet.submit_nowait("n/cancel-in-create", "slow_report", {"seconds": 60})
    support.wait_for("the tools/call to reach the server", lambda: "tools/call" in methods(fleet))
    op = fleet.wait_operation("n/cancel-in-create")
    assert (op.state, op.submit_attempted_at is not None) == (S.SUBMITTING, True)

    answer = longcall(fleet, "cancel", "n/cancel-in-create", "--json")
    assert answer.returncode == 0, answer.stderr + answer.stdout
    assert '"cancel_recorded"' in answer.stdout, answer.stdout
    op = fleet.ledger.get(op.id)
    # Recorded at once, while the create is still waiting for its answer.
    assert (op.state, op.cancel_generation, op.remote_id) == (S.SUBMITTING, 1, None)

    receipt = fleet.wait_receipt("n/cancel-in-create", timeout=45)
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    [task] = fleet.mcp.tasks()
    assert task["status"] == "cancelled"
    assert receipt["remote_id"] == task["taskId"]
    assert methods(fleet).count("tools/call") == 1
    op = fleet.ledger.get(op.id)
    assert (op.state, op.remote_id, op.cancel_generation) == (S.CANCELLED_ACCEPTED, task["taskId"], 1)
    events = fleet.ledger.events(op.id)
    created = next(e for e in events if e["kind"] == "created")
    assert (created["from_state"], created["to_state"]) == ("SUBMITTING", "CANCEL_REQUESTED")
    assert "stale_write_rejected" not in [e["kind"] for e in events]


def lose_the_create(fleet: Fleet, call_node_id: str) -> Operation:
    """A create whose answer is lost: MCP has no lookup by key, so the operation goes to an operator with
    no remote id (the server did create the task)."""
    fleet.mcp.faults(lose_create_response=1)
    fleet.submit_nowait(call_node_id, "slow_report", {"seconds": 60})
    op = fleet.wait_operation(call_node_id, S.MANUAL_RECONCILIATION, timeout=45)
    assert op.remote_id is None
    return op


def test_a_cancel_of_an_operation_an_operator_holds_ends_cancelled_when_it_was_never_created(
    fleet: Fleet,
) -> None:
    op = lose_the_create(fleet, "n/cancel-manual-never")
    answer = longcall(fleet, "cancel", op.call_node_id)
    assert answer.returncode == 0, answer.stderr + answer.stdout
    assert "cancel_recorded" in answer.stdout
    op = fleet.ledger.get(op.id)
    assert (op.state, op.cancel_generation) == (S.MANUAL_RECONCILIATION, 1)
    assert "cancel_requested" in kinds(fleet.ledger, op.id)

    decided = longcall(
        fleet, "reconcile", op.call_node_id, "--never-created", "--evidence", "server log shows no create"
    )
    assert decided.returncode == 0, decided.stderr + decided.stdout
    receipt = fleet.wait_receipt("n/cancel-manual-never", timeout=30)
    assert (receipt["terminal_state"], receipt["result"], receipt["remote_id"]) == ("cancelled", None, None)
    op = fleet.wait_state(op.id, S.CANCELLED_ACCEPTED)
    assert methods(fleet).count("tools/call") == 1  # no create after the cancel
    assert "tasks/cancel" not in methods(fleet)
    assert [r.resolved_at is not None for r in fleet.ledger.reconciliations_for(op.id)] == [True]


def test_a_cancel_of_an_operation_an_operator_holds_is_sent_once_it_is_found(fleet: Fleet) -> None:
    op = lose_the_create(fleet, "n/cancel-manual-found")
    answer = longcall(fleet, "cancel", op.call_node_id)
    assert answer.returncode == 0, answer.stderr + answer.stdout
    [task] = fleet.mcp.tasks()
    assert task["status"] == "working"

    decided = longcall(
        fleet,
        "reconcile",
        op.call_node_id,
        "--found",
        task["taskId"],
        *(["--session", task["session"]] if task.get("session") else []),
        "--evidence",
        "the server's task list",
    )
    assert decided.returncode == 0, decided.stderr + decided.stdout
    assert "CANCEL_REQUESTED" in decided.stdout
    receipt = fleet.wait_receipt("n/cancel-manual-found", timeout=30)
    assert (receipt["terminal_state"], receipt["remote_id"]) == ("cancelled", task["taskId"])
    assert fleet.mcp.tasks()[0]["status"] == "cancelled"
    assert methods(fleet).count("tools/call") == 1
    op = fleet.ledger.get(op.id)
    assert (op.state, op.cancel_generation) == (S.CANCELLED_ACCEPTED, 1)


def give_cancel_history(ledger: Ledger, op: Operation) -> Operation:
    """An earlier cancel that found nothing and an operator who found the task still running: WORKING again
    with cancel generation 1 in the ledger."""
    fence = Fence(op.execution_epoch, op.cancel_generation)
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
        op.id, fence, remote_id=op.remote_id, session_ref=op.session_ref, detail={}, resolution="found"
    )


def test_a_cancel_is_sent_when_the_hot_generation_is_behind_the_ledger(fleet: Fleet) -> None:
    fleet.submit_nowait("n/hot-behind", "slow_report", {"seconds": 60})
    op = give_cancel_history(fleet.ledger, fleet.wait_operation("n/hot-behind", S.WORKING))
    assert (op.state, op.cancel_generation) == (S.WORKING, 1)
    # The hot copy says 0 (a Redis restored from an older snapshot): behind the ledger's 1.
    fleet.redis.set(f"{fleet.env['LONGCALL_BROKER_KEYPREFIX']}longcall:cancel:{op.id}", 0)

    answer = longcall(fleet, "cancel", str(op.id), "--json")
    assert answer.returncode == 0, answer.stderr + answer.stdout
    receipt = fleet.wait_receipt("n/hot-behind", timeout=30)
    assert receipt["terminal_state"] == "cancelled", answer.stdout
    assert fleet.ledger.get(op.id).cancel_generation == 2
    assert fleet.mcp.tasks()[0]["status"] == "cancelled"


@pytest.fixture
def executors(runtimes: Any) -> Any:
    """The MCP server and in-process executors (each its own pools, as separate workers)."""
    mcp, make = runtimes
    return mcp, lambda: Executor(make())


def test_a_poll_moving_the_operation_to_input_required_never_drops_the_cancel(executors: Any) -> None:
    """The cancel reads WORKING; before its ledger write a poll opens an input round (INPUT_REQUIRED). The
    intent still lands, and the cancel is sent."""
    mcp, make = executors
    canceller: Executor = make()
    poller: Executor = make()
    ledger = canceller.ledger
    submission, _ = canceller.submit(
        validate_submission(
            {
                "call_node_id": "n/raced",
                "server": "reports",
                "tool": "slow_report",
                "arguments": {"seconds": 60},
            },
            canceller.rt.fleet,
            max_body_bytes=canceller.rt.settings.max_body_bytes,
        )
    )
    op = ledger.get(submission.operation.id)
    assert op.state is S.WORKING

    hot = canceller.rt.hot
    bump = hot.bump_cancel_generation

    def poll_moves_first(op_id: uuid.UUID, expected: int, **kw: Any) -> tuple[bool, int]:
        current = poller.ledger.get(op_id)
        if current.state is S.WORKING:
            poller.ledger.ask_for_input(
                op_id,
                Fence(current.execution_epoch, current.cancel_generation),
                from_state=S.WORKING,
                input_round=1,
                request_json={"method": "elicitation/create", "params": {}},
                schema_digest="-",
                deadline=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
                status=_status("input_required"),
                gate_payload={"signature": None, "input_request": {}},
            )
        return bump(op_id, expected, **kw)

    hot.bump_cancel_generation = poll_moves_first  # type: ignore[method-assign]
    outcome = canceller.request_cancel(op.id)
    op = ledger.get(op.id)
    assert op.cancel_generation == 1, outcome
    assert op.state is S.CANCELLED_ACCEPTED, outcome
    trail = kinds(ledger, op.id)
    assert trail.index("input_required") < trail.index("cancel_requested"), trail
    assert mcp.tasks()[0]["status"] == "cancelled"


def _status(server_state: str) -> ServerStatus:
    return ServerStatus(server_state, None, None)


# ------------------------------------------------------------------- item 7: a poll storm and a cancel

STORM = 200
CANCELLED = 10


def test_a_poll_storm_never_delays_a_cancel(fleet_parts: FleetParts) -> None:
    """200 operations on one server with ``poll_qps = 5``: the status reads queue for poll tokens. Ten of
    the operations are cancelled mid-run: each cancel is confirmed within 2 s of its request, and none is
    overtaken by the completion the task would have reached."""
    server = {"poll_qps": 5, "control_qps": 20}
    with running_fleet(fleet_parts, server=server, env=LONG_LEASE) as fleet:
        for index in range(STORM - CANCELLED):
            fleet.submit_nowait(f"n/storm-{index}", "slow_report", {"seconds": 600})
        for index in range(CANCELLED):
            fleet.submit_nowait(f"n/target-{index}", "slow_report", {"seconds": 25})

        def working() -> bool:
            with fleet.ledger.engine.begin() as conn:
                count = conn.execute(
                    text("SELECT count(*) FROM tool_operation WHERE state = 'WORKING'")
                ).scalar_one()
            return int(count) == STORM

        support.wait_for("every operation to be created", working, timeout=90)
        # The storm: every row is due and the poll bucket hands out 5 reads a second.
        support.wait_for(
            "steps refused for want of a poll token",
            lambda: sum(fleet.ledger.get(op.id).no_token_count for op in targets(fleet)) >= CANCELLED,
            timeout=30,
        )
        requested: dict[str, float] = {}
        for op in targets(fleet):
            requested[op.call_node_id] = time.time()
            fleet.send_nowait("longcall.cancel", op_id=str(op.id))

        late: dict[str, float] = {}
        for op in targets(fleet):
            receipt = fleet.wait_receipt(op.call_node_id, timeout=40)
            assert receipt["terminal_state"] == "cancelled", (op.call_node_id, receipt)
            accepted = dt.datetime.fromisoformat(receipt["accepted_at"]).timestamp()
            if accepted - requested[op.call_node_id] > 2.0:
                late[op.call_node_id] = round(accepted - requested[op.call_node_id], 2)
        assert late == {}, f"cancels confirmed later than 2 s after their request: {late}"
        assert sum(1 for t in fleet.mcp.tasks() if t["status"] == "cancelled") == CANCELLED


def targets(fleet: Fleet) -> list[Operation]:
    found = [fleet.ledger.find_by_call_node(f"n/target-{index}") for index in range(CANCELLED)]
    return [op for op in found if op is not None]


# ----------------------------------------------------------------------- item 11: rollback fences at once


def test_a_rollback_fences_a_step_already_in_flight(slow_lease_fleet: Fleet) -> None:
    """A result fetch is held in its ``tasks/result`` call when ``longcall rollback`` runs: its answer
    arrives after the rollback and is refused (recorded as stale); the new epoch fetches again and gives
    the one receipt."""
    fleet = slow_lease_fleet
    fleet.mcp.faults(delay_ms={"tasks/result": 4000})
    fleet.submit_nowait("n/rolled-back", "slow_report", {"seconds": 0.2})
    op = fleet.wait_operation("n/rolled-back", S.FETCHING_RESULT, timeout=30)
    support.wait_for("the tasks/result to reach the server", lambda: "tasks/result" in methods(fleet))
    assert op.execution_epoch == 1

    rolled = longcall(fleet, "rollback", "--json")
    assert rolled.returncode == 0, rolled.stderr + rolled.stdout
    assert fleet.ledger.control().execution_epoch == 2
    fleet.mcp.faults(delay_ms={})

    stale = support.wait_for(
        "the old epoch's acceptance to be refused",
        lambda: (
            [
                e
                for e in fleet.ledger.events(op.id)
                if e["kind"] == "stale_write_rejected" and e["detail"].get("attempted") == "accept_terminal"
            ]
            or None
        ),
        timeout=20,
    )
    assert stale[0]["detail"]["expected"]["execution_epoch"] == 1
    receipt = fleet.wait_receipt("n/rolled-back", timeout=40)
    assert (receipt["terminal_state"], receipt["execution_epoch"]) == ("completed", 2)
    support.wait_for("the outbox and the pipeline to settle", fleet.settled)
    [row] = receipts_of(fleet.ledger, op.id)
    assert row["execution_epoch"] == 2
    assert [r["execution_epoch"] for r in fleet.receipts()] == [2]
    accepted = [e for e in fleet.ledger.events(op.id) if e["kind"] == "terminal_accepted"]
    assert [e["execution_epoch"] for e in accepted] == [2]
    assert methods(fleet).count("tasks/result") == 2


def test_a_cancelled_receipt_without_a_create_needs_no_create_attempted(ledger: Ledger) -> None:
    """SUBMITTING -> CANCELLED_ACCEPTED only while no create was attempted: one in flight may have made a
    task, whose remote id the create's answer still brings (then the cancel is sent to it)."""
    op = place(ledger, S.SUBMITTING)
    op = ledger.record_create_attempt(op.id, op.fence, descriptor_version=None, detail={})
    op = ledger.record_cancel_intent(op.id, op.fence, from_state=S.SUBMITTING)
    assert (op.state, op.cancel_generation) == (S.SUBMITTING, 1)
    refused = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.CANCELLED))
    assert refused.outcome == "rejected"
    assert ledger.get(op.id).state is S.SUBMITTING


def test_a_write_of_an_older_epoch_is_refused_even_where_the_row_was_not_taken_over(ledger: Ledger) -> None:
    """Rule 13 in the statement itself: a row the rollback's take-over did not see (inserted by a
    transaction still open then) keeps the old epoch, and its old-epoch writer is refused all the same."""
    op = place(ledger, S.FETCHING_RESULT)
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE executor_control SET execution_epoch = execution_epoch + 1"))
    assert ledger.get(op.id).execution_epoch == 1
    with pytest.raises(StaleTransition):
        ledger.correct_observed_terminal(
            op.id, op.fence, state=S.FETCHING_RESULT, kind=TerminalKind.FAILED, was=TerminalKind.COMPLETED
        )
    rejected = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert rejected.outcome == "rejected"
    assert ledger.receipt_for(op.id) is None
    assert kinds(ledger, op.id).count("stale_write_rejected") == 2
