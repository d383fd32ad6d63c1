"""The record's tables as SQLAlchemy 2.0 typed models; the migrations create exactly these."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    event,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, ORMExecuteState, Session, mapped_column

from daemon.evidence.records import ProbeVerdict
from daemon.planner import Outcome
from daemon.store.states import ProposalState
from remediators.base import Lever

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utc_now() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in and out on both databases (SQLite would hand back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()} refused: the record keeps UTC")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


NUL_STAND_IN = "\u2400"


class NulSafeText(TypeDecorator[str]):
    """Text from outside (job output, scripts, names): PostgreSQL text cannot hold NUL.

    A NUL is stored as U+2400 (the visible "symbol for null") so the rest is kept and the row
    still saves; every other character, odd Unicode included, is stored as it came.
    """

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else value.replace("\x00", NUL_STAND_IN)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 (SQLAlchemy reads this class attribute)
        datetime: UtcDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


class LineageStatus(StrEnum):
    ACTIVE = "active"
    VERIFIED = "verified"
    EXHAUSTED = "exhausted"
    ABANDONED = "abandoned"


class ActionKind(StrEnum):
    SBATCH = "sbatch"
    SCANCEL = "scancel"
    DRAIN = "drain"
    RESUME = "resume"


class ActionResult(StrEnum):
    """`pending` is an intent not yet closed; `not_found` is one reconciliation closed empty."""

    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NOT_FOUND = "not_found"


class NodeEventKind(StrEnum):
    DRAIN = "drain"
    RESUME = "resume"


class CheckTrigger(StrEnum):
    """Why a node was probed for the fleet."""

    SCHEDULE = "schedule"  # its turn in the daemon's sweep
    AFTER_JOB = "after_job"  # a job on it just ended
    COMMAND = "command"  # `slurm-medic sweep`
    CORDON = "cordon"  # a person's `nodes drain` / `nodes resume`


class NotificationEvent(StrEnum):
    """What a person is told about (mail and webhook)."""

    APPROVAL_WAITING = "approval_waiting"  # a proposal waits for a person
    RUN_GIVEN_UP = "run_given_up"  # a lineage exhausted or abandoned
    RUN_ESCALATED = "run_escalated"  # a relaunch did not pass the failing step
    NODE_DRAINED = "node_drained"


class NotificationChannel(StrEnum):
    MAIL = "mail"
    WEBHOOK = "webhook"


class NotificationState(StrEnum):
    """`pending` until sent; `given_up` after the retries; `suppressed` by the rate limit."""

    PENDING = "pending"
    SENT = "sent"
    GIVEN_UP = "given_up"
    SUPPRESSED = "suppressed"


class ActorKind(StrEnum):
    DAEMON = "daemon"
    USER = "user"


def _values_check(name: str, column: str, values: type[StrEnum]) -> CheckConstraint:
    allowed = ", ".join(f"'{member.value}'" for member in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=name)


class Lineage(Base):
    """One training run across its relaunches."""

    __tablename__ = "lineage"
    __table_args__ = (
        _values_check("status", "status", LineageStatus),
        Index("ix_lineage_owner_created", "owner", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(NulSafeText)
    owner: Mapped[str] = mapped_column(String(64))
    template: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), default=LineageStatus.ACTIVE.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utc_now)
    updated_at: Mapped[datetime] = mapped_column(default=utc_now, onupdate=utc_now)


class Job(Base):
    """A Slurm job slurm-medic saw: the scalar fields it is searched by, and the whole record."""

    __tablename__ = "job"
    __table_args__ = (
        Index("ix_job_user_end", "user_name", "end_time"),
        Index("ix_job_lineage_attempt", "lineage_id", "attempt"),
        Index("ix_job_end_time", "end_time"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    slurm_job_id: Mapped[int] = mapped_column(BigInteger, unique=True)
    lineage_id: Mapped[int | None] = mapped_column(ForeignKey("lineage.id"))
    attempt: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(NulSafeText)
    user_name: Mapped[str] = mapped_column(String(64))
    uid: Mapped[int | None] = mapped_column(Integer)
    account: Mapped[str | None] = mapped_column(String(64))
    partition: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    nodes: Mapped[list[Any]] = mapped_column()
    submit_time: Mapped[datetime | None] = mapped_column()
    start_time: Mapped[datetime | None] = mapped_column()
    end_time: Mapped[datetime | None] = mapped_column()
    record: Mapped[dict[str, Any]] = mapped_column(deferred=True)
    seen_at: Mapped[datetime] = mapped_column(default=utc_now)


class Incident(Base):
    """One failure analysed: evidence and diagnosis whole, plus the columns people filter on."""

    __tablename__ = "incident"
    __table_args__ = (
        Index("ix_incident_kind_occurred", "kind", "occurred_at"),
        Index("ix_incident_node_occurred", "node", "occurred_at"),
        Index("ix_incident_user_occurred", "user_name", "occurred_at"),
        Index("ix_incident_occurred_at", "occurred_at"),
        Index("ix_incident_slurm_job_id", "slurm_job_id"),
        Index("ix_incident_lineage_id", "lineage_id"),
        Index("ix_incident_job_id", "job_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("job.id"))
    lineage_id: Mapped[int | None] = mapped_column(ForeignKey("lineage.id"))
    slurm_job_id: Mapped[int] = mapped_column(BigInteger)
    user_name: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(32))
    confidence: Mapped[str] = mapped_column(String(16))
    onset: Mapped[str | None] = mapped_column(String(16))
    node: Mapped[str | None] = mapped_column(String(255))
    rank: Mapped[int | None] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(BigInteger)
    occurred_at: Mapped[datetime] = mapped_column()
    recorded_at: Mapped[datetime] = mapped_column(default=utc_now)
    evidence: Mapped[dict[str, Any]] = mapped_column(deferred=True)
    diagnosis: Mapped[dict[str, Any]] = mapped_column(deferred=True)


class Proposal(Base):
    """A remediation proposed for an incident; its state moves only through `states.TRANSITIONS`.

    What the planner remembers of it (`planner.AttemptRecord`) is written and read only
    through the repository: the rung, lever, steps, revision and outcome as columns people
    can query, the rest of the planned fix as the codec's JSON in `plan`.
    """

    __tablename__ = "proposal"
    __table_args__ = (
        _values_check("state", "state", ProposalState),
        _values_check("lever", "lever", Lever),
        _values_check("outcome", "outcome", Outcome),
        Index("ix_proposal_state_created", "state", "created_at"),
        Index("ix_proposal_lineage_id", "lineage_id"),
        Index("ix_proposal_incident_id", "incident_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    incident_id: Mapped[int] = mapped_column(ForeignKey("incident.id"))
    lineage_id: Mapped[int | None] = mapped_column(ForeignKey("lineage.id"))
    remediator: Mapped[str] = mapped_column(String(64))
    lever: Mapped[str] = mapped_column(String(16))
    rung: Mapped[int] = mapped_column(Integer)
    failing_step: Mapped[int | None] = mapped_column(BigInteger)
    plan: Mapped[dict[str, Any]] = mapped_column()
    # template_revision also points here (the proposal a revision was made for): the cycle
    # is added after both tables exist.
    revision_id: Mapped[int | None] = mapped_column(
        ForeignKey("template_revision.id", use_alter=True)
    )
    resumed_step: Mapped[int | None] = mapped_column(BigInteger)
    outcome: Mapped[str] = mapped_column(String(24), default=Outcome.PENDING.value)
    step_reached: Mapped[int | None] = mapped_column(BigInteger)
    rationale: Mapped[str] = mapped_column(NulSafeText)
    cost: Mapped[float] = mapped_column(Float)
    changes_science: Mapped[bool] = mapped_column(Boolean)
    state: Mapped[str] = mapped_column(String(16), default=ProposalState.PROPOSED.value)
    created_at: Mapped[datetime] = mapped_column(default=utc_now)
    updated_at: Mapped[datetime] = mapped_column(default=utc_now)
    decided_by: Mapped[str | None] = mapped_column(String(64))
    relaunch_job_id: Mapped[int | None] = mapped_column(BigInteger)


class TemplateRevision(Base):
    """One rendered revision of a lineage's launch template, with where it came from."""

    __tablename__ = "template_revision"
    __table_args__ = (Index("ix_template_revision_lineage_id", "lineage_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    lineage_id: Mapped[int] = mapped_column(ForeignKey("lineage.id"))
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("template_revision.id"))
    proposal_id: Mapped[int | None] = mapped_column(ForeignKey("proposal.id"))
    knobs: Mapped[dict[str, Any]] = mapped_column()
    rendered_script: Mapped[str] = mapped_column(NulSafeText, deferred=True)
    script_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utc_now)


