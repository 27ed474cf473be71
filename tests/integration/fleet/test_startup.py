"""Unknown keys and bad values are refused when a worker or beat starts, with a message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import support

BAD = '[servers.reports]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\nurl = "http://127.0.0.1:9/mcp"\n'


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("poll_qsp = 3\n", "servers.reports.poll_qsp: unknown key"),
        ("poll_qps = -1\n", "servers.reports.poll_qps"),
    ],
)
@pytest.mark.parametrize("program", ["worker", "beat"])
def test_a_bad_config_stops_the_process_at_start(
    tmp_path: Path, broker_prefix: str, program: str, extra: str, message: str
) -> None:
    config = tmp_path / "longcall.toml"
    config.write_text(BAD + extra)
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", program]
    argv += ["-Q", "longcall.control"] if program == "worker" else ["-s", str(tmp_path / "schedule")]
    done = subprocess.run(
        argv,
        cwd=support.REPO,
        env=support.celery_env({"LONGCALL_CONFIG": str(config), "LONGCALL_BROKER_KEYPREFIX": broker_prefix}),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert message in (done.stdout + done.stderr).decode()


@pytest.mark.parametrize("program", ["worker", "beat"])
def test_a_redis_cluster_without_a_broker_stops_the_process_at_start(
    tmp_path: Path, broker_prefix: str, program: str
) -> None:
    """LONGCALL_REDIS_CLUSTER without LONGCALL_BROKER_URL: Celery reads its configuration before any start
    signal, so the refusal comes from there, one line naming the variable, no traceback."""
    argv = [sys.executable, "-m", "celery", "-A", "workers.app", program]
    argv += ["-Q", "longcall.control"] if program == "worker" else ["-s", str(tmp_path / "schedule")]
    done = subprocess.run(
        argv,
        cwd=support.REPO,
        env=support.celery_env(
            {
                "LONGCALL_REDIS_URL": f"redis://127.0.0.1:{support.free_port()}/0",
                "LONGCALL_REDIS_CLUSTER": "true",
                "LONGCALL_BROKER_KEYPREFIX": broker_prefix,
            }
        ),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    said = (done.stdout + done.stderr).decode()
    assert said.strip() == (
        "longcall: environment: LONGCALL_BROKER_URL: Value error, required with LONGCALL_REDIS_CLUSTER on: "
        "a Redis Cluster cannot be the Celery broker nor its result backend; name a standalone Redis or a "
        "RabbitMQ"
    )
    assert "Traceback" not in said
