"""Pytest plugin: a real PostgreSQL from Debian's packages, and the record's database fixtures.

`postgres_server` (session) runs initdb and pg_ctl in a temporary directory, as the `postgres`
user when the tests run as root, listening on 127.0.0.1 on a free port; it is stopped and
removed afterwards. `db_engine` is parametrized over SQLite and PostgreSQL (the PostgreSQL
param is marked `postgres`), migrated to head once per session; `db_session` rolls each test
back, so every store test runs on both databases against the schema the migrations built.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from daemon.process import run
from daemon.store.engine import make_engine
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url

POSTGRES_ROOT = Path("/usr/lib/postgresql")
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries: `deploy/install-system-packages` installs them."""


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create an empty database; returns its URL."""
        admin = make_engine(StoreSettings(url=self.url("postgres")))
        try:
            with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        return self.url(name)


def postgres_bin_dir() -> Path:
    versions = sorted(
        (path for path in POSTGRES_ROOT.glob("*/bin") if (path / "initdb").exists()),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    if not versions:
        raise PostgresUnavailable(
            f"no initdb under {POSTGRES_ROOT}; deploy/install-system-packages installs postgresql"
        )
    return versions[-1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_postgres(argv: list[str]) -> list[str]:
    """initdb and the server refuse to run as root; run them as the `postgres` user then."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextmanager
def running_postgres(*, durable: bool = False) -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server; unless `durable`, fsync is off (no crash safety needed)."""
    bin_dir = postgres_bin_dir()
    base = Path(tempfile.mkdtemp(prefix="medic-pg-"))
    data = base / "data"
    if os.geteuid() == 0:
        shutil.chown(base, user="postgres", group="postgres")
    port = _free_port()
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {base}"
    if not durable:
        options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    pg_ctl = str(bin_dir / "pg_ctl")
    try:
        run(
            _as_postgres(
                [
                    *(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres"),
                    *("--auth=trust", "--encoding=UTF8", "--no-locale"),
                ]
            ),
            timeout=120,
            check=True,
        )
        run(
            _as_postgres(
                [pg_ctl, "-D", str(data), "-o", options, "-l", str(base / "log"), "-w", "start"]
            ),
            timeout=60,
            check=True,
        )
        try:
            yield PostgresServer(host="127.0.0.1", port=port, user="postgres")
        finally:
            run(_as_postgres([pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"]), timeout=60)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


def _empty_engine(backend: str, request: pytest.FixtureRequest, directory: Path) -> Engine:
    if backend == "sqlite":
        return make_engine(StoreSettings(url=sqlite_url(directory / f"{uuid.uuid4().hex}.db")))
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return make_engine(StoreSettings(url=server.create_database(f"medic_{uuid.uuid4().hex[:12]}")))


@pytest.fixture(scope="session", params=BACKENDS)
def db_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """One database per backend for the session, built by the migrations (triggers included)."""
    engine = _empty_engine(str(request.param), request, tmp_path_factory.mktemp("store"))
    upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def db_session(db_engine: Engine) -> Iterator[Session]:
    """A session whose commits are savepoints inside a transaction rolled back after the test."""
    with db_engine.connect() as connection:
        outer = connection.begin()
        session = Session(
            bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False
        )
        try:
            yield session
        finally:
            session.close()
            outer.rollback()


@pytest.fixture(params=BACKENDS)
def empty_db_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A new, empty database (no schema) for migration tests."""
    engine = _empty_engine(str(request.param), request, tmp_path)
    yield engine
    engine.dispose()
