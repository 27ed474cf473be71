"""Issue 22, items 1 and 4: the pipeline's typed client (``workers/client.py``) builds the signatures the
worker takes, imports Celery only, and routes every longcall task name to its queue."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from celery import Celery, chain, group

from tests.support.imports import loaded_by
from workers import client
from workers.app import celery_config
from workers.settings import FleetConfig, Settings
from workers.signatures import completed_signature, routed_signature
from workers.submission import validate_submission

FLEET = FleetConfig.model_validate(
    {"servers": {"reports": {"protocol": "mcp", "protocol_version": "2025-11-25", "url": "http://h/mcp"}}}
)
PIPELINE = Celery("pipeline", set_as_current=False)
STEP = PIPELINE.signature("pipeline.publish_report", queue="pipeline")
AFTER = PIPELINE.signature("pipeline.archive", queue="pipeline")
GOOD_KWARGS: dict[str, Any] = {
    "call_node_id": "n/1",
    "server": "reports",
    "tool": "slow_report",
    "arguments": {},
}


def as_sent(signature: Any) -> dict[str, Any]:
    """The signature's message body as the JSON serializer sends it."""
    return json.loads(json.dumps(signature))  # type: ignore[no-any-return]


def test_call_is_a_submit_on_the_control_queue_whose_on_terminal_is_then() -> None:
    sig = client.call("run-42/report", server="reports", tool="slow_report", arguments={"m": 1}, then=STEP)
    assert (sig.task, sig.options["queue"]) == ("longcall.submit", "longcall.control")
    assert sig.kwargs == {
        "call_node_id": "run-42/report",
        "server": "reports",
        "tool": "slow_report",
        "arguments": {"m": 1},
        "on_terminal": as_sent(STEP),
    }
    # What the worker checks at its boundary takes it as it is.
    new = validate_submission(as_sent(sig)["kwargs"], FLEET, max_body_bytes=1024)
    assert (new.call_node_id, new.on_terminal) == ("run-42/report", as_sent(STEP))


@pytest.mark.parametrize("then", [chain(STEP, AFTER), group(STEP, AFTER)], ids=["chain", "group"])
def test_call_takes_a_chain_or_a_group_as_then(then: Any) -> None:
    sig = client.call(
        "n/1",
        server="reports",
        tool="slow_report",
        arguments={},
        then=then,
        on_input=STEP,
        ttl_ms=60_000,
        wait_budget_s=120.0,
    )
    sent = as_sent(sig)["kwargs"]
    assert sent["on_terminal"]["task"] in ("celery.chain", "celery.group")
    assert (sent["ttl_ms"], sent["wait_budget_s"], sent["on_input"]["task"]) == (
        60_000,
        120.0,
        "pipeline.publish_report",
    )
    new = validate_submission(sent, FLEET, max_body_bytes=1024)
    assert new.on_terminal is not None
    assert new.on_terminal["task"] == sent["on_terminal"]["task"]


def test_what_is_not_one_clear_request_is_refused_in_the_pipeline() -> None:
    with pytest.raises(TypeError, match="then must be a Celery signature"):
        client.call("n/1", server="reports", tool="t", arguments={}, then="pipeline.publish_report")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_input must be a Celery signature"):
        client.call("n/1", server="reports", tool="t", arguments={}, then=STEP, on_input={"kwargs": {}})
    with pytest.raises(ValueError, match="call_node_id or op_id"):
        client.cancel()
    with pytest.raises(ValueError, match="call_node_id or op_id"):
        client.cancel(call_node_id="n/1", op_id="00000000-0000-0000-0000-000000000001")


def test_cancel_and_provide_input_are_their_tasks_on_the_control_queue() -> None:
    by_node = client.cancel(call_node_id="n/1")
    assert (by_node.task, by_node.kwargs, by_node.options["queue"]) == (
        "longcall.cancel",
        {"call_node_id": "n/1"},
        "longcall.control",
    )
    assert client.cancel(op_id="abc").kwargs == {"op_id": "abc"}
    answer = client.provide_input("abc", 2, {"action": "accept", "content": {"ok": True}})
    assert (answer.task, answer.options["queue"]) == ("longcall.provide_input", "longcall.control")
    assert answer.kwargs == {
        "op_id": "abc",
        "input_round": 2,
        "response": {"action": "accept", "content": {"ok": True}},
    }


def test_the_client_routes_every_task_as_the_workers_do() -> None:
    config = celery_config(Settings(database_url="postgresql://h/db", redis_url="redis://h:6379/0"))
    assert config["task_routes"] == {name: dict(route) for name, route in client.TASK_ROUTES.items()}
    pipeline = Celery("pipeline", set_as_current=False)
    pipeline.conf.task_routes = client.TASK_ROUTES
    # A longcall task sent by name without queue= goes to its queue, not the pipeline's default one.
    assert pipeline.amqp.router.route({}, "longcall.submit")["queue"].name == "longcall.control"
    assert pipeline.amqp.router.route({}, "longcall.poll")["queue"].name == "longcall.poll"


def test_the_client_imports_celery_and_nothing_of_longcall_s_worker() -> None:
    heavy = ("workers", "ledger", "adapters", "redis", "sqlalchemy", "httpx2", "psycopg", "pydantic")
    loaded = loaded_by(["workers.client"])
    assert sorted(m for m in loaded if m.split(".")[0] in heavy) == ["workers", "workers.client"]


def test_a_task_that_names_no_queue_is_given_the_one_the_pipeline_routes_it_to() -> None:
    """longcall sends ``then`` from its own app, which knows nothing of the pipeline's routes: the client
    writes each task's queue into the signature, as the pipeline's app would route it."""
    app = Celery("pipeline", set_as_current=False)
    app.conf.task_default_queue = "pipeline"
    app.conf.task_routes = {"pipeline.archive": {"queue": "archives"}}
    then = chain(
        app.signature("pipeline.publish_report"),
        group(app.signature("pipeline.archive"), app.signature("pipeline.index")),
    )
    sent = as_sent(client.call("n/1", server="reports", tool="t", arguments={}, then=then, app=app))
    first, rest = sent["kwargs"]["on_terminal"]["kwargs"]["tasks"]
    assert first["options"]["queue"] == "pipeline"
    assert [m["options"]["queue"] for m in rest["kwargs"]["tasks"]] == ["archives", "pipeline"]
    assert "queue" not in sent["kwargs"]["on_terminal"]["options"]  # a composite is routed by its members


def test_delivery_sends_a_task_that_names_no_queue_to_celery_s_default_queue_never_longcall_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bare = {"task": "pipeline.next", "args": [], "kwargs": {}, "options": {}}
    routed = routed_signature(completed_signature(as_sent(chain(STEP, PIPELINE.signature("p.bare")))))
    assert [m["options"]["queue"] for m in routed["kwargs"]["tasks"]] == ["pipeline", "celery"]
    assert routed_signature(bare)["options"]["queue"] == "celery"
    with caplog.at_level(logging.WARNING, logger="workers.signatures"):
        validate_submission({**GOOD_KWARGS, "on_terminal": bare}, FLEET, max_body_bytes=1024)
    assert "on_terminal names no queue" in caplog.text
