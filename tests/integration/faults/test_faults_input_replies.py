"""Issue 19, items 5 and 6: an answer to the approval gate is stored with its round, then sent; a step that
finds it not taken by the server sends the same reply again; a round answered and still asked goes to an
operator within a bound; a Redis outage never loses an answer.

Real processes (longcall's MCP server with its fault switches, longcall workers, beat, a pipeline worker)
or the executor in this process; real Postgres and Redis. Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.reasons import ReconciliationReason
from ledger.states import OpState
from tests import support
from tests.support.fleet import (
    Fleet,
    FleetParts,
    McpServer,
    in_process_executor,
    run_due,
    running_fleet,
    step_until,
)
from workers import logs
from workers.executor import Executor
from workers.steps import input_rounds
from workers.steps.context import StepAction, StepOutcome
from workers.steps.reconciliation import Resolution
from workers.submission import validate_submission

S = OpState
APPROVE = {"action": "accept", "content": {"approved": True}}


@pytest.fixture
def input_fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    env = {"LONGCALL_LEASE_S": "30", "LONGCALL_INPUT_REPLY_S": "4"}
    with running_fleet(fleet_parts, env=env) as fleet:
        yield fleet


def gate_rounds(fleet: Fleet, op_id: uuid.UUID) -> list[int]:
    return [r["input_round"] for r in fleet.input_requests() if r["op_id"] == str(op_id)]


def asked(fleet: Fleet, call_node_id: str) -> uuid.UUID:
    op_id = fleet.submit(call_node_id, "ask_approval", {"question": "Ship it?"})
    support.wait_for("the approval gate to be asked", lambda: gate_rounds(fleet, op_id) or None)
    return op_id


def test_a_reply_whose_post_is_refused_is_sent_again_and_taken(input_fleet: Fleet) -> None:
    """The reply's POST meets a closed connection (the server never took it; it asks once and does not
    show the question again). The reply was stored first, so the next step sends the same reply again:
    one round, the server takes it, the task ends as approved, no operator."""
    fleet = input_fleet
    fleet.mcp.faults(refuse_reply=1)
    op_id = asked(fleet, "n/reply-refused")

    fleet.send("longcall.provide_input", op_id=str(op_id), input_round=1, response=APPROVE)

    receipt = fleet.wait_receipt("n/reply-refused")
    assert (receipt["terminal_state"], receipt["result"]["content"][0]["text"]) == ("completed", "approved")
    assert [r["outcome"] for r in fleet.mcp.replies()] == ["refused", "taken"]
    assert gate_rounds(fleet, op_id) == [1]
    assert fleet.ledger.reconciliations_for(op_id) == []


def test_a_redelivered_provide_input_sends_the_reply_once(input_fleet: Fleet) -> None:
    """The same answer sent twice (a redelivered message, or a caller that tried again after a lost
    answer) is one reply: the second is answered as a repeat and sends nothing."""
    fleet = input_fleet
    op_id = asked(fleet, "n/reply-twice")

    first = fleet.send("longcall.provide_input", op_id=str(op_id), input_round=1, response=APPROVE)
    second = fleet.send("longcall.provide_input", op_id=str(op_id), input_round=1, response=APPROVE)

    assert first["action"] in ("input_provided", "input_recorded"), first
    assert second["action"] == "input_recorded", second
    assert second["detail"]["repeat"] is True
    receipt = fleet.wait_receipt("n/reply-twice")
    assert receipt["terminal_state"] == "completed"
    assert [r["outcome"] for r in fleet.mcp.replies()] == ["taken"]


def test_a_round_answered_and_still_asked_goes_to_an_operator_within_the_bound(input_fleet: Fleet) -> None:
    """The server took the reply's POST (202) but the task still waits for input: past input_reply_s
    (4 s here) after the reply was taken, an operator decides (INPUT_REPLY_NOT_TAKEN), never a silent
    poll until the wait budget ends, nor a second round."""
    fleet = input_fleet
    fleet.mcp.faults(ignore_reply=1)
    op_id = asked(fleet, "n/reply-ignored")

    fleet.send("longcall.provide_input", op_id=str(op_id), input_round=1, response=APPROVE)

    op = fleet.wait_state(op_id, S.MANUAL_RECONCILIATION, timeout=30)
    records = fleet.ledger.reconciliations_for(op.id)
    assert [r.reason for r in records] == [ReconciliationReason.INPUT_REPLY_NOT_TAKEN]
    assert records[0].detail["input_round"] == 1
    assert gate_rounds(fleet, op_id) == [1]
    assert [r["outcome"] for r in fleet.mcp.replies()] == ["ignored"]


# ------------------------------------------------------------------------- in process: died, Redis down


def waiting_for_input(executor: Executor, call_node_id: str) -> uuid.UUID:
    new = validate_submission(
        {
            "call_node_id": call_node_id,
            "server": "reports",
            "tool": "ask_approval",
            "arguments": {"question": "Ship it?"},
        },
        executor.rt.fleet,
        max_body_bytes=executor.rt.settings.max_body_bytes,
    )
    op_id = executor.ledger.record_submission(new).operation.id
    step_until(executor, op_id, S.INPUT_REQUIRED)
    return op_id


def test_a_reply_stored_by_a_worker_that_died_before_sending_it_is_sent_by_the_next_step(
    private_redis_executor: tuple[McpServer, Executor, support.PrivateRedis],
) -> None:
    """The worker that took the answer stored it and died before its POST: the next step finds the round
    answered and not taken, and sends the stored reply; the task ends as approved."""
    mcp, executor, _ = private_redis_executor
    op_id = waiting_for_input(executor, "n/reply-died")
    op = executor.ledger.get(op_id)

    with logs.bind():  # as the executor's entry points do: the step's log context ends with it
        stored = input_rounds.record_reply(executor.ctx, op, 1, APPROVE)  # ... and the worker is killed here

    assert not isinstance(stored, StepOutcome)
    assert stored.state is S.WORKING
    assert mcp.replies() == []
    step_until(executor, op_id, S.ACCEPTED)
    assert [r["outcome"] for r in mcp.replies()] == ["taken"]
    assert executor.ledger.get(op_id).result["content"][0]["text"] == "approved"


def test_an_answer_sent_while_redis_is_down_is_recorded_and_sent_once_redis_is_back(
    private_redis_executor: tuple[McpServer, Executor, support.PrivateRedis],
) -> None:
    """With Redis down no control token can be had: the answer is stored all the same (the task answers
    that it is recorded, not a failure), nothing is sent outside the budget, and once Redis is back the
    next step sends the stored reply."""
    mcp, executor, hot = private_redis_executor
    op_id = waiting_for_input(executor, "n/reply-redis-down")

    hot.stop()
    outcome = executor.provide_input(op_id, 1, APPROVE)

    assert outcome.action in ("input_recorded", "no_token"), outcome
    assert executor.ledger.get(op_id).state is S.WORKING
    assert mcp.replies() == []
    hot.start()
    step_until(executor, op_id, S.ACCEPTED)
    assert [r["outcome"] for r in mcp.replies()] == ["taken"]


def test_a_reply_the_server_refuses_lets_its_claim_go_and_the_row_is_polled_again_at_once(
    private_redis_executor: tuple[McpServer, Executor, support.PrivateRedis],
) -> None:
    """The server refuses the reply (HTTP 400, a JSON-RPC error): the reply is given up, the round marked
    so, and the claim the answer's step took is let go, the row due at once: the next poll sees what the
    server asks now, as after a reply it took, not when the step's 30 s lease runs out."""
    mcp, executor, _ = private_redis_executor
    op_id = waiting_for_input(executor, "n/reply-rejected")
    mcp.faults(reject_reply=1)

    outcome = executor.provide_input(op_id, 1, APPROVE)

    assert outcome.action is StepAction.INPUT_REPLY_REFUSED, outcome
    assert [r["outcome"] for r in mcp.replies()] == ["rejected"]
    op = executor.ledger.get(op_id)
    assert op.state is S.WORKING
    assert op.input_request is not None
    assert op.input_request["reply_failed"] is True
    assert op.lease_until is None, "the refused reply's step kept its claim: no poll until its lease ran out"
    assert [d.op_id for d in executor.dispatch_due()] == [op_id]


def test_an_answer_whose_reply_a_poll_sent_first_lets_its_claim_go(
    private_redis_executor: tuple[McpServer, Executor, support.PrivateRedis],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the answer's record and its claim, the dispatcher's step claims the row (due at once) and
    sends the stored reply. The answer's own claim then finds nothing to send: it goes back, the row due as
    the reply's step left it, rather than held until the claim's 30 s lease runs out."""
    mcp, executor, _ = private_redis_executor
    op_id = waiting_for_input(executor, "n/reply-sent-first")
    record = executor._record_reply

    def recorded_then_sent_by_a_poll(op: uuid.UUID, input_round: int, response: dict[str, Any]) -> Any:
        stored = record(op, input_round, response)
        run_due(executor)  # the dispatcher's tick: its step sends the stored reply
        assert [r["outcome"] for r in mcp.replies()] == ["taken"]
        return stored

    monkeypatch.setattr(executor, "_record_reply", recorded_then_sent_by_a_poll)

    outcome = executor.provide_input(op_id, 1, APPROVE)

    assert outcome.action is StepAction.NOTHING_TO_DO, outcome
    op = executor.ledger.get(op_id)
    assert op.lease_until is None, "the answer's claim was kept: no step until its lease ran out"
    assert [r["outcome"] for r in mcp.replies()] == ["taken"]
    step_until(executor, op_id, S.ACCEPTED, timeout=15)


def test_an_answer_whose_operation_ended_before_its_claim_leaves_the_final_row_unscheduled(
    private_redis_executor: tuple[McpServer, Executor, support.PrivateRedis],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, and the operation even ended (its receipt accepted) before the answer's claim: the claim
    finds nothing to send and the row, final, keeps no schedule (a hand-back would have made it due, which
    a final row may never be)."""
    mcp, executor, _ = private_redis_executor
    op_id = waiting_for_input(executor, "n/reply-ended-first")
    record = executor._record_reply

    def recorded_then_ended(op: uuid.UUID, input_round: int, response: dict[str, Any]) -> Any:
        stored = record(op, input_round, response)
        step_until(executor, op, S.ACCEPTED)  # the dispatcher's steps send the reply, and the task ends
        return stored

    monkeypatch.setattr(executor, "_record_reply", recorded_then_ended)

    outcome = executor.provide_input(op_id, 1, APPROVE)

    assert outcome.action is StepAction.NOTHING_TO_DO, outcome
    op = executor.ledger.get(op_id)
    assert op.state is S.ACCEPTED
    assert op.next_poll_at is None
    assert [r["outcome"] for r in mcp.replies()] == ["taken"]


# ------------------------------------------- an operator's "found" after a round's bound: the answer lives


@pytest.fixture
def short_bounds(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, Executor]]:
    """A reply not delivered goes to an operator after 2 s (a round may wait for its answer a minute)."""
    with in_process_executor(database_url, broker_prefix, tmp_path, log_dir, input_reply_s=2) as made:
        yield made


