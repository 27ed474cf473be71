"""An existing pipeline's Celery app that calls longcall: its own app, its own queue (``pipeline``), and
longcall's task names routed to longcall's queues (``client.TASK_ROUTES``).

It reads the broker the way ``longcall dev`` prints it (``export LONGCALL_REDIS_URL=...``, or
``LONGCALL_BROKER_URL`` when the broker is another one) and longcall's key prefix if one is set. Run its
worker beside the fleet::

    celery -A examples.pipeline.app worker -Q pipeline --loglevel INFO

(``PIPELINE_QUEUE`` names another queue than ``pipeline``.)

``publish_report`` runs once per receipt even when a receipt is delivered twice (delivery is at least
once): it remembers each ``outbox_id`` it has handled, in Redis, for a day.
"""

from __future__ import annotations

import logging
import os

import redis
from celery import Celery

from workers import client

log = logging.getLogger(__name__)

BROKER_URL = os.environ.get("LONGCALL_BROKER_URL") or os.environ.get(
    "LONGCALL_REDIS_URL", "redis://127.0.0.1:6379/0"
)
#: Where the pipeline remembers the receipts it has handled (longcall's Redis will do).
REDIS_URL = os.environ.get("LONGCALL_REDIS_URL", "redis://127.0.0.1:6379/0")
#: longcall's broker key prefix, if the fleet has one: the pipeline's messages must be in the same keyspace.
KEYPREFIX = os.environ.get("LONGCALL_BROKER_KEYPREFIX", "")
#: The pipeline's own queue.
QUEUE = os.environ.get("PIPELINE_QUEUE", "pipeline")

# The result backend is longcall's Redis: what run.py waits for (the submission's answer) is stored there.
app = Celery("pipeline", broker=BROKER_URL, backend=REDIS_URL, set_as_current=True)
app.conf.update(
    result_backend_transport_options={"global_keyprefix": KEYPREFIX} if KEYPREFIX else {},
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=QUEUE,
    # longcall's tasks go to longcall's queues, the pipeline's own to its queue
    task_routes={**client.TASK_ROUTES, "pipeline.*": {"queue": QUEUE}},
    broker_transport_options={"global_keyprefix": KEYPREFIX} if KEYPREFIX else {},
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def first_time(outbox_id: int) -> bool:
    """True the first time a receipt's outbox id is seen (a redelivery is not)."""
    seen = redis.Redis.from_url(REDIS_URL)
    try:
        return bool(seen.set(f"{KEYPREFIX}pipeline:seen:{outbox_id}", 1, nx=True, ex=86_400))
    finally:
        seen.close()


@app.task(name="pipeline.publish_report")
def publish_report(receipt: client.Receipt) -> str | None:
    """The next step of the pipeline: runs with the receipt once the report has ended."""
    if not first_time(receipt["outbox_id"]):
        log.info("receipt %s of %s seen before: skipped", receipt["outbox_id"], receipt["call_node_id"])
        return None
    if receipt["terminal_state"] != "completed":
        log.info("report %s ended %s: nothing to publish", receipt["call_node_id"], receipt["terminal_state"])
        return None
    log.info("published report %s (receipt %s)", receipt["call_node_id"], receipt["outbox_id"])
    return receipt["call_node_id"]


@app.task(name="pipeline.archive")
def archive(published: str | None) -> None:
    """The step after: what ``publish_report`` returned (a chain passes it on)."""
    if published is not None:
        log.info("archived %s", published)
