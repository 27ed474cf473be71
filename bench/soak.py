"""Issue 21: a soak. A fleet holds ``--ops`` operations in flight (10,000 by default) for ``--window-s``
(at least 3 minutes) after every one of them is WORKING, polled at the server's ``pollInterval``.

One run, on loopback: the fleet of ``bench/_fleet.py`` (longcall's MCP demo server started with
``--poll-interval-ms``, ``--workers`` longcall workers of ``--concurrency`` processes each, beat, the
pipeline worker; a fresh ledger database, a private Redis for the broker and longcall's state). The
operations are long ``slow_report`` calls sent through ``longcall.submit`` as a pipeline sends them (one
message each, the server's ``poll_qps`` and ``control_qps`` both ``--qps``), ``--sample`` more than
``--ops`` so that ``--ops`` stay in flight while the sample is completed. With 10,000 at 25 s, 400 polls/s
are due: what two cores can hold with the server, Postgres and Redis on them too.

Over the window:

* in flight: the operations the ledger has WORKING, read every few seconds (the lowest reading);
* polls/s: ``tasks/get`` requests in the server's own request log (cleared at the window's start; a log
  that filled up, ``demo_server.faults.LOG_LIMIT`` entries, is said so: the figures are then over what it
  kept), beside the polls/s due (in flight / interval): a fleet that cannot keep up polls fewer;
* worker CPU per poll: ``/proc`` user + system time of the longcall worker processes (their pool children
  included; the dispatcher's ticks run there too) over the window, less what the idle fleet spent in as
  long (measured before the first submission), divided by the polls (the sample's completions, a result
  fetch and a receipt each, are in it too); every other part's CPU per poll is printed beside it;
* detection lag: ``--sample`` operations WORKING are completed on the server at instants spread over the
  window (``bench/_lag.py``), each lag from the server's completion to the ledger's ``terminal_observed``;
* the QPS caps: the most requests of each budget (the ``Longcall-Budget`` header) the workers sent in any
  one-second window (sliding), against ``--qps`` (the moment each request is handed to httpx2's transport,
  ``bench/_apps.py`` ``record_sends``), and beside it the most the server's log stamped in one: the demo
  server stamps a request when it handles it, and sharing two cores with the fleet it falls behind and
  handles a backlog at once (a tcpdump of the loopback found the wire within 1 % of the workers' figure);
* the fleet's RSS (the longcall worker processes with their children, and beat), read every few seconds:
  the mean of the window's last third against the mean of its first third.

Targets: ``soak.in_flight >= --ops``, ``soak.lag_p99 <= interval + 1 s``, ``soak.qps_cap`` (the highest
requests/s sent of each budget over its cap: <= 1), ``soak.rss_flat`` (growth <= 10 %).

Run: ``.venv/bin/python bench/soak.py [--quick] [--json]`` (``--quick``: 1,000 in flight at 5 s for 40 s)
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx2
from _fleet import Fleet, running_fleet, send_dir, services
from _harness import alarm, log_directory, percentile, raise_on_sigterm, target, wait_for
from _lag import Sample, finish_spread, lags, working, working_count
from scaling import peak_per_second

from demo_server.faults import LOG_LIMIT

#: The server's name in the fleet's configuration (``bench/_fleet.py``).
SERVER = "reports"
#: Growth of the fleet's RSS from the window's first third to its last the target allows.
RSS_GROWTH = 0.10
#: How often the in-flight count and the RSS are read in the window.
READ_EVERY_S = 5.0
#: A batch's actions in a worker's log (``workers/tasks.py``, logged once its members are done), or a
#: one-operation ``longcall.poll``'s answer.
BATCH_ACTIONS = re.compile(r"a batch of \d+ polls is done: \{([^}]*)\}")
ACTION_COUNT = re.compile(r"'(\w+)': (\d+)")
SINGLE_ACTION = re.compile(r"'action': '(\w+)'")


def rss_bytes(groups: Iterable[int]) -> int:
    """Resident memory of every process in the process groups ``groups`` (Linux ``/proc``)."""
    wanted = set(groups)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) in wanted:
                total += int((entry / "statm").read_text().split()[1]) * page
        except OSError:
            continue  # gone meanwhile
    return total


def fleet_groups(fleet: Fleet) -> list[int]:
    """The longcall workers' and beat's process groups (each started in a session of its own)."""
    return [c.proc.pid for n, c in fleet.children.items() if n.startswith("longcall") or n == "beat"]


class Readings:
    """What is read every few seconds in the window: the operations WORKING and the fleet's RSS."""

    def __init__(self, fleet: Fleet, prefix: str) -> None:
        self.fleet, self.prefix = fleet, prefix
        self.working: list[tuple[float, int]] = []
        self.rss: list[tuple[float, int]] = []
        self.server_rss: list[int] = []
        self._next = 0.0

    def maybe(self) -> None:
        now = time.time()
        if now < self._next:
            return
        self._next = now + READ_EVERY_S
        self.working.append((now, working_count(self.fleet.db_name, self.prefix)))
        self.rss.append((now, rss_bytes(fleet_groups(self.fleet))))
        self.server_rss.append(rss_bytes([self.fleet.children["mcp"].proc.pid]))


