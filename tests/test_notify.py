"""Notifications against the real things: a real SMTP server (aiosmtpd) and a real HTTP
receiver on loopback, a real SQLite record, and the daemon's own cycle.

Each message is found in the record, sent once (two looks, two daemons, a retry after a failure
all make one), retried with backoff while the relay or the receiver fails, given up after
`max_attempts`, held back by the rate limit, and sent by a thread of its own: a receiver that
never answers does not hold the daemon's cycle.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email import message_from_bytes, policy
from email.message import EmailMessage
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope
from aiosmtpd.smtp import Session as SmtpSession
from click.testing import CliRunner
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from daemon.cli import main
from daemon.config import Settings
from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import Evidence
from daemon.notify.notifier import Notifier
from daemon.notify.outbox import NotifyConfigError, Outgoing, insert_rows
from daemon.notify.sender import CLAIM_MARGIN_S
from daemon.notify.settings import NotifySettings
from daemon.planner import Outcome
from daemon.service import Daemon
from daemon.store import control
from daemon.store import repository as repo
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import (
    LineageStatus,
    NodeEventKind,
    Notification,
    NotificationChannel,
    NotificationEvent,
    NotificationState,
    Proposal,
)
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings, sqlite_url
from daemon.store.states import ProposalState
from tests.factories import ended_job
from tests.fixes import seeded_fix
from tests.test_pipeline import FRAGMENTED, FakeFiles, failed_job, start_lineage
from tests.test_service_poll import WindowSlurm, settings_for

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
DAEMON = repo.Actor.daemon()
SECRET = "T0KEN-s3cret"
JOB_IDS = (8001, 8002)  # the jobs the daemon's tests end, each died of fragmentation
HOSTILE_NAME = "llama\r\nBcc: everyone@example.org\r\n\r\n<!channel> [x](http://evil) @here"


# ----------------------------------------------------------------------------- receivers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Mailbox:
    """aiosmtpd's handler: every message the relay took, with its envelope recipients."""

    def __init__(self) -> None:
        self.received: list[tuple[list[str], EmailMessage]] = []

    async def handle_DATA(self, _server: SMTP, _session: SmtpSession, envelope: Envelope) -> str:
        content = envelope.content if isinstance(envelope.content, bytes) else b""
        message = message_from_bytes(content, policy=policy.default)
        assert isinstance(message, EmailMessage)
        self.received.append((list(envelope.rcpt_tos), message))
        return "250 OK"


@dataclass
class Relay:
    port: int
    mailbox: Mailbox = field(default_factory=Mailbox)
    controller: Controller | None = None

    def start(self) -> None:
        self.controller = Controller(self.mailbox, hostname="127.0.0.1", port=self.port)
        self.controller.start()

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
            self.controller = None


@pytest.fixture
def relay() -> Iterator[Relay]:
    running = Relay(free_port())
    running.start()
    yield running
    running.stop()


@pytest.fixture
def relay_down() -> Iterator[Relay]:
    """A relay not started yet: its port answers nothing until `start()`."""
    stopped = Relay(free_port())
    yield stopped
    stopped.stop()


@dataclass
class Receiver:
    """A webhook receiver: the JSON bodies it was sent and the status it answers; with `hang`
    it reads the request and answers nothing until `release` is set."""

    status: int = 200
    hang: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{SECRET}"

    @property
    def delivered(self) -> list[dict[str, Any]]:
        """The bodies it answered 2xx to."""
        return [body for body, code in zip(self.bodies, self.answered, strict=False) if code < 300]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            state.bodies.append(json.loads(self.rfile.read(length)))
            state.arrived.set()
            if state.hang:
                state.release.wait(60)
            status = state.status
            state.answered.append(status)
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *_args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state
    state.release.set()
    server.shutdown()
    server.server_close()


# ----------------------------------------------------------------------------- the record


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    made = make_engine(StoreSettings(url=sqlite_url(tmp_path / "medic.db")))
    upgrade(made)
    yield made
    made.dispose()


@pytest.fixture
def sessions(engine: Engine) -> sessionmaker[Session]:
    return make_session_factory(engine)


@dataclass
class Clock:
    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> None:
        self.now += timedelta(**delta)


def webhook_file(tmp_path: Path, url: str, mode: int = 0o600) -> Path:
    path = tmp_path / "webhook-url"
    path.write_text(url + "\n")
    path.chmod(mode)
    return path


