"""A Hypothesis state machine over the real repository on a real Postgres.

Random submits, moves (current or stale), generation bumps and acceptances (matching or not). After every
step: never more than one receipt per call node, no completed/failed receipt without a result digest, every
row where the model says it is (so no move out of a final state and no stale write changed anything).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import text

from ledger.errors import CallNodeConflict, StaleTransition
from ledger.records import Fence
from ledger.repository import Ledger
from ledger.states import (
    ACCEPT_FROM,
    ACCEPT_TO,
    EDGES,
    FINAL_STATES,
    IllegalTransition,
    OpState,
    TerminalKind,
    successors,
)
from tests.support.ledger_rows import evidence_for, submit, values_for

NODES = [f"node-{i}" for i in range(4)]
MOVABLE = [s for s in OpState if s not in FINAL_STATES]
STALE = ["none", "execution_epoch", "cancel_generation", "poll_cursor"]


@dataclass
class Model:
    state: OpState
    generation: int = 0
    call_node_id: str = ""
    receipt: TerminalKind | None = None


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self.run = uuid.uuid4().hex[:8]
        self.ops: dict[uuid.UUID, Model] = {}
        self.digests: dict[str, int] = {}

    def _node(self, index: int) -> str:
        return f"{self.run}-{NODES[index]}"

    @rule(node=st.integers(0, len(NODES) - 1), variant=st.integers(0, 1))
    def submit(self, node: int, variant: int) -> None:
        call_node_id = self._node(node)
        known = self.digests.get(call_node_id)
        try:
            op = submit(self.ledger, call_node_id, arguments={"variant": variant})
        except CallNodeConflict:
            assert known is not None
            assert known != variant
            return
        assert known in (None, variant)
        self.digests[call_node_id] = variant
        self.ops.setdefault(op.id, Model(OpState.SUBMITTING, call_node_id=call_node_id))

    @precondition(lambda self: bool(self.ops))
    @rule(data=st.data(), along_an_edge=st.booleans(), stale=st.sampled_from(STALE))
    def move(self, data: st.DataObject, along_an_edge: bool, stale: str) -> None:
        op_id = data.draw(st.sampled_from(list(self.ops)))
        model = self.ops[op_id]
        onward = sorted(successors(model.state) - FINAL_STATES)
        target = data.draw(st.sampled_from(onward if along_an_edge and onward else MOVABLE))
        op = self.ledger.get(op_id)
        fence = _fence(op.fence, stale)
        values = values_for(target, op)
        if (model.state, target) not in EDGES:
            with pytest.raises(IllegalTransition):
                self.ledger._edge_move(op_id, fence, target, from_states=[model.state], values=values)
            return
        if stale != "none":
            with pytest.raises(StaleTransition):
                self.ledger._edge_move(op_id, fence, target, from_states=[model.state], values=values)
            return
        self.ledger._edge_move(op_id, fence, target, from_states=[model.state], values=values)
        model.state = target

    @precondition(lambda self: bool(self.ops))
    @rule(data=st.data())
    def bump_generation(self, data: st.DataObject) -> None:
        op_id = data.draw(st.sampled_from(list(self.ops)))
        model = self.ops[op_id]
        if model.state in FINAL_STATES:
            return
        op = self.ledger.get(op_id)
        self.ledger._edge_move(op_id, op.fence, None, from_states=[model.state], bump_generation=True)
        model.generation += 1

    @precondition(lambda self: bool(self.ops))
    @rule(data=st.data(), kind=st.sampled_from(TerminalKind), stale=st.sampled_from(STALE[:3]))
    def accept(self, data: st.DataObject, kind: TerminalKind, stale: str) -> None:
        op_id = data.draw(st.sampled_from(list(self.ops)))
        model = self.ops[op_id]
        op = self.ledger.get(op_id)
        evidence = evidence_for(op, kind)
        if stale == "execution_epoch":
            evidence = evidence_for(op, kind, execution_epoch=op.execution_epoch + 1)
        elif stale == "cancel_generation":
            evidence = evidence_for(op, kind, cancel_generation=op.cancel_generation + 1)
        acceptance = self.ledger.accept_terminal(op_id, evidence)
        observed_ok = op.observed_terminal is kind or (
            kind is TerminalKind.CANCELLED
            and (
                model.state is OpState.CANCEL_REQUESTED
                # Rule 6: a cancel requested before any create was attempted ends it with no create.
                or (
                    model.state is OpState.SUBMITTING
                    and op.submit_attempted_at is None
                    and model.generation > 0
                )
            )
        )
        if model.receipt is None and model.state in ACCEPT_FROM[kind] and observed_ok and stale == "none":
            assert acceptance.outcome == "accepted"
            model.state = ACCEPT_TO[kind]
            model.receipt = kind
        elif model.receipt is TerminalKind.CANCELLED and kind is not TerminalKind.CANCELLED:
            assert acceptance.outcome == "effect_reconciliation"
        else:
            assert acceptance.outcome in ("rejected", "already_accepted")

    @invariant()
    def one_receipt_per_call_node_and_digests_present(self) -> None:
        with self.ledger.engine.connect() as conn:
            doubled = conn.execute(
                text("SELECT call_node_id FROM terminal_receipt GROUP BY call_node_id HAVING count(*) > 1")
            ).all()
            undigested = conn.execute(
                text(
                    "SELECT id FROM terminal_receipt "
                    "WHERE terminal_state <> 'cancelled' AND result_digest IS NULL"
                )
            ).all()
            outbox_per_receipt = conn.execute(
                text(
                    "SELECT count(*) FROM terminal_receipt r LEFT JOIN outbox o ON o.receipt_id = r.id "
                    "GROUP BY r.id HAVING count(o.id) <> 1"
                )
            ).all()
        assert doubled == []
        assert undigested == []
        assert outbox_per_receipt == []

    @invariant()
    def every_row_is_where_the_model_says(self) -> None:
        if not self.ops:
            return
        with self.ledger.engine.connect() as conn:
            rows = conn.execute(
                text("SELECT id, state, cancel_generation FROM tool_operation WHERE id = ANY(:ids)"),
                {"ids": list(self.ops)},
            ).all()
        for row in rows:
            model = self.ops[row.id]
            assert (OpState(row.state), row.cancel_generation) == (model.state, model.generation)


def _fence(fence: Fence, stale: str) -> Fence:
    if stale == "execution_epoch":
        return Fence(fence.execution_epoch + 1, fence.cancel_generation, fence.poll_cursor)
    if stale == "cancel_generation":
        return Fence(fence.execution_epoch, fence.cancel_generation + 1, fence.poll_cursor)
    if stale == "poll_cursor":
        return Fence(fence.execution_epoch, fence.cancel_generation, (fence.poll_cursor or 0) + 1)
    return fence


def test_ledger_state_machine(ledger: Ledger) -> None:
    class Bound(LedgerMachine):
        def __init__(self) -> None:
            super().__init__(ledger)

    run_state_machine_as_test(
        Bound,
        settings=settings(
            max_examples=40,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
