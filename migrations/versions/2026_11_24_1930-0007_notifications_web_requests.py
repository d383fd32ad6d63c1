"""The people's side: notifications recorded before they are sent (`notification`), and the
web page's state changes by idempotency key (`web_request`).

Two new tables; nothing existing changes. Downgrade drops them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 19:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Spelled out, as in 0001: the enums will have moved on by the time this runs.
EVENTS = ("approval_waiting", "run_given_up", "run_escalated", "node_drained")
CHANNELS = ("mail", "webhook")
STATES = ("pending", "sent", "given_up", "suppressed")


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def upgrade() -> None:
    op.create_table(
        "notification",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("event", sa.String(length=24), nullable=False),
        sa.Column("subject", sa.String(length=64), nullable=False),
        sa.Column("channel", sa.String(length=8), nullable=False),
        sa.Column("recipient", sa.String(length=320), nullable=False),
        sa.Column("dedupe", sa.String(length=512), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(f"event IN ({_in(EVENTS)})", name=op.f("ck_notification_event")),
        sa.CheckConstraint(f"channel IN ({_in(CHANNELS)})", name=op.f("ck_notification_channel")),
        sa.CheckConstraint(f"state IN ({_in(STATES)})", name=op.f("ck_notification_state")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notification")),
        sa.UniqueConstraint("dedupe", name=op.f("uq_notification_dedupe")),
    )
    op.create_index("ix_notification_state_next", "notification", ["state", "next_attempt_at"])
    op.create_table(
        "web_request",
        sa.Column("idempotency_key", sa.String(length=64), nullable=False),
        sa.Column("actor_name", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("idempotency_key", name=op.f("pk_web_request")),
    )


def downgrade() -> None:
    op.drop_table("web_request")
    op.drop_index("ix_notification_state_next", table_name="notification")
    op.drop_table("notification")
