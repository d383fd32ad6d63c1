"""Acting on an approved proposal: render, check the lever, resume, drain, submit, once.

Order, and why: everything that can be refused without touching the cluster comes first
(render the revision, check that the lever really is in the rendered script, find the last
good checkpoint); then drains (idempotent: a node medic already drained is not drained
again); then the relaunch through the one submission protocol (`daemon.submission`), so a
daemon killed between any two steps either finds its job by the token in the comment when it
reconciles, or submits it once under a new intent.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from sqlalchemy.orm import Session

from daemon.checkpoints import Checkpoint
from daemon.config import Settings
from daemon.dialects.base import Dialect, Knobs, Role
from daemon.effects import perform
from daemon.gather import JobFiles, OwnerJobFiles, lineage_template
from daemon.imported_render import check_rendered
from daemon.owner_files import OwnerReadRefused
from daemon.planner import PlannedFix
from daemon.policy import ProposalFacts, RecentActivity, gate
from daemon.slurm.backend import SlurmBackend
from daemon.slurm.errors import SlurmError
from daemon.slurm.records import SlurmJob
from daemon.store import control
from daemon.store import repository as repo
from daemon.store import service_records as records
from daemon.store.models import (
    ActionKind,
    Incident,
    Job,
    Lineage,
    NodeEventKind,
    Proposal,
    TemplateRevision,
)
from daemon.store.states import ProposalState
from daemon.submission import Sbatch, submit_once
from daemon.templates.model import LaunchTemplate, TemplateError
from daemon.templates.rendering import render
from daemon.templates.revisions import (
    KnobChange,
    Patch,
    apply_patch,
    diff_revisions,
    knobs_to_json,
    resume_patch,
)
from daemon.templates.revisions import TemplateRevision as Revision
from daemon.templates.sandbox import shell_quote

log = logging.getLogger(__name__)

DAEMON = repo.Actor.daemon()

RowT = TypeVar("RowT")


class LeverMissing(TemplateError):
    """The rendered script does not carry the change the proposal was approved for."""


@dataclass
class ActDeps:
    settings: Settings
    backend: SlurmBackend
    files: JobFiles = field(default_factory=OwnerJobFiles)
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    paused: Callable[[], bool] = lambda: False


@dataclass(frozen=True)
class ActResult:
    proposal_id: int
    outcome: str  # held | failed | submitted | maybe_submitted
    detail: str = ""
    slurm_job_id: int | None = None


@dataclass(frozen=True)
class Relaunch:
    """The revision to submit and where it resumes from."""

    revision: Revision
    checkpoint: Checkpoint | None
    checkpoint_note: str


# ----------------------------------------------------------------------------- pure parts


def lever_problems(template: LaunchTemplate, before: Knobs, after: Knobs, script: str) -> list[str]:
    """What the approved change should have put in the script but did not.

    Each changed environment variable must be exported with its new value and not set again
    later in the script; each new launch argument must appear as the word the dialect
    renders. An empty list means the lever reached the script.
    """
    if template.imported is not None:  # the script is the user's: read the change back
        return check_rendered(template.dialect, template.imported, after, script)
    problems: list[str] = []
    lines = script.splitlines()
    for key, value in _new_pairs(template, before, after):
        wanted = f"export {key}={shell_quote(value)}"
        positions = [i for i, line in enumerate(lines) if line.strip() == wanted]
        if not positions:
            problems.append(f"`{wanted}` is not in the rendered script")
            continue
        later = [
            line.strip()
            for line in lines[positions[-1] + 1 :]
            if line.strip().startswith((f"{key}=", f"export {key}="))
        ]
        if later:
            problems.append(f"{key} is set again after the export: {later[0]!r}")
    old_args = template.dialect.render_args(before)
    for word in template.dialect.render_args(after):
        if word not in old_args and shell_quote(word) not in script:
            problems.append(f"argument {word!r} is not in the rendered script")
    exclude = template.dialect.knob_for(Role.EXCLUDE)
    excluded_now = exclude is not None and after.get(exclude) not in (before.get(exclude), ())
    if excluded_now and "--exclude" not in script:
        problems.append("the exclusion does not reach the sbatch header")
    return problems


def _new_pairs(template: LaunchTemplate, before: Knobs, after: Knobs) -> list[tuple[str, str]]:
    def pairs(knobs: Knobs) -> set[tuple[str, str]]:
        env = knobs.get("env")
        own = (
            {(str(p[0]), str(p[1])) for p in env if isinstance(p, tuple)}
            if isinstance(env, tuple)
            else set()
        )
        return own | set(template.dialect.render_env(knobs))

    return sorted(pairs(after) - pairs(before))


def validated_patch(dialect: Dialect, patch: Patch) -> Patch:
    """A stored patch with every value validated again by its knob, as this code has it."""
    changes = []
    for change in patch.changes:
        spec = dialect.spec(change.knob)
        changes.append(
            KnobChange(spec.name, spec.validate(change.before), spec.validate(change.after))
        )
    return Patch(tuple(changes), patch.reason)


def build_relaunch(
    template: LaunchTemplate,
    parent: Revision,
    fix: PlannedFix,
    find_checkpoint: Callable[[LaunchTemplate], tuple[Checkpoint | None, str]],
) -> Relaunch:
    """The new revision: the proposal's patch, checked in the script, then the resume patch."""
    patch = validated_patch(template.dialect, fix.patch)
    fixed = apply_patch(template, parent, patch)
    problems = lever_problems(template, parent.knobs, fixed.knobs, fixed.script)
    if problems:
        raise LeverMissing("; ".join(problems))
    checkpoint, note = find_checkpoint(template)
    if checkpoint is None:
        return Relaunch(fixed, None, note)
    patched = dataclasses.replace(template, knobs=fixed.knobs)
    resume = resume_patch(patched, fixed.knobs, checkpoint)
    if not resume.changes:
        return Relaunch(fixed, checkpoint, "already resuming from the last good checkpoint")
    resumed = apply_patch(patched, fixed, resume)
    return Relaunch(resumed, checkpoint, f"resumes from {checkpoint.path} (step {checkpoint.step})")


