"""Repository functions the daemon's loop needs beyond `repository`: which job belongs to
which lineage and revision, which jobs were already handled, what was done in the last hour.

Kept as audit events and existing columns, so the schema is unchanged: a submission is an
audit event on the job (`lineage_submit`), a handled job one more (`job_handled`), a record of
the poll's window that could not be read one more (`slurm_record_rejected`). All are
append-only, which is what a record of "this happened" should be.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from daemon.slurm.records import RejectedRecord, printable
from daemon.store.models import (
    Action,
    ActionKind,
    ActionResult,
    AuditEvent,
    Incident,
    Lineage,
    NodeEvent,
    NodeEventKind,
    Proposal,
    TemplateRevision,
)
from daemon.store.repository import Actor, append_audit

VERB_SUBMIT = "lineage_submit"
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


def record_lineage_submission(
    session: Session,
    *,
    slurm_job_id: int,
    lineage_id: int,
    attempt: int,
    revision_id: int,
    proposal_id: int | None,
    token: str,
    actor: Actor,
) -> None:
    """Say which lineage, attempt and revision a submitted job runs (flushes, no commit)."""
    lineage = session.get(Lineage, lineage_id)
    if lineage is not None:
        lineage.attempts = max(lineage.attempts, attempt)
    append_audit(
        session,
        actor=actor,
        verb=VERB_SUBMIT,
        subject_type="job",
        subject_id=slurm_job_id,
        details={
            "lineage": lineage_id,
            "attempt": attempt,
            "revision": revision_id,
            "proposal": proposal_id,
            "token": token,
        },
    )
    session.flush()


def lineage_submission(session: Session, *, slurm_job_id: int) -> LineageSubmission | None:
    """The submission record of a job, from its audit event or, after a crash that lost the
    event, from the relaunch the proposal recorded (`relaunch_job_id`)."""
    event = session.scalars(
        select(AuditEvent)
        .where(
            AuditEvent.subject_type == "job",
            AuditEvent.subject_id == str(slurm_job_id),
            AuditEvent.verb == VERB_SUBMIT,
        )
        .order_by(AuditEvent.id)
        .limit(1)
    ).one_or_none()
    if event is not None:
        details: Mapping[str, Any] = event.details
        return LineageSubmission(
            slurm_job_id=slurm_job_id,
            lineage_id=int(details["lineage"]),
            attempt=int(details["attempt"]),
            revision_id=int(details["revision"]),
            proposal_id=None if details.get("proposal") is None else int(details["proposal"]),
            token=str(details.get("token", "")),
        )
    proposal = session.scalars(
        select(Proposal).where(Proposal.relaunch_job_id == slurm_job_id).limit(1)
    ).one_or_none()
    if proposal is None or proposal.lineage_id is None:
        return None
    revision = session.scalars(
        select(TemplateRevision).where(TemplateRevision.proposal_id == proposal.id).limit(1)
    ).one_or_none()
    if revision is None:
        return None
    lineage = session.get(Lineage, proposal.lineage_id)
    action = session.scalars(
        select(Action).where(Action.slurm_job_id == slurm_job_id).limit(1)
    ).one_or_none()
    return LineageSubmission(
        slurm_job_id=slurm_job_id,
        lineage_id=proposal.lineage_id,
        attempt=(lineage.attempts + 1) if lineage is not None else 1,
        revision_id=revision.id,
        proposal_id=proposal.id,
        token=action.token if action is not None else "",
    )


def lineage_job_ids(session: Session, *, active_only: bool = True) -> dict[int, int]:
    """Slurm job id -> lineage id for every job slurm-medic submitted (active lineages only)."""
    events = session.scalars(
        select(AuditEvent).where(AuditEvent.verb == VERB_SUBMIT, AuditEvent.subject_type == "job")
    )
    result = {int(event.subject_id): int(event.details["lineage"]) for event in events}
    # A relaunch whose submission event a crash lost is still known by its proposal.
    relaunched = session.execute(
        select(Proposal.relaunch_job_id, Proposal.lineage_id).where(
            Proposal.relaunch_job_id.is_not(None), Proposal.lineage_id.is_not(None)
        )
    ).tuples()
    for job_id, lineage_id in relaunched:
        if job_id is not None and lineage_id is not None:
            result.setdefault(int(job_id), int(lineage_id))
    if not active_only or not result:
        return result
    active = set(session.scalars(select(Lineage.id).where(Lineage.status == "active")).all())
    return {job: lineage for job, lineage in result.items() if lineage in active}


def handled_job_ids(session: Session, *, slurm_job_ids: Iterable[int]) -> set[int]:
    """Which of these jobs were already handled (so a poll window's overlap repeats nothing)."""
    wanted = [str(job_id) for job_id in slurm_job_ids]
    if not wanted:
        return set()
    found: set[int] = set()
    for start in range(0, len(wanted), 500):
        chunk = wanted[start : start + 500]
        found.update(
            int(subject)
            for subject in session.scalars(
                select(AuditEvent.subject_id).where(
                    AuditEvent.subject_type == "job",
                    AuditEvent.subject_id.in_(chunk),
                    AuditEvent.verb == VERB_HANDLED,
                )
            )
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


VERB_LINEAGE_INTENT = "submit_intent"
VERB_LINEAGE_INTENT_CLOSED = "submit_intent_closed"


@dataclass(frozen=True)
class LineageIntent:
    """`slurm-medic submit`'s intent, committed before its sbatch ran."""

    lineage_id: int
    revision_id: int
    token: str
    at: datetime


def open_lineage_intents(session: Session, *, since: datetime) -> list[LineageIntent]:
    """First submissions since `since` whose sbatch answer never reached the record (the CLI
    died): neither a `lineage_submit` with their token nor a closing or failure event."""
    intents = session.scalars(
        select(AuditEvent).where(
            AuditEvent.verb == VERB_LINEAGE_INTENT,
            AuditEvent.subject_type == "lineage",
            AuditEvent.at >= since,
        )
    ).all()
    if not intents:
        return []
    closing = session.scalars(
        select(AuditEvent).where(
            AuditEvent.verb.in_([VERB_SUBMIT, VERB_LINEAGE_INTENT_CLOSED, "submit_failed"]),
            AuditEvent.at >= since,
        )
    ).all()
    done_tokens = {str(event.details.get("token", "")) for event in closing}
    failed_lineages = {event.subject_id for event in closing if event.verb == "submit_failed"}
    return [
        LineageIntent(
            lineage_id=int(event.subject_id),
            revision_id=int(event.details["revision"]),
            token=str(event.details["token"]),
            at=event.at,
        )
        for event in intents
        if str(event.details.get("token")) not in done_tokens
        and event.subject_id not in failed_lineages
    ]


def close_lineage_intent(
    session: Session, *, intent: LineageIntent, found_job_id: int | None, actor: Actor
) -> None:
    """Tie a found job to its lineage, or record that sbatch never made one."""
    if found_job_id is not None:
        record_lineage_submission(
            session,
            slurm_job_id=found_job_id,
            lineage_id=intent.lineage_id,
            attempt=1,
            revision_id=intent.revision_id,
            proposal_id=None,
            token=intent.token,
            actor=actor,
        )
        return
    append_audit(
        session,
        actor=actor,
        verb=VERB_LINEAGE_INTENT_CLOSED,
        subject_type="lineage",
        subject_id=intent.lineage_id,
        details={"token": intent.token, "found": None},
    )
    session.flush()
