"""Issue 12: a real ``longcall gate`` table from a live fleet speaking three protocols, reproducible.

One run, on loopback, everything started here and stopped on the way out:

* a fresh, migrated ledger database (and the simulation's own ``<name>_simulation``, both dropped after);
  a Redis of its own (so the request meter's peaks are this run's only);
* longcall's demo servers: MCP 2025-11-25 (``reports``), AIP-151 (``exports``) and MCP 2026-07-28 with the
  tasks extension (``tasks_ext``), at realistic budgets (``--poll-qps``, ``--control-qps``); the long tools
  (``slow_report``, ``run_report``) are marked ``side_effect_free`` so that shadow mode applies to them,
  ``quick_lookup`` is not;
* two longcall workers, beat, and a pipeline worker that imports nothing of longcall (``bench/_apps.py``).

Then, only through public interfaces (the ``longcall`` CLI as a subprocess, and the task names a pipeline
sends: ``longcall.submit``, ``longcall.cancel``, ``longcall.provide_input``,
``longcall.record_legacy_outcome``):

1. ``longcall gate simulate --series N --seed S`` (recorded in the live ledger's ``simulation_run``);
2. ``longcall rollout --shadow on``, ``--percent 5`` (the first canary), then ``--percent P`` (a raise:
   the launch gate is asked, and must let it through);
3. the workload, on every protocol: call nodes inside the canary run live (completions, failures, one
   cancel each, an input round on both MCP generations, a lost create answer on each protocol, duplicate
   submissions sequential and concurrent); call nodes outside it run in shadow on the side-effect-free
   tools (the legacy outcome recorded by ``longcall.record_legacy_outcome``, before or after longcall's
   receipt) or are answered "not routed" (``quick_lookup``). A lost MCP create waits for an operator:
   this run is that operator, resolving it with ``longcall reconcile REF --found ID --evidence ...`` from
   the server's own task list (the evidence an operator would read);
4. once every receipt is delivered and every comparison made: ``longcall gate`` and ``longcall gate
   --json``, as run from the command line, with their exit codes.

Every figure of the gate comes from the rows this run's fleet wrote; nothing is inserted by hand.

Run: ``.venv/bin/python bench/gate_run.py [--seed 20261201] [--series 500]``; exit status: the gate's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import redis
from _apps import PIPELINE_QUEUE
from _harness import (
    REPO,
    Child,
    alarm,
    celery_worker_argv,
    child_env,
    database_url,
    delete_prefixed,
    drop_database,
    free_port,
    fresh_database,
    listening,
    log_directory,
    logged,
    raise_on_sigterm,
    start_child,
    start_private_redis,
    wait_for,
)
from celery import Celery

from demo_server.aip151_command import command as aip_command
from demo_server.command import command as mcp_command
from ledger.records import Operation
from ledger.repository import Ledger
from ledger.states import OpState
from workers.rollout import in_canary

LONGCALL_QUEUES = "longcall.control,longcall.poll,longcall.outbox"
MCP, AIP, EXT = "reports", "exports", "tasks_ext"
AIP_TOOL = "run_report"
ACTOR = "gate-run"


# ------------------------------------------------------------------------------------------ the fleet


def fleet_config(urls: dict[str, str], poll_qps: float, control_qps: float) -> str:
    """Three servers, one per protocol; the long tools side-effect-free (shadow applies), quick_lookup not."""
    budgets = f"poll_qps = {poll_qps}\ncontrol_qps = {control_qps}\n"
    return (
        f'[servers.{MCP}]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\nurl = "{urls[MCP]}"\n{budgets}'
        f"[servers.{MCP}.tools.slow_report]\nside_effect_free = true\n"
        f"[servers.{MCP}.tools.quick_lookup]\nsync_upper_bound_s = 5\n"
        f'[servers.{AIP}]\nprotocol = "aip151"\nprotocol_version = "v1"\nurl = "{urls[AIP]}"\n{budgets}'
        "default_poll_interval_ms = 200\n"
        f"[servers.{AIP}.tools.{AIP_TOOL}]\n"
        'create = "POST /v1/projects/{project}/reports:run"\nrequest_id_field = "requestId"\n'
        "side_effect_free = true\n"
        f'[servers.{EXT}]\nprotocol = "mcp"\nprotocol_version = "2026-07-28"\nurl = "{urls[EXT]}"\n{budgets}'
        "default_poll_interval_ms = 200\n"
        f"[servers.{EXT}.tools.slow_report]\nside_effect_free = true\n"
    )


def client_app(redis_url: str, prefix: str) -> Celery:
    """What a pipeline sends with: longcall's task names, answers from longcall's result backend."""
    app = Celery("gate-run-client", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        broker_transport_options={"global_keyprefix": prefix},
        result_backend_transport_options={"global_keyprefix": prefix},
        broker_connection_retry_on_startup=True,
    )
    return app


@dataclass
class Fleet:
    log_dir: Path
    db_name: str
    env: dict[str, str]
    control: dict[str, str]
    client: Celery
    redis: redis.Redis
    sink: str
    ledger: Ledger
    children: dict[str, Child] = field(default_factory=dict)
    out: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        print(line, flush=True)

    # -- the public task names

    def send(self, task: str, **kwargs: Any) -> Any:
        return self.client.send_task(task, kwargs=kwargs, queue="longcall.control").get(timeout=60)

    def signature(self) -> dict[str, Any]:
        return dict(self.client.signature("bench.record", queue=PIPELINE_QUEUE))

    def submit(self, node: str, server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = self.send(
            "longcall.submit",
            call_node_id=node,
            server=server,
            tool=tool,
            arguments=arguments,
            on_terminal=self.signature(),
            on_input=self.signature(),
        )
        return answer

    # -- the CLI

    def cli(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``longcall ARGV`` as an operator runs it (the venv's console script, this fleet's environment)."""
        command = [str(Path(sys.executable).parent / "longcall"), *argv]
        done = subprocess.run(
            command,
            cwd=REPO,
            env={**child_env(self.env), "USER": ACTOR, "COLUMNS": "250"},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        self.say(f"$ longcall {' '.join(argv)}   (exit {done.returncode})")
        for text in (done.stdout, done.stderr):
            if text.strip():
                self.say(text.rstrip())
        if check and done.returncode != 0:
            raise RuntimeError(f"longcall {' '.join(argv)} exited {done.returncode}")
        return done

    # -- what the pipeline received, and the ledger

    def deliveries(self) -> list[dict[str, Any]]:
        return [json.loads(raw)["kwargs"] for raw in self.redis.lrange(self.sink, 0, -1)]

    def receipt(self, node: str) -> dict[str, Any] | None:
        return next(
            (d["receipt"] for d in self.deliveries() if d.get("receipt", {}).get("call_node_id") == node),
            None,
        )

    def input_request(self, op_id: str) -> dict[str, Any] | None:
        return next(
            (
                d["input_request"]
                for d in self.deliveries()
                if d.get("input_request", {}).get("op_id") == op_id
            ),
            None,
        )

    def wait_op(self, node: str, *states: OpState, timeout: float = 60) -> Operation:
        def probe() -> Operation | None:
            op = self.ledger.find_by_call_node(node)
            return op if op is not None and (not states or op.state in states) else None

        return wait_for(f"{node} in {[s.value for s in states]}", probe, timeout=timeout, interval=0.1)

    def server_tasks(self, server: str) -> list[dict[str, Any]]:
        path = "operations" if server == AIP else "tasks"
        body = httpx2.get(f"{self.control[server]}/{path}", timeout=10).json()
        tasks: list[dict[str, Any]] = body[path]
        return tasks

    def faults(self, server: str, **switches: Any) -> None:
        httpx2.post(f"{self.control[server]}/faults", json=switches, timeout=10).raise_for_status()


@contextlib.contextmanager
def running_fleet(args: argparse.Namespace, log_dir: Path) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        redis_child, redis_url = start_private_redis(log_dir)
        stack.callback(redis_child.stop)
        prefix = f"lcgate-{uuid.uuid4().hex[:10]}:"
        client_redis = redis.Redis.from_url(redis_url)
        stack.callback(client_redis.close)
        stack.callback(delete_prefixed, client_redis, prefix)
        db_name = stack.enter_context(fresh_database())
        stack.callback(drop_database, f"{db_name}_simulation")  # longcall gate simulate's own database
        children: dict[str, Child] = {}

        def stop_all() -> None:
            for child in reversed(list(children.values())):
                child.stop()

        stack.callback(stop_all)
        urls: dict[str, str] = {}
        control: dict[str, str] = {}
        servers: dict[str, tuple[Callable[[int], list[str]], str]] = {
            MCP: (lambda port: mcp_command(port, poll_interval_ms=200), "/mcp"),
            AIP: (aip_command, ""),
            EXT: (
                lambda port: [sys.executable, "-m", "demo_server.mcp_ext", "--port", str(port)],
                "/mcp",
            ),
        }
        for name, (argv, path) in servers.items():
            port = free_port()
            control[name] = f"http://127.0.0.1:{port}/_control"
            urls[name] = f"http://127.0.0.1:{port}{path}"
            children[name] = start_child(
                argv(port), env={}, log_dir=log_dir, name=name, ready=listening(control[name])
            )
        config = log_dir / "longcall.toml"
        config.write_text(fleet_config(urls, args.poll_qps, args.control_qps))
        env = {
            "LONGCALL_DATABASE_URL": database_url(db_name),
            "LONGCALL_REDIS_URL": redis_url,
            "LONGCALL_BROKER_KEYPREFIX": prefix,
            "LONGCALL_CONFIG": str(config),
            "LONGCALL_OUTBOX_INTERVAL_S": "0.5",
        }
        for index in range(args.workers):
            name = f"longcall{index}"
            children[name] = start_child(
                celery_worker_argv("workers.app", queues=LONGCALL_QUEUES, name=name, concurrency=2),
                env=env,
                log_dir=log_dir,
                name=name,
                ready=logged(" ready."),
            )
        children["beat"] = start_child(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.app",
                "beat",
                "-s",
                str(log_dir / "beat-schedule"),
                "--loglevel",
                "INFO",
            ],
            env=env,
            log_dir=log_dir,
            name="beat",
            ready=logged("beat: Starting"),
        )
        sink = f"{prefix}sink"
        children["pipeline"] = start_child(
            celery_worker_argv("_apps:pipeline", queues=PIPELINE_QUEUE, name="pipeline", concurrency=1),
            env={"BENCH_BROKER_URL": redis_url, "BENCH_KEYPREFIX": prefix, "BENCH_SINK": sink},
            log_dir=log_dir,
            name="pipeline",
            ready=logged(" ready."),
        )
        client = client_app(redis_url, prefix)
        stack.callback(client.close)
        ledger = Ledger.from_url(database_url(db_name), pool_size=2)
        stack.callback(ledger.dispose)
        yield Fleet(log_dir, db_name, env, control, client, client_redis, sink, ledger, children)


