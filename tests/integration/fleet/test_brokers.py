"""RabbitMQ as longcall's broker, beside the default Redis (issue 9, "Brokers").

The end-to-end happy path, the cancel race and the input round trip run on both brokers in
tests/integration/steps/test_executor.py (parametrized over ``broker``); this module checks what is specific
to each: the transport options, that a RabbitMQ fleet really moves its messages through its own vhost with
durable queues, and that a publish RabbitMQ refuses (publisher confirms) leaves the receipt in the outbox.
Each RabbitMQ test has a vhost of its own; a RabbitMQ that is down fails the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests.support import (
    services as support,  # its RABBITMQ_URL is monkeypatched where rabbitmq_vhost reads it
)
from tests.support.fleet import Fleet, FleetParts, running_fleet
from tests.support.ledger_rows import evidence_for, place
from workers.app import BROKER_SOCKET_TIMEOUT_S, QUEUES, celery_config
from workers.settings import Settings

AMQP_URL = "amqp://guest:guest@rabbit:5672/fleet-a"


def test_the_amqp_broker_gets_confirms_and_none_of_the_redis_transport_options() -> None:
    config = celery_config(Settings(broker_url=AMQP_URL, broker_keyprefix="fleet-a:"))
    # kombu hands every broker transport option to py-amqp's Connection: only what it acts on is set.
    assert config["broker_transport_options"] == {
        "confirm_publish": True,
        "read_timeout": BROKER_SOCKET_TIMEOUT_S,
        "write_timeout": BROKER_SOCKET_TIMEOUT_S,
    }
    # The results stay in Redis, under the fleet's prefix.
    assert config["result_backend"] == "redis://127.0.0.1:6379/0"
    assert config["result_backend_transport_options"] == {"global_keyprefix": "fleet-a:"}
    # A step is acknowledged after it ran, one at a time per process; queues durable (messages persistent:
    # Celery's default delivery mode, not overridden).
    assert (config["task_acks_late"], config["worker_prefetch_multiplier"]) == (True, 1)
    assert "task_default_delivery_mode" not in config
    assert [(q.name, q.durable) for q in config["task_queues"]] == [(name, True) for name in QUEUES]


def test_the_redis_broker_keeps_its_visibility_timeout_and_key_prefix() -> None:
    options = celery_config(Settings(broker_keyprefix="fleet-a:"))["broker_transport_options"]
    assert options["visibility_timeout"] == 3600
    assert options["global_keyprefix"] == "fleet-a:"
    assert "confirm_publish" not in options


def test_a_rabbitmq_that_is_down_fails_the_test_that_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    nobody = support.free_port()  # nothing listens there
    monkeypatch.setattr(support, "RABBITMQ_URL", f"amqp://guest:guest@127.0.0.1:{nobody}//")
    with pytest.raises(RuntimeError, match=f"RabbitMQ is not reachable at 127.0.0.1:{nobody}"):  # noqa: SIM117
        with support.rabbitmq_vhost():
            pass


@pytest.mark.parametrize("broker", ["rabbitmq"])
def test_a_rabbitmq_fleet_moves_its_messages_through_its_vhost_on_durable_queues(fleet: Fleet) -> None:
    assert fleet.vhost is not None
    fleet.submit("n/report", "slow_report", {"seconds": 0.3})
    assert fleet.wait_receipt("n/report")["terminal_state"] == "completed"
    support.wait_for("the outbox and the pipeline to settle", fleet.settled)

    columns = ("name", "durable")
    listed = support.rabbitmqctl("list_queues", "-q", "--no-table-headers", "-p", fleet.vhost, *columns)
    durable = dict(line.split("\t") for line in listed.splitlines() if line)
    assert {name: durable.get(name) for name in (*QUEUES, "pipeline")} == dict.fromkeys(
        (*QUEUES, "pipeline"), "true"
    )
    for worker in fleet.workers():
        assert f"transport:   amqp://guest:**@127.0.0.1:5672/{fleet.vhost}" in worker.log()
    # Nothing went through Redis as a broker: no queue list under the fleet's prefix there.
    prefix = fleet.sink.removesuffix("sink")
    assert [fleet.redis.exists(f"{prefix}{name}") for name in (*QUEUES, "pipeline")] == [0] * 4


@pytest.mark.parametrize("broker", ["rabbitmq"])
def test_a_receipt_rabbitmq_refuses_stays_in_the_outbox_until_the_broker_takes_it(fleet: Fleet) -> None:
    """With publisher confirms a publish returns only once RabbitMQ has the message: one it refuses (here a
    full ``pipeline`` queue that rejects publishes) fails the drain and the row stays ready; without
    confirms the publish would return, the row be marked dispatched and the receipt be lost."""
    assert fleet.vhost is not None
    full = '{"max-length": 0, "overflow": "reject-publish"}'
    support.rabbitmqctl("set_policy", "-p", fleet.vhost, "full", "^pipeline$", full, "--apply-to", "queues")
    op_id = fleet.submit("n/refused", "quick_lookup", {"key": "k1"})
    fleet.wait_state(op_id, OpState.ACCEPTED)

    def refused() -> str | None:
        with fleet.ledger.engine.connect() as conn:
            row = conn.execute(text("SELECT attempts, last_error, dispatched_at FROM outbox")).one()
        assert row.dispatched_at is None, "the row was marked dispatched though RabbitMQ refused it"
        return str(row.last_error) if row.attempts >= 2 else None

    error = support.wait_for("two refused publishes of the receipt", refused)
    assert fleet.ledger.ready_outbox_count() == 1
    assert fleet.receipts() == []
    # kombu wraps py-amqp's MessageNacked (which carries no text) in an OperationalError.
    assert error.startswith("OperationalError"), error

    support.rabbitmqctl("clear_policy", "-p", fleet.vhost, "full")
    receipt = fleet.wait_receipt("n/refused")
    assert (receipt["terminal_state"], receipt["op_id"]) == ("completed", str(op_id))
    support.wait_for("the outbox and the pipeline to settle", fleet.settled)
    assert [r["call_node_id"] for r in fleet.receipts()] == ["n/refused"]


#: One drain of the outbox by the fleet's own app and publisher, in a process of its own (the environment
#: names the broker); prints what it did and how long it took.
DRAIN = """
import json, time
from ledger.repository import Ledger
from workers.app import app
from workers.delivery import publisher
ledger = Ledger.from_url(__import__("os").environ["LONGCALL_DATABASE_URL"])
started = time.monotonic()
report = ledger.drain_outbox(publisher(app))
print(json.dumps({"dispatched": len(report.dispatched), "failed": len(report.failed),
                  "seconds": round(time.monotonic() - started, 1)}))
