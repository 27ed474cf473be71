"""The ledger tables of DESIGN §3, with their invariants as constraints, and the executor control row.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 08:45:44.260789
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "executor_control",
        sa.Column("id", sa.SmallInteger(), nullable=False),
        sa.Column("execution_epoch", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("admission_open", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column(
            "disabled_adapters",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'[]'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "rollout",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("execution_epoch >= 1", name=op.f("ck_executor_control_epoch_positive")),
        sa.CheckConstraint("id = 1", name=op.f("ck_executor_control_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_executor_control")),
    )
    op.execute("INSERT INTO executor_control (id) VALUES (1)")
    op.create_table(
        "executor_control_audit",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("before", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("after", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_executor_control_audit")),
    )
    op.create_table(
        "tool_operation",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("call_node_id", sa.Text(), nullable=False),
        sa.Column("request_digest", sa.Text(), nullable=False),
        sa.Column("tool_name", sa.Text(), nullable=False),
        sa.Column("tool_descriptor_version", sa.Text(), nullable=True),
        sa.Column("body", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("server", sa.Text(), nullable=False),
        sa.Column("protocol", sa.Text(), nullable=False),
        sa.Column("protocol_version", sa.Text(), nullable=False),
        sa.Column("adapter_version", sa.Text(), nullable=False),
        sa.Column("remote_id", sa.Text(), nullable=True),
        sa.Column("session_ref", sa.Text(), nullable=True),
        sa.Column("submission_key", sa.UUID(), nullable=False),
        sa.Column("submit_attempted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("server_state", sa.Text(), nullable=True),
        sa.Column("observed_terminal", sa.Text(), nullable=True),
        sa.Column("status_message", sa.Text(), nullable=True),
        sa.Column("poll_cursor", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_poll_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("poll_interval_ms", sa.Integer(), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ttl_ms", sa.BigInteger(), nullable=True),
        sa.Column("wait_deadline", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("input_round", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("input_request", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("input_schema_digest", sa.Text(), nullable=True),
        sa.Column("input_deadline", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancel_generation", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("execution_epoch", sa.Integer(), nullable=False),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("result_digest", sa.Text(), nullable=True),
        sa.Column("on_terminal", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("on_input", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("event_seq", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint(
            "next_poll_at IS NULL OR state NOT IN ('ACCEPTED', 'CANCELLED_ACCEPTED', 'INPUT_REQUIRED', 'NOT_FOUND_SAFE')",
            name=op.f("ck_tool_operation_not_polled_by_state"),
        ),
        sa.CheckConstraint(
            "observed_terminal IS NOT NULL OR state NOT IN ('ACCEPTED', 'CANCELLED_ACCEPTED', 'FETCHING_RESULT', 'TERMINAL_OBSERVED')",
            name=op.f("ck_tool_operation_observed_terminal_by_state"),
        ),
        sa.CheckConstraint(
            "observed_terminal IS NULL OR observed_terminal IN ('cancelled', 'completed', 'failed')",
            name=op.f("ck_tool_operation_observed_terminal_known"),
        ),
        sa.CheckConstraint("protocol IN ('aip151', 'mcp')", name=op.f("ck_tool_operation_protocol_known")),
        sa.CheckConstraint(
            "remote_id IS NOT NULL OR state NOT IN ('CANCEL_REQUESTED', 'INPUT_REQUIRED', 'WORKING')",
            name=op.f("ck_tool_operation_remote_id_by_state"),
        ),
        sa.CheckConstraint(
            "state <> 'ACCEPTED' OR result_digest IS NOT NULL",
            name=op.f("ck_tool_operation_accepted_has_digest"),
        ),
        sa.CheckConstraint(
            "state <> 'CANCELLED_ACCEPTED' OR result IS NULL",
            name=op.f("ck_tool_operation_cancelled_carries_no_result"),
        ),
        sa.CheckConstraint(
            "state <> 'INPUT_REQUIRED' OR (input_request IS NOT NULL AND input_round >= 1 AND input_deadline IS NOT NULL)",
            name=op.f("ck_tool_operation_input_required_has_request"),
        ),
        sa.CheckConstraint(
            "state IN ('ACCEPTED', 'CANCELLED_ACCEPTED', 'CANCEL_REQUESTED', 'FETCHING_RESULT', 'INPUT_REQUIRED', 'MANUAL_RECONCILIATION', 'NOT_FOUND_SAFE', 'SUBMISSION_UNKNOWN', 'SUBMITTING', 'TERMINAL_OBSERVED', 'WORKING')",
            name=op.f("ck_tool_operation_state_known"),
        ),
        sa.CheckConstraint(
            "submit_attempted_at IS NOT NULL OR state <> 'SUBMISSION_UNKNOWN'",
            name=op.f("ck_tool_operation_submission_unknown_attempted"),
        ),
        sa.CheckConstraint(
            "length(call_node_id) BETWEEN 1 AND 512", name=op.f("ck_tool_operation_call_node_id_length")
        ),
        sa.CheckConstraint(
            "poll_cursor >= 0 AND cancel_generation >= 0 AND execution_epoch >= 1 AND input_round >= 0",
            name=op.f("ck_tool_operation_counters_non_negative"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tool_operation")),
        sa.UniqueConstraint("call_node_id", name=op.f("uq_tool_operation_call_node_id")),
        sa.UniqueConstraint("server", "remote_id", name=op.f("uq_tool_operation_server_remote_id")),
        sa.UniqueConstraint("submission_key", name=op.f("uq_tool_operation_submission_key")),
    )
    op.create_index(
        "ix_tool_operation_due",
        "tool_operation",
        ["next_poll_at"],
        unique=False,
        postgresql_where=sa.text("next_poll_at IS NOT NULL"),
    )
    op.create_index("ix_tool_operation_state", "tool_operation", ["state"], unique=False)
    op.create_table(
        "operation_event",
        sa.Column("op_id", sa.UUID(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column(
            "at", sa.DateTime(timezone=True), server_default=sa.text("clock_timestamp()"), nullable=False
        ),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("from_state", sa.Text(), nullable=True),
        sa.Column("to_state", sa.Text(), nullable=True),
        sa.Column("server_state", sa.Text(), nullable=True),
        sa.Column("poll_cursor", sa.BigInteger(), nullable=True),
        sa.Column("cancel_generation", sa.Integer(), nullable=True),
        sa.Column("execution_epoch", sa.Integer(), nullable=True),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.CheckConstraint("seq >= 1", name=op.f("ck_operation_event_seq_positive")),
        sa.ForeignKeyConstraint(
            ["op_id"], ["tool_operation.id"], name=op.f("fk_operation_event_op_id_tool_operation")
        ),
        sa.PrimaryKeyConstraint("op_id", "seq", name=op.f("pk_operation_event")),
    )
    op.create_table(
        "reconciliation",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("op_id", sa.UUID(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("resolution", sa.Text(), nullable=True),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "reason IN ('DEADLINE_EXCEEDED', 'EFFECT_RECONCILIATION_REQUIRED', 'PROTOCOL_VIOLATION', 'SUBMISSION_UNKNOWN', 'UNKNOWN_NOT_FOUND')",
            name=op.f("ck_reconciliation_reason_known"),
        ),
        sa.CheckConstraint(
            "(resolved_at IS NULL) = (resolution IS NULL)",
            name=op.f("ck_reconciliation_resolved_with_resolution"),
        ),
        sa.ForeignKeyConstraint(
            ["op_id"], ["tool_operation.id"], name=op.f("fk_reconciliation_op_id_tool_operation")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconciliation")),
    )
    op.create_index(
        "ix_reconciliation_open_deadline",
        "reconciliation",
        ["deadline"],
        unique=False,
        postgresql_where=sa.text("resolved_at IS NULL"),
    )
    op.create_index(
        "uq_reconciliation_open",
        "reconciliation",
        ["op_id", "reason"],
        unique=True,
        postgresql_where=sa.text("resolved_at IS NULL"),
    )
    op.create_table(
        "terminal_receipt",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("op_id", sa.UUID(), nullable=False),
        sa.Column("call_node_id", sa.Text(), nullable=False),
        sa.Column("request_digest", sa.Text(), nullable=False),
        sa.Column("remote_id", sa.Text(), nullable=True),
        sa.Column("tool_descriptor_version", sa.Text(), nullable=True),
        sa.Column("execution_epoch", sa.Integer(), nullable=False),
        sa.Column("cancel_generation", sa.Integer(), nullable=False),
        sa.Column("terminal_state", sa.Text(), nullable=False),
        sa.Column("result_digest", sa.Text(), nullable=True),
        sa.Column("audit", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("accepted_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "terminal_state = 'cancelled' OR result_digest IS NOT NULL",
            name=op.f("ck_terminal_receipt_digest_unless_cancelled"),
        ),
        sa.CheckConstraint(
            "terminal_state IN ('cancelled', 'completed', 'failed')",
            name=op.f("ck_terminal_receipt_terminal_state_known"),
        ),
        sa.ForeignKeyConstraint(
            ["op_id"], ["tool_operation.id"], name=op.f("fk_terminal_receipt_op_id_tool_operation")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_terminal_receipt")),
        sa.UniqueConstraint("call_node_id", name=op.f("uq_terminal_receipt_call_node_id")),
        sa.UniqueConstraint("op_id", name=op.f("uq_terminal_receipt_op_id")),
    )
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("receipt_id", sa.UUID(), nullable=True),
        sa.Column("op_id", sa.UUID(), nullable=False),
        sa.Column("input_round", sa.Integer(), nullable=True),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'ready'"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(kind = 'terminal' AND receipt_id IS NOT NULL AND input_round IS NULL) OR (kind = 'input_required' AND input_round IS NOT NULL AND receipt_id IS NULL)",
            name=op.f("ck_outbox_kind_columns"),
        ),
        sa.CheckConstraint(
            "(status = 'dispatched') = (dispatched_at IS NOT NULL)",
            name=op.f("ck_outbox_dispatched_when_dispatched"),
        ),
        sa.CheckConstraint("kind IN ('input_required', 'terminal')", name=op.f("ck_outbox_kind_known")),
        sa.CheckConstraint("status IN ('dispatched', 'ready')", name=op.f("ck_outbox_status_known")),
        sa.ForeignKeyConstraint(
            ["op_id"], ["tool_operation.id"], name=op.f("fk_outbox_op_id_tool_operation")
        ),
        sa.ForeignKeyConstraint(
            ["receipt_id"], ["terminal_receipt.id"], name=op.f("fk_outbox_receipt_id_terminal_receipt")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
        sa.UniqueConstraint("receipt_id", name=op.f("uq_outbox_receipt_id")),
    )
    op.create_index("ix_outbox_op_id", "outbox", ["op_id"], unique=False)
    op.create_index(
        "ix_outbox_ready", "outbox", ["id"], unique=False, postgresql_where=sa.text("status = 'ready'")
    )
    op.create_index(
        "uq_outbox_input_round",
        "outbox",
        ["op_id", "input_round"],
        unique=True,
        postgresql_where=sa.text("kind = 'input_required'"),
    )


def downgrade() -> None:
    op.drop_index(
        "uq_outbox_input_round", table_name="outbox", postgresql_where=sa.text("kind = 'input_required'")
    )
    op.drop_index("ix_outbox_ready", table_name="outbox", postgresql_where=sa.text("status = 'ready'"))
    op.drop_index("ix_outbox_op_id", table_name="outbox")
    op.drop_table("outbox")
    op.drop_table("terminal_receipt")
    op.drop_index(
        "uq_reconciliation_open", table_name="reconciliation", postgresql_where=sa.text("resolved_at IS NULL")
    )
    op.drop_index(
        "ix_reconciliation_open_deadline",
        table_name="reconciliation",
        postgresql_where=sa.text("resolved_at IS NULL"),
    )
    op.drop_table("reconciliation")
    op.drop_table("operation_event")
    op.drop_index("ix_tool_operation_state", table_name="tool_operation")
    op.drop_index(
        "ix_tool_operation_due",
        table_name="tool_operation",
        postgresql_where=sa.text("next_poll_at IS NOT NULL"),
    )
    op.drop_table("tool_operation")
    op.drop_table("executor_control_audit")
    op.drop_table("executor_control")
