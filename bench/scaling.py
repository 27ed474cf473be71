"""Issue 13: polls/s with 1, 2 and 4 longcall worker processes on this machine, the QPS caps holding.

For each process count a fleet of its own (``bench/_fleet.py``'s: the MCP demo server, one longcall
worker with that concurrency, beat, the pipeline worker; a fresh ledger database and a private Redis), with
``--ops`` long operations WORKING on one server whose ``poll_qps`` and ``control_qps`` are ``--qps``, its
poll interval ``--poll-interval-ms``: more polls are due than the processes can do, so polls/s measures
what they sustain. Over a ``--window-s`` window: polls/s (``tasks/get`` in the server's request log) and
the worker CPU per poll. Over the whole run: the highest number of requests the server received in any one
second per budget (its HTTP log, by the ``Longcall-Budget`` header each request names), against the budget.

One more run (``--cap-qps``) puts the most processes under a budget far below what they can poll, so the cap
is tested where it binds. Targets: in every run, the highest requests/s of each budget <= that budget;
polls/s with as many processes as the machine has cores (at most 4) >= 1.5 x polls/s with one, unless it is
at the cap already (>= 0.95 x the RATE_HEADROOM x ``poll_qps`` the buckets hand out), or every part of that
run together (the workers, the MCP server, Postgres, Redis, beat) kept the machine's cores MACHINE_FULL
busy: then >= 1 x (a process more costs no polls); when one process alone is at the cap, the growth cannot
show, and the target is that the most processes poll at the cap. Each run prints the CPU a poll by part.

Run: ``.venv/bin/python bench/scaling.py [--quick] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx2
import psycopg
from _fleet import Fleet, running_fleet, services
from _harness import alarm, database_url, log_directory, raise_on_sigterm, target, wait_for

from workers.hot import RATE_HEADROOM


def peak_per_second(times: list[float]) -> int:
    """The most entries in any one-second window (sliding, not aligned to whole seconds)."""
    ordered = sorted(times)
    best = start = 0
    for end, t in enumerate(ordered):
        while t - ordered[start] >= 1.0:
            start += 1
        best = max(best, end - start + 1)
    return best


def working_count(db_name: str, prefix: str) -> int:
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM tool_operation WHERE call_node_id LIKE %s AND state = 'WORKING'",
            (f"{prefix}%",),
        ).fetchone()
    return int(row[0]) if row else 0


#: The share of the machine's cores every part of a run together keeps busy from which the processes'
#: polls/s are bound by the machine, not by themselves (``report``).
MACHINE_FULL = 0.9

#: Operations in the ``--cap-qps`` run: at 500 ms, 600 polls/s due, 60 x a 10/s budget. Their creates go
#: through that budget too (1,000 at 8 a second outlasted the bound on the wait for them).
CAP_OPS = 300


def one_size(
    args: argparse.Namespace, processes: int, qps: float, log_dir: Path, *, ops: int | None = None
) -> dict[str, Any]:
    ops = args.ops if ops is None else ops
    fleet_args = argparse.Namespace(
        workers=1,
        concurrency=processes,
        poll_interval_ms=args.poll_interval_ms,
        qps=qps,
        wait_s=args.wait_s,
        redis_url=None,
        profile=None if args.profile is None else args.profile / f"p{processes}-qps{qps:g}",
    )
    if fleet_args.profile is not None:
        fleet_args.profile.mkdir(parents=True, exist_ok=True)
    run_dir = log_dir / f"p{processes}-qps{qps:g}"
    run_dir.mkdir()
    prefix = f"sc{uuid.uuid4().hex[:6]}-"
    with services(fleet_args, run_dir) as svc, running_fleet(fleet_args, run_dir, svc) as fleet:
        for index in range(ops):
            fleet.submit(f"{prefix}{index}", 3600)
        wait_for(
            f"{ops} operations WORKING",
            lambda: working_count(svc.db_name, prefix) == ops,
            timeout=args.wait_s,
            interval=0.2,
        )
        time.sleep(2 * args.poll_interval_ms / 1000 + 1)
        cpu0 = fleet.cpu()
        started = time.time()
        time.sleep(args.window_s)
        finished = time.time()
        cpu1 = fleet.cpu()
        cpu = {part: cpu1[part] - cpu0.get(part, 0.0) for part in cpu1}
        return {"qps": qps, "ops": ops, **measured(fleet, processes, started, finished, cpu)}


def measured(
    fleet: Fleet, processes: int, started: float, finished: float, cpu: dict[str, float]
) -> dict[str, Any]:
    polls = sum(1 for e in fleet.server_log() if e["method"] == "tasks/get" and started <= e["t"] <= finished)
    http = httpx2.get(f"{fleet.control}/http_log", timeout=10).json()["entries"]
    by_budget: dict[str, list[float]] = {}
    for entry in http:
        by_budget.setdefault(str(entry["budget"]), []).append(float(entry["t"]))
    window_s = finished - started
    return {
        "processes": processes,
        "window_s": window_s,
        "polls": polls,
        "polls_per_s": polls / window_s,
        "worker_cpu_ms_per_poll": 1000 * cpu["longcall workers"] / polls if polls else None,
        # Every part on this machine's cores (the workers, the MCP server, Postgres, Redis, beat, the
        # pipeline worker, this process): what share of the cores the window used.
        "cpu_ms_per_poll_by_part": {part: 1000 * s / polls for part, s in cpu.items()} if polls else {},
        "machine_busy": sum(cpu.values()) / (window_s * (os.cpu_count() or 1)),
        "peak_requests_per_s": {budget: peak_per_second(times) for budget, times in by_budget.items()},
    }


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> bool:
    cores = os.cpu_count() or 1
    print(
        f"\nscaling: {args.ops} operations WORKING, poll interval {args.poll_interval_ms} ms"
        f" ({1000 * args.ops / args.poll_interval_ms:.0f} polls/s due),"
        f" poll_qps = control_qps = {args.qps:g}; {cores} cores"
    )
    for r in runs:
        cpu = r["worker_cpu_ms_per_poll"]
        cpu_text = "-" if cpu is None else f"{cpu:.2f}"
        peaks = ", ".join(f"{budget} {count}" for budget, count in sorted(r["peak_requests_per_s"].items()))
        parts = ", ".join(f"{part} {ms:.2f}" for part, ms in r["cpu_ms_per_poll_by_part"].items())
        print(
            f"  {r['processes']} worker process(es), {r['ops']} operations, budgets {r['qps']:g}/s:"
            f" {r['polls_per_s']:.1f} polls/s ({r['polls']} in {r['window_s']:.1f} s),"
            f" worker CPU {cpu_text} ms/poll;"
            f" highest requests in any 1 s by budget: {peaks}\n"
            f"    the machine's cores {100 * r['machine_busy']:.0f} % busy; CPU ms a poll by part: {parts}"
        )
    print()
    ok = True
    for r in runs:
        for budget in ("poll", "control"):
            peak = r["peak_requests_per_s"].get(budget, 0)
            name = f"scaling.{r['processes']}_processes_qps_{r['qps']:g}.peak_{budget}_requests_per_s"
            ok &= target(name, peak, "<=", r["qps"])
    one = next((r for r in runs if r["processes"] == 1 and r["qps"] == args.qps), None)
    wide = [r for r in runs if r["processes"] <= min(cores, 4) and r["qps"] == args.qps]
    if one is not None and len(wide) > 1:
        top = max(wide, key=lambda r: r["processes"])
        cap = 0.95 * RATE_HEADROOM * args.qps  # what the buckets hand out
        at_cap = top["polls_per_s"] >= cap
        growth = top["polls_per_s"] / one["polls_per_s"] if one["polls_per_s"] else 0.0
        if one["polls_per_s"] >= cap:
            # One process alone polls at the cap: the processes' growth cannot show; what can is that more
            # processes keep the cap's rate.
            print(
                f"  (one process polls at the cap already: {one['polls_per_s']:.1f}/s; raise --ops and --qps)"
            )
            ok &= target(
                f"scaling.polls_per_s_{top['processes']}_processes_vs_cap",
                top["polls_per_s"] / cap,
                ">=",
                1.0,
                "x",
            )
            return ok
        if at_cap:
            print(
                f"  ({top['processes']} processes poll at the cap:"
                f" {top['polls_per_s']:.1f}/s >= 0.95 x {RATE_HEADROOM:g} x {args.qps:g})"
            )
        # The processes share this machine's cores with the MCP server, Postgres and Redis: once every part
        # together keeps the cores busy, one more process has nothing to run on, and what can show is that
        # it costs no polls.
        machine_full = top["machine_busy"] >= MACHINE_FULL
        if machine_full and not at_cap:
            print(
                f"  ({top['processes']} processes and every other part keep the cores"
                f" {100 * top['machine_busy']:.0f} % busy (>= {100 * MACHINE_FULL:.0f} %):"
                " the machine's bound, not the processes')"
            )
        ok &= target(
            f"scaling.polls_per_s_{top['processes']}_vs_1_processes",
            growth,
            ">=",
            1.0 if at_cap or machine_full else 1.5,
            "x",
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    # 2,000 polls/s due under a 2,000/s budget (1,600/s handed out): more than one process does, so its
    # polls/s is its own, not the budget's (569 and 1,298/s in two runs on 2026-12-06, shedding what it could
    # not run; two processes on two cores reached the cap). At 500 ops and 1,000/s, one process polled at the
    # cap already once polls cost 0.8 ms.
    parser.add_argument("--ops", type=int, default=1000, help="operations WORKING in each run")
    parser.add_argument("--poll-interval-ms", type=int, default=500)
    parser.add_argument("--qps", type=float, default=2000.0, help="the server's poll_qps and control_qps")
    parser.add_argument(
        "--cap-qps",
        type=float,
        default=10.0,
        help="one more run, the most processes under this budget, far below what they poll (0: none)",
    )
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--wait-s", type=float, default=90, help="bound on every wait")
    parser.add_argument("--max-s", type=int, default=540, help="bound on the whole run")
    parser.add_argument("--quick", action="store_true", help="a short run: a 5 s window")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--profile",
        type=Path,
        help="profile the worker's pool processes: one <pid>.prof each under DIR/p<processes>-qps<qps>",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.window_s = 5.0
    raise_on_sigterm()
    with log_directory("lc-bench-scaling-", keep=args.keep_logs) as log_dir, alarm(args.max_s):
        runs = [one_size(args, processes, args.qps, log_dir) for processes in args.processes]
        if args.cap_qps:
            runs.append(
                one_size(args, max(args.processes), args.cap_qps, log_dir, ops=min(args.ops, CAP_OPS))
            )
    passed = report(args, runs)
    if args.json:
        print(json.dumps(runs, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
