"""A worker killed while it runs a batched ``longcall.poll`` (issue 21): no member is lost.

Real processes (longcall's MCP server, two longcall workers, beat, the pipeline's worker), real Postgres and
Redis, a two-second lease. Beat is stopped while the operations are created, so its first tick after it
starts again claims every one of them at once: one message of all the members. The server answers status
reads after 3 s, so the members' reads are in flight together when the worker that took the message is
killed (kill -9):

- the whole worker (main process and pool);
- its pool processes only (the main process starts new ones).

The message was answered when its members started on their server's threads (``workers/members.py``), so
the broker holds nothing to give back: the members' leases bring them back, each claimed again by the
dispatcher when its lease runs out and polled by whichever worker takes the new message. Either way every
operation is polled again after the kill and completes within a bound: one create each, one receipt each,
nothing handed to an operator.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
from sqlalchemy import text

from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet

S = OpState

MEMBERS = 5
#: How long the server takes to answer a status read while the batch is in flight.
SLOW_READ_MS = 3000
LEASE_S = 2
BATCH_RECEIVED = re.compile(r"longcall\.poll\[(longcall\.poll:batch:[^\]]+)\] received")


def receipt_rows(fleet: Fleet, op_id: uuid.UUID) -> int:
    with fleet.ledger.engine.begin() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM terminal_receipt WHERE op_id = :id"), {"id": op_id}
        ).scalar_one()
    return int(count)


def batch_taken(fleet: Fleet) -> tuple[support.CeleryProcess, str] | None:
    """The worker that received a batched poll, and the batch's task id."""
    for worker in fleet.workers():
        found = BATCH_RECEIVED.search(worker.log())
        if found is not None:
            return worker, found.group(1)
    return None


def reads_since(fleet: Fleet, remote_ids: dict[uuid.UUID, str], since: float) -> dict[uuid.UUID, int]:
    """The status reads of each operation the server received since ``since``."""
    log = fleet.mcp.log()
    return {
        op_id: sum(1 for e in log if e["method"] == "tasks/get" and e["task_id"] == remote and e["t"] > since)
        for op_id, remote in remote_ids.items()
    }


@pytest.mark.parametrize("kill", ["worker", "pool"])
def test_a_worker_killed_mid_batch_loses_no_member(fleet_parts: FleetParts, kill: str) -> None:
    with running_fleet(fleet_parts, env={"LONGCALL_LEASE_S": str(LEASE_S)}) as fleet:
        [beat] = [p for p in fleet.processes if p.name == "beat"]
        beat.stop()
        ops = [fleet.submit(f"n/member-{i}", "slow_report", {"seconds": 8}) for i in range(MEMBERS)]
        rows = [fleet.wait_state(op_id, S.WORKING) for op_id in ops]
        remote_ids = {op.id: str(op.remote_id) for op in rows}
        fleet.mcp.faults(delay_ms={"tasks/get": SLOW_READ_MS})
        fleet.start_beat("beat-again")  # its first tick claims every member at once

        worker, task_id = support.wait_for(
            "a worker to take the batch", lambda: batch_taken(fleet), timeout=30
        )
        assert task_id.endswith(f":{MEMBERS}"), task_id  # all of them in one message
        # Answered when its members started, long before their reads are: acknowledged, nothing held.
        support.wait_for(
            "the batch's message to be answered", lambda: f"[{task_id}] succeeded" in worker.log()
        )
        support.wait_for(
            "every member's status read to reach the server",
            lambda: all(n >= 1 for n in reads_since(fleet, remote_ids, 0).values()),
            timeout=15,
        )
        claimed = {op_id: fleet.ledger.get(op_id) for op_id in ops}
        assert all(op.lease_until is not None for op in claimed.values())
        killed_at = time.time()
        if kill == "worker":
            worker.kill()
        else:
            assert worker.kill_children(), f"{worker.name} has no pool processes to kill"
        fleet.mcp.faults(delay_ms={})

        # Every member is polled again after the kill, and completes: within the lease, the server's 8 s and
        # a few polls, not the visibility timeout's hour.
        receipts = {
            f"n/member-{i}": fleet.wait_receipt(f"n/member-{i}", timeout=LEASE_S + 30) for i in range(MEMBERS)
        }
        done_in = time.time() - killed_at
        assert {r["terminal_state"] for r in receipts.values()} == {"completed"}
        assert all(n >= 1 for n in reads_since(fleet, remote_ids, killed_at).values())
        support.wait_for("the outbox and the pipeline to settle", fleet.settled)

        assert sorted(r["call_node_id"] for r in fleet.receipts()) == sorted(receipts)  # one each
        for op_id in ops:
            op = fleet.ledger.get(op_id)
            assert op.state is S.ACCEPTED
            assert receipt_rows(fleet, op_id) == 1
            assert fleet.ledger.reconciliations_for(op_id) == []
            # Claimed again by the dispatcher once the killed process's lease ran out: a new cursor.
            assert op.poll_cursor > claimed[op_id].poll_cursor
        assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == MEMBERS  # no second create
        assert len(fleet.mcp.tasks()) == MEMBERS
        prefix = fleet.sink.removesuffix("sink")
        held = [raw for raw in fleet.redis.hvals(f"{prefix}unacked") if task_id.encode() in raw]
        assert held == []  # the broker held nothing back: the leases did the work
        assert fleet.received_count(task_id) == 1
        assert done_in < LEASE_S + 20, f"the members took {done_in:.1f}s after the kill"
