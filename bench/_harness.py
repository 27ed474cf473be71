"""Plumbing the benchmarks share: throwaway databases, child processes in their own process group, a private
Redis, bounded waits and percentiles. Everything started here is stopped by the caller's ``ExitStack``, on
success and on failure alike.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TypeVar

import httpx2
import psycopg
import redis
from _apps import PIPELINE_QUEUE

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
ADMIN_URL = os.environ.get("LONGCALL_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SHARED_REDIS_URL = os.environ.get("LONGCALL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

T = TypeVar("T")


def raise_on_sigterm() -> None:
    """A SIGTERM (or SIGHUP) unwinds the stack like Ctrl-C, so every ``finally`` cleans up."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


# ------------------------------------------------------------------------------------------- Postgres


def database_url(name: str) -> str:
    base, _, _ = ADMIN_URL.rpartition("/")
    return f"{base}/{name}"


def admin_execute(sql: str) -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.encode())


def create_database() -> str:
    name = f"lc_bench_{uuid.uuid4().hex[:12]}"
    admin_execute(f'CREATE DATABASE "{name}"')
    return name


def drop_database(name: str) -> None:
    admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def alarm(seconds: int) -> Iterator[None]:
    """The whole run is bounded: past ``seconds``, unwind (and clean up) like Ctrl-C."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"the benchmark ran past its {seconds}s bound")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def log_directory(prefix: str, *, keep: bool = False) -> Iterator[Path]:
    """A fresh directory for a run's logs: removed when the run ends well (unless ``keep``), kept and named
    on stderr when it does not (or when asked to)."""
    log_dir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield log_dir
    except BaseException:
        print(f"logs kept in {log_dir}", file=sys.stderr)
        raise
    if keep:
        print(f"logs kept in {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """A new, migrated ledger database (``ledger.migrate.upgrade``), dropped on the way out."""
    from ledger.migrate import upgrade  # noqa: PLC0415 - alembic is only needed here

    name = create_database()
    try:
        upgrade(database_url(name))
        yield name
    finally:
        drop_database(name)


def xact_commit(name: str) -> int:
    """``pg_stat_database.xact_commit`` of one database, read from the admin database (so the read itself
    is not counted in it)."""
    with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (name,)).fetchone()
    if row is None:
        raise LookupError(f"database {name} has no pg_stat_database row")
    return int(row[0])


def sessions(name: str) -> int:
    """``pg_stat_database.sessions`` of one database: the connections made to it so far. Each one's start is
    a transaction of its own, counted in ``xact_commit``."""
    with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", (name,)).fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0


def backend_pids(name: str) -> list[int]:
    """The server processes of the connections to one database (read from the admin database)."""
    with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=10) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (name,)).fetchall()
    return [int(r[0]) for r in rows]


# --------------------------------------------------------------------------------------------- Redis


def delete_prefixed(client: redis.Redis, prefix: str) -> int:
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])
    return len(keys)


def command_calls(client: redis.Redis) -> dict[str, int]:
    """``calls`` per command from ``INFO commandstats`` (commands run inside Lua scripts included)."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(entry["calls"])
        for name, entry in stats.items()
        if isinstance(entry, dict)
    }