def poll_actions(fleet: Fleet) -> collections.Counter[str]:
    """What the poll steps did so far (``still_working``, ``no_token``, ...), summed over the batches'
    answers in the longcall workers' logs (a one-operation poll's answer counted as a batch of one)."""
    actions: collections.Counter[str] = collections.Counter()
    for name, child in fleet.children.items():
        if not name.startswith("longcall"):
            continue
        for line in child.log().splitlines():
            if batch := BATCH_ACTIONS.search(line):
                for action, count in ACTION_COUNT.findall(batch.group(1)):
                    actions[action] += int(count)
            elif "Task longcall.poll[" in line and (single := SINGLE_ACTION.search(line)):
                actions[single.group(1)] += 1
    return actions


def ramp(fleet: Fleet, prefix: str, total: int, timeout: float) -> float:
    """Submit ``total`` long operations and wait until every one is WORKING; returns the seconds it took."""
    started = time.time()
    for index in range(total):
        fleet.submit(f"{prefix}{index}", 3600)
    print(f"  {total:,} submissions sent in {time.time() - started:.1f} s", flush=True)
    printed = time.time()

    def all_working() -> bool:
        nonlocal printed
        count = working_count(fleet.db_name, prefix)
        if time.time() - printed >= 15:
            print(f"  {count:,} WORKING after {time.time() - started:.0f} s", flush=True)
            printed = time.time()
        return count >= total

    wait_for(f"{total} operations WORKING", all_working, timeout=timeout, interval=1.0)
    return time.time() - started


def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    prefix = f"soak{uuid.uuid4().hex[:6]}-"
    interval_s = args.poll_interval_ms / 1000
    with (
        services(args, log_dir) as svc,
        running_fleet(args, log_dir, svc, record_sends=True) as fleet,
    ):
        print(f"fleet up: {args.workers} longcall workers x {args.concurrency}, beat, pipeline", flush=True)
        time.sleep(2.0)  # beat's first ticks
        idle0, idle_t0 = fleet.cpu()["longcall workers"], time.time()
        time.sleep(args.idle_s)
        idle_cpu_per_s = (fleet.cpu()["longcall workers"] - idle0) / (time.time() - idle_t0)
        total = args.ops + args.sample
        print(f"idle fleet: {idle_cpu_per_s * 1000:.1f} ms worker CPU/s; ramp to {total:,} ...", flush=True)
        ramp_cpu0 = fleet.cpu()
        ramp_s = ramp(fleet, prefix, total, args.ramp_s)
        ramp_cpu = {k: v - ramp_cpu0[k] for k, v in fleet.cpu().items()}
        print(f"all {total:,} WORKING after {ramp_s:.0f} s; window of {args.window_s:.0f} s ...", flush=True)
        members = working(fleet.db_name, prefix, SERVER, args.sample)
        sample = Sample(fleet.control)
        readings = Readings(fleet, prefix)
        httpx2.delete(f"{fleet.control}/log", timeout=10).raise_for_status()
        actions0 = poll_actions(fleet)
        cpu0, started = fleet.cpu(), time.time()
        finished_at = started + args.window_s
        # Each completion is observed within one interval (plus the fleet's own delay) of it: the last
        # ones leave that much of the window.
        finish_spread(
            sample,
            members,
            started + 1.0,
            max(started + 1.0, finished_at - interval_s - 2.0),
            each_tick=readings.maybe,
        )
        while time.time() < finished_at:
            readings.maybe()
            time.sleep(min(0.5, max(0.0, finished_at - time.time())))
        cpu = {k: v - cpu0[k] for k, v in fleet.cpu().items()}
        ended = time.time()
        readings.maybe()
        time.sleep(1.0)  # the workers' log lines of the window's last steps
        actions = poll_actions(fleet) - actions0
        sample_lags = lags(fleet.db_name, sample, wait_s=interval_s + 30)
        log = fleet.server_log()
        load = Path("/proc/loadavg").read_text().split()[:3]
    workers = cpu["longcall workers"]
    polls = [float(e["t"]) for e in log if e["method"] == "tasks/get" and started <= e["t"] <= ended]
    by_budget: dict[str, list[float]] = {}
    for entry in log:
        if started <= entry["t"] <= ended:
            by_budget.setdefault(str(entry["budget"]), []).append(float(entry["t"]))
    sent = sent_by_budget(send_dir(log_dir), started, ended)
    return {
        "ops": args.ops,
        "sample": len(members),
        "interval_s": interval_s,
        "qps": args.qps,
        "ramp_s": ramp_s,
        "ramp_cpu_s": ramp_cpu,
        "window_s": ended - started,
        "in_flight_min": min(count for _, count in readings.working),
        "in_flight_readings": [count for _, count in readings.working],
        "polls": len(polls),
        "polls_per_s": len(polls) / (ended - started),
        "polls_by_second": per_second(polls, started, ended),
        "log_entries": len(log),
        "log_full": len(log) >= LOG_LIMIT,
        "poll_actions": dict(actions.most_common()),
        "cpu_s": cpu,
        "idle_worker_cpu_per_s": idle_cpu_per_s,
        "worker_cpu_ms_per_poll": 1000 * (workers - idle_cpu_per_s * (ended - started)) / max(1, len(polls)),
        "worker_cpu_ms_per_poll_raw": 1000 * workers / max(1, len(polls)),
        "lags": sample_lags.observed,
        "unobserved": sample_lags.unobserved,
        "refused": len(sample.refused),
        "peak_per_s": {budget: peak_per_second(times) for budget, times in by_budget.items()},
        "sent_peak_per_s": {budget: peak_per_second(times) for budget, times in sent.items()},
        "rss": [size for _, size in readings.rss],
        "server_rss": readings.server_rss,
        "load_average": load,
    }


