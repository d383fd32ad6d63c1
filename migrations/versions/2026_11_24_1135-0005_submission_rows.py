"""Every submission is an sbatch action row: its lineage, revision and attempt become columns.

Until now only a relaunch had an action row; a first submission (`slurm-medic submit`) kept
its intent and its job in audit events (`submit_intent`, `submit_intent_closed` and
`submit_failed` on the lineage, `lineage_submit` on the job) that the daemon rescanned every
cycle. Upgrade gives each one its row: a `lineage_submit` fills in (or makes) the row of its
token, a first submission's intent becomes a pending, not-found or failed row, and a
relaunch's row takes its lineage and revision from its proposal. Downgrade writes the audit
events the old code reads where they are missing, then drops the first submissions' rows
and the columns. Audit events are never changed either way.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 11:35:00
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ACTION = sa.table(
    "action",
    sa.column("id", sa.Integer()),
    sa.column("proposal_id", sa.Integer()),
    sa.column("lineage_id", sa.Integer()),
    sa.column("revision_id", sa.Integer()),
    sa.column("attempt", sa.Integer()),
    sa.column("kind", sa.String()),
    sa.column("argv", sa.JSON()),
    sa.column("token", sa.String()),
    sa.column("slurm_job_id", sa.BigInteger()),
    sa.column("started_at", sa.DateTime(timezone=True)),
    sa.column("finished_at", sa.DateTime(timezone=True)),
    sa.column("stderr", sa.Text()),
    sa.column("result", sa.String()),
)
AUDIT = sa.table(
    "audit_event",
    sa.column("id", sa.Integer()),
    sa.column("at", sa.DateTime(timezone=True)),
    sa.column("actor_kind", sa.String()),
    sa.column("actor_name", sa.String()),
    sa.column("verb", sa.String()),
    sa.column("subject_type", sa.String()),
    sa.column("subject_id", sa.String()),
    sa.column("details", sa.JSON()),
)
PROPOSAL = sa.table(
    "proposal",
    sa.column("id", sa.Integer()),
    sa.column("lineage_id", sa.Integer()),
    sa.column("revision_id", sa.Integer()),
)
REVISION = sa.table(
    "template_revision", sa.column("id", sa.Integer()), sa.column("proposal_id", sa.Integer())
)
LINEAGE = sa.table(
    "lineage",
    sa.column("id", sa.Integer()),
    sa.column("owner", sa.String()),
    sa.column("attempts", sa.Integer()),
)
FIRST_SUBMISSION_VERBS = ("submit_intent", "submit_intent_closed", "submit_failed")


def upgrade() -> None:
    with op.batch_alter_table("action") as batch:
        batch.add_column(sa.Column("lineage_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("revision_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_action_lineage_id_lineage"), "lineage", ["lineage_id"], ["id"]
        )
        batch.create_foreign_key(
            op.f("fk_action_revision_id_template_revision"),
            "template_revision",
            ["revision_id"],
            ["id"],
        )
        batch.create_index(op.f("ix_action_lineage_id"), ["lineage_id"])
    bind = op.get_bind()
    tokens = {row.token: row.id for row in bind.execute(sa.select(ACTION.c.id, ACTION.c.token))}
    submitted = _events(bind, "lineage_submit", "job")
    for event in submitted:
        _carry_submission(bind, event, tokens)
    _carry_relaunches(bind)
    _carry_first_intents(bind, tokens)


def _events(bind: sa.Connection, verb: str, subject_type: str) -> list[Any]:
    return list(
        bind.execute(
            sa.select(AUDIT)
            .where(AUDIT.c.verb == verb, AUDIT.c.subject_type == subject_type)
            .order_by(AUDIT.c.id)
        )
    )


def _carry_submission(bind: sa.Connection, event: Any, tokens: dict[str, int]) -> None:
    """A `lineage_submit` fills in its token's row, or becomes one (a first submission)."""
    details: Mapping[str, Any] = event.details
    values = {
        "lineage_id": int(details["lineage"]),
        "revision_id": int(details["revision"]),
        "attempt": int(details["attempt"]),
    }
    token = str(details.get("token") or "")
    if token in tokens:
        bind.execute(sa.update(ACTION).where(ACTION.c.id == tokens[token]).values(**values))
        return
    if not token:
        token = f"medic-migrated-{event.id}"
    proposal = details.get("proposal")
    tokens[token] = _insert(
        bind,
        token=token,
        at=event.at,
        result="succeeded",
        proposal_id=None if proposal is None else int(proposal),
        slurm_job_id=int(event.subject_id),
        finished_at=event.at,
        **values,
    )


