"""Rule 9, delivered again: a receipt sent twice (a drainer killed between its publish and its commit, a
confirm lost) reaches each downstream task under the same task id both times, whatever the canvas it was
submitted with, so that each task can tell the second for a repeat (``workers.delivery.with_derived_ids``).
Published for real, on the Redis broker, with delivery's own publisher; the ids are read as Celery sends
them (``before_task_publish``)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery.canvas import Signature
from celery.signals import before_task_publish
from sqlalchemy import text

from ledger.outbox import OutboxRetry
from ledger.records import OutboxMessage
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.ledger_rows import evidence_for, place
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
    stored = json.loads(json.dumps(dict(CANVASES[canvas](app.signature))))  # as the ledger keeps it
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


@PIPELINE_TASKS_SHARED
def test_a_receipt_whose_then_expired_is_dead_lettered_with_why_not_marked_dispatched(
    app: Celery, ledger: Ledger
) -> None:
    """A ``then`` with an ``expires`` date that has passed by the time its receipt is sent (a broker away
    for over an hour, an operator's late ``--resend``): Celery would drop the message unrun while the row read
    dispatched. The publish fails instead, and the row is dead-lettered with the reason at once: a date
    that has passed never comes again, so its attempts are not spent on it (before, it was tried
    ``outbox_max_attempts`` times, pauses between, for nothing)."""
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)).isoformat()
    stored = dict(app.signature("p.a") | app.signature("p.b", expires=past))
    op = place(ledger, OpState.FETCHING_RESULT)
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET on_terminal = :s WHERE id = :id"),
            {"s": json.dumps(stored), "id": op.id},
        )
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))

    report = ledger.drain_outbox(publisher(app), retry=OutboxRetry(max_attempts=10))

    assert report.dead == (acceptance.outbox_id,)
    with ledger.engine.connect() as conn:
        row = conn.execute(
            text("SELECT status, last_error FROM outbox WHERE id = :id"), {"id": acceptance.outbox_id}
        ).one()
    assert row.status == "dead"
    assert f"expires={past} has passed" in row.last_error


@PIPELINE_TASKS_SHARED
def test_a_lone_tasks_success_callback_is_named_from_the_receipt_too(app: Celery) -> None:
    """A ``link`` runs once per run of its task, when the worker has run it: it travels in the task's
    message, named from the receipt (``link/0`` under the task), the same name at each send."""
    stored = json.loads(json.dumps(dict(app.signature("p.a", link=app.signature("p.after")))))
    message = receipt_message(stored)
    callbacks: list[list[str]] = []

    def record(body: Any = None, **_: Any) -> None:
        embed = body[2] if isinstance(body, list | tuple) and len(body) > 2 else {}
        callbacks.append([c["options"]["task_id"] for c in embed.get("callbacks") or []])

    before_task_publish.connect(record, weak=False)
    try:
        publisher(app)(message)
        publisher(app)(message)
    finally:
        before_task_publish.disconnect(record)
    first, second = callbacks
    assert first == second
    assert len(first) == 1
    assert first[0] != delivery_task_id(message)
