"""The pipeline's writes: lineages, jobs, incidents, proposals and template revisions.

Keyword-only, typed, shared by the daemon, the CLI and the web UI; transactions belong to the
caller. The actor and audit event every write names live here too, as the one base of the
other store modules: `action_rows` (every side effect's action row, an sbatch's exactly-once),
`control` (cursors, the pause switch, drains in force) and `queries` (the CLI's read side).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.diagnosis import Diagnosis
from daemon.evidence.records import Evidence
from daemon.planner import AttemptRecord, Outcome, PlannedFix
from daemon.slurm.records import SlurmJob
from daemon.store.codec import CodecError, from_json, to_json
from daemon.store.models import (
    ActorKind,
    AuditEvent,
    Incident,
    Job,
    Lineage,
    LineageStatus,
    Proposal,
    TemplateRevision,
    utc_now,
)
from daemon.store.states import ProposalState, check_transition

RowT = TypeVar("RowT")

# The planned fix's fields kept as the proposal row's own columns, not in its `plan` JSON.
FIX_COLUMNS = ("remediator", "lever", "rung", "failing_step")


class NotFound(LookupError):
    """A row asked for by id that the record does not hold."""


@dataclass(frozen=True)
class Actor:
    """Who did something: the daemon itself, or a person with their uid."""

    kind: ActorKind
    name: str
    uid: int | None = None

    @classmethod
    def daemon(cls) -> Actor:
        return cls(kind=ActorKind.DAEMON, name="slurm-medic")

    @classmethod
    def user(cls, name: str, uid: int | None) -> Actor:
        return cls(kind=ActorKind.USER, name=name, uid=uid)


def get_row(session: Session, model: type[RowT], row_id: object) -> RowT:
    """A row by its id, or `NotFound`."""
    row = session.get(model, row_id)
    if row is None:
        raise NotFound(f"no {model.__name__} {row_id}")
    return row


def append_audit(
    session: Session,
    *,
    actor: Actor,
    verb: str,
    subject_type: str,
    subject_id: object,
    details: Mapping[str, Any] | None = None,
    at: datetime | None = None,
) -> AuditEvent:
    """Add one audit event; there is no function to change one, and the guards refuse it."""
    event = AuditEvent(
        at=at or utc_now(),
        actor_kind=actor.kind.value,
        actor_name=actor.name,
        actor_uid=actor.uid,
        verb=verb,
        subject_type=subject_type,
        subject_id=str(subject_id),
        details=to_json(dict(details or {})),
    )
    session.add(event)
    return event


def create_lineage(session: Session, *, name: str, owner: str, template: str) -> Lineage:
    lineage = Lineage(name=name, owner=owner, template=template, status=LineageStatus.ACTIVE.value)
    session.add(lineage)
    session.flush()
    return lineage


def set_lineage_status(
    session: Session, *, lineage_id: int, status: LineageStatus, actor: Actor, reason: str
) -> Lineage:
    lineage = get_row(session, Lineage, lineage_id)
    previous = lineage.status
    lineage.status = status.value
    append_audit(
        session,
        actor=actor,
        verb="lineage_status",
        subject_type="lineage",
        subject_id=lineage_id,
        details={"from": previous, "to": status.value, "reason": reason},
    )
    session.flush()
    return lineage


def record_job(
    session: Session, *, job: SlurmJob, lineage_id: int | None = None, attempt: int | None = None
) -> Job:
    """Insert or refresh a job by its Slurm id; a known job keeps its lineage unless given one."""
    row = session.scalars(select(Job).where(Job.slurm_job_id == job.job_id)).one_or_none()
    if row is None:
        row = Job(slurm_job_id=job.job_id)
        session.add(row)
    row.name = job.name
    row.user_name = job.user
    row.uid = job.uid
    row.account = job.account
    row.partition = job.partition
    row.state = job.state.value
    row.exit_code = job.exit_code
    row.nodes = list(job.nodes)
    row.submit_time = job.submit_time
    row.start_time = job.start_time
    row.end_time = job.end_time
    row.record = _as_object(to_json(job))
    if lineage_id is not None:
        row.lineage_id = lineage_id
        row.attempt = attempt
        if attempt is not None:
            lineage = get_row(session, Lineage, lineage_id)
            lineage.attempts = max(lineage.attempts, attempt)
    session.flush()
    return row


def job_record(job: Job) -> SlurmJob:
    """The typed record a job row was saved from."""
    return from_json(SlurmJob, job.record)


def record_incident(
    session: Session,
    *,
    slurm_job_id: int,
    evidence: Evidence,
    diagnosis: Diagnosis,
    occurred_at: datetime | None = None,
) -> Incident:
    """Store one analysed failure of a job already recorded with `record_job`."""
    job = session.scalars(select(Job).where(Job.slurm_job_id == slurm_job_id)).one_or_none()
    if job is None:
        raise NotFound(f"job {slurm_job_id} is not in the record; record_job first")
    when = occurred_at or job.end_time or utc_now()
    incident = Incident(
        job_id=job.id,
        lineage_id=job.lineage_id,
        slurm_job_id=slurm_job_id,
        user_name=job.user_name,
        kind=diagnosis.kind.value,
        confidence=diagnosis.confidence.value,
        onset=diagnosis.onset.value if diagnosis.onset else None,
        node=diagnosis.node,
        rank=diagnosis.rank,
        step=diagnosis.step,
        occurred_at=when,
        evidence=_as_object(to_json(evidence)),
        diagnosis=_as_object(to_json(diagnosis)),
    )
    session.add(incident)
    session.flush()
    return incident


def incident_records(incident: Incident) -> tuple[Evidence, Diagnosis]:
    """The typed evidence and diagnosis an incident row was saved from."""
    return from_json(Evidence, incident.evidence), from_json(Diagnosis, incident.diagnosis)


def propose(
    session: Session,
    *,
    incident_id: int,
    fix: PlannedFix,
    rationale: str,
    cost: float,
    changes_science: bool,
    actor: Actor,
) -> Proposal:
    """The one place a planned fix is written: its queried fields as columns, the rest as
    the codec's JSON (`attempt_record` reads it back)."""
    incident = get_row(session, Incident, incident_id)
    plan = _as_object(to_json(fix))
    proposal = Proposal(
        incident_id=incident_id,
        lineage_id=incident.lineage_id,
        remediator=fix.remediator,
        lever=fix.lever.value,
        rung=fix.rung,
        failing_step=fix.failing_step,
        plan={key: value for key, value in plan.items() if key not in FIX_COLUMNS},
        outcome=Outcome.PENDING.value,
        rationale=rationale,
        cost=cost,
        changes_science=changes_science,
        state=ProposalState.PROPOSED.value,
    )
    session.add(proposal)
    session.flush()
    append_audit(
        session,
        actor=actor,
        verb="propose",
        subject_type="proposal",
        subject_id=proposal.id,
        details={"remediator": fix.remediator, "incident": incident_id, "cost": cost},
    )
    session.flush()
    return proposal


