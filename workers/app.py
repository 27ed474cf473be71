"""The Celery app factory. ``celery -A workers.app worker -Q longcall.control,longcall.poll,longcall.outbox``.

The module-level ``app`` reads its settings from the environment when Celery first configures it, not at
import; tests and embedders build their own with ``create_app(settings)``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals
from kombu import Queue

from beat_schedule import beat_schedule
from workers import celery_logs, members
from workers.auth import check_credentials
from workers.broker import CONSUMER as REDIS_CONSUMER
from workers.broker import TRANSPORT as REDIS_TRANSPORT
from workers.client import TASK_ROUTES
from workers.delivery import CELERY_DELIVERY
from workers.errors import ConfigError
from workers.faults import describe_fault
from workers.fencing import ConsumptionFence
from workers.runtime import RuntimeHolder
from workers.settings import Settings
from workers.tasks import register_tasks

log = logging.getLogger("longcall")

#: How long a worker process that stops waits for the polls on its member threads (``workers/members.py``).
MEMBERS_SHUTDOWN_S = 10.0

QUEUES = ("longcall.control", "longcall.poll", "longcall.outbox")

#: Seconds a broker command (a publish, an ack, a confirm) or connect may take before it fails and is retried.
BROKER_SOCKET_TIMEOUT_S = 15.0
#: How many times a task's answer is stored through a fault of the result backend (Celery's own retry, on
#: the backend's connection errors), the pauses growing from 0.1 s to 2 s with full jitter: about a minute
#: in all, two at most, each try bounded by :data:`BROKER_SOCKET_TIMEOUT_S`.
RESULT_STORE_TRIES = 60


def is_amqp(broker_url: str) -> bool:
    """An AMQP broker (RabbitMQ), by the URL's transport (``amqp://``, ``pyamqp://``, ``amqps://``, ...)."""
    transport = broker_url.partition("://")[0].lower()
    return transport.partition("+")[0] in {"amqp", "amqps", "pyamqp", "librabbitmq"}


def is_redis(broker_url: str) -> bool:
    return broker_url.partition("://")[0].lower() in {"redis", "rediss", "redis+socket", "sentinel"}


