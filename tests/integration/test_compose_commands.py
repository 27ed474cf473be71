"""docker-compose.yml is for users; there is no Docker engine here, so run each of its commands as it is
written (with this test's database, Redis and a free port) and check that each one does its job."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import create_engine, inspect

from demo_server.command import command as demo_server_command
from ledger.engine import normalize_database_url
from tests import support

COMPOSE = yaml.safe_load((support.REPO / "docker-compose.yml").read_text())
BIN = Path(sys.executable).parent


def _command(service: str, port: int | None = None) -> list[str]:
    argv: list[str] = list(COMPOSE["services"][service]["command"])
    # The image's PATH has the installed console scripts; here they are in this interpreter's venv.
    executable = sys.executable if argv[0] == "python" else str(BIN / argv[0])
    argv = [executable, *argv[1:]]
    if port is not None:
        argv = [
            a.replace("5555", str(port)).replace("8765", str(port)).replace("0.0.0.0", "127.0.0.1")  # noqa: S104
            for a in argv
        ]
    return argv


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def env(empty_database_url: str, broker_prefix: str, tmp_path: Path) -> dict[str, str]:
    config = tmp_path / "longcall.toml"
    config.write_text(
        (support.REPO / "examples" / "compose.toml").read_text().replace("demo-mcp", "127.0.0.1")
    )
    return {
        "LONGCALL_DATABASE_URL": empty_database_url,
        "LONGCALL_REDIS_URL": support.REDIS_URL,
        "LONGCALL_BROKER_KEYPREFIX": broker_prefix,
        "LONGCALL_CONFIG": str(config),
    }


def test_the_compose_file_names_every_service_and_the_design_queues() -> None:
    assert {"postgres", "redis", "migrate", "worker", "beat", "flower", "demo-mcp"} <= set(
        COMPOSE["services"]
    )
    worker = COMPOSE["services"]["worker"]["command"]
    assert worker[:3] == ["celery", "-A", "workers.app"]
    assert worker[worker.index("-Q") + 1] == "longcall.control,longcall.poll,longcall.outbox"
    # The compose file writes the demo server's command line as text; it is the one the tests start.
    assert COMPOSE["services"]["demo-mcp"]["command"] == demo_server_command(
        8765,
        host="0.0.0.0",  # noqa: S104 - inside its container, for the other services
        python="python",
    )
    dockerfile = (support.REPO / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (support.REPO / source).exists(), f"Dockerfile copies missing {source}"


def test_compose_commands_run(env: dict[str, str], log_dir: Path, tmp_path: Path) -> None:
    migrate = support.start_celery_like(_command("migrate"), env=env, log_dir=log_dir, name="migrate")
    assert migrate.proc.wait(timeout=60) == 0, migrate.log()
    engine = create_engine(normalize_database_url(env["LONGCALL_DATABASE_URL"]))
    assert "tool_operation" in inspect(engine).get_table_names()
    engine.dispose()

    flower_port, mcp_port = _free_port(), _free_port()
    schedule = "/tmp/celerybeat-schedule"  # noqa: S108 - the path inside the image, replaced here
    beat_cmd = [a.replace(schedule, str(tmp_path / "beat")) for a in _command("beat")]
    processes: list[Any] = []
    with support.running(processes):
        processes.append(
            support.start_celery_like(
                _command("worker"), env=env, log_dir=log_dir, name="worker", ready_marker=" ready."
            )
        )
        processes.append(
            support.start_celery_like(
                beat_cmd, env=env, log_dir=log_dir, name="beat", ready_marker="beat: Starting"
            )
        )
        processes.append(
            support.start_celery_like(
                _command("flower", flower_port), env=env, log_dir=log_dir, name="flower"
            )
        )
        processes.append(
            support.start_celery_like(
                _command("demo-mcp", mcp_port), env={}, log_dir=log_dir, name="demo-mcp"
            )
        )

        def answers(url: str) -> bool:
            try:
                return httpx.get(url, timeout=1).status_code < 500
            except httpx.HTTPError:
                return False

        support.wait_for("flower to serve its dashboard", lambda: answers(f"http://127.0.0.1:{flower_port}/"))
        support.wait_for(
            "the demo MCP server to answer", lambda: answers(f"http://127.0.0.1:{mcp_port}/_control/faults")
        )