def attempt_record(proposal: Proposal) -> AttemptRecord:
    """The one place a proposal's record is read: typed, every field required; a stored
    record that does not fit raises `CodecError`, never fills in a default."""
    stray = sorted(set(proposal.plan) & set(FIX_COLUMNS))
    if stray:
        raise CodecError(f"proposal {proposal.id}: plan repeats its columns {', '.join(stray)}")
    columns = {
        "remediator": proposal.remediator,
        "lever": proposal.lever,
        "rung": proposal.rung,
        "failing_step": proposal.failing_step,
    }
    return AttemptRecord(
        fix=from_json(PlannedFix, {**proposal.plan, **columns}),
        revision_id=proposal.revision_id,
        resumed_step=proposal.resumed_step,
        outcome=from_json(Outcome, proposal.outcome),
        step_reached=proposal.step_reached,
    )


def record_relaunch_revision(
    session: Session, *, proposal: Proposal, revision_id: int, resumed_step: int | None
) -> None:
    """The revision a proposal's relaunch runs, and the checkpoint step it resumes from."""
    proposal.revision_id = revision_id
    proposal.resumed_step = resumed_step
    session.flush()


def record_outcome(
    session: Session, *, proposal: Proposal, outcome: Outcome, step_reached: int | None
) -> None:
    """How a proposal's relaunch ended and the furthest step it logged."""
    proposal.outcome = outcome.value
    proposal.step_reached = step_reached
    session.flush()


def transition_proposal(
    session: Session,
    *,
    proposal_id: int,
    to: ProposalState,
    actor: Actor,
    reason: str = "",
) -> Proposal:
    """Move a proposal as `states.TRANSITIONS` allows (else `IllegalTransition`), on the record."""
    proposal = session.scalars(
        select(Proposal).where(Proposal.id == proposal_id).with_for_update()
    ).one_or_none()
    if proposal is None:
        raise NotFound(f"no Proposal {proposal_id}")
    current = ProposalState(proposal.state)
    check_transition(current, to)
    proposal.state = to.value
    proposal.updated_at = utc_now()
    if to in (ProposalState.APPROVED, ProposalState.REJECTED) and current is ProposalState.PROPOSED:
        proposal.decided_by = actor.name
    append_audit(
        session,
        actor=actor,
        verb=f"proposal_{to.value}",
        subject_type="proposal",
        subject_id=proposal_id,
        details={"from": current.value, "to": to.value, "reason": reason},
    )
    session.flush()
    return proposal


def record_template_revision(
    session: Session,
    *,
    lineage_id: int,
    knobs: Mapping[str, Any],
    rendered_script: str,
    parent_id: int | None = None,
    proposal_id: int | None = None,
) -> TemplateRevision:
    revision = TemplateRevision(
        lineage_id=lineage_id,
        parent_id=parent_id,
        proposal_id=proposal_id,
        knobs=_as_object(to_json(dict(knobs))),
        rendered_script=rendered_script,
        script_sha256=hashlib.sha256(rendered_script.encode("utf-8", "surrogatepass")).hexdigest(),
    )
    session.add(revision)
    session.flush()
    return revision


def _as_object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, found {type(value).__name__}")
    return value
