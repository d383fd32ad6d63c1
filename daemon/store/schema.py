"""Schema versions: upgrade and downgrade through Alembic; the start-up check refusing old ones."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from daemon.store.engine import UPGRADE_COMMAND, record_location


class SchemaBehind(RuntimeError):
    """The database is older (or newer) than this code; the daemon must not start on it."""


def migrations_dir() -> Path:
    """The installed `migrations` package, wherever pip put it."""
    return Path(str(files("migrations")))


def alembic_config() -> Config:
    """An Alembic config built in code: no alembic.ini to ship, no URL or password in it."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option(
        "file_template",
        "%%(year)d_%%(month).2d_%%(day).2d_%%(hour).2d%%(minute).2d-%%(rev)s_%%(slug)s",
    )
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {migrations_dir()}")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for an empty database."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    _run_command(engine, "upgrade", revision)


def downgrade(engine: Engine, revision: str) -> None:
    _run_command(engine, "downgrade", revision)


def _run_command(engine: Engine, verb: str, revision: str) -> None:
    config = alembic_config()
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            _sqlite_foreign_keys(connection, on=False)
        try:
            with connection.begin():
                config.attributes["connection"] = connection
                getattr(command, verb)(config, revision)
                if sqlite:
                    _check_foreign_keys(connection)
        finally:
            if sqlite:
                _sqlite_foreign_keys(connection, on=True)


def _sqlite_foreign_keys(connection: Connection, *, on: bool) -> None:
    """Alembic changes a SQLite table by rebuilding it (copy, drop, rename), and dropping a
    table whose rows others reference fails under foreign keys, deferred or not. They are off
    while a migration runs; the pragma is ignored inside a transaction, so it goes to the
    driver's connection before the migration's transaction begins (and after it ends)."""
    dbapi_connection = connection.connection.dbapi_connection
    if dbapi_connection is None:
        raise RuntimeError("the SQLite connection is closed")
    dbapi_connection.execute(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")


def _check_foreign_keys(connection: Connection) -> None:
    """With the checks off, the migration itself must leave no dangling reference."""
    dangling = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
    if dangling:
        raise RuntimeError(f"the migration left dangling references: {dangling[:5]}")


def check_schema_current(engine: Engine) -> None:
    """Raise `SchemaBehind` unless the database is at this code's head revision."""
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return
    if current is None:
        raise SchemaBehind(
            f"the record at {record_location(engine.url)} has no schema; run `{UPGRADE_COMMAND}`"
        )
    known = {
        script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()
    }
    if current not in known:
        raise SchemaBehind(
            f"the record is at revision {current}, which this slurm-medic does not know"
            f" (newer code wrote it); upgrade slurm-medic, or downgrade the database with it"
        )
    raise SchemaBehind(
        f"the record is at revision {current}, behind this code's {head}; run `{UPGRADE_COMMAND}`"
    )
