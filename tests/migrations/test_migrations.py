"""Migrations do not drift: Alembic's upgrade creates what the models describe (autogenerate finds nothing),
and upgrade, downgrade and upgrade again round-trip."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from ledger.engine import normalize_database_url
from ledger.migrate import downgrade, upgrade
from ledger.models import Base

TABLES = {
    "tool_operation",
    "operation_event",
    "terminal_receipt",
    "outbox",
    "reconciliation",
    "executor_control",
    "executor_control_audit",
}


def test_upgrade_creates_the_tables_and_autogenerate_finds_no_drift(empty_database_url: str) -> None:
    upgrade(empty_database_url)
    engine = create_engine(normalize_database_url(empty_database_url))
    try:
        assert set(inspect(engine).get_table_names()) >= TABLES
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
            control = conn.execute(text("SELECT execution_epoch, admission_open FROM executor_control")).all()
        assert diff == []
        assert control == [(1, True)]
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(empty_database_url: str) -> None:
    engine = create_engine(normalize_database_url(empty_database_url))
    try:
        upgrade(empty_database_url)
        downgrade(empty_database_url, "base")
        assert not TABLES & set(inspect(engine).get_table_names())
        upgrade(empty_database_url)
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()


def test_the_event_kind_check_downgrades_and_upgrades(empty_database_url: str) -> None:
    engine = create_engine(normalize_database_url(empty_database_url))

    def checks() -> set[str]:
        return {str(c["name"]) for c in inspect(engine).get_check_constraints("operation_event")}

    try:
        upgrade(empty_database_url)
        assert "ck_operation_event_kind_known" in checks()
        downgrade(empty_database_url, "0002")
        assert "ck_operation_event_kind_known" not in checks()
        upgrade(empty_database_url)
        assert "ck_operation_event_kind_known" in checks()
    finally:
        engine.dispose()
