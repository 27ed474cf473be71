"""Receipt evidence (rule 8): what makes evidence acceptable on its own, a replay of the accepted receipt,
or a mismatch with the row; and the receipt as the downstream task receives it. Pure: no SQL here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.digests import digest
from ledger.records import Operation, Receipt, TerminalEvidence
from ledger.states import ACCEPT_FROM, OpState, TerminalKind


@dataclass(frozen=True, slots=True)
class EvidenceField:
    """One piece of evidence: a field of :class:`TerminalEvidence`, a column of the operation's row (matched
    in the acceptance's guard, bound as ``:ev_<name>``) and a column of its receipt (copied from the row)."""

    name: str
    #: NULL on the row until known (a remote id before the create answers): matched IS NOT DISTINCT FROM.
    nullable: bool = False


#: What an acceptance matches against the row and keeps in the receipt (rule 8), in the order of the
#: acceptance's guard (``ledger/acceptance.py``), the receipt's columns, a replay's check
#: (:func:`same_receipt`) and the mismatches a refusal names (:func:`row_mismatches`).
EVIDENCE_FIELDS = (
    EvidenceField("call_node_id"),
    EvidenceField("request_digest"),
    EvidenceField("remote_id", nullable=True),
    EvidenceField("tool_descriptor_version", nullable=True),
    EvidenceField("execution_epoch"),
    EvidenceField("cancel_generation"),
)


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
        all(getattr(receipt, f.name) == getattr(evidence, f.name) for f in EVIDENCE_FIELDS)
        and receipt.terminal_state is TerminalKind(evidence.terminal_state)
        and receipt.result_digest == evidence.result_digest
    )


def row_mismatches(op: Operation, evidence: TerminalEvidence, kind: TerminalKind) -> list[str]:
    """What of the row the evidence does not match (the guard of ``accept_update``, asked in Python to
    say why it refused): the state, each of :data:`EVIDENCE_FIELDS`, the observed terminal state."""
    checks = {
        "state": op.state in ACCEPT_FROM[kind],
        **{f.name: getattr(op, f.name) == getattr(evidence, f.name) for f in EVIDENCE_FIELDS},
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
