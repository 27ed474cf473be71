"""Issues 4 and 13: one operation's life through a real fleet, what it costs, and the baselines it is held to.

One run, on loopback: longcall's MCP server (``python -m demo_server.mcp --poll-interval-ms 500``), two
longcall workers (concurrency 2) and beat, and a pipeline worker that imports nothing of longcall and records
every receipt it is sent (``bench/_apps.py``). A fresh, migrated ledger database; Redis of its own, so that
``INFO commandstats`` counts this run and nothing else: two redis-servers, the broker's and longcall's
(``--redis-url`` uses one shared Redis for both instead, under a unique key prefix; with ``--broker
rabbitmq`` the one private Redis is longcall's). The longcall workers run longcall's own app plus one
counting no-op task (``_apps:longcall``), so the Celery baseline is measured in the very processes that
run the steps. Phases:

1. warm-up, then an idle window: what the fleet costs doing nothing (beat ticks, broker polling). The
   warm-up is a burst of the burst's own size and shape (``--warmup``, default N): each worker process's
   pools (Redis and Postgres connections, the status reads' sockets, member threads) grow to the
   concurrency a burst asks for once in the process's life, which a fleet that has run a while has done.
   With 8 operations (the default until 2026-12-07), the burst's own figures carried that growth: about
   0.3 Redis connections opened per operation (a HELLO and three CLIENT commands each: 1.4 commands an
   operation on longcall's Redis) and 20 to 27 Postgres sessions in a burst of 60 (quick runs);
2. Celery baseline: ``--noop-n`` fire-and-forget no-op tasks (results ignored; each INCRs a Redis counter),
   counted from the first send to the last completion, with task events as the fleet configures them and
   the other way (remote ``enable_events``/``disable_events``), ``--noop-reps`` batches each (the median);
   and the worker CPU per no-op task (``/proc``, net of idle);
3. burst: N ``slow_report`` operations (0.2 s, less than one poll interval: each needs exactly one poll) sent
   at once by the pipeline through ``longcall.submit``, each with an ``on_terminal`` that records the
   receipt: operations/s, and ledger transactions, Redis calls and broker messages per operation;
4. paced: operations of 0.1-1.6 s sent at a steady rate below capacity: detection lag, from the server's
   completion (``lastUpdatedAt`` of the completed task in ``GET /_control/tasks``) to the
   ``terminal_observed`` event's ``at``, against the server's poll interval;
5. cancel: long operations, then ``longcall.cancel`` for each: time from sending the request to the
   ``terminal_accepted`` event into CANCELLED_ACCEPTED;
6. unchanged polls: ``--unchanged`` long operations WORKING, polled repeatedly for ``--unchanged-s``: worker
   CPU, ledger transactions, Redis calls and broker messages per poll (polls counted from the server's request
   log), and the ledger event rows written in the window (target: none). 300 operations by default, at the
   server's 500 ms interval 600 polls/s: the density the target is about (5,000 in flight per worker core
   at 5 s is 1,000 polls/s a core), where a tick's messages carry full batches. At 60 in flight (the
   default until 2026-12-06) a batch held about 11 members, and each message's and each tick's own cost
   was spread over a fraction of the polls it serves at that density (1.2-1.4 ms a poll then, 0.7 at 300);
7. with the fleet stopped: raw Postgres commits/s over as many concurrent connections as the fleet held
   (one process each, one-row UPDATE transactions).

Every target is printed as a ``TARGET`` line (measured, target, ratio, PASS/FAIL) and the per-poll figures
the 100,000-operation model is built from as ``SCALING INPUT`` lines (``bench/run_all.py`` collects both).

How the costs are counted (burst phase, divided by N):

* ledger transactions (the target's figure): the commits the longcall workers' processes make, seen as
  each is made (SQLAlchemy's ``commit`` event and every autocommit statement, ``bench/_apps.py``
  ``count_ledger_commits``) and labelled with its caller (task, step, ``Ledger`` method), from the first
  submission to 1 s after the last receipt: every task's but the beat's periodic ones (``dispatch_due``
  ticks, ``drain_outbox``, ``reconcile``), which run on the beat's clock with or without operations; they
  are listed beside it, and a second figure nets them at the idle window's rate instead (right only on
  average: one tick more or less in a 2 s window is 0.02 per operation at 60). The server's count is
  printed beside it too: ``pg_stat_database.xact_commit`` of the run's database,
  read 11 s after the last receipt (backends flush their statistics at most once a second while busy, and
  within 10 s of going idle) minus the idle fleet's rate over that whole span. It is no longer the target's
  figure because that subtraction is noise, not the operation: the idle fleet commits about 5 transactions
  a second, the 11 s wait puts some 55 of them (about 1 per operation at 60) into the burst's count, and
  the rate they are subtracted at is read through the same once-a-second (or 10 s idle) flush over a 3 s
  window: a burst of exactly 7 transactions per operation read 7.02 in one quick run and 7.33 in another.
  Nothing is hidden by the switch: the line beside it compares the server's count with the workers'
  commits over the same span (what is not a worker's commit shows there: a connection's start is a
  transaction, and the connections opened are counted, ``pg_stat_database.sessions``), and
  every caller is listed, the dispatcher's ticks included (a tick is one transaction whether it claims
  rows or not; how many ticks claimed burst rows is printed, with the figure they would make charged to
  the operations).
  The counting costs the workers about 5 us per commit and per command sent to longcall's Redis (well
  under 1% of a step's CPU);
* Redis calls (the target's figure): the sum of ``calls`` in ``INFO commandstats`` (commands inside Lua
  scripts included) of every Redis the run uses, minus this process's own commands and the idle rate.
  Unless ``--redis-url`` (one shared Redis) or ``--broker rabbitmq``, the broker (``broker_url``) and
  longcall's own state (``redis_url``: buckets, meters, CAS, the result backend, and the bench's receipt
  sink) are two private redis-servers, so each one's commands are counted on their own, not estimated: per
  operation and per unchanged poll the broker's commands, longcall's commands, the script calls among them
  (``EVALSHA``/``EVAL``) and longcall's top-level calls ("round trips": what the workers send it, counted as
  they send it, ``bench/_apps.py`` ``count_redis_commands``, plus the pipeline's receipt ``RPUSH``; the
  rest of longcall's commands ran inside scripts). Broker messages are counted on their own too (see
  ``burst``). With one shared Redis the transport's share is still estimated at a no-op message's cost;
* CPU: ``/proc`` user + system time of each part of the fleet, Postgres backends included.

The servers' budgets (``--qps``, poll and control; 2,000 a second, which the buckets hand out at 80 %) are
set high: the token buckets are not what this measures, although their refusals (``no_token``) are counted
among the step outcomes. (At 500, the earlier default, the 600 polls/s of the unchanged phase met 400
a second of slots, and the refused polls' hand-backs were counted in the poll's cost.)

Run: ``.venv/bin/python bench/lifecycle.py [--quick] [--json]``
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from _apps import NOOP_QUEUE, noop_counter
from _fleet import Counters, Fleet, running_fleet, services, set_task_events, tx_dir
from _harness import (
    alarm,
    backend_pids,
    database_url,
    log_directory,
    percentile,
    raise_on_sigterm,
    scaling_input,
    target,
    wait_for,
    xact_commit,
)

from beat_schedule import beat_schedule
from ledger.repository import Ledger

#: The beat's periodic tasks (``dispatch_due``, ``drain_outbox``, ``reconcile``): they run on the beat's
#: clock, with or without operations, so their transactions are the fleet's, not an operation's.
PERIODIC_TASKS = frozenset(
    entry["task"]
    for entry in beat_schedule(dispatch_interval_s=1, outbox_interval_s=1, reconcile_interval_s=1).values()
)

#: Backends flush their statistics at most once a second and, when they go idle, within 10 s
#: (PGSTAT_IDLE_INTERVAL): ``xact_commit`` is read this long after the work it should include.
PG_STATS_FLUSH_S = 11.0


def commits_by_caller(log_dir: Path, t0: float, t1: float, suffix: str = ".tx") -> collections.Counter[str]:
    """The ledger commits the longcall workers made between ``t0`` and ``t1`` (their own clock, seen
    client-side), by ``task step Ledger.method``; with ``suffix=".redis"``, the commands they sent to
    longcall's Redis, by command."""
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(tx_dir(log_dir).glob(f"*{suffix}")):
        for line in path.read_text().splitlines():
            t, _, caller = line.partition(" ")
            if t0 <= float(t) < t1:
                counts[caller] += 1
    return counts


