"""A resubmission made at once by the step that proved "never created" keeps that step's claim (found by CI
on two xdist workers: the resubmission let the row go, due at once, while its step went on to the create,
so a dispatch tick in between claimed it too; two steps of one operation ran at once, five creates were
sent instead of three and the first step's answer was refused as stale).

Real Postgres and Redis, longcall's AIP-151 server (its parent-gone fault proves "never created"), an
in-process executor, and a second executor's dispatch tick run inside the window.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters.aip151.adapter import AipOperationsAdapter
from ledger.states import OpState
from tests import support
from tests.support.aip_fleet import AIP_SERVER, AIP_TOOL, aip_config, args
from tests.support.aip_server import AipServer, start_aip_server
from tests.support.fleet import McpServer, fleet_config, start_mcp_server
from workers.executor import Dispatch, Executor
from workers.runtime import Runtime
from workers.settings import Settings
from workers.submission import validate_submission


@pytest.fixture
def servers(log_dir: Path) -> Iterator[tuple[AipServer, McpServer]]:
    aip = start_aip_server(log_dir)
    mcp = start_mcp_server(log_dir)
    try:
        yield aip, mcp
    finally:
        mcp.process.stop()
        aip.stop()


def test_a_resubmission_keeps_its_steps_claim_until_the_create_is_made(
    servers: tuple[AipServer, McpServer],
    database_url: str,
    broker_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    aip, mcp = servers
    config = tmp_path / "longcall.toml"
    config.write_text(fleet_config(mcp.url) + aip_config(aip.root))
    settings = Settings(
        database_url=database_url, redis_url=support.REDIS_URL, broker_keyprefix=broker_prefix, config=config
    )
    step_runtime, tick_runtime = Runtime.from_settings(settings), Runtime.from_settings(settings)
    try:
        executor, ticker = Executor(step_runtime), Executor(tick_runtime)
        claimed_by_ticks: list[Dispatch] = []
        capabilities = AipOperationsAdapter.capabilities

        def tick_then_capabilities(self: AipOperationsAdapter, tool: str, **kwargs: Any) -> Any:
            # A dispatch tick on another worker, just before this step's create: it must find nothing.
            claimed_by_ticks.extend(ticker.dispatch_due())
            return capabilities(self, tool, **kwargs)

        monkeypatch.setattr(AipOperationsAdapter, "capabilities", tick_then_capabilities)
        aip.faults(status_503={"RunReport": {"count": 1, "retry_after_s": 0}}, missing_projects=["gone"])
        new = validate_submission(
            {
                "call_node_id": "n/resubmitted",
                "server": AIP_SERVER,
                "tool": AIP_TOOL,
                "arguments": args(project="gone"),
            },
            step_runtime.fleet,
            max_body_bytes=step_runtime.settings.max_body_bytes,
        )

        submission, step = executor.submit(new)

        kinds = [e["kind"] for e in executor.ledger.events(submission.operation.id)]
        assert "resubmission" in kinds, kinds
        assert step is not None
        assert step.action == "accepted", (step, kinds)
        assert claimed_by_ticks == []
        assert executor.ledger.get(submission.operation.id).state is OpState.ACCEPTED
        assert len([r for r in aip.log() if r["rpc"] == "RunReport"]) == 3  # create, lookup, resubmission
    finally:
        step_runtime.close()
        tick_runtime.close()
