"""The engine factory against real SQLite and PostgreSQL: the settings it promises are in force."""

from __future__ import annotations

import socket
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError, OperationalError

from daemon.store.engine import (
    Access,
    NoRecord,
    ReadOnlySessionError,
    RecordUnavailable,
    StoreConfigError,
    describe_failure,
    make_engine,
    make_session_factory,
    normalise_url,
    record_location,
)
from daemon.store.models import Cursor
from daemon.store.settings import StoreSettings, sqlite_url
from tests.postgres import PostgresServer


def _sqlite(tmp_path: Path, access: Access = Access.CREATE, **options: object) -> Engine:
    return make_engine(
        StoreSettings(url=sqlite_url(tmp_path / "medic.db"), **options),  # type: ignore[arg-type]
        access=access,
    )


def test_sqlite_runs_in_wal_with_busy_timeout_and_foreign_keys(tmp_path: Path) -> None:
    engine = _sqlite(tmp_path, sqlite_busy_timeout_ms=1234)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    assert (tmp_path / "medic.db").exists()
    engine.dispose()


def test_sqlite_read_then_write_waits_for_another_writer_instead_of_failing(
    tmp_path: Path,
) -> None:
    """A daemon step reads, a CLI command commits a write, the step then writes: both land.

    With a deferred BEGIN the step's snapshot is stale by then and SQLite answers "database
    is locked" at once, whatever the busy timeout; the factory begins every transaction
    IMMEDIATE so the second writer waits its turn instead.
    """
    engine = _sqlite(tmp_path)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE t (v INTEGER)"))
    step_has_read = threading.Event()
    cli_errors: list[BaseException] = []

    def cli_write() -> None:
        step_has_read.wait()
        try:
            with engine.begin() as connection:
                connection.execute(text("INSERT INTO t VALUES (2)"))
        except BaseException as error:
            cli_errors.append(error)

    cli = threading.Thread(target=cli_write)
    cli.start()
    with engine.begin() as connection:
        assert connection.execute(text("SELECT count(*) FROM t")).scalar() == 0
        step_has_read.set()
        cli.join(timeout=0.5)  # the CLI's write is waiting, not failing
        assert cli.is_alive()
        connection.execute(text("INSERT INTO t VALUES (1)"))
    cli.join()
    assert cli_errors == []
    with engine.connect() as connection:
        assert sorted(connection.execute(text("SELECT v FROM t")).scalars()) == [1, 2]
    engine.dispose()


def test_a_reader_neither_waits_for_a_writer_nor_writes(tmp_path: Path) -> None:
    """A daemon step holds the write lock (through sacct, a probe, sbatch); `show` and
    `history` still answer at once, from the last committed state, and cannot write."""
    engine = _sqlite(tmp_path, sqlite_busy_timeout_ms=200)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE t (v INTEGER)"))
        connection.execute(text("INSERT INTO t VALUES (1)"))
    readers = make_session_factory(engine, read_only=True)
    with engine.begin() as step:
        step.execute(text("INSERT INTO t VALUES (2)"))  # not committed yet
        with readers() as reader:
            assert list(reader.execute(text("SELECT v FROM t")).scalars()) == [1]
        with (
            pytest.raises(OperationalError, match="database is locked"),
            make_session_factory(engine)() as writer,
        ):
            writer.execute(text("SELECT v FROM t"))
    with readers() as reader:
        reader.add(Cursor(name="poll", polled_until=datetime.now(UTC)))
        with pytest.raises(ReadOnlySessionError):
            reader.flush()
    engine.dispose()


def test_nothing_is_opened_until_asked(tmp_path: Path) -> None:
    engine = _sqlite(tmp_path)
    assert not (tmp_path / "medic.db").exists()
    engine.dispose()


def test_sqlite_enforces_foreign_keys(tmp_path: Path) -> None:
    engine = _sqlite(tmp_path)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE parent (id INTEGER PRIMARY KEY)"))
        connection.execute(
            text("CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id REFERENCES parent(id))")
        )
    with pytest.raises(IntegrityError), engine.begin() as connection:
        connection.execute(text("INSERT INTO child (parent_id) VALUES (42)"))
    engine.dispose()


