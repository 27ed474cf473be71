"""Rule 11, the operator's side: unanswered input rounds handed over, overdue records flagged, and an
operator's evidence-backed decision on an operation in MANUAL_RECONCILIATION applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from ledger.errors import StaleTransition
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation
from ledger.states import OpState, TerminalKind
from workers.errors import WrongState
from workers.steps.context import StepContext

log = logging.getLogger("longcall.executor")

#: The protocols, by (protocol, version), whose tasks are bound to the session that created them: MCP
#: 2025-11-25 over Streamable HTTP (a stateful server answers every read of a task without its
#: ``Mcp-Session-Id`` "400 Missing session ID", one on another session "not found"). The session is
#: recorded on the operation from the create's answer; when that answer was lost, only the operator's
#: evidence can name it.
SESSION_BOUND: frozenset[tuple[str, str]] = frozenset({("mcp", "2025-11-25")})


@dataclass(frozen=True, slots=True)
class Resolution:
    """An operator's evidence-backed decision (``longcall reconcile``)."""

    kind: Literal["found", "never_created", "terminal"]
    evidence: str
    actor: str
    remote_id: str | None = None
    session_ref: str | None = None
    terminal: TerminalKind | None = None


def reconcile(ctx: StepContext) -> dict[str, int]:
    """Hand unanswered input rounds past their deadline to an operator, report what waits for one, flag
    each record past its deadline once (a ``reconciliation_overdue`` event) so alerting can key on it, and
    apply the retention of final operations' events and dispatched outbox rows (DESIGN §3)."""
    now = ctx.now()
    unanswered = 0
    for op in ctx.ledger.overdue_inputs():
        # Nobody answered in time: the server still waits, so an operator decides (cancel or answer late).
        try:
            ctx.hand_to_operator(
                op,
                Fence(op.execution_epoch, op.cancel_generation),
                ReconciliationReason.DEADLINE_EXCEEDED,
                {"why": f"input round {op.input_round} was not answered before its deadline"},
            )
            unanswered += 1
        except StaleTransition:
            continue
    records = ctx.ledger.open_reconciliations()
    overdue = [r for r in records if r.deadline <= now and not r.detail.get("overdue_flagged")]
    for record in overdue:
        ctx.ledger.flag_overdue(record.id)
        log.warning(
            "reconciliation %s of %s (%s) is past its deadline", record.id, record.op_id, record.reason
        )
    purged = ctx.ledger.purge_history(
        event_retention_s=ctx.settings.event_retention_s, outbox_retention_s=ctx.settings.outbox_retention_s
    )
    return {
        "open": len(records),
        "newly_overdue": len(overdue),
        "inputs_timed_out": unanswered,
        "events_purged": purged.events,
        "outbox_purged": purged.outbox_rows,
    }


def resolve(ctx: StepContext, op: Operation, resolution: Resolution) -> Operation:
    """Apply an operator's decision; open records of the operation are closed with the evidence.

    ``found``: the operation exists on the server under ``remote_id`` -> WORKING, polled at once. On a
    protocol whose tasks are bound to a session (:data:`SESSION_BOUND`) with none recorded, the resolution
    names it (``session_ref``; an empty one says the server keeps no sessions): without it every status
    read would be refused.
    ``never_created``: the operator proved it never ran -> NOT_FOUND_SAFE -> SUBMITTING with the same
    submission key (the only resubmission there is). ``terminal``: it ended on the server -> its result is
    fetched and accepted like any other. With a cancel requested (rule 6): ``found`` goes to
    CANCEL_REQUESTED and the cancel is sent; ``never_created`` ends CANCELLED_ACCEPTED with no create (the
    create step finds the intent before it makes any call).

    Raises:
        WrongState: the operation is not waiting for an operator.
        ValueError: the resolution lacks what its kind needs.
    """
    if op.state is not OpState.MANUAL_RECONCILIATION:
        raise WrongState(f"operation {op.id} is {op.state}, not waiting for an operator")
    fence = Fence(op.execution_epoch, op.cancel_generation)
    note = f"{resolution.kind} by {resolution.actor}: {resolution.evidence}"
    detail = {"actor": resolution.actor, "evidence": resolution.evidence}
    if resolution.kind == "found":
        if not resolution.remote_id:
            raise ValueError("a 'found' resolution names the remote id")
        if (
            resolution.session_ref is None
            and op.session_ref is None
            and (op.protocol, op.protocol_version) in SESSION_BOUND
        ):
            raise ValueError(
                f"operation {op.id} is on {op.server} ({op.protocol} {op.protocol_version}), whose tasks are "
                "read on the session that created them, and no session is recorded: give --session "
                "SESSION_ID (the Mcp-Session-Id the task was created on; --session '' if the server keeps "
                "no sessions)"
            )
        return ctx.ledger.resolve_found(
            op.id,
            fence,
            remote_id=resolution.remote_id,
            session_ref=resolution.session_ref or op.session_ref,
            detail=detail,
            resolution=note,
            cancel_above=0,  # any cancel requested, before or while the operator decided, is sent now
        )
    if resolution.kind == "never_created":
        return ctx.ledger.resubmit(op.id, fence, from_state=op.state, detail=detail, resolution=note)
    if resolution.terminal is None:
        raise ValueError("a 'terminal' resolution names the terminal state")
    remote_id = resolution.remote_id or op.remote_id
    if remote_id is None and resolution.terminal is not TerminalKind.CANCELLED:
        raise ValueError("the result of a completed or failed operation is fetched by its remote id")
    return ctx.ledger.resolve_terminal(
        op.id,
        fence,
        remote_id=remote_id,
        kind=resolution.terminal,
        detail=detail,
        resolution=note,
    )
