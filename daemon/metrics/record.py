"""The record's numbers as Prometheus series, read at scrape time.

One short session per scrape runs a handful of GROUP BY counts over indexed columns (incident
kind, proposal state, action result and kind, node event, cursor) and one bounded read of
the last week's relaunches; it writes nothing and is rolled back. A record that cannot be
read gives `slurm_medic_record_up 0` and the build info, never an error out of the scrape.
Labels take their values from the record's enums (an unknown value is `other`) and never
name a job, a user, a node or free text; who decided is `policy` or `person`, never a name.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from daemon.diagnosis import FailureKind
from daemon.fleet.scheduled import AFTER_JOB_CURSOR
from daemon.store import control
from daemon.store import service_records as records
from daemon.store.models import (
    Action,
    ActionKind,
    ActionResult,
    AwaitedRecord,
    Cursor,
    Incident,
    Job,
    Lineage,
    LineageStatus,
    NodeEvent,
    NodeEventKind,
    Proposal,
)
from daemon.store.repository import Actor
from daemon.store.states import ProposalState
from daemon.watch import CURSOR as FINISHED_JOBS_CURSOR

log = logging.getLogger(__name__)

OTHER = "other"
DAEMON_NAME = Actor.daemon().name
# The watchers whose cursors move at each successful poll: the finished-job poll and the fleet
# sweep's read of the jobs that ended (its `fleet_sweep_started` is set once: no poll).
WATCHERS = (FINISHED_JOBS_CURSOR, AFTER_JOB_CURSOR)
# Time from a job's end to its relaunch's submission, over the relaunches of this window: a
# gauge histogram (it describes the window, so it may go down), read from at most
# RELAUNCH_ROWS rows.
RELAUNCH_WINDOW = timedelta(days=7)
RELAUNCH_ROWS = 10_000
# Seconds, as floats: their str() is the `le` label prometheus-client's histograms write. A
# relaunch by policy is one poll interval plus seconds; one that waits for a person is minutes
# to days.
RELAUNCH_BUCKETS = (5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0)

# A sessionmaker, or a command's `context.session(read_only=True)`.
OpenSession = Callable[[], AbstractContextManager[Session]]


@dataclass(frozen=True)
class DaemonLimits:
    """The daemon's own settings the alert rules compare the record against."""

    max_drains_per_hour: int
    poll_interval_s: float


def build_version() -> str:
    try:
        return version("slurm-medic")
    except PackageNotFoundError:
        return "unknown"


