"""``make bench``: every benchmark, one after the other, then the 100,000-operation model and a summary.

Runs ``bench/dispatch_scale.py``, ``bench/lifecycle.py`` (on a Redis broker, then on RabbitMQ),
``bench/scaling.py``, ``bench/aip_vs_api_core.py``, ``bench/soak.py``, ``bench/isolation.py`` and
``bench/http_clients.py`` (their output streamed as it comes), collects every ``TARGET`` line (and the
``PASS``/``FAIL`` goal lines of the AIP-151 comparison) and every ``SCALING INPUT`` line, prints the
resources 100,000 operations in flight at a 5 s poll interval take, derived from those inputs alone
(docs/scaling.md quotes it), and a summary block with every target. Exits 1 when a target failed or a
benchmark did not finish, 0 otherwise.

Run: ``.venv/bin/python bench/run_all.py [--quick] [--only lifecycle ...]``
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TARGET = re.compile(r"^TARGET (\S+): (.*) -> (PASS|FAIL)$")
GOAL = re.compile(r"^(PASS|FAIL)  (.+)$")
INPUT = re.compile(r"^SCALING INPUT (\w+) = (\S+)")

#: name -> (script, its arguments, extra arguments for --quick); the order they run in.
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "dispatch_scale": ("dispatch_scale.py", [], ["--quick"]),
    "lifecycle": ("lifecycle.py", [], ["--quick"]),
    # The same on RabbitMQ, a first-class broker (its targets are lifecycle_rabbitmq.*; the scaling model
    # is built from the Redis run).
    "lifecycle_rabbitmq": ("lifecycle.py", ["--broker", "rabbitmq"], ["--quick"]),
    "scaling": ("scaling.py", [], ["--quick"]),
    "aip_vs_api_core": ("aip_vs_api_core.py", [], ["--seconds", "10", "--runs", "2"]),
    "soak": ("soak.py", [], ["--quick"]),
    "isolation": ("isolation.py", [], ["--quick"]),
    "http_clients": ("http_clients.py", [], ["--quick"]),
    "cli_start": ("cli_start.py", [], ["--quick"]),
}


@dataclass
class Collected:
    targets: list[tuple[str, str, str]] = field(default_factory=list)
    inputs: dict[str, float] = field(default_factory=dict)
    failed_runs: list[str] = field(default_factory=list)


def run(name: str, argv: list[str], collected: Collected, timeout: float) -> None:
    """Run one benchmark, its output streamed and its lines collected; past ``timeout`` it gets a SIGTERM
    (every benchmark then cleans up what it started), a SIGKILL 30 s later."""
    print(f"\n===== {name}: {' '.join(argv[1:])}", flush=True)
    started = time.monotonic()
    before = len(collected.targets)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its lines as they come, not at its exit
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
    ) as proc:
        stop = threading.Timer(timeout, proc.terminate)
        kill = threading.Timer(timeout + 30, proc.kill)
        stop.start()
        kill.start()
        try:
            for line in proc.stdout or ():
                print(line, end="", flush=True)
                text = line.rstrip("\n")
                if match := TARGET.match(text):
                    collected.targets.append((match.group(1), match.group(2), match.group(3)))
                elif match := GOAL.match(text):
                    collected.targets.append((f"{name}.{match.group(2)}", "", match.group(1)))
                elif match := INPUT.match(text):
                    collected.inputs[match.group(1)] = float(match.group(2))
            code = proc.wait(timeout=60)
        finally:
            stop.cancel()
            kill.cancel()
    # A benchmark exits 1 when one of its targets failed, and says which in its lines; any other exit, or an
    # exit 1 without a failed target, means it did not finish.
    failed = any(outcome == "FAIL" for _, _, outcome in collected.targets[before:])
    if code != 0 and not (code == 1 and failed):
        collected.failed_runs.append(f"{name} (exit {code})")
    print(f"===== {name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)


def model(inputs: dict[str, float], in_flight: int = 100_000, interval_s: float = 5.0) -> list[str]:
    """The resources ``in_flight`` operations polled every ``interval_s`` take, from the measured inputs."""
    wanted = (
        "worker_cpu_ms_per_poll",
        "ledger_tx_per_poll",
        "redis_calls_per_poll",
        "broker_messages_per_poll",
        "postgres_cpu_ms_per_poll",
        "redis_cpu_us_per_call",
        "postgres_commits_per_s",
        "dispatch_rows_per_s_one_dispatcher",
    )
    missing = [k for k in wanted if k not in inputs]
    if missing:
        return [f"  (not derived: missing inputs {', '.join(missing)})"]
    polls = in_flight / interval_s
    worker_cores = polls * inputs["worker_cpu_ms_per_poll"] / 1000
    pg_tx = polls * inputs["ledger_tx_per_poll"]
    pg_cores = polls * inputs["postgres_cpu_ms_per_poll"] / 1000
    redis_calls = polls * inputs["redis_calls_per_poll"]
    redis_cores = redis_calls * inputs["redis_cpu_us_per_call"] / 1e6
    broker = polls * inputs["broker_messages_per_poll"]
    dispatchers = polls / inputs["dispatch_rows_per_s_one_dispatcher"]
    # The parts one instance of which cannot be spread over more machines by adding workers: a single Redis
    # (one core), a single Postgres primary (its measured commit rate here), one dispatch tick at a time.
    single = {
        "Redis (one core per instance)": redis_cores,
        "Postgres commits (measured rate on this machine)": pg_tx / inputs["postgres_commits_per_s"],
        "one dispatcher (ticks back to back)": dispatchers,
    }
    first = max(single, key=lambda k: single[k])
    return [
        f"  {in_flight:,} operations in flight, one poll each per {interval_s:g} s: {polls:,.0f} polls/s",
        f"  MODEL worker_cores = {worker_cores:,.1f}  (polls/s x worker_cpu_ms_per_poll)",
        f"  MODEL postgres_tx_per_s = {pg_tx:,.0f}  (polls/s x ledger_tx_per_poll;"
        f" {single['Postgres commits (measured rate on this machine)']:.1f} x postgres_commits_per_s)",
        f"  MODEL postgres_backend_cores = {pg_cores:,.1f}  (polls/s x postgres_cpu_ms_per_poll)",
        f"  MODEL redis_calls_per_s = {redis_calls:,.0f}  (polls/s x redis_calls_per_poll)",
        f"  MODEL redis_cores = {redis_cores:,.2f}  (redis_calls_per_s x redis_cpu_us_per_call)",
        f"  MODEL broker_messages_per_s = {broker:,.0f}  (polls/s x broker_messages_per_poll)",
        f"  MODEL dispatchers = {dispatchers:,.1f}  (polls/s / dispatch_rows_per_s_one_dispatcher)",
        *(
            [
                f"  MODEL dispatchers_one_row_per_server = {polls / spread:,.1f}  (polls/s /"
                " dispatch_rows_per_s_one_row_per_server: every due row on a server of its own)"
            ]
            if (spread := inputs.get("dispatch_rows_per_s_one_row_per_server"))
            else []
        ),
        f"  MODEL saturates_first = {first}: {single[first]:.1f} x one instance's capacity"
        f" (others: {', '.join(f'{k} {v:.1f} x' for k, v in single.items() if k != first)})",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark's short run")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--timeout-s", type=float, default=600, help="bound on each benchmark")
    args = parser.parse_args(argv)
    collected = Collected()
    started = time.monotonic()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average before: {' '.join(load)}")
    for name in args.only:
        script, always, quick = BENCHMARKS[name]
        argv_ = [sys.executable, str(BENCH / script), *always, *(quick if args.quick else [])]
        run(name, argv_, collected, args.timeout_s)
    print("\n===== scaling inputs (SCALING INPUT lines above)")
    for key, value in collected.inputs.items():
        print(f"  {key} = {value:.6g}")
    print("\n===== 100,000 operations in flight at a 5 s poll interval (from the scaling inputs)")
    for line in model(collected.inputs):
        print(line)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\n===== summary ({time.monotonic() - started:.0f} s; load average now {' '.join(load)})")
    for name, figure, outcome in collected.targets:
        print(f"  {outcome}  {name}" + (f": {figure}" if figure else ""))
    for failed in collected.failed_runs:
        print(f"  FAIL  {failed} did not finish")
    failures = sum(outcome == "FAIL" for _, _, outcome in collected.targets) + len(collected.failed_runs)
    print(f"  {len(collected.targets)} targets, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
