"""The ``longcall`` command when a service cannot be reached: one line on stderr naming which and where
(credentials masked), exit code 3, within seconds; never a traceback, never a hang. Each command runs as
its own process, as a person or a script runs it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from console.common import EXIT_REFUSED, EXIT_UNREACHABLE
from console.common import as_unreachable as _unreachable
from tests import support

#: What a command may take to give up on a service (the brief's bound; the CLI connects within 2 s).
BOUND_S = 5.0
SECRET = "s3cret-pw"


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str
    elapsed_s: float


def longcall(*args: str, env: dict[str, str]) -> Ran:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "console", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Ran(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def assert_one_line(ran: Ran, expected: str) -> None:
    assert ran.code == EXIT_UNREACHABLE, (ran.code, ran.stdout, ran.stderr)
    lines = ran.stderr.splitlines()
    assert len(lines) == 1, ran.stderr
    assert lines[0].startswith(f"longcall: cannot reach {expected}"), lines[0]
    assert SECRET not in ran.stderr + ran.stdout
    assert "Traceback" not in ran.stderr
    # The interpreter's start and the commands' imports are not the command's wait: they are measured right
    # after, by importing what the commands import, and left out. ``longcall --help`` measured them before
    # and imports none of it: on a slow machine those imports took 3 s, and a database that never answers
    # was then given up on in 5.1 s, its 2 s connect timeout included, and failed the bound.
    start = startup_s()
    assert ran.elapsed_s - start < BOUND_S, (ran.elapsed_s, start)


#: What the commands here import before they connect (SQLAlchemy and psycopg, the adapters, Celery).
COMMAND_IMPORTS = "import console.main, ledger.repository, workers.app, adapters"


def startup_s() -> float:
    """Seconds a process takes to start and import what a command imports, measured now."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", COMMAND_IMPORTS], capture_output=True, timeout=60, check=True)
    return time.monotonic() - started


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never says a word (a host that hangs rather than refuses)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=2)
        for conn in held:
            conn.close()
        listener.close()


def closed_port() -> int:
    return support.free_port()


@pytest.mark.parametrize("command", [["status", "run-1/x"], ["migrate"], ["inputs", "--json"], ["reconcile"]])
def test_an_unreachable_database_is_one_line_and_exit_code_3(command: list[str]) -> None:
    port = closed_port()
    ran = longcall(
        *command, env={"LONGCALL_DATABASE_URL": f"postgresql://lc:{SECRET}@127.0.0.1:{port}/ledger"}
    )
    assert_one_line(ran, f"the database at postgresql://lc:***@127.0.0.1:{port}/ledger")
    assert "Connection refused" in ran.stderr


def test_a_database_that_never_answers_is_given_up_on_within_seconds() -> None:
    with silent_server() as port:
        ran = longcall(
            "status",
            "run-1/x",
            env={"LONGCALL_DATABASE_URL": f"postgresql://lc:{SECRET}@127.0.0.1:{port}/db"},
        )
    assert_one_line(ran, f"the database at postgresql://lc:***@127.0.0.1:{port}/db")
    assert "timeout" in ran.stderr


def test_an_unreachable_redis_fails_submit_at_once_not_after_twenty_seconds() -> None:
    port = closed_port()
    ran = longcall(
        "submit",
        "--call-node",
        "run-1/x",
        "--server",
        "reports",
        "--tool",
        "slow_report",
        env={"LONGCALL_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{port}/0"},
    )
    assert_one_line(ran, f"Redis (broker and result backend) at redis://:***@127.0.0.1:{port}/0")


def test_an_unreachable_broker_is_named_apart_from_redis(broker_prefix: str) -> None:
    port = closed_port()
    ran = longcall(
        "submit",
        "--call-node",
        "run-1/x",
        "--server",
        "reports",
        "--tool",
        "slow_report",
        env={
            "LONGCALL_BROKER_URL": f"amqp://guest:{SECRET}@127.0.0.1:{port}//",
            "LONGCALL_BROKER_KEYPREFIX": broker_prefix,
        },
    )
    assert_one_line(ran, f"the broker at amqp://guest:***@127.0.0.1:{port}//")


def test_a_refusal_by_the_database_is_not_taken_for_an_unreachable_one(database_url: str) -> None:
    """An error the server answered with (an SQLSTATE) is the command's business, not a connection failure."""
    with psycopg.connect(database_url) as conn, pytest.raises(psycopg.errors.UndefinedTable) as raised:
        conn.execute("SELECT * FROM no_such_table")
    assert _unreachable(raised.value) is None
    refused = psycopg.OperationalError("connection failed: Connection refused")
    wrapped = RuntimeError("Retry limit exceeded")
    wrapped.__cause__ = refused
    unreachable = _unreachable(wrapped)
    assert unreachable is not None
    assert unreachable.message.startswith("cannot reach the database at ")


def test_a_database_without_the_ledger_says_to_migrate(empty_database_url: str) -> None:
    """A fresh database (no tables) and a missing one: what to do, not a traceback."""
    ran = longcall("status", "run-1/x", env={"LONGCALL_DATABASE_URL": empty_database_url})
    assert ran.code == EXIT_REFUSED
    assert ran.stderr.strip().splitlines() == [
        'Error: the ledger has no tables yet (relation "tool_operation" does not exist): run longcall migrate'
    ]
    missing = empty_database_url.rsplit("/", 1)[0] + "/no_such_ledger_db"
    ran = longcall("status", "run-1/x", env={"LONGCALL_DATABASE_URL": missing})
    assert_one_line(ran, "the database at ")
    assert ran.stderr.strip().endswith(
        'database "no_such_ledger_db" does not exist (longcall migrate creates it)'
    )
