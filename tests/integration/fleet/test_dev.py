"""``longcall dev`` as a user runs it: a subprocess on embedded Postgres and Redis (none of the shared
services), the demo to its end at an 80-column terminal (a pseudo-terminal) with its two questions answered
by keys typed while its table goes on moving, then its ledger reopened and compared with what it printed;
and ``--no-demo`` stopped with Ctrl-C. Nothing it started may survive it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from console.dev.command import missing_demo_packages
from console.dev.fleet import LocalFleet, mask_password
from console.dev.processes import clean_leftovers, group_alive
from console.dev.services import DataDir, EmbeddedPostgres, lock_data_dir, pid_alive, prepare_data_dir
from console.main import main as cli_main
from tests.support import REPO, wait_for
from tests.support.terminal import Terminal, plain

pytestmark = pytest.mark.slow

RECEIPT_LINE = re.compile(r"^│ ([a-z0-9-]+)\s+│ (\w+)\s+│ (sha256:[0-9a-f]{16}|-)\s+│ (.*?)\s+│$")
RECEIPTS_TITLE = re.compile(r"^Receipts \(from the ledger; call nodes (dev/\S+/)\.\.\.\)\s*$", re.MULTILINE)
TITLE = "longcall dev demo (call nodes"
QUESTIONS = ("Approve? [Y/n]", "Record it as found? [Y/n]")
SERVER_TASKS_LINE = re.compile(r"^server tasks for (dev/\S+): (\d+) ")


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A data directory outside pytest's basetemp: as root, the embedded Postgres runs as the user
    ``pgserver``, which must traverse the directory's parents; pytest makes ``/tmp/pytest-of-root`` 0700
    again whenever a session starts (another engineer's run, say), which would cut the running server off."""
    root = Path(tempfile.mkdtemp(prefix="longcall-dev-test-"))
    try:
        yield root / "dev"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _env() -> dict[str, str]:
    """The user's shell with no LONGCALL_* service named: everything embedded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGCALL_")}
    env["COLUMNS"] = "200"
    return env


def _longcall() -> list[str]:
    return [str(Path(sys.executable).with_name("longcall"))]


def _assert_nothing_left(data_dir: Path) -> list[dict[str, Any]]:
    record = json.loads((data_dir / "processes.json").read_text())
    processes: list[dict[str, Any]] = record["processes"]
    names = {p["name"] for p in processes}
    assert {"postgres", "redis", "demo-server", "worker1", "worker2", "beat", "flower", "metrics"} <= names
    alive = [
        p for p in processes if pid_alive(p["pid"]) or (p["pgid"] is not None and group_alive(p["pgid"]))
    ]
    assert alive == [], f"left running after longcall dev exited: {alive}"
    return processes


def _ledger_rows(data_dir: Path) -> dict[str, dict[str, Any]]:
    """Reopen the data dir's Postgres and read every operation with its receipt."""
    postgres = EmbeddedPostgres(data_dir / "pg")
    url = postgres.start()
    try:
        with psycopg.connect(url) as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT o.call_node_id, o.state, o.result, r.terminal_state, r.result_digest"
                " FROM tool_operation o LEFT JOIN terminal_receipt r ON r.op_id = o.id"
            )
            return {
                row[0]: {"state": row[1], "result": row[2], "terminal_state": row[3], "digest": row[4]}
                for row in cur.fetchall()
            }
    finally:
        postgres.stop()


