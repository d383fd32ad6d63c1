"""One ended job, handled: gather -> diagnose -> plan -> decide, all on the record.

The I/O here is only through seams handed in (`PipelineDeps`): the Slurm backend, the node
prober, and `JobFiles`, which reads a job's files and its lineage's template with its
owner's rights. Everything
that decides is pure (`diagnose`, `plan`, `policy.decide`); this module joins them and writes
each step to the store in one transaction per job, ending with a `job_handled` event, so a
crash anywhere before the commit leaves the job to be handled again, and never twice.
"""

from __future__ import annotations

import dataclasses
import logging
import pwd
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session

from daemon.checkpoints import CheckpointScan, CheckpointSpec
from daemon.config import Settings
from daemon.diagnosis import Diagnosis, FailureKind, History, diagnose, with_suspicious_text
from daemon.dialects.base import Dialect, KnobValue
from daemon.evidence.findings import confine_to_allocation, merge_findings
from daemon.evidence.prober import NodeProber
from daemon.evidence.records import Evidence, LogFindings, NodeProbe
from daemon.owner_files import (
    Owner,
    OwnerFiles,
    OwnerReadRefused,
    TemplateTexts,
    job_tree,
)
from daemon.planner import (
    Attempt,
    LineageHistory,
    Outcome,
    PlannerPolicy,
    Proposal,
    Refusal,
    plan,
)
from daemon.policy import ProposalFacts, decide
from daemon.slurm.paths import PathContext, default_stdout_pattern, expand_std_path
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.models import Incident, Lineage, LineageStatus, TemplateRevision
from daemon.store.states import ProposalState
from daemon.templates import (
    KnobChange,
    LaunchTemplate,
    Patch,
    TemplateError,
    knobs_from_json,
    knobs_to_json,
    load_template,
)
from remediators.allocator import current_option

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


class JobFiles(Protocol):
    """A job's files, read with its owner's rights; a refusal raises `OwnerReadRefused`."""

    def scan_log(self, job: SlurmJob, path: str, max_bytes: int) -> LogFindings:
        """The scanner's findings over at most the last `max_bytes` of the log."""
        ...

    def find_last_good(self, job: SlurmJob, spec: CheckpointSpec) -> CheckpointScan: ...

    def read_template(self, owner: str, directory: str) -> TemplateTexts:
        """A lineage's template directory, read as the lineage's owner."""
        ...