class RecordCollector(Collector):
    """Reads the record on each scrape (`open_session` gives a new session each call)."""

    def __init__(
        self,
        open_session: OpenSession,
        *,
        limits: DaemonLimits | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._open_session = open_session
        self._limits = limits
        self._clock = clock
        self._version = build_version()

    def collect(self) -> Iterator[Metric]:
        try:
            with self._open_session() as session:
                families = list(self._read(session, self._clock()))
                session.rollback()
            up = 1
        except Exception as error:  # a record that cannot be read is down, not the scrape
            # One line a scrape, no traceback: the cycle's own failure logs the details.
            said = str(error).splitlines() or [type(error).__name__]
            log.warning("metrics: the record could not be read: %s", said[0])
            families, up = [], 0
        yield from families
        yield _gauge("slurm_medic_record_up", "1 if the record could be read now, else 0.", up)
        info = GaugeMetricFamily(
            "slurm_medic_build_info", "The slurm-medic version serving.", labels=["version"]
        )
        info.add_metric([self._version], 1)
        yield info
        if self._limits is not None:
            yield _gauge(
                "slurm_medic_drain_limit_per_hour",
                "policy.max_drains_per_hour: the circuit breaker's limit on the daemon's drains.",
                self._limits.max_drains_per_hour,
            )
            yield _gauge(
                "slurm_medic_poll_interval_seconds",
                "watcher.poll_interval_s: seconds between cycles.",
                self._limits.poll_interval_s,
            )

    def _read(self, session: Session, now: datetime) -> Iterator[Metric]:
        yield from _incidents(session)
        yield from _proposals(session, now)
        yield from _relaunches(session, now)
        yield from _drains(session, now)
        yield from _lineages(session)
        yield from _polls(session)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _by_enum(rows: Iterable[tuple[str, int]], members: Iterable[StrEnum]) -> dict[str, int]:
    """Counts by an enum's values, each present (0 when none), a value not in it as `other`."""
    counts = {member.value: 0 for member in members}
    for value, count in rows:
        key = value if value in counts else OTHER
        counts[key] = counts.get(key, 0) + count
    return counts


def _incidents(session: Session) -> Iterator[Metric]:
    rows = session.execute(select(Incident.kind, func.count()).group_by(Incident.kind))
    counts = _by_enum(((kind, count) for kind, count in rows), FailureKind)
    family = CounterMetricFamily(
        "slurm_medic_incidents", "Failures diagnosed, by kind.", labels=["kind"]
    )
    for kind, count in counts.items():
        family.add_metric([kind], count)
    yield family


def _proposals(session: Session, now: datetime) -> Iterator[Metric]:
    # One pass over the proposals: a row per state and decider, as many as the people who
    # decide; the names are folded into `policy` and `person` here and go no further.
    rows = session.execute(
        select(Proposal.state, Proposal.decided_by, func.count()).group_by(
            Proposal.state, Proposal.decided_by
        )
    )
    decided: Counter[tuple[str, str]] = Counter()
    states: Counter[str] = Counter()
    for state, decided_by, count in rows:
        states[state] += count
        if decided_by is not None:
            decided[state, "policy" if decided_by == DAEMON_NAME else "person"] += count
    by_state = _by_enum(states.items(), ProposalState)
    family = GaugeMetricFamily(
        "slurm_medic_proposals", "Proposals by the state they are in now.", labels=["state"]
    )
    for state, count in by_state.items():
        family.add_metric([state], count)
    yield family
    yield _decisions(by_state, decided)
    pending, oldest = session.execute(
        select(func.count(), func.min(Proposal.created_at)).where(
            Proposal.state == ProposalState.PROPOSED.value
        )
    ).one()
    yield _gauge("slurm_medic_pending_approvals", "Proposals waiting for a decision.", int(pending))
    age = (now - _utc(oldest)).total_seconds() if oldest is not None else 0.0
    yield _gauge(
        "slurm_medic_pending_approval_oldest_age_seconds",
        "Seconds the oldest proposal waiting for a decision has waited (0 when none waits).",
        max(0.0, age),
    )


def _decisions(
    by_state: Mapping[str, int], decided: Mapping[tuple[str, str], int]
) -> CounterMetricFamily:
    """Every decision taken on a proposal, by outcome and decider. A proposal approved stays
    counted as approved whatever happens to its relaunch; an expiry is policy's (the TTL)."""
    counts: Counter[tuple[str, str]] = Counter()
    counts["expired", "policy"] = by_state[ProposalState.EXPIRED.value]
    for (state, decider), count in decided.items():
        outcome = "rejected" if state == ProposalState.REJECTED.value else "approved"
        counts[outcome, decider] += count
    family = CounterMetricFamily(
        "slurm_medic_decisions",
        "Decisions on proposals, by outcome (approved, rejected, expired) and decider"
        " (policy or person).",
        labels=["outcome", "decider"],
    )
    for outcome, decider in (
        ("approved", "policy"),
        ("approved", "person"),
        ("rejected", "policy"),
        ("rejected", "person"),
        ("expired", "policy"),
    ):
        family.add_metric([outcome, decider], counts[outcome, decider])
    return family


def _relaunches(session: Session, now: datetime) -> Iterator[Metric]:
    relaunch = (Action.kind == ActionKind.SBATCH.value, Action.proposal_id.is_not(None))
    rows = session.execute(
        select(Action.result, func.count()).where(*relaunch).group_by(Action.result)
    )
    counts = _by_enum(((result, count) for result, count in rows), ActionResult)
    family = CounterMetricFamily(
        "slurm_medic_relaunches",
        "Relaunches by result (pending: sbatch's answer not yet recorded; not_found: a"
        " crashed submission that never reached Slurm).",
        labels=["result"],
    )
    for result, count in counts.items():
        family.add_metric([result], count)
    yield family
    delays = session.execute(
        select(Action.finished_at, Job.end_time)
        .join(Proposal, Proposal.id == Action.proposal_id)
        .join(Incident, Incident.id == Proposal.incident_id)
        .join(Job, Job.id == Incident.job_id)
        .where(
            *relaunch,
            Action.result == ActionResult.SUCCEEDED.value,
            Action.finished_at >= now - RELAUNCH_WINDOW,
            Job.end_time.is_not(None),
        )
        .order_by(Action.id.desc())
        .limit(RELAUNCH_ROWS)
    )
    yield _delay_histogram(
        (_utc(submitted) - _utc(ended)).total_seconds() for submitted, ended in delays
    )


def _delay_histogram(delays: Iterable[float]) -> GaugeHistogramMetricFamily:
    seconds = sorted(max(0.0, delay) for delay in delays)
    buckets = [
        (str(bound), sum(1 for delay in seconds if delay <= bound)) for bound in RELAUNCH_BUCKETS
    ]
    return GaugeHistogramMetricFamily(
        "slurm_medic_relaunch_delay_seconds",
        "Seconds from a failed job's end to its relaunch's submission, over the relaunches"
        " submitted in the last 7 days.",
        buckets=[*buckets, ("+Inf", len(seconds))],
        gsum_value=sum(seconds),
    )


def _drains(session: Session, now: datetime) -> Iterator[Metric]:
    total = session.scalar(
        select(func.count())
        .select_from(NodeEvent)
        .where(NodeEvent.kind == NodeEventKind.DRAIN.value, NodeEvent.by_medic.is_(True))
    )
    yield CounterMetricFamily(
        "slurm_medic_drains",
        "Drains slurm-medic made (incidents, the sweep, and people's cordons through it).",
        value=int(total or 0),
    )
    yield _gauge(
        "slurm_medic_drains_last_hour",
        "The daemon's drains in the last hour, as the circuit breaker counts them (people's"
        " cordons excluded).",
        records.drains_since(session, since=now - timedelta(hours=1)),
    )
    yield _gauge(
        "slurm_medic_drained_nodes",
        "Nodes drained by slurm-medic and not resumed since.",
        len(control.drains_in_force(session)),
    )


def _lineages(session: Session) -> Iterator[Metric]:
    rows = session.execute(select(Lineage.status, func.count()).group_by(Lineage.status))
    counts = _by_enum(((status, count) for status, count in rows), LineageStatus)
    family = GaugeMetricFamily("slurm_medic_lineages", "Managed runs by status.", labels=["status"])
    for status, count in counts.items():
        family.add_metric([status], count)
    yield family
    yield _gauge(
        "slurm_medic_lineages_given_up",
        "Runs whose retry budget is spent or that wait for a person (status exhausted).",
        counts[LineageStatus.EXHAUSTED.value],
    )


def _polls(session: Session) -> Iterator[Metric]:
    rows = session.execute(select(Cursor.name, Cursor.updated_at).where(Cursor.name.in_(WATCHERS)))
    seen: Mapping[str, datetime] = {name: _utc(updated) for name, updated in rows}
    family = GaugeMetricFamily(
        "slurm_medic_last_poll_timestamp_seconds",
        "When each watcher last moved its cursor (a successful poll), Unix time.",
        labels=["watcher"],
    )
    for watcher in WATCHERS:
        if watcher in seen:
            family.add_metric([watcher], seen[watcher].timestamp())
    yield family
    held = session.execute(
        select(Cursor.name, Cursor.held_since).where(Cursor.held_since.is_not(None))
    )
    held_family = GaugeMetricFamily(
        "slurm_medic_cursor_held_since_timestamp_seconds",
        "Since when a watcher's cursor has been held at the start of an accounting gap"
        " (slurmdbd unreachable, or slurmctld still holding records for it), Unix time.",
        labels=["watcher"],
    )
    for name, since in held:
        held_family.add_metric([name], _utc(since).timestamp())
    yield held_family
    yield _gauge(
        "slurm_medic_records_awaited",
        "Managed jobs that have left slurmctld's queue with no final record in accounting yet.",
        session.scalar(select(func.count()).select_from(AwaitedRecord)) or 0,
    )


def _utc(moment: datetime) -> datetime:
    """The record's datetimes are aware UTC; a raw column read (min()) on SQLite is naive."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment
