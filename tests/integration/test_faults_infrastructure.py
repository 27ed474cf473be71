"""Issue 19, item 0 and 6: nothing sent by name is lost to a Postgres, Redis or worker fault.

Real Postgres and Redis (a private ``redis-server`` where a test stops it), longcall's MCP server, and the
executor in this process or a real fleet. Every wait is bounded (``support.wait_for``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.records import Operation
from ledger.states import OpState
from tests import support
from tests.integration.fleet import McpServer, fleet_config, start_mcp_server
from workers.executor import Executor
from workers.runtime import Runtime
from workers.settings import Settings
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


@pytest.fixture
def redis_down_executor(
    database_url: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, Executor, support.PrivateRedis]]:
    """The demo MCP server and an in-process executor whose hot state (buckets, holds, the cancel CAS) is
    on a ``redis-server`` of this test's own, which the test stops and starts."""
    mcp = start_mcp_server(log_dir, poll_interval_ms=200)
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=5000, control_qps=5000))
    with support.private_redis(tmp_path / "redis", log_dir, "--save", "", "--appendonly", "no") as hot:
        runtime = Runtime.from_settings(
            Settings(database_url=database_url, redis_url=hot.url, config=config, lease_s=30)
        )
        try:
            yield mcp, Executor(runtime), hot
        finally:
            runtime.close()
            mcp.process.stop()


def test_a_cancel_sent_while_redis_is_down_is_recorded_and_sent_once_redis_is_back(
    redis_down_executor: tuple[McpServer, Executor, support.PrivateRedis],
) -> None:
    """The intent goes to the ledger first; the hot generation is best effort. With Redis down no control
    token can be had, so the cancel request is not sent (rule 4) and the step is due again shortly, its
    claim let go; once Redis is back the dispatcher sends it, and the server's task ends cancelled."""
    mcp, executor, hot = redis_down_executor
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
