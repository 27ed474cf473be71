"""docs/ledger-sql.md is the SQL the ledger sends, as ``ledger/sql_doc.py`` compiles it today."""

from __future__ import annotations

from pathlib import Path

from ledger.sql_doc import MOVES, move_statements, sql_document


def test_the_docs_sql_is_current() -> None:
    document = (Path(__file__).resolve().parents[2] / "docs" / "ledger-sql.md").read_text()
    assert document == sql_document(), "run: python -m ledger.sql_doc > docs/ledger-sql.md"


def test_every_named_move_is_compiled_to_its_statement() -> None:
    for move in MOVES:
        assert move_statements(move), f"{move.name} sent nothing"


def test_the_document_names_binds_never_values() -> None:
    document = sql_document()
    assert "%(fence_id)s" not in document
    assert " at 0x" not in document
    assert ":fence_id" in document
    assert ":ev_request_digest" in document
