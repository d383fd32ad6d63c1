"""Repository functions the daemon's loop needs beyond `repository`: which job belongs to
which lineage and revision, which jobs were already handled, what was done in the last hour.

Which run a job is lives in its submission's sbatch action row (lineage, revision, attempt;
written by `daemon.submission` for first submissions and relaunches alike). A handled job is
an append-only audit event (`job_handled`), asked for only by the poll window's job ids, and
so is a record of the window that could not be read (`slurm_record_rejected`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from daemon.fleet.findings import CORDON_FINDING
from daemon.slurm.records import RejectedRecord, printable
from daemon.store.models import (
    Action,
    ActionKind,
    ActionResult,
    AuditEvent,
    Incident,
    Lineage,
    LineageStatus,
    NodeEvent,
    NodeEventKind,
    Proposal,
)
from daemon.store.repository import Actor, append_audit

VERB_HANDLED = "job_handled"
VERB_REJECTED = "slurm_record_rejected"
# The subject of a rejected record whose job id could not be read: a digest of its text.
SUBJECT_UNREADABLE = "slurm_record"


@dataclass(frozen=True)
class LineageSubmission:
    """A Slurm job slurm-medic submitted: its lineage, attempt number, revision, proposal."""

    slurm_job_id: int
    lineage_id: int
    attempt: int
    revision_id: int
    proposal_id: int | None
    token: str


# An sbatch action that made a job of a lineage (its intent closed as submitted).
_SUBMITTED = (
    Action.kind == ActionKind.SBATCH.value,
    Action.slurm_job_id.is_not(None),
    Action.lineage_id.is_not(None),
)


def carries_token(comment: str | None, token: str) -> bool:
    """The token is one whole field of the comment (fields split on white space), never a
    part of a longer word: `xmedic-ab` or `medic-abc` does not carry `medic-ab`."""
    return bool(token) and comment is not None and token in comment.split()


def lineage_submission(
    session: Session, *, slurm_job_id: int, user: str, comment: str | None
) -> LineageSubmission | None:
    """Which lineage, attempt and revision a job slurm-medic submitted runs; None: not ours.

    Slurm reuses job ids (a controller started afresh, ids wrapping at MaxJobId), so the id
    only finds candidates: the job joins a lineage only as that lineage's owner, and, where
    accounting keeps the job's comment (`AccountingStoreFlags=job_comment`), only carrying the
    token its submission put there. Another user's job under a reused id joins nothing, so
    they can neither approve nor steer that lineage's relaunch."""
    candidates = session.execute(
        select(Action, Lineage.owner)
        .join(Lineage, Lineage.id == Action.lineage_id)
        .where(*_SUBMITTED, Action.slurm_job_id == slurm_job_id)
        .order_by(Action.id)
    ).tuples()
    action = next(
        (
            row
            for row, owner in candidates
            if owner == user and (not comment or carries_token(comment, row.token))
        ),
        None,
    )
    if action is None or action.lineage_id is None or action.revision_id is None:
        return None
    return LineageSubmission(
        slurm_job_id=slurm_job_id,
        lineage_id=action.lineage_id,
        attempt=action.attempt or 1,
        revision_id=action.revision_id,
        proposal_id=action.proposal_id,
        token=action.token,
    )


def lineage_job_ids(session: Session, *, active_only: bool = True) -> dict[int, int]:
    """Slurm job id -> lineage id for every job slurm-medic submitted (active lineages only)."""
    query = select(Action.slurm_job_id, Action.lineage_id).where(*_SUBMITTED)
    if active_only:
        query = query.join(Lineage, Lineage.id == Action.lineage_id).where(
            Lineage.status == LineageStatus.ACTIVE.value
        )
    return {
        int(job_id): int(lineage_id)
        for job_id, lineage_id in session.execute(query).tuples()
        if job_id is not None and lineage_id is not None
    }


def handled_job_ids(session: Session, *, slurm_job_ids: Iterable[int]) -> set[int]:
    """Which of these jobs were already handled (so a poll window's overlap repeats nothing)."""
    return _jobs_with(session, slurm_job_ids, VERB_HANDLED)


def rejected_job_ids(session: Session, *, slurm_job_ids: Iterable[int]) -> set[int]:
    """Which of these jobs have a record accounting holds but no parser could read (on the
    record once, with its text, and skipped)."""
    return _jobs_with(session, slurm_job_ids, VERB_REJECTED)


