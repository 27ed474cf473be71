"""Test plumbing over real services: a Postgres database per test (from a migrated template), Redis, and
Celery worker/beat processes started as subprocesses. Every wait here is bounded and says what it waited for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psycopg
import redis

REPO = Path(__file__).resolve().parent.parent
ADMIN_URL = os.environ.get("LONGCALL_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("LONGCALL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

T = TypeVar("T")


def database_url(name: str) -> str:
    base, _, _ = ADMIN_URL.rpartition("/")
    return f"{base}/{name}"


def admin_execute(sql: str) -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.encode())


def create_database(template: str | None = None) -> str:
    name = f"lc_test_{uuid.uuid4().hex[:12]}"
    admin_execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return name


def drop_database(name: str) -> None:
    admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def require_services() -> None:
    """A service a test needs that is missing fails the run; it never skips."""
    try:
        with psycopg.connect(ADMIN_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise RuntimeError(f"Postgres is not reachable at {ADMIN_URL}: {exc}") from exc
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5).ping()
    except redis.RedisError as exc:
        raise RuntimeError(f"Redis is not reachable at {REDIS_URL}: {exc}") from exc


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float = 30.0, interval: float = 0.05) -> T:
    """Call ``probe`` until it returns something other than None/False, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class CeleryProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    extra_logs: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """kill -9 the whole process group (the main process and its pool children)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def kill_children(self) -> list[int]:
        """kill -9 the direct children of the main process (a prefork worker's pool processes), not the main
        process itself: it sees its children die and acts on the tasks they ran. Returns the killed pids."""
        children = child_pids(self.proc.pid)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return children


def child_pids(pid: int) -> list[int]:
    """The live direct children of ``pid``, read from /proc (field 4 of /proc/<pid>/stat is the parent)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def celery_env(overrides: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGCALL_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def start_celery(
    args: list[str],
    *,
    env: Mapping[str, str],
    log_dir: Path,
    name: str,
    ready_marker: str | None,
    timeout: float = 60.0,
) -> CeleryProcess:
    return start_celery_like(
        [sys.executable, "-m", "celery", *args],
        env=env,
        log_dir=log_dir,
        name=name,
        ready_marker=ready_marker,
        timeout=timeout,
    )


def start_celery_like(
    argv: list[str],
    *,
    env: Mapping[str, str],
    log_dir: Path,
    name: str,
    ready_marker: str | None = None,
    timeout: float = 60.0,
) -> CeleryProcess:
    """Start any command of the fleet (celery, longcall, python -m ...) in its own process group."""
    log_path = log_dir / f"{name}.log"
    handle = log_path.open("wb")
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=celery_env(env),
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    handle.close()
    process = CeleryProcess(name, proc, log_path)
    if ready_marker is not None:
        try:
            wait_for(
                f"{name} to log {ready_marker!r}",
                lambda: ready_marker in process.log() or proc.poll() is not None,
                timeout=timeout,
            )
        except AssertionError:
            process.kill()
            raise AssertionError(f"{name} did not start:\n{process.log()[-4000:]}") from None
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{process.log()[-4000:]}")
    return process


def start_worker(
    app: str,
    *,
    queues: str,
    env: Mapping[str, str],
    log_dir: Path,
    name: str,
    concurrency: int = 2,
) -> CeleryProcess:
    return start_celery(
        [
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
            "INFO",
            "--without-gossip",
            "--without-mingle",
        ],
        env=env,
        log_dir=log_dir,
        name=name,
        ready_marker=" ready.",
    )


@contextlib.contextmanager
def running(processes: list[CeleryProcess]) -> Iterator[list[CeleryProcess]]:
    try:
        yield processes
    finally:
        for process in processes:
            process.stop()
