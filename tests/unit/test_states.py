"""The pure state table: its shape, and that the database constraint is derived from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import cast

from sqlalchemy import CheckConstraint, Table

from ledger import models
from ledger.events import EventKind
from ledger.migrate import MIGRATIONS
from ledger.reasons import ReconciliationReason
from ledger.states import (
    ACCEPT_FROM,
    ACCEPT_TO,
    EDGES,
    EXTENSION_EDGES,
    FINAL_STATES,
    SEED_EDGES,
    OpState,
    mermaid,
    states_document,
    successors,
)

S = OpState


def test_the_seed_graph_of_the_design() -> None:
    assert set(SEED_EDGES) == {
        (S.SUBMITTING, S.WORKING),
        (S.WORKING, S.INPUT_REQUIRED),
        (S.INPUT_REQUIRED, S.WORKING),
        (S.SUBMITTING, S.SUBMISSION_UNKNOWN),
        (S.SUBMISSION_UNKNOWN, S.WORKING),
        (S.SUBMISSION_UNKNOWN, S.NOT_FOUND_SAFE),
        (S.WORKING, S.CANCEL_REQUESTED),
        (S.INPUT_REQUIRED, S.CANCEL_REQUESTED),
        (S.WORKING, S.TERMINAL_OBSERVED),
        (S.INPUT_REQUIRED, S.TERMINAL_OBSERVED),
        (S.TERMINAL_OBSERVED, S.FETCHING_RESULT),
        (S.FETCHING_RESULT, S.ACCEPTED),
        (S.CANCEL_REQUESTED, S.CANCELLED_ACCEPTED),
        (S.CANCEL_REQUESTED, S.TERMINAL_OBSERVED),
    }


def test_every_extension_has_a_reason_and_is_not_a_seed_edge() -> None:
    assert not set(EXTENSION_EDGES) & set(SEED_EDGES)
    assert all(len(reason) > 20 for reason in EXTENSION_EDGES.values())
    assert (S.NOT_FOUND_SAFE, S.SUBMITTING) in EXTENSION_EDGES  # resubmission only from NOT_FOUND_SAFE
    assert [s for s, t in EDGES if t is S.SUBMITTING] == [S.NOT_FOUND_SAFE]


def test_final_states_have_no_way_out_and_every_state_reaches_one() -> None:
    assert {S.ACCEPTED, S.CANCELLED_ACCEPTED} == FINAL_STATES
    assert all(not successors(final) for final in FINAL_STATES)
    for state in OpState:
        seen, frontier = {state}, [state]
        while frontier:
            for nxt in successors(frontier.pop()):
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert seen & FINAL_STATES, f"{state} can never finish"


def test_acceptance_edges_are_edges() -> None:
    for kind, sources in ACCEPT_FROM.items():
        assert all((source, ACCEPT_TO[kind]) in EDGES for source in sources)


def test_the_state_check_is_generated_from_the_table() -> None:
    table = cast(Table, models.ToolOperation.__table__)
    [check] = [
        c
        for c in table.constraints
        if isinstance(c, CheckConstraint) and str(c.name).endswith("_state_known")
    ]
    listed = str(check.sqltext)
    assert all(f"'{state}'" in listed for state in OpState)
    assert listed.count("'") == 2 * len(OpState)


def test_the_diagram_shows_every_edge() -> None:
    diagram = mermaid()
    assert all(f"{s} --> {t}" in diagram for s, t in EDGES)


def test_the_docs_diagram_is_current() -> None:
    document = (Path(__file__).resolve().parents[2] / "docs" / "states.md").read_text()
    assert document == states_document(), "run: python -m ledger.states > docs/states.md"


def _check_named(table: Table, suffix: str) -> str:
    [check] = [
        c for c in table.constraints if isinstance(c, CheckConstraint) and str(c.name).endswith(suffix)
    ]
    return str(check.sqltext)


def test_the_event_kind_check_is_generated_from_the_enum() -> None:
    listed = _check_named(cast(Table, models.OperationEvent.__table__), "_kind_known")
    assert all(f"'{kind}'" in listed for kind in EventKind)
    assert listed.count("'") == 2 * len(EventKind)


def _head_vocabulary() -> ModuleType:
    """The newest migration that writes out the vocabulary lists (event kinds, reconciliation reasons)."""
    path = max((MIGRATIONS / "versions").glob("00*_hardening_vocabulary.py"))
    spec = importlib.util.spec_from_file_location("vocabulary_migration", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_head_migration_lists_every_event_kind() -> None:
    """Autogenerate does not compare CHECK constraints: this is the drift guard for the kinds' list."""
    assert sorted(_head_vocabulary().KINDS) == sorted(kind.value for kind in EventKind)


def test_the_head_migration_lists_every_reconciliation_reason() -> None:
    assert sorted(_head_vocabulary().REASONS) == sorted(reason.value for reason in ReconciliationReason)
