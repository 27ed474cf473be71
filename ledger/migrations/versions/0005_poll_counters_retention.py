"""Bounded growth (issue 8, item 15): unchanged polls and missing tokens are counted on the operation row
instead of written as events, and indexes for the retention of final operations' events and of dispatched
outbox rows.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tool_operation",
        sa.Column("unchanged_polls", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column(
        "tool_operation",
        sa.Column("no_token_count", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("tool_operation", sa.Column("last_polled_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        op.f("ck_tool_operation_poll_counters_non_negative"),
        "tool_operation",
        "unchanged_polls >= 0 AND no_token_count >= 0",
    )
    op.create_index("ix_operation_event_at", "operation_event", ["at"], unique=False)
    op.create_index(
        "ix_outbox_dispatched_at",
        "outbox",
        ["dispatched_at"],
        unique=False,
        postgresql_where=sa.text("status = 'dispatched'"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_outbox_dispatched_at", table_name="outbox", postgresql_where=sa.text("status = 'dispatched'")
    )
    op.drop_index("ix_operation_event_at", table_name="operation_event")
    op.drop_constraint(op.f("ck_tool_operation_poll_counters_non_negative"), "tool_operation", type_="check")
    op.drop_column("tool_operation", "last_polled_at")
    op.drop_column("tool_operation", "no_token_count")
    op.drop_column("tool_operation", "unchanged_polls")