# ------------------------------------------------------------------------------------------- phases


def burst(fleet: Fleet, run: str) -> dict[str, Any]:
    """Phase 2: N one-poll operations at once; returns throughput and per-operation costs.

    Messages are counted from the workers' ``Task ... received`` log lines (every message a worker takes off
    the broker, expired beat ticks included), per task name, minus what beat sent in the same window (the
    periodic ``dispatch_due``/``drain_outbox``/``reconcile`` ticks are the fleet's, not the operations').
    Cross-check: Redis ``LPUSH`` calls (kombu publishes a message with one LPUSH) minus beat's sends.
    """
    args = fleet.args
    received0, beat0, steps0 = fleet.message_counts()
    cpu0 = fleet.cpu()
    before = fleet.counters()
    started = time.time()
    for index in range(args.n):
        fleet.submit(f"{run}-burst-{index}", args.seconds)
    fleet.wait_receipts(fleet.sent, timeout=args.wait_s)
    cpu1 = fleet.cpu()
    time.sleep(1.0)  # the workers' log lines of the last messages
    received1, beat1, steps1 = fleet.message_counts()
    settled = fleet.counters()
    time.sleep(PG_STATS_FLUSH_S)
    after = fleet.counters()
    commits = commits_by_caller(fleet.log_dir, before.t, settled.t)
    commits_to_after = sum(commits_by_caller(fleet.log_dir, before.t, after.t).values())
    redis_sent = commits_by_caller(fleet.log_dir, before.t, settled.t, ".redis")
    receipts = [
        d for d in fleet.deliveries() if d["kwargs"]["receipt"]["call_node_id"].startswith(f"{run}-burst-")
    ]
    finished = max(d["t"] for d in receipts)
    requests = collections.Counter(e["method"] for e in fleet.server_log() if started <= e["t"] <= finished)
    received = received1 - received0
    beat_sent = beat1 - beat0
    per_task = {name: received[name] - beat_sent[name] for name in sorted(received)}
    return {
        "before": before,
        "settled": settled,
        "after": after,
        "started": started,
        "finished": finished,
        "receipts": len(receipts),
        "completed": sum(d["kwargs"]["receipt"]["terminal_state"] == "completed" for d in receipts),
        "messages_by_task": per_task,
        "beat_sent": sum(beat_sent.values()),
        "steps": dict(sorted((steps1 - steps0).items())),
        "server_requests": dict(sorted(requests.items())),
        "cpu_s": {name: cpu1[name] - cpu0[name] for name in cpu0},
        "commits_by_caller": commits,
        "commits_to_after": commits_to_after,
        "redis_sent": redis_sent,
    }


def paced(fleet: Fleet, run: str) -> None:
    """Phase 3: operations of 0.1-1.6 s at a steady rate (completion falls anywhere in a poll interval)."""
    args = fleet.args
    rng = random.Random(4)  # a reproducible spread
    for index in range(args.paced):
        tick = time.monotonic()
        fleet.submit(f"{run}-paced-{index}", round(rng.uniform(0.1, 1.6), 3))
        time.sleep(max(0.0, 1 / args.pace - (time.monotonic() - tick)))
    fleet.wait_receipts(fleet.sent, timeout=args.wait_s)


def cancels(fleet: Fleet, run: str) -> dict[str, float]:
    """Phase 4: long operations, then ``longcall.cancel`` for each; returns op id -> time the request went."""
    args = fleet.args
    for index in range(args.cancels):
        fleet.submit(f"{run}-cancel-{index}", 600)

    def working() -> list[str] | None:
        with psycopg.connect(database_url(fleet.db_name), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT id FROM tool_operation WHERE call_node_id LIKE %s AND state = 'WORKING'",
                (f"{run}-cancel-%",),
            ).fetchall()
        return [str(r[0]) for r in rows] if len(rows) == args.cancels else None

    op_ids = wait_for(
        f"{args.cancels} long operations to be WORKING", working, timeout=args.wait_s, interval=0.2
    )
    requested: dict[str, float] = {}
    for op_id in op_ids:
        tick = time.monotonic()
        requested[op_id] = time.time()
        fleet.client.send_task("longcall.cancel", kwargs={"op_id": op_id}, queue="longcall.control")
        time.sleep(max(0.0, 1 / args.pace - (time.monotonic() - tick)))
    fleet.wait_receipts(fleet.sent, timeout=args.wait_s)
    return requested


def ledger_view(db_name: str, run: str) -> dict[str, dict[str, Any]]:
    """Per call node: op id, remote id, state, its events (kind, at, to_state) and its unchanged polls
    (counted on the row, not written as events)."""
    ops: dict[str, dict[str, Any]] = {}
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        rows = conn.execute(
            """
            SELECT o.call_node_id, o.id, o.remote_id, o.state, o.unchanged_polls, e.kind, e.at, e.to_state
            FROM tool_operation o JOIN operation_event e ON e.op_id = o.id
            WHERE o.call_node_id LIKE %s ORDER BY o.call_node_id, e.seq
            """,
            (f"{run}-%",),
        ).fetchall()
    for call_node_id, op_id, remote_id, state, unchanged_polls, kind, at, to_state in rows:
        op = ops.setdefault(
            call_node_id,
            {
                "op_id": str(op_id),
                "remote_id": remote_id,
                "state": state,
                "unchanged_polls": unchanged_polls,
                "events": [],
            },
        )
        op["events"].append((kind, at, to_state))
    return ops


def detection_lags(
    ops: dict[str, dict[str, Any]], tasks: dict[str, dict[str, Any]], phase: str
) -> tuple[list[float], list[int]]:
    """Server completion -> terminal_observed, in s; and the number of polls each operation needed."""
    lags: list[float] = []
    polls: list[int] = []
    for call_node_id, op in ops.items():
        if f"-{phase}-" not in call_node_id:
            continue
        task = tasks[op["remote_id"]]
        if task["status"] != "completed":
            raise RuntimeError(f"{call_node_id}: the server's task is {task['status']}")
        completed = dt.datetime.fromisoformat(task["lastUpdatedAt"])
        observed = next(at for kind, at, _ in op["events"] if kind == "terminal_observed")
        lags.append((observed - completed).total_seconds())
        polls.append(1 + op["unchanged_polls"] + sum(kind == "polled" for kind, _, _ in op["events"]))
    return lags, polls


