"""Rule 13: a rollback bumps the execution epoch; the new executor takes over in-flight rows on its next
claim, and every write of the old epoch is refused from then on."""

from __future__ import annotations

import pytest

from ledger.errors import AdmissionClosed, StaleTransition
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.ledger_rows import evidence_for, new_operation, place, values_for


def test_a_claim_takes_over_rows_of_an_older_epoch_and_fences_off_their_writers(ledger: Ledger) -> None:
    op = place(ledger, OpState.WORKING)
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE tool_operation SET next_poll_at = now() WHERE id = %s", (op.id,))
    [old_claim] = ledger.claim_due(limit=10, lease_s=0.001, epoch=1)
    old_fence = old_claim.fence

    control = ledger.bump_epoch(actor="test")
    assert control.execution_epoch == 2
    # The first claim's lease (1 ms) runs out; the next claim is the new epoch's.
    [new_claim] = support.wait_for(
        "the row to be claimable again",
        lambda: ledger.claim_due(limit=10, lease_s=30, epoch=2) or None,
        timeout=5,
    )
    assert new_claim.execution_epoch == 2

    before = ledger.get(op.id)
    with pytest.raises(StaleTransition, match="execution_epoch expected 1 found 2"):
        ledger._edge_move(
            op.id,
            old_fence,
            OpState.TERMINAL_OBSERVED,
            from_states=[OpState.WORKING],
            values=values_for(OpState.TERMINAL_OBSERVED, op),
        )
    assert ledger.get(op.id).state is OpState.WORKING
    stale = ledger.accept_terminal(op.id, evidence_for(before, TerminalKind.COMPLETED, execution_epoch=1))
    assert stale.outcome == "rejected"

    moved = ledger._edge_move(
        op.id,
        new_claim.fence,
        OpState.TERMINAL_OBSERVED,
        from_states=[OpState.WORKING],
        values=values_for(OpState.TERMINAL_OBSERVED, op),
    )
    assert (moved.state, moved.execution_epoch) == (OpState.TERMINAL_OBSERVED, 2)


def test_closed_admission_refuses_new_operations_and_is_audited(ledger: Ledger) -> None:
    ledger.set_admission(open_=False, actor="operator-1")
    with pytest.raises(AdmissionClosed):
        ledger.record_submission(new_operation())
    ledger.set_admission(open_=True, actor="operator-1")
    assert ledger.record_submission(new_operation()).created
    with ledger.engine.connect() as conn:
        audit = conn.exec_driver_sql(
            "SELECT actor, action, before, after FROM executor_control_audit ORDER BY id"
        ).all()
    assert [(a.actor, a.action) for a in audit] == [("operator-1", "set_admission")] * 2
    assert (audit[0].before["admission_open"], audit[0].after["admission_open"]) == (True, False)
