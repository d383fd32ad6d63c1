"""One ended job, handled: gather -> diagnose -> plan -> decide, all on the record.

The I/O here is only through seams handed in (`PipelineDeps`): the node prober, and
`JobFiles`, which reads a job's files and its lineage's template with its owner's rights
(`daemon.gather`). Everything that decides is pure (`diagnose`, `plan`, `policy.decide`);
this module joins them and writes each step to the store in one transaction per job, ending
with a `job_handled` event, so a crash anywhere before the commit leaves the job to be
handled again, and never twice. An ended relaunch is judged first (`daemon.verify`), so the
planner counts its outcome; verify imports nothing of this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from daemon.config import Settings
from daemon.diagnosis import Diagnosis, History
from daemon.dialects.base import Dialect
from daemon.evidence.prober import NodeProber
from daemon.evidence.records import Evidence
from daemon.gather import (
    JobFiles,
    OwnerJobFiles,
    gather,
    lineage_expandable_segments,
    lineage_template,
    with_template_paths,
)
from daemon.planner import (
    Attempt,
    LineageHistory,
    Outcome,
    PlannerPolicy,
    Refusal,
    plan,
    planned_fix,
)
from daemon.policy import ProposalFacts, decide
from daemon.rules.dispatch import diagnose, with_suspicious_text
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.models import Incident, Lineage, LineageStatus, TemplateRevision
from daemon.store.states import ProposalState
from daemon.templates.model import TemplateError
from daemon.templates.revisions import knobs_from_json
from daemon.verify import finish_completed, judge_failed_relaunch

log = logging.getLogger(__name__)

DAEMON = repo.Actor.daemon()

# States after which a lineage's relaunch is judged as failed (anything but a clean finish).
FAILED_STATES = frozenset(
    {
        JobState.FAILED,
        JobState.OUT_OF_MEMORY,
        JobState.NODE_FAIL,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.PREEMPTED,
    }
)


@dataclass
class PipelineDeps:
    """The seams a handled job's I/O goes through."""

    settings: Settings
    prober: NodeProber | None
    files: JobFiles = field(default_factory=OwnerJobFiles)


@dataclass(frozen=True)
class HandleResult:
    """What handling one ended job came to (for logs and tests)."""

    slurm_job_id: int
    outcome: str
    incident_id: int | None = None
    proposal_id: int | None = None
    approved: bool = False
    detail: str = ""


# ------------------------------------------------------------------ lineage and history


_OUTCOMES = {
    ProposalState.VERIFIED.value: Outcome.VERIFIED,
    ProposalState.REJECTED.value: Outcome.REJECTED,
}


def planner_history(session: Session, *, lineage_id: int, dialect: Dialect) -> LineageHistory:
    """The lineage's attempts as the planner counts them: every proposal acted on or refused,
    read through `repo.attempt_record` (a record that does not read is an error)."""
    attempts = []
    for row in records.lineage_proposals(session, lineage_id=lineage_id):
        state = row.state
        if state in (ProposalState.PROPOSED.value, ProposalState.APPROVED.value):
            continue
        if state in (ProposalState.EXPIRED.value, ProposalState.SUPERSEDED.value):
            continue
        record = repo.attempt_record(row)
        fix = record.fix
        attempts.append(
            Attempt(
                remediator=fix.remediator,
                rung=fix.rung,
                kind=fix.kind,
                knobs_before=knobs_from_json(dialect, fix.knobs_before),
                knobs_after=knobs_from_json(dialect, fix.knobs_after),
                outcome=_OUTCOMES.get(state, record.outcome),
                failing_step=fix.failing_step,
                step_reached=record.step_reached,
            )
        )
    return LineageHistory(tuple(attempts))


def diagnosis_history(session: Session, *, lineage_id: int) -> History:
    earlier = [
        repo.incident_records(incident)[1]
        for incident in records.lineage_incidents(session, lineage_id=lineage_id)
    ]
    return History(tuple(earlier))


def planner_policy(settings: Settings) -> PlannerPolicy:
    policy = settings.policy
    return PlannerPolicy(
        max_attempts_per_lineage=policy.max_attempts_per_lineage,
        max_attempts_per_rule=policy.max_attempts_per_rule,
        per_rule=policy.max_attempts_by_lever,
        max_no_progress=policy.max_no_progress,
    )


# ------------------------------------------------------------------------------ handle


