"""A worker process's ledger pool follows the poll batch, within what one Postgres can serve a fleet."""

from __future__ import annotations

import pytest

from workers.runtime import MAX_LEDGER_POOL, ledger_pool_size
from workers.settings import Settings


@pytest.mark.parametrize(("poll_batch", "expected"), [(1, 5), (3, 5), (6, 8), (8, 10), (32, 10), (500, 10)])
def test_the_pool_grows_with_the_batch_and_stops_at_its_bound(poll_batch: int, expected: int) -> None:
    settings = Settings(
        database_url="postgresql://127.0.0.1/none", redis_url="redis://127.0.0.1:1/0", poll_batch=poll_batch
    )
    assert ledger_pool_size(settings) == expected
    assert ledger_pool_size(settings) <= MAX_LEDGER_POOL
