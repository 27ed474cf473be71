"""Durability (issue 8, items 13 and 14): a receipt survives the broker, and a fleet survives its Postgres
and its Redis restarting mid-run.

Each test starts services of its own (``redis-server``, ``initdb``/``pg_ctl``) on free ports, so the shared
Postgres and Redis stay up. The Redis is started with the command docker-compose.yml ships: what these tests
prove is what a user of the compose file gets. Real processes, bounded waits (``support.wait_for``).
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from sqlalchemy import text

from ledger.migrate import upgrade
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet

S = OpState

COMPOSE = yaml.safe_load((support.REPO / "docker-compose.yml").read_text())

#: A Redis that keeps nothing: no RDB snapshot, no append-only file (the negative control).
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


def compose_redis_flags() -> tuple[str, ...]:
    """The flags of the compose file's ``redis-server`` command (port, bind and dir are the test's own)."""
    command: list[str] = list(COMPOSE["services"]["redis"]["command"])
    assert command[0] == "redis-server", command
    return tuple(command[1:])


def outbox_status(ledger: Ledger, op_id: uuid.UUID) -> list[str]:
    with ledger.engine.begin() as conn:
        rows = conn.execute(
            text("SELECT status FROM outbox WHERE op_id = :id AND kind = 'terminal'"), {"id": op_id}
        ).all()
    return [r.status for r in rows]


def deliveries_of(fleet: Fleet, call_node_id: str) -> list[dict[str, Any]]:
    return [r for r in fleet.receipts() if r["call_node_id"] == call_node_id]


def exited(fleet: Fleet) -> list[str]:
    """longcall's processes (its workers and beat) that exited, with their exit codes. (The pipeline is the
    user's Celery app, on kombu's own transport.)"""
    return [
        f"{p.name}: {p.proc.returncode}"
        for p in fleet.processes
        if p.name != "pipeline" and p.proc.poll() is not None
    ]


@pytest.fixture
def broker_dir(tmp_path: Path) -> Path:
    return tmp_path / "redis"


# ------------------------------------------------------------------ 13. receipts survive the broker


def test_compose_redis_is_durable_for_every_acknowledged_write() -> None:
    """The shipped broker keeps an append-only file fsynced before it answers: a publish that returned is
    on disk (a crash of Redis, or of its host, loses nothing the outbox already marked dispatched)."""
    flags = compose_redis_flags()
    assert flags[flags.index("--appendonly") + 1] == "yes", flags
    assert flags[flags.index("--appendfsync") + 1] == "always", flags


@pytest.mark.parametrize("persistence", ["compose", "none"])
def test_a_drained_receipt_survives_a_broker_crash_before_it_is_consumed(
    persistence: str,
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    broker_dir: Path,
    tmp_path: Path,
    log_dir: Path,
) -> None:
    """The outbox marks a row dispatched when the publish returns. The pipeline's worker is not running
    when the receipt is drained; the broker then crashes (kill -9) and comes back; the pipeline's worker
    starts. With the compose file's Redis the receipt is delivered, once; with a Redis that keeps nothing
    (the negative control) the message is gone while the ledger says dispatched: that loss is what the
    durable broker closes."""
    flags = compose_redis_flags() if persistence == "compose" else NO_PERSISTENCE
    with support.private_redis(broker_dir, log_dir, *flags) as broker:
        client = redis.Redis.from_url(broker.url, socket_timeout=5)
        parts = FleetParts(ledger, database_url, broker_prefix, client, tmp_path, log_dir, broker.url)
        try:
            with running_fleet(parts, workers=1, pipeline=False) as fleet:
                fleet.submit_nowait("n/durable", "slow_report", {"seconds": 0.2})
                op = fleet.wait_operation("n/durable", S.ACCEPTED, timeout=60)
                support.wait_for(
                    "the receipt to be drained", lambda: outbox_status(ledger, op.id) == ["dispatched"]
                )
                queue = f"{broker_prefix}pipeline"
                assert client.llen(queue) == 1  # published, not consumed: nobody listens on it yet

                broker.restart(signal.SIGKILL)

                if persistence == "none":
                    # The ledger says dispatched, the broker has nothing: the downstream advance is lost.
                    assert outbox_status(ledger, op.id) == ["dispatched"]
                    assert client.llen(queue) == 0
                    return
                assert client.llen(queue) == 1
                fleet.start_pipeline()
                receipt = fleet.wait_receipt("n/durable", timeout=60)
                assert (receipt["op_id"], receipt["terminal_state"]) == (str(op.id), "completed")
                support.wait_for("the pipeline to settle", fleet.settled, timeout=60)
                assert len(deliveries_of(fleet, "n/durable")) == 1
        finally:
            client.close()


# ------------------------------------------------------------------ 14. Postgres and Redis restarts


FINAL = (S.ACCEPTED, S.CANCELLED_ACCEPTED)


def test_a_fleet_survives_its_postgres_and_its_redis_restarting_mid_run(
    broker_dir: Path, tmp_path: Path, log_dir: Path
) -> None:
    """A fleet on a Postgres and a Redis of its own (ledger; hot state, broker and pipeline), operations in
    flight. Postgres restarts (``pg_ctl restart -m fast``: every connection dropped); once the fleet has
    accepted a receipt on the new Postgres, Redis crashes (kill -9) and comes back. Every operation reaches a
    final state, the server holds one task per call node (no second create), and the pipeline receives every
    receipt: at least once, and every copy is the same receipt with the same outbox id (delivery is
    at-least-once: a receipt the pipeline held at the crash is redelivered; the outbox id dedupes it)."""
    nodes = {f"n/restart-{i}": round(3.0 + 0.6 * i, 1) for i in range(12)}
    with (
        support.private_postgres(log_dir) as postgres,
        support.private_redis(broker_dir, log_dir, *compose_redis_flags()) as hot,
    ):
        database_url = postgres.create_database("longcall")
        upgrade(database_url)
        ledger = Ledger.from_url(database_url)
        client = redis.Redis.from_url(hot.url, socket_timeout=5)
        parts = FleetParts(ledger, database_url, "lc-restarts:", client, tmp_path, log_dir, hot.url)
        try:
            with running_fleet(parts, workers=2, pipeline=False) as fleet:
                fleet.start_pipeline(app="tests.support.durable_pipeline_app")
                for node, seconds in nodes.items():
                    fleet.submit_nowait(node, "slow_report", {"seconds": seconds})
                # In flight: every create answered (a create cut by the restart is an unknown outcome,
                # rule 1, for an operator: not what this test is about).
                for node in nodes:
                    fleet.wait_operation(node, S.WORKING, S.TERMINAL_OBSERVED, S.FETCHING_RESULT, *FINAL)

                postgres.restart("fast")
                ledger.engine.dispose()  # the test's own pooled connections died with the server
                accepted_before = {r["call_node_id"] for r in fleet.receipts()}
                support.wait_for(
                    "a receipt accepted and delivered after the Postgres restart",
                    lambda: bool({r["call_node_id"] for r in fleet.receipts()} - accepted_before),
                    timeout=60,
                )
                pending = [n for n in nodes if fleet.wait_operation(n).state not in FINAL]
                assert pending, "every operation finished before the Redis restart: make them longer"

                hot.restart(signal.SIGKILL)

                # The workers ride the crash out (workers/broker.py; issue 19): none exits, none is restarted.
                def final(node: str) -> Callable[[], bool]:
                    def probe() -> bool:
                        assert not exited(fleet), exited(fleet)
                        return fleet.wait_operation(node).state in FINAL

                    return probe

                for node in nodes:
                    support.wait_for(f"the operation of {node} to be final", final(node), timeout=90)
                support.wait_for(
                    "every receipt delivered",
                    lambda: {r["call_node_id"] for r in fleet.receipts()} == set(nodes),
                    timeout=60,
                )
                support.wait_for("the pipeline to settle", fleet.settled, timeout=60)

                assert not exited(fleet), exited(fleet)
                receipts = fleet.receipts()
                by_outbox = {(r["outbox_id"], r["call_node_id"], r["receipt_id"]) for r in receipts}
                assert len(by_outbox) == len(nodes)  # one receipt and one outbox id per call node, none lost
                assert {r["terminal_state"] for r in receipts} == {"completed"}
                with ledger.engine.begin() as conn:
                    held = conn.execute(text("SELECT count(*) FROM terminal_receipt")).scalar_one()
                assert held == len(nodes)
                tasks = fleet.mcp.tasks()
                assert sorted(t["arguments"]["seconds"] for t in tasks) == sorted(nodes.values())
                assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == len(nodes)
        finally:
            client.close()
            ledger.dispose()
