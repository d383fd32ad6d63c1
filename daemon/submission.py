"""Exactly once, for every sbatch slurm-medic makes: a first submission and a relaunch alike.

The protocol: the intent (an sbatch action row with a fresh token, its lineage, revision and
attempt) is committed before sbatch runs; sbatch carries the token in the job's comment; the
answer closes the intent (submitted with the job id, or failed with sbatch's words). A
process killed in between leaves the intent open, and `reconcile` closes it: found when a job
of the lineage's owner carries the token (slurmctld's queue, then accounting), else declared
never submitted once settled. The rows are the state; the audit events the story.
"""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.slurm.backend import SlurmBackend
from daemon.slurm.errors import SubmissionError
from daemon.slurm.records import JobState, QueuedJob, SlurmJob
from daemon.slurm.sbatch import SubmitRequest, sbatch_argv, submitter_ids
from daemon.store import action_rows
from daemon.store import repository as repo
from daemon.store.models import AuditEvent, Lineage
from daemon.store.service_records import carries_token

log = logging.getLogger(__name__)

# How long before its intent a submission is looked for in accounting (clocks differ).
TOKEN_LOOKBACK = timedelta(minutes=5)
VERB_FOREIGN_TOKEN = "token_on_foreign_job"  # noqa: S105 (an audit verb, not a secret)
# Every state sacct's --state accepts (22.05 refuses COMPLETING and SPECIAL_EXIT with a fatal
# error): a reconciliation must find its job whatever became of it.
ACCOUNTED_STATES = tuple(
    state
    for state in JobState
    if state not in (JobState.COMPLETING, JobState.SPECIAL_EXIT, JobState.UNKNOWN)
)


@dataclass(frozen=True)
class Sbatch:
    """What to submit, and as whom."""

    script: str
    owner: str
    work_dir: str | None
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class SubmitOutcome:
    """How one submission ended: a job id, or the error (the intent left open for
    reconciliation when sbatch may have submitted all the same)."""

    intent: action_rows.SubmitIntent
    job_id: int | None = None
    error: SubmissionError | None = None


@dataclass(frozen=True)
class Reconciled:
    """An open intent closed by reconciliation: the job found, or None (never submitted)."""

    action_id: int
    lineage_id: int | None
    proposal_id: int | None
    job_id: int | None
    recorded_at: datetime


def submit_once(
    session: Session,
    backend: SlurmBackend,
    job: Sbatch,
    *,
    actor: repo.Actor,
    proposal_id: int | None = None,
    lineage_id: int | None = None,
    revision_id: int | None = None,
) -> SubmitOutcome:
    """Intent, sbatch, answer. A relaunch names its proposal, a first submission its lineage
    and revision (`action_rows.record_submit_intent`). Commits each step."""
    uid, gid = _identity(job.owner)
    intent = action_rows.record_submit_intent(
        session,
        proposal_id=proposal_id,
        lineage_id=lineage_id,
        revision_id=revision_id,
        build_argv=lambda token: sbatch_argv(
            SubmitRequest(
                comment=token, exclude_nodes=job.exclude, uid=uid, gid=gid, work_dir=job.work_dir
            )
        ),
        actor=actor,
    )
    try:
        job_id = backend.submit(
            job.script,
            as_user=job.owner,
            comment=intent.token,
            exclude_nodes=job.exclude,
            work_dir=job.work_dir,
        )
    except SubmissionError as error:
        if error.maybe_submitted:
            log.warning(
                "sbatch may have submitted; reconciliation will look for the token",
                extra={"fields": {"action": intent.action_id, "token": intent.token}},
            )
            return SubmitOutcome(intent, error=error)
        action_rows.record_submit_failed(
            session,
            intent=intent,
            exit_code=error.returncode,
            stdout="",
            stderr=error.stderr or str(error),
            actor=actor,
        )
        return SubmitOutcome(intent, error=error)
    action_rows.record_submitted(session, intent=intent, slurm_job_id=job_id, actor=actor)
    return SubmitOutcome(intent, job_id=job_id)


@dataclass(frozen=True)
class FirstSubmission:
    """`slurm-medic submit`'s new lineage and how its first job's submission ended."""

    lineage_id: int
    outcome: SubmitOutcome


def submit_new_lineage(
    session: Session,
    backend: SlurmBackend,
    job: Sbatch,
    *,
    name: str,
    template_dir: str,
    knobs: Mapping[str, Any],
    actor: repo.Actor,
) -> FirstSubmission:
    """A new lineage and its first revision (`job.script`), submitted by the one protocol."""
    lineage = repo.create_lineage(session, name=name, owner=job.owner, template=template_dir)
    lineage_id = lineage.id
    revision = repo.record_template_revision(
        session, lineage_id=lineage_id, knobs=knobs, rendered_script=job.script
    )
    outcome = submit_once(
        session, backend, job, actor=actor, lineage_id=lineage_id, revision_id=revision.id
    )
    return FirstSubmission(lineage_id, outcome)