def sent_by_budget(directory: Path, start: float, end: float) -> dict[str, list[float]]:
    """When the workers sent each request of the window, by budget (``bench/_apps.py`` ``record_sends``)."""
    sent: dict[str, list[float]] = {}
    for path in directory.glob("*.sent"):
        for line in path.read_text().splitlines():
            moment, budget = line.split()
            if start <= float(moment) <= end:
                sent.setdefault(budget, []).append(float(moment))
    return sent


def per_second(times: list[float], start: float, end: float) -> list[int]:
    """How many of ``times`` fell in each whole second from ``start`` (the last, partial second left out)."""
    counts = [0] * int(end - start)
    for t in times:
        index = int(t - start)
        if 0 <= index < len(counts):
            counts[index] += 1
    return counts


def thirds(values: list[int]) -> tuple[float, float]:
    """The means of the first and the last third of the readings (at least one reading each)."""
    third = max(1, len(values) // 3)
    return statistics.mean(values[:third]), statistics.mean(values[-third:])


def report(r: dict[str, Any]) -> bool:
    interval_s = r["interval_s"]
    lags_s = sorted(r["lags"] + r["unobserved"])
    p50, p99 = percentile(lags_s, 50), percentile(lags_s, 99)
    first, last = thirds(r["rss"])
    growth = last / first - 1 if first else float("inf")
    # The cap is held to what the workers sent (the moment httpx2's transport is handed each request). On this
    # machine the server's own stamps are no measure of it: a tcpdump of a 5,000 run found the requests on
    # the wire within 1 % of the workers' figure (541 in a second against 536), and the server's log 821.
    caps = {budget: peak / r["qps"] for budget, peak in r["sent_peak_per_s"].items()}
    if r["polls"] and "poll" not in caps:
        # polls were answered but none was seen leaving the workers: the cap is not measured, so not met
        caps["poll"] = math.inf
    worst = max(caps, key=lambda b: caps[b]) if caps else "none"
    print(
        f"\nsoak: {r['ops']:,} operations in flight (+{r['sample']} completed in the window), poll interval"
        f" {interval_s:g} s, poll_qps = control_qps = {r['qps']:g}; ramp {r['ramp_s']:.0f} s,"
        f" window {r['window_s']:.0f} s; load average at the end {' '.join(r['load_average'])}"
    )
    total = r["ops"] + r["sample"]
    ramp_cpu = ", ".join(f"{k} {1000 * v / total:.1f}" for k, v in r["ramp_cpu_s"].items())
    print(f"  ramp: {total / r['ramp_s']:.0f} submissions/s; CPU ms per submission: {ramp_cpu}")
    print(
        f"  in flight (ledger WORKING, every {READ_EVERY_S:g} s): lowest {r['in_flight_min']:,},"
        f" highest {max(r['in_flight_readings']):,}"
    )
    print(
        f"  polls: {r['polls']:,} tasks/get in the window = {r['polls_per_s']:.1f}/s"
        f" (due: {r['in_flight_min'] / interval_s:.1f}/s); server log {r['log_entries']:,} entries"
        + (f" (FULL: it keeps the newest {LOG_LIMIT:,}; the figures are over those)" if r["log_full"] else "")
    )
    print(
        f"  worker CPU per poll: {r['worker_cpu_ms_per_poll']:.3f} ms net of idle"
        f" ({r['worker_cpu_ms_per_poll_raw']:.3f} ms raw; {r['cpu_s']['longcall workers']:.1f} s over the"
        f" window, idle {1000 * r['idle_worker_cpu_per_s']:.1f} ms/s)"
    )
    seconds = sorted(r["polls_by_second"]) or [0]
    print(
        f"  polls in each second of the window: p50 {percentile(seconds, 50):.0f},"
        f" p99 {percentile(seconds, 99):.0f}, max {seconds[-1]}, min {seconds[0]}"
    )
    actions = ", ".join(f"{k} {v:,}" for k, v in r["poll_actions"].items())
    print(f"  poll steps in the window (the workers' logs): {actions}")
    # Not the Postgres backends: the ledger's pools open and close connections, and a backend that exited
    # in the window takes its CPU time with it (the difference can be negative).
    parts = ", ".join(
        f"{k} {1000 * v / max(1, r['polls']):.2f}" for k, v in r["cpu_s"].items() if k != "postgres backends"
    )
    print(f"  CPU ms per poll of the other parts (raw, the sample's completions included): {parts}")
    longest = lags_s[-1] if lags_s else float("nan")
    print(
        f"  detection lag: p50 {p50:.2f} s, p99 {p99:.2f} s, max {longest:.2f} s"
        f" over {len(lags_s)} completions ({len(r['unobserved'])} not observed within the wait, each at its"
        f" lower bound; {r['refused']} refused by the server)"
    )
    sent = ", ".join(f"{b} {n} ({n / r['qps']:.2f} x cap)" for b, n in sorted(r["sent_peak_per_s"].items()))
    print(f"  highest requests in any 1 s by budget, as the workers sent them: {sent}")
    peaks = ", ".join(f"{b} {n} ({n / r['qps']:.2f} x cap)" for b, n in sorted(r["peak_per_s"].items()))
    print(
        f"  ... as the server's log stamped them: {peaks} (it stamps a request when it handles it: a server"
        " that shares the fleet's cores and falls behind handles its backlog at once)"
    )
    mib = [f"{size / 2**20:.0f}" for size in r["rss"]]
    print(
        f"  fleet RSS (MiB, every {READ_EVERY_S:g} s): {' '.join(mib)}; first third {first / 2**20:.1f},"
        f" last third {last / 2**20:.1f} ({100 * growth:+.1f} %);"
        f" demo server {r['server_rss'][0] / 2**20:.0f} -> {r['server_rss'][-1] / 2**20:.0f} MiB"
    )
    print()
    ok = target("soak.in_flight", r["in_flight_min"], ">=", r["ops"])
    ok &= target("soak.lag_p99", p99, "<=", interval_s + 1, " s")
    print(f"  (the QPS cap figure: the {worst} budget's highest requests sent in any 1 s over its cap)")
    ok &= target("soak.qps_cap", caps.get(worst, 0.0), "<=", 1.0, "x")
    ok &= target("soak.rss_flat", 100 * growth, "<=", 100 * RSS_GROWTH, " %")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--ops", type=int, default=10_000, help="operations to hold in flight")
    parser.add_argument("--sample", type=int, default=300, help="operations completed in the window")
    parser.add_argument("--poll-interval-ms", type=int, default=25_000)
    parser.add_argument("--window-s", type=float, default=185.0, help="the window, all WORKING")
    parser.add_argument("--qps", type=float, default=600.0, help="the server's poll_qps and control_qps")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--status-reads",
        choices=("httptools", "aiohttp", "httpx2"),
        default=None,
        help="what sends the polls' status reads (LONGCALL_STATUS_READS; default: the fleet's own)",
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--ramp-s", type=float, default=300.0, help="bound on the ramp to all WORKING")
    parser.add_argument("--wait-s", type=float, default=90.0, help="bound on the fleet's waits")
    parser.add_argument("--max-s", type=int, default=590, help="bound on the whole run")
    parser.add_argument("--redis-url", default=None, help="a shared Redis instead of a private one")
    parser.add_argument("--quick", action="store_true", help="1,000 in flight at 5 s for 40 s")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.ops, args.sample, args.poll_interval_ms, args.window_s = 1_000, 100, 5_000, 40.0
        args.ramp_s, args.max_s = 120.0, 300
    raise_on_sigterm()
    with log_directory("lc-bench-soak-", keep=args.keep_logs) as log_dir, alarm(args.max_s):
        result = measure(args, log_dir)
    ok = report(result)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