# ------------------------------------------------------------------------------------------ workload


@dataclass(frozen=True)
class Protocol:
    server: str
    tool: str
    done: dict[str, Any]
    failed: dict[str, Any]
    long: dict[str, Any]
    #: The input round's tool and arguments (None: this server has none), and its reply for a request.
    ask: tuple[str, dict[str, Any]] | None = None


def aip_args(seconds: float, outcome: str = "response") -> dict[str, Any]:
    return {"project": "demo", "seconds": seconds, "outcome": outcome}


PROTOCOLS = (
    Protocol(
        MCP,
        "slow_report",
        {"seconds": 0.3},
        {"seconds": 0.2, "fail": True},
        {"seconds": 120},
        ("ask_approval", {"question": "Ship the report?"}),
    ),
    Protocol(AIP, AIP_TOOL, aip_args(0.3), aip_args(0.2, "error"), aip_args(120)),
    Protocol(
        EXT,
        "slow_report",
        {"seconds": 0.3},
        {"seconds": 0.2, "fail": True},
        {"seconds": 120},
        ("ask_approval", {"question": "Ship the export?"}),
    ),
)


def approval(server: str, request: dict[str, Any]) -> dict[str, Any]:
    """The approval gate's answer: yes. (2025-11-25: the elicitation reply; the extension: keyed by the
    input request's key.)"""
    reply = {"action": "accept", "content": {"approved": True}}
    if server == EXT:
        return dict.fromkeys(request["request"], reply)
    return reply


