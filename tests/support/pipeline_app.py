"""An existing pipeline's Celery app. It imports nothing of longcall: it reaches it by task name only.

Its one task records each call it receives (task id and keyword arguments) in a Redis list, so a test can
count deliveries.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task


def make_app(broker_url: str, keyprefix: str, sink: str, redis_url: str | None = None) -> Celery:
    """``redis_url``: the Redis of the results and the sink list when the broker is not Redis (RabbitMQ)."""
    store = redis_url or broker_url
    app = Celery("pipeline", broker=broker_url, backend=store, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        broker_transport_options={"global_keyprefix": keyprefix},
        result_backend_transport_options={"global_keyprefix": keyprefix},
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_default_queue="pipeline",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name="pipeline.record", bind=True, shared=False)
    def record(self: Task[Any, Any], /, **kwargs: Any) -> None:
        """Records the call; through a Redis restart (the sink's Redis), for up to a minute, as a consumer
        that must not lose what it was handed does."""
        entry = json.dumps({"task_id": self.request.id, "kwargs": kwargs})
        deadline = time.monotonic() + 60
        while True:
            client = redis.Redis.from_url(store, socket_timeout=5, socket_connect_timeout=5)
            try:
                client.rpush(sink, entry)
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)  # a bounded retry: Redis is restarting
            else:
                return
            finally:
                client.close()

    @app.task(name="pipeline.record_any", bind=True, shared=False)
    def record_any(self: Task[Any, Any], /, *args: Any, **kwargs: Any) -> str:
        """Records the call with its positional arguments (a chain's later link receives what the link
        before it returned) and returns its own task id, for the link after it."""
        client = redis.Redis.from_url(store)
        client.rpush(sink, json.dumps({"task_id": self.request.id, "args": list(args), "kwargs": kwargs}))
        client.close()
        return str(self.request.id)

    @app.task(name="pipeline.check_digest", bind=True, shared=False)
    def check_digest(self: Task[Any, Any], /, receipt: dict[str, Any]) -> None:
        """Recomputes the receipt's digest over the ``result`` it received, with the recipe a consumer
        reads in longcall's documentation (and nothing of longcall's code), and records both."""
        canonical = json.dumps(
            receipt["result"], sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
        recomputed = "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        client = redis.Redis.from_url(store)
        entry = {"task_id": self.request.id, "kwargs": {"receipt": receipt}, "recomputed": recomputed}
        client.rpush(sink, json.dumps(entry))
        client.close()

    @app.task(name="pipeline.flaky", bind=True, max_retries=3, shared=False)
    def flaky(self: Task[Any, Any], /, **kwargs: Any) -> None:
        """Fails its first attempt; every attempt is recorded, so a test sees what each one received."""
        client = redis.Redis.from_url(store)
        client.rpush(
            sink, json.dumps({"task_id": self.request.id, "attempt": self.request.retries, "kwargs": kwargs})
        )
        client.close()
        if self.request.retries == 0:
            raise self.retry(countdown=0.2)

    return app


if "PIPELINE_BROKER_URL" in os.environ:
    app = make_app(
        os.environ["PIPELINE_BROKER_URL"],
        os.environ["PIPELINE_KEYPREFIX"],
        os.environ["PIPELINE_SINK"],
        os.environ.get("PIPELINE_REDIS_URL"),
    )
