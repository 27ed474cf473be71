"""The children of ``longcall dev``: each in a process group of its own, logged to a file, stopped in order.

A child gets its own session, so the terminal's Ctrl-C reaches ``longcall dev`` alone and the teardown
decides the order: the fleet first (newest first), the services it needs last. A stop is SIGTERM to the
child's whole group (a prefork worker's pool processes included), then SIGKILL for what is still there after
a bound. The pids and groups are written to ``processes.json`` in the data directory as they start, so a
test (or a person) can check that nothing is left, and so that a fleet whose parent was killed -9 is cleaned
up by the next ``longcall dev`` on the same directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from console.dev.services import DevError


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes]
    log: Path
    #: A service the fleet uses (Redis): stopped after the fleet.
    service: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Children:
    """What ``longcall dev`` started, in start order."""

    def __init__(self, log_dir: Path, record: Path, cwd: Path) -> None:
        self.log_dir = log_dir
        self.record = record
        self.cwd = cwd
        self.started: list[Child] = []
        self.extra: dict[str, int] = {}

    def start(self, name: str, argv: list[str], env: Mapping[str, str], *, service: bool = False) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as handle:
            try:
                process = subprocess.Popen(  # noqa: S603 (argv built by longcall dev, never a shell)
                    argv,
                    cwd=self.cwd,
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise DevError(f"cannot start {name} ({argv[0]}): {exc.strerror or exc}") from None
        child = Child(name, argv, process, log, service)
        self.started.append(child)
        self.write_record()
        return child

    def note(self, name: str, pid: int) -> None:
        """Record a process started by other means (the embedded Postgres) with the others."""
        self.extra[name] = pid
        self.write_record()

    def write_record(self) -> None:
        entries = [
            {"name": c.name, "pid": c.pid, "pgid": c.pid, "started": start_ticks(c.pid), "argv": c.argv}
            for c in self.started
        ]
        entries += [
            {"name": n, "pid": pid, "pgid": None, "started": start_ticks(pid), "argv": None}
            for n, pid in self.extra.items()
        ]
        self.record.write_text(json.dumps({"parent": os.getpid(), "processes": entries}, indent=2))

    def wait_ready(self, child: Child, what: str, probe: Callable[[], bool], timeout: float) -> None:
        """Wait until ``probe()`` is true; a child that exits or stays silent is a one-line error."""
        deadline = time.monotonic() + timeout
        while not probe():
            if child.process.poll() is not None:
                raise DevError(
                    f"{child.name} exited with {child.process.returncode} before {what} "
                    f"(log {child.log}): {last_line(child.tail())}"
                )
            if time.monotonic() > deadline:
                raise DevError(f"{child.name} not {what} after {timeout:.0f}s (log {child.log})")
            time.sleep(0.1)

    def exited(self) -> list[Child]:
        return [c for c in self.started if c.process.poll() is not None]

    def stop_all(self, timeout: float = 15.0) -> None:
        """Stop the fleet (newest first), then the services it used; kill what is left after ``timeout``."""
        fleet = [c for c in reversed(self.started) if not c.service]
        services = [c for c in reversed(self.started) if c.service]
        for group in (fleet, services):
            for child in group:
                _signal_group(child.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for child in group:
                _wait_group(child.pid, max(0.0, deadline - time.monotonic()))
                _signal_group(child.pid, signal.SIGKILL)
                _wait_group(child.pid, 5)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(timeout=5)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies keep a group "alive" to kill(2): look for a live member instead.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _wait_group(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (ticks since boot): with the pid, it names one process, never a reused pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def clean_leftovers(record: Path) -> list[str]:
    """Stop the groups a previous ``longcall dev`` on this directory left running (its parent was killed -9).

    Only a group whose leader is the very process recorded (same pid, same start time) is touched. The
    embedded Postgres is not a group of ours: the next start finds it running and uses it.
    """
    try:
        entries = json.loads(record.read_text())["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    cleaned = []
    for entry in entries:
        pgid, started = entry.get("pgid"), entry.get("started")
        if not isinstance(pgid, int) or started is None or start_ticks(pgid) != started:
            continue
        _signal_group(pgid, signal.SIGTERM)
        _wait_group(pgid, 10)
        _signal_group(pgid, signal.SIGKILL)
        cleaned.append(str(entry.get("name")))
    return cleaned
