"""A table of named switches people flip from the CLI, starting with the global pause.

The flag lives in the record, not in a file beside one daemon, so every daemon on the same
database (the leader and its stand-bys) and every host running the CLI see the same switch.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 03:55:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "control_flag",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("set_by", sa.String(length=64), nullable=False),
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_control_flag")),
    )


def downgrade() -> None:
    op.drop_table("control_flag")