def test_sqlite_savepoints_roll_back_alone(tmp_path: Path) -> None:
    """pysqlite's own transaction handling breaks SAVEPOINT; the factory takes it over."""
    engine = _sqlite(tmp_path)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE t (v INTEGER)"))
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO t VALUES (1)"))
        nested = connection.begin_nested()
        connection.execute(text("INSERT INTO t VALUES (2)"))
        nested.rollback()
    with engine.connect() as connection:
        assert connection.execute(text("SELECT v FROM t")).scalars().all() == [1]
    engine.dispose()


@pytest.mark.postgres
def test_postgres_engine_uses_psycopg3(postgres_server: PostgresServer) -> None:
    url = postgres_server.url("postgres").replace("postgresql+psycopg://", "postgresql://")
    engine = make_engine(StoreSettings(url=url, pool_size=2))
    try:
        assert engine.dialect.driver == "psycopg"
        with engine.connect() as connection:
            assert connection.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


def test_bare_postgresql_url_means_psycopg3() -> None:
    assert normalise_url("postgresql://u@h/db").drivername == "postgresql+psycopg"


def test_in_memory_sqlite_is_refused() -> None:
    with pytest.raises(StoreConfigError, match="SQLite file"):
        normalise_url("sqlite://")


def test_default_url_is_under_the_state_directory() -> None:
    assert StoreSettings().url == "sqlite+pysqlite:////var/lib/slurm-medic/medic.db"


def test_other_databases_are_refused() -> None:
    with pytest.raises(ValidationError, match="sqlite and postgresql"):
        StoreSettings(url="mysql://h/db")


# ---------------------------------------------------------------- opening only what is there


def test_a_reader_or_writer_never_creates_the_record(tmp_path: Path) -> None:
    for access in (Access.READ, Access.WRITE):
        with pytest.raises(
            NoRecord, match=r"no record at .*medic\.db: run `slurm-medic db upgrade`"
        ):
            _sqlite(tmp_path, access=access)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_where_the_record_should_be_is_named(tmp_path: Path) -> None:
    (tmp_path / "medic.db").mkdir()
    with pytest.raises(RecordUnavailable, match=r"medic\.db is not a file"):
        _sqlite(tmp_path, access=Access.READ)


def test_a_reader_opens_sqlite_read_only(tmp_path: Path) -> None:
    writer = _sqlite(tmp_path)
    with writer.begin() as connection:
        connection.execute(text("CREATE TABLE t (v INTEGER)"))
        connection.execute(text("INSERT INTO t VALUES (1)"))
    reader = _sqlite(tmp_path, access=Access.READ)
    with reader.connect() as connection:
        assert connection.execute(text("SELECT v FROM t")).scalar_one() == 1
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    with pytest.raises(OperationalError, match="readonly database"), reader.begin() as connection:
        connection.execute(text("INSERT INTO t VALUES (2)"))
    assert record_location(reader.url) == str(tmp_path / "medic.db")
    reader.dispose()
    writer.dispose()


def test_an_odd_file_name_survives_the_uri(tmp_path: Path) -> None:
    """Characters a `file:` URI reads as syntax are quoted (a `?` cannot be in the URL at all)."""
    odd = tmp_path / "a b%20c#d&mode=rwc.db"
    make_engine(StoreSettings(url=sqlite_url(odd))).connect().close()
    reader = make_engine(StoreSettings(url=sqlite_url(odd)), access=Access.WRITE)
    with reader.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA database_list").all()[0][2] == str(odd)
    reader.dispose()


def test_a_failure_is_one_line_without_the_password() -> None:
    with socket.socket() as probe:  # a local port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = make_engine(StoreSettings(url=f"postgresql://medic:s3cret@127.0.0.1:{port}/medic"))
    with pytest.raises(OperationalError) as caught, engine.connect():
        pass
    line = describe_failure(caught.value, engine.url)
    assert "\n" not in line
    assert line.startswith(f"the record at postgresql+psycopg://medic:***@127.0.0.1:{port}/medic")
    assert "Connection refused" in line
    assert "s3cret" not in line
    engine.dispose()


def test_a_missing_postgres_driver_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(RecordUnavailable, match=r"install slurm-medic\[postgres\]"):
        make_engine(StoreSettings(url="postgresql://medic@db-host/medic"))
