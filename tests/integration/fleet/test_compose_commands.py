"""docker-compose.yml is for users; there is no Docker engine here, so run each of its commands as it is
written (with this test's database, Redis and free ports) and check that each one does its job. A command
added to the file that no test runs fails ``test_compose_commands_run``."""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from sqlalchemy import create_engine, inspect

from demo_server.command import command as demo_server_command
from ledger.engine import normalize_database_url
from tests import support

COMPOSE = yaml.safe_load((support.REPO / "docker-compose.yml").read_text())
RABBITMQ_OVERRIDE = yaml.safe_load((support.REPO / "docker-compose.rabbitmq.yml").read_text())
BIN = Path(sys.executable).parent
#: Commands of the compose file another test runs, and which: the Redis server with the file's flags.
RUN_ELSEWHERE = {"redis": "tests/integration/faults/test_faults_durability.py (compose_redis_flags)"}
#: The ports the compose file's commands listen on inside their containers; replaced by free ones here.
PORTS = {"flower": "5555", "metrics": "9808", "demo-mcp": "8765"}
#: ${NAME}, ${NAME:-default}, ${NAME:?error}: compose's interpolation, the forms these files use.
VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<kind>[-?])(?P<arg>[^}]*))?\}")


class MissingVariable(Exception):
    pass


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """What docker compose makes of a value from the file, given the user's environment."""

    def one(match: re.Match[str]) -> str:
        name, kind, arg = match["name"], match["kind"], match["arg"]
        if env.get(name):
            return env[name]
        if kind == "?":
            raise MissingVariable(f"required variable {name} is missing a value: {arg}")
        return arg if kind == "-" else env.get(name, "")

    return VARIABLE.sub(one, value)


def _command(service: str, port: int | None = None) -> list[str]:
    argv: list[str] = list(COMPOSE["services"][service]["command"])
    # The image's PATH has the installed console scripts; here they are in this interpreter's venv.
    executable = sys.executable if argv[0] == "python" else str(BIN / argv[0])
    argv = [executable, *argv[1:]]
    if port is not None:
        inside = PORTS[service]
        argv = [a.replace(inside, str(port)).replace("0.0.0.0", "127.0.0.1") for a in argv]  # noqa: S104
    return argv


def _service_env(service: str, user_env: Mapping[str, str]) -> dict[str, str]:
    """The service's own environment from the file (not the shared LONGCALL_* block: the test's own
    database, Redis and config replace those), interpolated from ``user_env``."""
    environment: dict[str, Any] = COMPOSE["services"][service].get("environment") or {}
    return {
        key: interpolate(str(value), user_env)
        for key, value in environment.items()
        if not key.startswith("LONGCALL_")
    }


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
    assert {"postgres", "redis", "migrate", "worker", "beat", "flower", "metrics", "demo-mcp"} <= set(
        COMPOSE["services"]
    )
    worker = COMPOSE["services"]["worker"]["command"]
    assert worker[:3] == ["celery", "-A", "workers.app"]
    assert worker[worker.index("-Q") + 1] == "longcall.control,longcall.poll,longcall.outbox"
    assert COMPOSE["services"]["metrics"]["command"] == [
        "longcall",
        "metrics",
        "--host",
        "0.0.0.0",  # noqa: S104 - inside its container, for Prometheus
        "--port",
        "9808",
    ]
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


def test_workers_scale_and_beat_is_one() -> None:
    """``docker compose up --scale worker=4`` needs a worker without a fixed container name, host name or
    host port (four containers cannot share one); beat runs once."""
    worker = COMPOSE["services"]["worker"]
    assert {"container_name", "hostname", "ports"}.isdisjoint(worker)
    assert "replicas" not in worker.get("deploy", {})
    assert COMPOSE["services"]["beat"]["deploy"] == {"replicas": 1}
    for name, service in COMPOSE["services"].items():
        assert "container_name" not in service, f"{name}: a fixed container name clashes between projects"


def test_flower_needs_basic_auth_from_the_environment_and_the_file_holds_no_password() -> None:
    flower = COMPOSE["services"]["flower"]
    assert not any("basic-auth" in arg or "basic_auth" in arg for arg in flower["command"])
    declared = flower["environment"]["FLOWER_BASIC_AUTH"]
    required = VARIABLE.fullmatch(declared)
    assert required is not None, declared
    assert (required["name"], required["kind"]) == ("FLOWER_BASIC_AUTH", "?"), declared
    with pytest.raises(MissingVariable, match="FLOWER_BASIC_AUTH"):
        _service_env("flower", {})
    assert _service_env("flower", {"FLOWER_BASIC_AUTH": "ops:s3cret"}) == {"FLOWER_BASIC_AUTH": "ops:s3cret"}
    # The shared LONGCALL_* block still reaches Flower (the YAML merge key): it must see the fleet's broker.
    assert set(COMPOSE["x-longcall-env"]) <= set(flower["environment"])


