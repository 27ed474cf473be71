"""operation_event.kind is one of the known event kinds (ledger/events.py).

The list is written out here, as it stood at this revision: a later kind is added by a later migration, so
replaying history never depends on today's code. ``tests/unit/test_states.py`` checks that the head revision's
list is ``EventKind``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = (
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


def upgrade() -> None:
    listed = ", ".join(f"'{kind}'" for kind in sorted(KINDS))
    op.create_check_constraint(
        op.f("ck_operation_event_kind_known"), "operation_event", f"kind IN ({listed})"
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_operation_event_kind_known"), "operation_event", type_="check")