@pytest.mark.timeout(300)
def test_the_demo_at_a_terminal_asks_while_its_table_stays_live_and_its_receipts_are_the_ledgers(
    data_dir: Path,
) -> None:
    started = time.monotonic()
    screen = Terminal([*_longcall(), "dev", "--exit", "--data-dir", str(data_dir)], cwd=REPO, env=_env())
    try:
        # The two questions come in the order their calls reach them (the operator's, or the approval).
        first = screen.read_until(*QUESTIONS, timeout=180)
        # Unanswered for 3 s: the table is drawn again and again, and moves (the calls' times), the
        # question still below it in every frame.
        frames = plain(screen.read(3.0)).split(TITLE)[1:]
        assert len(frames) >= 4, frames
        assert all(first in frame for frame in frames[:-1]), frames
        assert len({frame.strip() for frame in frames}) >= 2, frames
        screen.type("y")
        [second] = [question for question in QUESTIONS if question != first]
        screen.read_until(second, timeout=120)
        screen.type("\r")  # Enter: the default, yes
        code = screen.wait(timeout=200)
    except BaseException:
        # A failed interaction: what it started is stopped (killing longcall dev does not stop its children).
        screen.close()
        if (data_dir / "processes.json").exists():
            _clean_up(data_dir, [])
        raise
    finally:
        screen.close()
    output = plain(bytes(screen.raw))
    assert code == 0, output[-6000:]
    assert time.monotonic() - started < 280
    _assert_nothing_left(data_dir)
    assert "Approve? [Y/n] yes" in output
    assert "Record it as found? [Y/n] yes" in output

    # It reads at 80 columns: no line of the tables is wider.
    tables = output[output.index(TITLE) : output.index("server tasks for")]
    assert max(len(line) for line in tables.splitlines()) <= 80, tables

    [prefix] = RECEIPTS_TITLE.findall(output)
    printed = {prefix + m[1]: (m[2], m[3], m[4]) for m in map(RECEIPT_LINE.match, output.splitlines()) if m}
    assert len(printed) == 12, output[-6000:]
    assert printed[prefix + "report-08"][2] == "report ready after 12s", printed  # the result, not cut
    rows = _ledger_rows(data_dir)
    for node, (terminal, digest, _summary) in printed.items():
        row = rows[node]
        assert row["terminal_state"] == terminal, node
        if row["digest"] is None:
            assert digest == "-", node
        else:
            assert row["digest"].startswith(digest), node
        assert row["state"] in ("ACCEPTED", "CANCELLED_ACCEPTED"), node

    by_name = {node.rsplit("/", 1)[1]: node for node in printed}
    assert rows[by_name["cancel-me"]]["terminal_state"] == "cancelled"
    assert rows[by_name["cancel-me"]]["state"] == "CANCELLED_ACCEPTED"
    assert rows[by_name["report-fails"]]["terminal_state"] == "failed"
    approval = rows[by_name["approval"]]
    assert approval["terminal_state"] == "completed"
    assert approval["result"]["content"][0]["text"] == "approved"  # the answer (approved) reached the tool

    # The lost create answer: the server's own record holds exactly one task for that call, and one
    # tools/call per call node in all (nothing was called twice).
    lost = by_name["lost-create"]
    assert rows[lost]["terminal_state"] == "completed"
    server = json.loads((data_dir / "demo-server.json").read_text())
    lost_tasks = [t for t in server["tasks"]["tasks"] if t["arguments"] == {"seconds": 4.5}]
    assert len(lost_tasks) == 1
    calls = [e for e in server["log"]["entries"] if e["method"] == "tools/call"]
    assert len(calls) == len(server["tasks"]["tasks"]) == 12
    [(node, count)] = [(m[1], m[2]) for m in map(SERVER_TASKS_LINE.match, output.splitlines()) if m]
    assert (node, count) == (lost, "1")

    assert "flower" in output
    assert "http://127.0.0.1:" in output