def lag_parts(
    ops: dict[str, dict[str, Any]],
    tasks: dict[str, dict[str, Any]],
    log: list[dict[str, Any]],
    poll_s: float,
    phase: str,
) -> dict[str, list[float]]:
    """Where the detection lag of each operation went, in s:

    * ``to_due``: from the completion to the instant the poll that saw it was due (the step before it wrote
      ``next_poll_at`` = its own time + the poll interval; the jitter on top is not visible here): the
      price of polling at all;
    * ``due_to_get``: from that instant to the server receiving the ``tasks/get`` (dispatch tick, broker
      queue, worker, token bucket);
    * ``get_to_observed``: from that request to the ``terminal_observed`` event.
    """
    gets: dict[str, list[float]] = collections.defaultdict(list)
    for entry in log:
        if entry["method"] == "tasks/get" and entry["task_id"]:
            gets[str(entry["task_id"])].append(float(entry["t"]))
    parts: dict[str, list[float]] = {"to_due": [], "due_to_get": [], "get_to_observed": []}
    for call_node_id, op in ops.items():
        if f"-{phase}-" not in call_node_id:
            continue
        completed = dt.datetime.fromisoformat(tasks[op["remote_id"]]["lastUpdatedAt"]).timestamp()
        observed = next(at for kind, at, _ in op["events"] if kind == "terminal_observed").timestamp()
        seen = [t for t in gets[op["remote_id"]] if completed <= t <= observed]
        if not seen:
            continue
        get = seen[0]
        # The last poll (or the create) before the one that saw it set next_poll_at one interval on; a refused
        # token in between (``no_token``) is part of ``due_to_get``. An unchanged poll writes no event: the
        # server's log has its tasks/get.
        written = [at.timestamp() for k, at, _ in op["events"] if k in ("created", "polled")]
        steps = sorted(t for t in [*written, *gets[op["remote_id"]]] if t < get)
        if not steps:
            continue
        due = steps[-1] + poll_s
        parts["to_due"].append(due - completed)
        parts["due_to_get"].append(get - due)
        parts["get_to_observed"].append(observed - get)
    return parts


def event_kinds(ops: dict[str, dict[str, Any]], phase: str) -> dict[str, float]:
    """Ledger events per operation of one phase, by kind (each guarded write appends one)."""
    kinds: collections.Counter[str] = collections.Counter()
    count = 0
    for call_node_id, op in ops.items():
        if f"-{phase}-" in call_node_id:
            count += 1
            kinds.update(kind for kind, _, _ in op["events"])
    return {k: v / count for k, v in sorted(kinds.items())} if count else {}


def cancel_confirmations(ops: dict[str, dict[str, Any]], requested: dict[str, float]) -> list[float]:
    seconds: list[float] = []
    for op in ops.values():
        if op["op_id"] not in requested:
            continue
        accepted = next(
            at for kind, at, to in op["events"] if kind == "terminal_accepted" and to == "CANCELLED_ACCEPTED"
        )
        seconds.append(accepted.timestamp() - requested[op["op_id"]])
    return seconds


def unchanged_polls(fleet: Fleet, run: str) -> dict[str, Any]:
    """Phase 5: ``--unchanged`` long operations WORKING, polled again and again while nothing changes: over a
    ``--unchanged-s`` window, the worker CPU, ledger transactions, Redis calls, broker messages and ledger
    rows per poll. Polls are counted from the MCP server's request log (``tasks/get`` in the window); every
    operation is cancelled afterwards (and its receipt awaited), so nothing is left polling."""
    args = fleet.args
    prefix = f"{run}-unchanged-"
    for index in range(args.unchanged):
        fleet.submit(f"{prefix}{index}", 3600)

    def working() -> list[str] | None:
        with psycopg.connect(database_url(fleet.db_name), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT id FROM tool_operation WHERE call_node_id LIKE %s AND state = 'WORKING'",
                (f"{prefix}%",),
            ).fetchall()
        return [str(r[0]) for r in rows] if len(rows) == args.unchanged else None

    op_ids = wait_for(
        f"{args.unchanged} long operations to be WORKING", working, timeout=args.wait_s, interval=0.2
    )
    # Every one polled at least once since its create, and the polling steady for as long as a backend's
    # statistics may lag (PG_STATS_FLUSH_S): ``xact_commit`` read at the window's start then misses as much of
    # the polls before it as its reading at the end misses of the window's own. Read sooner, it missed the
    # submissions' transactions just before, which then landed in the window (0.17 per poll counted where
    # the statement log showed 0.09).
    time.sleep(max(2 * args.poll_interval_ms / 1000 + 1, PG_STATS_FLUSH_S))
    received0, beat0, steps0 = fleet.message_counts()
    rows0 = ledger_rows(fleet.db_name, prefix)
    cpu0 = fleet.cpu()
    before = fleet.counters()
    time.sleep(args.unchanged_s)
    cpu1 = fleet.cpu()
    settled = fleet.counters()
    # The messages the workers received in the window, as their logs say (either broker), less the beat's
    # ticks: read at once, where the steps' outcomes below wait for the window's last lines.
    received1, beat_settled, _ = fleet.message_counts()
    rows1 = ledger_rows(fleet.db_name, prefix)
    time.sleep(1.0)  # the workers' log lines of the window's last steps
    _, beat1, steps1 = fleet.message_counts()
    connections = len(backend_pids(fleet.db_name))
    remote = {op["remote_id"] for op in ledger_view(fleet.db_name, prefix.removesuffix("-")).values()}
    log = fleet.server_log()
    polls = sum(
        1
        for e in log
        if e["method"] == "tasks/get" and e["task_id"] in remote and before.t <= e["t"] <= settled.t
    )
    for op_id in op_ids:
        fleet.client.send_task("longcall.cancel", kwargs={"op_id": op_id}, queue="longcall.control")
    fleet.wait_receipts(fleet.sent, timeout=args.wait_s)
    time.sleep(PG_STATS_FLUSH_S)
    after = fleet.counters()
    return {
        "redis_sent": commits_by_caller(fleet.log_dir, before.t, settled.t, ".redis"),
        "commits": commits_by_caller(fleet.log_dir, before.t, settled.t),
        "operations": args.unchanged,
        "window_s": settled.t - before.t,
        "before": before,
        "settled": settled,
        "after": after,
        "polls": polls,
        "event_rows": rows1["events"] - rows0["events"],
        "operation_row_updates": rows1["updates"] - rows0["updates"],
        "steps": dict(sorted((steps1 - steps0).items())),
        "beat_sent": sum((beat1 - beat0).values()),
        "messages_received": sum((received1 - received0).values()) - sum((beat_settled - beat0).values()),
        "cpu_s": {name: cpu1[name] - cpu0[name] for name in cpu0},
        "connections": connections,
    }


def ledger_rows(db_name: str, call_node_prefix: str) -> dict[str, int]:
    """Event rows of the operations under a call node prefix, and ``tool_operation`` row updates so far
    (``n_tup_upd``: every UPDATE of a row, the claim's lease included; statistics lag up to a second)."""
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        events = conn.execute(
            "SELECT count(*) FROM operation_event e JOIN tool_operation o ON o.id = e.op_id"
            " WHERE o.call_node_id LIKE %s",
            (f"{call_node_prefix}%",),
        ).fetchone()
        conn.execute("SELECT pg_stat_force_next_flush()")
        updates = conn.execute(
            "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'tool_operation'"
        ).fetchone()
    return {"events": int(events[0]) if events else 0, "updates": int(updates[0]) if updates else 0}


