"""Following a relaunch until it has shown the fix worked, or failed again.

Verified: the relaunch logged at least `margin_steps` past the step that failed AND a
checkpoint newer than the one it resumed from exists (the run can be resumed past the
failure). A relaunch that fails again is judged here too, when the pipeline handles its
end (`judge_failed_relaunch`, `finish_completed`): the same kind of failure moves the lineage
up the ladder, a different one stops and asks a person, and one that did not get past the
failing step counts as no progress (the planner ends retries on those), as does one still
pending after `verify.pending_timeout_s`. This module gathers through `daemon.gather` and
imports nothing of the pipeline, which calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from daemon.config import Settings
from daemon.diagnosis import Diagnosis, FailureKind
from daemon.effects import perform
from daemon.evidence.records import Evidence
from daemon.gather import JobFiles, lineage_template, read_log_findings
from daemon.owner_files import OwnerReadRefused
from daemon.planner import AttemptRecord, Outcome
from daemon.slurm.backend import SlurmBackend
from daemon.slurm.errors import JobNotFound, SlurmError
from daemon.slurm.records import JobState, SlurmJob
from daemon.store import control
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.codec import CodecError
from daemon.store.models import (
    ActionKind,
    Incident,
    Lineage,
    LineageStatus,
    Proposal,
    TemplateRevision,
)
from daemon.store.states import ProposalState
from daemon.templates.model import LaunchTemplate, TemplateError

log = logging.getLogger(__name__)

DAEMON = repo.Actor.daemon()


@dataclass(frozen=True)
class Progress:
    """How far a relaunch got, as its log and its checkpoints show."""

    max_step_seen: int | None
    newest_checkpoint_step: int | None


@dataclass(frozen=True)
class VerifyVerdict:
    verified: bool
    reasons: tuple[str, ...]


def judge_progress(
    *,
    failing_step: int | None,
    resumed_step: int | None,
    margin_steps: int,
    progress: Progress,
) -> VerifyVerdict:
    """Verified only when both the step margin and a newer checkpoint are shown."""
    reasons: list[str] = []
    target = (failing_step or 0) + margin_steps
    step_ok = progress.max_step_seen is not None and progress.max_step_seen >= target
    if step_ok:
        reasons.append(
            f"logged step {progress.max_step_seen}, at least {margin_steps} past the failing "
            f"step {failing_step}"
        )
    else:
        reasons.append(f"has not logged step {target} yet (seen {progress.max_step_seen})")
    newest = progress.newest_checkpoint_step
    checkpoint_ok = newest is not None and (resumed_step is None or newest > resumed_step)
    if checkpoint_ok:
        reasons.append(f"wrote checkpoint step {newest} (resumed from {resumed_step})")
    else:
        reasons.append(f"no checkpoint newer than step {resumed_step} yet (newest {newest})")
    return VerifyVerdict(step_ok and checkpoint_ok, tuple(reasons))


# Device OOM kinds a fragmentation fix can turn into: once `expandable_segments` is on, the same
# shortage reads as a plain capacity problem (the rule stops counting stranded bytes), and the
# runbook's next move is the capacity ladder, not a person.
_AFTER_FRAGMENTATION = frozenset(
    {
        FailureKind.FRAGMENTATION,
        FailureKind.TRUE_OOM,
        FailureKind.WORKSPACE_SPIKE,
        FailureKind.OPTIMIZER_BURST,
        FailureKind.EVAL_GROWTH,
    }
)


def relaunch_outcome(previous: FailureKind, again: Diagnosis) -> Outcome:
    """The same failure climbs the ladder; anything else needs a person. A device OOM after a
    fragmentation fix is the same failure (see `_AFTER_FRAGMENTATION`)."""
    if again.kind is previous:
        return Outcome.SAME_FAILURE
    if previous is FailureKind.FRAGMENTATION and again.kind in _AFTER_FRAGMENTATION:
        return Outcome.SAME_FAILURE
    return Outcome.DIFFERENT_FAILURE


# ----------------------------------------------------------------------------- store side


def judge_failed_relaunch(
    session: Session, proposal_id: int, verdict: Diagnosis, evidence: Evidence
) -> None:
    """Close a relaunch that failed: its outcome and how far it got go on the proposal."""
    proposal = session.get(Proposal, proposal_id)
    if proposal is None or proposal.state not in (
        ProposalState.SUBMITTED.value,
        ProposalState.VERIFYING.value,
    ):
        return
    previous = session.get(Incident, proposal.incident_id)
    previous_kind = FailureKind(previous.kind) if previous is not None else FailureKind.UNKNOWN
    outcome = relaunch_outcome(previous_kind, verdict)
    step_reached = evidence.log.max_step_seen
    repo.record_outcome(session, proposal=proposal, outcome=outcome, step_reached=step_reached)
    repo.transition_proposal(
        session,
        proposal_id=proposal_id,
        to=ProposalState.FAILED,
        actor=DAEMON,
        reason=(
            f"relaunch failed again ({verdict.kind.value}, was {previous_kind.value}): "
            f"{outcome.value}; furthest step {step_reached}"
        ),
    )


def finish_completed(
    session: Session, proposal_id: int, job: SlurmJob, files: JobFiles, settings: Settings
) -> str:
    """A relaunch that ran to the end: verified if it shows progress, else no progress."""
    proposal = session.get(Proposal, proposal_id)
    if proposal is None or proposal.state not in (
        ProposalState.SUBMITTED.value,
        ProposalState.VERIFYING.value,
    ):
        return "already judged"
    record = repo.attempt_record(proposal)
    progress = measure_progress(session, proposal, record, job, files=files, settings=settings)
    verdict = _verdict(record, progress, settings)
    if proposal.state == ProposalState.SUBMITTED.value:
        repo.transition_proposal(
            session, proposal_id=proposal_id, to=ProposalState.VERIFYING, actor=DAEMON
        )
    if verdict.verified:
        _verified(session, proposal, progress, verdict)
        return "verified"
    _no_progress(
        session,
        proposal,
        progress,
        "completed without showing progress: " + "; ".join(verdict.reasons),
    )
    return "no progress"


def _no_progress(session: Session, proposal: Proposal, progress: Progress, reason: str) -> None:
    """The relaunch got nowhere: the planner counts this toward ending retries."""
    repo.record_outcome(
        session,
        proposal=proposal,
        outcome=Outcome.SAME_FAILURE,
        step_reached=progress.max_step_seen,
    )
    repo.transition_proposal(
        session, proposal_id=proposal.id, to=ProposalState.FAILED, actor=DAEMON, reason=reason
    )


def measure_progress(
    session: Session,
    proposal: Proposal,
    record: AttemptRecord,
    job: SlurmJob,
    *,
    files: JobFiles,
    settings: Settings,
) -> Progress:
    """How far the relaunch got: its log's furthest step and its newest good checkpoint."""
    findings = read_log_findings(job, files, settings.log_max_bytes)
    newest: int | None = None
    revision_id = record.revision_id
    revision = session.get(TemplateRevision, revision_id) if revision_id is not None else None
    lineage = session.get(Lineage, proposal.lineage_id) if proposal.lineage_id else None
    if revision is not None and lineage is not None:
        try:
            template: LaunchTemplate | None = lineage_template(lineage, revision, files)
        except TemplateError as error:
            # The owner's directory changed or went away: the log still tells the steps.
            log.warning("lineage %s: template not read: %s", lineage.id, error)
            template = None
        if template is not None and template.checkpoint is not None:
            try:
                scan = files.find_last_good(job, template.checkpoint)
            except OwnerReadRefused:
                scan = None
            if scan is not None and scan.found is not None:
                newest = scan.found.step
    return Progress(findings.max_step_seen, newest)