def _start_no_demo(data_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as handle:
        proc = subprocess.Popen(
            [*_longcall(), "dev", "--no-demo", "--data-dir", str(data_dir)],
            cwd=REPO,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    # The last line of what it prints once ready: "fleet ready" comes first, and the lines to use the fleet
    # (the exports the test reads) follow it (a read between the two missed them in CI).
    wait_for(
        "longcall dev --no-demo to say it is ready and how to use it",
        lambda: "Ctrl-C stops everything." in log.read_text() or proc.poll() is not None,
        timeout=150,
        interval=0.2,
    )
    assert proc.poll() is None, log.read_text()[-4000:]
    return proc


def _records(data_dir: Path) -> list[dict[str, Any]]:
    processes: list[dict[str, Any]] = json.loads((data_dir / "processes.json").read_text())["processes"]
    return processes


def _clean_up(data_dir: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """Whatever an assertion left running: the dev processes, their groups, the embedded Postgres."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    clean_leftovers(data_dir / "processes.json")
    if any(p["name"] == "postgres" and pid_alive(p["pid"]) for p in _records(data_dir)):
        postgres = EmbeddedPostgres(data_dir / "pg")
        postgres.start()
        postgres.stop()


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_fleet_and_a_fleet_whose_parent_was_killed_is_stopped_by_the_next(
    data_dir: Path, tmp_path: Path
) -> None:
    """``--no-demo`` prints the lines to use it and runs until Ctrl-C, which stops every process it started
    (the embedded Postgres and Redis included). A ``longcall dev`` killed -9 cannot stop its children: the
    next one on the same data dir does, before it starts its own."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        first = _start_no_demo(data_dir, tmp_path / "first.out")
        procs.append(first)
        text = (tmp_path / "first.out").read_text()
        assert "export LONGCALL_DATABASE_URL=" in text
        assert "export LONGCALL_REDIS_URL=" in text
        orphans = [p for p in _records(data_dir) if p["pgid"] is not None]
        assert all(group_alive(p["pgid"]) for p in orphans)
        first.kill()
        first.wait(timeout=10)
        assert all(group_alive(p["pgid"]) for p in orphans)  # nothing stops them but the next longcall dev

        second = _start_no_demo(data_dir, tmp_path / "second.out")
        procs.append(second)
        assert "stopped what a previous longcall dev left running" in (tmp_path / "second.out").read_text()
        assert [p["name"] for p in orphans if group_alive(p["pgid"])] == []
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 0, (tmp_path / "second.out").read_text()[-4000:]
        assert "longcall dev: stopped" in (tmp_path / "second.out").read_text()
        _assert_nothing_left(data_dir)
    finally:
        _clean_up(data_dir, procs)


def test_a_data_dir_that_cannot_be_used_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = CliRunner().invoke(cli_main, ["dev", "--data-dir", str(not_a_dir / "dev")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: data dir {not_a_dir / 'dev'} is not writable: Not a directory"
    ]

    busy = prepare_data_dir(tmp_path / "busy")
    held = lock_data_dir(busy)
    try:
        result = CliRunner().invoke(cli_main, ["dev", "--data-dir", str(busy.root)])
    finally:
        held.close()
    assert result.exit_code == 1
    assert (
        result.output.strip() == f"Error: data dir {busy.root} is in use by longcall dev (pid {os.getpid()})"
    )


def test_an_install_without_the_demo_extra_is_told_which_extra_to_add_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "uvicorn" else real(name, *args)
    )
    assert missing_demo_packages() == ["uvicorn"]
    result = CliRunner().invoke(cli_main, ["dev", "--data-dir", str(tmp_path / "dev")])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert "needs uvicorn" in line
    assert "pip install -e '.[demo]'" in line
    assert not (tmp_path / "dev").exists()  # nothing started, nothing written


def test_help_names_the_options() -> None:
    result = CliRunner().invoke(cli_main, ["dev", "--help"])
    assert result.exit_code == 0
    for option in ("--data-dir", "--no-demo", "--exit", "--yes", "--workers"):
        assert option in result.output


def test_a_password_in_a_url_the_user_set_is_never_printed() -> None:
    assert mask_password("postgresql://bob:s3cr%40t@db:5432/x") == "postgresql://bob:***@db:5432/x"
    assert mask_password("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert (
        mask_password("postgresql://postgres:@/longcall?host=/tmp/d")
        == "postgresql://postgres:@/longcall?host=/tmp/d"
    )
    fleet = LocalFleet(
        data=DataDir(Path("/d")),
        database_url="postgresql://bob:pw@db/x",
        redis_url="redis://127.0.0.1:7000/0",
        broker_url=None,
        embedded_postgres=False,
        embedded_redis=True,
        demo_url="http://127.0.0.1:1/mcp",
        flower_url="http://127.0.0.1:2/",
        flower_user="u",
        flower_password="p",
        flower_password_from_env=True,
        metrics_url="http://127.0.0.1:3/metrics",
        env={
            "LONGCALL_DATABASE_URL": "postgresql://bob:pw@db/x",
            "LONGCALL_REDIS_URL": "redis://127.0.0.1:7000/0",
            "LONGCALL_CONFIG": "/d/longcall.toml",
        },
    )
    assert fleet.exports() == [
        "# LONGCALL_DATABASE_URL: as set in your environment",
        "export LONGCALL_REDIS_URL='redis://127.0.0.1:7000/0'",
        "export LONGCALL_CONFIG='/d/longcall.toml'",
    ]


EMBEDDED_TWICE = """
import shutil, sys
from pathlib import Path
import psycopg
from console.dev.services import EmbeddedPostgres
root = Path(sys.argv[1])
for _ in range(2):
    postgres = EmbeddedPostgres(root / "pg")
    url = postgres.start().replace("/longcall?", "/postgres?")
    with psycopg.connect(url, connect_timeout=10) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    postgres.stop()
shutil.rmtree(root)
"""


@pytest.mark.timeout(120)
def test_the_embedded_postgres_starts_again_in_one_process_and_leaves_nothing_at_exit(data_dir: Path) -> None:
    """Stopped, it can be started again in the same process (the wheel caches a handle per directory), and
    the process's exit touches nothing (the wheel's exit hook would recreate a lock file in a removed dir)."""
    data_dir.mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-c", EMBEDDED_TWICE, str(data_dir)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    assert not data_dir.exists()
