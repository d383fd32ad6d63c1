"""The daemon: an APScheduler-driven cycle of watch -> handle -> act -> verify -> expire.

One cycle, in order: poll finished jobs (one sacct call from the stored cursor less the
overlap; jobs already handled are skipped by id, so nothing is handled twice across
restarts; a record it cannot read goes on the record once, with its text, and is skipped),
ask for the full records of the jobs to handle in one batch, handle each ended job
(`pipeline`), cancel wedged runs, act on approved proposals (`actions`), follow relaunches
(`verify`), expire stale proposals. Only the leader acts: a PostgreSQL advisory lock, or an
flock on a file beside the SQLite database. SIGTERM lets the step in flight finish, then
stops. systemd gets READY=1 and WATCHDOG=1 over NOTIFY_SOCKET.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import pwd
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from sqlalchemy import Connection, Engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from daemon import process
from daemon.actions import ActDeps, act_on_approved
from daemon.config import Settings
from daemon.effects import perform
from daemon.evidence.findings import OUTSIDE_ALLOCATION
from daemon.evidence.prober import NodeProber
from daemon.evidence.records import LogFindings
from daemon.gather import JobFiles, OwnerJobFiles, read_log_findings
from daemon.hook import HookError, HookListener, parse_slurm_user
from daemon.pipeline import (
    DAEMON,
    PipelineDeps,
    handle_ended_job,
    incomplete_record_expired,
)
from daemon.slurm.backend import CommandRunner, SlurmBackend
from daemon.slurm.errors import SlurmError
from daemon.slurm.records import JobState, QueuedJob, SlurmJob
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.models import ActionKind, AuditEvent, Lineage, Proposal
from daemon.store.schema import check_schema_current
from daemon.store.states import ProposalState
from daemon.verify import FollowDeps, follow_relaunches

log = logging.getLogger("slurm_medic")

CURSOR = "finished_jobs"
MAX_JOB_FAILURES = 3
# A first submission's intent older than this is not looked for again (bounds each cycle).
FIRST_SUBMISSION_HORIZON = timedelta(days=1)
# How long before its intent a submission is looked for in accounting (clocks differ).
TOKEN_LOOKBACK = timedelta(minutes=5)
SCONTROL_CONFIG_ARGV = ("scontrol", "show", "config")
# The account slurmctld runs as in Debian's and SchedMD's packages: the hook's sender when
# `scontrol show config` cannot say.
DEFAULT_SLURM_USER = "slurm"
# However many datagrams the hook sends, at most one extra cycle a second.
HOOK_WAKE_INTERVAL_S = 1.0
VERB_FOREIGN_TOKEN = "token_on_foreign_job"  # noqa: S105 (an audit verb, not a secret)
# Every state sacct's --state accepts (22.05 refuses COMPLETING and SPECIAL_EXIT with a fatal
# error): a reconciliation must find its job whatever became of it.
ACCOUNTED_STATES = tuple(
    state
    for state in JobState
    if state not in (JobState.COMPLETING, JobState.SPECIAL_EXIT, JobState.UNKNOWN)
)
ADVISORY_LOCK_KEY = 0x6D65646963  # "medic"


def carries_token(comment: str | None, token: str) -> bool:
    """The token is one whole field of the comment (fields split on white space), never a
    part of a longer word: `xmedic-ab` or `medic-abc` does not carry `medic-ab`."""
    return bool(token) and comment is not None and token in comment.split()


@dataclass(frozen=True)
class TokenSearch:
    """Where Slurm shows a token: the owner's job carrying it, and other users' jobs that
    carry it too (a copied token: ignored, and noted)."""

    found: int | None
    foreign: tuple[tuple[int, str], ...] = ()


class CommentLookup:
    """Job comments as Slurm shows them, asked at most once per reconciliation however many
    intents it closes: slurmctld's queue (one squeue) and, only when the queue lacks an
    owner's job, accounting since the earliest intent (one sacct)."""

    def __init__(self, backend: SlurmBackend, *, since: datetime, until: datetime) -> None:
        self._backend = backend
        self._since = since
        self._until = until
        self._queued: tuple[QueuedJob, ...] | None = None
        self._accounted: tuple[SlurmJob, ...] | None = None

    def search(self, token: str, owner: str | None) -> TokenSearch:
        """The owner's job whose comment carries the token. Slurm 22.05 accounting stores a
        job's comment only when the job ends, so a live relaunch is found in slurmctld's
        queue (which also keeps ended jobs for MinJobAge), an older one in accounting.

        Comments are visible to every user (squeue), so anyone may copy a token into a job of
        their own: only a job of the lineage's owner counts (no owner known, none does)."""
        if self._queued is None:
            self._queued = self._backend.queued_jobs()
        carrying = [
            (job.job_id, job.user) for job in self._queued if carries_token(job.comment, token)
        ]
        if not any(user == owner for _job_id, user in carrying):
            if self._accounted is None:
                self._accounted = self._backend.finished_jobs(
                    self._since, self._until, states=ACCOUNTED_STATES
                )
            carrying += [
                (job.job_id, job.user)
                for job in self._accounted
                if carries_token(job.comment, token)
            ]
        carrying = list(dict.fromkeys(carrying))
        found = next((job_id for job_id, user in carrying if user == owner), None)
        foreign = tuple((job_id, user) for job_id, user in carrying if user != owner)
        return TokenSearch(found, foreign)


