from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ledger.repository import Ledger
from tests.integration.fleet import Fleet, running_fleet


@pytest.fixture
def fleet(
    ledger: Ledger,
    database_url: str,
    broker_prefix: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    log_dir: Path,
) -> Iterator[Fleet]:
    """longcall's MCP server, two longcall workers, beat and a pipeline worker, on this test's database."""
    with running_fleet(ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir) as fleet:
        yield fleet