class Action(Base):
    """One side effect on the cluster; `token` makes a submission findable after a crash.

    An sbatch action is a submission of a lineage's revision: a relaunch carries its proposal,
    a first submission (`slurm-medic submit`) none. Its lineage, revision and attempt are the
    record of which run a Slurm job id is (`service_records.lineage_submission`).
    """

    __tablename__ = "action"
    __table_args__ = (
        _values_check("kind", "kind", ActionKind),
        _values_check("result", "result", ActionResult),
        Index("ix_action_proposal_id", "proposal_id"),
        Index("ix_action_result_kind", "result", "kind"),
        Index("ix_action_slurm_job_id", "slurm_job_id"),
        Index("ix_action_lineage_id", "lineage_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    proposal_id: Mapped[int | None] = mapped_column(ForeignKey("proposal.id"))
    lineage_id: Mapped[int | None] = mapped_column(ForeignKey("lineage.id"))
    revision_id: Mapped[int | None] = mapped_column(ForeignKey("template_revision.id"))
    attempt: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    argv: Mapped[list[Any]] = mapped_column()
    token: Mapped[str] = mapped_column(String(64), unique=True)
    node: Mapped[str | None] = mapped_column(String(255))
    slurm_job_id: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(default=utc_now)
    finished_at: Mapped[datetime | None] = mapped_column()
    exit_code: Mapped[int | None] = mapped_column(Integer)
    stdout: Mapped[str | None] = mapped_column(NulSafeText, deferred=True)
    stderr: Mapped[str | None] = mapped_column(NulSafeText, deferred=True)
    result: Mapped[str] = mapped_column(String(16), default=ActionResult.PENDING.value)


class NodeEvent(Base):
    """A drain or resume slurm-medic did, or saw someone else do, and why."""

    __tablename__ = "node_event"
    __table_args__ = (
        _values_check("kind", "kind", NodeEventKind),
        Index("ix_node_event_node_id", "node", "id"),
        Index("ix_node_event_occurred_at", "occurred_at"),
        Index("ix_node_event_incident_id", "incident_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(16))
    by_medic: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str] = mapped_column(NulSafeText)
    occurred_at: Mapped[datetime] = mapped_column(default=utc_now)
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incident.id"))
    action_id: Mapped[int | None] = mapped_column(ForeignKey("action.id"))
    # Who: the daemon's name, or the person behind `nodes drain` / `nodes resume`.
    actor_name: Mapped[str | None] = mapped_column(String(64))
    # What decided a sweep's drain (a `FindingKind`), `cordon` for a person's; None for an
    # incident's drain. Only a sweep's `remap_pending` drain may return to service by itself.
    finding: Mapped[str | None] = mapped_column(String(32))
    # The probe at that moment.
    check_id: Mapped[int | None] = mapped_column(ForeignKey("node_check.id"))


class NodeCheck(Base):
    """One node probed and judged for the fleet (a sweep, the end of a job, a person's cordon),
    with the policy's decision: the history an admin asks "which nodes had pending remaps"."""

    __tablename__ = "node_check"
    __table_args__ = (
        _values_check("trigger", "trigger", CheckTrigger),
        _values_check("health", "health", ProbeVerdict),
        Index("ix_node_check_node_id", "node", "id"),
        Index("ix_node_check_checked_at", "checked_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(255))
    checked_at: Mapped[datetime] = mapped_column()
    trigger: Mapped[str] = mapped_column(String(16))
    health: Mapped[str] = mapped_column(String(16))
    deciding: Mapped[str] = mapped_column(NulSafeText)
    # The finding kinds as `,a,b,`: searchable with LIKE on SQLite and PostgreSQL alike.
    kinds: Mapped[str] = mapped_column(String(512))
    findings: Mapped[list[Any]] = mapped_column()
    notes: Mapped[list[Any]] = mapped_column()
    gpus_seen: Mapped[int] = mapped_column(Integer)
    gpus_expected: Mapped[int | None] = mapped_column(Integer)
    running_jobs: Mapped[list[Any]] = mapped_column()
    after_job_id: Mapped[int | None] = mapped_column(BigInteger)
    decision: Mapped[str] = mapped_column(String(24))
    decision_reason: Mapped[str] = mapped_column(NulSafeText)
    actor_name: Mapped[str] = mapped_column(String(64))


class AuditEvent(Base):
    """Append-only: guarded in the ORM (see repository) and by triggers in the database."""

    __tablename__ = "audit_event"
    __table_args__ = (
        _values_check("actor_kind", "actor_kind", ActorKind),
        Index("ix_audit_event_subject", "subject_type", "subject_id", "id"),
        Index("ix_audit_event_at", "at"),
        Index("ix_audit_event_actor_name", "actor_name", "at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utc_now)
    actor_kind: Mapped[str] = mapped_column(String(16))
    actor_name: Mapped[str] = mapped_column(String(64))
    actor_uid: Mapped[int | None] = mapped_column(Integer)
    verb: Mapped[str] = mapped_column(String(64))
    subject_type: Mapped[str] = mapped_column(String(32))
    subject_id: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column()


class Cursor(Base):
    """Where a watcher's last poll ended, by watcher name."""

    __tablename__ = "cursor"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    polled_until: Mapped[datetime] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column(default=utc_now, onupdate=utc_now)
    # Set while the cursor is held at the start of an accounting gap (slurmdbd unreachable,
    # records still queued in slurmctld): since when, and the latest reason.
    held_since: Mapped[datetime | None] = mapped_column()
    held_reason: Mapped[str | None] = mapped_column(NulSafeText)


class AwaitedRecord(Base):
    """A lineage job that has left slurmctld's queue while accounting has no final record of
    it: looked up by its id each poll until accounting says how it ended, so no managed
    failure falls between two windows however long an outage lasts."""

    __tablename__ = "awaited_record"

    slurm_job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    lineage_id: Mapped[int] = mapped_column(ForeignKey("lineage.id"))
    left_queue_at: Mapped[datetime] = mapped_column()
    looked_at: Mapped[datetime] = mapped_column()
    looks: Mapped[int] = mapped_column(Integer)
    # What accounting showed at the last look: unreachable, no record, still running...
    accounting: Mapped[str] = mapped_column(NulSafeText)


class ControlFlag(Base):
    """A named switch people flip (the global pause); in the record so every daemon sees it."""

    __tablename__ = "control_flag"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str] = mapped_column(NulSafeText)
    set_by: Mapped[str] = mapped_column(String(64))
    set_at: Mapped[datetime] = mapped_column(default=utc_now)


class Notification(Base):
    """One message to one recipient on one channel: recorded before it is sent, so it is sent
    once (`dedupe` is unique) and retried from the record after a failure or a restart."""

    __tablename__ = "notification"
    __table_args__ = (
        _values_check("event", "event", NotificationEvent),
        _values_check("channel", "channel", NotificationChannel),
        _values_check("state", "state", NotificationState),
        Index("ix_notification_state_next", "state", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utc_now)
    event: Mapped[str] = mapped_column(String(24))
    # What it is about, as `proposal:12`, `lineage:3`, `node_event:9`.
    subject: Mapped[str] = mapped_column(String(64))
    channel: Mapped[str] = mapped_column(String(8))
    recipient: Mapped[str] = mapped_column(String(320))
    # event, subject, channel and recipient in one string: the same message is never made twice.
    dedupe: Mapped[str] = mapped_column(String(512), unique=True)
    title: Mapped[str] = mapped_column(NulSafeText)
    body: Mapped[str] = mapped_column(NulSafeText)
    state: Mapped[str] = mapped_column(String(16), default=NotificationState.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column()
    last_error: Mapped[str | None] = mapped_column(NulSafeText)
    sent_at: Mapped[datetime | None] = mapped_column()


class WebRequest(Base):
    """A state change asked for on the web page, by its idempotency key: a form sent twice (a
    double click, a retried POST) is answered from here instead of acting twice."""

    __tablename__ = "web_request"

    idempotency_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    actor_name: Mapped[str] = mapped_column(String(64))
    # The method and path it was made for: the same key on another request is refused.
    target: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utc_now)
    status: Mapped[int] = mapped_column(Integer)
    response: Mapped[dict[str, Any]] = mapped_column()


class AuditImmutable(Exception):
    """Something tried to change or delete an audit event."""


@event.listens_for(Session, "before_flush")
def _refuse_audit_changes(session: Session, _context: object, _instances: object) -> None:
    """Every Session, whoever made it: an audit event may be added, never changed or deleted."""
    for instance in session.deleted:
        if isinstance(instance, AuditEvent):
            raise AuditImmutable(f"audit event {instance.id} cannot be deleted")
    for instance in session.dirty:
        if isinstance(instance, AuditEvent) and session.is_modified(instance):
            raise AuditImmutable(f"audit event {instance.id} cannot be changed")


@event.listens_for(Session, "do_orm_execute")
def _refuse_bulk_audit_changes(state: ORMExecuteState) -> None:
    """`session.execute(update(AuditEvent))` skips the flush; stop it here."""
    if not (state.is_update or state.is_delete):
        return
    if any(mapper.class_ is AuditEvent for mapper in state.all_mappers):
        raise AuditImmutable("audit events cannot be updated or deleted")