def _verdict(record: AttemptRecord, progress: Progress, settings: Settings) -> VerifyVerdict:
    return judge_progress(
        failing_step=record.fix.failing_step,
        resumed_step=record.resumed_step,
        margin_steps=settings.verify.margin_steps,
        progress=progress,
    )


def _verified(
    session: Session, proposal: Proposal, progress: Progress, verdict: VerifyVerdict
) -> None:
    repo.record_outcome(
        session, proposal=proposal, outcome=Outcome.VERIFIED, step_reached=progress.max_step_seen
    )
    repo.transition_proposal(
        session,
        proposal_id=proposal.id,
        to=ProposalState.VERIFIED,
        actor=DAEMON,
        reason="; ".join(verdict.reasons),
    )
    if proposal.lineage_id is not None:
        lineage = session.get(Lineage, proposal.lineage_id)
        if lineage is not None and lineage.status == LineageStatus.ACTIVE.value:
            repo.set_lineage_status(
                session,
                lineage_id=lineage.id,
                status=LineageStatus.VERIFIED,
                actor=DAEMON,
                reason="the relaunch passed the failing step and wrote a new checkpoint",
            )


@dataclass
class FollowDeps:
    settings: Settings
    backend: SlurmBackend
    files: JobFiles
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)


def _pending_too_long(
    session: Session,
    proposal: Proposal,
    record: AttemptRecord,
    job: SlurmJob,
    *,
    waited: float,
    deps: FollowDeps,
) -> str:
    """A relaunch still queued past `verify.pending_timeout_s` is cancelled, then counted as
    no progress: it ran no step, so it stands where it resumed from (0 from scratch). Left
    queued, it could start after the planner had moved on, a second run of the lineage that
    nobody follows. While the daemon is paused or dry-running it only waits."""
    policy = deps.settings.policy
    if policy.dry_run or policy.paused or control.is_paused(session):
        return f"pending {waited:.0f} s, past the timeout; not cancelled while paused or dry-run"
    job_id = job.job_id
    done = perform(
        session,
        kind=ActionKind.SCANCEL,
        argv=["scancel", str(job_id)],
        actor=DAEMON,
        run=lambda: deps.backend.cancel(job_id),
        proposal_id=proposal.id,
    )
    if done.error is not None:
        return f"pending {waited:.0f} s, past the timeout; scancel failed: {done.error}"
    standing = Progress(record.resumed_step or 0, None)
    reason = f"pending {waited:.0f} s, past verify.pending_timeout_s: cancelled"
    _no_progress(session, proposal, standing, reason)
    session.commit()
    return "no progress"


