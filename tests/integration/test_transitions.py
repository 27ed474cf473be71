"""Every (from, to) pair of the state table, through the real repository on a real Postgres."""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from ledger.errors import StaleTransition
from ledger.repository import Fence, Ledger
from ledger.states import ACCEPT_TO, EDGES, FINAL_STATES, IllegalTransition, OpState, TerminalKind
from tests.integration.helpers import evidence_for, place, values_for

PAIRS = list(itertools.product(OpState, OpState))


def _kind_into(source: OpState, target: OpState) -> TerminalKind:
    if target is OpState.CANCELLED_ACCEPTED:
        return TerminalKind.CANCELLED
    return TerminalKind.COMPLETED


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_every_pair(shared_ledger: Ledger, source: OpState, target: OpState) -> None:
    ledger = shared_ledger
    kind = _kind_into(source, target)
    terminal = TerminalKind.CANCELLED if kind is TerminalKind.CANCELLED else TerminalKind.COMPLETED
    op = place(ledger, source, terminal=terminal)
    allowed = (source, target) in EDGES

    if target in FINAL_STATES:
        # Final states are reached only through the single acceptance point.
        with pytest.raises(IllegalTransition):
            ledger.transition(op.id, op.fence, target, from_states=[source])
        acceptance = ledger.accept_terminal(op.id, evidence_for(op, kind))
        after = ledger.get(op.id)
        if allowed:
            assert acceptance.outcome == "accepted", acceptance
            assert after.state is ACCEPT_TO[kind] is target
            assert ledger.receipt_for(op.id) is not None
            assert ledger.events(op.id)[-1]["kind"] == "terminal_accepted"
            assert ledger.events(op.id)[-1]["from_state"] == source.value
        else:
            assert acceptance.outcome != "accepted"
            assert after.state is source
            assert ledger.receipt_for(op.id) is None or source in FINAL_STATES
        return

    if not allowed:
        with pytest.raises(IllegalTransition):
            ledger.transition(op.id, op.fence, target, from_states=[source], values=values_for(target, op))
        after = ledger.get(op.id)
        assert (after.state, after.event_seq) == (source, op.event_seq)
        return

    moved = ledger.transition(op.id, op.fence, target, from_states=[source], values=values_for(target, op))
    assert moved.state is target
    assert ledger.get(op.id).state is target
    last = ledger.events(op.id)[-1]
    assert (last["from_state"], last["to_state"], last["kind"]) == (source.value, target.value, "transition")
    assert last["seq"] == moved.event_seq == op.event_seq + 1


def _stale_cases() -> list[tuple[OpState, OpState, str]]:
    cases: list[tuple[OpState, OpState, str]] = []
    for source, target in EDGES:
        if target in FINAL_STATES:
            continue
        kinds = ["execution_epoch", "cancel_generation", "poll_cursor"]
        if any(t is target and s is not source for s, t in EDGES):
            kinds.append("state")  # a writer that believes the row is in another source state of this edge
        cases.extend((source, target, kind) for kind in kinds)
    return cases


STALE_CASES = _stale_cases()


@pytest.mark.parametrize(
    ("source", "target", "stale"), STALE_CASES, ids=[f"{s}->{t}-{k}" for s, t, k in STALE_CASES]
)
def test_stale_writer_changes_nothing(
    shared_ledger: Ledger, source: OpState, target: OpState, stale: str
) -> None:
    ledger = shared_ledger
    op = place(ledger, source)
    fence = Fence(op.execution_epoch, op.cancel_generation, op.poll_cursor)
    from_states = [source]
    if stale == "execution_epoch":
        fence = Fence(op.execution_epoch - 1 if op.execution_epoch > 1 else 7, op.cancel_generation, None)
    elif stale == "cancel_generation":
        fence = Fence(op.execution_epoch, op.cancel_generation + 1, None)
    elif stale == "poll_cursor":
        fence = Fence(op.execution_epoch, op.cancel_generation, op.poll_cursor + 1)
    else:
        from_states = [s for (s, t) in EDGES if t is target and s is not source]
    before = ledger.get(op.id)

    with pytest.raises(StaleTransition) as refused:
        ledger.transition(op.id, fence, target, from_states=from_states, values=values_for(target, op))

    after = ledger.get(op.id)
    assert after.state is source
    assert {k: v for k, v in vars_of(after).items() if k not in ("event_seq",)} == {
        k: v for k, v in vars_of(before).items() if k not in ("event_seq",)
    }
    assert after.event_seq == before.event_seq + 1
    event = ledger.events(op.id)[-1]
    assert event["kind"] == "stale_write_rejected"
    assert event["to_state"] == target.value
    assert stale in str(refused.value) or stale == "state"


def vars_of(op: object) -> dict[str, object]:
    return {name: getattr(op, name) for name in op.__slots__}  # type: ignore[attr-defined]


def test_database_refuses_unknown_state(ledger: Ledger) -> None:
    op = place(ledger, OpState.SUBMITTING)
    with pytest.raises(IntegrityError, match="ck_tool_operation_state_known"), ledger.engine.begin() as conn:
        conn.execute(text("UPDATE tool_operation SET state = 'DONE' WHERE id = :id"), {"id": op.id})


@pytest.mark.parametrize(
    ("state", "constraint"),
    [
        (OpState.WORKING, "remote_id_by_state"),
        (OpState.CANCEL_REQUESTED, "remote_id_by_state"),
        (OpState.TERMINAL_OBSERVED, "observed_terminal_by_state"),
        (OpState.SUBMISSION_UNKNOWN, "submission_unknown_attempted"),
        (OpState.INPUT_REQUIRED, "input_required_has_request"),
        (OpState.ACCEPTED, "accepted_has_digest"),
    ],
)
def test_database_requires_the_columns_of_a_state(ledger: Ledger, state: OpState, constraint: str) -> None:
    op = place(ledger, OpState.SUBMITTING)
    with pytest.raises(IntegrityError, match=constraint), ledger.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE tool_operation SET state = :state, observed_terminal = "
                "CASE WHEN :state IN ('ACCEPTED') THEN 'completed' END, "
                "remote_id = CASE WHEN :state IN ('TERMINAL_OBSERVED', 'ACCEPTED', 'INPUT_REQUIRED') "
                "THEN 'r' END WHERE id = :id"
            ),
            {"id": op.id, "state": state.value},
        )


def test_input_required_is_never_auto_polled(ledger: Ledger) -> None:
    op = place(ledger, OpState.INPUT_REQUIRED)
    with pytest.raises(IntegrityError, match="not_polled_by_state"), ledger.engine.begin() as conn:
        conn.execute(text("UPDATE tool_operation SET next_poll_at = now() WHERE id = :id"), {"id": op.id})
