"""The service's plumbing against the real things: systemd's datagram, the leader lock on both
databases, the structured log line, and `slurm-medic run` stopping on SIGTERM."""

from __future__ import annotations

import json
import logging
import socket
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from daemon.config import Settings
from daemon.service import (
    JsonFormatter,
    LeaderLock,
    parse_queue_comments,
    sd_notify,
    watchdog_window_s,
)
from daemon.store.engine import make_engine
from daemon.store.settings import StoreSettings, sqlite_url
from tests.postgres import PostgresServer


def receive_on(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    return sock


def test_sd_notify_sends_one_datagram(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with receive_on(path) as sock:
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": path})
        assert sock.recv(64) == b"READY=1"


def test_sd_notify_reaches_an_abstract_socket() -> None:
    name = f"medic-test-{uuid.uuid4().hex}"
    with receive_on("\0" + name) as sock:
        assert sd_notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(64) == b"WATCHDOG=1"


def test_sd_notify_without_systemd_is_a_no() -> None:
    assert not sd_notify("READY=1", {})


def two_locks(engine: Engine) -> tuple[LeaderLock, LeaderLock]:
    settings = Settings()
    return LeaderLock(engine, settings), LeaderLock(make_engine_like(engine), settings)


def make_engine_like(engine: Engine) -> Engine:
    return make_engine(StoreSettings(url=engine.url.render_as_string(hide_password=False)))


def check_only_one_leader(first: LeaderLock, second: LeaderLock) -> None:
    assert first.try_acquire()
    assert not second.try_acquire()
    assert first.try_acquire()  # holding it already
    first.release()
    assert second.try_acquire()
    assert not first.try_acquire()
    second.release()


def test_one_leader_on_a_sqlite_record(tmp_path: Path) -> None:
    engine = make_engine(StoreSettings(url=sqlite_url(tmp_path / "medic.db")))
    first, second = two_locks(engine)
    check_only_one_leader(first, second)
    assert (tmp_path / "medic.db.leader").exists()


@pytest.mark.postgres
def test_one_leader_on_a_postgres_record(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database(f"medic_{uuid.uuid4().hex[:12]}")
    engine = make_engine(StoreSettings(url=url))
    first, second = two_locks(engine)
    try:
        check_only_one_leader(first, second)
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_leader_whose_session_died_is_leader_no_more(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database(f"medic_{uuid.uuid4().hex[:12]}")
    engine = make_engine(StoreSettings(url=url))
    first, second = two_locks(engine)
    try:
        assert first.try_acquire()
        with make_engine_like(engine).connect() as admin:
            admin.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks"
                    " WHERE locktype = 'advisory' AND granted AND database ="
                    " (SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            )
            admin.commit()
        assert second.try_acquire()
        assert not first.try_acquire()
        second.release()
    finally:
        engine.dispose()


def test_log_lines_are_json_with_their_fields() -> None:
    record = logging.LogRecord("slurm_medic", logging.INFO, __file__, 1, "handled job", (), None)
    record.fields = {"job": 42, "outcome": "proposed"}
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "handled job"
    assert line["job"] == 42
    assert line["outcome"] == "proposed"
    assert line["level"] == "info"


def test_queue_comments_keep_plain_jobs_and_any_comment_text() -> None:
    text = "41|medic-0a1b\n42|\n43|a|comment|with bars\n44_3|medic-x\n44_[5-9]|medic-y\nbad\n"
    assert parse_queue_comments(text) == {41: "medic-0a1b", 42: "", 43: "a|comment|with bars"}


def test_the_watchdog_window_comes_from_systemd() -> None:
    assert watchdog_window_s({"WATCHDOG_USEC": "90000000"}) == 90.0
    assert watchdog_window_s({"WATCHDOG_USEC": "junk"}) == 90.0
    assert watchdog_window_s({}) == 90.0


def test_the_watchdog_is_pinged_only_while_cycles_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon.pipeline import OwnerJobFiles
    from daemon.service import Daemon
    from tests.test_actions_store import FakeSlurm

    engine = make_engine(StoreSettings(url=sqlite_url(tmp_path / "medic.db")))
    service = Daemon(Settings(), backend=FakeSlurm(), files=OwnerJobFiles(), engine=engine)
    path = str(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    with receive_on(path) as sock:
        service._watchdog(90.0)
        assert sock.recv(64) == b"WATCHDOG=1"
        service.heartbeat -= 100
        service._watchdog(90.0)
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            sock.recv(64)
