"""Turning outbox rows into downstream Celery messages (rule 9): the publisher, the beat's drain
(:func:`drain`) and a step's own (:func:`follow`).

Delivery is at-least-once: a drainer that crashes between the broker publish and the ledger commit leaves the
row ready, and it is sent again. Every message names its receipt and carries ``outbox_id``; its Celery task id
is derived from the receipt (or the input round), so a consumer dedupes with one line::

    if not redis.set(f"seen:{receipt['outbox_id']}", 1, nx=True, ex=86400): return

A canvas (a chain, a group, a chord) is sent again with the same task id for each of its tasks, derived from
the receipt and the task's place in it (:func:`with_derived_ids`): each task of it dedupes on its own id
(``self.request.id``); ``outbox_id`` is the same for all of them.

A publish that fails is the drain's to retry (``ledger/outbox.py``): paced, and dead-lettered after
``outbox_max_attempts`` failures. A broker that is out of reach is told apart here
(:func:`broker_unreachable`) and raised as :class:`~ledger.errors.PublishUnavailable`, which the drain paces
without counting: an outage dead-letters nothing.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import uuid
from collections.abc import Callable
from typing import Any

import amqp.exceptions
import kombu.exceptions
import redis.exceptions
from celery import Celery, chord, group, signature
from celery.canvas import Signature, _chain
from kombu.utils import json as celery_json

from ledger.digests import canonical_json
from ledger.errors import NotJson, PublishRefusedForGood, PublishUnavailable
from ledger.outbox import OutboxRetry
from ledger.records import DrainReport, OutboxMessage
from ledger.redact import error_line
from workers.errors import InvalidSubmission
from workers.runtime import Runtime, RuntimeHolder
from workers.settings import Settings
from workers.signatures import DeliveryCheck, completed_signature, downstream_signatures, routed_signature
from workers.steps.context import StepOutcome

log = logging.getLogger("longcall")

#: Namespace of the downstream task ids: uuid5(DELIVERY_NAMESPACE, "receipt:<id>" | "input:<op>:<round>").
DELIVERY_NAMESPACE = uuid.UUID("5b0f7c1e-9a3c-4d51-8a59-2f6f3c0b9a11")


def delivered_unchanged(value: Any) -> bool:
    """Whether the Celery JSON serializer delivers ``value`` as it is. It does not for an object with exactly
    the keys ``__type__`` and ``__value__``: kombu decodes that into a datetime, a Decimal, bytes, ... (or
    refuses the whole message for a type it does not know)."""
    try:
        delivered = celery_json.loads(celery_json.dumps(value))
        return canonical_json(delivered) == canonical_json(value)
    except (NotJson, TypeError, ValueError):
        return False


def buildable(field: str, value: dict[str, Any]) -> None:
    """Celery builds the signature ``value`` (as delivery will build it).

    Raises:
        InvalidSubmission: whatever Celery refuses to build, delivery could not publish.
    """
    try:
        signature(copy.deepcopy(value))
    except Exception as exc:  # noqa: BLE001 - whatever Celery refuses to build, delivery could not publish
        raise InvalidSubmission(f"{field} is not a signature Celery can build: {error_line(exc)}") from None


#: The answers of this worker's serializer and of Celery itself, which the runtime gives the engine (the
#: result step, the submission check).
CELERY_DELIVERY = DeliveryCheck(unchanged=delivered_unchanged, build=buildable)


def delivery_task_id(message: OutboxMessage) -> str:
    if message.kind == "terminal":
        key = f"receipt:{message.payload['receipt']['receipt_id']}"
    else:
        key = f"input:{message.op_id}:{message.input_round}"
    return str(uuid.uuid5(DELIVERY_NAMESPACE, key))


def derived_id(task_id: str, place: tuple[str | int, ...]) -> str:
    """The task id of the task at ``place`` in the canvas sent as ``task_id`` (``task_id`` itself for the
    canvas's root)."""
    if not place:
        return task_id
    return str(uuid.uuid5(uuid.UUID(task_id), "/".join(str(step) for step in place)))


def with_derived_ids(sig: Signature, task_id: str, place: tuple[str | int, ...] = ()) -> Signature:
    """``sig`` with a task id set on each of its tasks (and groups), derived from ``task_id`` and the task's
    place in the canvas. Celery names only a lone task (or a chain's last, a group) after the task id it
    is sent with, and every other task of a canvas anew at each send: a receipt sent again (a drainer
    killed between its publish and its commit, a confirm lost) ran each of those tasks a second time under
    another id, and no consumer could tell it for a repeat. A task id already set is kept by Celery, so the
    canvas is sent the same way each time. A lone task's success callbacks (``link``) are named so too, at
    ``link/<n>`` under it; its error callbacks (``link_error``) are not: Celery copies those onto every task
    of a chain or a group, where one id would be given to several calls."""
    if isinstance(sig, chord):
        header = sig.tasks
        for index, task in enumerate(header.tasks if isinstance(header, group) else header):
            with_derived_ids(task, task_id, (*place, "header", index))
        if sig.body is not None:
            with_derived_ids(sig.body, task_id, (*place, "body"))
    elif isinstance(sig, _chain | group):
        for index, task in enumerate(sig.tasks):
            with_derived_ids(task, task_id, (*place, index))
    else:
        links = sig.options.get("link") or []
        for index, callback in enumerate(links if isinstance(links, list | tuple) else [links]):
            if isinstance(callback, dict):  # a Signature is a dict: its options are its "options" key
                callback.setdefault("options", {})["task_id"] = derived_id(task_id, (*place, "link", index))
    sig.options["task_id"] = derived_id(task_id, place)
    return sig


def downstream_call(message: OutboxMessage) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
    """The stored signature, the keyword it receives, and the value (with ``outbox_id`` added)."""
    keyword = "receipt" if message.kind == "terminal" else "input_request"
    value = {**message.payload[keyword], "outbox_id": message.id}
    return message.payload.get("signature"), keyword, value


class ExpiredDelivery(PublishRefusedForGood):
    """A downstream signature's ``expires`` date has passed: Celery would drop the message unrun, and the
    row would read dispatched. The publish fails instead, and the row is dead-lettered with this reason at
    once (a date that has passed never comes again); an operator sees it in ``longcall status`` and the
    metrics."""


def passed_expiry(stored: dict[str, Any], now: dt.datetime | None = None) -> str | None:
    """Why ``stored`` can no longer be delivered, None while it can: a task of it whose ``expires`` date
    (an ISO 8601 date and time, UTC when it names no zone) has passed. Submit refuses such a date unless it
    falls well after the operation's wait budget, so this is met only by a receipt sent very late (a broker
    away for over an hour, an operator's late ``--resend``). An error callback's (``link_error``) is not
    looked at: it is needed only if a task fails, and Celery checks it then."""
    now = now or dt.datetime.now(dt.UTC)
    try:
        signatures = list(downstream_signatures("then", stored))
    except InvalidSubmission:
        return None  # a shape taken by an earlier version: Celery is left to say what it makes of it
    for where, sig in signatures:
        expires = (sig.get("options") or {}).get("expires")
        if not isinstance(expires, str) or "link_error" in where:
            continue
        try:
            when = dt.datetime.fromisoformat(expires)
        except ValueError:
            continue
        if (when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)) <= now:
            return f"{where}: expires={expires} has passed; Celery would drop the message unrun"
    return None


