"""The local fleet of ``longcall dev``: the services (embedded unless the environment names real ones), the
ledger migrated, the demo MCP server, workers, beat, Flower with basic auth and the metrics endpoint."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis

from console.dev.processes import Child, Children, last_line
from console.dev.services import (
    DataDir,
    DevError,
    EmbeddedPostgres,
    free_port,
    port_free,
    port_open,
    redis_argv,
)
from demo_server.command import command as demo_server_command

QUEUES = "longcall.control,longcall.poll,longcall.outbox"
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 90.0


@dataclass
class FleetOptions:
    workers: int = 2
    concurrency: int = 2
    #: Ports asked for on the command line (``--flower-port`` ...), by part; the others are kept from the
    #: last start on the data directory when they are free, else new.
    ports: dict[str, int] = field(default_factory=dict)


#: The parts whose port a restart keeps.
PORTED = ("redis", "demo", "flower", "metrics")


class Kept:
    """The ports and the generated Flower password of a data directory (``DataDir.kept``), the same on every
    start unless asked otherwise or taken meanwhile."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError):
            loaded = {}
        self.ports: dict[str, int] = {
            k: int(v) for k, v in (loaded.get("ports") or {}).items() if k in PORTED
        }
        self.flower_password: str | None = loaded.get("flower_password")

    def port(self, part: str, asked: Mapping[str, int]) -> int:
        """``part``'s port: the one asked for (a port in use is an error), else the kept one if it is free,
        else a new one."""
        if part in asked:
            if not port_free(asked[part], HOST):
                raise DevError(f"{part} port {asked[part]} is in use")
            self.ports[part] = asked[part]
        elif part not in self.ports or not port_free(self.ports[part], HOST):
            self.ports[part] = free_port()
        return self.ports[part]

    def save(self) -> None:
        self.path.write_text(json.dumps({"ports": self.ports, "flower_password": self.flower_password}))
        self.path.chmod(0o600)


@dataclass
class LocalFleet:
    data: DataDir
    database_url: str
    redis_url: str
    broker_url: str | None
    embedded_postgres: bool
    embedded_redis: bool
    demo_url: str
    flower_url: str
    flower_user: str
    flower_password: str
    #: True when the password came from LONGCALL_FLOWER_PASSWORD (then it is not printed).
    flower_password_from_env: bool
    metrics_url: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def demo_control_url(self) -> str:
        return self.demo_url.removesuffix("/mcp") + "/_control"

    def exports(self) -> list[str]:
        """The lines a user pastes into another shell to use ``longcall submit`` on this fleet. A URL the
        user set is not repeated (it may hold a password): it is already in their environment."""
        names = ["LONGCALL_DATABASE_URL", "LONGCALL_REDIS_URL", "LONGCALL_BROKER_URL", "LONGCALL_CONFIG"]
        mine = {"LONGCALL_DATABASE_URL": self.embedded_postgres, "LONGCALL_REDIS_URL": self.embedded_redis}
        return [
            f"export {name}='{self.env[name]}'"
            if mine.get(name, name == "LONGCALL_CONFIG")
            else f"# {name}: as set in your environment"
            for name in names
            if name in self.env
        ]


def mask_password(url: str) -> str:
    """``scheme://user:***@host...``: a URL as it may be printed (a password never is)."""
    return re.sub(r"://([^:/@]*):[^@/]+@", r"://\1:***@", url)


def longcall_argv(*args: str) -> list[str]:
    """``longcall ARGS`` with the interpreter that runs this one."""
    script = Path(sys.executable).with_name("longcall")
    if os.access(script, os.X_OK):
        return [str(script), *args]
    return [sys.executable, "-c", "from console.main import main; main()", *args]


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "workers.app", *args]


def config_toml(demo_port: int) -> str:
    return f"""# Written by longcall dev: the demo MCP server it runs, as server "reports".
[servers.reports]
protocol = "mcp"
protocol_version = "2025-11-25"
url = "http://{HOST}:{demo_port}/mcp"
poll_qps = 20
control_qps = 10
default_ttl_ms = 600000
wait_budget_s = 3600

[servers.reports.tools.quick_lookup]
sync_upper_bound_s = 20
"""