def _carry_relaunches(bind: sa.Connection) -> None:
    """A relaunch's row with no `lineage_submit` takes its lineage and revision from its
    proposal; an open or submitted one its attempt as the old code counted it."""
    rows = bind.execute(
        sa.select(ACTION.c.id, ACTION.c.proposal_id, ACTION.c.result).where(
            ACTION.c.kind == "sbatch",
            ACTION.c.lineage_id.is_(None),
            ACTION.c.proposal_id.is_not(None),
        )
    ).all()
    for row in rows:
        proposal = bind.execute(
            sa.select(PROPOSAL).where(PROPOSAL.c.id == row.proposal_id)
        ).one_or_none()
        if proposal is None or proposal.lineage_id is None:
            continue
        revision_id = (
            proposal.revision_id
            or bind.execute(
                sa.select(sa.func.max(REVISION.c.id)).where(REVISION.c.proposal_id == proposal.id)
            ).scalar()
        )
        attempts = bind.execute(
            sa.select(LINEAGE.c.attempts).where(LINEAGE.c.id == proposal.lineage_id)
        ).scalar()
        attempt = (attempts or 0) + 1 if row.result in ("pending", "succeeded") else None
        bind.execute(
            sa.update(ACTION)
            .where(ACTION.c.id == row.id)
            .values(lineage_id=proposal.lineage_id, revision_id=revision_id, attempt=attempt)
        )


def _carry_first_intents(bind: sa.Connection, tokens: dict[str, int]) -> None:
    """A first submission's intent with no job becomes a not-found, failed or open row."""
    closed = {
        str(event.details.get("token")): event.at
        for event in _events(bind, "submit_intent_closed", "lineage")
    }
    failed = {event.subject_id: event for event in _events(bind, "submit_failed", "lineage")}
    for event in _events(bind, "submit_intent", "lineage"):
        token = str(event.details["token"])
        if token in tokens:
            continue
        values: dict[str, Any] = {
            "lineage_id": int(event.subject_id),
            "revision_id": int(event.details["revision"]),
            "attempt": 1,
        }
        if token in closed:
            values.update(result="not_found", finished_at=closed[token])
        elif event.subject_id in failed:
            failure = failed[event.subject_id]
            values.update(
                result="failed",
                finished_at=failure.at,
                stderr=str(failure.details.get("stderr") or failure.details.get("error", "")),
            )
        else:
            values.update(result="pending")
        tokens[token] = _insert(bind, token=token, at=event.at, proposal_id=None, **values)


def _insert(bind: sa.Connection, *, token: str, at: datetime, **values: Any) -> int:
    inserted = bind.execute(
        sa.insert(ACTION)
        .values(kind="sbatch", argv=[], token=token, started_at=at, **values)
        .returning(ACTION.c.id)
    ).scalar_one()
    return int(inserted)


def downgrade() -> None:
    bind = op.get_bind()
    submitted_tokens = {
        str(event.details.get("token")) for event in _events(bind, "lineage_submit", "job")
    }
    intent_tokens = {
        str(event.details.get("token")) for event in _events(bind, "submit_intent", "lineage")
    }
    rows = bind.execute(
        sa.select(ACTION, LINEAGE.c.owner)
        .join(LINEAGE, LINEAGE.c.id == ACTION.c.lineage_id)
        .where(ACTION.c.kind == "sbatch")
        .order_by(ACTION.c.id)
    ).all()
    for row in rows:
        if row.slurm_job_id is not None and row.token not in submitted_tokens:
            _audit(
                bind,
                "lineage_submit",
                "job",
                row.slurm_job_id,
                {
                    "lineage": row.lineage_id,
                    "attempt": row.attempt or 1,
                    "revision": row.revision_id,
                    "proposal": row.proposal_id,
                    "token": row.token,
                },
            )
        first_open = row.proposal_id is None and row.result == "pending"
        if first_open and row.token not in intent_tokens:
            _audit(
                bind,
                "submit_intent",
                "lineage",
                row.lineage_id,
                {"token": row.token, "revision": row.revision_id, "owner": row.owner},
            )
    # The old code knows a first submission only by its audit events.
    bind.execute(sa.delete(ACTION).where(ACTION.c.kind == "sbatch", ACTION.c.proposal_id.is_(None)))
    with op.batch_alter_table("action") as batch:
        batch.drop_index(op.f("ix_action_lineage_id"))
        batch.drop_constraint(op.f("fk_action_revision_id_template_revision"), type_="foreignkey")
        batch.drop_constraint(op.f("fk_action_lineage_id_lineage"), type_="foreignkey")
        batch.drop_column("attempt")
        batch.drop_column("revision_id")
        batch.drop_column("lineage_id")


def _audit(
    bind: sa.Connection, verb: str, subject_type: str, subject_id: object, details: Any
) -> None:
    bind.execute(
        sa.insert(AUDIT).values(
            at=_now(bind),
            actor_kind="daemon",
            actor_name="slurm-medic",
            verb=verb,
            subject_type=subject_type,
            subject_id=str(subject_id),
            details=details,
        )
    )


def _now(bind: sa.Connection) -> datetime:
    """UTC, stored as the models store it: naive on SQLite, aware on PostgreSQL."""
    now = datetime.now(UTC)
    return now.replace(tzinfo=None) if bind.dialect.name == "sqlite" else now