def _jobs_with(session: Session, slurm_job_ids: Iterable[int], verb: str) -> set[int]:
    wanted = [str(job_id) for job_id in slurm_job_ids]
    found: set[int] = set()
    for start in range(0, len(wanted), 500):
        chunk = wanted[start : start + 500]
        found.update(
            int(subject)
            for subject in session.scalars(
                select(AuditEvent.subject_id).where(
                    AuditEvent.subject_type == "job",
                    AuditEvent.subject_id.in_(chunk),
                    AuditEvent.verb == verb,
                )
            )
            if subject.isdigit()
        )
    return found


def mark_job_handled(
    session: Session, *, slurm_job_id: int, actor: Actor, outcome: str, details: Mapping[str, Any]
) -> None:
    append_audit(
        session,
        actor=actor,
        verb=VERB_HANDLED,
        subject_type="job",
        subject_id=slurm_job_id,
        details={"outcome": outcome, **details},
    )
    session.flush()


def record_rejected_records(
    session: Session,
    *,
    rejected: Iterable[RejectedRecord],
    actor: Actor,
    window: tuple[datetime, datetime],
) -> int:
    """Put each record a poll could not read on the record, once: on its job when the id was
    readable, else on a digest of its text, so the overlap of the next window (which reads
    it again) adds nothing. The new events' count (flushes, no commit).

    Find them with `SELECT * FROM audit_event WHERE verb = 'slurm_record_rejected'`.
    """
    added = 0
    for record in rejected:
        subject_type, subject_id = _rejected_subject(record)
        known = session.scalars(
            select(AuditEvent.id)
            .where(
                AuditEvent.verb == VERB_REJECTED,
                AuditEvent.subject_type == subject_type,
                AuditEvent.subject_id == subject_id,
            )
            .limit(1)
        ).one_or_none()
        if known is not None:
            continue
        append_audit(
            session,
            actor=actor,
            verb=VERB_REJECTED,
            subject_type=subject_type,
            subject_id=subject_id,
            details={
                "source": record.source,
                "reason": record.reason,
                "raw": record.raw or printable(record.excerpt),
                "raw_chars": record.raw_chars,
                "window": [window[0].isoformat(), window[1].isoformat()],
            },
        )
        session.flush()
        added += 1
    return added


def _rejected_subject(record: RejectedRecord) -> tuple[str, str]:
    if record.record_id is not None:
        return "job", record.record_id
    text = f"{record.source}\n{record.raw or record.excerpt}"
    return SUBJECT_UNREADABLE, hashlib.sha256(text.encode()).hexdigest()[:32]


def relaunches_since(session: Session, *, since: datetime, owner: str | None = None) -> int:
    """Relaunches submitted (or possibly submitted) since `since`, optionally one owner's."""
    query = (
        select(func.count())
        .select_from(Action)
        .where(
            Action.kind == ActionKind.SBATCH.value,
            Action.proposal_id.is_not(None),  # a first submission is no relaunch
            Action.started_at >= since,
            Action.result.in_([ActionResult.SUCCEEDED.value, ActionResult.PENDING.value]),
        )
    )
    if owner is not None:
        query = (
            query.join(Proposal, Proposal.id == Action.proposal_id)
            .join(Lineage, Lineage.id == Proposal.lineage_id)
            .where(Lineage.owner == owner)
        )
    return int(session.scalar(query) or 0)


def drains_since(session: Session, *, since: datetime) -> int:
    query = (
        select(func.count())
        .select_from(NodeEvent)
        .where(
            NodeEvent.kind == NodeEventKind.DRAIN.value,
            NodeEvent.by_medic.is_(True),
            NodeEvent.occurred_at >= since,
            # A person's cordon is theirs to make: the breaker bounds the daemon's drains.
            or_(NodeEvent.finding.is_(None), NodeEvent.finding != CORDON_FINDING),
        )
    )
    return int(session.scalar(query) or 0)


def proposals_in(session: Session, *, states: Iterable[str]) -> list[Proposal]:
    return list(
        session.scalars(
            select(Proposal).where(Proposal.state.in_(list(states))).order_by(Proposal.id)
        )
    )


def lineage_incidents(session: Session, *, lineage_id: int) -> list[Incident]:
    return list(
        session.scalars(
            select(Incident).where(Incident.lineage_id == lineage_id).order_by(Incident.id)
        )
    )


def lineage_proposals(session: Session, *, lineage_id: int) -> list[Proposal]:
    return list(
        session.scalars(
            select(Proposal).where(Proposal.lineage_id == lineage_id).order_by(Proposal.id)
        )
    )


def stale_proposals(session: Session, *, older_than: timedelta, now: datetime) -> list[Proposal]:
    return list(
        session.scalars(
            select(Proposal).where(
                Proposal.state == "proposed", Proposal.created_at < now - older_than
            )
        )
    )
