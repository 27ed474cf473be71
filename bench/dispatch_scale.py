"""Issues 4 and 13: the cost of one ``dispatch_due`` tick with 1,000 and 100,000 operations in flight, and
with the due rows on one server and spread over ``--servers`` servers.

The same number of rows (``--due``) is due in both cases; everything else in flight is WORKING with a remote
id and ``next_poll_at`` an hour away. One tick is exactly what ``longcall.dispatch_due`` does in
``workers/tasks.py``: ``Executor.dispatch_due`` (the executor-control read plus ``Ledger.claim_due``) and
``publish_dispatches`` (the same function the task calls, with the fleet's ``poll_batch``): the claimed polls
of one server in ``longcall.poll`` messages of up to ``poll_batch`` members (issue 21), through longcall's
own Celery app (its real config: routes, JSON, sent events) to a real Redis broker, under a unique key
prefix removed afterwards. So the one-server cases send ``ceil(due / poll_batch)`` messages a tick, and the
spread case (one due row on each of ``--servers`` servers) one message per row: the most a tick can send.

Each size has its own fresh, migrated database; the repetitions of the two sizes are interleaved, so load
from anything else on the machine falls on both alike. Between repetitions (outside the timing) the due rows
are made due again, the published messages are deleted and the table is vacuumed, so every tick starts from
the same state. Targets: the 100k tick costs at most 1.5 x the 1k tick (medians); with 1,000 in flight,
the claim of the ``--due`` rows spread over ``--servers`` configured servers (one due row each by default)
costs at most 1.5 x the claim of the same rows on one server (the claim must not be one query per
configured server; the tick's publish differs by design: a message per server). The dispatch rates one
dispatcher sustains (due rows / median tick) are printed as scaling inputs: rows of one server (batches
filled), and one row per server (a message each, the floor).

Run: ``.venv/bin/python bench/dispatch_scale.py [--json]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
from _harness import (
    SHARED_REDIS_URL,
    database_url,
    delete_prefixed,
    fresh_database,
    percentile,
    raise_on_sigterm,
    scaling_input,
    target,
)
from celery import Celery
from sqlalchemy import event

from ledger.repository import Ledger
from workers.app import create_app
from workers.executor import Executor
from workers.runtime import Runtime
from workers.settings import Settings
from workers.steps.dispatch import messages
from workers.tasks import publish_dispatches

TARGET_RATIO = 1.5

LOAD_SQL = """
INSERT INTO tool_operation (
    id, call_node_id, request_digest, tool_name, body, server, protocol, protocol_version, adapter_version,
    remote_id, submission_key, submit_attempted_at, state, server_state, poll_cursor, next_poll_at,
    poll_interval_ms, execution_epoch, event_seq
)
SELECT
    gen_random_uuid(),
    CASE WHEN g <= %(due)s THEN 'bench-due-' ELSE 'bench-' END || g,
    'bench-digest',
    'slow_report',
    jsonb_build_object('seconds', 600),
    CASE WHEN %(servers)s = 1 THEN 'reports' ELSE 'reports-' || (g %% %(servers)s) END,
    'mcp',
    '2025-11-25',
    'bench',
    'task-' || g,
    gen_random_uuid(),
    now() - interval '1 minute',
    'WORKING',
    'working',
    1,
    CASE
        WHEN g <= %(due)s THEN now() - interval '1 second'
        -- Not due: spread over the hour after the next one, never due while the benchmark runs.
        ELSE now() + interval '1 hour' + (random() * interval '1 hour')
    END,
    500,
    (SELECT execution_epoch FROM executor_control WHERE id = 1),
    1
FROM generate_series(1, %(total)s) AS g
"""

RESET_SQL = """
UPDATE tool_operation SET next_poll_at = now() - interval '1 second', lease_until = NULL
WHERE call_node_id LIKE 'bench-due-%'
"""


def server_names(servers: int) -> list[str]:
    """The names ``LOAD_SQL`` gives the rows' servers."""
    return ["reports"] if servers == 1 else [f"reports-{i}" for i in range(servers)]


def fleet_config(due: int, servers: int = 1) -> str:
    """``servers`` servers, each with budgets large enough that one tick may claim all ``due`` rows
    (``dispatch_due`` claims at most twice what a server's budgets take per tick): the tick, not the bucket,
    is measured."""
    qps = max(1000, due * 4 * 2)
    return "".join(
        f"[servers.{name}]\n"
        'protocol = "mcp"\n'
        'protocol_version = "2025-11-25"\n'
        f'url = "http://127.0.0.1:9/mcp/{name}"\n'
        f"poll_qps = {qps}\ncontrol_qps = {qps}\n\n"
        for name in server_names(servers)
    )


