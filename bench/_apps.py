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
from typing import Any, cast

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
    """Profile every pool process of this worker, each of its threads on that thread's own CPU clock
    (``cProfile`` with ``time.thread_time``: the member threads and the event loop's thread as well as the
    main one), from its start to its shutdown, merged into one ``<pid>.prof`` each in ``directory``
    (``lifecycle.py --profile``)."""
    import cProfile  # noqa: PLC0415 - only when asked
    import pstats  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from celery.signals import worker_process_init, worker_process_shutdown  # noqa: PLC0415

    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    def begin() -> None:
        profile = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append(profile)
        profile.enable()

    def first_event(*_: Any) -> None:
        # A thread's first profile event (threading.setprofile): its own profiler replaces this hook.
        begin()

    @worker_process_init.connect(weak=False)
    def start(**_: Any) -> None:
        threading.setprofile(first_event)
        begin()

    @worker_process_shutdown.connect(weak=False)
    def stop(**_: Any) -> None:
        threading.setprofile(None)
        with lock:
            taken = list(profiles)
            profiles.clear()
        if taken:
            # What each thread finished: a call still running on another thread is left out (disabling its
            # profiler from here would close that call on this thread's clock, a meaningless figure).
            stats = pstats.Stats(cast("cProfile.Profile", _Finished(taken[0])))
            for profile in taken[1:]:
                stats.add(cast("cProfile.Profile", _Finished(profile)))
            stats.dump_stats(os.path.join(directory, f"{os.getpid()}.prof"))


class _Finished:
    """A running profiler's calls finished so far, as ``pstats.Stats`` takes them."""

    def __init__(self, profile: Any) -> None:
        profile.snapshot_stats()
        self.stats = profile.stats

    def create_stats(self) -> None:
        """Already made."""


class _LineLog:
    """Lines a worker process records (``bench/lifecycle.py``'s counts), appended to ``<pid><suffix>`` in
    ``directory`` by a thread every 0.2 s and at the process's exit; a forked pool process starts empty, with
    its own lock and thread (``worker_process_init``)."""

    def __init__(self, directory: str, suffix: str) -> None:
        import atexit  # noqa: PLC0415 - only when asked
        import threading  # noqa: PLC0415

        from celery.signals import worker_process_init  # noqa: PLC0415

        self.directory, self.suffix = directory, suffix
        self.lines: list[str] = []
        self.lock = threading.Lock()

        def forked() -> None:
            self.lock = threading.Lock()  # the parent's flusher may have held it at the fork
            self.lines = []

        def start(**_: Any) -> None:
            threading.Thread(target=self._flush_forever, name=f"bench {suffix} lines", daemon=True).start()

        os.register_at_fork(after_in_child=forked)
        worker_process_init.connect(start, weak=False)
        atexit.register(self.flush)
        start()

    def add(self, line: str) -> None:
        with self.lock:
            self.lines.append(line)

    def flush(self) -> None:
        with self.lock:
            taken, self.lines = self.lines, []
        if taken:
            with open(os.path.join(self.directory, f"{os.getpid()}{self.suffix}"), "a") as handle:
                handle.writelines(taken)

    def _flush_forever(self) -> None:
        while True:
            time.sleep(0.2)
            self.flush()


def count_ledger_commits(directory: str) -> None:
    """Record every ledger transaction's commit in this worker's processes (``lifecycle.py``: the burst's
    transactions by caller): one line per commit, ``<time> <task> <step> <method>``, in ``<pid>.tx``.
    ``task`` is the Celery task running in the thread that committed (``-`` for another thread, e.g. the
    lease keeper), ``step`` the innermost function of ``workers/`` that called into ``ledger/``, ``method``
    the outermost function of ``ledger/`` on the stack: the public ``Ledger`` call that owns the
    transaction. Seen client-side (SQLAlchemy's ``commit`` event, and every statement run in autocommit, a
    transaction of its own): no statistics flush, no idle estimate."""
    import sys  # noqa: PLC0415 - only when asked

    from celery import current_task  # noqa: PLC0415
    from sqlalchemy import Engine, event  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ledger_dir = os.path.join(root, "ledger") + os.sep
    workers_dir = os.path.join(root, "workers") + os.sep
    log = _LineLog(directory, ".tx")

    def caller() -> tuple[str, str]:
        frame = sys._getframe(2)
        method = step = "?"
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(ledger_dir):
                method = frame.f_code.co_name
            elif filename.startswith(workers_dir):
                step = f"{os.path.splitext(os.path.basename(filename))[0]}.{frame.f_code.co_name}"
                break
            frame = frame.f_back  # type: ignore[assignment]
        return step, method

    def committed(conn: Any) -> None:
        task = current_task.name if current_task else "-"
        step, method = caller()
        log.add(f"{time.time():.6f} {task} {step} {method}\n")

    def executed(conn: Any, *_: Any) -> None:
        # A statement in autocommit is a transaction of its own (``Ledger._one_statement``), with no commit.
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            committed(conn)

    event.listen(Engine, "commit", committed)
    event.listen(Engine, "after_cursor_execute", executed)


