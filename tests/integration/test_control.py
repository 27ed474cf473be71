"""Executor control under concurrent operators: every change is kept, none lost to another's commit."""

from __future__ import annotations

import threading

from sqlalchemy import text

from ledger.repository import Ledger
from tests import support


def _waiting_on_a_lock(ledger: Ledger) -> int:
    with ledger.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )


def test_two_concurrent_disables_of_different_adapters_both_survive(ledger: Ledger) -> None:
    versions = ("2025-06-18", "2025-11-25")
    errors: list[BaseException] = []

    def disable(version: str) -> None:
        try:
            ledger.set_adapter_disabled("mcp", version, disabled=True, actor=f"operator-{version}")
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
            errors.append(exc)

    # Another operator's change holds the control row: both disables start, and both wait for it, so each
    # one's write lands after the other has begun (the interleaving that lost a write before).
    holder = ledger.engine.connect()
    holder.begin()
    holder.execute(text("SELECT * FROM executor_control WHERE id = 1 FOR UPDATE"))
    threads = [threading.Thread(target=disable, args=(version,)) for version in versions]
    try:
        for thread in threads:
            thread.start()
        support.wait_for(
            "both disables to wait for the control row",
            lambda: _waiting_on_a_lock(ledger) >= 2 or None,
            timeout=10,
        )
    finally:
        holder.rollback()
        holder.close()
        for thread in threads:
            thread.join(timeout=10)
    assert not errors
    assert ledger.control().disabled_adapters == tuple(f"mcp/{v}" for v in sorted(versions))
    with ledger.engine.connect() as conn:
        audited = conn.execute(
            text("SELECT action, after->'disabled_adapters' FROM executor_control_audit ORDER BY id")
        ).all()
    assert [action for action, _ in audited] == ["disable_adapter", "disable_adapter"]
    assert len(audited[-1][1]) == 2


def test_disable_is_idempotent_and_enable_removes_only_its_own(ledger: Ledger) -> None:
    ledger.set_adapter_disabled("mcp", "2025-11-25", disabled=True, actor="a")
    ledger.set_adapter_disabled("mcp", "2025-11-25", disabled=True, actor="a")
    ledger.set_adapter_disabled("aip151", "v1", disabled=True, actor="a")
    assert ledger.control().disabled_adapters == ("aip151/v1", "mcp/2025-11-25")
    ledger.set_adapter_disabled("mcp", "2025-11-25", disabled=False, actor="a")
    ledger.set_adapter_disabled("mcp", "2025-11-25", disabled=False, actor="a")
    assert ledger.control().disabled_adapters == ("aip151/v1",)