# ------------------------------------------------------------------------------ logging


class JsonFormatter(logging.Formatter):
    """One JSON object per line on stderr: journald keeps it, people and tools read it."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "at": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


# ------------------------------------------------------------------------------ systemd


def sd_notify(message: str, environ: dict[str, str] | None = None) -> bool:
    """Send one datagram to systemd's NOTIFY_SOCKET; False when not run by systemd."""
    address = (environ if environ is not None else os.environ).get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError as error:
            log.warning("sd_notify failed: %s", error)
            return False
    return True


def watchdog_window_s(environ: Mapping[str, str]) -> float:
    """systemd's WatchdogSec as it tells the service (WATCHDOG_USEC); 90 s when not told."""
    try:
        return max(1.0, int(environ["WATCHDOG_USEC"]) / 1_000_000)
    except (KeyError, ValueError):
        return 90.0


# ------------------------------------------------------------------------------ leader


class LeaderLock:
    """Held for the daemon's life; two daemons on one database never both act."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self._engine = engine
        self._settings = settings
        self._connection: Connection | None = None
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock, or confirm it is still ours (every cycle asks before acting)."""
        if self._connection is not None and not self._still_holding():
            self._connection.invalidate()
            self._connection = None
            log.warning("the leader lock's database session was lost; taking it again")
        if self.held:
            return True
        if self._engine.url.get_backend_name() == "postgresql":
            connection = self._engine.connect()
            got = connection.execute(
                text("SELECT pg_try_advisory_lock(:key)"), {"key": ADVISORY_LOCK_KEY}
            ).scalar()
            connection.commit()
            if got:
                self._connection = connection
                return True
            connection.close()
            return False
        path = self.lock_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def _still_holding(self) -> bool:
        """A PostgreSQL session that died (server restart, killed backend) took its advisory
        lock with it, and another daemon may hold it now."""
        assert self._connection is not None
        try:
            held = self._connection.execute(
                text(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
                    " AND pid = pg_backend_pid() AND granted)"
                )
            ).scalar()
            self._connection.commit()
        except DBAPIError:
            return False
        return bool(held)

    def lock_path(self) -> Path:
        database = self._engine.url.database or "medic.db"
        return Path(database + ".leader")

    @property
    def held(self) -> bool:
        return self._connection is not None or self._fd is not None

    def release(self) -> None:
        if self._connection is not None:
            # A pooled connection outlives close(): unlock first, or the lock stays held.
            try:
                self._connection.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_LOCK_KEY}
                )
                self._connection.commit()
                self._connection.close()
            except DBAPIError:
                self._connection.invalidate()
            self._connection = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ------------------------------------------------------------------------------- daemon


