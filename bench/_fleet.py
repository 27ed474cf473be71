"""The fleet the benchmarks measure: longcall's MCP demo server, the longcall workers and beat, and a pipeline
worker that records every receipt (``bench/_apps.py``), over Redis, a fresh ledger database and a broker of
their own (:func:`services`); :class:`Fleet` sends operations to it and reads what it counted.

``bench/lifecycle.py`` measures one operation's life through it; ``bench/scaling.py`` and
``bench/aip_vs_api_core.py`` start it too, ``bench/step_cpu.py`` takes its configuration. The plumbing under
it (child processes, databases, private Redis) is ``bench/_harness.py``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import redis
from _apps import NOOP_QUEUE, PIPELINE_QUEUE, make_pipeline
from _harness import (
    LONGCALL_QUEUES,
    Child,
    backend_pids,
    command_calls,
    cpu_seconds,
    database_url,
    delete_prefixed,
    free_port,
    fresh_database,
    listening,
    rabbitmq_vhost,
    sessions,
    start_child,
    start_longcall_fleet,
    start_private_redis,
    wait_for,
    xact_commit,
)
from celery import Celery

from demo_server.command import command as demo_server_command
from workers.app import celery_config
from workers.settings import Settings

RECEIVED = re.compile(r"Task (\S+)\[[^\]]+\] received")
BEAT_SENT = re.compile(r"Sending due task \S+ \((\S+)\)")
SUCCEEDED = re.compile(
    r"Task (longcall\.(?:submit|poll|fetch_result|cancel))\[[^\]]+\] succeeded in \S+: (.*)"
)
STEP = re.compile(r"'(?:step|action)': '(\w+)'")
TICK = re.compile(r"Task longcall\.dispatch_due\[[^\]]+\] succeeded in \S+: \{'dispatched': (\d+)\}")

#: ``redis.Redis``, named where a dataclass's ``redis`` field hides the module.
RedisClient = redis.Redis


@dataclass
class Counters:
    """What the shared services had counted at one instant."""

    t: float
    xact: int
    #: Every Redis command, both instances (broker and longcall's) when they are two.
    redis_calls: int
    lpush: int
    #: This process's own commands so far, both instances.
    own_calls: int
    #: ``calls`` per Redis command (``INFO commandstats``), both instances summed.
    by_command: dict[str, int] = field(default_factory=dict)
    #: The broker's Redis alone (a private one of its own; 0 when the broker is not a Redis of its own).
    broker_calls: int = 0
    own_broker_calls: int = 0
    broker_by_command: dict[str, int] = field(default_factory=dict)
    #: Connections made to the run's database so far (``pg_stat_database.sessions``).
    sessions: int = 0


@dataclass
class Fleet:
    args: argparse.Namespace
    log_dir: Path
    db_name: str
    redis_url: str
    prefix: str
    control: str
    client: Celery
    redis: redis.Redis
    children: dict[str, Child] = field(default_factory=dict)
    #: Commands this process sent to Redis (LLEN waits, INFO reads), subtracted from the fleet's count.
    own_calls: int = 0
    sent: int = 0
    redis_pid: int | None = None
    #: ``worker_send_task_events`` as longcall's ``celery_config`` sets it for this fleet.
    events_configured: bool = True
    #: The broker's own private Redis, when the run has one (see :func:`services`).
    broker_redis: RedisClient | None = None
    broker_redis_pid: int | None = None
    own_broker_calls: int = 0

    @property
    def sink(self) -> str:
        return f"{self.prefix}sink"

    def counters(self) -> Counters:
        calls = command_calls(self.redis)
        self.own_calls += 1
        broker: dict[str, int] = {}
        if self.broker_redis is not None:
            broker = command_calls(self.broker_redis)
            self.own_broker_calls += 1
        both = collections.Counter(calls)
        both.update(broker)
        return Counters(
            time.time(),
            xact_commit(self.db_name),
            sum(both.values()),
            both.get("lpush", 0),
            self.own_calls + self.own_broker_calls,
            dict(both),
            sum(broker.values()),
            self.own_broker_calls,
            broker,
            sessions(self.db_name),
        )

    def receipts_count(self) -> int:
        self.own_calls += 1
        return int(self.redis.llen(self.sink))

    def wait_receipts(self, count: int, timeout: float) -> None:
        wait_for(
            f"{count} receipts",
            lambda: self.receipts_count() >= count,
            timeout=timeout,
            interval=0.05,
        )

    def submit(self, call_node_id: str, seconds: float) -> None:
        on_terminal = dict(self.client.signature("bench.record", queue=PIPELINE_QUEUE))
        self.client.send_task(
            "longcall.submit",
            kwargs={
                "call_node_id": call_node_id,
                "server": "reports",
                "tool": "slow_report",
                "arguments": {"seconds": seconds},
                "on_terminal": on_terminal,
            },
            queue="longcall.control",
        )
        self.sent += 1

    def deliveries(self) -> list[dict[str, Any]]:
        self.own_calls += 1
        return [json.loads(raw) for raw in self.redis.lrange(self.sink, 0, -1)]

    def message_counts(self) -> tuple[collections.Counter[str], ...]:
        """So far: messages received by every worker (per task name), those beat sent, and the outcomes of
        the operation steps (``task:action``, e.g. ``longcall.poll:no_token``) the workers logged."""
        received: collections.Counter[str] = collections.Counter()
        steps: collections.Counter[str] = collections.Counter()
        for name, child in self.children.items():
            if name.startswith(("longcall", "pipeline")):
                text = child.log()
                received.update(RECEIVED.findall(text))
                for task, answer in SUCCEEDED.findall(text):
                    step = STEP.search(answer)
                    steps[f"{task}:{step.group(1) if step else '?'}"] += 1
                for dispatched in TICK.findall(text):
                    steps[
                        "longcall.dispatch_due:claimed" if int(dispatched) else "longcall.dispatch_due:none"
                    ] += 1
        beat = collections.Counter(BEAT_SENT.findall(self.children["beat"].log()))
        return received, beat, steps

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each part: longcall workers (pool children included), beat, the pipeline
        worker, the MCP server, this run's Postgres backends, Redis (when private) and this process."""
        groups = {
            "longcall workers": {c.proc.pid for n, c in self.children.items() if n.startswith("longcall")},
            "beat": {self.children["beat"].proc.pid},
            "pipeline worker": {self.children["pipeline"].proc.pid},
            "MCP server": {self.children["mcp"].proc.pid},
        }
        cpu = {name: cpu_seconds(set(), pgids) for name, pgids in groups.items()}
        cpu["postgres backends"] = cpu_seconds(set(backend_pids(self.db_name)), set())
        redis_pids = {pid for pid in (self.redis_pid, self.broker_redis_pid) if pid is not None}
        if redis_pids:
            cpu["redis"] = cpu_seconds(redis_pids, set())  # both redis-servers when they are two
        times = os.times()
        cpu["bench client"] = times.user + times.system
        return cpu

    def server_log(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = httpx2.get(f"{self.control}/log", timeout=10).json()["entries"]
        return entries

    def server_tasks(self) -> dict[str, dict[str, Any]]:
        tasks = httpx2.get(f"{self.control}/tasks", timeout=10).json()["tasks"]
        return {t["taskId"]: t for t in tasks}


def fleet_config(server_url: str, qps: float) -> str:
    return (
        "[servers.reports]\n"
        'protocol = "mcp"\n'
        'protocol_version = "2025-11-25"\n'
        f'url = "{server_url}"\n'
        f"poll_qps = {qps}\ncontrol_qps = {qps}\n"
    )


def send_dir(log_dir: Path) -> Path:
    """Where the longcall workers' processes write one line per request they send (``bench/_apps.py``
    ``record_sends``)."""
    return log_dir / "sent"


def tx_dir(log_dir: Path) -> Path:
    """Where the longcall workers' processes write one line per ledger commit (``bench/_apps.py``
    ``count_ledger_commits``)."""
    return log_dir / "tx"


@dataclass
class Services:
    redis_url: str
    redis: redis.Redis
    prefix: str
    db_name: str
    redis_pid: int | None
    #: The fleet's broker: the Redis above, a private Redis of its own (``broker_redis``), or a RabbitMQ
    #: vhost of this run (``--broker rabbitmq``).
    broker_url: str
    broker_redis: RedisClient | None = None
    broker_redis_pid: int | None = None


@contextlib.contextmanager
def services(args: argparse.Namespace, log_dir: Path, *, own_broker: bool = False) -> Iterator[Services]:
    """Redis (private unless ``--redis-url``), a key prefix deleted afterwards, a fresh ledger database, and
    with ``--broker rabbitmq`` a RabbitMQ vhost of its own as the broker (Redis then holds the buckets, the
    meters, the results and the receipts' sink only). With ``own_broker`` (``lifecycle.py``), and neither
    ``--redis-url`` nor ``--broker rabbitmq``, the broker is a second private Redis: the broker's commands
    and longcall's are then each counted on their own instance, not told apart by an estimate."""
    with contextlib.ExitStack() as stack:
        redis_pid = None
        if args.redis_url:
            redis_url = args.redis_url
        else:
            redis_child, redis_url = start_private_redis(log_dir)
            stack.callback(redis_child.stop)
            redis_pid = redis_child.proc.pid
        prefix = f"lcbench-{uuid.uuid4().hex[:10]}:"
        client_redis = redis.Redis.from_url(redis_url)
        stack.callback(client_redis.close)
        stack.callback(delete_prefixed, client_redis, prefix)
        db_name = stack.enter_context(fresh_database())
        rabbitmq = getattr(args, "broker", "redis") == "rabbitmq"  # scaling.py and aip_vs_api_core.py: Redis
        broker_redis = broker_pid = None
        if rabbitmq:
            broker_url = stack.enter_context(rabbitmq_vhost())
        elif own_broker and not args.redis_url:
            broker_child, broker_url = start_private_redis(log_dir)
            stack.callback(broker_child.stop)
            broker_pid = broker_child.proc.pid
            broker_redis = redis.Redis.from_url(broker_url)
            stack.callback(broker_redis.close)
        else:
            broker_url = redis_url
        yield Services(
            redis_url, client_redis, prefix, db_name, redis_pid, broker_url, broker_redis, broker_pid
        )


def longcall_env(svc: Services, config: Path) -> dict[str, str]:
    """The environment of a longcall process on these services, its configuration file at ``config``."""
    return {
        "LONGCALL_DATABASE_URL": database_url(svc.db_name),
        "LONGCALL_REDIS_URL": svc.redis_url,
        "LONGCALL_BROKER_KEYPREFIX": svc.prefix,
        "LONGCALL_CONFIG": str(config),
        **({"LONGCALL_BROKER_URL": svc.broker_url} if svc.broker_url != svc.redis_url else {}),
    }


@contextlib.contextmanager
def running_fleet(
    args: argparse.Namespace,
    log_dir: Path,
    svc: Services,
    *,
    count_calls: bool = False,
    record_sends: bool = False,
) -> Iterator[Fleet]:
    """The MCP server, the longcall workers and beat, and the pipeline worker; all stopped on the way out.
    With ``count_calls``, the longcall workers' processes record every ledger transaction and every command
    they send to longcall's Redis (:func:`tx_dir`; about 5 us of worker CPU each). With ``record_sends``, the
    moment each request charged to a budget leaves them (:func:`send_dir`)."""
    children: dict[str, Child] = {}
    client: Celery | None = None
    try:
        port = free_port()
        control = f"http://127.0.0.1:{port}/_control"
        children["mcp"] = start_child(
            demo_server_command(port, poll_interval_ms=args.poll_interval_ms),
            env={},
            log_dir=log_dir,
            name="mcp",
            ready=listening(control),
        )
        counting: dict[str, str] = {}
        if count_calls:
            tx_dir(log_dir).mkdir(exist_ok=True)
            counting = {"BENCH_TX_DIR": str(tx_dir(log_dir)), "BENCH_REDIS_COUNT_DIR": str(tx_dir(log_dir))}
        if record_sends:
            send_dir(log_dir).mkdir(exist_ok=True)
            counting["BENCH_SEND_DIR"] = str(send_dir(log_dir))
        config = log_dir / "longcall.toml"
        config.write_text(fleet_config(f"http://127.0.0.1:{port}/mcp", args.qps))
        sink = f"{svc.prefix}sink"
        # longcall's own app plus the counting no-op (bench/_apps.py): the Celery baseline runs in the
        # very processes that run the steps.
        start_longcall_fleet(
            children,
            log_dir=log_dir,
            longcall_env={
                **longcall_env(svc, config),
                "BENCH_LONGCALL_NOOP": "1",
                **counting,
                **({"BENCH_PROFILE_DIR": str(args.profile)} if getattr(args, "profile", None) else {}),
                # Settings.status_reads: what sends the polls' status reads (the fleet's default unless set)
                **(
                    {"LONGCALL_STATUS_READS": args.status_reads}
                    if getattr(args, "status_reads", None)
                    else {}
                ),
            },
            workers=args.workers,
            concurrency=args.concurrency,
            redis_url=svc.redis_url,
            prefix=svc.prefix,
            sink=sink,
            app="_apps:longcall",
            queues=f"{LONGCALL_QUEUES},{NOOP_QUEUE}",
            broker_url=svc.broker_url,
        )
        client = make_pipeline(svc.broker_url, svc.prefix, sink, svc.redis_url)
        settings = Settings(
            database_url=database_url(svc.db_name),
            redis_url=svc.redis_url,
            broker_url=svc.broker_url,
            broker_keyprefix=svc.prefix,
            config=config,
        )
        fleet = Fleet(
            args,
            log_dir,
            svc.db_name,
            svc.redis_url,
            svc.prefix,
            control,
            client,
            svc.redis,
            children=children,
            redis_pid=svc.redis_pid,
            events_configured=bool(celery_config(settings)["worker_send_task_events"]),
            broker_redis=svc.broker_redis,
            broker_redis_pid=svc.broker_redis_pid,
        )
        # The workers started with task events off (bench/_apps.py): now as the fleet configures them.
        set_task_events(fleet, fleet.events_configured)
        yield fleet
    finally:
        if client is not None:
            client.close()
        for child in reversed(list(children.values())):
            child.stop()


def set_task_events(fleet: Fleet, enabled: bool) -> None:
    """``celery control enable_events|disable_events`` to the longcall workers, every reply awaited."""
    names = [f"{n}@{socket.gethostname()}" for n in fleet.children if n.startswith("longcall")]
    command = fleet.client.control.enable_events if enabled else fleet.client.control.disable_events
    replies = command(destination=names, reply=True, timeout=10)
    answers = {name: answer for reply in replies or [] for name, answer in reply.items()}
    state = "enabled" if enabled else "disabled"
    wanted = {f"task events {state}", f"task events already {state}"}
    if set(answers) != set(names) or any(answer.get("ok") not in wanted for answer in answers.values()):
        raise RuntimeError(f"task events {'on' if enabled else 'off'}: {answers}")
