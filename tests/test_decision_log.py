"""The daemon's log at INFO carries its decisions, one line each, and not the scheduler's
chatter: a cycle's diagnosis, proposal, auto-approval or wait for a person, a person's
approval seen, the relaunch submitted; nothing a rolled-back transaction decided; and under
`Daemon.run` with the daemon's logging, no APScheduler line at INFO while its metrics listener
answers."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from daemon.config import Settings
from daemon.logs import QUIET_LOGGERS, JsonFormatter, configure_logging, log_decisions
from daemon.service import Daemon
from daemon.store import control
from daemon.store import repository as repo
from daemon.store.engine import make_session_factory
from daemon.store.models import NodeEventKind, Proposal
from daemon.store.schema import upgrade
from daemon.store.states import ProposalState
from tests.test_pipeline import FRAGMENTED, FakeFiles, failed_job, start_lineage
from tests.test_service_poll import NOW, WindowSlurm, daemon, settings_for

ALICE = repo.Actor.user("alice", 1001)


@pytest.fixture
def fresh_engine(empty_db_engine: Engine) -> Engine:
    """A record of its own per test (the cycle commits; nothing to roll back)."""
    upgrade(empty_db_engine)
    return empty_db_engine


def decisions(records: list[logging.LogRecord]) -> list[dict[str, Any]]:
    """The decision lines as the daemon writes them (its JSON), in order."""
    formatter = JsonFormatter()
    return [
        json.loads(formatter.format(record))
        for record in records
        if record.name == "slurm_medic.decisions" or record.getMessage().startswith("approval")
    ]


def test_a_cycle_logs_each_decision_once_in_order(
    fresh_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 8001)
        session.commit()
    slurm = WindowSlurm(ended=[failed_job(8001, end=NOW - timedelta(minutes=5))])
    medic = daemon(fresh_engine, slurm)
    with caplog.at_level(logging.INFO):
        report = medic.cycle()
    medic.leader.release()
    lines = decisions(caplog.records)
    events = [line["event"] for line in lines]
    assert events == ["diagnosis", "proposal", "auto_approved", "relaunch_submitted"], lines
    diagnosis, proposal, approved, submitted = lines
    assert diagnosis["msg"] == "diagnosis: job 8001 fragmentation (high confidence)"
    assert (diagnosis["job"], diagnosis["kind"], diagnosis["confidence"]) == (
        8001,
        "fragmentation",
        "high",
    )
    assert proposal["remediator"] == "allocator_expandable_segments"
    assert approved["msg"] == (
        f"proposal {proposal['proposal']} auto-approved, policy: allocator_expandable_segments"
        " is in policy.auto_approve and leaves the science unchanged"
    )
    assert submitted["job"] == report.acted[0].slurm_job_id is not None
    assert submitted["level"] == "info"


def test_a_proposal_that_waits_then_a_persons_approval_is_seen_and_acted_on(
    fresh_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 8002)
        session.commit()
    slurm = WindowSlurm(ended=[failed_job(8002, end=NOW - timedelta(minutes=5))])
    waiting = Settings.model_validate(
        {**settings_for(fresh_engine).model_dump(), "policy": {"auto_approve": []}}
    )
    medic = Daemon(
        waiting,
        backend=slurm,
        files=FakeFiles({8002: FRAGMENTED}),
        engine=fresh_engine,
        clock=lambda: NOW,
    )
    with caplog.at_level(logging.INFO):
        medic.cycle()
        first = decisions(caplog.records)
        caplog.clear()
        with make_session_factory(fresh_engine)() as session:  # `slurm-medic approve`, elsewhere
            proposal = session.query(Proposal).one()
            repo.transition_proposal(
                session, proposal_id=proposal.id, to=ProposalState.APPROVED, actor=ALICE
            )
            session.commit()
        medic.cycle()
        medic.cycle()  # the approval is seen once, however many cycles follow
    medic.leader.release()
    assert [line["event"] for line in first] == ["diagnosis", "proposal", "awaiting_approval"]
    assert first[-1]["msg"].startswith(f"proposal {proposal.id} waits for a person: ")
    second = decisions(caplog.records)
    assert [line.get("event") for line in second] == ["approval_seen", "relaunch_submitted"]
    assert second[0]["msg"] == (
        f"approval seen: proposal {proposal.id} (allocator_expandable_segments) approved by alice"
    )


def test_what_a_rolled_back_transaction_decided_is_never_said(
    fresh_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    sessions = make_session_factory(fresh_engine)
    log_decisions(sessions)
    with caplog.at_level(logging.INFO), sessions() as session:
        lineage = repo.create_lineage(session, name="n", owner="alice", template="t")
        repo.append_audit(
            session,
            actor=repo.Actor.daemon(),
            verb="diagnosed",
            subject_type="incident",
            subject_id=1,
            details={"job": 1, "kind": "true_oom", "confidence": "high"},
        )
        session.flush()
        session.rollback()
        repo.append_audit(
            session,
            actor=repo.Actor.daemon(),
            verb="lineage_status",
            subject_type="lineage",
            subject_id=lineage.id,
            details={"from": "active", "to": "exhausted", "reason": "budget spent"},
        )
        for by_medic, reason in ((True, "medic: XID 79 on GPU 3"), (False, "fan noise")):
            control.record_node_event(
                session, node="gpu-03", kind=NodeEventKind.DRAIN, by_medic=by_medic, reason=reason
            )
        session.commit()
    lines = decisions(caplog.records)
    assert [(line["event"], line["msg"]) for line in lines] == [
        ("escalation", f"escalation: lineage {lineage.id} needs a person: budget spent"),
        ("drain", "drain gpu-03: medic: XID 79 on GPU 3"),  # someone else's is only seen
    ]


# ------------------------------------------------------------------------- under run()


@pytest.fixture
def daemon_logging(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The daemon's own logging set up, with pytest's capture still listening; put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    configure_logging()
    root.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, quiet_level in quiet.items():
            logging.getLogger(name).setLevel(quiet_level)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_under_run_the_scheduler_says_nothing_at_info_and_metrics_answer(
    fresh_engine: Engine,
    daemon_logging: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 8003)
        session.commit()
    port = free_port()
    settings = Settings.model_validate(
        {**settings_for(fresh_engine).model_dump(), "metrics": {"listen": f"127.0.0.1:{port}"}}
    )
    slurm = WindowSlurm(ended=[failed_job(8003, end=NOW - timedelta(minutes=5))])
    medic = Daemon(
        settings,
        backend=slurm,
        files=FakeFiles({8003: FRAGMENTED}),
        engine=fresh_engine,
        clock=lambda: NOW,
    )
    scraped: list[str] = []
    cycle = medic._scheduled_cycle

    def one_cycle_then_stop() -> None:
        cycle()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            scraped.append(answer.read().decode())
        os.kill(os.getpid(), signal.SIGTERM)  # as systemd stops it

    monkeypatch.setattr(medic, "_scheduled_cycle", one_cycle_then_stop)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        medic.run()
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    records = daemon_logging.records
    scheduler = [r for r in records if r.name.startswith("apscheduler") and r.levelno < 30]
    assert scheduler == []
    messages = [record.getMessage() for record in records]
    assert "cycle" in messages
    assert any(message.startswith("signal 15") for message in messages)
    assert [line["event"] for line in decisions(records)] == [
        "diagnosis",
        "proposal",
        "auto_approved",
        "relaunch_submitted",
    ]
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(scraped[0])
        for sample in family.samples
        if not sample.labels
    }
    assert samples["slurm_medic_leader"] == 1
    assert samples["slurm_medic_record_up"] == 1
    assert samples["slurm_medic_drain_limit_per_hour"] == 2
