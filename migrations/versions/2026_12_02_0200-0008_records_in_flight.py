"""Records in flight: a cursor held at the start of an accounting gap, and the managed jobs
that have ended but whose final record accounting does not have yet.

`cursor` gains `held_since` and `held_reason`: while slurmdbd is unreachable or slurmctld
still holds records for it, the finished-job cursor stays where it was, and says since when
and why. `awaited_record` holds each lineage job that has left slurmctld's queue, looked up
by its id until accounting shows how it ended, so a failure cannot fall between windows
whatever an outage's length. Downgrade drops both.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cursor") as batch:
        batch.add_column(sa.Column("held_since", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("held_reason", sa.Text(), nullable=True))
    op.create_table(
        "awaited_record",
        sa.Column("slurm_job_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("lineage_id", sa.Integer(), nullable=False),
        sa.Column("left_queue_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("looked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("looks", sa.Integer(), nullable=False),
        sa.Column("accounting", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["lineage_id"], ["lineage.id"], name=op.f("fk_awaited_record_lineage_id_lineage")
        ),
        sa.PrimaryKeyConstraint("slurm_job_id", name=op.f("pk_awaited_record")),
    )


def downgrade() -> None:
    op.drop_table("awaited_record")
    with op.batch_alter_table("cursor") as batch:
        batch.drop_column("held_reason")
        batch.drop_column("held_since")