def _identity(user: str) -> tuple[int | None, int | None]:
    """The ids the backend's sbatch argv carries for `user` from this process (`submitter_ids`)."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None, None
    return submitter_ids(entry, os.geteuid())


# ----------------------------------------------------------------------------- reconciling


@dataclass(frozen=True)
class TokenSearch:
    """Where Slurm shows a token: the owner's job carrying it, and other users' jobs that
    carry it too (a copied token: ignored, and noted)."""

    found: int | None
    foreign: tuple[tuple[int, str], ...] = ()


class CommentLookup:
    """Job comments as Slurm shows them, asked at most once per reconciliation however many
    intents it closes: slurmctld's queue (one squeue) and, only when the queue lacks an
    owner's job, accounting since the earliest intent (one sacct)."""

    def __init__(self, backend: SlurmBackend, *, since: datetime, until: datetime) -> None:
        self._backend = backend
        self._since = since
        self._until = until
        self._queued: tuple[QueuedJob, ...] | None = None
        self._accounted: tuple[SlurmJob, ...] | None = None

    def search(self, token: str, owner: str | None) -> TokenSearch:
        """The owner's job whose comment carries the token. Slurm 22.05 accounting stores a
        job's comment only when the job ends, so a live job is found in slurmctld's queue
        (which also keeps ended jobs for MinJobAge), an older one in accounting.

        Comments are visible to every user (squeue), so anyone may copy a token into a job of
        their own: only a job of the lineage's owner counts (no owner known, none does)."""
        if self._queued is None:
            self._queued = self._backend.queued_jobs()
        carrying = [
            (job.job_id, job.user) for job in self._queued if carries_token(job.comment, token)
        ]
        if not any(user == owner for _job_id, user in carrying):
            if self._accounted is None:
                self._accounted = self._backend.finished_jobs(
                    self._since, self._until, states=ACCOUNTED_STATES
                )
            carrying += [
                (job.job_id, job.user)
                for job in self._accounted
                if carries_token(job.comment, token)
            ]
        carrying = list(dict.fromkeys(carrying))
        found = next((job_id for job_id, user in carrying if user == owner), None)
        foreign = tuple((job_id, user) for job_id, user in carrying if user != owner)
        return TokenSearch(found, foreign)


def reconcile(
    session: Session,
    backend: SlurmBackend,
    *,
    now: datetime,
    settle: timedelta,
    actor: repo.Actor,
) -> list[Reconciled]:
    """Close every open intent Slurm can answer for: found by its token on a job of the
    lineage's owner, or, once older than `settle` (younger, "never submitted" cannot be told
    from "not in accounting yet"), not submitted.

    A relaunch's intent is the leader's own, left by a crash: a job found closes it at once,
    and its proposal stays `submitting` until then, so nothing else acts on it. A first
    submission's intent belongs to `slurm-medic submit`, which may still be between sbatch and
    its own answer: it is looked for only once settled.
    """
    intents = [
        intent
        for intent in action_rows.pending_intents(session)
        if intent.proposal_id is not None or now - intent.recorded_at >= settle
    ]
    if not intents:
        return []
    comments = CommentLookup(
        backend, since=min(intent.recorded_at for intent in intents) - TOKEN_LOOKBACK, until=now
    )
    closed: list[Reconciled] = []
    for intent in intents:
        lineage = session.get(Lineage, intent.lineage_id) if intent.lineage_id else None
        owner = lineage.owner if lineage is not None else None
        search = comments.search(intent.token, owner)
        _note_foreign(session, search, subject=_subject(intent), owner=owner, actor=actor)
        if search.found is None and now - intent.recorded_at < settle:
            session.commit()
            continue
        action_rows.reconcile_intent(session, intent=intent, found_job_id=search.found, actor=actor)
        closed.append(
            Reconciled(
                intent.action_id,
                intent.lineage_id,
                intent.proposal_id,
                search.found,
                intent.recorded_at,
            )
        )
        log.info(
            "reconciled intent",
            extra={"fields": {"action": intent.action_id, "job": search.found}},
        )
    return closed


def _subject(intent: action_rows.SubmitIntent) -> tuple[str, int | None]:
    """What a foreign token is noted on: the relaunch's proposal, or the first submission's
    lineage."""
    if intent.proposal_id is not None:
        return "proposal", intent.proposal_id
    return "lineage", intent.lineage_id


def _note_foreign(
    session: Session,
    search: TokenSearch,
    *,
    subject: tuple[str, int | None],
    owner: str | None,
    actor: repo.Actor,
) -> None:
    """A job of someone else carrying a lineage's token: ignored, and on the record (once:
    reconciliation asks again every cycle until the intent settles)."""
    if not search.foreign:
        return
    noted = {
        event.details.get("job")
        for event in session.scalars(
            select(AuditEvent).where(
                AuditEvent.verb == VERB_FOREIGN_TOKEN,
                AuditEvent.subject_type == subject[0],
                AuditEvent.subject_id == str(subject[1]),
            )
        )
    }
    for job_id, user in search.foreign:
        if job_id in noted:
            continue
        log.warning(
            "a job of another user carries a lineage token; ignored",
            extra={"fields": {"job": job_id, "user": user, "owner": owner}},
        )
        repo.append_audit(
            session,
            actor=actor,
            verb=VERB_FOREIGN_TOKEN,
            subject_type=subject[0],
            subject_id=subject[1],
            details={"job": job_id, "user": user, "owner": owner},
        )
    session.flush()