# ------------------------------------------------------------------------------- acting


def act_on_approved(session: Session, deps: ActDeps) -> list[ActResult]:
    """Act on every approved proposal, oldest first; each one commits its own steps."""
    results = []
    for proposal in records.proposals_in(session, states=[ProposalState.APPROVED.value]):
        try:
            results.append(act(session, proposal.id, deps))
        except SlurmError as error:
            session.rollback()
            log.warning("proposal %s: Slurm did not answer: %s", proposal.id, error)
            results.append(ActResult(proposal.id, "retry", str(error)))
        except Exception as error:  # one proposal's failure must not stop the others
            session.rollback()
            log.exception("acting on proposal %s failed", proposal.id)
            results.append(ActResult(proposal.id, "retry", str(error)))
    return results


def act(session: Session, proposal_id: int, deps: ActDeps) -> ActResult:
    """Carry out one approved proposal, exactly once."""
    proposal = _row(session, Proposal, proposal_id)
    incident = _row(session, Incident, proposal.incident_id)
    job_row = _row(session, Job, incident.job_id)
    failed_job = repo.job_record(job_row)
    submission = records.lineage_submission(
        session, slurm_job_id=failed_job.job_id, user=failed_job.user, comment=failed_job.comment
    )
    if proposal.lineage_id is None or submission is None:
        return _fail(session, proposal, "the failed job belongs to no lineage: nothing to relaunch")
    lineage = _row(session, Lineage, proposal.lineage_id)
    parent_row = _row(session, TemplateRevision, submission.revision_id)
    now = deps.clock()
    since = now - timedelta(hours=1)
    fix = repo.attempt_record(proposal).fix
    drains = fix.drains
    facts = ProposalFacts(fix.remediator, proposal.changes_science, drains)
    activity = RecentActivity(
        relaunches_by_user=records.relaunches_since(session, since=since, owner=lineage.owner),
        relaunches=records.relaunches_since(session, since=since),
        drains=records.drains_since(session, since=since),
    )
    verdict = gate(facts, activity, deps.settings.policy, paused=deps.paused())
    if not verdict.may_act:
        return ActResult(proposal_id, "held", "; ".join(verdict.reasons))
    try:
        template = lineage_template(lineage, parent_row, deps.files)
        parent = Revision(
            id=str(parent_row.id),
            template=template.name,
            parent=None,
            knobs=dict(template.knobs),
            script=render(template),
            diff="",
            patch=None,
        )
        relaunch = build_relaunch(template, parent, fix, lambda t: _last_good(t, failed_job, deps))
    except TemplateError as error:
        return _fail(session, proposal, f"the new revision cannot be made: {error}")
    for node in drains:
        if node in verdict.drop_drains:
            continue
        _drain(session, node, proposal, incident, deps)
    exclude = _excluded(session, template, relaunch.revision)
    revision_row = repo.record_template_revision(
        session,
        lineage_id=lineage.id,
        knobs=knobs_to_json(relaunch.revision.knobs),
        rendered_script=relaunch.revision.script,
        parent_id=parent_row.id,
        proposal_id=proposal.id,
    )
    repo.append_audit(
        session,
        actor=DAEMON,
        verb="revision",
        subject_type="proposal",
        subject_id=proposal.id,
        details={
            "revision": revision_row.id,
            "diff": diff_revisions(parent, relaunch.revision),
            "checkpoint": relaunch.checkpoint_note,
            "resumed_step": relaunch.checkpoint.step if relaunch.checkpoint else None,
            "exclude": list(exclude),
        },
    )
    repo.record_relaunch_revision(
        session,
        proposal=proposal,
        revision_id=revision_row.id,
        resumed_step=relaunch.checkpoint.step if relaunch.checkpoint else None,
    )
    outcome = submit_once(
        session,
        deps.backend,
        Sbatch(relaunch.revision.script, lineage.owner, failed_job.work_dir, exclude),
        actor=DAEMON,
        proposal_id=proposal.id,
        revision_id=revision_row.id,
    )
    if outcome.error is None:
        return ActResult(proposal_id, "submitted", slurm_job_id=outcome.job_id)
    if outcome.error.maybe_submitted:
        return ActResult(proposal_id, "maybe_submitted", str(outcome.error))
    return ActResult(proposal_id, "failed", str(outcome.error))


