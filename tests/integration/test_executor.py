"""The terminal-state protocol end to end: longcall's MCP server, real worker processes and beat."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ledger.repository import Ledger
from ledger.states import OpState
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
    with running_fleet(ledger, database_url, broker_prefix, redis_client, tmp_path, log_dir) as fleet:
        yield fleet


def test_happy_path_completed_failed_and_synchronous(fleet: Fleet) -> None:
    done = fleet.submit("n/report", "slow_report", {"seconds": 0.5})
    failed = fleet.submit("n/failing", "slow_report", {"seconds": 0.2, "fail": True})
    sync = fleet.submit("n/lookup", "quick_lookup", {"key": "k1"})

    receipt = fleet.wait_receipt("n/report")
    assert receipt["terminal_state"] == "completed"
    assert receipt["result"]["content"][0]["text"] == "report ready after 0.5s"
    assert fleet.wait_receipt("n/failing")["terminal_state"] == "failed"
    lookup = fleet.wait_receipt("n/lookup")
    assert (lookup["terminal_state"], lookup["result"]["content"][0]["text"]) == ("completed", "value:k1")

    assert fleet.ledger.get(done).state is OpState.ACCEPTED
    assert fleet.ledger.get(failed).state is OpState.ACCEPTED
    assert fleet.ledger.get(sync).remote_id is None  # it ran as one synchronous call
    creates = [e for e in fleet.mcp.log() if e["method"] == "tools/call"]
    assert len(creates) == 3


def test_cancel_of_a_running_task(fleet: Fleet) -> None:
    op_id = fleet.submit("n/long", "slow_report", {"seconds": 60})
    fleet.wait_state(op_id, OpState.WORKING)
    fleet.send("longcall.cancel", op_id=str(op_id))
    receipt = fleet.wait_receipt("n/long")
    assert (receipt["terminal_state"], receipt["result"]) == ("cancelled", None)
    assert fleet.ledger.get(op_id).state is OpState.CANCELLED_ACCEPTED
