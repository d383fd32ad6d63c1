"""Make audit_event append-only in the database itself, below any code that might forget.

The ORM guard stops the repository layer; these triggers stop everything else that writes
SQL (a hand-typed UPDATE included). Dropping them is the downgrade.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_MESSAGE = "audit_event is append-only"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE FUNCTION audit_event_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN RAISE EXCEPTION '{_MESSAGE}'; END $$"
        )
        op.execute(
            "CREATE TRIGGER audit_event_no_change BEFORE UPDATE OR DELETE ON audit_event "
            "FOR EACH ROW EXECUTE FUNCTION audit_event_append_only()"
        )
        op.execute(
            "CREATE TRIGGER audit_event_no_truncate BEFORE TRUNCATE ON audit_event "
            "FOR EACH STATEMENT EXECUTE FUNCTION audit_event_append_only()"
        )
        return
    for verb in ("UPDATE", "DELETE"):
        op.execute(
            f"CREATE TRIGGER audit_event_no_{verb.lower()} BEFORE {verb} ON audit_event "
            f"BEGIN SELECT RAISE(ABORT, '{_MESSAGE}'); END"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER audit_event_no_truncate ON audit_event")
        op.execute("DROP TRIGGER audit_event_no_change ON audit_event")
        op.execute("DROP FUNCTION audit_event_append_only()")
        return
    for verb in ("UPDATE", "DELETE"):
        op.execute(f"DROP TRIGGER audit_event_no_{verb.lower()}")