def celery_config(settings: Settings) -> dict[str, Any]:
    transport_options: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if is_amqp(settings.broker):
        # The outbox marks a row dispatched when the publish returns: on RabbitMQ that return must mean the
        # broker has taken the message (publisher confirms), not that it left this process.
        # The Redis-only options are not set here: kombu hands every transport option to py-amqp, which
        # ignores what it does not know. Fleets share a RabbitMQ by vhost (the URL's path), not by a key
        # prefix; LONGCALL_BROKER_KEYPREFIX then prefixes only the result keys in Redis.
        # Queues are durable and messages persistent (Celery's defaults, kept). RabbitMQ closes a channel
        # whose delivery stays unacknowledged past its consumer_timeout (30 min by default) and delivers
        # the message again: with acks_late a step must end well inside it. Every longcall step is a few
        # bounded HTTP requests (a synchronous call at most its sync_upper_bound_s), and a redelivered
        # step is fenced by the ledger's lease and epoch, never a second create. The dispatcher owns time: its
        # messages carry a countdown of at most one dispatch tick (a batch waits for its earliest member's
        # due time); an intent handed back to the broker through an outage (workers/task_faults.py) carries
        # one well inside max_held_delivery_s; so none waits unacknowledged in a worker for long.
        transport_options["confirm_publish"] = True
        # RabbitMQ stops reading from a publishing connection while it is in a memory or disk alarm, and a
        # broker that vanished without closing the connection never answers: a publish waiting for its
        # confirm (or a channel close after a failed one) would wait for ever, its drainer holding its
        # outbox rows (locked, skipped by every other drainer) and the dispatcher's tick its claims. A read
        # or write that waits this long fails instead (the socket's SO_RCVTIMEO/SO_SNDTIMEO; a consumer
        # reads only what its event loop saw arrive, so an idle one is not affected); the publish is
        # retried by Celery's policy, then fails, and the row stays ready.
        transport_options["read_timeout"] = BROKER_SOCKET_TIMEOUT_S
        transport_options["write_timeout"] = BROKER_SOCKET_TIMEOUT_S
    elif is_redis(settings.broker):
        # A message not acknowledged within the visibility timeout is delivered again (Redis only).
        transport_options["visibility_timeout"] = settings.redis_visibility_timeout_s
        if settings.broker_keyprefix:
            transport_options["global_keyprefix"] = settings.broker_keyprefix
        # A broker that vanished without closing the connection (host down, failover, a dropped NAT entry)
        # must fail a publish, not hang it: a drainer stuck in a publish holds its outbox rows (locked,
        # skipped by every other drainer) for ever. The consumer's BRPOP waits 1 s, well inside this.
        transport_options["socket_timeout"] = BROKER_SOCKET_TIMEOUT_S
        transport_options["socket_connect_timeout"] = BROKER_SOCKET_TIMEOUT_S
        if settings.broker.partition("://")[0].lower() == "redis":
            # kombu's Redis transport, keeping one client per channel (workers/broker.py): kombu builds a
            # client for every ack, unacked record and event otherwise. Its channels outlive a lost
            # connection, and the worker's consumer gives back at once the messages Celery drops then.
            extra["broker_transport"] = REDIS_TRANSPORT
            extra["worker_consumer"] = REDIS_CONSUMER
    return {
        **extra,
        "broker_url": settings.broker,
        # LONGCALL_REDIS_URL, unless it is a Redis Cluster (LONGCALL_REDIS_CLUSTER): then the broker's Redis,
        # or rpc:// on RabbitMQ (workers/settings.py).
        "result_backend": settings.result_backend,
        "result_expires": 24 * 3600,
        "result_backend_transport_options": (
            {"global_keyprefix": settings.broker_keyprefix} if settings.broker_keyprefix else {}
        ),
        # The answer of a task a caller waits on (submit, cancel, provide_input) is stored once it ran. Celery
        # stores it after the task's body, outside its retries: a Redis that restarts then would lose the
        # answer for good (the message is acknowledged as a failure "outside body", nothing stored: the
        # caller's AsyncResult stays PENDING). It is tried again through the fault instead, in bounds; past
        # them the task's end is logged at ERROR (``report_unstored_answer``); the ledger keeps the outcome.
        "result_backend_always_retry": True,
        "result_backend_max_retries": RESULT_STORE_TRIES,
        "result_backend_base_sleep_between_retries_ms": 100,
        "result_backend_max_sleep_between_retries_ms": 2000,
        # A Redis gone silent (a host down, a frozen process) fails a store instead of holding it (Celery's
        # default waits two minutes for a reply and the operating system's for a connect).
        "redis_socket_timeout": BROKER_SOCKET_TIMEOUT_S,
        "redis_socket_connect_timeout": BROKER_SOCKET_TIMEOUT_S,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        # A worker whose broker connection drops reconnects (kombu's backoff: 2 s, 4 s, ... 30 s between
        # tries; Celery gives up after broker_connection_max_retries, 100 tries, about 45 min), and lets the
        # tasks it is running finish: Celery 6 will cancel them by default, and a step cut off mid-request (a
        # create, a cancel) has an unknown outcome. Each step is fenced by the ledger; one that ends after the
        # reconnect acknowledges its message then (workers/broker.py), or leaves it to be delivered again.
        "broker_connection_retry": True,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # JSON only, in and out (DESIGN §7; never pickle).
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # A task is acknowledged after it ran, and redelivered if its worker died mid-run.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_queues": [Queue(name, routing_key=name) for name in QUEUES],
        "task_default_queue": "longcall.control",
        "task_routes": {name: dict(route) for name, route in TASK_ROUTES.items()},
        # Flower sees what the fleet does.
        # (No task-sent events: one more publish per message, and Flower has the workers' own events.)
        "worker_send_task_events": True,
        "beat_schedule": beat_schedule(
            dispatch_interval_s=settings.dispatch_interval_s,
            outbox_interval_s=settings.outbox_interval_s,
            reconcile_interval_s=settings.reconcile_interval_s,
        ),
        "beat_max_loop_interval": min(1.0, settings.dispatch_interval_s),
        "worker_hijack_root_logger": False,
    }