def notify_settings(**values: object) -> NotifySettings:
    return NotifySettings.model_validate(
        {"mail_domain": "example.org", "web_url": "https://medic.example.org", **values}
    )


def mail_to(relay: Relay, **values: object) -> NotifySettings:
    return notify_settings(smtp_host="127.0.0.1", smtp_port=relay.port, **values)


def hook_to(tmp_path: Path, receiver: Receiver, **values: object) -> NotifySettings:
    return notify_settings(webhook_url_file=str(webhook_file(tmp_path, receiver.url)), **values)


def seed_waiting(
    session: Session, job_id: int, *, name: str = "llama-7b", user: str = "alice"
) -> int:
    """A job of `user` that died of a true OOM, its proposal waiting for a person."""
    lineage = repo.create_lineage(session, name=name, owner=user, template="llama-7b")
    job = ended_job(job_id, user=user, name=name, end=T0 - timedelta(minutes=5))
    repo.record_job(session, job=job, lineage_id=lineage.id, attempt=1)
    diagnosis = Diagnosis(FailureKind.TRUE_OOM, Confidence.HIGH, ("did not fit",), step=120)
    incident = repo.record_incident(
        session, slurm_job_id=job_id, evidence=Evidence(job=job), diagnosis=diagnosis
    )
    proposal = repo.propose(
        session,
        incident_id=incident.id,
        fix=seeded_fix(failing_step=120),
        rationale="micro-batch 8 -> 4, grad-accum 4 -> 8: the global batch is kept",
        cost=1.0,
        changes_science=False,
        actor=DAEMON,
    )
    repo.append_audit(
        session,
        actor=DAEMON,
        verb="awaiting_approval",
        subject_type="proposal",
        subject_id=proposal.id,
        details={"reasons": ["the batch lever waits for a person"]},
    )
    session.commit()
    return proposal.id


def seed_drain(session: Session, node: str, *, finding: str | None = None) -> int:
    event = control.record_node_event(
        session,
        node=node,
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason=f"medic: sweep found {finding or 'xid_hardware'}",
        finding=finding,
    )
    session.commit()
    return event.id


def escalate(session: Session, proposal_id: int, outcome: Outcome) -> None:
    """The relaunch of `proposal_id` ran and failed again, judged `outcome` (as verify does)."""
    for state in (ProposalState.APPROVED, ProposalState.SUBMITTING, ProposalState.SUBMITTED):
        repo.transition_proposal(session, proposal_id=proposal_id, to=state, actor=DAEMON)
    proposal = repo.get_row(session, Proposal, proposal_id)
    proposal.relaunch_job_id = 9000 + proposal_id
    repo.record_outcome(session, proposal=proposal, outcome=outcome, step_reached=64)
    repo.transition_proposal(
        session,
        proposal_id=proposal_id,
        to=ProposalState.FAILED,
        actor=DAEMON,
        reason="relaunch failed again (true_oom, was true_oom): same_failure; furthest step 64",
    )
    session.commit()


def look(notifier: Notifier, sessions: sessionmaker[Session]) -> int:
    """The cycle's step: one look at the record, committed."""
    with sessions() as session:
        added = notifier.enqueue(session).added
        session.commit()
    return added


def rows(sessions: sessionmaker[Session]) -> list[Notification]:
    with sessions() as session:
        return list(session.scalars(select(Notification).order_by(Notification.id)))


# ----------------------------------------------------------------------------- delivery


