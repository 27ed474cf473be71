"""A whole fleet for end-to-end tests: longcall's MCP server, longcall workers and beat, and a pipeline
worker that imports nothing of longcall. Real processes, real Postgres, Redis and broker."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import redis
from celery import Celery
from celery.result import AsyncResult

from demo_server.command import command as demo_server_command
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.pipeline_app import make_app
from workers.executor import Executor
from workers.runtime import Runtime
from workers.settings import Settings
from workers.steps.context import StepOutcome

#: The brokers a fleet runs on (the ``broker`` fixture; a test parametrized over it runs on each).
BROKERS = ("redis", "rabbitmq")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class McpServer:
    url: str
    control: str
    process: support.CeleryProcess

    def faults(self, **switches: Any) -> None:
        httpx2.post(f"{self.control}/faults", json=switches, timeout=5).raise_for_status()

    def log(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = httpx2.get(f"{self.control}/log", timeout=5).json()["entries"]
        return entries

    def http_log(self) -> list[dict[str, Any]]:
        """Every HTTP request the server received: ``{"t", "verb", "budget", ...}`` (``budget``: the bucket
        the request was charged to, as its ``Longcall-Budget`` header names it)."""
        entries: list[dict[str, Any]] = httpx2.get(f"{self.control}/http_log", timeout=5).json()["entries"]
        return entries

    def replies(self) -> list[dict[str, Any]]:
        """Every input reply (client JSON-RPC response) the server received, with what became of it."""
        replies: list[dict[str, Any]] = httpx2.get(f"{self.control}/replies", timeout=5).json()["replies"]
        return replies

    def tasks(self) -> list[dict[str, Any]]:
        tasks: list[dict[str, Any]] = httpx2.get(f"{self.control}/tasks", timeout=5).json()["tasks"]
        return tasks


def start_mcp_server(log_dir: Path, *flags: str, poll_interval_ms: int = 200) -> McpServer:
    port = free_port()
    process = support.start_celery_like(
        demo_server_command(port, *flags, poll_interval_ms=poll_interval_ms),
        env={},
        log_dir=log_dir,
        name=f"mcp-{port}",
    )
    control = f"http://127.0.0.1:{port}/_control"

    def up() -> bool:
        try:
            return httpx2.get(f"{control}/faults", timeout=1).status_code == 200
        except httpx2.HTTPError:
            return False

    support.wait_for("the MCP server to listen", up)
    return McpServer(f"http://127.0.0.1:{port}/mcp", control, process)


def in_process_runtime(database_url: str, broker_prefix: str, config: Path, **settings: Any) -> Runtime:
    """A runtime in this process on the test's ledger, Redis and broker prefix, with ``config``'s servers."""
    return Runtime.from_settings(
        Settings(
            database_url=database_url,
            redis_url=support.REDIS_URL,
            broker_keyprefix=broker_prefix,
            config=config,
            **settings,
        )
    )


@contextmanager
def in_process_executor(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path, **settings: Any
) -> Iterator[tuple[McpServer, Executor]]:
    """longcall's MCP server (tasks poll every 200 ms) and an executor in this process driving one step at a
    time: budgets far above what a test sends, a 30 s lease, and ``settings`` besides."""
    mcp = start_mcp_server(log_dir, poll_interval_ms=200)
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=5000, control_qps=5000))
    runtime = in_process_runtime(database_url, broker_prefix, config, **{"lease_s": 30, **settings})
    try:
        yield mcp, Executor(runtime)
    finally:
        runtime.close()
        mcp.process.stop()


def run_due(executor: Executor) -> list[StepOutcome]:
    """One dispatcher tick, its steps run by ``executor`` in this process."""
    outcomes = []
    for dispatch in executor.dispatch_due():
        if dispatch.task == "longcall.poll":
            outcomes.append(executor.advance(dispatch.op_id, dispatch.cursor))
        elif dispatch.task == "longcall.fetch_result":
            outcomes.append(executor.fetch_result(dispatch.op_id, dispatch.cursor))
        else:
            outcomes.append(executor.send_cancel(dispatch.op_id, dispatch.cursor))
    return outcomes


def step_until(executor: Executor, op_id: uuid.UUID, *states: OpState, timeout: float = 30) -> None:
    """Run what the dispatcher would, in this process, until the operation is in one of ``states``."""

    def reached() -> bool:
        run_due(executor)
        return executor.ledger.get(op_id).state in states

    support.wait_for(f"the operation to reach {[s.value for s in states]}", reached, timeout=timeout)


def fleet_config(server_url: str, **server: Any) -> str:
    values = {"poll_qps": 50, "control_qps": 50, **server}
    lines = [
        "[servers.reports]",
        'protocol = "mcp"',
        'protocol_version = "2025-11-25"',
        f'url = "{server_url}"',
        *(f"{k} = {json.dumps(v)}" for k, v in values.items()),
        "[servers.reports.tools.quick_lookup]",
        "sync_upper_bound_s = 5",
    ]
    return "\n".join(lines) + "\n"


@dataclass
class Fleet:
    ledger: Ledger
    pipeline: Celery
    sink: str
    redis: redis.Redis
    mcp: McpServer
    env: dict[str, str]
    log_dir: Path
    pipeline_env: dict[str, str] = field(default_factory=dict)
    processes: list[support.CeleryProcess] = field(default_factory=list)
    #: The RabbitMQ vhost of this fleet's queues when its broker is RabbitMQ; None: the broker is Redis.
    vhost: str | None = None

    def deliveries(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.redis.lrange(self.sink, 0, -1)]

    def receipts(self) -> list[dict[str, Any]]:
        return [d["kwargs"]["receipt"] for d in self.deliveries() if "receipt" in d["kwargs"]]

    def input_requests(self) -> list[dict[str, Any]]:
        return [d["kwargs"]["input_request"] for d in self.deliveries() if "input_request" in d["kwargs"]]

    def drains_run(self) -> int:
        """How many ``longcall.drain_outbox`` runs the longcall workers have finished (from their logs)."""
        return sum(
            line.count("longcall.drain_outbox[")
            for p in self.processes
            if p.name.startswith("longcall")
            for line in p.log().splitlines()
            if "succeeded" in line
        )

    def send(self, task: str, timeout: float = 30, **kwargs: Any) -> Any:
        return self.pipeline.send_task(task, kwargs=kwargs, queue="longcall.control").get(timeout=timeout)

    def submit(self, call_node_id: str, tool: str, arguments: dict[str, Any], **extra: Any) -> uuid.UUID:
        on_terminal = dict(self.pipeline.signature("pipeline.record", queue="pipeline"))
        on_input = dict(self.pipeline.signature("pipeline.record", queue="pipeline"))
        answer = self.send(
            "longcall.submit",
            call_node_id=call_node_id,
            server="reports",
            tool=tool,
            arguments=arguments,
            on_terminal=on_terminal,
            on_input=on_input,
            **extra,
        )
        return uuid.UUID(answer["op_id"])

    def send_nowait(self, task: str, **kwargs: Any) -> AsyncResult[Any]:
        """Send without waiting on the result backend (e.g. when longcall's results go to another Redis)."""
        return self.pipeline.send_task(task, kwargs=kwargs, queue="longcall.control")

    def submit_nowait(
        self, call_node_id: str, tool: str, arguments: dict[str, Any], **extra: Any
    ) -> AsyncResult[Any]:
        on_terminal = dict(self.pipeline.signature("pipeline.record", queue="pipeline"))
        return self.send_nowait(
            "longcall.submit",
            call_node_id=call_node_id,
            server="reports",
            tool=tool,
            arguments=arguments,
            on_terminal=on_terminal,
            **extra,
        )

    def wait_operation(self, call_node_id: str, *states: OpState, timeout: float = 30) -> Operation:
        """The call node's operation once it exists (and, with ``states``, is in one of them)."""

        def probe() -> Operation | None:
            op = self.ledger.find_by_call_node(call_node_id)
            return op if op is not None and (not states or op.state in states) else None

        return support.wait_for(
            f"the operation of {call_node_id} in {[s.value for s in states] or 'any state'}",
            probe,
            timeout=timeout,
        )

    def workers(self) -> list[support.CeleryProcess]:
        return [p for p in self.processes if p.name.startswith("longcall")]

    def worker_that_received(self, task_id: str) -> support.CeleryProcess | None:
        """The one longcall worker whose log says it received ``task_id`` ('<name>[<id>] received')."""
        marker = f"[{task_id}] received"
        found = [w for w in self.workers() if marker in w.log()]
        return found[0] if len(found) == 1 else None

    def received_count(self, task_id: str) -> int:
        """How many times the longcall workers received ``task_id`` (a redelivery counts again)."""
        marker = f"[{task_id}] received"
        return sum(w.log().count(marker) for w in self.workers())

    def ended_count(self, task_id: str) -> int:
        """How many runs of ``task_id`` ended in the longcall workers' logs (succeeded, raised or retry)."""
        ends = (f"[{task_id}] succeeded", f"[{task_id}] raised", f"[{task_id}] retry")
        return sum(w.log().count(end) for w in self.workers() for end in ends)

    def settled(self) -> bool:
        """No receipt or input request is waiting to be delivered, and the pipeline has nothing in hand."""
        if self.vhost is not None:
            # RabbitMQ counts a queue's messages ready and delivered-but-unacknowledged together.
            pipeline = support.rabbitmq_messages(self.vhost).get("pipeline", 0)
            return self.ledger.ready_outbox_count() == 0 and pipeline == 0
        prefix = self.sink.removesuffix("sink")
        # kombu keeps a message being worked on in the "unacked" hash as [message, exchange, routing key].
        in_hand = [
            raw
            for raw in self.redis.hvals(f"{prefix}unacked")
            if json.loads(raw)[2] == "pipeline"  # the longcall queues share this prefix
        ]
        return (
            self.ledger.ready_outbox_count() == 0
            and self.redis.llen(f"{prefix}pipeline") == 0
            and not in_hand
        )

    def wait_state(self, op_id: uuid.UUID, *states: OpState, timeout: float = 30) -> Operation:
        return support.wait_for(
            f"operation {op_id} to reach {[s.value for s in states]}",
            lambda: op if (op := self.ledger.get(op_id)).state in states else None,
            timeout=timeout,
        )

    def wait_receipt(self, call_node_id: str, timeout: float = 30) -> dict[str, Any]:
        return support.wait_for(
            f"the receipt of {call_node_id}",
            lambda: next((r for r in self.receipts() if r["call_node_id"] == call_node_id), None),
            timeout=timeout,
        )

    def start_pipeline(
        self, name: str = "pipeline", app: str = "tests.support.pipeline_app"
    ) -> support.CeleryProcess:
        """The pipeline's worker (it imports nothing of longcall), consuming the ``pipeline`` queue."""
        process = support.start_worker(
            app,
            queues="pipeline",
            env=self.pipeline_env,
            log_dir=self.log_dir,
            name=name,
            concurrency=1,
        )
        self.processes.append(process)
        return process

    def start_beat(self, name: str = "beat") -> support.CeleryProcess:
        """longcall's beat (exactly one should run), its schedule file in the fleet's log directory."""
        schedule = self.log_dir.parent / "beat-schedule"
        process = support.start_celery(
            ["-A", "workers.app", "beat", "-s", str(schedule), "--loglevel", "INFO"],
            env=self.env,
            log_dir=self.log_dir,
            name=name,
            ready_marker="beat: Starting",
        )
        self.processes.append(process)
        return process

    def start_worker(
        self, name: str, queues: str = "longcall.control,longcall.poll,longcall.outbox", concurrency: int = 2
    ) -> support.CeleryProcess:
        process = support.start_worker(
            "workers.app",
            queues=queues,
            env=self.env,
            log_dir=self.log_dir,
            name=name,
            concurrency=concurrency,
        )
        self.processes.append(process)
        return process


@dataclass(frozen=True)
class FleetParts:
    """What a fleet runs on: this test's ledger and database, its broker prefix on the shared Redis, and
    the directories for its files and its processes' logs (the ``fleet_parts`` fixture builds one)."""

    ledger: Ledger
    database_url: str
    broker_prefix: str
    redis_client: redis.Redis
    tmp_path: Path
    log_dir: Path
    #: The Redis of the fleet's hot state, broker and pipeline (a test's private instance, or the shared one).
    redis_url: str = support.REDIS_URL
    #: Another broker for longcall and the pipeline (RabbitMQ, on ``vhost``); None: ``redis_url`` is the
    #: broker. Results, hot state and the pipeline's sink stay on ``redis_url`` either way.
    broker_url: str | None = None
    vhost: str | None = None


@contextmanager
def running_fleet(
    parts: FleetParts,
    *,
    mcp_flags: tuple[str, ...] = (),
    poll_interval_ms: int = 200,
    server: dict[str, Any] | None = None,
    workers: int = 2,
    concurrency: int = 2,
    env: dict[str, str] | None = None,
    pipeline: bool = True,
    url_userinfo: str | None = None,
    route: Callable[[McpServer], str] | None = None,
) -> Iterator[Fleet]:
    """Starts the MCP server, ``workers`` longcall workers (of ``concurrency`` processes each), beat and
    (unless ``pipeline`` is False: then ``Fleet.start_pipeline`` does, later) the pipeline worker; stops
    them all. ``route``: the URL longcall is configured with for the server (e.g. through a path the test
    can cut), by default its own."""
    broker_prefix, tmp_path, log_dir = parts.broker_prefix, parts.tmp_path, parts.log_dir
    mcp = start_mcp_server(log_dir, *mcp_flags, poll_interval_ms=poll_interval_ms)
    config = tmp_path / "longcall.toml"
    url = route(mcp) if route is not None else mcp.url
    # With ``url_userinfo`` ("user:password"), longcall is configured with the server's URL carrying it.
    url = url.replace("://", f"://{url_userinfo}@", 1) if url_userinfo else url
    config.write_text(fleet_config(url, **(server or {})))
    sink = f"{broker_prefix}sink"
    longcall_env = {
        "LONGCALL_DATABASE_URL": parts.database_url,
        "LONGCALL_REDIS_URL": parts.redis_url,
        "LONGCALL_BROKER_KEYPREFIX": broker_prefix,
        "LONGCALL_CONFIG": str(config),
        "LONGCALL_OUTBOX_INTERVAL_S": "0.5",
        "LONGCALL_LEASE_S": "3",
        # drains_run counts the drains' "succeeded" lines, idle ones included (logged at DEBUG otherwise).
        "LONGCALL_LOG_IDLE_TICKS": "1",
        **({"LONGCALL_BROKER_URL": parts.broker_url} if parts.broker_url else {}),
        **(env or {}),
    }
    pipeline_env = {
        "PIPELINE_BROKER_URL": parts.broker_url or parts.redis_url,
        "PIPELINE_REDIS_URL": parts.redis_url,
        "PIPELINE_KEYPREFIX": broker_prefix,
        "PIPELINE_SINK": sink,
    }
    fleet = Fleet(
        parts.ledger,
        make_app(parts.broker_url or parts.redis_url, broker_prefix, sink, parts.redis_url),
        sink,
        parts.redis_client,
        mcp,
        longcall_env,
        log_dir,
        pipeline_env=pipeline_env,
        vhost=parts.vhost,
    )
    try:
        for index in range(workers):
            fleet.start_worker(f"longcall{index}", concurrency=concurrency)
        fleet.start_beat()
        if pipeline:
            fleet.start_pipeline()
        yield fleet
    finally:
        support.stop_all([*fleet.processes, mcp.process])
