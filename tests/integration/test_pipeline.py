"""End to end through real worker processes: a pipeline that imports nothing of longcall enqueues
``longcall.submit`` by name, and after acceptance its own downstream task receives the receipt exactly once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import text

from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.integration.helpers import evidence_for
from tests.integration.pipeline_app import make_app
from workers.delivery import DELIVERY_NAMESPACE

CONFIG = """
[servers.reports]
protocol = "mcp"
protocol_version = "2025-11-25"
url = "http://127.0.0.1:9/mcp"
"""


@dataclass
class Fleet:
    pipeline: Celery
    sink: str
    redis: redis.Redis
    ledger: Ledger

    def deliveries(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.redis.lrange(self.sink, 0, -1)]


@pytest.fixture
def fleet(
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    log_dir: Path,
) -> Iterator[Fleet]:
    config = tmp_path / "longcall.toml"
    config.write_text(CONFIG)
    sink = f"{broker_prefix}sink"
    longcall_env = {
        "LONGCALL_DATABASE_URL": database_url,
        "LONGCALL_REDIS_URL": support.REDIS_URL,
        "LONGCALL_BROKER_KEYPREFIX": broker_prefix,
        "LONGCALL_CONFIG": str(config),
        "LONGCALL_OUTBOX_INTERVAL_S": "0.5",
    }
    pipeline_env = {
        "PIPELINE_BROKER_URL": support.REDIS_URL,
        "PIPELINE_KEYPREFIX": broker_prefix,
        "PIPELINE_SINK": sink,
    }
    processes = [
        support.start_worker(
            "workers.app",
            queues="longcall.control,longcall.outbox",
            env=longcall_env,
            log_dir=log_dir,
            name="longcall",
        ),
        support.start_celery(
            ["-A", "workers.app", "beat", "-s", str(tmp_path / "beat-schedule"), "--loglevel", "INFO"],
            env=longcall_env,
            log_dir=log_dir,
            name="beat",
            ready_marker="beat: Starting",
        ),
        support.start_worker(
            "tests.integration.pipeline_app",
            queues="pipeline",
            env=pipeline_env,
            log_dir=log_dir,
            name="pipeline",
            concurrency=1,
        ),
    ]
    with support.running(processes):
        yield Fleet(make_app(support.REDIS_URL, broker_prefix, sink), sink, redis_client, ledger)


def _submit(fleet: Fleet, **kwargs: Any) -> Any:
    return fleet.pipeline.send_task("longcall.submit", kwargs=kwargs, queue="longcall.control").get(
        timeout=30
    )


def test_a_pipeline_reaches_longcall_by_name_and_gets_its_receipt_once(fleet: Fleet) -> None:
    on_terminal = dict(
        fleet.pipeline.signature("pipeline.record", kwargs={"step": "after-report"}, queue="pipeline")
    )
    call = {
        "call_node_id": "run-7/report",
        "server": "reports",
        "tool": "slow_report",
        "arguments": {"month": "2026-11"},
        "on_terminal": on_terminal,
    }
    summary = _submit(fleet, **call)
    assert summary["created"] is True
    assert summary["state"] == "SUBMITTING"
    again = _submit(fleet, **call)  # the same call node and request: the same operation
    assert (again["op_id"], again["created"]) == (summary["op_id"], False)

    # Remote calls arrive with the executor; here acceptance is driven directly on the ledger.
    ledger = fleet.ledger
    op = ledger.get(uuid.UUID(summary["op_id"]))
    op = ledger.transition(
        op.id, op.fence, OpState.WORKING, from_states=[OpState.SUBMITTING], values={"remote_id": "task-1"}
    )
    op = ledger.transition(
        op.id,
        op.fence,
        OpState.TERMINAL_OBSERVED,
        from_states=[OpState.WORKING],
        values={"observed_terminal": TerminalKind.COMPLETED, "server_state": "completed"},
    )
    op = ledger.transition(op.id, op.fence, OpState.FETCHING_RESULT, from_states=[OpState.TERMINAL_OBSERVED])
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert acceptance.accepted
    assert acceptance.receipt is not None

    # beat's drain_outbox delivers it.
    support.wait_for("the downstream task to receive the receipt", lambda: fleet.deliveries() or None)

    # More drains find nothing to send; a sentinel behind them proves the pipeline queue is empty.
    for _ in range(3):
        fleet.pipeline.send_task("longcall.drain_outbox", queue="longcall.outbox").get(timeout=30)
    fleet.pipeline.send_task("pipeline.record", kwargs={"sentinel": True}, queue="pipeline")
    support.wait_for("the sentinel", lambda: any("sentinel" in d["kwargs"] for d in fleet.deliveries()))

    receipts = [d for d in fleet.deliveries() if "receipt" in d["kwargs"]]
    assert len(receipts) == 1
    [delivery] = receipts
    receipt = delivery["kwargs"]["receipt"]
    assert delivery["kwargs"]["step"] == "after-report"  # the signature's own kwargs are kept
    assert receipt["receipt_id"] == str(acceptance.receipt.id)
    assert receipt["outbox_id"] == acceptance.outbox_id
    assert receipt["op_id"] == summary["op_id"]
    assert receipt["call_node_id"] == "run-7/report"
    assert receipt["terminal_state"] == "completed"
    assert receipt["result_digest"] == acceptance.receipt.result_digest
    assert receipt["result"] == ledger.get(op.id).result
    assert receipt["result"]["content"][0]["text"] == "report ready"
    assert delivery["task_id"] == str(uuid.uuid5(DELIVERY_NAMESPACE, f"receipt:{receipt['receipt_id']}"))
    with ledger.engine.connect() as conn:
        status = conn.execute(text("SELECT status FROM outbox WHERE id = :id"), {"id": acceptance.outbox_id})
        assert status.scalar_one() == "dispatched"


BAD_INPUT: list[tuple[dict[str, Any], str]] = [
    ({"server": "nowhere"}, "unknown server 'nowhere'; configured servers: reports"),
    ({"call_node_id": ""}, "call_node_id must not be empty"),
    ({"arguments": "not an object"}, "arguments must be a JSON object"),
    ({"arguments": {"blob": "x" * 1_100_000}}, "the limit is 1048576"),
    ({"on_terminal": {"args": []}}, "on_terminal must name its task"),
]


def test_bad_input_is_refused_by_the_worker_and_writes_nothing(fleet: Fleet) -> None:
    for change, message in BAD_INPUT:
        call: dict[str, Any] = {
            "call_node_id": "run-8/report",
            "server": "reports",
            "tool": "slow_report",
            "arguments": {},
        }
        with pytest.raises(Exception) as refused:  # noqa: PT011 - the class is rebuilt by Celery; name checked below
            _submit(fleet, **(call | change))
        assert type(refused.value).__name__ == "SubmissionRefused"
        assert message in str(refused.value)
    with fleet.ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM tool_operation")).scalar_one() == 0

    # The same call node with a different request is refused; the first stays the only operation.
    call = {"call_node_id": "run-9/report", "server": "reports", "tool": "slow_report", "arguments": {"a": 1}}
    _submit(fleet, **call)
    with pytest.raises(Exception, match="already has an operation for a different request"):
        _submit(fleet, **(call | {"arguments": {"a": 2}}))
    with fleet.ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM tool_operation")).scalar_one() == 1