def handle_ended_job(session: Session, job: SlurmJob, deps: PipelineDeps) -> HandleResult:
    """Handle one ended job once; the caller commits (and skips jobs already handled).

    The gather (log scan, node probe) runs between transactions: only reads come before it.
    """
    submission = records.lineage_submission(
        session, slurm_job_id=job.job_id, user=job.user, comment=job.comment
    )
    managed = deps.settings.managed.matches(
        account=job.account, partition=job.partition, user=job.user
    )
    if submission is None and not managed:
        return HandleResult(job.job_id, "unmanaged")
    lineage_id = submission.lineage_id if submission else None
    expandable: bool | None = None
    if submission is not None:
        # A completed relaunch is judged from its log too, so it needs the paths as well.
        job = with_template_paths(session, job, submission, deps.files)
        if job.state in FAILED_STATES:
            expandable = lineage_expandable_segments(session, submission, deps.files)
    evidence: Evidence | None = None
    if job.state in FAILED_STATES:
        # Nothing is written yet: end the read so that the log scan and the node probe
        # (seconds, longer for a node that does not answer) hold no lock on the record.
        session.commit()
        evidence = gather(
            job,
            files=deps.files,
            prober=deps.prober,
            log_max_bytes=deps.settings.log_max_bytes,
            expandable_segments=expandable,
        )
    repo.record_job(
        session,
        job=job,
        lineage_id=lineage_id,
        attempt=submission.attempt if submission else None,
    )
    if job.state is JobState.COMPLETED:
        return _completed(session, job, submission, deps)
    if evidence is None:
        records.mark_job_handled(
            session, slurm_job_id=job.job_id, actor=DAEMON, outcome="ignored", details={}
        )
        return HandleResult(job.job_id, "ignored", detail=job.state.value)
    history = (
        diagnosis_history(session, lineage_id=lineage_id) if lineage_id is not None else History()
    )
    verdict = with_suspicious_text(diagnose(evidence, history), evidence.log)
    incident = repo.record_incident(
        session, slurm_job_id=job.job_id, evidence=evidence, diagnosis=verdict
    )
    repo.append_audit(
        session,
        actor=DAEMON,
        verb="diagnosed",
        subject_type="incident",
        subject_id=incident.id,
        details={
            "job": job.job_id,
            "kind": verdict.kind.value,
            "confidence": verdict.confidence.value,
            "reasons": list(verdict.reasons),
        },
    )
    if submission is not None and submission.proposal_id is not None:
        judge_failed_relaunch(session, submission.proposal_id, verdict, evidence)
    if submission is None:
        records.mark_job_handled(
            session,
            slurm_job_id=job.job_id,
            actor=DAEMON,
            outcome="diagnosed",
            details={"incident": incident.id, "managed": "diagnosis only"},
        )
        return HandleResult(job.job_id, "diagnosed", incident.id)
    result = _plan_and_decide(
        session,
        job=job,
        incident=incident,
        verdict=verdict,
        failing_step=failing_step(verdict, evidence),
        submission=submission,
        deps=deps,
    )
    records.mark_job_handled(
        session,
        slurm_job_id=job.job_id,
        actor=DAEMON,
        outcome=result.outcome,
        details={"incident": incident.id, "proposal": result.proposal_id},
    )
    return result


def failing_step(verdict: Diagnosis, evidence: Evidence) -> int | None:
    """The step a relaunch must get past: the failure's own step, or the furthest step the
    dead run logged if that is later (a verification margin counted from too early a step
    would pass a relaunch that never reached the point of failure)."""
    steps = [step for step in (verdict.step, evidence.log.max_step_seen) if step is not None]
    return max(steps) if steps else None


def _completed(
    session: Session,
    job: SlurmJob,
    submission: records.LineageSubmission | None,
    deps: PipelineDeps,
) -> HandleResult:
    detail = ""
    if submission is not None and submission.proposal_id is not None:
        detail = finish_completed(session, submission.proposal_id, job, deps.files, deps.settings)
    records.mark_job_handled(
        session, slurm_job_id=job.job_id, actor=DAEMON, outcome="completed", details={}
    )
    return HandleResult(job.job_id, "completed", detail=detail)


