"""The vocabulary of the hardening issue (issue 8): event kinds and reconciliation reasons.

Both lists are written out as they stand at this revision, so replaying history never depends on today's
code. A kind or reason added by issue 8 is appended here (the revision is not released yet);
``tests/unit/test_states.py`` checks that the head revision's lists are ``EventKind`` and
``ReconciliationReason``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 02:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = (
    "adapter_disabled",
    "input_unreadable",
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
    "result_failed",
    "stale_write_rejected",
    "submission_unknown",
    "submitted",
    "terminal_accepted",
    "terminal_observed",
    "transition",
    "result_contradicts_status",
)

REASONS = (
    "INPUT_UNREADABLE",
    "DEADLINE_EXCEEDED",
    "EFFECT_RECONCILIATION_REQUIRED",
    "PROTOCOL_VIOLATION",
    "SUBMISSION_UNKNOWN",
    "UNKNOWN_NOT_FOUND",
    "RESULT_CONTRADICTS_STATUS",
    "RESULT_UNSTORABLE",
)

#: The lists this revision replaces (0003's kinds, 0001's reasons), for the downgrade.
_PREVIOUS_KINDS = (
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
    "PROTOCOL_VIOLATION",
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


def upgrade() -> None:
    _replace(KINDS, REASONS)


def downgrade() -> None:
    _replace(_PREVIOUS_KINDS, _PREVIOUS_REASONS)