class Nodes:
    """Call node ids of this run, chosen inside or outside the canary (its stable hash, workers/rollout.py),
    so that each role is exercised whatever the run's random tag."""

    def __init__(self, run: str, percent: float) -> None:
        self.run, self.percent, self.next = run, percent, 0

    def __call__(self, role: str, *, live: bool) -> str:
        while True:
            node = f"{self.run}/{role}/{self.next}"
            self.next += 1
            if in_canary(node, self.percent) == live:
                return node


@dataclass
class Tally:
    live: list[str] = field(default_factory=list)
    shadow: list[str] = field(default_factory=list)
    not_routed: list[str] = field(default_factory=list)
    duplicates: int = 0
    cancels: int = 0
    inputs: int = 0
    lost_creates: int = 0
    legacy: int = 0


def submit_live(
    fleet: Fleet, tally: Tally, node: str, server: str, tool: str, *, args: dict[str, Any]
) -> str:
    answer = fleet.submit(node, server, tool, args)
    if answer.get("routing") != "live" or answer.get("created") is not True:
        raise RuntimeError(f"{node}: expected a new live operation, got {answer}")
    tally.live.append(node)
    return str(answer["op_id"])


def duplicates(
    fleet: Fleet, tally: Tally, node: str, server: str, tool: str, *, args: dict[str, Any]
) -> None:
    """The same submission again, twice in a row and three at once: each must answer the existing one."""
    first = fleet.ledger.find_by_call_node(node)
    sent = [
        fleet.client.send_task(
            "longcall.submit",
            kwargs={
                "call_node_id": node,
                "server": server,
                "tool": tool,
                "arguments": args,
                "on_terminal": fleet.signature(),
                "on_input": fleet.signature(),
            },
            queue="longcall.control",
        )
        for _ in range(3)
    ]
    answers = [fleet.submit(node, server, tool, args)] + [r.get(timeout=60) for r in sent]
    for answer in answers:
        tally.duplicates += 1
        if answer.get("created") or (first is not None and answer.get("op_id") != str(first.id)):
            raise RuntimeError(f"duplicate submission of {node} answered {answer}")


