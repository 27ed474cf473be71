"""Issue 19, item 13: a seeded chaos scenario on the real fleet.

A few dozen long calls (duplicates, cancels, input rounds) through two longcall workers and beat, on a
Postgres and a Redis of the test's own (Redis with the append-only file of docker-compose.yml), while a
seeded schedule kills worker processes (a worker's whole process group, or its pool processes) and beat
with SIGKILL and starts them again, crashes Redis and starts it again, stops Postgres (immediate) and starts
it again, and cuts the path to the MCP server for a few seconds. Every message is sent by name, once, while
the faults happen (the sender waits for the broker to take it, as a pipeline's publish does).

Afterwards: every call node is final, or with an operator for a reason only a fault can leave (a create
whose answer was lost, on a protocol that cannot be asked by key); no submission, cancel or answer is lost;
the server holds at most one task per call node; at most one receipt per call node, equal to the server's
own final view; every receipt delivered (deduplicated by ``outbox_id``); no QPS cap exceeded.

Replay a failure with ``LONGCALL_CHAOS_SEED=<seed printed>``.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from ledger.migrate import upgrade
from ledger.reasons import ReconciliationReason
from ledger.repository import Ledger
from ledger.states import FINAL_STATES, OpState
from tests import support
from tests.integration.faults.test_faults_durability import compose_redis_flags
from tests.integration.steps.test_qps import max_in_any_window
from tests.support import chaos
from tests.support.fleet import Fleet, FleetParts, McpServer, running_fleet
from tests.support.pipeline_app import make_app

S = OpState

SEED = int(os.environ.get("LONGCALL_CHAOS_SEED") or random.SystemRandom().randrange(1, 1_000_000))
#: The span of the fault schedule; the work is sent during its first two thirds.
SPAN_S = 75.0
POLL_QPS, CONTROL_QPS = 20, 10
APPROVE = {"action": "accept", "content": {"approved": True}}
#: What only a fault can leave to an operator on MCP 2025-11-25 (no lookup by key): a create whose answer
#: was lost (a cut path, a worker killed between recording its attempt and recording the answer).
FAULT_REASONS = {ReconciliationReason.SUBMISSION_UNKNOWN}


@dataclass
class Call:
    node: str
    tool: str
    arguments: dict[str, Any]
    send_at: float
    duplicate_at: float | None = None
    cancel_at: float | None = None
    asks: bool = False
    answered: bool = False
    sent: list[str] = field(default_factory=list)


def workload(rng: random.Random) -> list[Call]:
    """Thirty calls over the first two thirds of the span: reports of 2-10 s (a few failing), four sent
    twice, five cancelled mid-run, four that ask for approval."""
    calls: list[Call] = []
    for i in range(30):
        node = f"chaos/{SEED}/{i}"
        send_at = rng.uniform(0.0, SPAN_S * 2 / 3)
        if i < 4:
            calls.append(Call(node, "ask_approval", {"question": f"ship {node}?", "node": node}, send_at))
            calls[-1].asks = True
            continue
        seconds = round(rng.uniform(2.0, 10.0), 1)
        arguments: dict[str, Any] = {"seconds": seconds, "node": node}
        call = Call(node, "slow_report", arguments, send_at)
        if i < 9:  # cancelled while it runs
            call.arguments["seconds"] = 40
            call.cancel_at = send_at + rng.uniform(3.0, 8.0)
        elif i < 13:  # sent again, as a pipeline that retries does
            call.duplicate_at = send_at + rng.uniform(1.0, 15.0)
        elif i < 16:
            call.arguments["fail"] = True
        calls.append(call)
    return calls


class Sender:
    """The pipeline's side: each message sent by name once; the publish waits for the broker to take it
    (the broker may be restarting), as Celery's own publish retry does, then it is never sent again."""

    def __init__(self, fleet: Fleet, redis_url: str, prefix: str) -> None:
        self.app: Celery = make_app(redis_url, prefix, fleet.sink, redis_url)
        self.fleet = fleet
        self.sent = 0

    def send(self, task: str, **kwargs: Any) -> str:
        result = self.app.send_task(
            task,
            kwargs=kwargs,
            queue="longcall.control",
            ignore_result=True,  # nobody waits: no subscription to a result channel on a restarting Redis
            retry=True,
            retry_policy={
                "max_retries": 120,
                "interval_start": 0.5,
                "interval_step": 0.5,
                "interval_max": 1.0,
            },
        )
        self.sent += 1
        return str(result.id)

    def submit(self, call: Call) -> None:
        on_terminal = dict(self.app.signature("pipeline.record", queue="pipeline"))
        on_input = dict(self.app.signature("pipeline.record", queue="pipeline"))
        call.sent.append(
            self.send(
                "longcall.submit",
                call_node_id=call.node,
                server="reports",
                tool=call.tool,
                arguments=call.arguments,
                on_terminal=on_terminal,
                on_input=on_input,
            )
        )

    def close(self) -> None:
        support.release_app(self.app)