# ------------------------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float, interval: float = 0.05) -> T:
    """Call ``probe`` until it returns something other than None/False, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the child's process group (a Celery worker and its pool), SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        # Pool children can outlive their parent's exit: the group is killed whatever happened above.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def child_env(overrides: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LONGCALL_", "BENCH_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(BENCH), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def start_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_dir: Path,
    name: str,
    ready: Callable[[Child], bool] | None = None,
    timeout: float = 60.0,
) -> Child:
    """Start a command in its own process group; with ``ready``, wait (bounded) until it says so."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as handle:
        proc = subprocess.Popen(
            list(argv),
            cwd=REPO,
            env=child_env(env),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    child = Child(name, proc, log_path)
    if ready is not None:
        try:
            wait_for(f"{name} to start", lambda: proc.poll() is not None or ready(child), timeout=timeout)
        except TimeoutError:
            child.stop()
            raise RuntimeError(f"{name} did not start:\n{child.log()[-3000:]}") from None
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{child.log()[-3000:]}")
    return child


def logged(marker: str) -> Callable[[Child], bool]:
    return lambda child: marker in child.log()


def listening(control: str) -> Callable[[Child], bool]:
    """Ready when a demo server's control endpoints (``control``: its ``.../_control`` URL) answer."""

    def probe(_: Child) -> bool:
        try:
            return httpx2.get(f"{control}/faults", timeout=1).status_code == 200
        except httpx2.HTTPError:
            return False

    return probe


def celery_worker_argv(
    app: str, *, queues: str, name: str, concurrency: int, loglevel: str = "INFO"
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app,
        "worker",
        "-Q",
        queues,
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "--loglevel",
        loglevel,
        "--without-gossip",
        "--without-mingle",
    ]


@contextlib.contextmanager
def rabbitmq_vhost(base_url: str = "amqp://guest:guest@127.0.0.1:5672/") -> Iterator[str]:
    """A fresh vhost on the machine's RabbitMQ (``rabbitmqctl``), deleted with its queues on the way out;
    yields its broker URL."""
    vhost = f"lcbench-{uuid.uuid4().hex[:10]}"
    scheme, _, rest = base_url.partition("://")
    user = rest.partition("@")[0].partition(":")[0] or "guest"
    subprocess.run(["rabbitmqctl", "add_vhost", vhost], check=True, capture_output=True, timeout=60)
    try:
        subprocess.run(
            ["rabbitmqctl", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield f"{scheme}://{rest.partition('/')[0]}/{vhost}"
    finally:
        subprocess.run(["rabbitmqctl", "delete_vhost", vhost], check=False, capture_output=True, timeout=60)


def start_private_redis(log_dir: Path) -> tuple[Child, str]:
    """A Redis of our own (no persistence), so ``INFO commandstats`` counts this run's calls only."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    url = f"redis://127.0.0.1:{port}/0"

    def up(_: Child) -> bool:
        try:
            return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    return start_child(argv, env={}, log_dir=log_dir, name=f"redis-{port}", ready=up, timeout=20), url


def cpu_seconds(pids: set[int], groups: set[int]) -> float:
    """User + system CPU time of the processes in ``pids`` and in the process groups ``groups`` (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(entry.name) in pids or int(fields[2]) in groups:
            total += int(fields[11]) + int(fields[12])
    return total / tick


# --------------------------------------------------------------------------------------------- figures


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def target(name: str, measured: float, op: str, goal: float, unit: str = "") -> bool:
    """Print one target line, ``TARGET <name>: <measured> (target <op> <goal>; ratio) -> PASS|FAIL``, the form
    ``bench/run_all.py`` collects into its summary; returns whether it holds. ``op``: ``<=``, ``>=``, ``<``,
    ``==``."""
    checks = {
        "<=": measured <= goal,
        ">=": measured >= goal,
        "<": measured < goal,
        "==": measured == goal,
    }
    ok = checks[op]
    ratio = f"; measured/target {measured / goal:.2f}" if goal else ""
    print(f"TARGET {name}: {measured:.4g}{unit} (target {op} {goal:.4g}{unit}{ratio}) -> {verdict(ok)}")
    return ok


def scaling_input(key: str, value: float, unit: str, what: str) -> None:
    """Print one figure the 100,000-operation model (``bench/run_all.py``, docs/scaling.md) is built from."""
    print(f"SCALING INPUT {key} = {value:.6g} {unit}  # {what}")


# ------------------------------------------------------------------------------------------- a fleet

LONGCALL_QUEUES = "longcall.control,longcall.poll,longcall.outbox"


def start_longcall_fleet(
    children: dict[str, Child],
    *,
    log_dir: Path,
    longcall_env: Mapping[str, str],
    workers: int,
    concurrency: int,
    redis_url: str,
    prefix: str,
    sink: str,
    app: str = "workers.app",
    queues: str = LONGCALL_QUEUES,
    broker_url: str | None = None,
) -> None:
    """``workers`` longcall workers (``longcall0``, ...; Celery app ``app`` on ``queues``), beat, and the
    pipeline worker (``_apps:pipeline``, recording receipts on the Redis list ``sink``), each added to
    ``children`` once started, so the caller's ``finally`` stops whatever did start."""
    for index in range(workers):
        name = f"longcall{index}"
        children[name] = start_child(
            celery_worker_argv(app, queues=queues, name=name, concurrency=concurrency),
            env=longcall_env,
            log_dir=log_dir,
            name=name,
            ready=logged(" ready."),
        )
    beat = [sys.executable, "-m", "celery", "-A", "workers.app", "beat"]
    beat += ["-s", str(log_dir / "beat-schedule"), "--loglevel", "INFO"]
    children["beat"] = start_child(
        beat, env=longcall_env, log_dir=log_dir, name="beat", ready=logged("beat: Starting")
    )
    children["pipeline"] = start_child(
        celery_worker_argv("_apps:pipeline", queues=PIPELINE_QUEUE, name="pipeline", concurrency=1),
        env={
            "BENCH_BROKER_URL": broker_url or redis_url,
            "BENCH_SINK_URL": redis_url,
            "BENCH_KEYPREFIX": prefix,
            "BENCH_SINK": sink,
        },
        log_dir=log_dir,
        name="pipeline",
        ready=logged(" ready."),
    )