@pytest.fixture
def short_deadline(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, Executor]]:
    """A round not answered goes to an operator after 2 s."""
    with in_process_executor(database_url, broker_prefix, tmp_path, log_dir, input_timeout_s=2) as made:
        yield made


def found(executor: Executor, op_id: uuid.UUID) -> None:
    """The operator's ``longcall reconcile --found``: the task is alive on the server under its remote id."""
    op = executor.ledger.get(op_id)
    assert op.remote_id is not None
    executor.resolve(
        op_id, Resolution("found", evidence="the task is alive", actor="ops", remote_id=op.remote_id)
    )


def test_a_reply_not_delivered_in_its_bound_is_sent_once_an_operator_finds_the_task(
    short_bounds: tuple[McpServer, Executor],
) -> None:
    """Every POST of the stored reply is refused for longer than input_reply_s: an operator is told
    (INPUT_REPLY_NOT_TAKEN). The operator finds the task alive: the caller's answer, stored and never
    taken, is sent again under a fresh bound, not handed back at once (the round's reply would then be
    lost: no new one is taken while the operation is not waiting for input)."""
    mcp, executor = short_bounds
    op_id = waiting_for_input(executor, "n/reply-found")
    mcp.faults(refuse_reply=1000)
    executor.provide_input(op_id, 1, APPROVE)
    step_until(executor, op_id, S.MANUAL_RECONCILIATION)
    [record] = executor.ledger.reconciliations_for(op_id)
    assert record.reason is ReconciliationReason.INPUT_REPLY_NOT_TAKEN
    refused = len(mcp.replies())
    assert refused >= 1
    assert {r["outcome"] for r in mcp.replies()} == {"refused"}

    mcp.faults(refuse_reply=0)
    found(executor, op_id)
    step_until(executor, op_id, S.ACCEPTED, S.MANUAL_RECONCILIATION, timeout=20)

    assert executor.ledger.get(op_id).state is S.ACCEPTED
    assert [r["outcome"] for r in mcp.replies()][refused:] == ["taken"]
    assert executor.ledger.get(op_id).result["content"][0]["text"] == "approved"
    assert len(executor.ledger.reconciliations_for(op_id)) == 1