class Supervisor:
    """What compose's ``restart: unless-stopped`` does, and the faults the schedule asks for."""

    def __init__(
        self,
        fleet: Fleet,
        postgres: support.PrivatePostgres,
        hot: support.PrivateRedis,
        path: chaos.CuttablePath,
    ) -> None:
        self.fleet, self.postgres, self.hot, self.path = fleet, postgres, hot, path
        self.log: list[str] = []
        self.restarts = 0
        self._postgres_back_at: float | None = None

    def apply(self, fault: chaos.Fault, now: float) -> None:
        self.log.append(str(fault))
        workers = [w for w in self.fleet.workers() if w.proc.poll() is None]
        if fault.kind == "kill_worker" and workers:
            workers[fault.target % len(workers)].kill()
        elif fault.kind == "kill_pool" and workers:
            workers[fault.target % len(workers)].kill_children()
        elif fault.kind == "kill_beat":
            for beat in self._beats():
                beat.kill()
        elif fault.kind == "crash_redis":
            self.hot.stop(signal.SIGKILL)
            time.sleep(fault.seconds)
            self.hot.start()
        elif fault.kind == "stop_postgres":
            self.postgres.stop()
            self._postgres_back_at = now + fault.seconds
        elif fault.kind == "cut_server":
            self.path.cut(fault.seconds)

    def tick(self, now: float) -> None:
        """Bring back what the faults took down (Postgres at its time, the processes at once)."""
        if self._postgres_back_at is not None and now >= self._postgres_back_at:
            self.postgres.start()
            self._postgres_back_at = None
        for worker in self.fleet.workers():
            if worker.proc.poll() is not None and not worker.name.endswith("(gone)"):
                worker.name += "(gone)"
                self.restarts += 1
                self.fleet.start_worker(f"longcall-r{self.restarts}")
        beats = self._beats()
        if beats and all(b.proc.poll() is not None for b in beats):
            for beat in beats:
                beat.name += "(gone)"
            self.restarts += 1
            self.fleet.start_beat(f"beat-r{self.restarts}")

    def _beats(self) -> list[support.CeleryProcess]:
        return [
            p for p in self.fleet.processes if p.name.startswith("beat") and not p.name.endswith("(gone)")
        ]

    def finish(self) -> None:
        if self._postgres_back_at is not None:
            self.postgres.start()
            self._postgres_back_at = None


@pytest.fixture
def chaos_parts(
    tmp_path: Path, log_dir: Path
) -> Iterator[tuple[FleetParts, support.PrivatePostgres, support.PrivateRedis]]:
    with (
        support.private_postgres(log_dir) as postgres,
        support.private_redis(tmp_path / "redis", log_dir, *compose_redis_flags()) as hot,
    ):
        database_url = postgres.create_database("longcall")
        upgrade(database_url)
        ledger = Ledger.from_url(database_url)
        client = redis.Redis.from_url(hot.url, socket_timeout=5)
        try:
            yield (
                FleetParts(ledger, database_url, "lc-chaos:", client, tmp_path, log_dir, hot.url),
                postgres,
                hot,
            )
        finally:
            client.close()
            ledger.dispose()


def settle_ledger(ledger: Ledger) -> None:
    ledger.engine.dispose()  # connections Postgres dropped at its stops


