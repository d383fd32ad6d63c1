"""No managed failure lost to an accounting outage, with Slurm faked at its seam: the cursor is
held at the start of a gap while slurmctld still holds records for slurmdbd, and a lineage job
that has left the queue is looked up by id until accounting has its final record.

The same outages on the real cluster (slurmdbd stopped, slurmctld restarted, the daemon
restarted) are in test_accounting_outage_cluster.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, select

from daemon.commands.record_views import status_document, visible_status
from daemon.config import Settings
from daemon.service import Daemon
from daemon.slurm.errors import JobNotFound, SlurmUnavailable
from daemon.slurm.records import JobState, JobWindow, QueuedJob, SlurmJob
from daemon.store.engine import make_session_factory
from daemon.store.models import AuditEvent, AwaitedRecord, Cursor
from daemon.store.schema import upgrade
from daemon.store.settings import StoreSettings
from daemon.watch import CURSOR
from tests.test_actions_store import FakeSlurm
from tests.test_pipeline import FRAGMENTED, FakeFiles, failed_job, start_lineage

START = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
OVERLAP_S = 30


@pytest.fixture
def fresh_engine(empty_db_engine: Engine) -> Engine:
    upgrade(empty_db_engine)
    return empty_db_engine


def down(command: str) -> SlurmUnavailable:
    return SlurmUnavailable(
        "Slurm did not answer", argv=[command], attempts=3, last_error="Connection refused"
    )


@dataclass
class Accounting(FakeSlurm):
    """slurmdbd and slurmctld as an outage leaves them: `delivered` is what sacct can read,
    `held` what slurmctld still queues for slurmdbd, `queued` slurmctld's queue."""

    delivered: list[SlurmJob] = field(default_factory=list)
    held: list[SlurmJob] = field(default_factory=list)
    queued: dict[int, JobState] = field(default_factory=dict)
    slurmdbd_up: bool = True
    slurmctld_up: bool = True
    windows: list[tuple[datetime, datetime]] = field(default_factory=list)
    looked_up: list[int] = field(default_factory=list)  # sacct --jobs, by id

    def finished_window(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> JobWindow:
        if not self.slurmdbd_up:
            raise down("sacct")
        self.windows.append((since, until))
        return super().finished_window(since, until, states)

    def finished_jobs(
        self, since: datetime, until: datetime, states: Iterable[JobState] = ()
    ) -> tuple[SlurmJob, ...]:
        wanted = frozenset(states)
        return tuple(
            job
            for job in self.delivered
            if job.state in wanted and since <= (job.end_time or until) <= until
        )

    def job(self, job_id: int | str) -> SlurmJob:
        self.looked_up.append(int(job_id))
        if not self.slurmdbd_up:
            raise down("sacct")
        for job in self.delivered:
            if job.job_id == int(job_id):
                return job
        raise JobNotFound(f"accounting has no job {job_id}")

    def queued_jobs(self) -> tuple[QueuedJob, ...]:
        if not self.slurmctld_up:
            raise down("squeue")
        return tuple(QueuedJob(job_id, "alice", "", state) for job_id, state in self.queued.items())

    def accounting_backlog(self) -> int:
        if not self.slurmctld_up:
            raise down("sdiag")
        return len(self.held) if self.slurmdbd_up else len(self.held) + 1

    def submit(
        self,
        script: str,
        *,
        as_user: str,
        comment: str | None = None,
        exclude_nodes: Iterable[str] = (),
        extra_args: Sequence[str] = (),
        work_dir: str | None = None,
    ) -> int:
        """A relaunch waits in slurmctld's queue."""
        job_id = super().submit(
            script,
            as_user=as_user,
            comment=comment,
            exclude_nodes=exclude_nodes,
            extra_args=extra_args,
            work_dir=work_dir,
        )
        self.queued[job_id] = JobState.PENDING
        return job_id

    def deliver(self) -> None:
        """slurmdbd is back and slurmctld's agent has sent what it held."""
        self.delivered += self.held
        self.held = []


def settings_for(
    engine: Engine, managed: dict[str, list[str]] | None = None, **watcher: object
) -> Settings:
    return Settings.model_validate(
        {
            "store": StoreSettings(url=engine.url.render_as_string(hide_password=False)),
            "watcher": {"overlap_s": OVERLAP_S, "initial_lookback_s": 60, **watcher},
            "wedge": {"enabled": False},
            "managed": managed or {},
        }
    )


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


def daemon(
    engine: Engine,
    slurm: Accounting,
    clock: Clock,
    managed: dict[str, list[str]] | None = None,
    **watcher: object,
) -> Daemon:
    files = FakeFiles({job_id: FRAGMENTED for job_id in range(9000, 9100)})
    settings = settings_for(engine, managed, **watcher)
    return Daemon(settings, backend=slurm, files=files, engine=engine, clock=clock)


def handled(engine: Engine, job_id: int) -> list[AuditEvent]:
    with make_session_factory(engine)() as session:
        return list(
            session.scalars(
                select(AuditEvent).where(
                    AuditEvent.verb == "job_handled", AuditEvent.subject_id == str(job_id)
                )
            )
        )


def cursor(engine: Engine) -> Cursor:
    with make_session_factory(engine)() as session:
        found = session.get(Cursor, CURSOR)
        assert found is not None
        session.expunge(found)
        return found


def status(engine: Engine, medic: Daemon) -> dict[str, object]:
    with make_session_factory(engine)() as session:
        return status_document(session, medic.settings)


def lineage_jobs(engine: Engine, *job_ids: int) -> None:
    with make_session_factory(engine)() as session:
        for job_id in job_ids:
            start_lineage(session, job_id)
        session.commit()


def test_a_record_delivered_after_the_overlap_is_still_in_the_window(
    fresh_engine: Engine,
) -> None:
    """The measured case: the job ends early in a slurmdbd outage longer than the overlap;
    sacct answers again before slurmctld has delivered its record. Unmanaged by lineage, so
    only the window (a `[managed]` rule) can find it."""
    slurm, clock = Accounting(), Clock()
    medic = daemon(fresh_engine, slurm, clock, managed={"accounts": ["training"]})
    medic.cycle()
    last_moved = cursor(fresh_engine).updated_at
    slurm.slurmdbd_up = False
    clock.now += timedelta(seconds=2)
    slurm.held.append(failed_job(9001, end=clock.now + timedelta(seconds=9)))
    for _ in range(8):  # 80 s of outage, several times the overlap
        clock.now += timedelta(seconds=10)
        assert medic.cycle().errors
    held = cursor(fresh_engine)
    assert held.polled_until == START
    assert held.held_reason == "accounting unreachable: Connection refused"
    # The stale-poll alert reads when the cursor last moved: a hold moves nothing.
    assert held.updated_at == last_moved
    slurm.slurmdbd_up = True  # sacct answers; slurmctld still holds the record
    for _ in range(3):
        clock.now += timedelta(seconds=5)
        medic.cycle()
    assert cursor(fresh_engine).polled_until == START
    assert "DBD Agent queue" in (cursor(fresh_engine).held_reason or "")
    assert handled(fresh_engine, 9001) == []
    slurm.deliver()
    clock.now += timedelta(seconds=5)
    medic.cycle()
    clock.now += timedelta(seconds=5)
    medic.cycle()
    medic.leader.release()
    [event] = handled(fresh_engine, 9001)
    assert event.details["outcome"] != "error"
    moved = cursor(fresh_engine)
    assert moved.polled_until == clock.now
    assert moved.held_since is None
    assert moved.held_reason is None


def test_the_cursor_holds_while_the_window_answers_without_the_record(
    fresh_engine: Engine,
) -> None:
    """Without the hold the first good poll after the outage moved the cursor to now; the
    record then arrived with an end older than the overlap, in no window ever."""
    slurm, clock = Accounting(), Clock()
    medic = daemon(fresh_engine, slurm, clock)
    medic.cycle()
    slurm.held.append(failed_job(9002, end=START + timedelta(seconds=5)))
    clock.now += timedelta(minutes=10)
    medic.cycle()
    medic.leader.release()
    since, _until = slurm.windows[-1]
    assert since == START - timedelta(seconds=OVERLAP_S)
    assert cursor(fresh_engine).held_since == clock.now


def test_a_lineage_job_that_left_the_queue_is_looked_up_by_id_until_accounting_has_it(
    fresh_engine: Engine,
) -> None:
    lineage_jobs(fresh_engine, 9003)
    slurm, clock = Accounting(queued={9003: JobState.RUNNING}), Clock()
    medic = daemon(fresh_engine, slurm, clock)
    medic.cycle()
    assert status(fresh_engine, medic)["records_in_flight"] == {"held": [], "awaited": []}
    del slurm.queued[9003]  # ended; slurmdbd down, and slurmctld forgets it (MinJobAge)
    slurm.slurmdbd_up = False
    clock.now += timedelta(seconds=10)
    medic.cycle()
    in_flight = status(fresh_engine, medic)["records_in_flight"]
    assert isinstance(in_flight, dict)
    [awaited] = in_flight["awaited"]
    assert awaited["job"] == 9003
    assert awaited["owner"] == "alice"
    assert awaited["looks"] == 1
    assert awaited["accounting"].startswith("accounting unreachable")
    [held] = in_flight["held"]
    assert held["watcher"] == CURSOR
    assert "accounting unreachable" in held["reason"]
    assert slurm.looked_up == []  # the window's sacct failed: not asked again by id
    slurm.slurmdbd_up = True
    clock.now += timedelta(seconds=10)
    medic.cycle()
    [awaited] = status(fresh_engine, medic)["records_in_flight"]["awaited"]  # type: ignore[index]
    assert awaited["accounting"] == "no record yet"
    assert awaited["looks"] == 2
    # Delivered late, with an end time no window from here reaches: found by its id.
    slurm.delivered.append(failed_job(9003, end=START - timedelta(hours=1)))
    clock.now += timedelta(seconds=10)
    medic.cycle()
    clock.now += timedelta(seconds=10)
    medic.cycle()
    medic.leader.release()
    assert len(handled(fresh_engine, 9003)) == 1
    assert status(fresh_engine, medic)["records_in_flight"]["awaited"] == []  # type: ignore[index]
    assert len(slurm.submitted) == 1  # the allocator fix, relaunched once


def test_a_record_that_still_reads_running_is_waited_for(fresh_engine: Engine) -> None:
    lineage_jobs(fresh_engine, 9004)
    slurm, clock = Accounting(), Clock()
    running = failed_job(9004, state=JobState.RUNNING)
    slurm.delivered.append(running)  # the start record arrived, the end is still held
    medic = daemon(fresh_engine, slurm, clock)
    medic.cycle()
    medic.leader.release()
    [awaited] = status(fresh_engine, medic)["records_in_flight"]["awaited"]  # type: ignore[index]
    assert awaited["accounting"] == "a record that still reads RUNNING"
    assert handled(fresh_engine, 9004) == []


def test_a_job_still_in_the_queue_or_requeued_is_not_awaited(fresh_engine: Engine) -> None:
    lineage_jobs(fresh_engine, 9005)
    slurm, clock = Accounting(queued={9005: JobState.FAILED}), Clock()
    medic = daemon(fresh_engine, slurm, clock)
    medic.cycle()
    [awaited] = status(fresh_engine, medic)["records_in_flight"]["awaited"]  # type: ignore[index]
    assert awaited["job"] == 9005  # ended, though slurmctld still shows it
    slurm.queued[9005] = JobState.PENDING  # Slurm requeued it
    clock.now += timedelta(seconds=10)
    medic.cycle()
    medic.leader.release()
    assert status(fresh_engine, medic)["records_in_flight"]["awaited"] == []  # type: ignore[index]


def test_nothing_is_told_when_slurmctld_does_not_answer(fresh_engine: Engine) -> None:
    lineage_jobs(fresh_engine, 9006)
    slurm, clock = Accounting(slurmctld_up=False), Clock()
    medic = daemon(fresh_engine, slurm, clock)
    medic.cycle()
    medic.leader.release()
    in_flight = status(fresh_engine, medic)["records_in_flight"]
    assert in_flight["awaited"] == []  # type: ignore[index]
    [held] = in_flight["held"]  # type: ignore[index]
    assert "cannot be read" in held["reason"]


def test_a_record_that_never_comes_is_given_up_on_the_record_once(fresh_engine: Engine) -> None:
    lineage_jobs(fresh_engine, 9007)
    slurm, clock = Accounting(), Clock()
    medic = daemon(fresh_engine, slurm, clock, ended_record_wait_s=3600)
    medic.cycle()
    clock.now += timedelta(minutes=59)
    medic.cycle()
    assert handled(fresh_engine, 9007) == []
    clock.now += timedelta(minutes=2)
    medic.cycle()
    clock.now += timedelta(minutes=2)
    medic.cycle()
    medic.leader.release()
    [gave_up] = handled(fresh_engine, 9007)
    assert gave_up.details["outcome"] == "record_never_read"
    assert gave_up.details["accounting"] == "no record yet"
    with make_session_factory(fresh_engine)() as session:
        assert session.scalars(select(AwaitedRecord)).all() == []
        never = session.scalars(
            select(AuditEvent).where(AuditEvent.verb == "record_never_read")
        ).all()
    assert [event.subject_id for event in never] == ["9007"]


def test_a_daemon_restarted_mid_outage_keeps_the_hold_and_the_wait(fresh_engine: Engine) -> None:
    lineage_jobs(fresh_engine, 9008)
    slurm, clock = Accounting(queued={9008: JobState.RUNNING}), Clock()
    first = daemon(fresh_engine, slurm, clock)
    first.cycle()
    del slurm.queued[9008]
    slurm.slurmdbd_up = False
    slurm.held.append(failed_job(9008, end=clock.now + timedelta(seconds=1)))
    clock.now += timedelta(seconds=10)
    first.cycle()
    first.leader.release()
    clock.now += timedelta(minutes=5)
    restarted = daemon(fresh_engine, slurm, clock)
    restarted.cycle()
    [awaited] = status(fresh_engine, restarted)["records_in_flight"]["awaited"]  # type: ignore[index]
    assert awaited["looks"] == 2
    assert awaited["left_queue_at"] is not None
    assert cursor(fresh_engine).polled_until == START
    slurm.slurmdbd_up = True
    slurm.deliver()
    for _ in range(2):
        clock.now += timedelta(seconds=10)
        restarted.cycle()
    restarted.leader.release()
    assert len(handled(fresh_engine, 9008)) == 1
    assert len(slurm.submitted) == 1
    assert cursor(fresh_engine).held_since is None


def test_a_reader_sees_only_the_awaited_jobs_of_runs_they_may_see(fresh_engine: Engine) -> None:
    lineage_jobs(fresh_engine, 9009)
    slurm, clock = Accounting(), Clock()
    medic = daemon(fresh_engine, slurm, clock)
    medic.cycle()
    medic.leader.release()
    document = status(fresh_engine, medic)
    assert visible_status(document, lambda owner: owner == "alice")["records_in_flight"]["awaited"]
    shown = visible_status(document, lambda owner: owner == "bob")["records_in_flight"]
    assert shown["awaited"] == []
