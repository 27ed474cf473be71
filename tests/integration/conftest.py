from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from ledger.repository import Ledger
from tests import support
from tests.support.fleet import (
    BROKERS,
    Fleet,
    FleetParts,
    McpServer,
    fleet_config,
    in_process_executor,
    running_fleet,
    start_mcp_server,
)
from workers.executor import Executor
from workers.runtime import Runtime
from workers.settings import Settings


@pytest.fixture
def broker() -> str:
    """The fleet's broker: Redis, unless the test is parametrized over ``broker`` (``@pytest.mark.parametrize(
    "broker", BROKERS)``, ``BROKERS`` from tests.support.fleet): then its fleet runs on each."""
    return "redis"


@pytest.fixture
def fleet_parts(
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    log_dir: Path,
    broker: str,
) -> Iterator[FleetParts]:
    """What ``running_fleet`` needs, for a test that starts its fleet with options of its own. On RabbitMQ
    the fleet's queues (longcall's and the pipeline's) live in a vhost of this test's own, deleted after;
    a RabbitMQ that is down fails the test."""
    if broker == "redis":
        yield FleetParts(ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir)
        return
    assert broker == "rabbitmq", f"unknown broker {broker!r} (one of {BROKERS})"
    with support.rabbitmq_vhost() as (vhost, url):
        yield FleetParts(
            ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir, broker_url=url, vhost=vhost
        )


@pytest.fixture
def fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    """longcall's MCP server, two longcall workers, beat and a pipeline worker, on this test's database."""
    with running_fleet(fleet_parts) as fleet:
        yield fleet


@pytest.fixture
def runtimes(database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path) -> Iterator[Any]:
    """A running MCP server and a factory of in-process runtimes (each one a 'worker': its own pools)."""
    mcp = start_mcp_server(log_dir, poll_interval_ms=200)
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url))
    settings = Settings(
        database_url=database_url,
        redis_url=support.REDIS_URL,
        broker_keyprefix=broker_prefix,
        config=config,
        lease_s=30,
    )
    made: list[Runtime] = []

    def make() -> Runtime:
        made.append(Runtime.from_settings(settings))
        return made[-1]

    try:
        yield mcp, make
    finally:
        for runtime in made:
            runtime.close()
        mcp.process.stop()


@pytest.fixture
def mcp_executor(
    database_url: str, broker_prefix: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, Executor]]:
    """longcall's MCP server (tasks poll every 200 ms) and an executor in this process driving one step at a
    time: budgets far above what a test sends, a 30 s lease."""
    with in_process_executor(database_url, broker_prefix, tmp_path, log_dir) as made:
        yield made


@pytest.fixture
def private_redis_executor(
    database_url: str, tmp_path: Path, log_dir: Path
) -> Iterator[tuple[McpServer, Executor, support.PrivateRedis]]:
    """longcall's MCP server and an executor in this process whose hot state (buckets, holds, the cancel CAS)
    is on a ``redis-server`` of this test's own, which the test may stop and start."""
    mcp = start_mcp_server(log_dir, poll_interval_ms=200)
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url, poll_qps=5000, control_qps=5000))
    with support.private_redis(tmp_path / "redis", log_dir, "--save", "", "--appendonly", "no") as hot:
        runtime = Runtime.from_settings(
            Settings(database_url=database_url, redis_url=hot.url, config=config, lease_s=30)
        )
        try:
            yield mcp, Executor(runtime), hot
        finally:
            runtime.close()
            mcp.process.stop()