@pytest.mark.timeout(480)  # a 75 s schedule, up to 150 s to settle, and the fleet's start and stop
def test_a_seeded_chaos_run_loses_nothing_and_makes_one_operation_per_call_node(
    chaos_parts: tuple[FleetParts, support.PrivatePostgres, support.PrivateRedis],
) -> None:
    parts, postgres, hot = chaos_parts
    print(f"chaos seed {SEED} (replay: LONGCALL_CHAOS_SEED={SEED})")
    rng = random.Random(SEED)
    calls = workload(rng)
    faults = chaos.schedule(SEED, span_s=SPAN_S, workers=2)
    print("fault schedule:", "; ".join(str(f) for f in faults))
    paths: list[chaos.CuttablePath] = []

    def through_a_cuttable_path(mcp: McpServer) -> str:
        port = int(mcp.url.rsplit(":", 1)[1].split("/")[0])
        paths.append(chaos.CuttablePath(("127.0.0.1", port)))
        return f"http://127.0.0.1:{paths[0].port}/mcp"

    env = {
        "LONGCALL_LEASE_S": "15",
        "LONGCALL_REDIS_VISIBILITY_TIMEOUT_S": "20",
        "LONGCALL_INPUT_REPLY_S": "60",
    }
    server = {"poll_qps": POLL_QPS, "control_qps": CONTROL_QPS, "wait_budget_s": 900}
    with running_fleet(parts, env=env, server=server, pipeline=False, route=through_a_cuttable_path) as fleet:
        fleet.start_pipeline(app="tests.support.durable_pipeline_app")
        sender = Sender(fleet, parts.redis_url, parts.broker_prefix)
        supervisor = Supervisor(fleet, postgres, hot, paths[0])
        clock = chaos.Clock()
        pending_faults = collections.deque(faults)
        try:

            def duties() -> None:
                now = clock.now()
                supervisor.tick(now)
                while pending_faults and pending_faults[0].at_s <= now:
                    supervisor.apply(pending_faults.popleft(), now)
                for call in calls:
                    if not call.sent and call.send_at <= now:
                        sender.submit(call)
                    if call.duplicate_at is not None and len(call.sent) == 1 and call.duplicate_at <= now:
                        sender.submit(call)
                    if call.cancel_at is not None and call.cancel_at <= now and call.sent:
                        op = _operation(fleet, call.node)
                        if op is not None:
                            sender.send("longcall.cancel", op_id=str(op.id))
                            call.cancel_at = None
                    if call.asks and not call.answered:
                        _answer_if_asked(fleet, sender, call)

            clock.until(SPAN_S, duties)
            supervisor.finish()
            assert not pending_faults
            deadline = clock.now() + 150

            def settled() -> bool:
                duties()
                return _all_settled(fleet, calls)

            while not settled():
                assert clock.now() < deadline, _report(fleet, calls, supervisor, "the calls did not settle")
                time.sleep(0.5)
            support.wait_for("the pipeline to settle", fleet.settled, timeout=60)
            _check(fleet, calls, supervisor)
            print(_summary(fleet, calls, supervisor, clock.now()))
        finally:
            supervisor.finish()
            sender.close()
            for path in paths:
                path.close()


def _operation(fleet: Fleet, node: str) -> Any:
    try:
        return fleet.ledger.find_by_call_node(node)
    except Exception:  # noqa: BLE001 - Postgres is down (a fault of the schedule): ask again later
        settle_ledger(fleet.ledger)
        return None


def _answer_if_asked(fleet: Fleet, sender: Sender, call: Call) -> None:
    """The approval gate: a request delivered for this call node is answered once, by name."""
    try:
        requests = [r for r in fleet.input_requests() if r["call_node_id"] == call.node]
    except redis.RedisError:
        return  # the sink's Redis is restarting: look again on the next tick
    if requests:
        request = requests[0]
        sender.send(
            "longcall.provide_input",
            op_id=request["op_id"],
            input_round=request["input_round"],
            response=APPROVE,
        )
        call.answered = True


def _all_settled(fleet: Fleet, calls: list[Call]) -> bool:
    try:
        for call in calls:
            op = fleet.ledger.find_by_call_node(call.node)
            if op is None:
                return False
            if op.state in FINAL_STATES:
                continue
            if op.state is not S.MANUAL_RECONCILIATION:
                return False
    except Exception:  # noqa: BLE001 - Postgres restarting
        settle_ledger(fleet.ledger)
        return False
    return True


def _report(fleet: Fleet, calls: list[Call], supervisor: Supervisor, why: str) -> str:
    lines = [f"{why} (seed {SEED}); faults: {supervisor.log}"]
    for call in calls:
        op = _operation(fleet, call.node)
        lines.append(f"  {call.node}: {op.state.value if op else 'NO ROW'} sent={len(call.sent)}")
    return "\n".join(lines)