def follow_relaunches(session: Session, deps: FollowDeps) -> list[tuple[int, str]]:
    """Look at every relaunch in flight; verify those that already show the fix worked.

    Ended relaunches are left to the finished-job poll (the pipeline hands them to
    `judge_failed_relaunch` or `finish_completed`), so a job is judged once.
    """
    results: list[tuple[int, str]] = []
    states = [ProposalState.SUBMITTED.value, ProposalState.VERIFYING.value]
    in_flight = records.proposals_in(session, states=states)
    session.commit()  # only read: asking Slurm about each relaunch holds no lock on the record
    for proposal in in_flight:
        if proposal.relaunch_job_id is None:
            continue
        try:
            record = repo.attempt_record(proposal)
        except CodecError as error:  # one unreadable record must not stop the others
            results.append((proposal.id, f"its record does not read: {error}"))
            continue
        try:
            job = deps.backend.job(proposal.relaunch_job_id)
        except JobNotFound:
            results.append((proposal.id, "not in accounting yet"))
            continue
        except SlurmError as error:
            results.append((proposal.id, f"Slurm did not answer: {error}"))
            continue
        now = deps.clock()
        if job.state is JobState.PENDING and job.submit_time is not None:
            waited = (now - job.submit_time).total_seconds()
            if waited > deps.settings.verify.pending_timeout_s:
                results.append(
                    (
                        proposal.id,
                        _pending_too_long(session, proposal, record, job, waited=waited, deps=deps),
                    )
                )
                continue
        if job.state is not JobState.RUNNING:
            results.append((proposal.id, job.state.value))
            continue
        if proposal.state == ProposalState.SUBMITTED.value:
            repo.transition_proposal(
                session,
                proposal_id=proposal.id,
                to=ProposalState.VERIFYING,
                actor=DAEMON,
                reason=f"job {job.job_id} is running",
            )
        progress = measure_progress(
            session, proposal, record, job, files=deps.files, settings=deps.settings
        )
        verdict = _verdict(record, progress, deps.settings)
        ran = (now - job.start_time).total_seconds() if job.start_time else 0.0
        if verdict.verified:
            _verified(session, proposal, progress, verdict)
            results.append((proposal.id, "verified"))
        elif ran > deps.settings.verify.max_duration_s:
            _no_progress(session, proposal, progress, f"ran {ran:.0f} s without showing progress")
            results.append((proposal.id, "no progress"))
        else:
            results.append((proposal.id, "; ".join(verdict.reasons)))
        session.commit()
    return results
