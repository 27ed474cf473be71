"""The vocabulary and columns of the third hardening pass (issue 19): event kinds and reconciliation reasons
(a create never sent, an input reply stored and sent, a dead-lettered outbox row; a result unreadable, an
input reply the server never took, a server no longer configured, an undeliverable outbox row), the stored
input reply (``tool_operation.input_reply``), the outbox's dead letters and retry pause
(``outbox.status = 'dead'``, ``outbox.next_attempt_at``), the owner of the execution epoch
(``executor_control.epoch_owner``) and the dispatch ticks' counter (sequence ``dispatch_tick``: the rotation
that gives every server its turn in a tick, rule 3).

Both lists are written out as they stand at this revision, so replaying history never depends on today's
code; ``tests/unit/test_states.py`` checks that the head revision's lists are ``EventKind`` and
``ReconciliationReason``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 22:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = (
    "adapter_disabled",
    "cancel_failed",
    "cancel_pending",
    "cancel_read_failed",
    "cancel_refused",
    "cancel_requested",
    "capabilities_failed",
    "create_attempted",
    "create_never_sent",
    "create_refused_before_work",
    "created",
    "fetching_result",
    "found_by_key",
    "input_provided",
    "input_refused",
    "input_reply_failed",
    "input_reply_sent",
    "input_required",
    "input_unreadable",
    "lookup_failed",
    "manual_reconciliation",
    "never_created",
    "no_token",
    "outbox_dead_lettered",
    "outbox_resent",
    "outcome_from_result",
    "poll_failed",
    "polled",
    "ran_synchronously",
    "rate_limited",
    "reconciliation_opened",
    "reconciliation_overdue",
    "rejected",
    "resolved_found",
    "resolved_never_created",
    "resolved_terminal",
    "resubmission",
    "result_contradicts_status",
    "result_failed",
    "stale_write_rejected",
    "submission_unknown",
    "submitted",
    "terminal_accepted",
    "terminal_observed",
    "transition",
)

REASONS = (
    "DEADLINE_EXCEEDED",
    "EFFECT_RECONCILIATION_REQUIRED",
    "INPUT_REPLY_NOT_TAKEN",
    "INPUT_UNREADABLE",
    "OUTBOX_UNDELIVERABLE",
    "PROTOCOL_VIOLATION",
    "RESULT_CONTRADICTS_STATUS",
    "RESULT_UNREADABLE",
    "RESULT_UNSTORABLE",
    "SERVER_UNCONFIGURED",
    "SUBMISSION_UNKNOWN",
    "UNKNOWN_NOT_FOUND",
)

#: The lists this revision replaces (0004's), for the downgrade.
_PREVIOUS_KINDS = (
    "adapter_disabled",
    "cancel_failed",
    "cancel_pending",
    "cancel_read_failed",
    "cancel_refused",
    "cancel_requested",
    "capabilities_failed",
    "create_attempted",
    "create_refused_before_work",
    "created",
    "fetching_result",
    "found_by_key",
    "input_provided",
    "input_refused",
    "input_reply_failed",
    "input_required",
    "input_unreadable",
    "lookup_failed",
    "manual_reconciliation",
    "never_created",
    "no_token",
    "outcome_from_result",
    "poll_failed",
    "polled",
    "ran_synchronously",
    "rate_limited",
    "reconciliation_opened",
    "reconciliation_overdue",
    "rejected",
    "resolved_found",
    "resolved_never_created",
    "resolved_terminal",
    "resubmission",
    "result_contradicts_status",
    "result_failed",
    "stale_write_rejected",
    "submission_unknown",
    "submitted",
    "terminal_accepted",
    "terminal_observed",
    "transition",
)

_PREVIOUS_REASONS = (
    "DEADLINE_EXCEEDED",
    "EFFECT_RECONCILIATION_REQUIRED",
    "INPUT_UNREADABLE",
    "PROTOCOL_VIOLATION",
    "RESULT_CONTRADICTS_STATUS",
    "RESULT_UNSTORABLE",
    "SUBMISSION_UNKNOWN",
    "UNKNOWN_NOT_FOUND",
)


def _listed(values: Sequence[str]) -> str:
    return ", ".join(f"'{value}'" for value in sorted(values))


def _replace(kinds: Sequence[str], reasons: Sequence[str]) -> None:
    op.drop_constraint(op.f("ck_operation_event_kind_known"), "operation_event", type_="check")
    op.create_check_constraint(
        op.f("ck_operation_event_kind_known"), "operation_event", f"kind IN ({_listed(kinds)})"
    )
    op.drop_constraint(op.f("ck_reconciliation_reason_known"), "reconciliation", type_="check")
    op.create_check_constraint(
        op.f("ck_reconciliation_reason_known"), "reconciliation", f"reason IN ({_listed(reasons)})"
    )


def _outbox_statuses(statuses: Sequence[str]) -> None:
    op.drop_constraint(op.f("ck_outbox_status_known"), "outbox", type_="check")
    op.create_check_constraint(op.f("ck_outbox_status_known"), "outbox", f"status IN ({_listed(statuses)})")


def upgrade() -> None:
    _replace(KINDS, REASONS)
    _outbox_statuses(("dead", "dispatched", "ready"))
    op.add_column("outbox", sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "tool_operation", sa.Column("input_reply", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )
    op.add_column("executor_control", sa.Column("epoch_owner", sa.Text(), nullable=True))
    op.execute(sa.schema.CreateSequence(sa.Sequence("dispatch_tick")))


def downgrade() -> None:
    op.execute(sa.schema.DropSequence(sa.Sequence("dispatch_tick")))
    op.drop_column("executor_control", "epoch_owner")
    op.drop_column("tool_operation", "input_reply")
    op.drop_column("outbox", "next_attempt_at")
    op.execute("UPDATE outbox SET status = 'ready' WHERE status = 'dead'")
    _outbox_statuses(("dispatched", "ready"))
    _replace(_PREVIOUS_KINDS, _PREVIOUS_REASONS)