def _row(session: Session, model: type[RowT], row_id: object) -> RowT:
    row = session.get(model, row_id)
    if row is None:
        raise repo.NotFound(f"no {model.__name__} {row_id}")
    return row


def _fail(session: Session, proposal: Proposal, reason: str) -> ActResult:
    repo.transition_proposal(
        session, proposal_id=proposal.id, to=ProposalState.SUPERSEDED, actor=DAEMON, reason=reason
    )
    repo.append_audit(
        session,
        actor=DAEMON,
        verb="act_refused",
        subject_type="proposal",
        subject_id=proposal.id,
        details={"reason": reason},
    )
    session.commit()
    return ActResult(proposal.id, "failed", reason)


def _last_good(
    template: LaunchTemplate, job: SlurmJob, deps: ActDeps
) -> tuple[Checkpoint | None, str]:
    if template.checkpoint is None:
        return None, "the template declares no checkpoint layout: starts from scratch"
    try:
        scan = deps.files.find_last_good(job, template.checkpoint)
    except OwnerReadRefused as error:
        return None, f"checkpoints not readable as the owner ({error}): starts from scratch"
    if scan.found is None:
        return None, f"no good checkpoint ({scan.reason}): starts from scratch"
    return scan.found, ""


def _drain(
    session: Session, node: str, proposal: Proposal, incident: Incident, deps: ActDeps
) -> None:
    """Drain once: a node medic already holds drained is left as it is."""
    if any(event.node == node for event in control.drains_in_force(session)):
        return
    reason = f"medic: incident {incident.id} ({incident.kind}) job {incident.slurm_job_id}"
    done = perform(
        session,
        kind=ActionKind.DRAIN,
        argv=["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
        actor=DAEMON,
        run=lambda: deps.backend.drain(node, reason),
        node=node,
        proposal_id=proposal.id,
    )
    if not done.succeeded:
        return
    control.record_node_event(
        session,
        node=node,
        kind=NodeEventKind.DRAIN,
        by_medic=True,
        reason=reason,
        incident_id=incident.id,
        action_id=done.action.id,
    )
    session.commit()


def _excluded(session: Session, template: LaunchTemplate, revision: Revision) -> tuple[str, ...]:
    """The template's own exclusions plus every node medic holds drained: sbatch's command
    line `--exclude` replaces the script's, so the union goes on the command line."""
    knob = template.dialect.knob_for(Role.EXCLUDE)
    own = revision.knobs.get(knob) if knob else ()
    nodes = [str(node) for node in own] if isinstance(own, tuple) else []
    nodes += [event.node for event in control.drains_in_force(session)]
    return tuple(dict.fromkeys(nodes))
