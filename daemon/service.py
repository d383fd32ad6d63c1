"""The daemon: scheduling and leading. One cycle runs the stages in order, each step in its own
transaction, one step's failure logged while the others still run:

reconcile (`submission`: intents a killed submitter left open) -> watch (`watch`: poll finished
jobs, handle each ended one through `pipeline`; cancel wedged runs) -> act (`actions`) ->
sweep (`fleet`: the nodes due, drained or resumed on policy) -> verify (`verify`) -> expire
stale proposals -> notify (`notify`: what people are told, into the record's outbox; a thread of
its own sends it, so a relay that hangs never holds the cycle).

Only the leader acts: a PostgreSQL advisory lock, or an flock on a file beside the SQLite
database. APScheduler runs the cycle every poll interval and at once when the epilog hook
says a job ended (at most one extra cycle a second). SIGTERM lets the step in flight finish,
then stops. systemd gets READY=1 and WATCHDOG=1 (only while cycles make progress) over
NOTIFY_SOCKET. The log is one JSON object a line (`logs`).

Near 500 lines because leading is two locks (PostgreSQL's advisory lock, checked every cycle
because a lost session loses it, and SQLite's flock) and waking is the hook's sender check;
every stage lives in its own module.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from daemon import process
from daemon.actions import ActDeps, act_on_approved
from daemon.config import Settings
from daemon.evidence.prober import NodeProber
from daemon.fleet.scheduled import run_scheduled_sweep
from daemon.fleet.sweep import SweepDeps
from daemon.gather import JobFiles, OwnerJobFiles
from daemon.hook import HookError, HookListener, parse_slurm_user
from daemon.logs import log_decisions
from daemon.metrics import series as metrics
from daemon.metrics.record import DaemonLimits
from daemon.metrics.serve import daemon_registry, serve_metrics
from daemon.notify.notifier import Notifier
from daemon.pipeline import DAEMON
from daemon.slurm.backend import CommandRunner, SlurmBackend
from daemon.store import control
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.engine import make_engine, make_session_factory
from daemon.store.schema import check_schema_current
from daemon.store.states import ProposalState
from daemon.submission import reconcile
from daemon.verify import FollowDeps, follow_relaunches
from daemon.watch import Watcher, poll_again_from

log = logging.getLogger("slurm_medic")

SCONTROL_CONFIG_ARGV = ("scontrol", "show", "config")
# The account slurmctld runs as in Debian's and SchedMD's packages: the hook's sender when
# `scontrol show config` cannot say.
DEFAULT_SLURM_USER = "slurm"
# However many datagrams the hook sends, at most one extra cycle a second.
HOOK_WAKE_INTERVAL_S = 1.0
ADVISORY_LOCK_KEY = 0x6D65646963  # "medic"


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
    swept: list[Any] = field(default_factory=list)
    expired: int = 0
    notified: int = 0  # notification rows added to the outbox
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
        log_decisions(self.sessions)  # each decision the cycle commits is one INFO line
        self._approvals_seen: set[int] = set()
        self.clock = clock
        self.notifier = (
            Notifier(settings.notify, self.sessions, clock) if settings.notify is not None else None
        )
        self.leader = LeaderLock(self.engine, settings)
        self.stopping = threading.Event()
        self._cycle_lock = threading.Lock()
        self._last_run: dict[str, float] = {}
        self.heartbeat = time.monotonic()  # moved on by every step and every job handled
        self.watch = Watcher(
            settings,
            backend=backend,
            files=files,
            prober=prober,
            clock=clock,
            stopping=self.stopping,
            beat=self._beat,
        )

    # -- start-up ---------------------------------------------------------------------------

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    def start(self) -> None:
        """Refuse a record whose schema is not this code's (reconciling what a crash left open
        is every cycle's first step)."""
        check_schema_current(self.engine)

    # -- the cycle --------------------------------------------------------------------------

    def cycle(self) -> CycleReport:
        """One pass; each step's failure is logged and the others still run."""
        report = CycleReport()
        started = time.monotonic()
        with self._cycle_lock:
            if not self.leader.try_acquire():
                log.info("standby: another slurm-medic holds the leader lock")
                metrics.cycle_ran(time.monotonic() - started, leader=False)
                return report
            report.leader = True
            steps: list[tuple[str, Callable[[Session, CycleReport], None]]] = [
                ("reconcile", self._step_reconcile),
                ("poll", self._step_poll),
                ("wedged", self._step_wedged),
                ("act", self._step_act),
                ("sweep", self._step_sweep),
                ("verify", self._step_verify),
                ("expire", self._step_expire),
                ("notify", self._step_notify),
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
                        metrics.step_failed(name)
        metrics.cycle_ran(time.monotonic() - started, leader=True)
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
        """Close the intents a killed submitter left open (`submission.reconcile`)."""
        settle = timedelta(seconds=self.settings.watcher.reconcile_settle_s)
        now = self.clock()
        for closed in reconcile(session, self.backend, now=now, settle=settle, actor=DAEMON):
            if closed.job_id is not None:
                # The job may have ended before it was known as the lineage's: poll it again.
                poll_again_from(session, closed.recorded_at)
                session.commit()

    def _step_poll(self, session: Session, report: CycleReport) -> None:
        polled = self.watch.poll(session)
        report.polled, report.rejected = polled.polled, polled.rejected
        report.handled = polled.handled
        report.errors.extend(polled.errors)

    def _step_wedged(self, session: Session, report: CycleReport) -> None:
        report.wedged_cancelled = self.watch.cancel_wedged(session)

    def _step_act(self, session: Session, report: CycleReport) -> None:
        self._log_approvals_seen(session)
        deps = ActDeps(
            self.settings,
            self.backend,
            files=self.files,
            clock=self.clock,
            paused=lambda: control.is_paused(session),
        )
        report.acted = act_on_approved(session, deps)
        for result in report.acted:
            log.info("acted", extra={"fields": dict(vars(result))})

    def _log_approvals_seen(self, session: Session) -> None:
        """A person's approval is made in another process (the CLI, the web page): the daemon
        says when it first sees one, once per proposal while it runs."""
        for proposal in records.proposals_in(session, states=[ProposalState.APPROVED.value]):
            if proposal.id in self._approvals_seen or proposal.decided_by in (None, DAEMON.name):
                continue
            self._approvals_seen.add(proposal.id)
            log.info(
                "approval seen: proposal %s (%s) approved by %s",
                proposal.id,
                proposal.remediator,
                proposal.decided_by,
                extra={
                    "fields": {
                        "event": "approval_seen",
                        "proposal": proposal.id,
                        "lever": proposal.remediator,
                        "by": proposal.decided_by,
                    }
                },
            )

    def _step_sweep(self, session: Session, report: CycleReport) -> None:
        """The fleet sweep (`daemon.fleet.scheduled`), when configured and nodes can be probed."""
        if not self.settings.sweep.enabled or self.prober is None:
            return
        deps = SweepDeps(self.settings, self.backend, self.prober, self.clock, DAEMON)
        report.swept = run_scheduled_sweep(session, deps)

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

    def _step_notify(self, session: Session, report: CycleReport) -> None:
        """Into the outbox only; the sender thread is woken once the rows are committed."""
        if self.notifier is None:
            return
        report.notified = self.notifier.enqueue(session).added
        session.commit()
        if report.notified:
            self.notifier.thread.wake()

    # -- running ----------------------------------------------------------------------------

    def run(self, *, once: bool = False) -> None:
        """Run cycles until SIGTERM/SIGINT; `once` runs a single cycle and returns."""
        self.start()
        if once:
            self.cycle()
            self.leader.release()
            if self.notifier is not None:
                self.notifier.send_due()
            return
        from apscheduler.schedulers.blocking import BlockingScheduler  # noqa: PLC0415

        served = self._serve_metrics()  # before READY: an address in use stops the start
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
        if self.notifier is not None:
            self.notifier.thread.start()
        sd_notify("READY=1")
        try:
            scheduler.start()
        finally:
            if listener is not None:
                listener.stop()
            if self.notifier is not None:
                self.notifier.thread.stop()
            with self._cycle_lock:  # wait for the step in flight
                self.leader.release()
            served.close()
            sd_notify("STOPPING=1")

    def _serve_metrics(self) -> ExitStack:
        """The daemon's /metrics from a thread of its own while `run` runs, if `[metrics]
        listen` is set; each scrape reads the record in a read-only session."""
        served = ExitStack()
        listen = self.settings.metrics.listen
        if listen is None:
            return served
        limits = DaemonLimits(
            max_drains_per_hour=self.settings.policy.max_drains_per_hour,
            poll_interval_s=self.settings.watcher.poll_interval_s,
        )
        readers = make_session_factory(self.engine, read_only=True)
        host, port = served.enter_context(serve_metrics(listen, daemon_registry(readers, limits)))
        log.info("metrics", extra={"fields": {"listen": f"{host}:{port}"}})
        return served

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
                    "swept": len(report.swept),
                    "errors": report.errors,
                    "seconds": round(time.monotonic() - started, 3),
                }
            },
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
        backend=SlurmCli(runner=metrics.SlurmErrorCounter(), timeout_s=settings.slurm_timeout_s),
        files=OwnerJobFiles(step_pattern=settings.step_pattern),
        prober=prober,
    )
    try:
        yield daemon
    finally:
        daemon.leader.release()
        daemon.engine.dispose()