def test_a_round_past_its_deadline_is_asked_again_once_an_operator_finds_the_task(
    short_deadline: tuple[McpServer, Executor],
) -> None:
    """Nobody answered round 1 before its deadline: an operator is told (DEADLINE_EXCEEDED). The operator
    finds the task alive, and the server still asks the same question: that is a new round, asked of the
    gate and answered, not a question taken for answered and polled in silence until the wait budget
    ends."""
    mcp, executor = short_deadline
    op_id = waiting_for_input(executor, "n/round-found")
    support.wait_for(
        "round 1's deadline to pass",
        lambda: executor.reconcile() and executor.ledger.get(op_id).state is S.MANUAL_RECONCILIATION,
        timeout=15,
    )
    [record] = executor.ledger.reconciliations_for(op_id)
    assert record.reason is ReconciliationReason.DEADLINE_EXCEEDED

    found(executor, op_id)
    step_until(executor, op_id, S.INPUT_REQUIRED, S.MANUAL_RECONCILIATION, timeout=10)
    op = executor.ledger.get(op_id)
    assert (op.state, op.input_round) == (S.INPUT_REQUIRED, 2)
    executor.provide_input(op_id, 2, APPROVE)
    step_until(executor, op_id, S.ACCEPTED)
    assert [r["outcome"] for r in mcp.replies()] == ["taken"]
    assert executor.ledger.get(op_id).result["content"][0]["text"] == "approved"


def test_a_reply_delivered_twice_at_once_is_answered_as_a_repeat_not_a_stale_write(
    short_bounds: tuple[McpServer, Executor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two copies of one answer run side by side (a redelivered message, a caller trying again): the second
    read the row, still waiting for input, before the first stored the reply, so its write is stale. It is
    answered as a repeat (the reply is recorded), not failed with a stale write that tells its caller the
    answer was lost; one reply reaches the server."""
    mcp, executor = short_bounds
    op_id = waiting_for_input(executor, "n/reply-race")
    before = executor.ledger.get(op_id)  # the second copy's read, made before the first copy's write
    executor.provide_input(op_id, 1, APPROVE)
    reads = iter([before])
    get = executor.ledger.get
    monkeypatch.setattr(executor.ledger, "get", lambda *a, **k: next(reads, None) or get(*a, **k))

    second = executor.provide_input(op_id, 1, APPROVE)

    assert second.action is StepAction.INPUT_RECORDED, second
    assert second.detail["repeat"] is True
    step_until(executor, op_id, S.ACCEPTED)
    assert [r["outcome"] for r in mcp.replies()] == ["taken"]