def test_the_rabbitmq_override_names_compose_services_and_takes_its_password_from_the_environment() -> None:
    services = RABBITMQ_OVERRIDE["services"]
    assert set(services) - {"rabbitmq"} <= set(COMPOSE["services"])
    # Every process that talks to the broker is switched; the ledger-only migrate and the demo server not.
    assert {"worker", "beat", "flower", "metrics"} <= set(services)
    url = services["worker"]["environment"]["LONGCALL_BROKER_URL"]
    with pytest.raises(MissingVariable, match="RABBITMQ_PASSWORD"):
        interpolate(url, {})
    assert interpolate(url, {"RABBITMQ_PASSWORD": "pw"}) == "amqp://longcall:pw@rabbitmq:5672/longcall"
    rabbit = services["rabbitmq"]["environment"]
    assert rabbit["RABBITMQ_DEFAULT_PASS"].startswith("${RABBITMQ_PASSWORD:?")
    assert (rabbit["RABBITMQ_DEFAULT_USER"], rabbit["RABBITMQ_DEFAULT_VHOST"]) == ("longcall", "longcall")
    # The node keeps its data under its host name: fixed, so a new container finds the volume's queues.
    assert services["rabbitmq"]["hostname"] == "rabbitmq"


def _answers(url: str, **options: Any) -> int | None:
    try:
        return httpx2.get(url, timeout=2, **options).status_code
    except httpx2.HTTPError:
        return None


def test_compose_commands_run(env: dict[str, str], log_dir: Path, tmp_path: Path) -> None:
    ran: set[str] = set()
    migrate = support.start_celery_like(_command("migrate"), env=env, log_dir=log_dir, name="migrate")
    assert migrate.proc.wait(timeout=60) == 0, migrate.log()
    ran.add("migrate")
    engine = create_engine(normalize_database_url(env["LONGCALL_DATABASE_URL"]))
    assert "tool_operation" in inspect(engine).get_table_names()
    engine.dispose()

    ports = {service: _free_port() for service in PORTS}
    schedule = "/tmp/celerybeat-schedule"  # noqa: S108 - the path inside the image, replaced here
    beat_cmd = [a.replace(schedule, str(tmp_path / "beat")) for a in _command("beat")]
    user, password = "ops", "compose-test-password"
    flower_env = env | _service_env("flower", {"FLOWER_BASIC_AUTH": f"{user}:{password}"})
    processes: list[support.CeleryProcess] = []
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
        ran |= {"worker", "beat"}
        processes.append(
            support.start_celery_like(
                _command("flower", ports["flower"]), env=flower_env, log_dir=log_dir, name="flower"
            )
        )
        processes.append(
            support.start_celery_like(
                _command("metrics", ports["metrics"]), env=env, log_dir=log_dir, name="metrics"
            )
        )
        processes.append(
            support.start_celery_like(
                _command("demo-mcp", ports["demo-mcp"]), env={}, log_dir=log_dir, name="demo-mcp"
            )
        )

        flower = f"http://127.0.0.1:{ports['flower']}/"
        support.wait_for("flower to answer", lambda: _answers(flower))
        assert _answers(flower) == 401, "Flower served its dashboard without basic auth"
        assert _answers(flower, auth=(user, "wrong")) == 401
        assert _answers(flower, auth=(user, password)) == 200
        ran.add("flower")

        metrics = f"http://127.0.0.1:{ports['metrics']}/metrics"
        support.wait_for("the metrics server to answer", lambda: _answers(metrics) == 200)
        scraped = httpx2.get(metrics, timeout=10).text
        assert "# TYPE longcall_" in scraped, scraped[:2000]
        ran.add("metrics")

        support.wait_for(
            "the demo MCP server to answer",
            lambda: _answers(f"http://127.0.0.1:{ports['demo-mcp']}/_control/faults") == 200,
        )
        ran.add("demo-mcp")
        for process in processes:
            assert process.proc.poll() is None, f"{process.name} exited:\n{process.log()[-3000:]}"

    with_command = {name for name, service in COMPOSE["services"].items() if "command" in service}
    assert ran == with_command - set(RUN_ELSEWHERE), "a compose command that no test runs"
    durability = (support.REPO / "tests" / "integration" / "faults" / "test_faults_durability.py").read_text()
    assert 'COMPOSE["services"]["redis"]["command"]' in durability