def publisher(app: Celery) -> Callable[[OutboxMessage], None]:
    """What the drain calls for each row: the stored signature sent with its receipt (or input request).
    Raises :class:`~ledger.errors.PublishUnavailable` (the broker's error as its cause) when the broker is
    out of reach, and the broker's own error when it refused the message."""
    channel_errors: tuple[type[BaseException], ...] | None = None

    def publish(message: OutboxMessage) -> None:
        nonlocal channel_errors
        stored, keyword, value = downstream_call(message)
        if stored is None:
            return  # nobody downstream: the receipt alone is the record
        expired = passed_expiry(stored)
        if expired is not None:
            raise ExpiredDelivery(expired)
        # A task that names no queue goes to Celery's default one, never to longcall's (routed_signature).
        task_id = delivery_task_id(message)
        sig = with_derived_ids(signature(routed_signature(completed_signature(stored)), app=app), task_id)
        # The signature's own headers are kept: apply_async's headers replace them, they do not add to them.
        headers = {**(sig.options.get("headers") or {}), "longcall_outbox_id": str(message.id)}
        try:
            sig.apply_async(kwargs={keyword: value}, task_id=task_id, headers=headers)
        except Exception as exc:
            if channel_errors is None:
                # The transport's own refusals (RabbitMQ's channel errors, Redis's error replies): kombu
                # builds the transport without connecting.
                channel_errors = tuple(app.connection_for_write().channel_errors)
            if broker_unreachable(exc, channel_errors):
                raise PublishUnavailable(error_line(exc)) from exc
            raise

    return publish