"""


def _drain(database_url: str, broker_url: str) -> dict[str, float]:
    env = support.celery_env({"LONGCALL_DATABASE_URL": database_url, "LONGCALL_BROKER_URL": broker_url})
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", DRAIN],
        env=env,
        cwd=support.REPO,
        capture_output=True,
        timeout=10 * BROKER_SOCKET_TIMEOUT_S,  # a drain that waits for ever fails the test here
        check=False,
    )
    output = done.stdout.decode(errors="replace")
    assert done.returncode == 0, output + done.stderr.decode(errors="replace")[-3000:]
    report: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    return report


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_drain_while_rabbitmq_blocks_publishers_fails_in_bounded_time(
    ledger: Ledger, database_url: str
) -> None:
    """RabbitMQ in a disk (or memory) alarm stops reading from every publishing connection: the confirm never
    comes, nor the close-ok of a channel. Without a socket bound a drainer waited there for as long as the
    alarm lasted, holding its outbox rows and its worker process (seen: still waiting after 150 s). Now each
    read fails after BROKER_SOCKET_TIMEOUT_S, Celery's publish retries end, the drain reports the row
    failed, and it stays ready; once the alarm clears, the next drain delivers it."""
    op = place(ledger, OpState.FETCHING_RESULT)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert ledger.ready_outbox_count() == 1
    with support.private_rabbitmq() as node:
        node.ctl("set_disk_free_limit", "100000GB")
        support.wait_for("the disk alarm", lambda: "disk" in node.ctl("-q", "status").lower(), timeout=30)
        started = time.monotonic()
        report = _drain(database_url, node.url)
        assert (report["dispatched"], report["failed"]) == (0, 1), report
        # Four publish attempts and the channel closes after them, each at most one socket timeout.
        assert time.monotonic() - started < 8 * BROKER_SOCKET_TIMEOUT_S, report
        assert ledger.ready_outbox_count() == 1

        node.ctl("set_disk_free_limit", "1MB")
        assert _drain(database_url, node.url)["dispatched"] == 1
        assert ledger.ready_outbox_count() == 0


def test_a_drained_receipt_survives_a_rabbitmq_crash_before_it_is_consumed(
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    log_dir: Path,
) -> None:
    """The outbox marks a row dispatched once RabbitMQ confirmed the publish: the pipeline's worker is not
    running when the receipt is drained, the node is killed (-9) and started again on its data, then the
    pipeline's worker starts. The durable queue and the persistent message bring the receipt back: it is
    delivered, once. (The longcall workers lose their broker meanwhile and reconnect.)"""
    with support.private_rabbitmq() as node:
        parts = FleetParts(
            ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir, broker_url=node.url
        )
        with running_fleet(parts, workers=1, pipeline=False) as fleet:
            fleet.submit_nowait("n/durable", "slow_report", {"seconds": 0.2})
            op = fleet.wait_operation("n/durable", OpState.ACCEPTED, timeout=60)

            def pipeline_messages() -> int:
                listed = node.ctl("list_queues", "-q", "--no-table-headers", "name", "messages")
                counts = dict(line.split("\t") for line in listed.splitlines() if line)
                return int(counts.get("pipeline", "0"))

            support.wait_for("the receipt to be drained", lambda: fleet.ledger.ready_outbox_count() == 0)
            assert pipeline_messages() == 1  # published and confirmed, not consumed: nobody listens yet

            node.kill()
            node.start()

            assert pipeline_messages() == 1
            fleet.start_pipeline()
            receipt = fleet.wait_receipt("n/durable", timeout=60)
            assert (receipt["op_id"], receipt["terminal_state"]) == (str(op.id), "completed")
            support.wait_for("the pipeline to take it", lambda: pipeline_messages() == 0, timeout=60)
            assert [r["call_node_id"] for r in fleet.receipts()] == ["n/durable"]
            assert fleet.ledger.get(op.id).state is OpState.ACCEPTED
