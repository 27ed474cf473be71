"""Receipt evidence (rule 8): what makes evidence acceptable on its own, a replay of the accepted receipt,
or a mismatch with the row; and the receipt as the downstream task receives it. Pure: no SQL here."""

from __future__ import annotations

from typing import Any

from ledger.digests import digest
from ledger.records import Operation, Receipt, TerminalEvidence
from ledger.states import ACCEPT_FROM, OpState, TerminalKind


def receipt_payload(receipt: Receipt, result: Any) -> dict[str, Any]:
    """The receipt as the downstream task receives it (``outbox_id`` is added when it is delivered)."""
    return {
        "receipt_id": str(receipt.id),
        "op_id": str(receipt.op_id),
        "call_node_id": receipt.call_node_id,
        "request_digest": receipt.request_digest,
        "remote_id": receipt.remote_id,
        "terminal_state": receipt.terminal_state.value,
        "result_digest": receipt.result_digest,
        "result": result if receipt.terminal_state is not TerminalKind.CANCELLED else None,
        "execution_epoch": receipt.execution_epoch,
        "cancel_generation": receipt.cancel_generation,
        "accepted_at": receipt.accepted_at.isoformat(),
    }


def evidence_problems(evidence: TerminalEvidence) -> list[str]:
    """What is wrong with the evidence on its own, before it is matched against the row."""
    problems: list[str] = []
    kind = TerminalKind(evidence.terminal_state)
    if kind is TerminalKind.CANCELLED:
        if evidence.result is not None:
            problems.append("result: a cancelled terminal never carries a result (use audit)")
    elif evidence.result is None or evidence.result_digest is None:
        problems.append("result: a completed or failed terminal needs the whole result and its digest")
    elif digest(evidence.result) != evidence.result_digest:
        problems.append("result_digest: does not match the result")
    return problems


def same_receipt(receipt: Receipt, evidence: TerminalEvidence) -> bool:
    """A replay of the evidence that was accepted (a redelivered task): answered with the held receipt."""
    return (
        receipt.call_node_id == evidence.call_node_id
        and receipt.request_digest == evidence.request_digest
        and receipt.remote_id == evidence.remote_id
        and receipt.tool_descriptor_version == evidence.tool_descriptor_version
        and receipt.execution_epoch == evidence.execution_epoch
        and receipt.cancel_generation == evidence.cancel_generation
        and receipt.terminal_state is TerminalKind(evidence.terminal_state)
        and receipt.result_digest == evidence.result_digest
    )


def row_mismatches(op: Operation, evidence: TerminalEvidence, kind: TerminalKind) -> list[str]:
    checks = {
        "state": op.state in ACCEPT_FROM[kind],
        "call_node_id": op.call_node_id == evidence.call_node_id,
        "request_digest": op.request_digest == evidence.request_digest,
        "remote_id": op.remote_id == evidence.remote_id,
        "tool_descriptor_version": op.tool_descriptor_version == evidence.tool_descriptor_version,
        "execution_epoch": op.execution_epoch == evidence.execution_epoch,
        "cancel_generation": op.cancel_generation == evidence.cancel_generation,
        "terminal_state": op.observed_terminal is kind
        or (kind is TerminalKind.CANCELLED and op.state is OpState.CANCEL_REQUESTED)
        or (
            kind is TerminalKind.CANCELLED
            and op.state is OpState.SUBMITTING
            and op.submit_attempted_at is None
            and op.cancel_generation > 0
        ),
    }
    return [name for name, ok in checks.items() if not ok]