def test_a_waiting_approval_reaches_its_owner_by_mail_and_the_webhook(
    tmp_path: Path, relay: Relay, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        proposal_id = seed_waiting(session, 4242)
    clock = Clock()
    settings = hook_to(tmp_path, receiver, smtp_host="127.0.0.1", smtp_port=relay.port)
    notifier = Notifier(settings, sessions, clock)
    assert look(notifier, sessions) == 2
    sent = notifier.send_due()
    assert [result.state for result in sent] == [NotificationState.SENT] * 2
    [(recipients, mail)] = relay.mailbox.received
    assert recipients == ["alice@example.org"]
    assert mail["To"] == "alice@example.org"
    assert mail["From"] == "slurm-medic@localhost"
    assert mail["Subject"] == (
        f"[slurm-medic] job 4242 (llama-7b): relaunch {proposal_id} waits for your approval"
    )
    body = mail.get_content()
    assert f"slurm-medic approve {proposal_id} --comment" in body
    assert "Job 4242 llama-7b of alice died: true_oom" in body
    assert "https://medic.example.org/approvals" in body
    [hook] = receiver.bodies
    assert set(hook) == {"text"}
    assert f"slurm-medic approve {proposal_id}" in hook["text"]
    assert "`llama-7b`" in hook["text"]
    assert all(row.state == NotificationState.SENT.value for row in rows(sessions))
    assert all(row.sent_at == T0 and row.attempts == 1 for row in rows(sessions))


def test_every_event_is_found_in_the_record_and_nothing_else(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        waiting = seed_waiting(session, 1)
        escalated = seed_waiting(session, 2)
        escalate(session, escalated, Outcome.SAME_FAILURE)
        refused = seed_waiting(session, 3)
        for state in (ProposalState.APPROVED, ProposalState.SUBMITTING, ProposalState.FAILED):
            repo.transition_proposal(session, proposal_id=refused, to=state, actor=DAEMON)
        given_up = repo.create_lineage(session, name="gpt", owner="bob", template="gpt")
        repo.set_lineage_status(
            session,
            lineage_id=given_up.id,
            status=LineageStatus.EXHAUSTED,
            actor=DAEMON,
            reason="a person must decide: no rung left",
        )
        verified = repo.create_lineage(session, name="bert", owner="bob", template="bert")
        repo.set_lineage_status(
            session,
            lineage_id=verified.id,
            status=LineageStatus.VERIFIED,
            actor=DAEMON,
            reason="passed",
        )
        session.commit()
        drained = seed_drain(session, "gpu-07")
        seed_drain(session, "gpu-08", finding="cordon")  # a person's own cordon
    notifier = Notifier(hook_to(tmp_path, receiver), sessions, Clock())
    look(notifier, sessions)
    found = {(row.event, row.subject) for row in rows(sessions)}
    assert found == {
        (NotificationEvent.APPROVAL_WAITING.value, f"proposal:{waiting}"),
        # the escalated and refused proposals also waited once; they wait no more
        (NotificationEvent.RUN_ESCALATED.value, f"proposal:{escalated}"),
        (NotificationEvent.RUN_GIVEN_UP.value, f"lineage:{given_up.id}"),
        (NotificationEvent.NODE_DRAINED.value, f"node_event:{drained}"),
    }


def test_only_the_events_chosen_are_told(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
        seed_drain(session, "gpu-07")
    chosen = hook_to(tmp_path, receiver, events=["node_drained"])
    look(Notifier(chosen, sessions, Clock()), sessions)
    assert [row.event for row in rows(sessions)] == [NotificationEvent.NODE_DRAINED.value]


def test_a_drain_is_mailed_to_the_admins(relay: Relay, sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        seed_drain(session, "gpu-07")
    notifier = Notifier(
        mail_to(relay, admin_mail=["ops@example.org", "hpc@example.org"]), sessions, Clock()
    )
    look(notifier, sessions)
    notifier.send_due()
    assert sorted(rcpt for rcpts, _mail in relay.mailbox.received for rcpt in rcpts) == [
        "hpc@example.org",
        "ops@example.org",
    ]
    assert all(
        mail["Subject"] == "[slurm-medic] node gpu-07 drained by slurm-medic"
        for _rcpts, mail in relay.mailbox.received
    )


def test_two_looks_and_two_daemons_make_one_message(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
    settings = hook_to(tmp_path, receiver)
    first, second = Notifier(settings, sessions, Clock()), Notifier(settings, sessions, Clock())
    assert look(first, sessions) == 1
    assert look(first, sessions) == 0
    assert look(second, sessions) == 0
    first.send_due()
    second.send_due()
    assert look(second, sessions) == 0
    first.send_due()
    assert len(receiver.bodies) == 1


def test_a_restarted_daemon_sends_what_was_left_pending(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
    settings = hook_to(tmp_path, receiver)
    look(Notifier(settings, sessions, Clock()), sessions)  # then the daemon stops
    assert receiver.bodies == []
    restarted = Notifier(settings, sessions, Clock())
    assert look(restarted, sessions) == 0
    restarted.send_due()
    assert len(receiver.delivered) == 1


# ----------------------------------------------------------------------------- retries


def test_a_receiver_that_fails_is_retried_later_then_sent_once(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
    clock = Clock()
    notifier = Notifier(hook_to(tmp_path, receiver, backoff_s=60), sessions, clock)
    look(notifier, sessions)
    receiver.status = 500
    notifier.send_due()
    [row] = rows(sessions)
    assert (row.state, row.attempts) == (NotificationState.PENDING.value, 1)
    assert row.last_error is not None
    assert "500" in row.last_error
    assert SECRET not in row.last_error  # the URL's token stays in its file
    assert row.next_attempt_at == T0 + timedelta(seconds=60)
    receiver.status = 200
    clock.advance(seconds=30)
    assert notifier.send_due() == []  # not due yet
    clock.advance(seconds=31)
    notifier.send_due()
    clock.advance(hours=2)
    notifier.send_due()
    [row] = rows(sessions)
    assert (row.state, row.attempts, row.sent_at) == (
        NotificationState.SENT.value,
        2,
        T0 + timedelta(seconds=61),
    )
    assert receiver.answered == [500, 200]
    assert receiver.bodies[0] == receiver.bodies[1]


def test_a_relay_that_is_down_is_retried_then_sent_once(
    relay_down: Relay, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
    clock = Clock()
    notifier = Notifier(mail_to(relay_down, backoff_s=60), sessions, clock)
    look(notifier, sessions)
    notifier.send_due()
    [row] = rows(sessions)
    assert row.state == NotificationState.PENDING.value
    assert row.last_error is not None
    assert "refused" in row.last_error.lower()
    relay_down.start()
    clock.advance(seconds=61)
    notifier.send_due()
    clock.advance(hours=2)
    notifier.send_due()
    assert len(relay_down.mailbox.received) == 1
    assert rows(sessions)[0].state == NotificationState.SENT.value


def test_after_max_attempts_the_message_is_given_up_with_a_warning(
    tmp_path: Path,
    receiver: Receiver,
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with sessions() as session:
        seed_drain(session, "gpu-07")
    receiver.status = 503
    clock = Clock()
    notifier = Notifier(hook_to(tmp_path, receiver, max_attempts=3, backoff_s=10), sessions, clock)
    look(notifier, sessions)
    with caplog.at_level(logging.WARNING, logger="daemon.notify.sender"):
        for _ in range(6):
            notifier.send_due()
            clock.advance(hours=1)
    [row] = rows(sessions)
    assert (row.state, row.attempts) == (NotificationState.GIVEN_UP.value, 3)
    assert receiver.answered == [503, 503, 503]
    given_up = [r for r in caplog.records if r.getMessage() == "notification given up"]
    assert len(given_up) == 1
    assert given_up[0].levelno == logging.WARNING


def test_the_backoff_doubles_between_tries(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_drain(session, "gpu-07")
    receiver.status = 500
    clock = Clock()
    notifier = Notifier(hook_to(tmp_path, receiver, backoff_s=60), sessions, clock)
    look(notifier, sessions)
    waits = []
    for _ in range(3):
        notifier.send_due()
        [row] = rows(sessions)
        assert row.next_attempt_at is not None
        waits.append(row.next_attempt_at - clock.now)
        clock.now = row.next_attempt_at
    assert waits == [timedelta(seconds=60), timedelta(seconds=120), timedelta(seconds=240)]


# ----------------------------------------------------------------------------- rate limit


def test_the_rate_limit_holds_messages_back_until_the_hour_has_room(
    relay: Relay, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        for node in ("gpu-01", "gpu-02", "gpu-03"):
            seed_drain(session, node)
    clock = Clock()
    limited = mail_to(relay, admin_mail=["ops@example.org"], max_per_recipient_per_hour=2)
    notifier = Notifier(limited, sessions, clock)
    look(notifier, sessions)
    notifier.send_due()
    assert len(relay.mailbox.received) == 2
    held = rows(sessions)[2]
    assert held.state == NotificationState.PENDING.value
    assert held.attempts == 0  # held back is not a failed try
    assert held.next_attempt_at == T0 + timedelta(hours=1)
    clock.advance(minutes=59)
    notifier.send_due()
    assert len(relay.mailbox.received) == 2
    clock.advance(minutes=1)
    notifier.send_due()
    assert len(relay.mailbox.received) == 3
    assert "gpu-03" in relay.mailbox.received[2][1]["Subject"]


def test_the_rate_limit_is_per_recipient_and_channel(
    tmp_path: Path, relay: Relay, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1, user="alice")
        seed_waiting(session, 2, user="alice")
        seed_waiting(session, 3, user="bob")
    limited = hook_to(
        tmp_path,
        receiver,
        smtp_host="127.0.0.1",
        smtp_port=relay.port,
        max_per_recipient_per_hour=1,
    )
    notifier = Notifier(limited, sessions, Clock())
    look(notifier, sessions)
    notifier.send_due()
    assert sorted(rcpts[0] for rcpts, _mail in relay.mailbox.received) == [
        "alice@example.org",
        "bob@example.org",
    ]
    assert len(receiver.bodies) == 1


def test_a_held_approval_decided_meanwhile_is_suppressed(
    relay: Relay, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
        second = seed_waiting(session, 2)
    clock = Clock()
    notifier = Notifier(mail_to(relay, max_per_recipient_per_hour=1), sessions, clock)
    look(notifier, sessions)
    notifier.send_due()
    with sessions() as session:
        alice = repo.Actor.user("alice", 1001)
        repo.transition_proposal(
            session, proposal_id=second, to=ProposalState.APPROVED, actor=alice
        )
        session.commit()
    clock.advance(hours=2)
    notifier.send_due()
    assert len(relay.mailbox.received) == 1
    held = rows(sessions)[1]
    assert held.state == NotificationState.SUPPRESSED.value
    assert held.last_error == f"proposal {second} is approved now: nothing waits"


# ----------------------------------------------------------------------------- hostile text


def test_a_hostile_job_name_reaches_neither_a_header_nor_markup(
    tmp_path: Path, relay: Relay, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1, name=HOSTILE_NAME)
    settings = hook_to(tmp_path, receiver, smtp_host="127.0.0.1", smtp_port=relay.port)
    notifier = Notifier(settings, sessions, Clock())
    look(notifier, sessions)
    notifier.send_due()
    [(recipients, mail)] = relay.mailbox.received
    assert recipients == ["alice@example.org"]
    assert mail["Bcc"] is None
    assert "everyone@example.org" not in mail.get_all("To", [])
    assert mail["Subject"].startswith("[slurm-medic] job 1 (llama Bcc: everyone@example.org")
    text = receiver.bodies[0]["text"]
    assert "<" not in text
    assert ">" not in text
    assert "@here" not in text
    outside_code_spans = re.sub(r"`[^`\n]*`", "", text)
    assert "evil" not in outside_code_spans
    assert "Bcc" not in outside_code_spans
    assert "`llama Bcc: everyone@\u200bexample.org \u2039!channel\u203a" in text


# ----------------------------------------------------------------------------- the secret


def test_a_webhook_file_others_may_read_is_refused(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    loose = webhook_file(tmp_path, receiver.url, mode=0o644)
    settings = notify_settings(webhook_url_file=str(loose))
    with pytest.raises(NotifyConfigError, match="0644: others may read"):
        Notifier(settings, sessions, Clock())
    os.chmod(loose, 0o640)
    assert Notifier(settings, sessions, Clock()).sender.senders.keys() == {
        NotificationChannel.WEBHOOK
    }


def test_a_webhook_file_without_a_url_is_refused(
    tmp_path: Path, sessions: sessionmaker[Session]
) -> None:
    path = webhook_file(tmp_path, "file:///etc/shadow")
    with pytest.raises(NotifyConfigError, match="does not hold one http"):
        Notifier(notify_settings(webhook_url_file=str(path)), sessions, Clock())


# ----------------------------------------------------------------------------- the daemon


def daemon_with(
    engine: Engine, slurm: WindowSlurm, notify: NotifySettings, now: datetime
) -> Daemon:
    base = settings_for(engine).model_dump()
    settings = Settings.model_validate(
        {**base, "policy": {"auto_approve": []}, "notify": notify.model_dump()}
    )
    files = FakeFiles(dict.fromkeys(JOB_IDS, FRAGMENTED))
    return Daemon(settings, backend=slurm, files=files, engine=engine, clock=lambda: now)


def test_the_cycle_tells_of_a_proposal_it_leaves_waiting(
    relay: Relay, engine: Engine, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        start_lineage(session, 8001)
        session.commit()
    slurm = WindowSlurm(ended=[failed_job(8001, end=T0 - timedelta(minutes=5))])
    daemon = daemon_with(engine, slurm, mail_to(relay), T0)
    report = daemon.cycle()
    daemon.cycle()
    daemon.leader.release()
    assert report.errors == []
    assert report.notified == 1
    assert daemon.notifier is not None
    daemon.notifier.send_due()
    [(recipients, mail)] = relay.mailbox.received
    assert recipients == ["alice@example.org"]
    assert "job 8001 (torchrun-example): relaunch" in mail["Subject"]
    assert "slurm-medic approve" in mail.get_content()


def test_a_receiver_that_never_answers_does_not_hold_the_cycle(
    tmp_path: Path, receiver: Receiver, engine: Engine, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        start_lineage(session, 8001)
        start_lineage(session, 8002)
        session.commit()
    receiver.hang = True
    slurm = WindowSlurm(ended=[failed_job(8001, end=T0 - timedelta(minutes=5))])
    daemon = daemon_with(engine, slurm, hook_to(tmp_path, receiver, webhook_timeout_s=60), T0)
    assert daemon.notifier is not None
    assert daemon.cycle().notified == 1
    daemon.notifier.thread.start()
    try:
        assert receiver.arrived.wait(30), "the sender thread never sent"
        slurm.ended.append(failed_job(8002, end=T0 - timedelta(minutes=1)))
        report = daemon.cycle()  # while the sender waits on the receiver
        in_flight = rows(sessions)[0]
        assert report.errors == []
        assert report.notified == 1  # the cycle wrote the record while the send hung
        assert (in_flight.state, in_flight.attempts, in_flight.last_error) == (
            NotificationState.PENDING.value,
            1,
            None,
        )
        assert receiver.answered == []
    finally:
        receiver.release.set()
        daemon.notifier.thread.stop(timeout_s=30)
        daemon.leader.release()
    assert not daemon.notifier.thread.alive
    assert rows(sessions)[0].state == NotificationState.SENT.value


def test_a_sender_killed_mid_send_leaves_the_row_to_the_next_daemon(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
    settings = hook_to(tmp_path, receiver, webhook_timeout_s=10)
    clock = Clock()

    def killed(_row: Notification) -> None:
        raise SystemExit("killed while sending")

    dying = Notifier(settings, sessions, clock, senders={NotificationChannel.WEBHOOK: killed})
    look(dying, sessions)
    with pytest.raises(SystemExit):
        dying.send_due()
    restarted = Notifier(settings, sessions, clock)
    assert restarted.send_due() == []  # claimed: not before the send's timeouts have passed
    clock.advance(seconds=10 + CLAIM_MARGIN_S)
    restarted.send_due()
    [row] = rows(sessions)
    assert (row.state, row.attempts) == (NotificationState.SENT.value, 2)
    assert len(receiver.delivered) == 1


def test_a_channel_configured_no_more_leaves_its_rows_waiting(
    tmp_path: Path, relay: Relay, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_waiting(session, 1)
    both = hook_to(tmp_path, receiver, smtp_host="127.0.0.1", smtp_port=relay.port)
    look(Notifier(both, sessions, Clock()), sessions)
    Notifier(hook_to(tmp_path, receiver), sessions, Clock()).send_due()
    mail, hook = rows(sessions)
    assert (mail.channel, mail.state, mail.attempts) == ("mail", "pending", 0)
    assert (hook.channel, hook.state) == ("webhook", "sent")
    assert relay.mailbox.received == []


def test_a_row_another_daemon_added_meanwhile_is_skipped_and_the_rest_added(
    tmp_path: Path, receiver: Receiver, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        seed_drain(session, "gpu-01")
        seed_drain(session, "gpu-02")
    notifier = Notifier(hook_to(tmp_path, receiver), sessions, Clock())
    look(notifier, sessions)
    with sessions() as session:
        first, second = session.scalars(select(Notification).order_by(Notification.id)).all()
        outgoing = [
            Outgoing(
                NotificationEvent(row.event),
                row.subject,
                NotificationChannel(row.channel),
                row.recipient,
                row.title,
                row.body,
            )
            for row in (first, second)
        ]
        session.delete(second)
        session.commit()
        # The first is in the record already (another daemon's), the second is not.
        assert insert_rows(session, outgoing) == 1
        session.commit()
    assert [row.subject for row in rows(sessions)] == [first.subject, second.subject]


def test_run_refuses_to_start_on_a_webhook_file_others_may_read(tmp_path: Path) -> None:
    loose = webhook_file(tmp_path, f"https://chat.example.org/hooks/{SECRET}", mode=0o604)
    config = tmp_path / "config.toml"
    config.write_text(
        f'[store]\nurl = "sqlite:///{tmp_path / "medic.db"}"\n'
        f'[notify]\nwebhook_url_file = "{loose}"\n'
    )
    result = CliRunner().invoke(
        main, ["run", "--once", "--config", str(config)], env={"SLURM_MEDIC_CONFIG": None}
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert SECRET not in result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("slurm-medic run:")]
    assert "others may read the webhook's secret" in line
