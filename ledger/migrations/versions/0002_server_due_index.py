"""An index for claiming due operations server by server.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 09:01:43.830092
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_tool_operation_server_due",
        "tool_operation",
        ["server", "next_poll_at"],
        unique=False,
        postgresql_where=sa.text("next_poll_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_tool_operation_server_due",
        table_name="tool_operation",
        postgresql_where=sa.text("next_poll_at IS NOT NULL"),
    )
