"""The record's read side, for the CLI and the web UI: active lineages, pending approvals,
incidents by kind, user and node, audit trails, and the stories of a lineage and of a job."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from daemon.diagnosis import FailureKind
from daemon.store.models import (
    Action,
    AuditEvent,
    Incident,
    Job,
    Lineage,
    LineageStatus,
    NodeEvent,
    Proposal,
    TemplateRevision,
)
from daemon.store.repository import get_row
from daemon.store.states import ProposalState


@dataclass(frozen=True)
class LineageJob:
    """One job of a lineage with what was concluded and proposed about it."""

    job: Job
    incidents: tuple[Incident, ...]
    proposals: tuple[Proposal, ...]


@dataclass(frozen=True)
class LineageStory:
    """A lineage's rows for people to read (the planner's view is `planner.LineageHistory`)."""

    lineage: Lineage
    attempts: tuple[LineageJob, ...]
    revisions: tuple[TemplateRevision, ...]


@dataclass(frozen=True)
class JobStory:
    """Everything the record holds about one Slurm job id."""

    job: Job
    incidents: tuple[Incident, ...]
    proposals: tuple[Proposal, ...]
    actions: tuple[Action, ...]
    node_events: tuple[NodeEvent, ...]
    audit: tuple[AuditEvent, ...]


def active_lineages(session: Session, *, limit: int = 500) -> list[Lineage]:
    """Runs still being followed (not verified, exhausted or abandoned), newest change first."""
    query = (
        select(Lineage)
        .where(Lineage.status == LineageStatus.ACTIVE.value)
        .order_by(Lineage.updated_at.desc(), Lineage.id.desc())
        .limit(limit)
    )
    return list(session.scalars(query))


def proposals_for_incidents(session: Session, *, incident_ids: Sequence[int]) -> list[Proposal]:
    """The proposals made for these incidents, in the order they were made."""
    if not incident_ids:
        return []
    query = select(Proposal).where(Proposal.incident_id.in_(list(incident_ids)))
    return list(session.scalars(query.order_by(Proposal.id)))


def pending_approvals(session: Session, *, limit: int = 500) -> list[Proposal]:
    """Proposals waiting for a decision, oldest first."""
    query = (
        select(Proposal)
        .where(Proposal.state == ProposalState.PROPOSED.value)
        .order_by(Proposal.created_at, Proposal.id)
        .limit(limit)
    )
    return list(session.scalars(query))


def incidents_by_kind(
    session: Session,
    *,
    kind: FailureKind,
    since: datetime,
    until: datetime,
    limit: int = 1000,
) -> list[Incident]:
    """Incidents of one kind in [since, until), newest first."""
    return find_incidents(session, kind=kind, since=since, until=until, limit=limit)


def find_incidents(
    session: Session,
    *,
    since: datetime,
    until: datetime,
    kind: FailureKind | None = None,
    user: str | None = None,
    node: str | None = None,
    limit: int = 1000,
) -> list[Incident]:
    """Incidents in [since, until), newest first, narrowed by kind, user and node when given.

    Each filter has an index led by its column and followed by the time, so any one of them
    keeps the query to the rows asked for.
    """
    query = select(Incident).where(Incident.occurred_at >= since, Incident.occurred_at < until)
    if kind is not None:
        query = query.where(Incident.kind == kind.value)
    if user is not None:
        query = query.where(Incident.user_name == user)
    if node is not None:
        query = query.where(Incident.node == node)
    query = query.order_by(Incident.occurred_at.desc(), Incident.id.desc()).limit(limit)
    return list(session.scalars(query))


def count_incidents_by_kind(
    session: Session, *, since: datetime, until: datetime
) -> dict[FailureKind, int]:
    """How many incidents of each kind in [since, until)."""
    query = (
        select(Incident.kind, func.count())
        .where(Incident.occurred_at >= since, Incident.occurred_at < until)
        .group_by(Incident.kind)
    )
    return {FailureKind(kind): count for kind, count in session.execute(query).tuples()}


def proposal_audit_trail(session: Session, *, proposal_id: int) -> list[AuditEvent]:
    """Every audit event about a proposal and the actions taken for it, in order."""
    action_ids = [
        str(action_id)
        for action_id in session.scalars(select(Action.id).where(Action.proposal_id == proposal_id))
    ]
    return _audit_for(session, {"proposal": [str(proposal_id)], "action": action_ids})


def _audit_for(session: Session, subjects: Mapping[str, Sequence[str]]) -> list[AuditEvent]:
    conditions = [
        and_(AuditEvent.subject_type == subject_type, AuditEvent.subject_id.in_(ids))
        for subject_type, ids in subjects.items()
        if ids
    ]
    if not conditions:
        return []
    return list(session.scalars(select(AuditEvent).where(or_(*conditions)).order_by(AuditEvent.id)))


def lineage_story(session: Session, *, lineage_id: int) -> LineageStory:
    """A run across its relaunches: each attempt with its incidents, proposals and outcomes."""
    lineage = get_row(session, Lineage, lineage_id)
    jobs = session.scalars(
        select(Job).where(Job.lineage_id == lineage_id).order_by(Job.attempt, Job.id)
    ).all()
    incidents = session.scalars(
        select(Incident).where(Incident.lineage_id == lineage_id).order_by(Incident.id)
    ).all()
    proposals = session.scalars(
        select(Proposal).where(Proposal.lineage_id == lineage_id).order_by(Proposal.id)
    ).all()
    revisions = session.scalars(
        select(TemplateRevision)
        .where(TemplateRevision.lineage_id == lineage_id)
        .order_by(TemplateRevision.id)
    ).all()
    job_of_incident = {incident.id: incident.job_id for incident in incidents}
    attempts = tuple(
        LineageJob(
            job=job,
            incidents=tuple(i for i in incidents if i.job_id == job.id),
            proposals=tuple(p for p in proposals if job_of_incident.get(p.incident_id) == job.id),
        )
        for job in jobs
    )
    return LineageStory(lineage=lineage, attempts=attempts, revisions=tuple(revisions))


def job_story(session: Session, *, slurm_job_id: int) -> JobStory | None:
    """Everything that happened to one job id, or None if the record never saw it."""
    job = session.scalars(select(Job).where(Job.slurm_job_id == slurm_job_id)).one_or_none()
    if job is None:
        return None
    incidents = session.scalars(
        select(Incident).where(Incident.job_id == job.id).order_by(Incident.id)
    ).all()
    incident_ids = [incident.id for incident in incidents]
    proposals = (
        session.scalars(
            select(Proposal).where(Proposal.incident_id.in_(incident_ids)).order_by(Proposal.id)
        ).all()
        if incident_ids
        else []
    )
    proposal_ids = [proposal.id for proposal in proposals]
    action_filter = Action.slurm_job_id == slurm_job_id
    if proposal_ids:
        action_filter = or_(action_filter, Action.proposal_id.in_(proposal_ids))
    actions = session.scalars(select(Action).where(action_filter).order_by(Action.id)).all()
    node_events = (
        session.scalars(
            select(NodeEvent).where(NodeEvent.incident_id.in_(incident_ids)).order_by(NodeEvent.id)
        ).all()
        if incident_ids
        else []
    )
    audit = _audit_for(
        session,
        {
            "job": [str(slurm_job_id)],
            "incident": [str(i) for i in incident_ids],
            "proposal": [str(p) for p in proposal_ids],
            "action": [str(action.id) for action in actions],
        },
    )
    return JobStory(
        job=job,
        incidents=tuple(incidents),
        proposals=tuple(proposals),
        actions=tuple(actions),
        node_events=tuple(node_events),
        audit=tuple(audit),
    )