def count_redis_commands(directory: str, port: int) -> None:
    """Record every command this worker's processes send to the Redis on ``port`` (longcall's own, the
    ``redis_url``): one line per command, ``<time> <command>``, in ``<pid>.redis``. These are the top-level
    calls (a pipeline's commands each, MULTI and EXEC included; a script call once, whatever it runs inside),
    which ``INFO commandstats`` cannot tell from the commands run inside scripts."""
    from redis.connection import AbstractConnection  # noqa: PLC0415 - only when asked

    log = _LineLog(directory, ".redis")
    send_command: Any = AbstractConnection.send_command  # redis-py's own, untyped
    pack_commands: Any = AbstractConnection.pack_commands

    def name(args: Any) -> str:
        first = args[0] if args else b"?"
        return (first.decode() if isinstance(first, bytes) else str(first)).split()[0].lower()

    def counted_send_command(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "port", None) == port:
            log.add(f"{time.time():.6f} {name(args)}\n")
        return send_command(self, *args, **kwargs)

    def counted_pack_commands(self: Any, commands: Any) -> Any:
        commands = list(commands)
        if getattr(self, "port", None) == port:
            now = time.time()
            for args in commands:
                log.add(f"{now:.6f} {name(args)}\n")
        return pack_commands(self, commands)

    AbstractConnection.send_command = counted_send_command  # type: ignore[method-assign]
    AbstractConnection.pack_commands = counted_pack_commands  # type: ignore[method-assign]


def record_sends(directory: str) -> None:
    """Record the moment each request charged to a budget leaves this worker's processes (``soak.py``: the
    requests per second the workers sent, beside the server's log of when it handled them): one line per
    request, ``<time> <budget>``, in ``<pid>.sent``, taken as httpx2's transport is handed the request (its
    ``Longcall-Budget`` header names the budget; requests without one are not recorded), or a status
    reads' transport is (``adapters.socket_transport.SocketTransport``,
    ``adapters.loop_transport.LoopTransport``), or the adapter's client writes it on the status reads'
    sockets itself (``SocketTransport.send_bytes``: ``adapters.lean_client``)."""
    import httpx2  # noqa: PLC0415 - only when asked

    from adapters.loop_transport import LoopTransport  # noqa: PLC0415
    from adapters.socket_transport import SocketTransport  # noqa: PLC0415
    from workers.budget import BUDGET_HEADER  # noqa: PLC0415

    log = _LineLog(directory, ".sent")

    def recorded(handle_request: Any) -> Any:
        def recorded_handle_request(self: Any, request: httpx2.Request) -> Any:
            budget = request.headers.get(BUDGET_HEADER)
            if budget is not None:
                log.add(f"{time.time():.6f} {budget}\n")
            return handle_request(self, request)

        return recorded_handle_request

    httpx2.HTTPTransport.handle_request = recorded(httpx2.HTTPTransport.handle_request)  # type: ignore[method-assign]
    LoopTransport.handle_request = recorded(LoopTransport.handle_request)  # type: ignore[method-assign]
    SocketTransport.handle_request = recorded(SocketTransport.handle_request)  # type: ignore[method-assign]
    send_bytes = SocketTransport.send_bytes
    label = f"\r\n{BUDGET_HEADER}: ".encode().lower()

    def recorded_send_bytes(self: SocketTransport, url: Any, request: bytes, timeouts: Any) -> Any:
        # a request the adapter's client sends itself (adapters.lean_client): its budget in its head
        head = request.split(b"\r\n\r\n", 1)[0].lower()
        at = head.find(label)
        if at >= 0:
            budget = head[at + len(label) :].split(b"\r\n", 1)[0].decode("ascii")
            log.add(f"{time.time():.6f} {budget}\n")
        return send_bytes(self, url, request, timeouts)

    SocketTransport.send_bytes = recorded_send_bytes  # type: ignore[method-assign]


if "BENCH_PROFILE_DIR" in os.environ:
    profile_worker_processes(os.environ["BENCH_PROFILE_DIR"])

if "BENCH_TX_DIR" in os.environ:
    count_ledger_commits(os.environ["BENCH_TX_DIR"])

if "BENCH_REDIS_COUNT_DIR" in os.environ:
    from urllib.parse import urlsplit

    count_redis_commands(
        os.environ["BENCH_REDIS_COUNT_DIR"], urlsplit(os.environ["LONGCALL_REDIS_URL"]).port or 6379
    )

if "BENCH_SEND_DIR" in os.environ:
    record_sends(os.environ["BENCH_SEND_DIR"])

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
