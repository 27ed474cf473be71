"""Rule 8: the single acceptance point, its matching, and races with real commits between processes."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
from sqlalchemy import text

from ledger.digests import digest
from ledger.reasons import ReconciliationReason
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests.support import races
from tests.support.ledger_rows import RESULT, evidence_for, place, submit


def _counts(ledger: Ledger, op_id: object) -> tuple[int, int]:
    with ledger.engine.connect() as conn:
        receipts = conn.execute(
            text("SELECT count(*) FROM terminal_receipt WHERE op_id = :id"), {"id": op_id}
        )
        outbox = conn.execute(text("SELECT count(*) FROM outbox WHERE op_id = :id"), {"id": op_id})
        return int(receipts.scalar_one()), int(outbox.scalar_one())


def test_accepting_a_completion_writes_receipt_outbox_state_and_event(ledger: Ledger) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))

    assert acceptance.outcome == "accepted"
    receipt = acceptance.receipt
    assert receipt is not None
    assert (receipt.terminal_state, receipt.result_digest) == (TerminalKind.COMPLETED, digest(RESULT))
    after = ledger.get(op.id)
    assert (after.state, after.result, after.result_digest) == (OpState.ACCEPTED, RESULT, digest(RESULT))
    assert _counts(ledger, op.id) == (1, 1)
    with ledger.engine.connect() as conn:
        row = conn.execute(
            text("SELECT status, kind, payload FROM outbox WHERE op_id = :id"), {"id": op.id}
        ).one()
    assert (row.status, row.kind) == ("ready", "terminal")
    assert row.payload["signature"]["task"] == "pipeline.record"
    assert row.payload["receipt"]["receipt_id"] == str(receipt.id)
    assert row.payload["receipt"]["result"] == RESULT
    assert ledger.events(op.id)[-1]["detail"]["receipt_id"] == str(receipt.id)


def test_a_replay_of_the_accepted_evidence_returns_the_same_receipt(ledger: Ledger) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    first = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    again = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert again.outcome == "already_accepted"
    assert again.receipt == first.receipt
    assert _counts(ledger, op.id) == (1, 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("call_node_id", "someone-else"),
        ("request_digest", "sha256:other"),
        ("remote_id", "task-other"),
        ("tool_descriptor_version", "sha256:newer-descriptor"),
        ("execution_epoch", 2),
        ("cancel_generation", 1),
        ("terminal_state", TerminalKind.FAILED),
        ("result_digest", "sha256:not-the-result"),
    ],
)
def test_anything_that_does_not_match_writes_no_receipt(ledger: Ledger, field: str, value: Any) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED, **{field: value}))

    assert acceptance.outcome == "rejected"
    assert any(m.startswith(field) for m in acceptance.mismatches), acceptance.mismatches
    assert _counts(ledger, op.id) == (0, 0)
    assert ledger.get(op.id).state is OpState.FETCHING_RESULT
    event = ledger.events(op.id)[-1]
    assert (event["kind"], event["detail"]["attempted"]) == ("stale_write_rejected", "accept_terminal")


def test_completion_needs_the_whole_result(ledger: Ledger) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    acceptance = ledger.accept_terminal(
        op.id, evidence_for(op, TerminalKind.COMPLETED, result=None, result_digest=None)
    )
    assert acceptance.outcome == "rejected"
    assert _counts(ledger, op.id) == (0, 0)


def test_a_confirmed_cancel_is_accepted_without_a_result_and_keeps_its_audit(ledger: Ledger) -> None:
    op = place(ledger, OpState.CANCEL_REQUESTED)
    acceptance = ledger.accept_terminal(
        op.id, evidence_for(op, TerminalKind.CANCELLED, audit={"partial": "page 1 of 3"})
    )
    assert acceptance.outcome == "accepted"
    assert acceptance.receipt is not None
    assert (acceptance.receipt.result_digest, acceptance.receipt.audit) == (None, {"partial": "page 1 of 3"})
    after = ledger.get(op.id)
    assert (after.state, after.result) == (OpState.CANCELLED_ACCEPTED, None)


def test_a_cancelled_terminal_never_carries_a_success_payload(ledger: Ledger) -> None:
    op = place(ledger, OpState.CANCEL_REQUESTED)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.CANCELLED, result=RESULT))
    assert acceptance.outcome == "rejected"
    assert _counts(ledger, op.id) == (0, 0)


def test_a_completion_after_an_accepted_cancel_opens_effect_reconciliation(ledger: Ledger) -> None:
    op = place(ledger, OpState.CANCEL_REQUESTED)
    cancelled = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.CANCELLED))
    late = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))

    assert late.outcome == "effect_reconciliation"
    assert late.receipt == cancelled.receipt
    assert _counts(ledger, op.id) == (1, 1)
    assert ledger.get(op.id).state is OpState.CANCELLED_ACCEPTED
    [record] = ledger.open_reconciliations()
    assert (record.op_id, record.reason) == (op.id, ReconciliationReason.EFFECT_RECONCILIATION_REQUIRED)
    # A second late completion finds the record open and opens no other.
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert len(ledger.open_reconciliations()) == 1


def _spawn(target: Any, args_for: list[tuple[Any, ...]]) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(args_for))
    out = context.Queue()
    processes = [context.Process(target=target, args=(*args, barrier, out)) for args in args_for]
    for process in processes:
        process.start()
    results = [out.get(timeout=90) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    return results


RACERS = 20


def test_twenty_processes_accept_the_same_operation_at_once(ledger: Ledger, database_url: str) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    evidence = evidence_for(op, TerminalKind.COMPLETED)
    started = time.perf_counter()
    outcomes = _spawn(races.accept, [(database_url, str(op.id), evidence)] * RACERS)
    elapsed = time.perf_counter() - started

    names = sorted(outcome for outcome, _ in outcomes)
    assert names.count("accepted") == 1
    assert names.count("already_accepted") == RACERS - 1
    assert _counts(ledger, op.id) == (1, 1)
    slowest = max(seconds for _, seconds in outcomes)
    print(
        f"\nrace: {RACERS} processes, 1 accepted, {RACERS - 1} already_accepted, 1 receipt, 1 outbox row; "
        f"slowest accept_terminal {slowest * 1000:.1f} ms; whole run {elapsed:.2f} s"
    )


def test_twenty_processes_submit_the_same_call_node_at_once(ledger: Ledger, database_url: str) -> None:
    results = _spawn(races.submit, [(database_url, "node-raced")] * RACERS)
    assert len({op_id for op_id, _ in results}) == 1
    assert sorted(created for _, created in results).count(True) == 1
    with ledger.engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM tool_operation WHERE call_node_id = 'node-raced'"))
        assert count.scalar_one() == 1


def test_two_drainers_deliver_each_outbox_row_once(ledger: Ledger, database_url: str) -> None:
    accepted: list[int] = []
    for _ in range(120):
        op = place(ledger, OpState.FETCHING_RESULT)
        acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
        assert acceptance.outbox_id is not None
        accepted.append(acceptance.outbox_id)
    results = dict(_spawn(races.drain, [(database_url, "a"), (database_url, "b")]))

    delivered = results["a"] + results["b"]
    assert sorted(delivered) == sorted(accepted)  # every row, each exactly once
    assert ledger.ready_outbox_count() == 0
    print(f"\ndrainers: 120 rows, a delivered {len(results['a'])}, b delivered {len(results['b'])}, 0 twice")


def test_a_failed_publish_leaves_the_row_ready(ledger: Ledger) -> None:
    op = place(ledger, OpState.FETCHING_RESULT)
    ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))

    def broken(_: object) -> None:
        raise ConnectionError("broker down")

    report = ledger.drain_outbox(broken)
    assert (report.dispatched, len(report.failed)) == ((), 1)
    assert ledger.ready_outbox_count() == 1
    with ledger.engine.connect() as conn:
        row = conn.execute(text("SELECT attempts, last_error FROM outbox")).one()
    assert row.attempts == 1
    assert "broker down" in row.last_error


def test_submission_of_the_same_call_node_is_the_same_operation(ledger: Ledger) -> None:
    first = submit(ledger, "node-1")
    assert submit(ledger, "node-1").id == first.id
