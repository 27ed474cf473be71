"""Many polls per message (issue 21): the dispatcher sends the claimed polls of one server as one
``longcall.poll`` message, and a worker runs its members side by side, each fenced by its own cursor.

Real Postgres and Redis, longcall's MCP servers (a fast one and one whose status reads the test slows), an
in-process executor that submits and claims, and real worker processes that take the messages; no beat: the
test publishes each tick's messages itself.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import text

from ledger.events import EventKind
from ledger.states import OpState
from tests import support
from tests.support.fleet import McpServer, fleet_config, in_process_runtime, start_mcp_server
from workers.app import create_app
from workers.executor import Dispatch, Executor
from workers.submission import validate_submission
from workers.tasks import publish_dispatches

POLL_QUEUE = "longcall.poll"


@dataclass
class Setup:
    fast: McpServer
    slow: McpServer
    executor: Executor
    env: dict[str, str]
    log_dir: Path
    broker_prefix: str
    redis: redis.Redis
    workers: list[support.CeleryProcess]

    def submit(self, server: str, count: int, seconds: float = 3600) -> list[uuid.UUID]:
        ids = []
        for _ in range(count):
            new = validate_submission(
                {
                    "call_node_id": f"node-{uuid.uuid4()}",
                    "server": server,
                    "tool": "slow_report",
                    "arguments": {"seconds": seconds},
                },
                self.executor.rt.fleet,
                max_body_bytes=self.executor.rt.settings.max_body_bytes,
            )
            submission, step = self.executor.submit(new)
            assert step is not None
            assert step.state is OpState.WORKING
            ids.append(submission.operation.id)
        return ids

    def claim(self, count: int) -> list[Dispatch]:
        """One dispatcher tick, once ``count`` rows are due within it (the server's 200 ms interval)."""
        claimed: list[Dispatch] = []

        def all_claimed() -> bool:
            claimed.extend(self.executor.dispatch_due())
            return len(claimed) >= count

        support.wait_for(f"{count} polls to be claimed", all_claimed, timeout=10)
        assert len(claimed) == count
        return claimed

    def queued(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.redis.lrange(f"{self.broker_prefix}{POLL_QUEUE}", 0, -1)]

    @staticmethod
    def kwargs(message: dict[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = json.loads(base64.b64decode(message["body"]))[1]
        return kwargs

    def start_worker(self, name: str, concurrency: int) -> support.CeleryProcess:
        worker = support.start_worker(
            "workers.app",
            queues=POLL_QUEUE,
            env=self.env,
            log_dir=self.log_dir,
            name=name,
            concurrency=concurrency,
        )
        self.workers.append(worker)
        return worker

    def status_reads(self, server: McpServer) -> int:
        return sum(1 for entry in server.log() if entry["method"] == "tasks/get")

    def row_versions(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[int, int]]:
        """Each row's version (``xmin``: every UPDATE makes a new one, even of the same values) and its
        event count."""
        with self.executor.ledger.engine.begin() as conn:
            rows = conn.execute(
                text(
                    "SELECT o.id, o.xmin::text::bigint AS version,"
                    " (SELECT count(*) FROM operation_event e WHERE e.op_id = o.id) AS events"
                    " FROM tool_operation o WHERE o.id = ANY(:ids)"
                ),
                {"ids": ids},
            ).all()
        return {row.id: (int(row.version), int(row.events)) for row in rows}

    def succeeded(self, worker: support.CeleryProcess, task_id: str) -> int:
        return worker.log().count(f"[{task_id}] succeeded")

    @staticmethod
    def batches_done(worker: support.CeleryProcess, size: int) -> int:
        """How many batches of ``size`` members the worker ran to their end (a batch's message is answered
        when its members start; each batch says so once all are done)."""
        return worker.log().count(f"a batch of {size} polls is done")


@pytest.fixture
def setup(
    database_url: str, broker_prefix: str, redis_client: redis.Redis, tmp_path: Path, log_dir: Path
) -> Iterator[Setup]:
    fast = start_mcp_server(log_dir, poll_interval_ms=200)
    slow = start_mcp_server(log_dir, poll_interval_ms=200)
    config = tmp_path / "longcall.toml"
    config.write_text(
        fleet_config(fast.url, poll_qps=500, control_qps=500)
        + fleet_config(slow.url, poll_qps=500, control_qps=500).replace("servers.reports", "servers.slow")
    )
    runtime = in_process_runtime(database_url, broker_prefix, config, lease_s=30)
    env = {
        "LONGCALL_DATABASE_URL": database_url,
        "LONGCALL_REDIS_URL": support.REDIS_URL,
        "LONGCALL_BROKER_KEYPREFIX": broker_prefix,
        "LONGCALL_CONFIG": str(config),
        "LONGCALL_LEASE_S": "30",
    }
    made = Setup(fast, slow, Executor(runtime), env, log_dir, broker_prefix, redis_client, [])
    try:
        yield made
    finally:
        support.stop_all([*made.workers, fast.process, slow.process])
        runtime.close()


def _polled(setup: Setup, ids: list[uuid.UUID]) -> bool:
    """Every one of ``ids`` had its status read and its claim let go."""
    ops = [setup.executor.ledger.get(op_id, with_body=False) for op_id in ids]
    return all(op.last_polled_at is not None and op.lease_until is None for op in ops)


def test_a_batch_of_claimed_polls_is_one_message_and_every_member_is_polled(setup: Setup) -> None:
    ids = setup.submit("reports", 5)
    dispatches = setup.claim(5)
    app = create_app(setup.executor.rt.settings)

    assert publish_dispatches(app, dispatches, poll_batch=32) == 5

    [message] = setup.queued()
    ops = setup.kwargs(message)["ops"]
    assert sorted(uuid.UUID(op[0]) for op in ops) == sorted(ids)
    assert message["headers"]["id"].startswith("longcall.poll:batch:")
    setup.start_worker("batch", concurrency=1)
    support.wait_for("every member to be polled", lambda: _polled(setup, ids), timeout=30)
    assert setup.status_reads(setup.fast) == 5
    for op_id in ids:
        op = setup.executor.ledger.get(op_id)
        assert op.state is OpState.WORKING
        assert op.next_poll_at is not None


def test_a_batch_published_twice_polls_each_member_once(setup: Setup) -> None:
    """A redelivered or duplicated batch changes nothing: the second copy's members find their claims done
    (let go by the first copy's steps) and send no status read, write nothing, record no stale write."""
    ids = setup.submit("reports", 4)
    dispatches = setup.claim(4)
    app = create_app(setup.executor.rt.settings)
    publish_dispatches(app, dispatches, poll_batch=32)
    publish_dispatches(app, dispatches, poll_batch=32)
    first, second = setup.queued()
    assert first["headers"]["id"] == second["headers"]["id"]  # the same batch has one task id
    task_id = first["headers"]["id"]
    before = {op_id: setup.executor.ledger.get(op_id).event_seq for op_id in ids}

    worker = setup.start_worker("twice", concurrency=1)
    support.wait_for(
        "both copies to run to their end",
        lambda: (
            worker.log().count(f"[{task_id}] succeeded") == 2
            and worker.log().count("a batch of 4 polls is done") == 2
        ),
        timeout=30,
    )

    assert setup.status_reads(setup.fast) == 4
    for op_id in ids:
        op = setup.executor.ledger.get(op_id)
        assert op.last_polled_at is not None
        assert op.unchanged_polls == 1  # counted once: the second copy recorded nothing
        assert op.event_seq == before[op_id]  # an unchanged poll is counted on the row, not an event
        kinds = [e["kind"] for e in setup.executor.ledger.events(op_id)]
        assert EventKind.STALE_WRITE_REJECTED.value not in kinds
    # The second copy's members found their claims running here, or done: each did nothing.
    assert "a batch of 4 polls is done: {'nothing_to_do': 4}" in worker.log()


def test_a_slow_server_holds_up_neither_another_servers_batch_nor_its_own_members(setup: Setup) -> None:
    """Each status read of the slow server takes 3 s: its batch of four is done in about 3 s (its members
    side by side, not 12 s one after the other), and the fast server's batch, behind it in the queue, is
    polled meanwhile by the worker's other process."""
    slow_ids = setup.submit("slow", 4)
    fast_ids = setup.submit("reports", 4)
    setup.slow.faults(delay_ms={"tasks/get": 3000})
    dispatches = setup.claim(8)
    app = create_app(setup.executor.rt.settings)
    publish_dispatches(app, [d for d in dispatches if d.server == "slow"], poll_batch=32)
    publish_dispatches(app, [d for d in dispatches if d.server == "reports"], poll_batch=32)
    assert len(setup.queued()) == 2

    started = time.monotonic()
    setup.start_worker("isolated", concurrency=2)
    support.wait_for("the fast server's batch to be polled", lambda: _polled(setup, fast_ids), timeout=30)
    fast_done = time.monotonic()
    assert not _polled(setup, slow_ids)  # the slow reads are still on their way
    support.wait_for("the slow server's batch to be polled", lambda: _polled(setup, slow_ids), timeout=30)
    slow_done = time.monotonic()

    assert fast_done < slow_done
    # Side by side: one slow read's time, not four (the worker's start is in both figures).
    assert slow_done - started < fast_done - started + 3.0 + 6.0
    polled_at = [setup.executor.ledger.get(op_id).last_polled_at for op_id in slow_ids]
    stamps = sorted(p.timestamp() for p in polled_at if p is not None)
    assert stamps[-1] - stamps[0] < 2.0  # all four answered together, not 3 s apart


def test_one_worker_process_polls_a_fast_server_while_a_slow_servers_reads_are_on_their_way(
    setup: Setup,
) -> None:
    """A batch's members run on their server's threads after its message is answered: one worker process,
    which takes the slow server's batch first (every status read takes 4 s), takes the fast server's next
    and polls it at once, not after the slow reads."""
    slow_ids = setup.submit("slow", 4)
    fast_ids = setup.submit("reports", 4)
    setup.slow.faults(delay_ms={"tasks/get": 4000})
    dispatches = setup.claim(8)
    app = create_app(setup.executor.rt.settings)
    publish_dispatches(app, [d for d in dispatches if d.server == "slow"], poll_batch=32)
    publish_dispatches(app, [d for d in dispatches if d.server == "reports"], poll_batch=32)

    worker = setup.start_worker("one-process", concurrency=1)
    support.wait_for("the fast server's batch to be polled", lambda: _polled(setup, fast_ids), timeout=30)
    assert setup.status_reads(setup.slow) < 4 or not _polled(setup, slow_ids)  # still on their way
    slow_started = [e["t"] for e in setup.slow.log() if e["method"] == "tasks/get"]
    fast_polled = [e["t"] for e in setup.fast.log() if e["method"] == "tasks/get"]
    assert slow_started, "the slow batch was taken first"
    # The fast reads went while the slow ones were waited for (each 4 s), not after them.
    assert max(fast_polled) < min(slow_started) + 3.0
    support.wait_for("the slow server's batch to be polled", lambda: _polled(setup, slow_ids), timeout=30)
    assert "a batch of 4 polls is done" in worker.log()


def test_with_a_poll_batch_of_one_every_poll_is_a_message_of_its_own(setup: Setup) -> None:
    ids = setup.submit("reports", 3)
    dispatches = setup.claim(3)
    app = create_app(setup.executor.rt.settings)

    assert publish_dispatches(app, dispatches, poll_batch=1) == 3

    queued = setup.queued()
    assert sorted(setup.kwargs(m)["op_id"] for m in queued) == sorted(str(i) for i in ids)
    assert {m["headers"]["id"] for m in queued} == {d.task_id for d in dispatches}
    setup.start_worker("single", concurrency=1)
    support.wait_for("every poll to run", lambda: _polled(setup, ids), timeout=30)
    assert setup.status_reads(setup.fast) == 3


def test_a_copy_of_a_batch_that_comes_after_its_members_completed_changes_nothing(setup: Setup) -> None:
    """The first copy sees every member's task completed and accepts it (the result read in the same step);
    a copy of the same message afterwards (a redelivery, a dispatcher's retry) sends no request, writes no
    row and no event, and leaves the receipts as they were."""
    ids = setup.submit("reports", 3, seconds=0.2)
    support.wait_for(
        "the tasks to complete on the server",
        lambda: [t["status"] for t in setup.fast.tasks()] == ["completed"] * 3,
        timeout=15,
    )
    dispatches = setup.claim(3)
    app = create_app(setup.executor.rt.settings)
    publish_dispatches(app, dispatches, poll_batch=32)
    [message] = setup.queued()
    task_id = message["headers"]["id"]
    worker = setup.start_worker("late-copy", concurrency=1)
    support.wait_for(
        "the first copy to run",
        lambda: setup.succeeded(worker, task_id) == 1 and setup.batches_done(worker, 3) == 1,
        timeout=30,
    )
    assert {setup.executor.ledger.get(op_id).state for op_id in ids} == {OpState.ACCEPTED}
    requests = len(setup.fast.http_log())
    versions = setup.row_versions(ids)
    receipts = {op_id: setup.executor.ledger.receipt_for(op_id) for op_id in ids}
    assert all(receipt is not None for receipt in receipts.values())

    publish_dispatches(app, dispatches, poll_batch=32)
    support.wait_for(
        "the late copy to run",
        lambda: setup.succeeded(worker, task_id) == 2 and setup.batches_done(worker, 3) == 2,
        timeout=30,
    )

    assert len(setup.fast.http_log()) == requests  # no status read, no result read, nothing
    assert setup.row_versions(ids) == versions  # no row written, no event
    assert {op_id: setup.executor.ledger.receipt_for(op_id) for op_id in ids} == receipts
    assert "a batch of 3 polls is done: {'nothing_to_do': 3}" in worker.log()


def test_two_copies_of_a_batch_running_at_once_leave_each_member_as_one_would(setup: Setup) -> None:
    """A copy delivered while the first still runs (a worker that lost its broker connection gives back
    the messages it held while their steps go on, ``workers/broker.py``): both copies run side by side,
    each member under the same claim, so each may read the status (the claim is fenced, not the read).
    Neither leaves an event, a stale write or a claim behind, and each poll is counted once.

    A defect before: a member whose read outlasts the next poll its claim set is written by
    ``record_poll``, whose guard checked the state and the fence but not that the claim is still held, so
    the second copy's write landed after the first let the claim go: counted [2, 2, 2, 2]. Its guard now
    asks the claim too (``GuardedWrite.only_claimed``), and the second copy's refusal is quiet."""
    ids = setup.submit("reports", 4)
    dispatches = setup.claim(4)
    setup.fast.faults(delay_ms={"tasks/get": 1500})  # the first copy's reads still in flight
    app = create_app(setup.executor.rt.settings)
    publish_dispatches(app, dispatches, poll_batch=32)
    publish_dispatches(app, dispatches, poll_batch=32)
    task_id = setup.queued()[0]["headers"]["id"]
    before = setup.row_versions(ids)

    worker = setup.start_worker("side-by-side", concurrency=2)
    support.wait_for(
        "both copies to run",
        lambda: setup.succeeded(worker, task_id) == 2 and setup.batches_done(worker, 4) == 2,
        timeout=30,
    )

    ops = [setup.executor.ledger.get(op_id) for op_id in ids]
    for op in ops:
        assert (op.state, op.lease_until) == (OpState.WORKING, None)
        assert 1 <= op.unchanged_polls <= 2
        assert setup.row_versions([op.id])[op.id][1] == before[op.id][1]  # no event
        kinds = [e["kind"] for e in setup.executor.ledger.events(op.id)]
        assert EventKind.STALE_WRITE_REJECTED.value not in kinds
    assert 4 <= setup.status_reads(setup.fast) <= 8
    assert [op.unchanged_polls for op in ops] == [1] * 4