def noop_rate(fleet: Fleet, count: int, idle_cpu_per_s: float) -> tuple[float, float, float]:
    """``count`` fire-and-forget ``bench.noop`` tasks through the longcall workers: tasks/s from the first
    send to the last completion (the Redis counter every run INCRs), worker CPU seconds per task net of
    what the idle workers spend in as long (``idle_cpu_per_s``), as the unchanged-poll figure is, and the
    Redis commands per task other than the task's own INCR: what one Celery message costs the broker
    (send, receive, the late-ack bookkeeping, the task events), idle calls included."""
    counter = noop_counter(fleet.prefix)
    fleet.redis.delete(counter)
    fleet.own_calls += 1
    calls0 = fleet.counters()
    cpu0 = fleet.cpu()["longcall workers"]
    started = time.perf_counter()
    for _ in range(count):
        fleet.client.send_task("bench.noop", queue=NOOP_QUEUE)

    def done() -> bool:
        fleet.own_calls += 1
        return int(fleet.redis.get(counter) or 0) >= count

    wait_for(f"{count} no-op tasks", done, timeout=fleet.args.wait_s, interval=0.005)
    elapsed = time.perf_counter() - started
    cpu = fleet.cpu()["longcall workers"] - cpu0 - idle_cpu_per_s * elapsed
    calls1 = fleet.counters()
    calls = calls1.redis_calls - calls0.redis_calls - (calls1.own_calls - calls0.own_calls) - count
    return count / elapsed, cpu / count, calls / count


def noop_baseline(fleet: Fleet, idle_cpu_per_s: float) -> dict[str, Any]:
    """The Celery no-op rate and worker CPU per no-op task, with task events on and off (``--noop-reps``
    batches each, the median), in the fleet's own worker processes; events end as the fleet configures."""
    args = fleet.args
    noop_rate(fleet, 50, idle_cpu_per_s)  # warm-up
    out: dict[str, Any] = {"events_configured": fleet.events_configured}
    try:
        for enabled in (fleet.events_configured, not fleet.events_configured):
            set_task_events(fleet, enabled)
            runs = [noop_rate(fleet, args.noop_n, idle_cpu_per_s) for _ in range(args.noop_reps)]
            out["on" if enabled else "off"] = {
                "per_s": statistics.median(r[0] for r in runs),
                "cpu_s_per_task": statistics.median(r[1] for r in runs),
                "redis_calls_per_message": statistics.median(r[2] for r in runs),
            }
    finally:
        set_task_events(fleet, fleet.events_configured)
    return out


# ---------------------------------------------------------------------------------------- baselines


def _commit_loop(url: str, row: int, seconds: float, barrier: Any, counts: Any) -> None:
    """One connection (in its own process): one-row UPDATE transactions on its own row for ``seconds`` from
    when every connection is open (``barrier``); puts how many committed on ``counts``."""
    with psycopg.connect(url) as conn:
        barrier.wait(timeout=60)
        done = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.execute("UPDATE bench_commit SET n = n + 1 WHERE id = %s", (row,))
            conn.commit()
            done += 1
    counts.put(done)


