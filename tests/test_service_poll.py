"""The service's cycle with Slurm faked at its seam: a job in every overlapping window is
handled once, across a restart too; stale proposals expire; a standby daemon does nothing."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, select

from daemon.config import Settings
from daemon.evidence.records import LogFindings
from daemon.service import Daemon
from daemon.slurm.errors import JobNotFound
from daemon.slurm.records import JobState, SlurmJob
from daemon.store.engine import make_session_factory
from daemon.store.models import AuditEvent, Proposal
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings
from tests.test_actions_store import FakeSlurm
from tests.test_pipeline import FRAGMENTED, FakeFiles, failed_job, start_lineage

NOW = datetime(2026, 11, 1, 12, 30, tzinfo=UTC)


@pytest.fixture
def fresh_engine(empty_db_engine: Engine) -> Engine:
    """A record of its own per test (the cycle commits; nothing to roll back)."""
    upgrade(empty_db_engine)
    return empty_db_engine


@dataclass
class WindowSlurm(FakeSlurm):
    """Every poll's window holds the same ended jobs, as overlapping windows do."""

    ended: list[SlurmJob] = field(default_factory=list)
    polls: int = 0

    def finished_jobs(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> tuple[SlurmJob, ...]:
        self.polls += 1
        return tuple(job for job in self.ended if since <= (job.end_time or until) <= until)

    def job(self, job_id: int | str) -> SlurmJob:
        for job in self.ended:
            if job.job_id == int(job_id):
                return job
        raise JobNotFound(f"accounting has no job {job_id}")


def settings_for(engine: Engine) -> Settings:
    url = engine.url.render_as_string(hide_password=False)
    return Settings.model_validate(
        {
            "store": StoreSettings(url=url),
            "watcher": {"overlap_s": 3600, "initial_lookback_s": 3600},
            "wedge": {"enabled": False},
        }
    )


def daemon(engine: Engine, slurm: WindowSlurm, now: datetime = NOW) -> Daemon:
    files = FakeFiles({job.job_id: FRAGMENTED for job in slurm.ended})
    return Daemon(
        settings_for(engine), backend=slurm, files=files, engine=engine, clock=lambda: now
    )


def handled_events(engine: Engine, job_id: int) -> int:
    with make_session_factory(engine)() as session:
        return len(
            session.scalars(
                select(AuditEvent).where(
                    AuditEvent.verb == "job_handled", AuditEvent.subject_id == str(job_id)
                )
            ).all()
        )


def test_a_job_in_every_window_is_handled_once_across_a_restart(fresh_engine: Engine) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 8001)
        session.commit()
    slurm = WindowSlurm(ended=[failed_job(8001, end=NOW - timedelta(minutes=5))])
    first = daemon(fresh_engine, slurm)
    first.cycle()
    first.cycle()
    first.leader.release()
    restarted = daemon(fresh_engine, slurm, NOW + timedelta(minutes=1))
    restarted.cycle()
    restarted.leader.release()
    assert slurm.polls == 3
    assert handled_events(fresh_engine, 8001) == 1
    assert len(slurm.submitted) == 1  # the approved allocator fix, relaunched once


def test_a_standby_daemon_neither_polls_nor_acts(fresh_engine: Engine) -> None:
    slurm = WindowSlurm()
    leader = daemon(fresh_engine, slurm)
    standby = daemon(fresh_engine, slurm)
    assert leader.leader.try_acquire()
    report = standby.cycle()
    leader.leader.release()
    assert not report.leader
    assert slurm.polls == 0


def test_a_proposal_nobody_decides_on_expires(fresh_engine: Engine) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 8101)
        session.commit()
    slurm = WindowSlurm(ended=[failed_job(8101, end=NOW - timedelta(minutes=5))])
    waiting = Settings.model_validate(
        {**settings_for(fresh_engine).model_dump(), "policy": {"auto_approve": []}}
    )
    first = Daemon(
        waiting,
        backend=slurm,
        files=FakeFiles({8101: FRAGMENTED}),
        engine=fresh_engine,
        clock=lambda: NOW,
    )
    first.cycle()
    first.leader.release()
    later = Daemon(
        waiting,
        backend=slurm,
        files=FakeFiles({8101: FRAGMENTED}),
        engine=fresh_engine,
        clock=lambda: datetime.now(UTC) + timedelta(days=8),
    )
    later.cycle()
    later.leader.release()
    with make_session_factory(fresh_engine)() as session:
        proposal = session.scalars(
            select(Proposal).where(Proposal.remediator == "allocator_expandable_segments")
        ).all()[-1]
    assert proposal.state == "expired"
    assert slurm.submitted == []


class BrokenFiles(FakeFiles):
    """A reader that fails for one job, as a bug or a corrupt record would."""

    def scan_log(self, job: SlurmJob, path: str, max_bytes: int) -> LogFindings:
        if job.job_id == 8201:
            raise RuntimeError("corrupt record")
        return super().scan_log(job, path, max_bytes)


def test_one_job_that_cannot_be_handled_holds_back_nothing_else(fresh_engine: Engine) -> None:
    with make_session_factory(fresh_engine)() as session:
        start_lineage(session, 8201)
        start_lineage(session, 8202)
        session.commit()
    slurm = WindowSlurm(
        ended=[
            failed_job(8201, end=NOW - timedelta(minutes=6)),
            failed_job(8202, end=NOW - timedelta(minutes=5)),
        ]
    )
    files = BrokenFiles({8201: FRAGMENTED, 8202: FRAGMENTED})
    service = Daemon(
        settings_for(fresh_engine),
        backend=slurm,
        files=files,
        engine=fresh_engine,
        clock=lambda: NOW,
    )
    reports = [service.cycle() for _ in range(3)]
    service.leader.release()
    assert handled_events(fresh_engine, 8202) == 1
    assert [len(report.errors) for report in reports] == [1, 1, 1]
    with make_session_factory(fresh_engine)() as session:
        gave_up = session.scalars(
            select(AuditEvent).where(
                AuditEvent.verb == "job_handled", AuditEvent.subject_id == "8201"
            )
        ).one()
    assert gave_up.details["outcome"] == "error"
    assert gave_up.details["tries"] == 3