def _redis_ready(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _worker_ready(worker: Child) -> bool:
    return " ready." in worker.tail(200_000)


def _migrate(data: DataDir, env: Mapping[str, str]) -> None:
    log = data.logs / "migrate.log"
    with log.open("ab") as handle:
        try:
            done = subprocess.run(  # noqa: S603 (a fixed argv)
                longcall_argv("migrate"),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=STARTUP_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DevError(
                f"longcall migrate did not finish in {STARTUP_TIMEOUT_S:.0f}s (log {log})"
            ) from None
    if done.returncode != 0:
        raise DevError(f"longcall migrate failed (log {log}): {last_line(log.read_text(errors='replace'))}")


def start_fleet(
    data: DataDir, children: Children, postgres: EmbeddedPostgres, options: FleetOptions
) -> LocalFleet:
    """Start everything, each part checked before the next needs it; a failure is a one-line DevError."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"

    database_url = env.get("LONGCALL_DATABASE_URL")
    embedded_postgres = not database_url
    if not database_url:
        database_url = postgres.start()
        if postgres.pid is not None:
            children.note("postgres", postgres.pid)
    env["LONGCALL_DATABASE_URL"] = database_url
    kept = Kept(data.kept)

    redis_url = env.get("LONGCALL_REDIS_URL")
    embedded_redis = not redis_url
    if not redis_url:
        port = kept.port("redis", options.ports)
        redis_url = f"redis://{HOST}:{port}/0"
        child = children.start("redis", redis_argv(data.redis, port), env, service=True)
        children.wait_ready(child, "answering PING", lambda: _redis_ready(redis_url), STARTUP_TIMEOUT_S)
    env["LONGCALL_REDIS_URL"] = redis_url

    demo_port = kept.port("demo", options.ports)
    data.config.write_text(config_toml(demo_port))
    env["LONGCALL_CONFIG"] = str(data.config)

    _migrate(data, env)

    demo = children.start("demo-server", demo_server_command(demo_port, poll_interval_ms=500), env)
    waits: list[tuple[Child, str, int]] = [(demo, "listening", demo_port)]
    workers = [
        children.start(
            f"worker{n}",
            celery_argv(
                "worker",
                "-Q",
                QUEUES,
                "-c",
                str(options.concurrency),
                "-n",
                f"dev{n}@%h",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
            ),
            env,
        )
        for n in range(1, options.workers + 1)
    ]
    children.start("beat", celery_argv("beat", "-s", str(data.beat_schedule), "--loglevel", "WARNING"), env)

    flower_user = env.get("LONGCALL_FLOWER_USER") or "longcall"
    if not kept.flower_password:
        kept.flower_password = secrets.token_urlsafe(12)
    flower_password = env.get("LONGCALL_FLOWER_PASSWORD") or kept.flower_password
    flower_port = kept.port("flower", options.ports)
    # The credentials go to Flower in its environment (FLOWER_BASIC_AUTH), not on a command line `ps` shows.
    flower_env = {**env, "FLOWER_BASIC_AUTH": f"{flower_user}:{flower_password}"}
    flower = children.start(
        "flower", celery_argv("flower", f"--address={HOST}", f"--port={flower_port}"), flower_env
    )
    waits.append((flower, "listening", flower_port))

    metrics_port = kept.port("metrics", options.ports)
    kept.save()
    metrics = children.start(
        "metrics", longcall_argv("metrics", "--host", HOST, "--port", str(metrics_port)), env
    )
    waits.append((metrics, "listening", metrics_port))
    metrics_url = f"http://{HOST}:{metrics_port}/metrics"

    for child, what, port in waits:
        children.wait_ready(
            child, f"{what} on {HOST}:{port}", partial(port_open, HOST, port), STARTUP_TIMEOUT_S
        )
    for worker in workers:
        children.wait_ready(worker, "ready", partial(_worker_ready, worker), STARTUP_TIMEOUT_S)
    if exited := children.exited():
        first = exited[0]
        raise DevError(f"{first.name} exited (log {first.log}): {last_line(first.tail())}")

    return LocalFleet(
        data=data,
        database_url=database_url,
        redis_url=redis_url,
        broker_url=env.get("LONGCALL_BROKER_URL"),
        embedded_postgres=embedded_postgres,
        embedded_redis=embedded_redis,
        demo_url=f"http://{HOST}:{demo_port}/mcp",
        flower_url=f"http://{HOST}:{flower_port}/",
        flower_user=flower_user,
        flower_password=flower_password,
        flower_password_from_env=bool(env.get("LONGCALL_FLOWER_PASSWORD")),
        metrics_url=metrics_url,
        env={k: v for k, v in env.items() if k.startswith("LONGCALL_") and "PASSWORD" not in k},
    )
