from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ledger.repository import Ledger
from tests.integration.fleet import Fleet, FleetParts, running_fleet


@pytest.fixture
def fleet_parts(
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    log_dir: Path,
) -> FleetParts:
    """What ``running_fleet`` needs, for a test that starts its fleet with options of its own."""
    return FleetParts(ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir)


@pytest.fixture
def fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    """longcall's MCP server, two longcall workers, beat and a pipeline worker, on this test's database."""
    with running_fleet(fleet_parts) as fleet:
        yield fleet