class OwnerJobFiles:
    """The production `JobFiles`: `daemon.owner_files` reads as the owner (a child when root)."""

    def __init__(
        self, *, drop_privileges: bool | None = None, step_pattern: str | None = None
    ) -> None:
        self._drop = drop_privileges
        self._step_pattern = step_pattern  # the site's `step_pattern`: None = built-in formats

    def _files(self, job: SlurmJob) -> OwnerFiles:
        """22.05's sacct JSON may carry no uid: the user name then names the owner."""
        uid = job.uid
        if uid is None:
            try:
                uid = pwd.getpwnam(job.user).pw_uid
            except KeyError:
                uid = None
        return OwnerFiles(Owner.for_job(user=job.user, uid=uid), drop_privileges=self._drop)

    def scan_log(self, job: SlurmJob, path: str, max_bytes: int) -> LogFindings:
        """The owner's reader opens the log and scans it itself, as the CLI does, back at most
        `max_bytes` from its end (in its child, under its own memory and CPU limits, when
        root): a hostile line can cost that child, not us."""
        return self._files(job).scan_log(
            path,
            max_bytes=max_bytes,
            step_pattern=self._step_pattern,
            tree=job_tree(path, job.work_dir),
        )

    def find_last_good(self, job: SlurmJob, spec: CheckpointSpec) -> CheckpointScan:
        return self._files(job).find_last_good(spec)

    def read_template(self, owner: str, directory: str) -> TemplateTexts:
        return OwnerFiles(Owner.from_name(owner), drop_privileges=self._drop).read_template(
            directory
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


# ------------------------------------------------------------------------------- gather


def read_log_findings(job: SlurmJob, files: JobFiles, max_bytes: int) -> LogFindings:
    """The job's logs scanned from their ends with the owner's rights; refusals noted.

    The failing node is one of the job's own, or none: a node the log names outside the
    allocation is only a note (see `confine_to_allocation`), so nothing downstream (the
    probe, the diagnosis, a drain) can be pointed at another node by what a job prints.
    """
    paths = [path for path in dict.fromkeys((job.stdout_path, job.stderr_path)) if path]
    findings: list[LogFindings] = []
    notes: list[str] = []
    if not paths:
        notes.append("Slurm gave no output path for the job (accounting keeps none in 22.05)")
    for path in paths:
        try:
            findings.append(files.scan_log(job, path, max_bytes))
        except OwnerReadRefused as error:
            notes.append(str(error))
    merged = merge_findings(findings)
    merged = dataclasses.replace(merged, notes=merged.notes + tuple(notes))
    return confine_to_allocation(merged, job)


def gather(
    job: SlurmJob, deps: PipelineDeps, *, expandable_segments: bool | None = None
) -> Evidence:
    """The Slurm record, the log scan and a probe of the failing rank's node; whether the run
    already had expandable segments (from its lineage's template) goes with them."""
    findings = read_log_findings(job, deps.files, deps.settings.log_max_bytes)
    node = findings.node or (job.nodes[0] if len(job.nodes) == 1 else job.batch_host)
    probe: NodeProbe | None = None
    if deps.prober is not None and node:
        try:
            probe = deps.prober.probe(node, start=job.start_time, end=job.end_time)
        except ValueError as error:
            log.warning("probe of %r refused: %s", node, error)
    return Evidence(log=findings, job=job, probe=probe, expandable_segments=expandable_segments)


def lineage_expandable_segments(
    session: Session, submission: records.LineageSubmission, files: JobFiles
) -> bool | None:
    """Whether the revision the job ran had `expandable_segments` on in its template's env
    (None: not known). With it on, the diagnosis reads stranded bytes as a full card."""
    lineage = session.get(Lineage, submission.lineage_id)
    revision = session.get(TemplateRevision, submission.revision_id)
    if lineage is None or revision is None:
        return None
    try:
        return template_expandable_segments(lineage_template(lineage, revision, files))
    except TemplateError:
        return None


def template_expandable_segments(template: LaunchTemplate) -> bool | None:
    """The template's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF `expandable_segments`."""
    value = current_option(template, "expandable_segments")
    return None if value is None else value.lower() == "true"


# ------------------------------------------------------------------ lineage and history


def lineage_template(
    lineage: Lineage, revision: TemplateRevision, files: JobFiles
) -> LaunchTemplate:
    """The lineage's template as the revision had it (its directory, read as the lineage's
    owner, and the revision's knobs)."""
    template = load_template(
        Path(lineage.template),
        lambda directory: files.read_template(lineage.owner, directory),
    )
    knobs = knobs_from_json(template.dialect, revision.knobs)
    return dataclasses.replace(template, knobs=knobs)


def patch_to_json(
    proposal: Proposal, knobs_before: Mapping[str, KnobValue], failing_step: int | None
) -> dict[str, Any]:
    """Everything acting on and judging a proposal needs, as the proposal row's JSON."""
    remediation = proposal.remediation
    return {
        "reason": proposal.patch.reason,
        "changes": [
            {"knob": change.knob, **knobs_to_json({"before": change.before, "after": change.after})}
            for change in proposal.patch.changes
        ],
        "kind": proposal.kind.value,
        "rung": proposal.rung,
        "ladder": list(proposal.ladder),
        "lever": remediation.lever.value,
        "expected_effect": remediation.expected_effect,
        "cost": remediation.cost.describe(),
        "knobs_before": knobs_to_json(knobs_before),
        "knobs_after": knobs_to_json(proposal.knobs_after),
        "failing_step": failing_step,
        "actions": [
            {"kind": action.kind.value, "node": action.node, "reason": action.reason}
            for action in remediation.actions
        ],
        "skipped": [
            {"rung": skip.rung, "remediator": skip.remediator, "reason": skip.reason}
            for skip in proposal.skipped
        ],
    }


def patch_from_json(dialect: Dialect, data: Mapping[str, Any]) -> Patch:
    """The typed patch back from a proposal row; every value re-validated by its knob."""
    changes = []
    for item in data["changes"]:
        spec = dialect.spec(str(item["knob"]))
        changes.append(
            KnobChange(spec.name, spec.validate(item["before"]), spec.validate(item["after"]))
        )
    return Patch(tuple(changes), str(data["reason"]))


_OUTCOMES = {
    ProposalState.VERIFIED.value: Outcome.VERIFIED,
    ProposalState.REJECTED.value: Outcome.REJECTED,
}


def planner_history(session: Session, *, lineage_id: int, dialect: Dialect) -> LineageHistory:
    """The lineage's attempts as the planner counts them: every proposal acted on or refused."""
    attempts = []
    for row in records.lineage_proposals(session, lineage_id=lineage_id):
        data = row.patch
        if "knobs_before" not in data:
            continue
        state = row.state
        if state in (ProposalState.PROPOSED.value, ProposalState.APPROVED.value):
            continue
        if state in (ProposalState.EXPIRED.value, ProposalState.SUPERSEDED.value):
            continue
        outcome = _OUTCOMES.get(state) or Outcome(data.get("outcome", Outcome.PENDING.value))
        attempts.append(
            Attempt(
                remediator=row.remediator,
                rung=int(data.get("rung", 0)),
                kind=FailureKind(data["kind"]),
                knobs_before=knobs_from_json(dialect, data["knobs_before"]),
                knobs_after=knobs_from_json(dialect, data["knobs_after"]),
                outcome=outcome,
                failing_step=data.get("failing_step"),
                step_reached=data.get("step_reached"),
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
    submission = records.lineage_submission(session, slurm_job_id=job.job_id)
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
        evidence = gather(job, deps, expandable_segments=expandable)
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
        _judge_relaunch(session, submission.proposal_id, verdict, evidence)
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


def with_template_paths(
    session: Session, job: SlurmJob, submission: records.LineageSubmission, files: JobFiles
) -> SlurmJob:
    """22.05 accounting keeps no std paths and slurmctld forgets them MinJobAge after the
    end; a lineage job's paths are known anyway: its revision's sbatch options, expanded as
    slurmd expands them."""
    if job.stdout_path is not None:
        return job
    lineage = session.get(Lineage, submission.lineage_id)
    revision = session.get(TemplateRevision, submission.revision_id)
    if lineage is None or revision is None:
        return job
    try:
        options = dict(lineage_template(lineage, revision, files).sbatch)
    except TemplateError:
        return job
    context = PathContext(
        job_id=job.job_id, name=job.name, user=job.user, first_node=job.batch_host
    )
    stdout = options.get("output", default_stdout_pattern(is_array=False))
    stderr = options.get("error")
    return dataclasses.replace(
        job,
        stdout_path=expand_std_path(stdout, context, work_dir=job.work_dir),
        stderr_path=expand_std_path(stderr, context, work_dir=job.work_dir) if stderr else None,
    )


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
    from daemon.verify import finish_completed  # noqa: PLC0415  (verify imports this module)

    detail = ""
    if submission is not None and submission.proposal_id is not None:
        detail = finish_completed(session, submission.proposal_id, job, deps)
    records.mark_job_handled(
        session, slurm_job_id=job.job_id, actor=DAEMON, outcome="completed", details={}
    )
    return HandleResult(job.job_id, "completed", detail=detail)


def _judge_relaunch(
    session: Session, proposal_id: int, verdict: Diagnosis, evidence: Evidence
) -> None:
    from daemon.verify import judge_failed_relaunch  # noqa: PLC0415

    judge_failed_relaunch(session, proposal_id, verdict, evidence)


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
        remediator=remediation.remediator,
        patch=patch_to_json(outcome, template.knobs, failing_step),
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
