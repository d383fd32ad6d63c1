"""The watch stage: finished jobs from accounting, and running runs that are wedged.

The poll asks sacct once for the window from the stored cursor less the overlap; jobs already
handled are skipped by id, so nothing is handled twice across restarts; a record it cannot read
goes on the record once, with its text, and is skipped; the full records of the jobs to handle
come in one batch, and each ended job is handled (`pipeline`) in its own transaction.

No outage's length can lose a failure. The cursor is held at the start of an accounting gap
(a poll that failed, or slurmctld still holding records for slurmdbd: sdiag, asked before the
window) until that backlog has drained, so the next window reaches back to every job that
ended in the gap, those matched only by `[managed]` rules included. And each job of an active
lineage that has left slurmctld's queue is looked up by its id every poll until accounting has
its final record ("ended, record not yet in accounting" in `status` meanwhile).

The wedge check cancels a running lineage job whose log shows a rank's root failure while the
others hang, once its grace has passed.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from daemon.config import Settings
from daemon.effects import perform
from daemon.evidence.findings import OUTSIDE_ALLOCATION
from daemon.evidence.prober import NodeProber
from daemon.evidence.records import LogFindings
from daemon.gather import JobFiles, read_log_findings
from daemon.pipeline import DAEMON, PipelineDeps, handle_ended_job, incomplete_record_expired
from daemon.slurm.backend import SlurmBackend
from daemon.slurm.errors import SlurmError, SlurmUnavailable
from daemon.slurm.records import SlurmJob
from daemon.store import awaited as awaited_records
from daemon.store import control
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.models import ActionKind, AwaitedRecord

log = logging.getLogger("slurm_medic")

CURSOR = "finished_jobs"
MAX_JOB_FAILURES = 3


@dataclass
class PollReport:
    """What one poll found and did."""

    polled: int = 0
    rejected: int = 0  # unreadable records of the window put on the record by this poll
    handled: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def poll_again_from(session: Session, when: datetime) -> None:
    """Move the cursor back to `when` (never forward): a job that became a lineage's after
    the poll passed it is read again."""
    cursor = control.get_cursor(session, name=CURSOR)
    if cursor is not None and cursor > when:
        control.set_cursor(session, name=CURSOR, polled_until=when)


class Watcher:
    """The poll and the wedge check, with what they remember between cycles: each job's
    failed tries, and when each wedged run was first seen."""

    def __init__(
        self,
        settings: Settings,
        *,
        backend: SlurmBackend,
        files: JobFiles,
        prober: NodeProber | None,
        clock: Callable[[], datetime],
        stopping: threading.Event,
        beat: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.files = files
        self.prober = prober
        self.clock = clock
        self.stopping = stopping
        self._beat = beat  # tells the watchdog that handling makes progress
        self._wedge_seen: dict[int, datetime] = {}
        self._job_failures: dict[int, int] = {}

    def poll(self, session: Session) -> PollReport:
        """One sacct window from the cursor, every new job in it handled or held back."""
        report = PollReport()
        watcher = self.settings.watcher
        now = self.clock()
        cursor = control.get_cursor(session, name=CURSOR)
        session.commit()  # only read: sacct's seconds hold no lock on the record
        start = (
            cursor if cursor is not None else now - timedelta(seconds=watcher.initial_lookback_s)
        )
        since = start - timedelta(seconds=watcher.overlap_s)
        # Asked before the window: a record slurmctld delivered by now is in the answer.
        backlog = self._accounting_backlog()
        deps = PipelineDeps(self.settings, self.prober, self.files)
        try:
            window = self.backend.finished_window(since, now, states=watcher.states)
        except SlurmError as error:
            reason = f"accounting unreachable: {_said(error)}"
            control.hold_cursor(session, name=CURSOR, reason=reason, now=now, start=start)
            session.commit()
            # The managed jobs that ended are still told apart, without asking sacct again.
            self._await_ended(session, report, deps=deps, now=now, tried=set(), down=reason)
            raise
        jobs = window.jobs
        report.polled = len(jobs)
        # Unreadable records are skipped, never waited for (they would hold the cursor for
        # ever): each goes on the record once, with its text, and the window moves on.
        report.rejected = records.record_rejected_records(
            session, rejected=window.rejected, actor=DAEMON, window=(since, now)
        )
        session.commit()
        handled = records.handled_job_ids(session, slurm_job_ids=[job.job_id for job in jobs])
        lineage_jobs = records.lineage_job_ids(session, active_only=False)
        managed = self.settings.managed
        to_handle = [
            job
            for job in sorted(jobs, key=lambda j: (j.end_time or now, j.job_id))
            if job.job_id not in handled
        ]
        wanted = {
            job.job_id: job
            for job in to_handle
            if job.job_id in lineage_jobs
            or managed.matches(account=job.account, partition=job.partition, user=job.user)
        }
        full_records = self._full_records(list(wanted.values()))
        wait = timedelta(seconds=watcher.incomplete_record_wait_s)
        hold_cursor: datetime | None = None
        for job in to_handle:
            if self.stopping.is_set():
                end = job.end_time or now
                hold_cursor = end if hold_cursor is None else min(hold_cursor, end)
                continue
            if job.job_id not in wanted:
                continue
            complete = self._complete_record(job, full_records)
            if not self._handle_one(
                session, job, complete, deps=deps, report=report, now=now, wait=wait
            ):
                end = job.end_time or now
                hold_cursor = end if hold_cursor is None else min(hold_cursor, end)
        session.commit()
        # The window's own jobs were tried once this poll already (a failure counts once).
        self._await_ended(session, report, deps=deps, now=now, tried=set(wanted))
        if backlog is not None:
            control.hold_cursor(session, name=CURSOR, reason=backlog, now=now, start=start)
            return report
        new_cursor = now if hold_cursor is None else min(now, hold_cursor)
        if cursor is not None and new_cursor < cursor:
            new_cursor = cursor
        control.advance_cursor(session, name=CURSOR, polled_until=new_cursor)
        return report

    def _accounting_backlog(self) -> str | None:
        """Why the cursor must stay where it is, or None: slurmctld holds no record back."""
        try:
            queued = self.backend.accounting_backlog()
        except SlurmError as error:
            return f"slurmctld's queue for slurmdbd cannot be read: {_said(error)}"
        if queued:
            return f"slurmctld holds {queued} message(s) for slurmdbd (sdiag's DBD Agent queue)"
        return None

    def _await_ended(
        self,
        session: Session,
        report: PollReport,
        *,
        deps: PipelineDeps,
        now: datetime,
        tried: set[int],
        down: str | None = None,
    ) -> None:
        """Look up by id each job of an active lineage that has left slurmctld's queue and is
        not handled yet (nor `tried` by this poll's window); handle it once accounting has its
        final record, and say meanwhile what accounting showed (`down`: why it was not asked).
        Given up on, on the record, after `ended_record_wait_s`."""
        watcher = self.settings.watcher
        unhandled = awaited_records.unhandled_lineage_jobs(session)
        known = awaited_records.awaited(session)
        session.commit()  # only read: squeue and sacct hold no lock on the record
        if not unhandled:
            if known:
                awaited_records.forget_awaited(session, known)
                session.commit()
            return
        try:
            queue = {job.job_id: job.state for job in self.backend.queued_jobs()}
        except SlurmError as error:  # who has ended cannot be told: the rows stay as they are
            log.warning("slurmctld's queue could not be read: %s", error)
            return
        ended = sorted(
            job_id
            for job_id in unhandled
            if job_id not in tried and (job_id not in queue or queue[job_id].is_terminal())
        )
        awaited_records.forget_awaited(session, [job_id for job_id in known if job_id not in ended])
        session.commit()
        if not ended:
            return
        found: dict[int, SlurmJob] = {}
        unreachable = down
        if down is None:
            try:
                found = {job.job_id: job for job in self.backend.jobs(ended)}
            except SlurmError as error:
                unreachable = f"accounting unreachable: {_said(error)}"
        wait = timedelta(seconds=watcher.incomplete_record_wait_s)
        for job_id in ended:
            if self.stopping.is_set():
                return
            job = found.get(job_id)
            if (
                job is not None
                and job.state.is_terminal()
                and self._handled_by_id(session, job, deps=deps, report=report, now=now, wait=wait)
            ):
                awaited_records.forget_awaited(session, [job_id])
                session.commit()
                continue
            row = awaited_records.note_awaited(
                session,
                slurm_job_id=job_id,
                lineage_id=unhandled[job_id],
                now=now,
                accounting=unreachable or _accounting_shows(job),
            )
            if now - row.left_queue_at > timedelta(seconds=watcher.ended_record_wait_s):
                self._give_up_waiting(session, row)
            session.commit()

    def _handled_by_id(
        self,
        session: Session,
        job: SlurmJob,
        *,
        deps: PipelineDeps,
        report: PollReport,
        now: datetime,
        wait: timedelta,
    ) -> bool:
        """Handle a job found by its id as the window's would be; False: look again."""
        if job.state not in self.settings.watcher.states:
            records.mark_job_handled(
                session,
                slurm_job_id=job.job_id,
                actor=DAEMON,
                outcome="ignored",
                details={"state": job.state.value},
            )
            return True
        complete = job if job.accounting_complete else None
        return self._handle_one(
            session, job, complete, deps=deps, report=report, now=now, wait=wait
        )

    @staticmethod
    def _give_up_waiting(session: Session, row: AwaitedRecord) -> None:
        """Put on the record that accounting never said how this job ended."""
        details = {
            "left_queue_at": row.left_queue_at.isoformat(),
            "looks": row.looks,
            "accounting": row.accounting,
        }
        repo.append_audit(
            session,
            actor=DAEMON,
            verb="record_never_read",
            subject_type="job",
            subject_id=row.slurm_job_id,
            details=details,
        )
        records.mark_job_handled(
            session,
            slurm_job_id=row.slurm_job_id,
            actor=DAEMON,
            outcome="record_never_read",
            details=details,
        )
        awaited_records.forget_awaited(session, [row.slurm_job_id])

    def _handle_one(
        self,
        session: Session,
        job: SlurmJob,
        complete: SlurmJob | None,
        *,
        deps: PipelineDeps,
        report: PollReport,
        now: datetime,
        wait: timedelta,
    ) -> bool:
        """Handle one job (`complete`: its full record, None while accounting has only a
        placeholder) in its own transaction; False: try it again next cycle.

        A job whose handling keeps failing is recorded as such after MAX_JOB_FAILURES tries,
        so one bad record cannot hold every later job's cursor back forever.
        """
        self._beat()
        try:
            if complete is None:
                if not incomplete_record_expired(job, now, wait):
                    return False
                complete = job
            result = handle_ended_job(session, complete, deps)
            session.commit()
        except Exception as error:  # one job's failure must not stop the others
            session.rollback()
            failures = self._job_failures.get(job.job_id, 0) + 1
            self._job_failures[job.job_id] = failures
            log.exception("handling job %s failed (try %d)", job.job_id, failures)
            report.errors.append(f"job {job.job_id}: {error}")
            if failures < MAX_JOB_FAILURES:
                return False
            records.mark_job_handled(
                session,
                slurm_job_id=job.job_id,
                actor=DAEMON,
                outcome="error",
                details={"error": str(error)[:2000], "tries": failures},
            )
            session.commit()
            return True
        self._job_failures.pop(job.job_id, None)
        if result.outcome != "unmanaged":
            report.handled.append(result)
            log.info("handled job", extra={"fields": dict(vars(result))})
        return True

    def _full_records(self, jobs: Sequence[SlurmJob]) -> dict[int, SlurmJob]:
        """The full records (exit codes, std paths) of the jobs worth handling, asked for all
        of them at once; where Slurm cannot say, each job keeps its window's record."""
        ids = [job.job_id for job in jobs if job.accounting_complete]
        if not ids:
            return {}
        try:
            return {full.job_id: full for full in self.backend.jobs(ids)}
        except SlurmError as error:
            log.warning("the full records of %d job(s) could not be read: %s", len(ids), error)
            return {}

    @staticmethod
    def _complete_record(job: SlurmJob, full_records: Mapping[int, SlurmJob]) -> SlurmJob | None:
        """The record to handle the job by; None: accounting has only a placeholder, wait."""
        if not job.accounting_complete:
            return None
        full = full_records.get(job.job_id, job)
        return full if full.accounting_complete else None

    def cancel_wedged(self, session: Session) -> list[int]:
        """Cancel a run whose log shows a rank's root failure while the others hang; never
        while paused or dry-running, which promise no scancel. The jobs cancelled."""
        wedge, policy = self.settings.wedge, self.settings.policy
        if not wedge.enabled or policy.dry_run or policy.paused or control.is_paused(session):
            return []
        lineage_jobs = records.lineage_job_ids(session)
        session.commit()  # only read: squeue and the log reads hold no lock on the record
        if not lineage_jobs:
            return []
        now = self.clock()
        cancelled: list[int] = []
        running = [job.job_id for job in self.backend.running_jobs() if job.job_id in lineage_jobs]
        if not running:
            return []
        # Full records (std paths) of every running lineage job at once; one gone is skipped.
        for job in self.backend.jobs(running):
            findings = read_log_findings(job, self.files, wedge.log_tail_bytes)
            if not root_failure_seen(findings):
                self._wedge_seen.pop(job.job_id, None)
                continue
            first = self._wedge_seen.setdefault(job.job_id, now)
            if now - first < timedelta(seconds=wedge.grace_s):
                continue
            done = perform(
                session,
                kind=ActionKind.SCANCEL,
                argv=["scancel", str(job.job_id)],
                actor=DAEMON,
                run=functools.partial(self.backend.cancel, job.job_id),
            )
            if not done.succeeded:
                continue
            repo.append_audit(
                session,
                actor=DAEMON,
                verb="wedged_cancelled",
                subject_type="job",
                subject_id=job.job_id,
                details={
                    "first_seen": first.isoformat(),
                    "grace_s": wedge.grace_s,
                    "notes": [n for n in findings.notes if n.startswith(OUTSIDE_ALLOCATION)],
                },
            )
            session.commit()
            self._wedge_seen.pop(job.job_id, None)
            cancelled.append(job.job_id)
        return cancelled


def _said(error: SlurmError) -> str:
    """What Slurm last said, without the argv (a window's times change at every poll)."""
    return error.last_error if isinstance(error, SlurmUnavailable) else str(error)


def _accounting_shows(job: SlurmJob | None) -> str:
    """What accounting answered for a job that has left the queue, in a person's words."""
    if job is None:
        return "no record yet"
    if not job.state.is_terminal():
        return f"a record that still reads {job.state.value}"
    return "a placeholder record"


def root_failure_seen(findings: LogFindings) -> bool:
    """A rank's root failure in the log of a job still running: the others hang."""
    return findings.oom is not None or (
        findings.root_failure_line is not None and findings.traceback_seen
    )
