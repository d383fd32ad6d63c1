"""Every side effect recorded as an action row as it starts and closed when it ends; an
sbatch's exactly-once.

The exactly-once functions (`record_submit_intent` and the three that close an intent) commit
themselves: their commit is the point. `daemon.submission` is the protocol that uses them, for
first submissions and relaunches alike. The other side effects (scancel, drain, resume) are
recorded with `record_action` and closed with `finish_action`, in the caller's transaction.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.store.models import (
    Action,
    ActionKind,
    ActionResult,
    Lineage,
    Proposal,
    TemplateRevision,
    utc_now,
)
from daemon.store.repository import Actor, append_audit, get_row, transition_proposal
from daemon.store.states import ProposalState

TOKEN_PREFIX = "medic-"  # noqa: S105 (a label, not a secret)
# The audit event on a submitted job naming its lineage, attempt and revision.
VERB_LINEAGE_SUBMIT = "lineage_submit"


class IntentError(RuntimeError):
    """An intent used in a way that would break exactly-once (closed twice, token missing...)."""


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


def new_token() -> str:
    """An idempotency token: unguessable, and safe inside an sbatch `--comment`."""
    return TOKEN_PREFIX + secrets.token_hex(16)


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
        lineage = get_row(session, Lineage, intent.lineage_id)
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
    action = get_row(session, Action, action_id)
    if action.result != ActionResult.PENDING.value:
        raise IntentError(f"action {action_id} already finished ({action.result})")
    action.exit_code = exit_code
    action.stdout = stdout
    action.stderr = stderr
    action.finished_at = utc_now()
    action.result = (ActionResult.SUCCEEDED if succeeded else ActionResult.FAILED).value
    session.flush()
    return action
