"""A cancel asked for by call node id before the call node had an operation (``call_node_cancel``, issue 22):
taken by the call node's first submission, whose row is then born with the intent.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 10:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "call_node_cancel",
        sa.Column("call_node_id", sa.Text(), nullable=False),
        sa.Column(
            "requested_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.PrimaryKeyConstraint("call_node_id", name=op.f("pk_call_node_cancel")),
    )


def downgrade() -> None:
    op.drop_table("call_node_cancel")
