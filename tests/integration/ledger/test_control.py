"""Executor control under concurrent operators: every change is kept, none lost to another's commit."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from ledger.errors import AdapterDisabled
from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.ledger_rows import place


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


def test_a_create_attempt_is_refused_in_its_own_transaction_once_its_adapter_is_disabled(
    ledger: Ledger,
) -> None:
    """Rule 14 at the attempt itself: the control row is read in the transaction that would record the
    create attempt, so an attempt after a disable has committed is refused with nothing written, and the
    other adapters' attempts go on."""
    op = place(ledger, OpState.SUBMITTING)
    ledger.set_adapter_disabled(op.protocol, op.protocol_version, disabled=True, actor="operator")
    events_before = len(ledger.events(op.id))
    with pytest.raises(AdapterDisabled):
        ledger.record_create_attempt(
            op.id,
            op.fence,
            descriptor_version=None,
            detail={},
            unless_disabled=(op.protocol, op.protocol_version),
        )
    assert ledger.get(op.id).submit_attempted_at is None
    assert len(ledger.events(op.id)) == events_before

    ledger.set_adapter_disabled(op.protocol, op.protocol_version, disabled=False, actor="operator")
    ledger.set_adapter_disabled("aip151", "v1", disabled=True, actor="operator")
    adapter = (op.protocol, op.protocol_version)
    attempted = ledger.record_create_attempt(
        op.id, op.fence, descriptor_version=None, detail={}, unless_disabled=adapter
    )
    assert attempted.submit_attempted_at is not None
