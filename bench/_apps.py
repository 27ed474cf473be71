"""The Celery apps of the lifecycle benchmark. They import nothing of longcall: they reach it by task name.

* ``pipeline``: an existing pipeline's worker. ``bench.record`` is the ``on_terminal`` downstream task; it
  appends each receipt, with the time it arrived, to a Redis list.
* ``noop``: the Celery baseline. ``bench.noop`` does nothing; its app has the Celery settings longcall's
  fleet runs with (``workers/app.py`` ``celery_config``: JSON, late acks, prefetch 1, task events, sent
  events, started state, a Redis result backend), so that the baseline pays what longcall's messages pay.
* ``longcall``: longcall's own app (``workers.app.app``, the fleet's settings, task events as the fleet
  configures them) with one more task, ``bench.noop`` on the ``bench.noop`` queue: fire and forget (results
  ignored), it INCRs a Redis counter so the benchmark can count completions. The longcall workers of
  ``bench/lifecycle.py`` run from it, so the Celery baseline runs in the very worker processes, with the
  very settings, that run the operation steps. They start with task events off and the benchmark turns them
  on by remote control (``enable_events``) when the fleet's config has them on: Celery's ``disable_events``
  does nothing to a worker started with them on (its event dispatcher's groups are then empty, meaning
  all), so only a worker started without them can be measured both ways. On, its dispatcher sends the
  ``worker`` and ``task`` groups: what a worker started with them sends (there are no other groups).

Worker processes build them from the environment (``celery -A _apps:pipeline worker``); the benchmark builds
its client apps with the same functions.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

PIPELINE_QUEUE = "bench.pipeline"
NOOP_QUEUE = "bench.noop"


def _common(app: Celery, keyprefix: str) -> None:
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        broker_transport_options={"global_keyprefix": keyprefix, "visibility_timeout": 3600},
        result_backend_transport_options={"global_keyprefix": keyprefix},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )


def make_pipeline(broker_url: str, keyprefix: str, sink: str, sink_url: str | None = None) -> Celery:
    """No result backend: a pipeline fires ``longcall.submit`` and forgets it; the receipt comes back. The
    receipts are appended to the Redis list ``sink`` on ``sink_url`` (the broker's Redis by default)."""
    app = Celery("bench-pipeline", broker=broker_url, set_as_current=False)
    _common(app, keyprefix)
    app.conf.update(task_default_queue=PIPELINE_QUEUE, task_ignore_result=True)
    clients: dict[int, redis.Redis] = {}

    @app.task(name="bench.record", bind=True)
    def record(self: Task[Any, Any], /, **kwargs: Any) -> None:
        client = clients.get(os.getpid())
        if client is None:
            client = clients[os.getpid()] = redis.Redis.from_url(sink_url or broker_url)
        client.rpush(sink, json.dumps({"t": time.time(), "task_id": self.request.id, "kwargs": kwargs}))

    return app


def make_noop(broker_url: str, keyprefix: str) -> Celery:
    app = Celery("bench-noop", broker=broker_url, backend=broker_url, set_as_current=False)
    _common(app, keyprefix)
    app.conf.update(
        task_default_queue=NOOP_QUEUE,
        result_expires=3600,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
    )

    @app.task(name="bench.noop")
    def noop() -> None:
        return None

    return app


def noop_counter(keyprefix: str) -> str:
    """The Redis key ``bench.noop`` (the fire-and-forget one) INCRs once per run."""
    return f"{keyprefix}noop-done"


def add_counting_noop(app: Celery, redis_url: str, keyprefix: str) -> None:
    """``bench.noop`` on ``app``: results ignored, one INCR of ``noop_counter`` per run (its only cost)."""
    clients: dict[int, redis.Redis] = {}
    counter = noop_counter(keyprefix)

    @app.task(name="bench.noop", ignore_result=True, shared=False)
    def noop() -> None:
        client = clients.get(os.getpid())
        if client is None:
            client = clients[os.getpid()] = redis.Redis.from_url(redis_url)
        client.incr(counter)


def profile_worker_processes(directory: str) -> None:
    """Profile every pool process of this worker on its CPU clock (``cProfile`` with ``time.process_time``)
    from its start to its shutdown, one ``<pid>.prof`` each in ``directory`` (``lifecycle.py --profile``)."""
    import cProfile  # noqa: PLC0415 - only when asked

    from celery.signals import worker_process_init, worker_process_shutdown  # noqa: PLC0415

    profiles: dict[int, cProfile.Profile] = {}

    @worker_process_init.connect(weak=False)
    def start(**_: Any) -> None:
        profiles[os.getpid()] = profile = cProfile.Profile(time.process_time)
        profile.enable()

    @worker_process_shutdown.connect(weak=False)
    def stop(**_: Any) -> None:
        profile = profiles.pop(os.getpid(), None)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(directory, f"{os.getpid()}.prof"))


if "BENCH_PROFILE_DIR" in os.environ:
    profile_worker_processes(os.environ["BENCH_PROFILE_DIR"])

if "BENCH_LONGCALL_NOOP" in os.environ:
    from workers.app import app as longcall

    add_counting_noop(longcall, os.environ["LONGCALL_REDIS_URL"], os.environ["LONGCALL_BROKER_KEYPREFIX"])
    longcall.conf.worker_send_task_events = False  # turned on by remote control, see above

if "BENCH_BROKER_URL" in os.environ:
    pipeline = make_pipeline(
        os.environ["BENCH_BROKER_URL"],
        os.environ["BENCH_KEYPREFIX"],
        os.environ["BENCH_SINK"],
        os.environ.get("BENCH_SINK_URL"),
    )
    noop = make_noop(os.environ["BENCH_BROKER_URL"], os.environ["BENCH_KEYPREFIX"])
