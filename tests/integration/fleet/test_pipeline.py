"""End to end through real worker processes: a pipeline that imports nothing of longcall enqueues
``longcall.submit`` by name, and after acceptance its own downstream task receives the receipt exactly once.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text

from tests import support
from tests.support.fleet import Fleet
from workers.delivery import DELIVERY_NAMESPACE


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
        "arguments": {"seconds": 0.3},
        "on_terminal": on_terminal,
    }
    summary = _submit(fleet, **call)
    assert summary["created"] is True
    assert summary["state"] in ("WORKING", "SUBMITTING")
    again = _submit(fleet, **call)  # the same call node and request: the same operation
    assert (again["op_id"], again["created"]) == (summary["op_id"], False)

    receipt = fleet.wait_receipt("run-7/report")

    # Three more drains (beat's) find nothing to send; a sentinel behind them proves the pipeline queue empty.
    drained = fleet.drains_run()
    support.wait_for("three more drains", lambda: fleet.drains_run() >= drained + 3)
    fleet.pipeline.send_task("pipeline.record", kwargs={"sentinel": True}, queue="pipeline")
    support.wait_for("the sentinel", lambda: any("sentinel" in d["kwargs"] for d in fleet.deliveries()))

    deliveries = [d for d in fleet.deliveries() if "receipt" in d["kwargs"]]
    assert len(deliveries) == 1
    [delivery] = deliveries
    assert delivery["kwargs"]["step"] == "after-report"  # the signature's own kwargs are kept
    ledger_receipt = fleet.ledger.receipt_for(uuid.UUID(summary["op_id"]))
    assert ledger_receipt is not None
    assert receipt["receipt_id"] == str(ledger_receipt.id)
    assert receipt["op_id"] == summary["op_id"]
    assert receipt["call_node_id"] == "run-7/report"
    assert receipt["terminal_state"] == "completed"
    assert receipt["result_digest"] == ledger_receipt.result_digest
    assert receipt["result"]["content"][0]["text"] == "report ready after 0.3s"
    assert delivery["task_id"] == str(uuid.uuid5(DELIVERY_NAMESPACE, f"receipt:{receipt['receipt_id']}"))
    assert [e["method"] for e in fleet.mcp.log()].count("tools/call") == 1
    with fleet.ledger.engine.connect() as conn:
        outbox = conn.execute(text("SELECT id, status FROM outbox WHERE kind = 'terminal'")).one()
    assert (receipt["outbox_id"], outbox.status) == (outbox.id, "dispatched")


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
