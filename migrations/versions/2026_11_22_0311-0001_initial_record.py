"""The record's tables: lineage, job, incident, proposal, template revision, action, node
event, audit event and cursor, with the indexes for the questions people ask.

Self-contained on purpose: it spells out every column rather than importing the models,
which will have moved on by the time this runs on an old database.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 03:11:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor_kind", sa.String(length=16), nullable=False),
        sa.Column("actor_name", sa.String(length=64), nullable=False),
        sa.Column("actor_uid", sa.Integer(), nullable=True),
        sa.Column("verb", sa.String(length=64), nullable=False),
        sa.Column("subject_type", sa.String(length=32), nullable=False),
        sa.Column("subject_id", sa.String(length=64), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.CheckConstraint(
            "actor_kind IN ('daemon', 'user')", name=op.f("ck_audit_event_actor_kind")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_event")),
    )
    op.create_index("ix_audit_event_actor_name", "audit_event", ["actor_name", "at"], unique=False)
    op.create_index("ix_audit_event_at", "audit_event", ["at"], unique=False)
    op.create_index(
        "ix_audit_event_subject", "audit_event", ["subject_type", "subject_id", "id"], unique=False
    )
    op.create_table(
        "cursor",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("polled_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_cursor")),
    )
    op.create_table(
        "lineage",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("template", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('active', 'verified', 'exhausted', 'abandoned')",
            name=op.f("ck_lineage_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lineage")),
    )
    op.create_index("ix_lineage_owner_created", "lineage", ["owner", "created_at"], unique=False)
    op.create_table(
        "job",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("slurm_job_id", sa.BigInteger(), nullable=False),
        sa.Column("lineage_id", sa.Integer(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("user_name", sa.String(length=64), nullable=False),
        sa.Column("uid", sa.Integer(), nullable=True),
        sa.Column("account", sa.String(length=64), nullable=True),
        sa.Column("partition", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("submit_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("start_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_time", sa.DateTime(timezone=True), nullable=True),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["lineage_id"], ["lineage.id"], name=op.f("fk_job_lineage_id_lineage")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job")),
        sa.UniqueConstraint("slurm_job_id", name=op.f("uq_job_slurm_job_id")),
    )
    op.create_index("ix_job_end_time", "job", ["end_time"], unique=False)
    op.create_index("ix_job_lineage_attempt", "job", ["lineage_id", "attempt"], unique=False)
    op.create_index("ix_job_user_end", "job", ["user_name", "end_time"], unique=False)
    op.create_table(
        "incident",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("lineage_id", sa.Integer(), nullable=True),
        sa.Column("slurm_job_id", sa.BigInteger(), nullable=False),
        sa.Column("user_name", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("confidence", sa.String(length=16), nullable=False),
        sa.Column("onset", sa.String(length=16), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("diagnosis", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], name=op.f("fk_incident_job_id_job")),
        sa.ForeignKeyConstraint(
            ["lineage_id"], ["lineage.id"], name=op.f("fk_incident_lineage_id_lineage")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incident")),
    )
    op.create_index("ix_incident_kind_occurred", "incident", ["kind", "occurred_at"], unique=False)
    op.create_index("ix_incident_lineage_id", "incident", ["lineage_id"], unique=False)
    op.create_index("ix_incident_job_id", "incident", ["job_id"], unique=False)
    op.create_index("ix_incident_node_occurred", "incident", ["node", "occurred_at"], unique=False)
    op.create_index("ix_incident_occurred_at", "incident", ["occurred_at"], unique=False)
    op.create_index("ix_incident_slurm_job_id", "incident", ["slurm_job_id"], unique=False)
    op.create_index(
        "ix_incident_user_occurred", "incident", ["user_name", "occurred_at"], unique=False
    )
    op.create_table(
        "proposal",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=False),
        sa.Column("lineage_id", sa.Integer(), nullable=True),
        sa.Column("remediator", sa.String(length=64), nullable=False),
        sa.Column("patch", sa.JSON(), nullable=False),
        sa.Column("rationale", sa.Text(), nullable=False),
        sa.Column("cost", sa.Float(), nullable=False),
        sa.Column("changes_science", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_by", sa.String(length=64), nullable=True),
        sa.Column("relaunch_job_id", sa.BigInteger(), nullable=True),
        sa.CheckConstraint(
            "state IN ('proposed', 'approved', 'rejected', 'expired', 'submitting', 'submitted',"
            " 'verifying', 'verified', 'failed', 'superseded')",
            name=op.f("ck_proposal_state"),
        ),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incident.id"], name=op.f("fk_proposal_incident_id_incident")
        ),
        sa.ForeignKeyConstraint(
            ["lineage_id"], ["lineage.id"], name=op.f("fk_proposal_lineage_id_lineage")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_proposal")),
    )
    op.create_index("ix_proposal_incident_id", "proposal", ["incident_id"], unique=False)
    op.create_index("ix_proposal_lineage_id", "proposal", ["lineage_id"], unique=False)
    op.create_index("ix_proposal_state_created", "proposal", ["state", "created_at"], unique=False)
    op.create_table(
        "action",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("proposal_id", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("argv", sa.JSON(), nullable=False),
        sa.Column("token", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("slurm_job_id", sa.BigInteger(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("stdout", sa.Text(), nullable=True),
        sa.Column("stderr", sa.Text(), nullable=True),
        sa.Column("result", sa.String(length=16), nullable=False),
        sa.CheckConstraint(
            "kind IN ('sbatch', 'scancel', 'drain', 'resume')", name=op.f("ck_action_kind")
        ),
        sa.CheckConstraint(
            "result IN ('pending', 'succeeded', 'failed', 'not_found')",
            name=op.f("ck_action_result"),
        ),
        sa.ForeignKeyConstraint(
            ["proposal_id"], ["proposal.id"], name=op.f("fk_action_proposal_id_proposal")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_action")),
        sa.UniqueConstraint("token", name=op.f("uq_action_token")),
    )
    op.create_index("ix_action_proposal_id", "action", ["proposal_id"], unique=False)
    op.create_index("ix_action_result_kind", "action", ["result", "kind"], unique=False)
    op.create_index("ix_action_slurm_job_id", "action", ["slurm_job_id"], unique=False)
    op.create_table(
        "template_revision",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("lineage_id", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("proposal_id", sa.Integer(), nullable=True),
        sa.Column("knobs", sa.JSON(), nullable=False),
        sa.Column("rendered_script", sa.Text(), nullable=False),
        sa.Column("script_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["lineage_id"], ["lineage.id"], name=op.f("fk_template_revision_lineage_id_lineage")
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["template_revision.id"],
            name=op.f("fk_template_revision_parent_id_template_revision"),
        ),
        sa.ForeignKeyConstraint(
            ["proposal_id"], ["proposal.id"], name=op.f("fk_template_revision_proposal_id_proposal")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_template_revision")),
    )
    op.create_index(
        "ix_template_revision_lineage_id", "template_revision", ["lineage_id"], unique=False
    )
    op.create_table(
        "node_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("by_medic", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("action_id", sa.Integer(), nullable=True),
        sa.CheckConstraint("kind IN ('drain', 'resume')", name=op.f("ck_node_event_kind")),
        sa.ForeignKeyConstraint(
            ["action_id"], ["action.id"], name=op.f("fk_node_event_action_id_action")
        ),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incident.id"], name=op.f("fk_node_event_incident_id_incident")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_event")),
    )
    op.create_index("ix_node_event_node_id", "node_event", ["node", "id"], unique=False)
    op.create_index("ix_node_event_occurred_at", "node_event", ["occurred_at"], unique=False)
    op.create_index("ix_node_event_incident_id", "node_event", ["incident_id"], unique=False)


def downgrade() -> None:
    op.drop_table("node_event")
    op.drop_table("template_revision")
    op.drop_table("action")
    op.drop_table("proposal")
    op.drop_table("incident")
    op.drop_table("job")
    op.drop_table("lineage")
    op.drop_table("cursor")
    op.drop_table("audit_event")