def lost_create(fleet: Fleet, tally: Tally, nodes: Nodes, p: Protocol) -> None:
    """A create whose answer is lost (the server did the work): AIP-151 finds it by its request id; MCP has
    no lookup by key, so it waits for an operator, who finds the task in the server's list and says so."""
    before = {t.get("taskId") or t.get("name") for t in fleet.server_tasks(p.server)}
    fleet.faults(p.server, lose_create_response=1)
    node = nodes(f"lost-{p.server}", live=True)
    args = p.done if p.server == AIP else {"seconds": 1.0}
    submit_live(fleet, tally, node, p.server, p.tool, args=args)
    tally.lost_creates += 1
    if p.server == AIP:
        return
    op = fleet.wait_op(node, OpState.MANUAL_RECONCILIATION)
    made = wait_for(
        f"the task {p.server} made for {node}",
        lambda: [t for t in fleet.server_tasks(p.server) if t["taskId"] not in before] or None,
        timeout=30,
    )
    if len(made) != 1:
        raise RuntimeError(f"{p.server} made {len(made)} tasks for one lost create: {made}")
    task = made[0]
    fleet.cli("reconcile", "--json")
    # MCP 2025-11-25 tasks are bound to the session that made them: the operator names it too (without it
    # every poll is refused "Missing session ID", and longcall polls on: see the report of this brief).
    session = ["--session", task["session"]] if task.get("session") else []
    fleet.cli(
        "reconcile",
        str(op.id),
        "--found",
        task["taskId"],
        *session,
        "--evidence",
        f"{p.server}'s task list shows {task['taskId']} ({task.get('status')}), made while the answer"
        " to our one create was lost",
    )


