"""Issue 22, item 12: the CPU the ``longcall`` command costs before it does its work.

Each command runs ``--runs`` times as its own process (the console script's interpreter, ``python -m
console``), nothing else running it; the figure is the median of the child's user + system CPU
(``resource.getrusage(RUSAGE_CHILDREN)``), beside a bare interpreter's (``python -c pass``) measured in the
same run. ``status --help`` and ``list --help`` load their command (its module and what it imports) and
stop before reading anything: what ``longcall status`` pays before its own work. With
``LONGCALL_DATABASE_URL`` set, ``longcall status`` of an op id the ledger does not hold is measured too (no
target): the whole command, its reading imports (SQLAlchemy, psycopg, pydantic) and one lookup included.

Targets: ``cli.help_cpu`` and ``cli.status_load_cpu`` <= 0.3 s.

Run: ``.venv/bin/python bench/cli_start.py [--runs N] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from _harness import target

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "longcall --help": [sys.executable, "-m", "console", "--help"],
    "longcall status --help": [sys.executable, "-m", "console", "status", "--help"],
    "longcall list --help": [sys.executable, "-m", "console", "list", "--help"],
}


#: Run only with a ledger to read (its answer: exit 1, no such operation).
READING = {
    "longcall status (a lookup)": [
        sys.executable,
        "-m",
        "console",
        "status",
        "00000000-0000-4000-8000-000000000000",
    ]
}


def cpu_s(argv: list[str], *, check: bool = True) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, cwd=REPO, capture_output=True, check=check, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 runs each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = 3 if args.quick else args.runs
    figures = {
        name: statistics.median(cpu_s(command) for _ in range(runs)) for name, command in COMMANDS.items()
    }
    if os.environ.get("LONGCALL_DATABASE_URL"):
        for name, command in READING.items():
            figures[name] = statistics.median(cpu_s(command, check=False) for _ in range(runs))
    for name, seconds in figures.items():
        print(f"  {name:<28} {1000 * seconds:7.1f} ms CPU (median of {runs})")
    ok = target("cli.help_cpu", figures["longcall --help"], "<=", 0.3, " s")
    ok &= target("cli.status_load_cpu", figures["longcall status --help"], "<=", 0.3, " s")
    if args.json:
        print(json.dumps(figures))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
