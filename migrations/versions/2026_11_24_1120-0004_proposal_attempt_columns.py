"""The planner's memory of a proposal as typed columns: rung, lever, steps, revision, outcome.

Until now it lived in one loose JSON object (`proposal.patch`) read with defaults, so a
renamed key silently became a default. The columns people and the planner query move out of
it (carried over from every row's JSON; a row that lacks one stops the upgrade, naming the
proposal), and the rest is renamed `plan` and laid out as the codec writes a `PlannedFix`:
the patch's reason and changes nested under `patch`, environment maps as lists of pairs.
Downgrade puts every value back where the old code read it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 11:20:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Spelled out, as in 0001: the enums will have moved on by the time this runs.
LEVERS = (
    "allocator",
    "batch",
    "recompute",
    "sharding",
    "optimizer",
    "eval",
    "workers",
    "sequence",
    "placement",
)
OUTCOMES = ("pending", "verified", "same_failure", "different_failure", "rejected")
# Where each column's value lived in the old JSON.
COLUMN_KEYS = {
    "rung": "rung",
    "lever": "lever",
    "failing_step": "failing_step",
    "revision_id": "revision",
    "resumed_step": "resumed_step",
    "outcome": "outcome",
    "step_reached": "step_reached",
}
PLAN_KEYS = (
    "kind",
    "ladder",
    "expected_effect",
    "cost",
    "knobs_before",
    "knobs_after",
    "actions",
    "skipped",
)
PATCH_KEYS = ("reason", "changes")
REQUIRED_KEYS = ("rung", "lever", "failing_step", *PLAN_KEYS, *PATCH_KEYS)


def _proposals(column: str) -> sa.TableClause:
    return sa.table(
        "proposal",
        sa.column("id", sa.Integer()),
        sa.column(column, sa.JSON()),
        *(sa.column(name) for name in COLUMN_KEYS),
    )


def _checks(allowed: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in allowed)


def _pairs(value: Any) -> Any:
    """An environment map (the old JSON's object) as the codec writes a tuple of pairs."""
    if isinstance(value, dict):
        return [[str(key), str(item)] for key, item in value.items()]
    return value


def _object(value: Any) -> Any:
    """A list of pairs back to the old JSON's object; other values as they are."""
    if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        return {str(pair[0]): pair[1] for pair in value}
    return value


def _knobs(knobs: dict[str, Any], convert: Any) -> dict[str, Any]:
    return {name: convert(value) for name, value in knobs.items()}


def _change(change: dict[str, Any], convert: Any) -> dict[str, Any]:
    return {
        "knob": change["knob"],
        "before": convert(change["before"]),
        "after": convert(change["after"]),
    }


def _new_layout(proposal_id: int, old: dict[str, Any]) -> dict[str, Any]:
    missing = [key for key in REQUIRED_KEYS if key not in old]
    if missing:
        raise RuntimeError(
            f"proposal {proposal_id}: its JSON lacks {', '.join(missing)}; the record was not"
            " written by slurm-medic and cannot be carried over"
        )
    plan = {key: old[key] for key in PLAN_KEYS}
    plan["knobs_before"] = _knobs(old["knobs_before"], _pairs)
    plan["knobs_after"] = _knobs(old["knobs_after"], _pairs)
    plan["patch"] = {
        "changes": [_change(change, _pairs) for change in old["changes"]],
        "reason": old["reason"],
    }
    values: dict[str, Any] = {column: old.get(key) for column, key in COLUMN_KEYS.items()}
    values["outcome"] = values["outcome"] or "pending"
    values["plan"] = plan
    return values


def _old_layout(row: Any) -> dict[str, Any]:
    plan = dict(row.plan)
    patch = plan.pop("patch")
    old: dict[str, Any] = {
        "reason": patch["reason"],
        "changes": [_change(change, _object) for change in patch["changes"]],
        **plan,
        "knobs_before": _knobs(plan["knobs_before"], _object),
        "knobs_after": _knobs(plan["knobs_after"], _object),
        "rung": row.rung,
        "lever": row.lever,
        "failing_step": row.failing_step,
    }
    if row.revision_id is not None:
        old["revision"] = row.revision_id
        old["resumed_step"] = row.resumed_step
    if row.outcome != "pending":
        old["outcome"] = row.outcome
        old["step_reached"] = row.step_reached
    return old


def upgrade() -> None:
    with op.batch_alter_table("proposal") as batch:
        batch.alter_column("patch", new_column_name="plan")
        batch.add_column(sa.Column("lever", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("rung", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("failing_step", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("revision_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("resumed_step", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("outcome", sa.String(length=24), nullable=True))
        batch.add_column(sa.Column("step_reached", sa.BigInteger(), nullable=True))
    bind = op.get_bind()
    table = _proposals("plan")
    for row in bind.execute(sa.select(table.c.id, table.c.plan)).all():
        values = _new_layout(row.id, dict(row.plan))
        bind.execute(sa.update(table).where(table.c.id == row.id).values(**values))
    with op.batch_alter_table("proposal") as batch:
        batch.alter_column("lever", existing_type=sa.String(length=16), nullable=False)
        batch.alter_column("rung", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("outcome", existing_type=sa.String(length=24), nullable=False)
        batch.create_check_constraint(op.f("ck_proposal_lever"), f"lever IN ({_checks(LEVERS)})")
        batch.create_check_constraint(
            op.f("ck_proposal_outcome"), f"outcome IN ({_checks(OUTCOMES)})"
        )
        batch.create_foreign_key(
            op.f("fk_proposal_revision_id_template_revision"),
            "template_revision",
            ["revision_id"],
            ["id"],
        )


def downgrade() -> None:
    bind = op.get_bind()
    table = _proposals("plan")
    rows = bind.execute(sa.select(table)).all()
    with op.batch_alter_table("proposal") as batch:
        batch.drop_constraint(op.f("fk_proposal_revision_id_template_revision"), type_="foreignkey")
        batch.drop_constraint(op.f("ck_proposal_outcome"), type_="check")
        batch.drop_constraint(op.f("ck_proposal_lever"), type_="check")
    for row in rows:
        bind.execute(sa.update(table).where(table.c.id == row.id).values(plan=_old_layout(row)))
    with op.batch_alter_table("proposal") as batch:
        for column in reversed(list(COLUMN_KEYS)):
            batch.drop_column(column)
        batch.alter_column("plan", new_column_name="patch")