def drive(fleet: Fleet, nodes: Nodes, tally: Tally) -> None:
    started = time.monotonic()
    # Lost create answers first, one protocol at a time (each server's new task is then unambiguous).
    for p in PROTOCOLS:
        lost_create(fleet, tally, nodes, p)
    fleet.say(f"  lost creates submitted ({time.monotonic() - started:.1f} s)")

    longs: list[tuple[Protocol, str, str]] = []
    asks: list[tuple[Protocol, str]] = []
    firsts: list[tuple[Protocol, str]] = []
    for p in PROTOCOLS:
        node = nodes(f"long-{p.server}", live=True)
        longs.append((p, node, submit_live(fleet, tally, node, p.server, p.tool, args=p.long)))
        for index in range(3):
            node = nodes(f"done-{p.server}", live=True)
            submit_live(fleet, tally, node, p.server, p.tool, args=p.done)
            if index == 0:
                firsts.append((p, node))
        submit_live(fleet, tally, nodes(f"failed-{p.server}", live=True), p.server, p.tool, args=p.failed)
        if p.ask is not None:
            tool, args = p.ask
            asks.append(
                (p, submit_live(fleet, tally, nodes(f"ask-{p.server}", live=True), p.server, tool, args=args))
            )
    fleet.say(f"  live operations submitted: {len(tally.live)} ({time.monotonic() - started:.1f} s)")

    # Shadow: outside the canary on a side-effect-free tool. Legacy outcomes before and after the receipt.
    shadowed: list[tuple[str, str]] = []
    for p in PROTOCOLS:
        for role, args, legacy in (
            ("shadow-done", p.done, "completed"),
            ("shadow-failed", p.failed, "failed"),
        ):
            node = nodes(f"{role}-{p.server}", live=False)
            answer = fleet.submit(node, p.server, p.tool, args)
            if answer.get("routing") != "shadow" or answer.get("created") is not True:
                raise RuntimeError(f"{node}: expected a new shadow operation, got {answer}")
            tally.shadow.append(node)
            shadowed.append((node, legacy))
    for node, legacy in shadowed[::2]:  # half recorded now, likely before longcall's receipt
        fleet.send("longcall.record_legacy_outcome", call_node_id=node, terminal_state=legacy)
        tally.legacy += 1

    # Not routed: outside the canary, a tool not marked side-effect-free; asked twice, answered the same.
    for index in range(2):
        node = nodes("not-routed", live=False)
        for _ in range(2):
            answer = fleet.submit(node, MCP, "quick_lookup", {"key": f"k{index}"})
            if answer != {"routed": False, "reason": "canary", "percent": nodes.percent}:
                raise RuntimeError(f"{node}: expected not routed, got {answer}")
        if fleet.ledger.find_by_call_node(node) is not None:
            raise RuntimeError(f"{node}: answered not routed, yet it has an operation")
        tally.not_routed.append(node)

    # Duplicate submissions of live call nodes (one per protocol), while they run or after.
    for p, node in firsts:
        duplicates(fleet, tally, node, p.server, p.tool, args=p.done)

    # Input rounds: the approval gate answers the request it was sent.
    for p, op_id in asks:
        request = wait_for(f"the input request of {op_id}", partial(fleet.input_request, op_id), timeout=60)
        fleet.send(
            "longcall.provide_input",
            op_id=op_id,
            input_round=int(request["input_round"]),
            response=approval(p.server, request),
        )
        tally.inputs += 1

    # Cancels: each long operation once it works on the server.
    for _, node, op_id in longs:
        fleet.wait_op(node, OpState.WORKING)
        fleet.send("longcall.cancel", op_id=op_id)
        tally.cancels += 1
    fleet.say(f"  cancels, inputs, duplicates, shadow sent ({time.monotonic() - started:.1f} s)")

    for node in tally.live:
        wait_for(f"the receipt of {node}", partial(fleet.receipt, node), timeout=120)
    for node in tally.shadow:
        fleet.wait_op(node, OpState.ACCEPTED, timeout=120)
    for node, legacy in shadowed[1::2]:  # the other half after longcall's receipt
        fleet.send("longcall.record_legacy_outcome", call_node_id=node, terminal_state=legacy)
        tally.legacy += 1
    wait_for(
        "every shadow comparison made and every advance dispatched",
        lambda: settled(fleet, len(tally.shadow)),
        timeout=60,
        interval=0.2,
    )
    fleet.say(f"  everything delivered and compared ({time.monotonic() - started:.1f} s)")


def settled(fleet: Fleet, shadows: int) -> bool:
    with fleet.ledger.engine.connect() as conn:
        compared = conn.exec_driver_sql(
            "SELECT count(*) FROM shadow_comparison WHERE diverged IS NOT NULL"
        ).scalar_one()
    return int(compared) == shadows and fleet.ledger.ready_outbox_count() == 0


