"""Issue 21: isolation. One slow server must not slow the polls of another: the detection lag of a fast
server's operations, alone and then with a slow server busy beside it, measured the same way in one run.

One fleet, on loopback: two demo MCP servers, ``fast`` (``pollInterval`` ``--fast-interval-ms``) and
``slow`` (``--slow-interval-ms``, and every ``tasks/get`` answered after ``--slow-get-ms``: the
``delay_ms`` fault switch), both in the fleet's configuration (``poll_qps`` = ``control_qps`` =
``--qps`` each); ``--workers`` longcall workers of ``--concurrency`` processes each, beat, the pipeline
worker, a fresh ledger database and a private Redis (``bench/_fleet.py`` ``services``). Phases:

1. ``--fast`` + ``--sample`` long operations on the fast server, WORKING, the slow server idle;
   ``--sample`` of them are completed on the server at instants spread over ``--sample-s``
   (``bench/_lag.py``): each one's lag from the server's completion to the ledger's ``terminal_observed``;
2. ``--sample`` fast operations more (the fast server's load as it was in phase 1), and ``--slow`` long
   operations on the slow server (enough that its polls fill batches and keep the worker processes busy:
   each status read takes ``--slow-get-ms``), WORKING and polled, then another sample of the fast server's
   operations completed the same way.

The two phases poll the fast server alike, and within its budget: its polls due (operations in flight over
its interval) are fewer than its poll bucket hands out (``RATE_HEADROOM`` of ``--qps``); the run stops
before measuring otherwise. Until 2026-12-07 phase 1 had the fast server's polls due above what its bucket
handed out (220/s against 160/s) and phase 2 a sample fewer in flight: its lag alone was the bucket's, and
the ratio below 1 said nothing of the slow server.

Printed: each phase's lag (p50, p99, max), the polls/s each server answered in each phase, and the ratio
of the fast server's lag p99 beside the slow server to its lag p99 alone. Target:
``isolation.fast_lag_ratio <= 1.2``.

Run: ``.venv/bin/python bench/isolation.py [--quick] [--json]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import re
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
from _apps import PIPELINE_QUEUE, make_pipeline
from _fleet import Services, longcall_env, services
from _harness import (
    Child,
    alarm,
    free_port,
    listening,
    log_directory,
    percentile,
    raise_on_sigterm,
    start_child,
    start_longcall_fleet,
    target,
    wait_for,
)
from _lag import Sample, finish_spread, lags, working, working_count
from celery import Celery

from demo_server.command import command as demo_server_command
from workers.hot import RATE_HEADROOM
from workers.settings import Settings

#: The start of a Celery worker's log line: its local time.
LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): ")

#: The fast server's lag p99 beside the slow server, over its lag p99 alone, the target allows.
RATIO = 1.2
#: How often beat sends a dispatch tick (the fleet runs with the default).
DISPATCH_INTERVAL_S = Settings.model_fields["dispatch_interval_s"].default


@dataclass
class Pair:
    """The fleet with its two servers: each one's ``/_control`` URL, the pipeline's client, the database."""

    db_name: str
    client: Celery
    controls: dict[str, str]
    children: dict[str, Child] = field(default_factory=dict)

    def submit(self, call_node_id: str, server: str) -> None:
        """A long ``slow_report`` operation on ``server``, sent as a pipeline sends it."""
        on_terminal = dict(self.client.signature("bench.record", queue=PIPELINE_QUEUE))
        self.client.send_task(
            "longcall.submit",
            kwargs={
                "call_node_id": call_node_id,
                "server": server,
                "tool": "slow_report",
                "arguments": {"seconds": 3600},
                "on_terminal": on_terminal,
            },
            queue="longcall.control",
        )

    def gets(self, server: str, start: float, end: float) -> int:
        """``tasks/get`` requests ``server`` received between ``start`` and ``end`` (its request log)."""
        entries = httpx2.get(f"{self.controls[server]}/log", timeout=30).json()["entries"]
        return sum(1 for e in entries if e["method"] == "tasks/get" and start <= e["t"] <= end)


def dispatch_ticks(children: dict[str, Child], start: float, end: float) -> dict[str, int]:
    """The dispatcher's ticks between ``start`` and ``end`` from the longcall workers' logs: those that ran,
    and those a worker took only after their expiry (they waited that long in the queue) and threw away."""
    counts = {"ran": 0, "expired": 0}
    for name, child in children.items():
        if not name.startswith("longcall"):
            continue
        for line in child.log().splitlines():
            stamp = LOG_TIME.match(line)
            if "longcall.dispatch_due[" not in line or stamp is None:
                continue
            at = dt.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()
            if not start <= at <= end:
                continue
            if " succeeded in " in line:
                counts["ran"] += 1
            elif "Discarding revoked task" in line:
                counts["expired"] += 1
    return counts


def fleet_config(urls: dict[str, str], qps: float) -> str:
    return "".join(
        f'[servers.{name}]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\nurl = "{url}"\n'
        f"poll_qps = {qps}\ncontrol_qps = {qps}\n\n"
        for name, url in urls.items()
    )


@contextlib.contextmanager
def two_servers(args: argparse.Namespace, log_dir: Path, svc: Services) -> Iterator[Pair]:
    """The two demo servers (the slow one's ``tasks/get`` delayed from the start), the longcall workers,
    beat and the pipeline worker; every process stopped (by its process group) on the way out."""
    children: dict[str, Child] = {}
    client: Celery | None = None
    try:
        urls, controls = {}, {}
        for name, interval in (("fast", args.fast_interval_ms), ("slow", args.slow_interval_ms)):
            port = free_port()
            controls[name] = f"http://127.0.0.1:{port}/_control"
            urls[name] = f"http://127.0.0.1:{port}/mcp"
            children[name] = start_child(
                demo_server_command(port, poll_interval_ms=interval),
                env={},
                log_dir=log_dir,
                name=name,
                ready=listening(controls[name]),
            )
        slow = {"delay_ms": {"tasks/get": args.slow_get_ms}}
        httpx2.post(f"{controls['slow']}/faults", json=slow, timeout=10).raise_for_status()
        config = log_dir / "longcall.toml"
        config.write_text(fleet_config(urls, args.qps))
        sink = f"{svc.prefix}sink"
        start_longcall_fleet(
            children,
            log_dir=log_dir,
            longcall_env=longcall_env(svc, config),
            workers=args.workers,
            concurrency=args.concurrency,
            redis_url=svc.redis_url,
            prefix=svc.prefix,
            sink=sink,
            broker_url=svc.broker_url,
        )
        client = make_pipeline(svc.broker_url, svc.prefix, sink, svc.redis_url)
        yield Pair(svc.db_name, client, controls, children)
    finally:
        if client is not None:
            client.close()
        for child in reversed(list(children.values())):
            child.stop()


def all_working(pair: Pair, prefix: str, server: str, count: int, timeout: float) -> None:
    wait_for(
        f"{count} operations of {server} WORKING",
        lambda: working_count(pair.db_name, prefix, server) >= count,
        timeout=timeout,
        interval=0.5,
    )


def fast_lags(args: argparse.Namespace, pair: Pair, prefix: str) -> dict[str, Any]:
    """Complete ``--sample`` fast operations over ``--sample-s``; their lags, and each server's polls/s."""
    members = working(pair.db_name, prefix, "fast", args.sample)
    sample = Sample(pair.controls["fast"])
    started = time.time()
    finish_spread(sample, members, started, started + args.sample_s)
    ended = time.time()
    time.sleep(1.0)  # the workers' log lines of the window's last ticks
    ticks = dispatch_ticks(pair.children, started, ended)
    sample_lags = lags(pair.db_name, sample, wait_s=args.fast_interval_ms / 1000 + args.lag_wait_s)
    window = ended - started
    return {
        "lags": sample_lags.all,
        "unobserved": len(sample_lags.unobserved),
        "refused": len(sample.refused),
        "fast_polls_per_s": pair.gets("fast", started, ended) / window,
        "slow_polls_per_s": pair.gets("slow", started, ended) / window,
        "window_s": window,
        "ticks": ticks,
    }


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    prefix = f"iso{uuid.uuid4().hex[:6]}-"
    fast_interval_s = args.fast_interval_ms / 1000
    with services(args, log_dir) as svc, two_servers(args, log_dir, svc) as pair:
        print(f"fleet up: {args.workers} longcall workers x {args.concurrency}, beat, pipeline", flush=True)
        fast_total = args.fast + args.sample
        for index in range(fast_total):
            pair.submit(f"{prefix}fast-{index}", "fast")
        all_working(pair, prefix, "fast", fast_total, args.wait_s)
        time.sleep(2 * fast_interval_s + 1)  # every one polled on its cadence since its create
        print(f"{fast_total} fast operations WORKING; the fast server alone ...", flush=True)
        alone = fast_lags(args, pair, prefix)
        print(f"alone done; {args.sample} fast and {args.slow} slow operations more ...", flush=True)
        for index in range(fast_total, fast_total + args.sample):
            pair.submit(f"{prefix}fast-{index}", "fast")
        all_working(pair, prefix, "fast", fast_total, args.wait_s)
        for index in range(args.slow):
            pair.submit(f"{prefix}slow-{index}", "slow")
        all_working(pair, prefix, "slow", args.slow, args.wait_s)
        time.sleep(2 * args.slow_get_ms / 1000 + 1)  # the slow server's polls under way
        print("the fast server beside the busy slow one ...", flush=True)
        beside = fast_lags(args, pair, prefix)
        load = Path("/proc/loadavg").read_text().split()[:3]
    return {
        "fast": args.fast,
        "slow": args.slow,
        "sample": args.sample,
        "fast_interval_s": fast_interval_s,
        "slow_interval_s": args.slow_interval_ms / 1000,
        "slow_get_s": args.slow_get_ms / 1000,
        "processes": args.workers * args.concurrency,
        "alone": alone,
        "beside": beside,
        "load_average": load,
    }


def p99(phase: dict[str, Any]) -> float:
    """The lags' 99th percentile (a completion not observed within the wait at its lower bound)."""
    return percentile(phase["lags"], 99)


def report(r: dict[str, Any]) -> bool:
    print(
        f"\nisolation: {r['fast']} operations on a fast server (poll interval {r['fast_interval_s']:g} s)"
        f" beside {r['slow']} on a slow one (poll interval {r['slow_interval_s']:g} s, every tasks/get"
        f" answered after {r['slow_get_s']:g} s); {r['processes']} worker processes;"
        f" load average at the end {' '.join(r['load_average'])}"
    )
    for name in ("alone", "beside"):
        phase = r[name]
        values = phase["lags"]
        print(
            f"  fast server {name:6}: detection lag p50 {percentile(values, 50):.2f} s,"
            f" p99 {p99(phase):.2f} s, max {values[-1] if values else float('nan'):.2f} s over"
            f" {len(values)} completions ({phase['unobserved']} not observed within the wait: at their lower"
            " bound);"
            f" polls/s fast {phase['fast_polls_per_s']:.1f}, slow {phase['slow_polls_per_s']:.1f};"
            f" dispatch ticks {phase['ticks']['ran']} run, {phase['ticks']['expired']} expired in the queue"
            f" ({phase['window_s'] / DISPATCH_INTERVAL_S:.0f} sent)"
        )
    ratio = p99(r["beside"]) / p99(r["alone"])
    print()
    return target("isolation.fast_lag_ratio", ratio, "<=", RATIO, "x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--fast", type=int, default=200, help="operations in flight on the fast server")
    parser.add_argument("--slow", type=int, default=256, help="operations in flight on the slow server")
    parser.add_argument("--sample", type=int, default=120, help="fast operations completed per phase")
    parser.add_argument("--sample-s", type=float, default=24.0, help="the completions spread over this")
    parser.add_argument("--fast-interval-ms", type=int, default=2_000)
    parser.add_argument("--slow-interval-ms", type=int, default=1_000)
    parser.add_argument("--slow-get-ms", type=int, default=5_000, help="the slow server's tasks/get delay")
    parser.add_argument("--qps", type=float, default=400.0, help="each server's poll_qps and control_qps")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--lag-wait-s", type=float, default=60.0, help="bound on a completion's detection")
    parser.add_argument("--wait-s", type=float, default=120.0, help="bound on every other wait")
    parser.add_argument("--max-s", type=int, default=540, help="bound on the whole run")
    parser.add_argument("--redis-url", default=None, help="a shared Redis instead of a private one")
    parser.add_argument("--quick", action="store_true", help="smaller phases")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.fast, args.slow, args.sample, args.sample_s = 100, 160, 50, 10.0
        args.max_s = 360
    due = (args.fast + args.sample) / (args.fast_interval_ms / 1000)
    handed_out = RATE_HEADROOM * args.qps
    if due > handed_out:
        parser.error(
            f"the fast server's polls due ({due:g}/s) exceed what its bucket hands out ({handed_out:g}/s of"
            " --qps): its lag alone would be the bucket's; raise --qps or lower --fast / --sample"
        )
    print(f"the fast server: {due:g} polls/s due in each phase, its bucket hands out {handed_out:g}/s")
    raise_on_sigterm()
    with log_directory("lc-bench-isolation-", keep=args.keep_logs) as log_dir, alarm(args.max_s):
        result = measure(args, log_dir)
    ok = report(result)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