#: The failures of a broker that is out of reach: the network (refused, reset, unreachable, timed out, a
#: name that does not resolve), the broker going away (RabbitMQ closing the connection as it stops, Redis
#: loading its data after a restart).
UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,  # ConnectionError, TimeoutError, socket.gaierror among them
    amqp.exceptions.ConnectionError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
#: The broker refused the message itself, whatever wraps it: RabbitMQ's negative confirm (a full queue that
#: rejects publishes, kombu raising it as an ``OperationalError``).
REFUSED: tuple[type[BaseException], ...] = (amqp.exceptions.MessageNacked,)


def broker_unreachable(exc: BaseException, channel_errors: tuple[type[BaseException], ...] = ()) -> bool:
    """Whether ``exc`` (a failed publish) says the broker is out of reach rather than that it refused the
    message. A refusal anywhere in the chain of causes (a channel error of the transport: a queue declared
    with other arguments, a missing exchange, a permission, an error reply; a negative confirm) is the
    message's, and counts; so is anything that is not a network or connection failure. kombu's own
    ``OperationalError`` (also what Celery raises once its publish retries ran out) is one when it has no
    cause to say otherwise."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 16 and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(e, (*REFUSED, *channel_errors)) for e in chain):
        return False
    if any(isinstance(e, UNREACHABLE) for e in chain):
        return True
    return isinstance(chain[-1], kombu.exceptions.OperationalError)


def outbox_retry(settings: Settings) -> OutboxRetry:
    """The drain's pace (rule 9): ``outbox_max_attempts`` counted failures, pauses doubling from the beat's
    drain interval up to ``outbox_retry_max_s``."""
    return OutboxRetry(
        max_attempts=settings.outbox_max_attempts,
        max_pause_s=settings.outbox_retry_max_s,
        first_pause_s=min(settings.outbox_interval_s, settings.outbox_retry_max_s),
    )


#: What a step drains of its own operation's rows (a receipt, an input request or two).
OWN_ROWS_DRAIN_LIMIT = 10


def drain(app: Celery, runtime: Runtime, limit: int) -> DrainReport:
    """``longcall.drain_outbox``: the ready rows (up to ``limit``) published, the ones that could not be said
    (:func:`log_failed_publishes`)."""
    report = runtime.ledger.drain_outbox(publisher(app), limit=limit, retry=outbox_retry(runtime.settings))
    if report.failed:
        log_failed_publishes(report)
    return report


def follow(app: Celery, holder: RuntimeHolder, step: StepOutcome | None) -> None:
    """A step left a receipt or an input request in the outbox (committed with its state): drain it now,
    in this task, rather than as one more message (``longcall.drain_outbox``: a broker round trip, its
    events and a task's CPU for every operation; issue 13). The drain is the beat's own
    (``Ledger.drain_outbox``: SKIP LOCKED, at-least-once); if it fails, the message is sent instead, and
    the beat's drain still runs every ``outbox_interval_s``. Only the step's own operation's rows, up to
    the first failed publish: a backlog of others' rows, or a broker that fails slowly, stays with the
    beat's drain on ``longcall.outbox`` and never holds a poll or control slot."""
    if step is None or not step.drain_now:
        return
    try:
        runtime = holder.get()
        report = runtime.ledger.drain_outbox(
            publisher(app),
            limit=OWN_ROWS_DRAIN_LIMIT,
            op_id=step.op_id,
            retry=outbox_retry(runtime.settings),
        )
    except Exception:
        log.warning("draining the outbox after %s failed", step.op_id, exc_info=True)
    else:
        if not report.failed:
            return
        log_failed_publishes(report)
    try:
        app.send_task("longcall.drain_outbox", queue="longcall.outbox", ignore_result=True)
    except Exception:  # the beat's drain runs every outbox_interval_s anyway
        log.warning("could not send longcall.drain_outbox; the beat's drain will publish", exc_info=True)


def log_failed_publishes(report: DrainReport) -> None:
    """The rows a drain could not publish: the ones it dead-lettered at ERROR (an operator's, rule 9), the
    rest, which stay ready for the next drain, at WARNING."""
    dead = set(report.dead)
    if dead:
        log.error(
            "outbox rows %s could not be published after their bounded attempts: dead-lettered "
            "(OUTBOX_UNDELIVERABLE; longcall reconcile --resend ID once the cause is gone)",
            sorted(dead),
        )
    ready = [row for row in report.failed if row not in dead]
    if ready:
        log.warning("outbox rows %s could not be published; they stay ready", ready)
