"""Every (from, to) pair of the state table, through the real repository on a real Postgres."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import uuid
from collections.abc import Callable

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from ledger.errors import StaleTransition
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation, ServerStatus
from ledger.repository import Ledger
from ledger.states import ACCEPT_TO, EDGES, FINAL_STATES, IllegalTransition, OpState, TerminalKind
from tests.support.ledger_rows import evidence_for, place, values_for

S = OpState
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
    if (source, target) == (OpState.SUBMITTING, OpState.CANCELLED_ACCEPTED):
        # Its precondition: a cancel requested before any create was attempted (rule 6).
        op = ledger.record_cancel_intent(op.id, op.fence, from_state=source)
    allowed = (source, target) in EDGES

    if target in FINAL_STATES:
        # Final states are reached only through the single acceptance point.
        with pytest.raises(IllegalTransition):
            ledger._edge_move(op.id, op.fence, target, from_states=[source])
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
            ledger._edge_move(op.id, op.fence, target, from_states=[source], values=values_for(target, op))
        after = ledger.get(op.id)
        assert (after.state, after.event_seq) == (source, op.event_seq)
        return

    moved = ledger._edge_move(op.id, op.fence, target, from_states=[source], values=values_for(target, op))
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
        ledger._edge_move(op.id, fence, target, from_states=from_states, values=values_for(target, op))

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


# ------------------------------------------------------------------------------------------- named moves

MoveCall = Callable[[Ledger, Operation], Operation]

NAMED_MOVES: dict[str, tuple[OpState, MoveCall, OpState, list[str]]] = {
    "record_create_attempt": (
        S.SUBMITTING,
        lambda ledger, op: ledger.record_create_attempt(
            op.id, op.fence, descriptor_version="sha256:d", detail={}
        ),
        S.SUBMITTING,
        ["create_attempted"],
    ),
    "undo_create_attempt": (
        S.SUBMITTING,
        lambda ledger, op: ledger.undo_create_attempt(op.id, op.fence, retry_in_s=5, detail={"error": "x"}),
        S.SUBMITTING,
        ["create_refused_before_work"],
    ),
    "mark_submission_unknown": (
        S.SUBMISSION_UNKNOWN,  # placed there only for its submit_attempted_at; moved from SUBMITTING below
        lambda ledger, op: ledger.mark_submission_unknown(op.id, op.fence, detail={"why": "lost"}),
        S.SUBMISSION_UNKNOWN,
        ["submission_unknown"],
    ),
    "record_created": (
        S.SUBMITTING,
        lambda ledger, op: ledger.record_created(
            op.id,
            op.fence,
            remote_id="task-1",
            session_ref="s-1",
            status=ServerStatus("working", "queued", 500),
            expires_at=None,
            next_poll_in_s=0.5,
        ),
        S.WORKING,
        ["created"],
    ),
    "record_found_by_key": (
        S.SUBMISSION_UNKNOWN,
        lambda ledger, op: ledger.record_found_by_key(
            op.id, op.fence, remote_id="task-2", session_ref=None, detail={}
        ),
        S.WORKING,
        ["found_by_key"],
    ),
    "hold_create_result": (
        S.SUBMITTING,
        lambda ledger, op: ledger.hold_create_result(
            op.id,
            op.fence,
            kind=TerminalKind.COMPLETED,
            server_state=None,
            result={"isError": False},
            event=EventKind.RAN_SYNCHRONOUSLY,
        ),
        S.FETCHING_RESULT,
        ["ran_synchronously", "fetching_result"],
    ),
    "record_poll": (
        S.WORKING,
        lambda ledger, op: ledger.record_poll(
            op.id, op.fence, state=S.WORKING, status=ServerStatus("working"), next_poll_in_s=1
        ),
        S.WORKING,
        ["polled"],
    ),
    "reschedule": (
        S.WORKING,
        lambda ledger, op: ledger.reschedule(
            op.id, op.fence, state=S.WORKING, delay_s=2, event=EventKind.POLL_FAILED, detail={}
        ),
        S.WORKING,
        ["poll_failed"],
    ),
    "observe_terminal": (
        S.WORKING,
        lambda ledger, op: ledger.observe_terminal(
            op.id,
            op.fence,
            from_state=S.WORKING,
            kind=TerminalKind.COMPLETED,
            status=ServerStatus("completed"),
            fetch_now=False,
            due_in_s=1,
        ),
        S.TERMINAL_OBSERVED,
        ["terminal_observed"],
    ),
    "observe_terminal_and_fetch": (
        S.CANCEL_REQUESTED,
        lambda ledger, op: ledger.observe_terminal(
            op.id,
            op.fence,
            from_state=S.CANCEL_REQUESTED,
            kind=TerminalKind.FAILED,
            status=ServerStatus("failed"),
            fetch_now=True,
        ),
        S.FETCHING_RESULT,
        ["terminal_observed", "fetching_result"],
    ),
    "start_fetch": (
        S.TERMINAL_OBSERVED,
        lambda ledger, op: ledger.start_fetch(op.id, op.fence),
        S.FETCHING_RESULT,
        ["fetching_result"],
    ),
    "correct_observed_terminal": (
        S.FETCHING_RESULT,
        lambda ledger, op: ledger.correct_observed_terminal(
            op.id, op.fence, state=S.FETCHING_RESULT, kind=TerminalKind.FAILED, was=op.observed_terminal
        ),
        S.FETCHING_RESULT,
        ["outcome_from_result"],
    ),
    "request_cancel": (
        S.INPUT_REQUIRED,
        lambda ledger, op: ledger.request_cancel(op.id, op.fence, from_state=S.INPUT_REQUIRED),
        S.CANCEL_REQUESTED,
        ["cancel_requested"],
    ),
    "ask_for_input": (
        S.WORKING,
        lambda ledger, op: ledger.ask_for_input(
            op.id,
            op.fence,
            from_state=S.WORKING,
            input_round=op.input_round + 1,
            request_json={"method": "elicitation/create", "params": {}},
            schema_digest="sha256:s",
            deadline=op.created_at + dt.timedelta(hours=1),
            status=ServerStatus("input_required"),
            gate_payload={"input_request": {}},
        ),
        S.INPUT_REQUIRED,
        ["input_required"],
    ),
    "record_input_reply": (
        S.INPUT_REQUIRED,
        lambda ledger, op: ledger.record_input_reply(
            op.id, op.fence, input_round=op.input_round, response={"action": "accept"}
        ),
        S.WORKING,
        ["input_provided"],
    ),
    "hand_to_operator": (
        S.FETCHING_RESULT,
        lambda ledger, op: ledger.hand_to_operator(
            op.id,
            op.fence,
            from_state=S.FETCHING_RESULT,
            reason=ReconciliationReason.UNKNOWN_NOT_FOUND,
            detail={"why": "gone"},
            deadline_s=60,
        ),
        S.MANUAL_RECONCILIATION,
        ["manual_reconciliation", "reconciliation_opened"],
    ),
    "resolve_found": (
        S.MANUAL_RECONCILIATION,
        lambda ledger, op: ledger.resolve_found(
            op.id, op.fence, remote_id="task-3", session_ref=None, detail={}, resolution="found by test"
        ),
        S.WORKING,
        ["resolved_found"],
    ),
    "resolve_terminal": (
        S.MANUAL_RECONCILIATION,
        lambda ledger, op: ledger.resolve_terminal(
            op.id, op.fence, remote_id="task-4", kind=TerminalKind.FAILED, detail={}, resolution="ended"
        ),
        S.TERMINAL_OBSERVED,
        ["resolved_terminal"],
    ),
    "resubmit_after_lookup": (
        S.SUBMISSION_UNKNOWN,
        lambda ledger, op: ledger.resubmit(op.id, op.fence, from_state=S.SUBMISSION_UNKNOWN, detail={}),
        S.SUBMITTING,
        ["never_created", "resubmission"],
    ),
    "resubmit_by_operator": (
        S.MANUAL_RECONCILIATION,
        lambda ledger, op: ledger.resubmit(
            op.id, op.fence, from_state=S.MANUAL_RECONCILIATION, detail={}, resolution="never ran"
        ),
        S.SUBMITTING,
        ["resolved_never_created", "resubmission"],
    ),
}


@pytest.mark.parametrize("name", list(NAMED_MOVES))
def test_each_named_move_writes_its_events(shared_ledger: Ledger, name: str) -> None:
    ledger = shared_ledger
    source, call, end, kinds = NAMED_MOVES[name]
    op = place(ledger, source)
    if name == "mark_submission_unknown":  # SUBMITTING with an attempt recorded
        op = place(ledger, S.SUBMITTING)
        op = ledger.record_create_attempt(op.id, op.fence, descriptor_version=None, detail={})
    moved = call(ledger, op)
    assert moved.state is end
    written = [e["kind"] for e in ledger.events(op.id)][-len(kinds) :]
    assert written == kinds
    assert ledger.get(op.id).event_seq == ledger.events(op.id)[-1]["seq"]
    # And a writer one cursor behind changes nothing.
    again = place(ledger, source)
    if name == "mark_submission_unknown":
        again = place(ledger, S.SUBMITTING)
        again = ledger.record_create_attempt(again.id, again.fence, descriptor_version=None, detail={})
    behind = dataclasses.replace(again, poll_cursor=again.poll_cursor + 1)
    with pytest.raises(StaleTransition):
        call(ledger, behind)
    assert ledger.get(again.id).state is again.state
    assert ledger.events(again.id)[-1]["kind"] == "stale_write_rejected"


def _xmins(ledger: Ledger, op_id: uuid.UUID) -> tuple[str, list[str]]:
    with ledger.engine.connect() as conn:
        row = conn.execute(
            text("SELECT xmin::text FROM tool_operation WHERE id = :id"), {"id": op_id}
        ).scalar_one()
        events = conn.execute(
            text("SELECT xmin::text FROM operation_event WHERE op_id = :id ORDER BY seq"), {"id": op_id}
        ).scalars()
        return row, list(events)


def test_resubmission_after_never_created_is_one_transaction(ledger: Ledger) -> None:
    op = place(ledger, S.SUBMISSION_UNKNOWN)
    moved = ledger.resubmit(
        op.id, op.fence, from_state=S.SUBMISSION_UNKNOWN, detail={"detail": "no such key"}
    )
    assert (moved.state, moved.submit_attempted_at, moved.lease_until) == (S.SUBMITTING, None, None)
    assert moved.next_poll_at is not None
    assert moved.submission_key == op.submission_key
    never, again = ledger.events(op.id)[-2:]
    assert (never["kind"], never["from_state"], never["to_state"]) == (
        "never_created",
        "SUBMISSION_UNKNOWN",
        "NOT_FOUND_SAFE",
    )
    assert never["detail"] == {"detail": "no such key"}
    assert (again["kind"], again["from_state"], again["to_state"]) == (
        "resubmission",
        "NOT_FOUND_SAFE",
        "SUBMITTING",
    )
    assert again["detail"] == {"submission_key": str(op.submission_key)}
    # The row and both events were written by one transaction (one transaction id).
    row_xmin, event_xmins = _xmins(ledger, op.id)
    assert event_xmins[-2:] == [row_xmin, row_xmin]


def test_an_operator_resubmission_closes_the_open_records_in_the_same_transaction(ledger: Ledger) -> None:
    op = place(ledger, S.SUBMISSION_UNKNOWN)
    op = ledger.hand_to_operator(
        op.id,
        op.fence,
        from_state=S.SUBMISSION_UNKNOWN,
        reason=ReconciliationReason.SUBMISSION_UNKNOWN,
        detail={},
        deadline_s=3600,
    )
    moved = ledger.resubmit(
        op.id, op.fence, from_state=S.MANUAL_RECONCILIATION, detail={"actor": "ops"}, resolution="never ran"
    )
    assert moved.state is S.SUBMITTING
    [record] = ledger.reconciliations_for(op.id)
    assert record.resolution == "never ran"
    with ledger.engine.connect() as conn:
        record_xmin = conn.execute(
            text("SELECT xmin::text FROM reconciliation WHERE id = :id"), {"id": record.id}
        ).scalar_one()
    assert record_xmin == _xmins(ledger, op.id)[0]


def test_a_stale_resubmission_changes_nothing(ledger: Ledger) -> None:
    op = place(ledger, S.SUBMISSION_UNKNOWN)
    stale = Fence(op.execution_epoch, op.cancel_generation + 1)
    with pytest.raises(StaleTransition, match="never_created"):
        ledger.resubmit(op.id, stale, from_state=S.SUBMISSION_UNKNOWN, detail={})
    after = ledger.get(op.id)
    assert (after.state, after.event_seq) == (S.SUBMISSION_UNKNOWN, op.event_seq + 1)
    [event] = ledger.events(op.id)[-1:]
    assert (event["kind"], event["to_state"]) == ("stale_write_rejected", "NOT_FOUND_SAFE")