def create_app(settings: Settings | None = None) -> Celery:
    holder = RuntimeHolder(settings, delivery=CELERY_DELIVERY)
    app = Celery("longcall", set_as_current=False)

    def defaults() -> dict[str, Any]:
        # Celery reads its configuration before a worker or beat sends its first signal: a bad environment
        # (LONGCALL_*) stops the process here, with the message alone.
        try:
            return celery_config(holder.settings)
        except ConfigError as exc:
            raise SystemExit(f"longcall: {exc}") from None

    app.add_defaults(defaults)
    app.longcall_runtime = holder  # type: ignore[attr-defined]

    register_tasks(app, holder)

    def refuse_bad_config(sender: Any = None, **_: Any) -> None:
        # A worker or beat starts only with a usable configuration: settings and LONGCALL_CONFIG are read
        # and validated now, not on the first task.
        if getattr(sender, "app", None) is app:
            try:
                holder.get()
            except ConfigError as exc:
                raise SystemExit(f"longcall: {exc}") from None

    def report_at_start(sender: Any = None, **_: Any) -> None:
        # Then it says what it finds in the ledger that needs saying (rules 13, 14): operations on servers
        # the configuration no longer names, an epoch it does not own. A worker says it once its logging is
        # set up (worker_ready; worker_init comes before it).
        if getattr(sender, "app", None) is app:
            holder.get().report_at_start()

    def refuse_missing_credentials(sender: Any = None, **_: Any) -> None:
        # A worker sends requests: the OAuth clients' variables and key files are checked at its start (beat
        # and the CLI need none of them).
        if getattr(sender, "app", None) is app:
            try:
                check_credentials(holder.get().fleet)
            except ConfigError as exc:
                raise SystemExit(f"longcall: {exc}") from None

    signals.worker_init.connect(refuse_bad_config, weak=False)
    signals.worker_init.connect(refuse_missing_credentials, weak=False)
    signals.beat_init.connect(refuse_bad_config, weak=False)
    signals.worker_ready.connect(report_at_start, weak=False)

    def fence_consumption(sender: Any = None, **_: Any) -> None:
        # Rule 13 at the broker: while its fleet does not own the epoch, the worker takes none of longcall's
        # messages off the shared queues (workers/fencing.py).
        if getattr(sender, "app", None) is app:
            ConsumptionFence(sender, holder.settings, QUEUES).start()

    signals.worker_ready.connect(fence_consumption, weak=False)
    signals.beat_init.connect(report_at_start, weak=False)

    # Logs (workers.celery_logs): `celery -A workers.app worker|beat --log-format json`, op and call node on
    # every line, idle ticks at DEBUG.
    app.user_options["preload"].add(celery_logs.LOG_FORMAT_OPTION)

    def take_log_format(**kwargs: Any) -> None:  # user_preload_options(sender, app, options)
        options = kwargs.get("options")
        if kwargs.get("app") is app and isinstance(options, dict):
            celery_logs.request_format(options.get("log_format"))

    signals.user_preload_options.connect(take_log_format, weak=False)

    def let_members_finish(**_: Any) -> None:
        # The polls this process started run on its member threads after their messages were answered: a
        # process that stops lets them finish (bounded), so their rows are free at once, not when their
        # leases run out.
        if not members.wait_for_members(MEMBERS_SHUTDOWN_S):
            log.warning("a worker process stopped with %d polls still on their way", members.in_flight())

    def report_unstored_answer(sender: Any = None, **kwargs: Any) -> None:
        # Celery tells of an error outside a task's body (its answer not stored past RESULT_STORE_TRIES) only
        # with a RuntimeWarning; the message is acknowledged all the same. An operator is told at ERROR, with
        # where the outcome is kept.
        if getattr(sender, "app", None) is app:
            exc = kwargs.get("exception")
            log.error(
                "%s[%s] failed outside its body (%s): its answer is not stored in the result backend, and a "
                "caller waiting on it gets none; the ledger keeps the outcome (longcall status <call node>)",
                getattr(sender, "name", "?"),
                kwargs.get("task_id"),
                describe_fault(exc) if isinstance(exc, BaseException) else "no exception given",
            )

    signals.task_internal_error.connect(report_unstored_answer, weak=False)
    signals.worker_process_shutdown.connect(let_members_finish, weak=False)
    signals.worker_shutdown.connect(let_members_finish, weak=False)
    celery_logs.connect_signals()
    return app


app = create_app()
