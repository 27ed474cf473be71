"""Test plumbing over real services: a Postgres database per test (from a migrated template), Redis, and
Celery worker/beat processes started as subprocesses. Every wait here is bounded and says what it waited for.
"""

from __future__ import annotations

import contextlib
import functools
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis
import redis.cluster
from celery import Celery

REPO = Path(__file__).resolve().parents[2]
ADMIN_URL = os.environ.get("LONGCALL_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("LONGCALL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The RabbitMQ the broker tests use; each test gets a vhost of its own on it (``rabbitmq_vhost``).
RABBITMQ_URL = os.environ.get("LONGCALL_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

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


def require_rabbitmq() -> None:
    """A RabbitMQ that is down fails the test that needs it (never a skip)."""
    host, port = _amqp_address(RABBITMQ_URL)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        raise RuntimeError(
            f"RabbitMQ is not reachable at {host}:{port}: {exc} (scripts/ensure-services starts it)"
        ) from exc


def _amqp_address(url: str) -> tuple[str, int]:
    location = url.partition("://")[2].partition("/")[0].rpartition("@")[2]
    host, _, port = location.partition(":")
    return host or "127.0.0.1", int(port or 5672)


def rabbitmqctl(*args: str, timeout: float = 60) -> str:
    """Run ``rabbitmqctl`` against the local node (the machine's RabbitMQ); fail with its output."""
    binary = _binary("rabbitmqctl", "rabbitmq-server", "/usr/sbin/rabbitmqctl")
    done = subprocess.run([binary, *args], capture_output=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"rabbitmqctl {' '.join(args)} failed ({done.returncode}): "
            f"{done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}"
        )
    return done.stdout.decode(errors="replace")


@contextlib.contextmanager
def rabbitmq_vhost() -> Iterator[tuple[str, str]]:
    """A fresh vhost on the test RabbitMQ, for one test's queues; deleted (with its queues) afterwards.
    Yields (vhost, broker URL)."""
    require_rabbitmq()
    vhost = f"lctest-{uuid.uuid4().hex[:10]}"
    user = RABBITMQ_URL.partition("://")[2].partition("@")[0].partition(":")[0] or "guest"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        scheme, _, rest = RABBITMQ_URL.partition("://")
        yield vhost, f"{scheme}://{rest.partition('/')[0]}/{vhost}"
    finally:
        rabbitmqctl("delete_vhost", vhost)


def rabbitmq_messages(vhost: str) -> dict[str, int]:
    """Messages per queue of ``vhost``: ready plus delivered and not yet acknowledged (in a worker's hand)."""
    out = rabbitmqctl("list_queues", "-q", "--no-table-headers", "-p", vhost, "name", "messages")
    return {name: int(count) for name, count in (line.split("\t") for line in out.splitlines() if line)}


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
        stop_all([self], timeout=timeout)

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


def stop_all(processes: Sequence[CeleryProcess], timeout: float = 20.0) -> None:
    """Stop every process at once: SIGTERM to all, then wait for each within one shared ``timeout``, and
    kill -9 (with its pool children) whichever is still running then. A fleet's processes shut down side by
    side, not one after another (each warm shutdown takes a second or more)."""
    for process in processes:
        if process.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


def release_app(app: Celery) -> None:
    """Close the connections a Celery app owns in this process: its result backend's Redis (the pub/sub an
    ``AsyncResult.get`` subscribes on included) or its ``rpc://`` consumer's broker connection. Left to the
    garbage collector with the app, their sockets are reported unclosed (a ResourceWarning, an error here)
    in whichever later test it runs. (Its broker connections and producers are kombu's, in pools shared by
    every app of the same URL in the process, which keep them: those are not the app's to close.) The app
    stays usable: a later wait connects again."""
    backend = getattr(app, "_backend", None)
    consumer: Any = getattr(backend, "result_consumer", None)
    # The Redis backend's consumer waits on a pub/sub, the rpc:// one on a broker connection of its own.
    if getattr(consumer, "_pubsub", None) is not None:
        consumer.stop()
        consumer._pubsub = None  # a later wait subscribes anew (Celery's consumer starts when it has none)
    if getattr(consumer, "_connection", None) is not None:
        with contextlib.suppress(Exception):  # its broker may be gone with the test: closed all the same
            consumer._consumer.cancel()
        consumer._connection.close()
        consumer._connection = consumer._consumer = None
    pool = getattr(getattr(backend, "__dict__", {}).get("client"), "connection_pool", None)
    if pool is not None:
        pool.disconnect()


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
        stop_all(processes)


# ------------------------------------------------------------------ private Redis and Postgres instances
# For tests that restart a service mid-run: each test starts its own on a free port, in a directory of its
# own, so the shared services on 6379 and 5432 stay up. A missing binary fails the test, naming its package.


def _binary(name: str, package: str, *candidates: str) -> str:
    for path in (shutil.which(name), *candidates):
        if path and os.access(path, os.X_OK):
            return path
    raise RuntimeError(f"{name} is not installed: this test needs it (Debian package {package})")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PrivateRedis:
    """A ``redis-server`` of this test's own, started with ``flags`` (e.g. the compose file's command)."""

    flags: tuple[str, ...]
    data_dir: Path
    log_dir: Path
    port: int = field(default_factory=free_port)
    process: CeleryProcess | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = _binary("redis-server", "redis-server", "/usr/bin/redis-server")
        self.starts += 1
        where = ("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir))
        self.process = start_celery_like(
            [binary, *self.flags, *where],
            env={},
            log_dir=self.log_dir,
            name=f"redis-{self.port}-{self.starts}",
            ready_marker="Ready to accept connections",
        )

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the server with ``sig`` (SIGKILL: a crash, nothing flushed at exit; SIGTERM: a shutdown)."""
        if self.process is not None and self.process.proc.poll() is None:
            self.process.proc.send_signal(sig)
            self.process.proc.wait(timeout=30)
        self.process = None

    def restart(self, sig: signal.Signals = signal.SIGKILL) -> None:
        self.stop(sig)
        self.start()


@contextlib.contextmanager
def private_redis(data_dir: Path, log_dir: Path, *flags: str) -> Iterator[PrivateRedis]:
    data_dir.mkdir(parents=True, exist_ok=True)
    server = PrivateRedis(tuple(flags), data_dir, log_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop(signal.SIGKILL)


@dataclass
class PrivateRedisCluster:
    """A Redis Cluster of this test's own: ``nodes`` primaries (no replicas) on free loopback ports, each a
    :class:`PrivateRedis` in cluster mode, the slots spread over them by ``redis-cli --cluster create``."""

    nodes: list[PrivateRedis]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """One node's URL: a cluster client finds the others from it."""
        return self.nodes[0].url

    def client(self) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=5)


def _cluster_ok(port: int) -> bool:
    node = redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        info = node.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]  # parsed into a dict
        return bool(info.get("cluster_state") == "ok")
    except redis.RedisError:
        return False
    finally:
        node.close()


@contextlib.contextmanager
def private_redis_cluster(data_dir: Path, log_dir: Path, nodes: int = 3) -> Iterator[PrivateRedisCluster]:
    """Start ``nodes`` redis-servers in cluster mode (nothing kept on disk), join them into one cluster
    with every slot assigned, and wait (bounded) until each node says ``cluster_state:ok``. Every server is
    stopped (by its pid) on the way out."""
    started: list[PrivateRedis] = []
    try:
        for _ in range(nodes):
            port = free_port()
            node_dir = data_dir / f"node-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            # The cluster bus on a free port of its own (the default, port + 10000, may be taken or past
            # 65535).
            bus = ("--cluster-port", str(free_port()))
            flags = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf", *bus)
            node = PrivateRedis((*flags, "--appendonly", "no", "--save", ""), node_dir, log_dir, port=port)
            started.append(node)
            node.start()
        cli = _binary("redis-cli", "redis-tools", "/usr/bin/redis-cli")
        addresses = [f"127.0.0.1:{node.port}" for node in started]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for node in started:
            wait_for(f"cluster_state:ok on node {node.port}", functools.partial(_cluster_ok, node.port))
        yield PrivateRedisCluster(started)
    finally:
        for node in started:
            node.stop(signal.SIGKILL)


#: Postgres refuses to run as root: as root, initdb and pg_ctl run as this (unprivileged) user.
POSTGRES_OS_USER = os.environ.get("LONGCALL_TEST_POSTGRES_OS_USER", "postgres")


@dataclass
class PrivatePostgres:
    """A Postgres cluster of this test's own (``initdb`` + ``pg_ctl``), trust auth on 127.0.0.1 only."""

    root: Path
    log_dir: Path
    port: int = field(default_factory=free_port)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = 120) -> None:
        prefix: list[str] = []
        if os.geteuid() == 0:
            prefix = [_binary("runuser", "util-linux", "/usr/sbin/runuser"), "-u", POSTGRES_OS_USER, "--"]
        done = subprocess.run(
            [*prefix, *argv], capture_output=True, timeout=timeout, check=False, cwd=self.root
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:2])} failed ({done.returncode}):\n"
                f"{done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}"
                f"{self.log()[-4000:]}"
            )

    def _pg_ctl(self, *args: str) -> None:
        pg_ctl = _binary("pg_ctl", "postgresql", "/usr/local/bin/pg_ctl", "/usr/lib/postgresql/15/bin/pg_ctl")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(pg_ctl, "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-o", options, *args)

    def init(self) -> None:
        initdb = _binary("initdb", "postgresql", "/usr/local/bin/initdb", "/usr/lib/postgresql/15/bin/initdb")
        self._run(initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        self._pg_ctl("-w", "-t", "60", "start")

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m <mode>``: every client connection is dropped, the data is kept."""
        self._pg_ctl("-w", "-t", "60", "-m", mode, "restart")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._pg_ctl("-w", "-t", "60", "-m", "immediate", "stop")

    def log(self) -> str:
        path = self.root / "postgres.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"'.encode())
        return self.url(name)


@contextlib.contextmanager
def private_postgres(log_dir: Path) -> Iterator[PrivatePostgres]:
    # Not under pytest's tmp_path: the unprivileged user must be able to reach the directory.
    root = Path(tempfile.mkdtemp(prefix="lc-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, user=POSTGRES_OS_USER)
    server = PrivatePostgres(root, log_dir)
    try:
        server.init()
        server.start()
        yield server
    finally:
        try:
            server.stop()
        finally:
            (log_dir / f"postgres-{server.port}.log").write_text(server.log())
            shutil.rmtree(root, ignore_errors=True)


@dataclass
class PrivateRabbitMQ:
    """A RabbitMQ node of this test's own (its own node name, ports, data and config), so a test may put it
    in an alarm or stop it while the shared node on 5672 stays up."""

    root: Path
    port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)

    @property
    def node(self) -> str:
        return f"lctest{self.port}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def ctl(self, *args: str, timeout: float = 60) -> str:
        return rabbitmqctl("-n", self.node, *args, timeout=timeout)

    def start(self) -> None:
        (self.root / "rabbitmq.conf").write_text(f"listeners.tcp.local = 127.0.0.1:{self.port}\n")
        (self.root / "enabled_plugins").write_text("[].\n")
        if os.geteuid() == 0:  # the server drops to the rabbitmq user: it must own its files
            for path in (self.root, *self.root.iterdir()):
                shutil.chown(path, user="rabbitmq")
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.root / "pid"),
        }
        server = _binary("rabbitmq-server", "rabbitmq-server", "/usr/sbin/rabbitmq-server")
        subprocess.run([server, "-detached"], env=env, cwd=self.root, timeout=60, check=True)

        def started() -> bool:
            # Until the node has registered, rabbitmqctl cannot reach it at all (and says so at once).
            try:
                self.ctl("await_startup", "--timeout", "5", timeout=30)
            except RuntimeError:
                return False
            return True

        wait_for(f"RabbitMQ node {self.node} to start", started, timeout=120, interval=1)

    def kill(self) -> None:
        """kill -9 the node (a crash: nothing flushed or closed at exit); ``start`` brings it back on the
        same data."""
        pid = int((self.root / "pid").read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(f"RabbitMQ node {self.node} to die", gone, timeout=30)

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.ctl("stop", timeout=60)


@contextlib.contextmanager
def private_rabbitmq() -> Iterator[PrivateRabbitMQ]:
    # Not under pytest's tmp_path: the rabbitmq user must be able to reach the directory.
    root = Path(tempfile.mkdtemp(prefix="lc-rmq-"))
    root.chmod(0o755)
    node = PrivateRabbitMQ(root)
    try:
        node.start()
        yield node
    finally:
        node.stop()
        shutil.rmtree(root, ignore_errors=True)
