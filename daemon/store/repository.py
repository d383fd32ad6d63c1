"""Repository functions shared by the daemon, the CLI and the web UI: keyword-only, typed.

Transactions belong to the caller, except for the exactly-once functions (`record_submit_intent`
and the three that close an intent): their commit is the point, so they make it themselves.
`daemon.submission` is the protocol that uses them, for first submissions and relaunches alike.

Some 1,000 lines for now, not for want of seams: the exactly-once intents, the writes of the
pipeline, and the read side of the CLI (`active_lineages` to `job_story`) would each stand
alone; they are kept together until the web pages settle what the read side needs.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from daemon.diagnosis import Diagnosis, FailureKind
from daemon.evidence.records import Evidence
from daemon.planner import AttemptRecord, Outcome, PlannedFix
from daemon.slurm.records import SlurmJob
from daemon.store.codec import CodecError, from_json, to_json
from daemon.store.models import (
    Action,
    ActionKind,
    ActionResult,
    ActorKind,
    AuditEvent,
    ControlFlag,
    Cursor,
    Incident,
    Job,
    Lineage,
    LineageStatus,
    NodeEvent,
    NodeEventKind,
    Proposal,
    TemplateRevision,
    utc_now,
)
from daemon.store.states import ProposalState, check_transition

RowT = TypeVar("RowT")

TOKEN_PREFIX = "medic-"  # noqa: S105 (a label, not a secret)
# The audit event on a submitted job naming its lineage, attempt and revision.
VERB_LINEAGE_SUBMIT = "lineage_submit"
PAUSE_FLAG = "paused"
# The planned fix's fields kept as the proposal row's own columns, not in its `plan` JSON.
_FIX_COLUMNS = ("remediator", "lever", "rung", "failing_step")


class NotFound(LookupError):
    """A row asked for by id that the record does not hold."""


class IntentError(RuntimeError):
    """An intent used in a way that would break exactly-once (closed twice, token missing...)."""


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


@dataclass(frozen=True)
class SubmitIntent:
    """A submission recorded (and committed) before `sbatch` runs; the only source of its token.

    A relaunch carries its proposal; a first submission (`slurm-medic submit`) has none.
    """

    action_id: int
    proposal_id: int | None
    lineage_id: int | None
    revision_id: int | None
    attempt: int
    token: str
    argv: tuple[str, ...]
    recorded_at: datetime


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


def new_token() -> str:
    """An idempotency token: unguessable, and safe inside an sbatch `--comment`."""
    return TOKEN_PREFIX + secrets.token_hex(16)


def _get(session: Session, model: type[RowT], row_id: object) -> RowT:
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
    lineage = _get(session, Lineage, lineage_id)
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
            lineage = _get(session, Lineage, lineage_id)
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
    incident = _get(session, Incident, incident_id)
    plan = _as_object(to_json(fix))
    proposal = Proposal(
        incident_id=incident_id,
        lineage_id=incident.lineage_id,
        remediator=fix.remediator,
        lever=fix.lever.value,
        rung=fix.rung,
        failing_step=fix.failing_step,
        plan={key: value for key, value in plan.items() if key not in _FIX_COLUMNS},
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
    stray = sorted(set(proposal.plan) & set(_FIX_COLUMNS))
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


def record_submit_intent(
    session: Session,
    *,
    build_argv: Callable[[str], Sequence[str]],
    actor: Actor,
    proposal_id: int | None = None,
    lineage_id: int | None = None,
    revision_id: int | None = None,
) -> SubmitIntent:
    """Record, and commit, the intent to submit before anything runs.

    A relaunch names its proposal (which moves to `submitting`; its lineage and revision come
    from it); a first submission names its lineage and revision. The token is made here and
    only handed to `build_argv`, so an sbatch argv carrying a token exists only once its intent
    is on disk; the argv must carry it (in `--comment`) so a crash after sbatch can be
    reconciled by finding the job.
    """
    token = new_token()
    argv = tuple(build_argv(token))
    if not any(token in arg for arg in argv):
        raise IntentError("the sbatch argv must carry the intent's token (in --comment)")
    if proposal_id is not None:
        proposal = transition_proposal(
            session, proposal_id=proposal_id, to=ProposalState.SUBMITTING, actor=actor
        )
        lineage_id = proposal.lineage_id
        revision_id = revision_id or proposal.revision_id or _revision_made_for(session, proposal)
    elif lineage_id is None or revision_id is None:
        raise IntentError("a first submission names its lineage and its revision")
    lineage = session.get(Lineage, lineage_id) if lineage_id is not None else None
    action = Action(
        proposal_id=proposal_id,
        lineage_id=lineage_id,
        revision_id=revision_id,
        attempt=lineage.attempts + 1 if lineage is not None else 1,
        kind=ActionKind.SBATCH.value,
        argv=list(argv),
        token=token,
        result=ActionResult.PENDING.value,
    )
    session.add(action)
    session.flush()
    append_audit(
        session,
        actor=actor,
        verb="submit_intent",
        subject_type="action",
        subject_id=action.id,
        details={
            "proposal": proposal_id,
            "lineage": lineage_id,
            "revision": revision_id,
            "token": token,
        },
    )
    session.commit()
    return _intent(action)


def _revision_made_for(session: Session, proposal: Proposal) -> int | None:
    return session.scalars(
        select(TemplateRevision.id)
        .where(TemplateRevision.proposal_id == proposal.id)
        .order_by(TemplateRevision.id.desc())
        .limit(1)
    ).one_or_none()


def _intent(action: Action) -> SubmitIntent:
    if action.attempt is None:
        raise IntentError(f"sbatch action {action.id} has no attempt number")
    return SubmitIntent(
        action_id=action.id,
        proposal_id=action.proposal_id,
        lineage_id=action.lineage_id,
        revision_id=action.revision_id,
        attempt=action.attempt,
        token=action.token,
        argv=tuple(str(arg) for arg in action.argv),
        recorded_at=action.started_at,
    )


def _open_intent_action(session: Session, intent: SubmitIntent) -> Action:
    action = session.scalars(
        select(Action).where(Action.id == intent.action_id).with_for_update()
    ).one_or_none()
    if action is None or action.token != intent.token:
        raise IntentError(f"no recorded intent {intent.action_id} with token {intent.token}")
    if action.result != ActionResult.PENDING.value:
        raise IntentError(f"intent {intent.action_id} is already closed ({action.result})")
    return action


def record_submitted(
    session: Session,
    *,
    intent: SubmitIntent,
    slurm_job_id: int,
    actor: Actor,
    stdout: str = "",
    stderr: str = "",
) -> Action:
    """Close an intent whose sbatch succeeded; commits."""
    return _close_submitted(
        session,
        intent=intent,
        slurm_job_id=slurm_job_id,
        actor=actor,
        exit_code=0,
        stdout=stdout,
        stderr=stderr,
        verb="submitted",
    )


def _close_submitted(
    session: Session,
    *,
    intent: SubmitIntent,
    slurm_job_id: int,
    actor: Actor,
    exit_code: int | None,
    stdout: str | None,
    stderr: str | None,
    verb: str,
) -> Action:
    action = _open_intent_action(session, intent)
    action.result = ActionResult.SUCCEEDED.value
    action.slurm_job_id = slurm_job_id
    action.exit_code = exit_code
    action.stdout = stdout
    action.stderr = stderr
    action.finished_at = utc_now()
    if intent.proposal_id is not None:
        proposal = transition_proposal(
            session,
            proposal_id=intent.proposal_id,
            to=ProposalState.SUBMITTED,
            actor=actor,
            reason=f"job {slurm_job_id}",
        )
        proposal.relaunch_job_id = slurm_job_id
    append_audit(
        session,
        actor=actor,
        verb=verb,
        subject_type="action",
        subject_id=action.id,
        details={"proposal": intent.proposal_id, "lineage": intent.lineage_id, "job": slurm_job_id},
    )
    if intent.lineage_id is not None:
        lineage = _get(session, Lineage, intent.lineage_id)
        lineage.attempts = max(lineage.attempts, intent.attempt)
        # The job's own line in the record: `show JOBID` tells which run it is.
        append_audit(
            session,
            actor=actor,
            verb=VERB_LINEAGE_SUBMIT,
            subject_type="job",
            subject_id=slurm_job_id,
            details={
                "lineage": intent.lineage_id,
                "attempt": intent.attempt,
                "revision": intent.revision_id,
                "proposal": intent.proposal_id,
                "token": intent.token,
            },
        )
    session.commit()
    return action


def record_submit_failed(
    session: Session,
    *,
    intent: SubmitIntent,
    exit_code: int | None,
    stdout: str,
    stderr: str,
    actor: Actor,
) -> Action:
    """Close an intent whose sbatch ran and refused; a relaunch's proposal fails with sbatch's
    words. Commits."""
    action = _open_intent_action(session, intent)
    action.result = ActionResult.FAILED.value
    action.exit_code = exit_code
    action.stdout = stdout
    action.stderr = stderr
    action.finished_at = utc_now()
    append_audit(
        session,
        actor=actor,
        verb="submit_failed",
        subject_type="action",
        subject_id=action.id,
        details={
            "proposal": intent.proposal_id,
            "lineage": intent.lineage_id,
            "exit_code": exit_code,
            "stderr": stderr[:2000],
        },
    )
    session.flush()
    if intent.proposal_id is not None:
        transition_proposal(
            session,
            proposal_id=intent.proposal_id,
            to=ProposalState.FAILED,
            actor=actor,
            reason=f"sbatch exited {exit_code}: {stderr.strip()[:500]}",
        )
    session.commit()
    return action


def pending_intents(session: Session) -> list[SubmitIntent]:
    """Intents recorded but never closed: what reconciliation must look for in Slurm."""
    rows = session.scalars(
        select(Action)
        .where(Action.result == ActionResult.PENDING.value, Action.kind == ActionKind.SBATCH.value)
        .order_by(Action.id)
    )
    return [_intent(row) for row in rows]


def reconcile_intent(
    session: Session, *, intent: SubmitIntent, found_job_id: int | None, actor: Actor
) -> Action:
    """Close an intent after a crash: submitted if Slurm has a job with its token, else undone.

    Not found means sbatch never ran: a relaunch's proposal goes back to approved and may be
    submitted again under a new intent; a first submission stays a lineage with no job.
    Commits.
    """
    if found_job_id is not None:
        return _close_submitted(
            session,
            intent=intent,
            slurm_job_id=found_job_id,
            actor=actor,
            exit_code=None,
            stdout=None,
            stderr=None,
            verb="reconciled_found",
        )
    action = _open_intent_action(session, intent)
    action.result = ActionResult.NOT_FOUND.value
    action.finished_at = utc_now()
    if intent.proposal_id is not None:
        transition_proposal(
            session,
            proposal_id=intent.proposal_id,
            to=ProposalState.APPROVED,
            actor=actor,
            reason=f"no Slurm job carries token {intent.token}",
        )
    append_audit(
        session,
        actor=actor,
        verb="reconciled_not_found",
        subject_type="action",
        subject_id=action.id,
        details={"proposal": intent.proposal_id, "lineage": intent.lineage_id},
    )
    session.commit()
    return action


def record_action(
    session: Session,
    *,
    kind: ActionKind,
    argv: Sequence[str],
    actor: Actor,
    node: str | None = None,
    proposal_id: int | None = None,
) -> Action:
    """Record a side effect other than a relaunch (scancel, drain, resume) as it starts."""
    if kind is ActionKind.SBATCH:
        raise IntentError("a relaunch is recorded with record_submit_intent")
    action = Action(
        proposal_id=proposal_id,
        kind=kind.value,
        argv=list(argv),
        token=new_token(),
        node=node,
        result=ActionResult.PENDING.value,
    )
    session.add(action)
    session.flush()
    append_audit(
        session,
        actor=actor,
        verb=kind.value,
        subject_type="action",
        subject_id=action.id,
        details={"argv": list(argv), "node": node, "proposal": proposal_id},
    )
    session.flush()
    return action


def finish_action(
    session: Session,
    *,
    action_id: int,
    exit_code: int | None,
    stdout: str,
    stderr: str,
    succeeded: bool,
) -> Action:
    action = _get(session, Action, action_id)
    if action.result != ActionResult.PENDING.value:
        raise IntentError(f"action {action_id} already finished ({action.result})")
    action.exit_code = exit_code
    action.stdout = stdout
    action.stderr = stderr
    action.finished_at = utc_now()
    action.result = (ActionResult.SUCCEEDED if succeeded else ActionResult.FAILED).value
    session.flush()
    return action


def record_node_event(
    session: Session,
    *,
    node: str,
    kind: NodeEventKind,
    by_medic: bool,
    reason: str,
    occurred_at: datetime | None = None,
    incident_id: int | None = None,
    action_id: int | None = None,
) -> NodeEvent:
    event = NodeEvent(
        node=node,
        kind=kind.value,
        by_medic=by_medic,
        reason=reason,
        occurred_at=occurred_at or utc_now(),
        incident_id=incident_id,
        action_id=action_id,
    )
    session.add(event)
    session.flush()
    return event


def drains_in_force(session: Session) -> list[NodeEvent]:
    """Drains slurm-medic made that no later event on the same node has undone."""
    latest = (
        select(NodeEvent.node, func.max(NodeEvent.id).label("last_id"))
        .group_by(NodeEvent.node)
        .subquery()
    )
    query = (
        select(NodeEvent)
        .join(latest, NodeEvent.id == latest.c.last_id)
        .where(NodeEvent.kind == NodeEventKind.DRAIN.value, NodeEvent.by_medic.is_(True))
        .order_by(NodeEvent.node)
    )
    return list(session.scalars(query))


def get_cursor(session: Session, *, name: str) -> datetime | None:
    cursor = session.get(Cursor, name)
    return None if cursor is None else cursor.polled_until


def set_cursor(session: Session, *, name: str, polled_until: datetime) -> None:
    cursor = session.get(Cursor, name)
    if cursor is None:
        session.add(Cursor(name=name, polled_until=polled_until))
    else:
        cursor.polled_until = polled_until
    session.flush()


def set_paused(session: Session, *, paused: bool, actor: Actor, reason: str) -> ControlFlag:
    """Flip the global pause (the daemon proposes, never acts, while it is on); audited."""
    flag = session.get(ControlFlag, PAUSE_FLAG)
    previous = flag.value if flag is not None else False
    if flag is None:
        flag = ControlFlag(name=PAUSE_FLAG)
        session.add(flag)
    flag.value = paused
    flag.reason = reason
    flag.set_by = actor.name
    flag.set_at = utc_now()
    append_audit(
        session,
        actor=actor,
        verb="pause" if paused else "unpause",
        subject_type="daemon",
        subject_id=PAUSE_FLAG,
        details={"from": previous, "to": paused, "reason": reason},
    )
    session.flush()
    return flag


def pause_flag(session: Session) -> ControlFlag | None:
    """The pause switch as last set (who, when, why), or None if nobody ever set it."""
    return session.get(ControlFlag, PAUSE_FLAG)


def is_paused(session: Session) -> bool:
    flag = pause_flag(session)
    return flag is not None and flag.value


def cursors(session: Session) -> list[Cursor]:
    """Every watcher's cursor: where its last poll ended, and when it wrote that."""
    return list(session.scalars(select(Cursor).order_by(Cursor.name)))


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
    lineage = _get(session, Lineage, lineage_id)
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


def _as_object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a JSON object, found {type(value).__name__}")
    return value