def _summary(fleet: Fleet, calls: list[Call], supervisor: Supervisor, took_s: float) -> str:
    """What the run came to: the calls by end, the faults, the restarts, the messages sent by name."""
    ends: collections.Counter[str] = collections.Counter()
    for call in calls:
        op = fleet.ledger.find_by_call_node(call.node)
        assert op is not None
        receipt = fleet.ledger.receipt_for(op.id)
        reasons = [r.reason.value for r in fleet.ledger.reconciliations_for(op.id) if r.resolved_at is None]
        ends[receipt.terminal_state.value if receipt else f"operator:{','.join(reasons)}"] += 1
    return (
        f"chaos seed {SEED}: {len(calls)} calls in {took_s:.0f} s, ends {dict(ends)}; faults "
        f"{supervisor.log}; {supervisor.restarts} restarts; {sum(len(c.sent) for c in calls)} submissions, "
        f"{len(fleet.receipts())} receipt deliveries"
    )


def _check(fleet: Fleet, calls: list[Call], supervisor: Supervisor) -> None:
    ledger = fleet.ledger
    tasks_by_node: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for task in fleet.mcp.tasks():
        tasks_by_node[task["arguments"]["node"]].append(task)
    receipts_by_node: dict[str, dict[str, tuple[Any, ...]]] = collections.defaultdict(dict)
    for delivery in fleet.receipts():
        key = (delivery["receipt_id"], delivery["terminal_state"], delivery["result_digest"])
        receipts_by_node[delivery["call_node_id"]][str(delivery["outbox_id"])] = key
    problems: list[str] = []
    for call in calls:
        op = ledger.find_by_call_node(call.node)
        assert op is not None, f"the submission of {call.node} was lost (seed {SEED})"
        tasks = tasks_by_node.get(call.node, [])
        if len(tasks) > 1:
            problems.append(f"{call.node}: {len(tasks)} tasks on the server")
        if op.state is S.MANUAL_RECONCILIATION:
            reasons = {r.reason for r in ledger.reconciliations_for(op.id) if r.resolved_at is None}
            if not reasons <= FAULT_REASONS:
                problems.append(f"{call.node}: with an operator for {sorted(reasons)}")
            continue
        receipt = ledger.receipt_for(op.id)
        if receipt is None:
            problems.append(f"{call.node}: final without a receipt")
            continue
        delivered = receipts_by_node.get(call.node, {})
        if len({v[0] for v in delivered.values()}) != 1:
            problems.append(f"{call.node}: receipts delivered {delivered}")
        if call.cancel_at is None and call.arguments.get("seconds") == 40 and op.cancel_generation < 1:
            problems.append(f"{call.node}: the cancel was lost (generation {op.cancel_generation})")
        if not tasks:
            if receipt.terminal_state.value != "cancelled":
                problems.append(f"{call.node}: {receipt.terminal_state.value} without a task on the server")
            continue
        task = tasks[0]
        if receipt.terminal_state.value != task["status"]:
            problems.append(f"{call.node}: receipt {receipt.terminal_state.value}, server {task['status']}")
        elif task["status"] != "cancelled" and op.result["content"] != task["result"]["content"]:
            problems.append(f"{call.node}: the receipt's result is not the server's")
        if call.asks and (task["status"] != "completed" or op.result["content"][0]["text"] != "approved"):
            problems.append(f"{call.node}: the answer was lost ({task['status']})")
    assert not problems, f"seed {SEED}, faults {supervisor.log}:\n" + "\n".join(problems)
    _check_qps(fleet)


def _check_qps(fleet: Fleet) -> None:
    """In no one-second window did the server receive more requests of one budget than its cap, nor more
    than both caps together (rule 4), counted on the server's own clock from its log of arrivals."""
    requests = fleet.mcp.http_log()
    by_budget: dict[str, list[float]] = collections.defaultdict(list)
    for entry in requests:
        by_budget[str(entry["budget"])].append(float(entry["t"]))
    seen = {budget: max_in_any_window(times, 1.0) for budget, times in by_budget.items()}
    total = max_in_any_window([float(e["t"]) for e in requests], 1.0)
    assert seen.get("poll", 0) <= POLL_QPS, f"seed {SEED}: {seen} requests in one second"
    assert seen.get("control", 0) <= CONTROL_QPS, f"seed {SEED}: {seen} requests in one second"
    assert total <= POLL_QPS + CONTROL_QPS, f"seed {SEED}: {total} requests in one second ({seen})"


def test_the_schedule_is_seeded_and_names_every_fault_kind() -> None:
    """The same seed gives the same schedule (a failure can be replayed), and every kind is in it."""
    first = chaos.schedule(7, span_s=SPAN_S, workers=2)
    assert first == chaos.schedule(7, span_s=SPAN_S, workers=2)
    assert {f.kind for f in first} == set(chaos.FAULTS)
    assert all(b.at_s > a.at_s for a, b in itertools.pairwise(first))
    assert first[-1].at_s <= SPAN_S
