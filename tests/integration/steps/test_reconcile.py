"""``longcall.reconcile``: unanswered input past its deadline goes to an operator; overdue records are
flagged once."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from ledger.reasons import ReconciliationReason
from ledger.repository import Ledger
from ledger.states import OpState
from tests.support.fleet import in_process_runtime
from tests.support.ledger_rows import place
from workers.executor import Executor


@pytest.fixture
def executor(database_url: str, broker_prefix: str, tmp_path: Path) -> Iterator[Executor]:
    config = tmp_path / "longcall.toml"
    config.write_text(
        '[servers.reports]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\nurl = "http://127.0.0.1:9/mcp"\n'
    )
    runtime = in_process_runtime(database_url, broker_prefix, config)
    try:
        yield Executor(runtime)
    finally:
        runtime.close()


def test_unanswered_input_past_its_deadline_goes_to_an_operator(executor: Executor, ledger: Ledger) -> None:
    waiting = place(ledger, OpState.INPUT_REQUIRED)
    late = place(ledger, OpState.INPUT_REQUIRED)
    with ledger.engine.begin() as conn:
        conn.execute(
            text("UPDATE tool_operation SET input_deadline = now() - interval '1 s' WHERE id = :id"),
            {"id": late.id},
        )

    assert executor.reconcile() == {
        "unconfigured_handled": 0,  # issue 19 item 9: nothing on a server the configuration lacks
        "unconfigured_left": 0,
        "open": 1,
        "newly_overdue": 0,
        "inputs_timed_out": 1,
        "events_purged": 0,
        "outbox_purged": 0,
    }
    assert ledger.get(waiting.id).state is OpState.INPUT_REQUIRED
    assert ledger.get(late.id).state is OpState.MANUAL_RECONCILIATION
    [record] = ledger.reconciliations_for(late.id)
    assert record.reason is ReconciliationReason.DEADLINE_EXCEEDED


def test_a_record_past_its_deadline_is_flagged_once(executor: Executor, ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)
    record = ledger.open_reconciliation(
        op.id, ReconciliationReason.UNKNOWN_NOT_FOUND, deadline=dt.timedelta(0)
    )
    assert executor.reconcile()["newly_overdue"] == 1
    assert executor.reconcile()["newly_overdue"] == 0
    flagged = [e for e in ledger.events(op.id) if e["kind"] == "reconciliation_overdue"]
    assert [e["detail"]["reconciliation_id"] for e in flagged] == [record.id]