def ledger_summary(fleet: Fleet) -> list[str]:
    """What the run left in the ledger (read-only), so the table can be checked against it."""
    with fleet.ledger.engine.connect() as conn:
        ops = conn.exec_driver_sql(
            "SELECT server, routing, state, count(*) FROM tool_operation GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
        ).all()
        receipts = conn.exec_driver_sql(
            "SELECT o.server, r.terminal_state, count(*) FROM terminal_receipt r "
            "JOIN tool_operation o ON o.id = r.op_id GROUP BY 1, 2 ORDER BY 1, 2"
        ).all()
        events = conn.exec_driver_sql(
            "SELECT kind, count(*) FROM operation_event WHERE kind IN ('create_attempted', 'created', "
            "'submission_unknown', 'found_by_key', 'manual_reconciliation', 'cancel_requested', "
            "'input_requested', 'input_provided') GROUP BY 1 ORDER BY 1"
        ).all()
        records = conn.exec_driver_sql(
            "SELECT reason, resolution, count(*) FROM reconciliation GROUP BY 1, 2 ORDER BY 1, 2"
        ).all()
        shadow = conn.exec_driver_sql(
            "SELECT diverged, count(*) FROM shadow_comparison GROUP BY 1 ORDER BY 1"
        ).all()
        decisions = conn.exec_driver_sql(
            "SELECT routed, count(*) FROM routing_decision GROUP BY 1 ORDER BY 1"
        ).all()
    return [
        "operations (server, routing, state, n): " + "; ".join(" ".join(map(str, r)) for r in ops),
        "receipts (server, terminal state, n): " + "; ".join(" ".join(map(str, r)) for r in receipts),
        "events: " + "; ".join(" ".join(map(str, r)) for r in events),
        "reconciliation records (reason, resolution, n): "
        + "; ".join(" ".join(map(str, r)) for r in records),
        "shadow comparisons (diverged, n): " + "; ".join(" ".join(map(str, r)) for r in shadow),
        "routing decisions (routed, n): " + "; ".join(" ".join(map(str, r)) for r in decisions),
    ]


# ------------------------------------------------------------------------------------------- the run


def run(args: argparse.Namespace, log_dir: Path) -> int:
    started = time.monotonic()
    with running_fleet(args, log_dir) as fleet:
        fleet.say(
            f"fleet up ({time.monotonic() - started:.1f} s): servers {MCP} (MCP 2025-11-25),"
            f" {AIP} (AIP-151 v1), {EXT} (MCP 2026-07-28 tasks extension),"
            f" poll_qps {args.poll_qps:g}, control_qps {args.control_qps:g};"
            f" {args.workers} longcall workers x 2, beat, pipeline worker;"
            f" ledger database {fleet.db_name}"
        )
        fleet.cli("gate", "simulate", "--series", str(args.series), "--seed", str(args.seed))
        fleet.cli("rollout", "--shadow", "on", "--reason", "gate run: compare side-effect-free tools first")
        fleet.cli("rollout", "--percent", "5", "--reason", "gate run: the first canary")
        fleet.cli("rollout", "--percent", f"{args.percent:g}", "--reason", "gate run: raise, the gate asked")
        tally = Tally()
        fleet.say(f"workload ({time.monotonic() - started:.1f} s):")
        drive(fleet, Nodes(f"gr{uuid.uuid4().hex[:6]}", args.percent), tally)
        fleet.say(
            f"workload sent: {len(tally.live)} live call nodes, {len(tally.shadow)} shadow"
            f" ({tally.legacy} legacy outcomes), {len(tally.not_routed)} not routed (each asked twice),"
            f" {tally.duplicates} duplicate submissions, {tally.cancels} cancels, {tally.inputs} input"
            f" rounds, {tally.lost_creates} lost create answers"
        )
        for line in ledger_summary(fleet):
            fleet.say("  " + line)
        fleet.cli("rollout", "--history")
        fleet.say(f"the gate ({time.monotonic() - started:.1f} s):")
        table = fleet.cli("gate", check=False)
        machine = fleet.cli("gate", "--json", check=False)
        if table.returncode != machine.returncode:
            raise RuntimeError("longcall gate and longcall gate --json disagree")
        fleet.say(
            f"elapsed {time.monotonic() - started:.1f} s; load: {Path('/proc/loadavg').read_text().strip()}"
        )
        return table.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--seed", type=int, default=20261201, help="the simulation's seed")
    parser.add_argument("--series", type=int, default=500, help="the simulation's series")
    parser.add_argument("--percent", type=float, default=50, help="the canary after the raise")
    parser.add_argument("--poll-qps", type=float, default=5, help="every server's poll budget")
    parser.add_argument("--control-qps", type=float, default=5, help="every server's control budget")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--max-s",
        type=int,
        default=800,
        help="bound on the whole run (about 4 min unloaded; 500 series ~ 3 min at load 10)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = parser.parse_args(argv)
    raise_on_sigterm()
    with log_directory("lc-gate-run-", keep=args.keep_logs) as log_dir, alarm(args.max_s):
        return run(args, log_dir)


if __name__ == "__main__":
    sys.exit(main())
