"""The service's plumbing against the real things: systemd's datagram, the leader lock on both
databases, the structured log line, and `slurm-medic run` stopping on SIGTERM."""

from __future__ import annotations

import json
import logging
import socket
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from daemon.config import Settings
from daemon.logs import JsonFormatter
from daemon.service import LeaderLock, sd_notify, watchdog_window_s
from daemon.slurm.errors import SlurmParseError
from daemon.slurm.records import JobState, QueuedJob
from daemon.slurm.squeue import parse_queue_json
from daemon.store.engine import make_engine
from daemon.store.service_records import carries_token
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
                    # Waits (up to 10 s) for the backend to end: without a timeout the
                    # call only signals it, and the lock may still be held a moment later.
                    "SELECT pg_terminate_backend(pid, 10000) FROM pg_locks"
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


def test_queued_jobs_keep_plain_jobs_their_owner_and_any_comment_text() -> None:
    jobs = [
        {"job_id": 41, "user_name": "alice", "comment": "medic-0a1b", "array_task_id": None},
        {"job_id": 42, "user_name": "bob", "comment": ""},
        # 22.05 keeps a comment's newline inside the string: no line can be forged.
        {"job_id": 43, "user_name": "bob", "comment": "x\n41|alice|medic-0a1b"},
        {"job_id": 44, "user_name": "alice", "comment": "medic-x", "array_task_id": 3},
        {"job_id": {"set": True, "number": 45}, "user_name": "carol", "comment": None},
        {"job_id": {"set": False, "number": 0}, "user_name": "carol", "comment": "medic-y"},
        {"job_id": 46, "comment": "no owner"},
        {"job_id": True, "user_name": "dave", "comment": "medic-z"},
        "not a job",
    ]
    parsed = parse_queue_json(json.dumps({"meta": {}, "errors": [], "jobs": jobs}))
    assert parsed == (
        QueuedJob(41, "alice", "medic-0a1b"),
        QueuedJob(42, "bob", ""),
        QueuedJob(43, "bob", "x\n41|alice|medic-0a1b"),
        QueuedJob(45, "carol", ""),
    )


def test_a_queued_job_keeps_its_state_as_each_release_prints_it() -> None:
    """The real 22.05 capture (a job FAILED while slurmdbd was stopped) prints a string;
    23.11+ prints the base state and its flags as a list; an unknown state is never ended."""
    capture = Path(__file__).parent / "data" / "slurm" / "dbv0.0.38"
    [failed] = parse_queue_json(
        (capture / "squeue-failed-slurmdbd-stopped.json").read_text(encoding="utf-8")
    )
    assert (failed.job_id, failed.user, failed.state) == (1, "alice", JobState.FAILED)
    jobs = [
        {"job_id": 51, "user_name": "alice", "job_state": ["PENDING", "REQUEUED"]},
        {"job_id": 52, "user_name": "alice", "job_state": ["OUT_OF_MEMORY"]},
        {"job_id": 53, "user_name": "alice", "job_state": "SOMETHING_NEW"},
        {"job_id": 54, "user_name": "alice", "job_state": 7},
    ]
    states = [job.state for job in parse_queue_json(json.dumps({"jobs": jobs}))]
    assert states == [JobState.PENDING, JobState.OUT_OF_MEMORY, JobState.UNKNOWN, JobState.UNKNOWN]
    assert not JobState.UNKNOWN.is_terminal()


@pytest.mark.parametrize("text", ["", "[]", '{"jobs": {}}', "{"])
def test_squeue_output_that_is_not_a_jobs_document_is_an_error(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_queue_json(text)


def test_a_token_is_carried_only_as_a_whole_field_of_the_comment() -> None:
    token = "medic-0a1b2c"
    assert carries_token(token, token)
    assert carries_token(f"  {token}\n", token)
    assert carries_token(f"run 3 {token} resumed", token)
    assert not carries_token(f"x{token}", token)
    assert not carries_token(f"{token}d", token)
    assert not carries_token(f"a,{token}", token)
    assert not carries_token("medic-0a1b", token)
    assert not carries_token(None, token)
    assert not carries_token("", token)
    assert not carries_token("anything", "")


def test_the_watchdog_window_comes_from_systemd() -> None:
    assert watchdog_window_s({"WATCHDOG_USEC": "90000000"}) == 90.0
    assert watchdog_window_s({"WATCHDOG_USEC": "junk"}) == 90.0
    assert watchdog_window_s({}) == 90.0


def test_the_watchdog_is_pinged_only_while_cycles_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon.gather import OwnerJobFiles
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


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
JOB_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "job_id": JSON_VALUES | st.integers(),
        "user_name": JSON_VALUES,
        "comment": JSON_VALUES,
        "array_task_id": JSON_VALUES,
    },
)


@settings(max_examples=200, deadline=None)
@given(st.lists(JOB_FIELDS | JSON_VALUES, max_size=6) | JSON_VALUES)
def test_any_squeue_document_gives_queued_jobs_or_a_parse_error(jobs: object) -> None:
    try:
        parsed = parse_queue_json(json.dumps({"jobs": jobs}))
    except SlurmParseError:
        assert not isinstance(jobs, list)
        return
    for job in parsed:
        assert 0 < job.job_id < 2**63
        assert job.user
        assert isinstance(job.comment, str)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_squeue_text_gives_queued_jobs_or_a_parse_error(text: str) -> None:
    try:
        jobs = parse_queue_json(text)
    except SlurmParseError:
        return
    assert all(job.user and 0 < job.job_id < 2**63 for job in jobs)