def postgres_commit_rate(db_name: str, seconds: float, connections: int) -> float:
    """Simple one-row UPDATE transactions (each connection its own row, so no lock waits), ``connections``
    concurrent connections from as many processes, as fast as they go: commits/s over all of them."""
    url = database_url(db_name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_commit (id int PRIMARY KEY, n bigint NOT NULL)")
        conn.execute("INSERT INTO bench_commit SELECT g, 0 FROM generate_series(1, %s) g", (connections,))
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(connections + 1)
    counts = context.Queue()
    procs = [
        context.Process(target=_commit_loop, args=(url, i + 1, seconds, barrier, counts))
        for i in range(connections)
    ]
    try:
        for proc in procs:
            proc.start()
        barrier.wait(timeout=60)
        total = sum(counts.get(timeout=seconds + 60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE bench_commit")
    return float(total) / seconds


def xact_per_ledger_call(db_name: str, calls: int = 200) -> float:
    """``xact_commit`` per ``Ledger`` method call (one transaction each), through the ledger's own engine: 2.0
    while its pool pings every checkout (``pool_pre_ping``: an autocommit ``SELECT 1`` is a transaction)."""
    ledger = Ledger.from_url(database_url(db_name))
    ledger.control()  # connects; the backend's first statistics flush is immediate
    time.sleep(0.2)
    before = xact_commit(db_name)
    for _ in range(calls):
        ledger.control()
    ledger.dispose()  # a backend flushes its statistics when it exits
    time.sleep(0.5)
    return (xact_commit(db_name) - before) / calls


# ------------------------------------------------------------------------------------------- the run


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    run = f"lc{uuid.uuid4().hex[:6]}"
    with services(args, log_dir, own_broker=True) as svc:
        with running_fleet(args, log_dir, svc, count_calls=True) as fleet:
            print(f"fleet up: {args.workers} longcall workers x {args.concurrency}, beat, pipeline")
            warmup = args.n if args.warmup is None else args.warmup
            for index in range(warmup):
                fleet.submit(f"{run}-warmup-{index}", args.seconds)
            fleet.wait_receipts(fleet.sent, timeout=args.wait_s)
            time.sleep(PG_STATS_FLUSH_S)
            idle_cpu0 = fleet.cpu()
            idle_from = fleet.counters()
            time.sleep(args.idle_s)
            idle_to = fleet.counters()
            idle_cpu1 = fleet.cpu()
            print(f"idle window done; Celery no-op ({args.noop_reps} x {args.noop_n}, events on and off) ...")
            idle_s = idle_to.t - idle_from.t
            idle_cpu_per_s = {k: (idle_cpu1[k] - idle_cpu0[k]) / idle_s for k in idle_cpu0}
            noop = noop_baseline(fleet, idle_cpu_per_s["longcall workers"])
            print(f"no-op done; burst of {args.n} ...")
            burst_figures = burst(fleet, run)
            print(f"burst done; {args.paced} paced ...")
            paced(fleet, run)
            print(f"paced done; {args.cancels} cancels ...")
            requested = cancels(fleet, run)
            print(f"cancels done; {args.unchanged} operations polled unchanged for {args.unchanged_s} s ...")
            unchanged = unchanged_polls(fleet, run)
            burst_figures["idle_commits"] = commits_by_caller(log_dir, idle_from.t, idle_to.t)
            burst_figures["idle_redis_sent"] = commits_by_caller(log_dir, idle_from.t, idle_to.t, ".redis")
            burst_figures["redis_split_kind"] = (
                "measured"
                if svc.broker_redis is not None
                else "rabbitmq"
                if args.broker == "rabbitmq"
                else "shared"
            )
            ops = ledger_view(svc.db_name, run)
            tasks = fleet.server_tasks()
            server_log = fleet.server_log()
            if args.keep_logs:
                (log_dir / "operations.json").write_text(
                    json.dumps({"ops": ops, "tasks": tasks, "server_log": server_log}, default=str)
                )
        # The fleet is stopped: the Postgres baseline has the machine to itself.
        connections = max(1, unchanged["connections"])
        print(f"fleet stopped; Postgres baseline ({connections} connections) ...")
        pg_rate = postgres_commit_rate(svc.db_name, args.baseline_s, connections)
        per_call = xact_per_ledger_call(svc.db_name)
    burst_lags, burst_polls = detection_lags(ops, tasks, "burst")
    paced_lags, paced_polls = detection_lags(ops, tasks, "paced")
    return figures(
        args,
        idle_from,
        idle_to,
        burst_figures,
        lags={"burst": burst_lags, "paced": paced_lags},
        polls={"burst": burst_polls, "paced": paced_polls},
        events_per_op=event_kinds(ops, "burst"),
        paced_lag_parts=lag_parts(ops, tasks, server_log, args.poll_interval_ms / 1000, "paced"),
        confirmations=cancel_confirmations(ops, requested),
        pg_rate=pg_rate,
        pg_connections=connections,
        xact_per_call=per_call,
        noop=noop,
        unchanged=unchanged,
        idle_cpu_per_s=idle_cpu_per_s,
    )


#: The commands that run a Lua script: one top-level call each, whatever the script runs inside.
SCRIPT_CALLS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def redis_split(
    c0: Counters, c1: Counters, sent: collections.Counter[str], recorder: bool
) -> dict[str, float]:
    """Redis commands between two readings, per instance: the broker's (its own private Redis), longcall's
    (``redis_url``: buckets, meters, CAS, the result backend, the bench's receipt sink), the script calls on
    longcall's (``EVALSHA``/``EVAL``), and longcall's top-level calls: the commands the longcall workers sent
    it (``sent``, counted as they send them, ``bench/_apps.py``) plus, with ``recorder``, the pipeline
    worker's receipt ``RPUSH``; ``INFO commandstats`` counts the commands run inside scripts as well, so the
    difference between longcall's commands and its top-level calls is what the scripts run inside. This
    process's own commands (``INFO``, the sink's ``LLEN``) are taken out of each instance's count."""
    broker = (c1.broker_calls - c0.broker_calls) - (c1.own_broker_calls - c0.own_broker_calls)
    total = (c1.redis_calls - c0.redis_calls) - (c1.own_calls - c0.own_calls)

    def longcall_count(names: tuple[str, ...]) -> int:
        return sum(
            (c1.by_command.get(k, 0) - c1.broker_by_command.get(k, 0))
            - (c0.by_command.get(k, 0) - c0.broker_by_command.get(k, 0))
            for k in names
        )

    recorded = longcall_count(("rpush",)) if recorder else 0
    return {
        "all": total,
        "broker": broker,
        "longcall": total - broker,
        "longcall_scripts": longcall_count(SCRIPT_CALLS),
        "longcall_top_level": sum(sent.values()) + recorded,
        "longcall_sent_by_workers": sum(sent.values()),
        "longcall_recorder_rpush": recorded,
    }


def per_unit(
    window: dict[str, float], idle: dict[str, float], idle_s: float, window_s: float, units: float
) -> dict[str, float]:
    """``window``'s counts per unit (an operation, a poll), net of what the idle fleet counts in as long."""
    return {k: (v - idle.get(k, 0.0) / idle_s * window_s) / units for k, v in window.items()}


def figures(
    args: argparse.Namespace,
    idle_from: Counters,
    idle_to: Counters,
    burst_figures: dict[str, Any],
    *,
    lags: dict[str, list[float]],
    polls: dict[str, list[int]],
    events_per_op: dict[str, float],
    paced_lag_parts: dict[str, list[float]],
    confirmations: list[float],
    pg_rate: float,
    pg_connections: int,
    xact_per_call: float,
    noop: dict[str, Any],
    unchanged: dict[str, Any],
    idle_cpu_per_s: dict[str, float],
) -> dict[str, Any]:
    n = args.n
    idle_s = idle_to.t - idle_from.t
    idle_xact = (idle_to.xact - idle_from.xact) / idle_s
    idle_redis = (
        (idle_to.redis_calls - idle_from.redis_calls) - (idle_to.own_calls - idle_from.own_calls)
    ) / idle_s
    before, settled, after = burst_figures["before"], burst_figures["settled"], burst_figures["after"]
    # Ledger transactions: up to ``after``, when every backend has flushed its statistics.
    xact_raw = (after.xact - before.xact) / n
    xact_net = (after.xact - before.xact - idle_xact * (after.t - before.t)) / n
    # Redis: up to ``settled``, the instant the messages were counted.
    redis_raw = (settled.redis_calls - before.redis_calls - (settled.own_calls - before.own_calls)) / n
    redis_net = redis_raw - idle_redis * (settled.t - before.t) / n
    # The same, per Redis instance when the broker has its own, net of idle each.
    split_kind = burst_figures["redis_split_kind"]
    idle_split = redis_split(idle_from, idle_to, burst_figures["idle_redis_sent"], recorder=True)
    burst_split = redis_split(before, settled, burst_figures["redis_sent"], recorder=True)
    redis_split_op = per_unit(burst_split, idle_split, idle_s, settled.t - before.t, n)
    by_task = burst_figures["messages_by_task"]
    messages = sum(by_task.values()) / n
    # The ledger commits the workers made in the burst (client-side, up to ``settled``), by caller, and what
    # the idle fleet's callers commit in as long.
    commits_window_s = settled.t - before.t
    idle_commits = burst_figures["idle_commits"]
    commit_callers = {
        caller: {
            "raw": burst_figures["commits_by_caller"].get(caller, 0) / n,
            "idle": idle_commits.get(caller, 0) / idle_s * commits_window_s / n,
        }
        for caller in sorted(set(burst_figures["commits_by_caller"]) | set(idle_commits))
    }
    commits_raw = sum(c["raw"] for c in commit_callers.values())
    commits_net = commits_raw - sum(c["idle"] for c in commit_callers.values())
    # The operations' own: every commit but the periodic tasks' (whose count in the window is the beat's
    # clock: subtracted as counted, not at the idle rate, which is right only on average).
    commits_own = sum(
        c["raw"] for caller, c in commit_callers.items() if caller.split(" ", 1)[0] not in PERIODIC_TASKS
    )
    ops_per_s = n / (burst_figures["finished"] - burst_figures["started"])
    configured = "on" if noop["events_configured"] else "off"
    noop_per_s = noop[configured]["per_s"]
    noop_cpu_s = noop[configured]["cpu_s_per_task"]
    ceiling = noop_per_s / messages
    poll_s = args.poll_interval_ms / 1000
    lag_bound = 1.1 * poll_s + 0.3
    paced_lags = lags["paced"]
    one_poll = sum(p == 1 for p in polls["burst"])
    # The unchanged-poll window: per poll done in it, net of what the idle fleet costs in as long.
    u = unchanged
    u_polls = max(1, u["polls"])
    u_s = u["window_s"]
    u0, u1 = u["before"], u["settled"]
    u_cpu_ms = {k: 1000 * (v - idle_cpu_per_s.get(k, 0.0) * u_s) / u_polls for k, v in u["cpu_s"].items()}
    u_cpu_raw_ms = {k: 1000 * v / u_polls for k, v in u["cpu_s"].items()}
    u_redis_calls = u1.redis_calls - u0.redis_calls - (u1.own_calls - u0.own_calls)
    u_split = redis_split(u0, u1, u["redis_sent"], recorder=True)
    redis_split_poll = per_unit(u_split, idle_split, idle_s, u_s, u_polls)
    redis_cpu_s = u["cpu_s"].get("redis")
    result = {
        "operations": n,
        "tool_seconds": args.seconds,
        "poll_interval_s": poll_s,
        "receipts": burst_figures["receipts"],
        "completed": burst_figures["completed"],
        "burst_ops_needing_one_poll": one_poll,
        "ops_per_s": ops_per_s,
        # The target's figure: the workers' commits, each seen as it is made, net of what each caller
        # commits idle in as long (see the module docstring).
        "ledger_tx_per_op": commits_own,
        "ledger_tx_per_op_net_of_idle": commits_net,
        "ledger_tx_per_op_raw": commits_raw,
        # The server's count over the same burst, read 11 s later, net of the idle fleet's rate as the
        # statistics showed it.
        "ledger_xact_commit_per_op": xact_net,
        "ledger_xact_commit_per_op_raw": xact_raw,
        "ledger_xact_commit_vs_commits_seen": {
            "xact_commit": after.xact - before.xact,
            "workers_commits": burst_figures["commits_to_after"],
            "sessions": after.sessions - before.sessions,
        },
        "xact_commit_per_ledger_call": xact_per_call,
        "ledger_calls_per_op": xact_net / xact_per_call,
        "ledger_calls_per_op_seen": commits_own,
        "ledger_commits_by_caller_per_op": commit_callers,
        "redis_calls_per_op": redis_net,
        "redis_calls_per_op_raw": redis_raw,
        # "measured": broker and longcall each on a private Redis of its own; "shared": one Redis for both
        # (--redis-url), only the estimate below tells them apart; "rabbitmq": Redis is longcall's alone.
        "redis_split_kind": split_kind,
        "broker_name": args.broker,
        "redis_split_per_op": redis_split_op,
        "redis_longcall_sent_per_op_raw": {k: v / n for k, v in burst_figures["redis_sent"].most_common()},
        # What the broker's own handling of the op's messages accounts for, at a no-op message's cost.
        "redis_calls_per_message": noop[configured]["redis_calls_per_message"],
        "redis_calls_per_op_transport": messages * noop[configured]["redis_calls_per_message"],
        "redis_commands_per_op_raw": {
            name: (count - before.by_command.get(name, 0)) / n
            for name, count in sorted(
                settled.by_command.items(), key=lambda kv: before.by_command.get(kv[0], 0) - kv[1]
            )
            if count > before.by_command.get(name, 0)
        },
        "messages_per_op": messages,
        "messages_by_task_per_op": {k: v / n for k, v in by_task.items()},
        "lpush_per_op": (settled.lpush - before.lpush - burst_figures["beat_sent"]) / n,
        "step_outcomes_per_op": {k: v / n for k, v in burst_figures["steps"].items()},
        "ledger_events_per_op": events_per_op,
        "mcp_requests_per_op": {k: v / n for k, v in burst_figures["server_requests"].items()},
        "cpu_ms_per_op": {k: 1000 * v / n for k, v in burst_figures["cpu_s"].items()},
        "idle": {
            "ledger_tx_per_s": idle_xact,
            "redis_calls_per_s": idle_redis,
            "cpu_ms_per_s": {k: 1000 * v for k, v in idle_cpu_per_s.items()},
        },
        "detection_lag_s": {
            phase: {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}
            for phase, values in lags.items()
        },
        "detection_lag_parts_paced_s": {
            part: {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}
            for part, values in paced_lag_parts.items()
        },
        "polls_per_op_paced_mean": statistics.mean(polls["paced"]) if polls["paced"] else None,
        "cancel_confirmation_s": {
            "p50": percentile(confirmations, 50),
            "p99": percentile(confirmations, 99),
            "n": len(confirmations),
        },
        "unchanged": {
            "operations": u["operations"],
            "window_s": u_s,
            "polls": u["polls"],
            "polls_per_s": u["polls"] / u_s,
            "steps": u["steps"],
            "cpu_ms_per_poll": u_cpu_ms,
            "cpu_ms_per_poll_raw": u_cpu_raw_ms,
            "ledger_tx_per_poll": (u1.xact - u0.xact - idle_xact * u_s) / u_polls,
            # Connections made to the run's database in the window (each one's start is a transaction).
            "sessions": u1.sessions - u0.sessions,
            "xact_commit": u1.xact - u0.xact,
            # The workers' commits seen as made, net of each caller's idle rate (see the burst's figure).
            "ledger_commits_per_poll": (
                sum(u["commits"].values()) - sum(idle_commits.values()) / idle_s * u_s
            )
            / u_polls,
            "redis_calls_per_poll": (u_redis_calls - idle_redis * u_s) / u_polls,
            "redis_split_per_poll": redis_split_poll,
            "redis_longcall_sent_per_poll_raw": {k: v / u_polls for k, v in u["redis_sent"].most_common()},
            "redis_commands_per_poll_raw": {
                name: (count - u0.by_command.get(name, 0)) / u_polls
                for name, count in sorted(
                    u1.by_command.items(), key=lambda kv: u0.by_command.get(kv[0], 0) - kv[1]
                )
                if count > u0.by_command.get(name, 0)
            },
            # Counted as the workers received them, either broker; LPUSH (the Redis broker's publishes) as a
            # check beside it: on RabbitMQ it counts nothing, and stood as this figure until 2026-12-07.
            "broker_messages_per_poll": u["messages_received"] / u_polls,
            "lpush_per_poll": (u1.lpush - u0.lpush - u["beat_sent"]) / u_polls,
            "event_rows": u["event_rows"],
            "operation_row_updates_per_poll": u["operation_row_updates"] / u_polls,
            "redis_cpu_us_per_call": (
                1e6 * redis_cpu_s / u_redis_calls if redis_cpu_s is not None and u_redis_calls else None
            ),
        },
        "baseline": {
            "postgres_commits_per_s": pg_rate,
            "postgres_connections": pg_connections,
            "celery_noop_events_configured": configured,
            "celery_noop_per_s": {k: noop[k]["per_s"] for k in ("on", "off")},
            "celery_noop_worker_cpu_ms": {k: 1000 * noop[k]["cpu_s_per_task"] for k in ("on", "off")},
        },
        "ratios": {
            "ops_per_s_vs_message_ceiling": ops_per_s / ceiling,
            "ledger_commits_per_s_vs_raw": ops_per_s * commits_own / pg_rate,
            "ops_per_s_vs_noop_per_s": ops_per_s / noop_per_s,
        },
        "noop_per_s": noop_per_s,
        "noop_cpu_ms": 1000 * noop_cpu_s,
        "detection_lag_bound_s": lag_bound,
        "message_ceiling_ops_per_s": ceiling,
        "paced_lag_p99_s": percentile(paced_lags, 99),
    }
    worker_ms = u_cpu_ms["longcall workers"]
    # name -> (measured, op, target, unit)
    result["targets"] = {
        "end_to_end_ops_per_s": (ops_per_s, ">=", 0.5 * ceiling, " ops/s"),
        # Issue 21: an unchanged poll at most 1.0 ms of worker CPU and half a no-op task's; 5,000 in flight
        # per worker core at a 5 s interval; nearly nothing written, sent or asked of Redis.
        "unchanged_poll_worker_cpu": (worker_ms, "<=", 1.0, " ms"),
        "unchanged_poll_worker_cpu_vs_noop": (worker_ms / result["noop_cpu_ms"], "<=", 0.5, "x"),
        "in_flight_per_worker_core_at_5s": (5.0 / (worker_ms / 1000), ">=", 5000.0, ""),
        "unchanged_poll_ledger_commits": (result["unchanged"]["ledger_tx_per_poll"], "<=", 0.1, ""),
        "unchanged_poll_redis_calls": (result["unchanged"]["redis_calls_per_poll"], "<=", 3.0, ""),
        "unchanged_poll_messages": (result["unchanged"]["broker_messages_per_poll"], "<=", 0.1, ""),
        "redis_calls_per_op": (redis_net, "<=", 20.0, ""),
        "ledger_tx_per_one_poll_op": (commits_own, "<=", 7.0, ""),
        "ledger_rows_per_unchanged_poll": (float(u["event_rows"]), "==", 0.0, ""),
        "celery_messages_per_op": (messages, "<=", 6.0, ""),
        "cancel_confirmation_p99": (result["cancel_confirmation_s"]["p99"], "<", 2.0, " s"),
        "detection_lag_p99": (result["paced_lag_p99_s"], "<=", lag_bound, " s"),
    }
    return result


def print_redis_split(kind: str, split: dict[str, float], unit: str, sent: dict[str, float]) -> None:
    """The Redis commands per ``unit`` by instance (see :func:`redis_split`), net of idle, and the commands
    the workers sent longcall's Redis by name (raw)."""
    if kind == "shared":
        print("    (one Redis for the broker and longcall, --redis-url: not split by instance)")
        return
    broker = (
        f"the broker's Redis {split['broker']:.1f}"
        if kind == "measured"
        else "the broker is RabbitMQ (not counted here)"
    )
    print(
        f"    by instance, per {unit}: {broker}; longcall's Redis {split['longcall']:.1f} commands (Lua-inner"
        f" included), {split['longcall_scripts']:.1f} of them script calls (EVALSHA/EVAL); round trips"
        f" (top-level calls) on longcall's Redis {split['longcall_top_level']:.1f} = the workers'"
        f" {split['longcall_sent_by_workers']:.1f} (counted as sent) + the pipeline's receipt RPUSH"
        f" {split['longcall_recorder_rpush']:.1f}"
    )
    print(
        "      the workers' top-level calls on longcall's Redis (raw): "
        + ", ".join(f"{k} {v:.2f}" for k, v in sent.items())
    )


def print_machine_bound(f: dict[str, Any]) -> None:
    """What the machine's cores allow at the burst's CPU an operation, every part of the run on them, and
    what the end-to-end target leaves longcall's workers for their own work."""
    # What the machine's cores allow at that CPU, every part of the run on them: the end-to-end target's
    # ceiling counts the no-op's messages only, on the same cores.
    total = sum(f["cpu_ms_per_op"].values())
    others = total - f["cpu_ms_per_op"].get("longcall workers", 0.0)
    cores = os.cpu_count() or 1
    wanted = 0.5 * f["message_ceiling_ops_per_s"]
    print(
        f"  the machine's CPU bound: {cores} cores / {total:.1f} ms of CPU an operation (every part) ="
        f" {cores * 1000 / total:.0f} ops/s; the end-to-end target ({wanted:.0f}/s) leaves"
        f" {cores * 1000 / wanted:.1f} ms an operation for every part, of which the parts other than"
        f" longcall's workers take {others:.1f}"
    )
    # What that leaves the workers' own work: what the target allows an operation, less every other part as
    # measured and the Celery cost of the operation's messages at the no-op's CPU (the part the target's
    # ceiling counts). At or below 0, no code of longcall's reaches the target on this machine.
    messages_cpu = f["messages_per_op"] * f["noop_cpu_ms"]
    own = f["cpu_ms_per_op"].get("longcall workers", 0.0) - messages_cpu
    left = cores * 1000 / wanted - others - messages_cpu
    print(
        f"    left within the target for the workers' own work (create, status reads, result, ledger and"
        f" Redis calls, delivery), beyond their messages' Celery cost ({f['messages_per_op']:.2f} x"
        f" {f['noop_cpu_ms']:.2f} ms = {messages_cpu:.1f}): {left:.1f} ms an operation; measured {own:.1f}"
    )


def report(f: dict[str, Any]) -> bool:
    """Print the figures, the target lines and the scaling inputs; True when every target holds."""
    b = f["baseline"]
    lag = f["detection_lag_s"]
    cancel = f["cancel_confirmation_s"]
    configured = b["celery_noop_events_configured"]
    print(
        f"\nbaselines (same run, same worker processes, CPU net of idle): Celery no-op fire and forget"
        f" {b['celery_noop_per_s']['on']:.0f} tasks/s with task events on,"
        f" {b['celery_noop_per_s']['off']:.0f}/s off (the fleet runs with them {configured});"
        f" worker CPU per no-op {b['celery_noop_worker_cpu_ms']['on']:.2f} ms on,"
        f" {b['celery_noop_worker_cpu_ms']['off']:.2f} ms off"
    )
    print(
        f"  Postgres {b['postgres_commits_per_s']:.0f} commits/s ({b['postgres_connections']} concurrent"
        " connections, as many as the fleet held; one-row UPDATE each)"
    )
    print(
        f"\nburst: {f['operations']} slow_report({f['tool_seconds']} s) operations, poll interval"
        f" {f['poll_interval_s']} s; {f['receipts']} receipts ({f['completed']} completed),"
        f" {f['burst_ops_needing_one_poll']} needed exactly one poll"
    )
    print(
        f"  end to end: {f['ops_per_s']:.1f} operations/s = {f['ratios']['ops_per_s_vs_message_ceiling']:.2f}"
        f" of the message ceiling (no-op/s {f['noop_per_s']:.0f} / messages/op {f['messages_per_op']:.2f}"
        f" = {f['message_ceiling_ops_per_s']:.1f} ops/s); {f['ratios']['ops_per_s_vs_noop_per_s']:.3f} of the"
        " no-op rate (0.078 before issue 21: 68.6 operations/s at 876 no-ops/s, 06a6cfa, Dec 1)"
    )
    callers = f["ledger_commits_by_caller_per_op"]
    claimed = f["step_outcomes_per_op"].get("longcall.dispatch_due:claimed", 0.0)
    print(
        f"  ledger transactions/op (the workers' commits, each seen as made): {f['ledger_tx_per_op']:.3f},"
        " the operations' own (every task's but the beat's periodic ones);"
        f" {f['ledger_tx_per_op_net_of_idle']:.3f} with the periodic ones net of their idle rate;"
        f" {f['ledger_tx_per_op_raw']:.3f} raw. By caller"
        " (task, step, Ledger method: raw/op, the idle fleet's share/op):"
    )
    for caller, c in sorted(callers.items(), key=lambda kv: -kv[1]["raw"]):
        periodic = " [periodic]" if caller.split(" ", 1)[0] in PERIODIC_TASKS else ""
        print(f"      {caller}: {c['raw']:.3f} ({c['idle']:.3f}){periodic}")
    print(
        f"    {claimed:.3f}/op of the dispatcher's ticks claimed burst rows (a tick is one transaction"
        " whether it claims or not); charged to the operations, the figure would be"
        f" {f['ledger_tx_per_op'] + claimed:.3f}"
    )
    check = f["ledger_xact_commit_vs_commits_seen"]
    print(
        f"    xact_commit (the server's count, read {PG_STATS_FLUSH_S:.0f} s later):"
        f" {f['ledger_xact_commit_per_op']:.2f} net of idle ({f['ledger_xact_commit_per_op_raw']:.2f} raw;"
        f" idle fleet {f['idle']['ledger_tx_per_s']:.1f}/s)"
        f" = {f['ledger_calls_per_op']:.2f} Ledger transactions x {f['xact_commit_per_ledger_call']:.2f}"
        f" xact_commit each; over the same span it counted {check['xact_commit']}, the workers committed"
        f" {check['workers_commits']}, and {check['sessions']} connections were opened (each one's start is a"
        " transaction); the rest: statistics not yet flushed at either end, autovacuum"
    )
    print(
        f"  Redis calls/op: {f['redis_calls_per_op']:.1f} net of idle ({f['redis_calls_per_op_raw']:.1f} raw;"
        f" idle fleet {f['idle']['redis_calls_per_s']:.1f}/s; broker, results, events, buckets)"
    )
    print_redis_split(
        f["redis_split_kind"], f["redis_split_per_op"], "op", f["redis_longcall_sent_per_op_raw"]
    )
    if f["redis_split_kind"] == "shared":
        transport = f["redis_calls_per_op_transport"]
        print(
            f"    of which the Celery transport's own, ESTIMATED at a no-op message's cost: {transport:.1f}"
            f" (= {f['messages_per_op']:.2f} messages x {f['redis_calls_per_message']:.1f} Redis calls per"
            f" no-op message, same run); the rest, longcall's own (buckets, CAS, results, drains):"
            f" {f['redis_calls_per_op'] - transport:.1f}"
        )
    commands = ", ".join(f"{k} {v:.1f}" for k, v in list(f["redis_commands_per_op_raw"].items())[:10])
    print(f"    by command (raw, the ten largest): {commands}")
    by_task = ", ".join(f"{k} {v:.2f}" for k, v in f["messages_by_task_per_op"].items() if v)
    print(
        f"  Celery messages/op: {f['messages_per_op']:.2f} ({by_task}; LPUSH count {f['lpush_per_op']:.2f})"
    )
    steps = ", ".join(f"{k.removeprefix('longcall.')} {v:.2f}" for k, v in f["step_outcomes_per_op"].items())
    print(f"  step outcomes/op: {steps}")
    events = ", ".join(f"{k} {v:.2f}" for k, v in f["ledger_events_per_op"].items())
    print(f"  ledger events/op: {events}")
    requests = ", ".join(f"{k} {v:.2f}" for k, v in f["mcp_requests_per_op"].items())
    print(f"  MCP requests/op: {requests}")
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in f["cpu_ms_per_op"].items())
    print(f"  CPU ms/op during the burst: {cpu}")
    print_machine_bound(f)
    for phase in ("paced", "burst"):
        d = lag[phase]
        line = f"  detection lag ({phase}, n={d['n']}): p50 {d['p50']:.3f} s, p99 {d['p99']:.3f} s"
        if phase == "paced":
            parts = f["detection_lag_parts_paced_s"]
            line += "\n    of which " + ", ".join(
                f"{name} p50 {v['p50']:.3f} / p99 {v['p99']:.3f}" for name, v in parts.items()
            )
        else:
            line += "  (under the burst's queueing; not the target)"
        print(line)
    print(f"  cancel confirmation (n={cancel['n']}): p50 {cancel['p50']:.3f} s, p99 {cancel['p99']:.3f} s")
    return report_unchanged(f)


def report_unchanged(f: dict[str, Any]) -> bool:
    """The unchanged-poll figures, every target line and the scaling inputs."""
    b = f["baseline"]
    u = f["unchanged"]
    configured = b["celery_noop_events_configured"]
    worker_ms = u["cpu_ms_per_poll"]["longcall workers"]
    outcomes = ", ".join(f"{k.removeprefix('longcall.')} {v}" for k, v in u["steps"].items())
    print(
        f"\nunchanged polls: {u['operations']} WORKING operations, {u['polls']} tasks/get in"
        f" {u['window_s']:.1f} s ({u['polls_per_s']:.1f} polls/s); step outcomes: {outcomes}"
    )
    cpu = ", ".join(
        f"{k} {v:.2f} ({u['cpu_ms_per_poll_raw'][k]:.2f} raw)" for k, v in u["cpu_ms_per_poll"].items()
    )
    print(f"  CPU ms per unchanged poll, net of idle (dispatch ticks included): {cpu}")
    print(
        f"  per unchanged poll: ledger transactions {u['ledger_tx_per_poll']:.2f} (xact_commit;"
        f" the workers' commits seen as made: {u['ledger_commits_per_poll']:.2f}; the server counted"
        f" {u['xact_commit']} in the window, {u['sessions']} connections opened), Redis calls"
        f" {u['redis_calls_per_poll']:.1f}, broker messages {u['broker_messages_per_poll']:.3f} (received by"
        f" the workers; LPUSH count {u['lpush_per_poll']:.3f}),"
        f" tool_operation row updates {u['operation_row_updates_per_poll']:.2f}, event rows written"
        f" {u['event_rows']} in the window"
    )
    print_redis_split(
        f["redis_split_kind"],
        u["redis_split_per_poll"],
        "unchanged poll",
        u["redis_longcall_sent_per_poll_raw"],
    )
    commands = ", ".join(f"{k} {v:.1f}" for k, v in list(u["redis_commands_per_poll_raw"].items())[:10])
    print(f"    Redis calls by command (raw, the ten largest): {commands}")
    print(
        "  operations in flight one worker core sustains at a 5 s poll interval:"
        f" {5.0 / (worker_ms / 1000):.0f} (= 5 s / {worker_ms:.2f} ms worker CPU per unchanged poll)"
    )
    print()
    ok = True
    # The Redis broker's run is the one the scaling model is built from; another broker's targets are named
    # apart (``make bench`` runs both).
    on_redis = f["broker_name"] == "redis"
    prefix = "lifecycle" if on_redis else f"lifecycle_{f['broker_name']}"
    for name, (measured, op, goal, unit) in f["targets"].items():
        ok &= target(f"{prefix}.{name}", measured, op, goal, unit)
    print()
    if not on_redis:
        return ok
    scaling_input("worker_cpu_ms_per_poll", worker_ms, "ms", "longcall worker CPU per unchanged poll")
    scaling_input("ledger_tx_per_poll", u["ledger_tx_per_poll"], "tx", "xact_commit per unchanged poll")
    scaling_input("redis_calls_per_poll", u["redis_calls_per_poll"], "calls", "Redis commands per poll")
    scaling_input(
        "broker_messages_per_poll", u["broker_messages_per_poll"], "msgs", "messages received per poll"
    )
    scaling_input(
        "postgres_cpu_ms_per_poll", u["cpu_ms_per_poll"]["postgres backends"], "ms", "backend CPU per poll"
    )
    if u["redis_cpu_us_per_call"] is not None:
        scaling_input("redis_cpu_us_per_call", u["redis_cpu_us_per_call"], "us", "redis-server CPU per call")
    scaling_input(
        "postgres_commits_per_s",
        b["postgres_commits_per_s"],
        "tx/s",
        f"{b['postgres_connections']} connections",
    )
    scaling_input("noop_tasks_per_s", f["noop_per_s"], "tasks/s", f"events {configured}, 4 processes")
    scaling_input("noop_worker_cpu_ms", f["noop_cpu_ms"], "ms", "worker CPU per no-op task")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("-n", type=int, default=150, help="operations in the burst")
    parser.add_argument("--seconds", type=float, default=0.2, help="slow_report duration in the burst")
    parser.add_argument("--paced", type=int, default=100, help="operations in the paced phase")
    parser.add_argument("--cancels", type=int, default=30, help="operations cancelled")
    parser.add_argument("--pace", type=float, default=10.0, help="paced submissions and cancels per second")
    parser.add_argument("--poll-interval-ms", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--status-reads",
        choices=("httptools", "aiohttp", "httpx2"),
        default=None,
        help="what sends the polls' status reads (LONGCALL_STATUS_READS; default: the fleet's own)",
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--warmup", type=int, default=None, help="operations sent at once before the idle window (default -n)"
    )
    parser.add_argument("--idle-s", type=float, default=6.0)
    parser.add_argument("--baseline-s", type=float, default=3.0, help="Postgres baseline duration")
    parser.add_argument("--noop-n", type=int, default=1000, help="no-op tasks per baseline batch")
    parser.add_argument("--noop-reps", type=int, default=3, help="batches per events setting (median)")
    parser.add_argument("--unchanged", type=int, default=300, help="operations polled unchanged")
    parser.add_argument("--unchanged-s", type=float, default=10.0, help="the unchanged-poll window")
    parser.add_argument("--quick", action="store_true", help="a short run: smaller phases")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="profile the longcall pool processes on their CPU clock: one <pid>.prof each in this directory",
    )
    parser.add_argument(
        "--qps",
        type=float,
        default=2000,
        help="the server's poll_qps and control_qps (buckets are not measured)",
    )
    parser.add_argument("--wait-s", type=float, default=90, help="bound on every wait")
    parser.add_argument("--max-s", type=int, default=420, help="bound on the whole run")
    parser.add_argument("--redis-url", default=None, help="a shared Redis instead of a private one")
    parser.add_argument(
        "--broker",
        choices=("redis", "rabbitmq"),
        default="redis",
        help="the fleet's broker: the Redis (default) or a RabbitMQ vhost of the run (rabbitmqctl, guest)",
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the processes' logs and operations.json (ledger events)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.paced, args.cancels, args.idle_s = 60, 30, 10, 3.0
        args.noop_n, args.noop_reps, args.unchanged_s, args.baseline_s = 600, 1, 5.0, 2.0
    raise_on_sigterm()
    with log_directory("lc-bench-lifecycle-", keep=args.keep_logs) as log_dir, alarm(args.max_s):
        result = measure(args, log_dir)
    ok = report(result)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
