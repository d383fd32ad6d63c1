"""Alembic's entry point: runs migrations on the connection `daemon.store.schema` hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from daemon.store.engine import make_engine
from daemon.store.models import Base
from daemon.store.settings import StoreSettings


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    connection = context.config.attributes.get("connection")
    if isinstance(connection, Connection):
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database given: pass a connection or set sqlalchemy.url")
    engine = make_engine(StoreSettings(url=url))
    try:
        with engine.connect() as own_connection:
            _run(own_connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; run against a database")
_run_online()
