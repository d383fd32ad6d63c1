"""The fleet sweep's record: each node probe judged (`node_check`), and who drained or resumed
a node, on what finding, with the probe at that moment (`node_event`'s new columns).

Existing node events keep NULL in the new columns: they were an incident's drains and a
person's resumes, and the old record does not say more. Downgrade drops what upgrade added.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Spelled out, as in 0001: the enums will have moved on by the time this runs.
TRIGGERS = ("schedule", "after_job", "command", "cordon")
HEALTHS = ("healthy", "degraded", "faulty", "unreachable")


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def upgrade() -> None:
    op.create_table(
        "node_check",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column("health", sa.String(length=16), nullable=False),
        sa.Column("deciding", sa.Text(), nullable=False),
        sa.Column("kinds", sa.String(length=512), nullable=False),
        sa.Column("findings", sa.JSON(), nullable=False),
        sa.Column("notes", sa.JSON(), nullable=False),
        sa.Column("gpus_seen", sa.Integer(), nullable=False),
        sa.Column("gpus_expected", sa.Integer(), nullable=True),
        sa.Column("running_jobs", sa.JSON(), nullable=False),
        sa.Column("after_job_id", sa.BigInteger(), nullable=True),
        sa.Column("decision", sa.String(length=24), nullable=False),
        sa.Column("decision_reason", sa.Text(), nullable=False),
        sa.Column("actor_name", sa.String(length=64), nullable=False),
        sa.CheckConstraint(f"trigger IN ({_in(TRIGGERS)})", name=op.f("ck_node_check_trigger")),
        sa.CheckConstraint(f"health IN ({_in(HEALTHS)})", name=op.f("ck_node_check_health")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_check")),
    )
    op.create_index("ix_node_check_node_id", "node_check", ["node", "id"])
    op.create_index("ix_node_check_checked_at", "node_check", ["checked_at"])
    with op.batch_alter_table("node_event") as batch:
        batch.add_column(sa.Column("actor_name", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("finding", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("check_id", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_node_event_check_id_node_check"), "node_check", ["check_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("node_event") as batch:
        batch.drop_constraint(op.f("fk_node_event_check_id_node_check"), type_="foreignkey")
        batch.drop_column("check_id")
        batch.drop_column("finding")
        batch.drop_column("actor_name")
    op.drop_index("ix_node_check_checked_at", table_name="node_check")
    op.drop_index("ix_node_check_node_id", table_name="node_check")
    op.drop_table("node_check")
