"""The dispatcher's messages (issue 13): one LPUSH each on the Redis broker, and no result subscription, since
nobody waits on a step's result (the ledger is the record)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from celery.utils.saferepr import saferepr

from tests import support
from workers.app import create_app
from workers.executor import Dispatch
from workers.settings import Settings
from workers.tasks import publish_dispatches


def test_a_dispatched_step_is_one_message_and_subscribes_to_no_result(
    database_url: str, broker_prefix: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(
        Settings(database_url=database_url, redis_url=support.REDIS_URL, broker_keyprefix=broker_prefix)
    )
    subscribed: list[Any] = []
    monkeypatch.setattr(app.backend, "on_task_call", lambda *args: subscribed.append(args))
    dispatches = [
        Dispatch("longcall.poll", uuid.uuid4(), 3),
        Dispatch("longcall.fetch_result", uuid.uuid4(), 5, delay_s=0.1),
        Dispatch("longcall.cancel", uuid.uuid4(), 7),
    ]

    assert publish_dispatches(app, dispatches) == 3

    assert subscribed == []
    queued = {
        queue: redis_client.llen(f"{broker_prefix}{queue}") for queue in ("longcall.poll", "longcall.control")
    }
    assert queued == {"longcall.poll": 1, "longcall.control": 2}, queued  # a fetch is a control step


def test_a_dispatched_step_shows_its_arguments_as_celery_writes_them(
    database_url: str, broker_prefix: str, redis_client: redis.Redis
) -> None:
    """The message's argsrepr/kwargsrepr (Flower's and the task events' view of the call) are given by the
    dispatcher, and read exactly as Celery's own saferepr of the same arguments."""
    app = create_app(
        Settings(database_url=database_url, redis_url=support.REDIS_URL, broker_keyprefix=broker_prefix)
    )
    dispatch = Dispatch("longcall.poll", uuid.uuid4(), 12)

    assert publish_dispatches(app, [dispatch]) == 1

    raw = redis_client.lpop(f"{broker_prefix}longcall.poll")
    assert isinstance(raw, bytes)
    headers = json.loads(raw)["headers"]
    assert headers["id"] == dispatch.task_id
    assert headers["argsrepr"] == saferepr(())
    assert headers["kwargsrepr"] == saferepr({"op_id": str(dispatch.op_id), "cursor": 12})
