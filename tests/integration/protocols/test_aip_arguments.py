"""AIP-151 arguments that do not fit the tool's create route are refused by ``longcall.submit`` itself: a
clear error naming the placeholder and the route, no ledger row, nothing sent (before, they became a failed
receipt). Real fleet: workers, broker, ledger and the demo AIP-151 server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from tests.support.aip_fleet import AIP_CREATE, AIP_SERVER, AIP_TOOL, AipFleet, args, running_aip_fleet
from tests.support.fleet import FleetParts


@pytest.fixture
def aip_fleet(fleet_parts: FleetParts) -> Iterator[AipFleet]:
    with running_aip_fleet(fleet_parts) as running:
        yield running


def submit(aip_fleet: AipFleet, call_node_id: str, arguments: dict[str, Any]) -> Any:
    return aip_fleet.fleet.send(
        "longcall.submit", call_node_id=call_node_id, server=AIP_SERVER, tool=AIP_TOOL, arguments=arguments
    )


def test_arguments_missing_a_placeholder_or_leaving_the_path_are_refused_at_submit(
    aip_fleet: AipFleet,
) -> None:
    missing = {k: v for k, v in args().items() if k != "project"}
    cases = [
        (missing, "needs the argument(s) project (its path placeholders)"),
        (args(project="../admin"), "project='../admin' would change the path"),
        (args(project=""), "project must not be empty"),
    ]
    for i, (arguments, message) in enumerate(cases):
        with pytest.raises(Exception) as refused:  # noqa: PT011 - the class is rebuilt by Celery; name checked below
            submit(aip_fleet, f"n/aip-bad-{i}", arguments)
        assert type(refused.value).__name__ == "SubmissionRefused"
        assert message in str(refused.value)
        assert AIP_CREATE in str(refused.value)
    with aip_fleet.fleet.ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM tool_operation")).scalar_one() == 0
    assert aip_fleet.requests("RunReport") == []
    # Arguments that fit are taken as before.
    aip_fleet.submit("n/aip-good", args(0))
    assert aip_fleet.fleet.wait_receipt("n/aip-good")["terminal_state"] == "completed"
