"""Shadow and canary rollout and the launch gate (issue 12): operations routed in shadow, the legacy
outcome recorded beside a shadow operation, the canary's decision of every call node it answered (kept, so a
later submission gets the same answer), the reason of every control change, and the results of
simulation runs the gate reads.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 05:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TERMINAL = "'cancelled', 'completed', 'failed'"


def upgrade() -> None:
    op.add_column(
        "tool_operation", sa.Column("routing", sa.Text(), server_default=sa.text("'live'"), nullable=False)
    )
    op.create_check_constraint(
        op.f("ck_tool_operation_routing_known"), "tool_operation", "routing IN ('live', 'shadow')"
    )
    op.create_check_constraint(
        op.f("ck_tool_operation_shadow_never_delivered"),
        "tool_operation",
        "routing = 'live' OR (on_terminal IS NULL AND on_input IS NULL)",
    )
    op.add_column("executor_control_audit", sa.Column("reason", sa.Text(), nullable=True))
    op.create_table(
        "shadow_comparison",
        sa.Column("call_node_id", sa.Text(), nullable=False),
        sa.Column("legacy_terminal_state", sa.Text(), nullable=False),
        sa.Column("legacy_result_digest", sa.Text(), nullable=True),
        sa.Column("legacy_detail", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("recorded_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("longcall_terminal_state", sa.Text(), nullable=True),
        sa.Column("longcall_result_digest", sa.Text(), nullable=True),
        sa.Column("diverged", sa.Boolean(), nullable=True),
        sa.Column("compared_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            f"legacy_terminal_state IN ({TERMINAL})", name=op.f("ck_shadow_comparison_legacy_state_known")
        ),
        sa.CheckConstraint(
            f"longcall_terminal_state IS NULL OR longcall_terminal_state IN ({TERMINAL})",
            name=op.f("ck_shadow_comparison_longcall_state_known"),
        ),
        sa.CheckConstraint(
            "(diverged IS NULL) = (compared_at IS NULL)",
            name=op.f("ck_shadow_comparison_compared_with_verdict"),
        ),
        sa.PrimaryKeyConstraint("call_node_id", name=op.f("pk_shadow_comparison")),
    )
    op.create_table(
        "routing_decision",
        sa.Column("call_node_id", sa.Text(), nullable=False),
        sa.Column("routed", sa.Boolean(), nullable=False),
        sa.Column("percent", sa.Float(), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "percent >= 0 AND percent <= 100", name=op.f("ck_routing_decision_percent_in_range")
        ),
        sa.PrimaryKeyConstraint("call_node_id", name=op.f("pk_routing_decision")),
    )
    op.create_table(
        "simulation_run",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("series", sa.Integer(), nullable=False),
        sa.Column("protocols", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("divergences", sa.Integer(), nullable=False),
        sa.Column("second_operations", sa.Integer(), nullable=False),
        sa.Column("max_receipts_per_call_node", sa.Integer(), nullable=False),
        sa.Column("advances_without_receipt", sa.Integer(), nullable=False),
        sa.Column("late_completions_advanced", sa.Integer(), nullable=False),
        sa.Column("series_per_s", sa.Float(), nullable=False),
        sa.Column("failures", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.CheckConstraint("series >= 0", name=op.f("ck_simulation_run_series_non_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_simulation_run")),
    )
    op.create_index("ix_simulation_run_finished_at", "simulation_run", ["finished_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_simulation_run_finished_at", table_name="simulation_run")
    op.drop_table("simulation_run")
    op.drop_table("routing_decision")
    op.drop_table("shadow_comparison")
    op.drop_column("executor_control_audit", "reason")
    op.drop_constraint(op.f("ck_tool_operation_shadow_never_delivered"), "tool_operation", type_="check")
    op.drop_constraint(op.f("ck_tool_operation_routing_known"), "tool_operation", type_="check")
    op.drop_column("tool_operation", "routing")
