"""A cancel does not wait behind batches of polls (issue 21).

A batch of polls is answered when its members start on their server's threads (``workers/members.py``), so
it holds no pool process while its status reads are in flight, and the worker takes a cancel on its control
queue at once, beside the polls: the shipped topology, one worker on every queue.

Real processes: longcall's MCP server, beat, the pipeline's worker and one longcall worker (two processes)
on every queue. Forty long operations on one server whose poll budget is saturated (5 polls/s for a poll
due every 200 ms each) and whose status reads take 2.5 s: every tick sends a batch of polls, whose reads
are in flight the whole time. Then cancels go, one every 0.4 s; each one's delay is from its send to the
server's receipt of its ``tasks/cancel`` (the server's own log). When a batch held the process that ran it
until its reads were answered, the same run measured delays of 0.9 s growing to 3.2 s (each cancel waiting
for a process a batch let go); now 0.01-0.2 s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet
from workers.app import QUEUES

S = OpState

OPERATIONS = 40
CANCELS = 8
SLOW_READ_MS = 2500


@pytest.fixture
def busy_fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    """A fleet as it is run: one worker (two processes) on every queue."""
    server = {"poll_qps": 5, "control_qps": 50}
    with running_fleet(fleet_parts, workers=0, server=server, env={"LONGCALL_LEASE_S": "10"}) as fleet:
        fleet.start_worker("longcall-all", queues=",".join(QUEUES), concurrency=2)
        yield fleet


def test_a_cancel_reaches_the_server_within_two_seconds_under_batches_of_slow_polls(
    busy_fleet: Fleet,
) -> None:
    fleet = busy_fleet
    sent = [fleet.submit_nowait(f"n/busy-{i}", "slow_report", {"seconds": 600}) for i in range(OPERATIONS)]
    ops = [uuid.UUID(s.get(timeout=60)["op_id"]) for s in sent]
    rows = [fleet.wait_state(op_id, S.WORKING, timeout=60) for op_id in ops]
    remote = {op.id: str(op.remote_id) for op in rows}
    fleet.mcp.faults(delay_ms={"tasks/get": SLOW_READ_MS})
    started = time.time()
    support.wait_for(
        "slow status reads in flight",
        lambda: sum(1 for e in fleet.mcp.log() if e["method"] == "tasks/get" and e["t"] > started) >= 4,
        timeout=30,
    )
    time.sleep(SLOW_READ_MS / 1000)  # a slow read's time: every pool process has a batch by now

    requested: dict[uuid.UUID, float] = {}
    for op_id in ops[:CANCELS]:
        requested[op_id] = time.time()
        fleet.send_nowait("longcall.cancel", op_id=str(op_id))
        time.sleep(0.4)

    def arrivals() -> dict[uuid.UUID, float] | None:
        first: dict[uuid.UUID, float] = {}
        for entry in fleet.mcp.log():
            if entry["method"] == "tasks/cancel":
                for op_id in requested:
                    if entry["task_id"] == remote[op_id]:
                        first.setdefault(op_id, entry["t"])
        return first if len(first) == CANCELS else None

    arrived = support.wait_for("every tasks/cancel to reach the server", arrivals, timeout=60)
    delays = sorted(arrived[op_id] - requested[op_id] for op_id in requested)
    fleet.mcp.faults(delay_ms={})  # the batches in flight end sooner: the fleet stops sooner
    assert delays[-1] < 2.0, f"a cancel waited {delays[-1]:.2f}s: {[round(d, 2) for d in delays]}"
    # The batches were in flight meanwhile: the poll worker ran them, the control worker none.
    [worker] = fleet.workers()
    assert "longcall.poll[longcall.poll:batch:" in worker.log()
