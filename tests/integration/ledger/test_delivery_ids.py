"""Rule 9, delivered again: a receipt sent twice (a drainer killed between its publish and its commit, a
confirm lost) reaches each downstream task under the same task id both times, whatever the canvas it was
submitted with, so that each task can tell the second for a repeat (``workers.delivery.with_derived_ids``).
Published for real, on the Redis broker, with delivery's own publisher; the ids are read as Celery sends
them (``before_task_publish``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery.canvas import Signature
from celery.signals import before_task_publish

from ledger.records import OutboxMessage
from tests import support
from workers.app import create_app
from workers.delivery import delivery_task_id, publisher
from workers.settings import Settings

PIPELINE_TASKS_SHARED = pytest.mark.filterwarnings("ignore::celery.exceptions.DuplicateTaskNameWarning")


@pytest.fixture
def app(broker_prefix: str) -> Iterator[Celery]:
    made = create_app(
        Settings(broker_url=support.REDIS_URL, redis_url=support.REDIS_URL, broker_keyprefix=broker_prefix)
    )
    try:
        yield made
    finally:
        made.close()


def receipt_message(stored: dict[str, Any]) -> OutboxMessage:
    receipt = {"receipt_id": str(uuid.uuid4()), "terminal_state": "completed", "result": {"content": []}}
    return OutboxMessage(
        id=7,
        kind="terminal",
        op_id=uuid.uuid4(),
        input_round=None,
        payload={"receipt": receipt, "signature": stored},
        attempts=0,
    )


def sent_ids(app: Celery, message: OutboxMessage) -> list[tuple[str, str]]:
    """The (task, id) of every message one publish of ``message`` sends."""
    sent: list[tuple[str, str]] = []

    def record(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append((str(sender), str((headers or {}).get("id"))))

    before_task_publish.connect(record, weak=False)
    try:
        publisher(app)(message)
    finally:
        before_task_publish.disconnect(record)
    return sent


CANVASES: dict[str, Callable[[Callable[..., Signature]], Signature]] = {
    "a chain": lambda s: chain(s("p.a"), s("p.b")),
    "a group": lambda s: group(s("p.a"), s("p.b")),
    "a chord": lambda s: chord([s("p.a"), s("p.b")], s("p.c")),
    "a group of a chain and a task": lambda s: group(chain(s("p.a"), s("p.b")), s("p.c")),
    "a chain that Celery makes a chord": lambda s: chain(group(s("p.a"), s("p.b")), s("p.c")),
}


@PIPELINE_TASKS_SHARED
@pytest.mark.parametrize("canvas", CANVASES)
def test_a_receipt_sent_twice_reaches_each_task_of_its_canvas_under_the_same_id(
    app: Celery, canvas: str
) -> None:
    stored = dict(CANVASES[canvas](app.signature))
    message = receipt_message(stored)

    first = sent_ids(app, message)
    second = sent_ids(app, message)

    assert first
    assert second == first
    assert len({task_id for _, task_id in first}) == len(first)  # each task its own id


@PIPELINE_TASKS_SHARED
def test_a_lone_task_is_sent_under_the_id_derived_from_its_receipt(app: Celery) -> None:
    message = receipt_message(dict(app.signature("p.a")))
    assert sent_ids(app, message) == [("p.a", delivery_task_id(message))]
