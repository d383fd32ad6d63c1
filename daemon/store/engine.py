"""The engine factory: the only place a database connection is configured, never at import."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from daemon.store.settings import StoreSettings

# The execution option that marks a read-only session's connections.
_READ_ONLY = "medic_read_only"
UPGRADE_COMMAND = "slurm-medic db upgrade"


class StoreConfigError(ValueError):
    """A database URL slurm-medic cannot use."""


class RecordUnavailable(RuntimeError):
    """The record cannot be opened or reached; the message is one line for a person."""


class NoRecord(RecordUnavailable):
    """The SQLite file is not there, and this command may not create it."""


class Access(enum.StrEnum):
    """How a command opens the record (SQLite's open modes). Only the commands that build
    the record create its file; the others refuse a missing one, and readers cannot write."""

    CREATE = "rwc"
    WRITE = "rw"
    READ = "ro"


def normalise_url(url: str | URL) -> URL:
    """Pin the drivers we test: pysqlite and psycopg 3 (a bare `postgresql://` means psycopg2)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise StoreConfigError("the record needs a SQLite file, not an in-memory database")
        return parsed.set(drivername="sqlite+pysqlite")
    raise StoreConfigError(f"unsupported database {parsed.get_backend_name()!r}")


def make_engine(settings: StoreSettings, *, access: Access = Access.CREATE) -> Engine:
    """An engine for `settings.url`; SQLite gets WAL, a busy timeout and foreign keys on.

    With `Access.WRITE` or `Access.READ` a SQLite file must already exist (`NoRecord`
    otherwise) and `READ` opens it read-only, so a command that only looks can neither
    create a file nor change one.
    """
    url = normalise_url(settings.url)
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url, settings, access)
    try:
        return create_engine(
            url,
            echo=settings.echo,
            pool_size=settings.pool_size,
            max_overflow=settings.max_overflow,
            pool_timeout=settings.pool_timeout_s,
            pool_pre_ping=True,
        )
    except ImportError as error:
        raise RecordUnavailable(
            f"the record is PostgreSQL, and its driver is missing ({error}):"
            " install slurm-medic[postgres]"
        ) from error


def record_location(url: URL) -> str:
    """Where the record is, for a person: the SQLite file, or the URL without its password."""
    if url.get_backend_name() == "sqlite" and url.database:
        database = url.database
        if url.query.get("uri") == "true":
            database = unquote(database.removeprefix("file:"))
        return database
    return url.render_as_string(hide_password=True)


def describe_failure(error: DBAPIError, url: URL) -> str:
    """What the database or its driver said, as one line naming the record (no password)."""
    cause = error.orig if error.orig is not None else error
    said = " ".join(line.strip() for line in str(cause).splitlines() if line.strip())
    return f"the record at {record_location(url)} cannot be used: {said or type(cause).__name__}"


def _existing_file(url: URL, access: Access) -> URL:
    """The SQLite URL opened in `access` mode (a `file:` URI), once the file is there."""
    path = Path(url.database or "").absolute()
    if not path.exists():
        raise NoRecord(f"no record at {path}: run `{UPGRADE_COMMAND}`")
    if not path.is_file():
        raise RecordUnavailable(f"the record {path} is not a file")
    return url.set(
        database=f"file:{quote(str(path))}",
        query={**url.query, "mode": access.value, "uri": "true"},
    )


def _sqlite_engine(url: URL, settings: StoreSettings, access: Access) -> Engine:
    if access is not Access.CREATE:
        url = _existing_file(url, access)
    engine = create_engine(
        url,
        echo=settings.echo,
        connect_args={"timeout": settings.sqlite_busy_timeout_ms / 1000},
    )
    busy_timeout_ms = int(settings.sqlite_busy_timeout_ms)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # pysqlite's own implicit BEGIN breaks SAVEPOINT; SQLAlchemy emits BEGIN itself below.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            if access is not Access.READ:  # setting the journal mode is a write
                cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # IMMEDIATE: a transaction that reads, then writes after another writer committed,
        # would otherwise fail at once with "database is locked" (its WAL snapshot is stale
        # and the busy timeout does not apply); taking the write lock at BEGIN makes the
        # second writer wait its turn instead. A read-only session needs no lock at all
        # (WAL readers see a snapshot), so it never waits behind a daemon step.
        if connection.get_execution_options().get(_READ_ONLY):
            connection.exec_driver_sql("BEGIN")
        else:
            connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class ReadOnlySessionError(RuntimeError):
    """A session made for reading tried to write."""


def make_session_factory(engine: Engine, *, read_only: bool = False) -> sessionmaker[Session]:
    """Sessions that keep loaded rows readable after commit (the CLI prints them afterwards).

    `read_only` sessions (status, history, show, a reviewer's queries) take no write lock on
    SQLite and refuse to flush, so a reader can neither block nor be blocked by the daemon.
    """
    if not read_only:
        return sessionmaker(bind=engine, expire_on_commit=False)
    factory = sessionmaker(
        bind=engine.execution_options(**{_READ_ONLY: True}), expire_on_commit=False
    )

    # SQLAlchemy calls before_flush only when something is new, changed or deleted.
    @event.listens_for(factory, "before_flush")
    def _refuse_writes(_session: Session, _context: Any, _instances: Any) -> None:
        raise ReadOnlySessionError("a read-only session of the record cannot write")

    return factory