@dataclass
class Size:
    """One in-flight population: its database, its executor and the claim SQL it emitted."""

    in_flight: int
    servers: int
    db_name: str
    ledger: Ledger
    executor: Executor
    claim_sql: list[tuple[str, Any]] = field(default_factory=list)
    ticks_s: list[float] = field(default_factory=list)
    claims_s: list[float] = field(default_factory=list)
    #: The messages one tick sent (the same every tick).
    messages: int = 0

    def summary(self) -> dict[str, float]:
        return {
            "median_ms": statistics.median(self.ticks_s) * 1000,
            "p90_ms": percentile(self.ticks_s, 90) * 1000,
            "min_ms": min(self.ticks_s) * 1000,
            "max_ms": max(self.ticks_s) * 1000,
            "claim_median_ms": statistics.median(self.claims_s) * 1000,
            "claim_p90_ms": percentile(self.claims_s, 90) * 1000,
            "messages": float(self.messages),
        }

    @property
    def label(self) -> str:
        return f"{self.in_flight:,} in flight" + (f", {self.servers} servers" if self.servers > 1 else "")


def load(db_name: str, total: int, due: int, servers: int) -> None:
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        conn.execute(LOAD_SQL, {"due": due, "total": total, "servers": servers})
        conn.execute("VACUUM (ANALYZE) tool_operation")


def reset(db_name: str, due: int) -> None:
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        made_due = conn.execute(RESET_SQL).rowcount
        if made_due != due:
            raise RuntimeError(f"{db_name}: {made_due} rows made due, expected {due}")
        conn.execute("VACUUM tool_operation")


def tick(size: Size, app: Celery, due: int) -> tuple[float, float, int]:
    """One ``longcall.dispatch_due`` tick, as ``workers/tasks.py`` runs it: (whole tick, claim part) in s, and
    the messages it sent."""
    poll_batch = size.executor.rt.settings.poll_batch
    started = time.perf_counter()
    dispatches = size.executor.dispatch_due(limit=due)
    claimed = time.perf_counter()
    sent = publish_dispatches(app, dispatches, poll_batch=poll_batch)
    finished = time.perf_counter()
    if sent != due or any(d.task != "longcall.poll" for d in dispatches):
        raise RuntimeError(f"{size.label}: the tick dispatched {sent}, not {due} polls")
    return finished - started, claimed - started, len(messages(dispatches, poll_batch))


def claim_index(plan: list[str]) -> str | None:
    """The index the claim's due scan runs on (``ix_tool_operation_due`` or its per-server sibling
    ``ix_tool_operation_server_due``, both partial on ``next_poll_at IS NOT NULL``), or None (a seq scan)."""
    for line in plan:
        match = re.search(r"Index (?:Only )?Scan using (\S+) on tool_operation tool_operation_1", line)
        if match is None:
            match = re.search(r"Index (?:Only )?Scan using (ix_\S*due\S*)", line)
        if match is not None:
            return match.group(1)
    return None


