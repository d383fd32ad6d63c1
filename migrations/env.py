"""Alembic's entry point: runs migrations on the connection `daemon.store.schema` hands over.

Engines come only from `daemon.store.engine.make_engine` (SQLite pragmas, psycopg 3), so this
file opens none of its own: run migrations through `slurm-medic db` or `daemon.store.schema`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from daemon.store.models import Base


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; run against a database")
_connection = context.config.attributes.get("connection")
if not isinstance(_connection, Connection):
    raise RuntimeError("run migrations with `slurm-medic db upgrade`, which passes a connection")
_run(_connection)
