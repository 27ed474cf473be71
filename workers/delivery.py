"""Turning outbox rows into downstream Celery messages (rule 9).

Delivery is at-least-once: a drainer that crashes between the broker publish and the ledger commit leaves the
row ready, and it is sent again. Every message names its receipt and carries ``outbox_id``; its Celery task id
is derived from the receipt (or the input round), so a consumer dedupes with one line::

    if not redis.set(f"seen:{receipt['outbox_id']}", 1, nx=True, ex=86400): return
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery, signature
from kombu.utils import json as celery_json

from ledger.digests import NotJson, canonical_json
from ledger.records import OutboxMessage

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


def delivery_task_id(message: OutboxMessage) -> str:
    if message.kind == "terminal":
        key = f"receipt:{message.payload['receipt']['receipt_id']}"
    else:
        key = f"input:{message.op_id}:{message.input_round}"
    return str(uuid.uuid5(DELIVERY_NAMESPACE, key))


def downstream_call(message: OutboxMessage) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
    """The stored signature, the keyword it receives, and the value (with ``outbox_id`` added)."""
    keyword = "receipt" if message.kind == "terminal" else "input_request"
    value = {**message.payload[keyword], "outbox_id": message.id}
    return message.payload.get("signature"), keyword, value


def publisher(app: Celery) -> Callable[[OutboxMessage], None]:
    def publish(message: OutboxMessage) -> None:
        stored, keyword, value = downstream_call(message)
        if stored is None:
            return  # nobody downstream: the receipt alone is the record
        sig = signature(stored, app=app)
        # The signature's own headers are kept: apply_async's headers replace them, they do not add to them.
        headers = {**(sig.options.get("headers") or {}), "longcall_outbox_id": str(message.id)}
        sig.apply_async(kwargs={keyword: value}, task_id=delivery_task_id(message), headers=headers)

    return publish