def explain_claim(size: Size) -> list[str]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of the exact claim statement the ledger sent, rolled back."""
    statement, parameters = next((s, p) for s, p in reversed(size.claim_sql) if "SKIP LOCKED" in s)
    with size.ledger.engine.connect() as conn:
        rows = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters).all()
        conn.rollback()
    return [str(r[0]) for r in rows]


@contextlib.contextmanager
def population(
    in_flight: int, *, servers: int, due: int, redis_url: str, prefix: str, config: Path
) -> Iterator[Size]:
    with fresh_database() as db_name:
        load(db_name, in_flight, due, servers)
        runtime = Runtime.from_settings(
            Settings(
                database_url=database_url(db_name),
                redis_url=redis_url,
                broker_keyprefix=prefix,
                config=config,
            )
        )
        size = Size(in_flight, servers, db_name, runtime.ledger, Executor(runtime))

        @event.listens_for(size.ledger.engine, "before_cursor_execute")
        def capture(*args: Any) -> None:
            statement, parameters = args[2], args[3]
            if "SKIP LOCKED" in statement:
                size.claim_sql[:] = [(statement, parameters)]

        try:
            yield size
        finally:
            runtime.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"lcbench-{uuid.uuid4().hex[:10]}:"
    client = redis.Redis.from_url(args.redis_url)
    sizes_wanted: list[int] = sorted(args.sizes)
    # (in flight, servers): every size on one server, then the smallest spread over --servers servers.
    cases = [(n, 1) for n in sizes_wanted] + [(sizes_wanted[0], args.servers)]
    try:
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lc-bench-")))
            for servers in {1, args.servers}:
                (tmp / f"fleet-{servers}.toml").write_text(fleet_config(args.due, servers))
            print(
                f"loading {', '.join(f'{n:,}' for n in sizes_wanted)} operations in flight, {args.due} due;"
                f" and {sizes_wanted[0]:,} over {args.servers} servers"
            )
            sizes = [
                stack.enter_context(
                    population(
                        n,
                        servers=servers,
                        due=args.due,
                        redis_url=args.redis_url,
                        prefix=prefix,
                        config=tmp / f"fleet-{servers}.toml",
                    )
                )
                for n, servers in cases
            ]
            app = create_app(sizes[0].executor.rt.settings)
            poll_queue = f"{prefix}longcall.poll"
            for repetition in range(args.warmup + args.reps):
                for size in sizes:
                    reset(size.db_name, args.due)
                    client.delete(poll_queue)
                    elapsed, claim, sent = tick(size, app, args.due)
                    if client.llen(poll_queue) != sent:
                        queued = client.llen(poll_queue)
                        raise RuntimeError(f"{queued} poll messages on the broker, not {sent}")
                    size.messages = sent
                    if repetition >= args.warmup:
                        size.ticks_s.append(elapsed)
                        size.claims_s.append(claim)
            largest = sizes[len(sizes_wanted) - 1]
            reset(largest.db_name, args.due)
            plan = explain_claim(largest)
            app.close()
            small, spread = sizes[0], sizes[-1]
            ratio = statistics.median(largest.ticks_s) / statistics.median(small.ticks_s)
            spread_ratio = statistics.median(spread.ticks_s) / statistics.median(small.ticks_s)
            spread_claim_ratio = statistics.median(spread.claims_s) / statistics.median(small.claims_s)
            return {
                "due_per_tick": args.due,
                "repetitions": args.reps,
                "servers": args.servers,
                "sizes": {s.label: s.summary() for s in sizes},
                "largest": largest.in_flight,
                "ratio_median": ratio,
                "ratio_p90": percentile(largest.ticks_s, 90) / percentile(small.ticks_s, 90),
                "claim_ratio_median": statistics.median(largest.claims_s) / statistics.median(small.claims_s),
                "spread_ratio_median": spread_ratio,
                "spread_claim_ratio_median": spread_claim_ratio,
                "dispatches_per_s_one_dispatcher": args.due / statistics.median(largest.ticks_s),
                "dispatches_per_s_one_row_per_server": args.due / statistics.median(spread.ticks_s),
                "target_ratio": TARGET_RATIO,
                "pass": ratio <= TARGET_RATIO and spread_claim_ratio <= TARGET_RATIO,
                "claim_plan": plan,
                "claim_index": claim_index(plan),
            }
    finally:
        delete_prefixed(client, prefix)
        client.close()


def report(figures: dict[str, Any]) -> bool:
    print(
        f"\ndispatch_due tick (claim + publish of {figures['due_per_tick']} due rows),"
        f" {figures['repetitions']} repetitions per case"
    )
    for label, s in figures["sizes"].items():
        print(
            f"  {label:>30}: median {s['median_ms']:7.1f} ms   p90 {s['p90_ms']:7.1f} ms"
            f"   (min {s['min_ms']:.1f}, max {s['max_ms']:.1f};"
            f" claim alone: median {s['claim_median_ms']:.1f} ms, p90 {s['claim_p90_ms']:.1f} ms;"
            f" {s['messages']:.0f} messages)"
        )
    print(
        f"  ratio largest/smallest: median {figures['ratio_median']:.2f}x, p90 {figures['ratio_p90']:.2f}x"
        f" (claim alone: median {figures['claim_ratio_median']:.2f}x)"
    )
    print(
        f"  ratio {figures['servers']} servers/1 server: median {figures['spread_ratio_median']:.2f}x"
        f" (claim alone: median {figures['spread_claim_ratio_median']:.2f}x)"
    )
    largest = figures["largest"]
    print(f"\nEXPLAIN (ANALYZE, BUFFERS) of the claim statement at {largest:,} in flight:")
    keep = ("Scan", "Limit", "LockRows", "Update on", "Buffers", "Execution Time", "Planning Time")
    for line in figures["claim_plan"]:
        if any(word in line for word in keep):
            print("  " + line.rstrip())
    index = figures["claim_index"]
    print(f"  due scan runs on: {index or 'no index (sequential scan)'}\n")
    goal = figures["target_ratio"]
    sizes = f"{largest}_vs_{min(int(k.split()[0].replace(',', '')) for k in figures['sizes'])}"
    ok = target(f"dispatch.tick_{sizes}_in_flight", figures["ratio_median"], "<=", goal, "x")
    ok &= target(
        f"dispatch.claim_{figures['servers']}_servers_vs_1_server",
        figures["spread_claim_ratio_median"],
        "<=",
        goal,
        "x",
    )
    ok &= target("dispatch.claim_on_an_index", float(index is not None), "==", 1.0)
    print()
    scaling_input(
        "dispatch_rows_per_s_one_dispatcher",
        figures["dispatches_per_s_one_dispatcher"],
        "polls/s",
        f"{figures['due_per_tick']} due rows of one server / median tick at {largest:,} in flight,"
        " back to back",
    )
    scaling_input(
        "dispatch_rows_per_s_one_row_per_server",
        figures["dispatches_per_s_one_row_per_server"],
        "polls/s",
        f"{figures['due_per_tick']} due rows on as many servers (a message each) / median tick, back to back",
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--due", type=int, default=200, help="rows due in every tick")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000], help="operations in flight")
    parser.add_argument("--servers", type=int, default=200, help="servers the spread case's rows are on")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a short run: fewer repetitions")
    parser.add_argument(
        "--redis-url", default=SHARED_REDIS_URL, help="the broker (keys under a unique prefix)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.warmup = 8, 2
    if len(args.sizes) < 2 or min(args.sizes) < args.due or args.servers < 2:
        parser.error("give at least two sizes, each at least --due, and at least 2 --servers")
    raise_on_sigterm()
    figures = run(args)
    ok = report(figures)
    if args.json:
        print(json.dumps(figures, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
