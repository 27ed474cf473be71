"""An index of each server's due rows that are not WORKING (a cancel to send or confirm, a result to fetch, a
create's or a lookup's retry), which the dispatcher claims before the server's polls (issue 21): small,
whatever the backlog of polls.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 17:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHERE = sa.text("next_poll_at IS NOT NULL AND state <> 'WORKING'")


def upgrade() -> None:
    op.create_index(
        "ix_tool_operation_server_due_not_working",
        "tool_operation",
        ["server", "next_poll_at"],
        unique=False,
        postgresql_where=WHERE,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_tool_operation_server_due_not_working", table_name="tool_operation", postgresql_where=WHERE
    )