def _plan_and_decide(
    session: Session,
    *,
    job: SlurmJob,
    incident: Incident,
    verdict: Diagnosis,
    failing_step: int | None,
    submission: records.LineageSubmission,
    deps: PipelineDeps,
) -> HandleResult:
    lineage = session.get(Lineage, submission.lineage_id)
    revision = session.get(TemplateRevision, submission.revision_id)
    if lineage is None or revision is None:
        return HandleResult(job.job_id, "no_lineage", incident.id)
    try:
        template = lineage_template(lineage, revision, deps.files)
    except TemplateError as error:
        _ask_person(session, lineage, f"the lineage's template cannot be loaded: {error}")
        return HandleResult(job.job_id, "template_error", incident.id, detail=str(error))
    if lineage.status == LineageStatus.VERIFIED.value:
        repo.set_lineage_status(
            session,
            lineage_id=lineage.id,
            status=LineageStatus.ACTIVE,
            actor=DAEMON,
            reason=f"job {job.job_id} failed after the lineage was verified",
        )
    history = planner_history(session, lineage_id=lineage.id, dialect=template.dialect)
    outcome = plan(verdict, template, history, planner_policy(deps.settings))
    _supersede_waiting(session, lineage.id)
    if isinstance(outcome, Refusal):
        repo.append_audit(
            session,
            actor=DAEMON,
            verb="refused",
            subject_type="incident",
            subject_id=incident.id,
            details={
                "reason": outcome.reason,
                "asks_person": outcome.asks_person,
                "skipped": [[s.rung, s.remediator, s.reason] for s in outcome.skipped],
            },
        )
        if verdict.is_oom:
            _ask_person(session, lineage, outcome.reason)
        return HandleResult(job.job_id, "refused", incident.id, detail=outcome.reason)
    remediation = outcome.remediation
    row = repo.propose(
        session,
        incident_id=incident.id,
        fix=planned_fix(outcome, template.knobs, failing_step),
        rationale=remediation.rationale,
        cost=float(remediation.cost.throughput_loss_pct[1]),
        changes_science=remediation.changes_science,
        actor=DAEMON,
    )
    facts = ProposalFacts(
        remediator=remediation.remediator,
        changes_science=remediation.changes_science,
        drains=tuple(action.node for action in remediation.actions),
    )
    policy_verdict = decide(facts, deps.settings.policy)
    dry_run = deps.settings.policy.dry_run and policy_verdict.approved
    if dry_run:
        # Approving now would act the moment dry-run is switched off, on a stale failure.
        repo.append_audit(
            session,
            actor=DAEMON,
            verb="dry_run_would_approve",
            subject_type="proposal",
            subject_id=row.id,
            details={"reasons": list(policy_verdict.reasons)},
        )
    elif policy_verdict.approved:
        repo.transition_proposal(
            session,
            proposal_id=row.id,
            to=ProposalState.APPROVED,
            actor=DAEMON,
            reason="policy: " + "; ".join(policy_verdict.reasons),
        )
    else:
        repo.append_audit(
            session,
            actor=DAEMON,
            verb="awaiting_approval",
            subject_type="proposal",
            subject_id=row.id,
            details={"reasons": list(policy_verdict.reasons)},
        )
    return HandleResult(
        job.job_id,
        "proposed",
        incident.id,
        row.id,
        approved=policy_verdict.approved and not dry_run,
        detail=remediation.remediator,
    )


def _supersede_waiting(session: Session, lineage_id: int) -> None:
    """A newer failure makes an older, never-acted-on proposal of the lineage moot."""
    for row in records.lineage_proposals(session, lineage_id=lineage_id):
        if row.state in (ProposalState.PROPOSED.value, ProposalState.APPROVED.value):
            repo.transition_proposal(
                session,
                proposal_id=row.id,
                to=ProposalState.SUPERSEDED,
                actor=DAEMON,
                reason="a newer failure of the lineage was diagnosed",
            )


def _ask_person(session: Session, lineage: Lineage, reason: str) -> None:
    if lineage.status != LineageStatus.ACTIVE.value:
        return
    repo.set_lineage_status(
        session,
        lineage_id=lineage.id,
        status=LineageStatus.EXHAUSTED,
        actor=DAEMON,
        reason=f"a person must decide: {reason}",
    )


def incomplete_record_expired(job: SlurmJob, now: datetime, wait: timedelta) -> bool:
    """A placeholder accounting record is read again until `wait` after the job's end."""
    end = job.end_time or now
    return now - end > wait