@dataclass
class CycleReport:
    """What one cycle did (logged, and returned to tests and benchmarks)."""

    leader: bool = False
    polled: int = 0
    rejected: int = 0  # unreadable records of the poll's window put on the record this cycle
    handled: list[Any] = field(default_factory=list)
    acted: list[Any] = field(default_factory=list)
    followed: list[Any] = field(default_factory=list)
    wedged_cancelled: list[int] = field(default_factory=list)
    expired: int = 0
    errors: list[str] = field(default_factory=list)


class Daemon:
    """The service object: one `cycle()` is one pass of every step; `run()` schedules it."""

    def __init__(
        self,
        settings: Settings,
        *,
        backend: SlurmBackend,
        files: JobFiles,
        prober: NodeProber | None = None,
        engine: Engine | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        run_command: CommandRunner = process.run,
    ) -> None:
        self.settings = settings
        self.run_command = run_command
        self.backend = backend
        self.files = files
        self.prober = prober
        self.engine = engine or make_engine(settings.store)
        self.sessions: sessionmaker[Session] = make_session_factory(self.engine)
        self.clock = clock
        self.leader = LeaderLock(self.engine, settings)
        self.stopping = threading.Event()
        self._cycle_lock = threading.Lock()
        self._wedge_seen: dict[int, datetime] = {}
        self._last_run: dict[str, float] = {}
        self._job_failures: dict[int, int] = {}
        self.heartbeat = time.monotonic()  # moved on by every step and every job handled
        self._started = False

    # -- start-up ---------------------------------------------------------------------------

    def start(self) -> None:
        """Refuse an old schema; reconcile relaunches a crash left between intent and answer."""
        check_schema_current(self.engine)
        self._started = True

    def reconcile(self, session: Session) -> list[tuple[int, int | None]]:
        """Close every pending intent: found in Slurm by its token, or (once older than the
        settle time) not submitted; its proposal stays `submitting` meanwhile, so nothing
        else acts on it."""
        closed: list[tuple[int, int | None]] = []
        settle = timedelta(seconds=self.settings.watcher.reconcile_settle_s)
        intents = repo.pending_intents(session)
        if not intents:
            return closed
        comments = CommentLookup(
            self.backend,
            since=min(intent.recorded_at for intent in intents) - TOKEN_LOOKBACK,
            until=self.clock(),
        )
        for intent in intents:
            owner = _relaunch_owner(session, intent.proposal_id)
            search = comments.search(intent.token, owner)
            _note_foreign(session, search, subject=("proposal", intent.proposal_id), owner=owner)
            found = search.found
            if found is None and self.clock() - intent.recorded_at < settle:
                continue  # too young to tell "never submitted" from "not in accounting yet"
            repo.reconcile_intent(session, intent=intent, found_job_id=found, actor=DAEMON)
            if found is not None:
                self._record_found_submission(session, intent, found)
            closed.append((intent.action_id, found))
            log.info(
                "reconciled intent",
                extra={"fields": {"action": intent.action_id, "job": found}},
            )
        return closed

    def _record_found_submission(self, session: Session, intent: Any, job_id: int) -> None:
        proposal = session.get(Proposal, intent.proposal_id)
        if proposal is None or proposal.lineage_id is None or proposal.revision_id is None:
            return
        lineage = session.get(Lineage, proposal.lineage_id)
        records.record_lineage_submission(
            session,
            slurm_job_id=job_id,
            lineage_id=proposal.lineage_id,
            attempt=(lineage.attempts + 1) if lineage is not None else 1,
            revision_id=proposal.revision_id,
            proposal_id=proposal.id,
            token=intent.token,
            actor=DAEMON,
        )
        session.commit()

    # -- the cycle --------------------------------------------------------------------------

    def cycle(self) -> CycleReport:
        """One pass; each step's failure is logged and the others still run."""
        report = CycleReport()
        with self._cycle_lock:
            if not self.leader.try_acquire():
                log.info("standby: another slurm-medic holds the leader lock")
                return report
            report.leader = True
            steps: list[tuple[str, Callable[[Session, CycleReport], None]]] = [
                ("reconcile", self._step_reconcile),
                ("poll", self._step_poll),
                ("wedged", self._step_wedged),
                ("act", self._step_act),
                ("verify", self._step_verify),
                ("expire", self._step_expire),
            ]
            intervals = {
                "wedged": self.settings.watcher.running_interval_s,
                "verify": self.settings.verify.interval_s,
            }
            for name, step in steps:
                self.heartbeat = time.monotonic()
                if self.stopping.is_set():
                    break
                if not self._due(name, intervals.get(name, 0.0)):
                    continue
                with self.sessions() as session:
                    try:
                        step(session, report)
                        session.commit()
                    except Exception as error:  # a cycle must survive any one step's failure
                        session.rollback()
                        report.errors.append(f"{name}: {error}")
                        log.exception("step %s failed", name)
        return report

    def _due(self, step: str, interval_s: float) -> bool:
        """Steps slower than the poll (wedge checks, verification) run at their own pace."""
        now = time.monotonic()
        last = self._last_run.get(step)
        if last is not None and now - last < interval_s:
            return False
        self._last_run[step] = now
        return True

    def _step_reconcile(self, session: Session, report: CycleReport) -> None:
        if repo.pending_intents(session):
            self.reconcile(session)
        self.reconcile_first_submissions(session)

    def reconcile_first_submissions(self, session: Session) -> list[tuple[int, int | None]]:
        """`slurm-medic submit` killed between its intent and recording the job: find the job
        by its token so the run is followed; declare it never submitted once settled."""
        closed: list[tuple[int, int | None]] = []
        settle = timedelta(seconds=self.settings.watcher.reconcile_settle_s)
        now = self.clock()
        settled = [
            intent
            for intent in records.open_lineage_intents(
                session, since=now - FIRST_SUBMISSION_HORIZON
            )
            # a younger one: the CLI may still be between sbatch and its own record
            if now - intent.at >= settle
        ]
        if not settled:
            return closed
        comments = CommentLookup(
            self.backend, since=min(intent.at for intent in settled) - TOKEN_LOOKBACK, until=now
        )
        for intent in settled:
            lineage = session.get(Lineage, intent.lineage_id)
            owner = lineage.owner if lineage is not None else None
            search = comments.search(intent.token, owner)
            _note_foreign(session, search, subject=("lineage", intent.lineage_id), owner=owner)
            found = search.found
            records.close_lineage_intent(session, intent=intent, found_job_id=found, actor=DAEMON)
            cursor = repo.get_cursor(session, name=CURSOR)
            if found is not None and cursor is not None and cursor > intent.at:
                # The job may have ended before it was known as the lineage's: poll it again.
                repo.set_cursor(session, name=CURSOR, polled_until=intent.at)
            session.commit()
            closed.append((intent.lineage_id, found))
        return closed

    def _step_poll(self, session: Session, report: CycleReport) -> None:
        watcher = self.settings.watcher
        now = self.clock()
        cursor = repo.get_cursor(session, name=CURSOR)
        session.commit()  # only read: sacct's seconds hold no lock on the record
        start = (
            cursor if cursor is not None else now - timedelta(seconds=watcher.initial_lookback_s)
        )
        since = start - timedelta(seconds=watcher.overlap_s)
        window = self.backend.finished_window(since, now, states=watcher.states)
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
        deps = PipelineDeps(self.settings, self.prober, self.files)
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
        new_cursor = now if hold_cursor is None else min(now, hold_cursor)
        if cursor is None or new_cursor > cursor:
            repo.set_cursor(session, name=CURSOR, polled_until=new_cursor)

    def _handle_one(
        self,
        session: Session,
        job: SlurmJob,
        complete: SlurmJob | None,
        *,
        deps: PipelineDeps,
        report: CycleReport,
        now: datetime,
        wait: timedelta,
    ) -> bool:
        """Handle one job (`complete`: its full record, None while accounting has only a
        placeholder) in its own transaction; False: try it again next cycle.

        A job whose handling keeps failing is recorded as such after MAX_JOB_FAILURES tries,
        so one bad record cannot hold every later job's cursor back forever.
        """
        self.heartbeat = time.monotonic()
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

    def _step_wedged(self, session: Session, report: CycleReport) -> None:
        """Cancel a run whose log shows a rank's root failure while the others hang; never
        while paused or dry-running, which promise no scancel."""
        wedge, policy = self.settings.wedge, self.settings.policy
        if not wedge.enabled or policy.dry_run or policy.paused or repo.is_paused(session):
            return
        lineage_jobs = records.lineage_job_ids(session)
        session.commit()  # only read: squeue and the log reads hold no lock on the record
        if not lineage_jobs:
            return
        now = self.clock()
        running = [job.job_id for job in self.backend.running_jobs() if job.job_id in lineage_jobs]
        if not running:
            return
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
            report.wedged_cancelled.append(job.job_id)

    def _step_act(self, session: Session, report: CycleReport) -> None:
        deps = ActDeps(
            self.settings,
            self.backend,
            files=self.files,
            clock=self.clock,
            paused=lambda: repo.is_paused(session),
        )
        report.acted = act_on_approved(session, deps)
        for result in report.acted:
            log.info("acted", extra={"fields": dict(vars(result))})

    def _step_verify(self, session: Session, report: CycleReport) -> None:
        deps = FollowDeps(self.settings, self.backend, self.files, self.clock)
        report.followed = follow_relaunches(session, deps)

    def _step_expire(self, session: Session, report: CycleReport) -> None:
        ttl = timedelta(seconds=self.settings.policy.proposal_ttl_s)
        for proposal in records.stale_proposals(session, older_than=ttl, now=self.clock()):
            repo.transition_proposal(
                session,
                proposal_id=proposal.id,
                to=ProposalState.EXPIRED,
                actor=DAEMON,
                reason=f"no decision within {ttl}",
            )
            report.expired += 1

    # -- running ----------------------------------------------------------------------------

    def run(self, *, once: bool = False) -> None:
        """Run cycles until SIGTERM/SIGINT; `once` runs a single cycle and returns."""
        self.start()
        if once:
            self.cycle()
            self.leader.release()
            return
        from apscheduler.schedulers.blocking import BlockingScheduler  # noqa: PLC0415

        scheduler = BlockingScheduler(timezone=UTC)
        interval = self.settings.watcher.poll_interval_s
        scheduler.add_job(
            self._scheduled_cycle,
            "interval",
            seconds=interval,
            id="cycle",
            max_instances=1,
            coalesce=True,
            next_run_time=datetime.now(UTC),
        )
        window_s = watchdog_window_s(os.environ)
        scheduler.add_job(
            self._watchdog, "interval", seconds=max(1.0, window_s / 3), args=(window_s,)
        )

        def stop(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %s: finishing the step in flight, then stopping", signum)
            self.stopping.set()
            scheduler.shutdown(wait=False)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        listener = self._hook_listener(scheduler)
        sd_notify("READY=1")
        try:
            scheduler.start()
        finally:
            if listener is not None:
                listener.stop()
            with self._cycle_lock:  # wait for the step in flight
                self.leader.release()
            sd_notify("STOPPING=1")

    def _hook_listener(self, scheduler: Any) -> HookListener | None:
        """The epilog hook wakes the cycle now; without the socket the poll still finds all."""
        path = self.settings.hook_socket
        if not path.parent.is_dir():
            log.warning("no hook socket: %s does not exist; polling only", path.parent)
            return None

        def wake(job_id: int) -> None:
            log.info("hook: job ended", extra={"fields": {"job": job_id}})
            scheduler.modify_job("cycle", next_run_time=datetime.now(UTC))

        allowed, group = self.hook_senders()
        listener = HookListener(
            path,
            on_job=wake,
            allowed_uids=allowed,
            group=group,
            min_wake_interval_s=HOOK_WAKE_INTERVAL_S,
        )
        try:
            listener.start()
        except HookError as error:
            log.warning("no hook socket: %s; polling only", error)
            return None
        return listener

    def hook_senders(self) -> tuple[frozenset[int], int | None]:
        """Who may send to the hook socket: root, this daemon's user, and the SlurmUser
        (slurmctld runs EpilogSlurmctld as it), as `scontrol show config` names it, else
        the `slurm` account; and the group the socket file is given so the SlurmUser can
        write to it (None: nobody but the owner needs to)."""
        slurm_user: tuple[str, int] | None = None
        try:
            result = self.run_command(
                list(SCONTROL_CONFIG_ARGV), timeout=min(self.settings.slurm_timeout_s, 10.0)
            )
        except process.CommandError as error:
            log.warning("scontrol show config failed: %s", error)
        else:
            slurm_user = parse_slurm_user(result.stdout) if result.ok else None
        entry = _passwd(slurm_user[1] if slurm_user else DEFAULT_SLURM_USER)
        if slurm_user is None and entry is not None:
            slurm_user = (entry.pw_name, entry.pw_uid)
        me = os.geteuid()
        allowed = {0, me}
        if slurm_user is None:
            log.warning("no SlurmUser known: the hook accepts datagrams from root only")
            return frozenset(allowed), None
        allowed.add(slurm_user[1])
        group = entry.pw_gid if entry is not None and slurm_user[1] not in (0, me) else None
        log.info(
            "hook senders",
            extra={"fields": {"slurm_user": slurm_user[0], "uids": sorted(allowed)}},
        )
        return frozenset(allowed), group

    def _watchdog(self, window_s: float) -> None:
        """Ping systemd only while cycles make progress: a hung daemon gets restarted."""
        age = time.monotonic() - self.heartbeat
        if age < window_s:
            sd_notify("WATCHDOG=1")
        else:
            log.warning("no progress for %.0f s: not pinging the watchdog", age)

    def _scheduled_cycle(self) -> None:
        started = time.monotonic()
        report = self.cycle()
        log.info(
            "cycle",
            extra={
                "fields": {
                    "leader": report.leader,
                    "polled": report.polled,
                    "handled": len(report.handled),
                    "acted": len(report.acted),
                    "errors": report.errors,
                    "seconds": round(time.monotonic() - started, 3),
                }
            },
        )


def root_failure_seen(findings: LogFindings) -> bool:
    """A rank's root failure in the log of a job still running: the others hang."""
    return findings.oom is not None or (
        findings.root_failure_line is not None and findings.traceback_seen
    )


def _relaunch_owner(session: Session, proposal_id: int) -> str | None:
    """Whose job a relaunch intent's token may be found on: its lineage's owner."""
    proposal = session.get(Proposal, proposal_id)
    if proposal is None or proposal.lineage_id is None:
        return None
    lineage = session.get(Lineage, proposal.lineage_id)
    return lineage.owner if lineage is not None else None


def _note_foreign(
    session: Session, search: TokenSearch, *, subject: tuple[str, int], owner: str | None
) -> None:
    """A job of someone else carrying a lineage's token: ignored, and on the record (once:
    reconciliation asks again every cycle until the intent settles)."""
    if not search.foreign:
        return
    noted = {
        event.details.get("job")
        for event in session.scalars(
            select(AuditEvent).where(
                AuditEvent.verb == VERB_FOREIGN_TOKEN,
                AuditEvent.subject_type == subject[0],
                AuditEvent.subject_id == str(subject[1]),
            )
        )
    }
    for job_id, user in search.foreign:
        if job_id in noted:
            continue
        log.warning(
            "a job of another user carries a lineage token; ignored",
            extra={"fields": {"job": job_id, "user": user, "owner": owner}},
        )
        repo.append_audit(
            session,
            actor=DAEMON,
            verb=VERB_FOREIGN_TOKEN,
            subject_type=subject[0],
            subject_id=subject[1],
            details={"job": job_id, "user": user, "owner": owner},
        )


def _passwd(user: str | int) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
    except KeyError:
        return None


@contextmanager
def daemon_from_settings(settings: Settings) -> Iterator[Daemon]:
    """The production wiring: Slurm's CLI, the SSH prober, the owner-rights reader."""
    from daemon.slurm.backend import SlurmCli  # noqa: PLC0415

    prober = NodeProber(settings.probe) if settings.probe is not None else None
    daemon = Daemon(
        settings,
        backend=SlurmCli(timeout_s=settings.slurm_timeout_s),
        files=OwnerJobFiles(step_pattern=settings.step_pattern),
        prober=prober,
    )
    try:
        yield daemon
    finally:
        daemon.leader.release()
        daemon.engine.dispose()
