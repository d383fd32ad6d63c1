"""The outbox in the record: what happened since the `notify` cursor becomes `Notification` rows.

The pipeline's stages are not touched; what they already record is read back. A proposal that
waits for a person is its `awaiting_approval` audit event; a run given up is a `lineage_status`
event to exhausted or abandoned; an escalation is a `proposal_failed` event on a proposal whose
relaunch `verify` judged `same_failure` or `different_failure`; a drain is a `NodeEvent` drain
slurm-medic made (an incident's or a sweep's; a person's cordon is their own doing). Each message
is one row per channel and recipient, keyed by the unique `dedupe`: reading the same events
twice (the cursor's overlap, a restart, two daemons) adds nothing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from daemon.fleet.findings import CORDON_FINDING
from daemon.notify.messages import (
    Fact,
    JobFacts,
    Message,
    NodeDrained,
    RunEscalated,
    RunGivenUp,
    WaitingApproval,
    mail_body,
    mail_subject,
    message_for,
    webhook_text,
)
from daemon.notify.settings import ADDRESS, NotifySettings
from daemon.planner import Outcome
from daemon.store import control
from daemon.store.models import (
    AuditEvent,
    Incident,
    Job,
    Lineage,
    LineageStatus,
    NodeEvent,
    NodeEventKind,
    Notification,
    NotificationChannel,
    NotificationEvent,
    NotificationState,
    Proposal,
)
from daemon.store.states import ProposalState

log = logging.getLogger(__name__)

NOTIFY_CURSOR = "notify"
# The webhook's recipient on the record: the URL itself is a secret and stays in its file.
WEBHOOK_RECIPIENT = "webhook"
# Events read per look: far above what a cluster records in an overlap window.
MAX_EVENTS_PER_LOOK = 5000
# Dedupe keys asked for in one query: far below SQLite's and PostgreSQL's bound parameters.
KEYS_PER_QUERY = 500
MAX_MAIL_MAP_BYTES = 1024 * 1024
_VERBS = ("awaiting_approval", "lineage_status", "proposal_failed")
_GIVEN_UP = frozenset({LineageStatus.EXHAUSTED.value, LineageStatus.ABANDONED.value})
_ESCALATED = frozenset({Outcome.SAME_FAILURE.value, Outcome.DIFFERENT_FAILURE.value})
_MAP_LINE = re.compile(r"\A(?P<user>[A-Za-z0-9_.@-]{1,64})\s*:\s*(?P<address>\S+)\Z")


class NotifyConfigError(ValueError):
    """A file the `[notify]` section names cannot be used (the daemon refuses to start)."""


# ----------------------------------------------------------------------------- addresses


@dataclass(frozen=True)
class AddressBook:
    """Who gets a user's mail: the mail map's address, else `user@domain`; admins for nodes.

    The job's `--mail-user` is not in the record: Slurm's accounting (`sacct`) does not keep
    it, so the owner's address comes from the site's config.
    """

    domain: str | None = None
    mapped: Mapping[str, str] | None = None
    admins: tuple[str, ...] = ()

    def owner_address(self, user: str) -> str | None:
        if self.mapped and user in self.mapped:
            return self.mapped[user]
        if self.domain is None:
            return None
        address = f"{user}@{self.domain}"
        return address if ADDRESS.match(address) else None

    def mail_to(self, owner: str | None) -> tuple[str, ...]:
        """A job's message goes to its owner; a node's to the admins."""
        if owner is None:
            return self.admins
        address = self.owner_address(owner)
        return () if address is None else (address,)


def parse_mail_map(text: str, *, source: str) -> dict[str, str]:
    """`user: address` lines (as /etc/aliases writes them); `#` starts a comment."""
    mapped: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _MAP_LINE.match(line)
        if match is None or not ADDRESS.match(match["address"]):
            raise NotifyConfigError(f"{source}:{number}: not `user: address`")
        mapped[match["user"]] = match["address"]
    return mapped


def address_book(settings: NotifySettings) -> AddressBook:
    """Read the mail map once, at start-up (a restart reads a changed one)."""
    mapped: dict[str, str] = {}
    if settings.mail_map is not None:
        try:
            with settings.mail_map.open("rb") as handle:
                raw = handle.read(MAX_MAIL_MAP_BYTES + 1)
        except OSError as error:
            raise NotifyConfigError(f"mail_map {settings.mail_map}: {error.strerror}") from error
        if len(raw) > MAX_MAIL_MAP_BYTES:
            raise NotifyConfigError(f"mail_map {settings.mail_map} is over 1 MiB")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise NotifyConfigError(f"mail_map {settings.mail_map} is not UTF-8") from error
        mapped = parse_mail_map(text, source=str(settings.mail_map))
    return AddressBook(settings.mail_domain, mapped, settings.admin_mail)


# ----------------------------------------------------------------------------- addressing


@dataclass(frozen=True)
class Outgoing:
    """One row to add: a message rendered for one channel and one recipient."""

    event: NotificationEvent
    subject: str
    channel: NotificationChannel
    recipient: str
    title: str
    body: str

    @property
    def dedupe(self) -> str:
        return dedupe_key(self.event, self.subject, self.channel, self.recipient)


def dedupe_key(
    event: NotificationEvent, subject: str, channel: NotificationChannel, recipient: str
) -> str:
    return f"{event.value}|{subject}|{channel.value}|{recipient}"


def addressed(message: Message, *, settings: NotifySettings, book: AddressBook) -> list[Outgoing]:
    """Every row a message makes: mail to each recipient, and the webhook's one."""
    subject = mail_subject(message)
    rows: list[Outgoing] = []
    if settings.mail:
        body = mail_body(message)
        for address in book.mail_to(message.owner):
            rows.append(
                Outgoing(
                    message.event,
                    message.subject,
                    NotificationChannel.MAIL,
                    address,
                    subject,
                    body,
                )
            )
    if settings.webhook:
        rows.append(
            Outgoing(
                message.event,
                message.subject,
                NotificationChannel.WEBHOOK,
                WEBHOOK_RECIPIENT,
                subject,
                webhook_text(message),
            )
        )
    return rows


# ----------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Enqueued:
    """What one look at the record did."""

    seen: int  # facts found in the window
    added: int  # rows new to the outbox
    cursor: datetime | None


def enqueue(
    session: Session, *, settings: NotifySettings, book: AddressBook, now: datetime
) -> Enqueued:
    """Find what happened since the cursor and add its rows; the cursor moves to the newest
    event read. The caller commits."""
    cursor = control.get_cursor(session, name=NOTIFY_CURSOR)
    if cursor is None:
        since = now - timedelta(seconds=settings.initial_lookback_s)
    else:
        since = cursor - timedelta(seconds=settings.overlap_s)
    found = find_facts(session, since=since, events=frozenset(settings.events))
    outgoing = [
        row
        for _at, fact in found
        for row in addressed(
            message_for(fact, web_url=settings.web_url), settings=settings, book=book
        )
    ]
    added = _add_new(session, outgoing)
    newest = max((at for at, _fact in found), default=None)
    if newest is not None and (cursor is None or newest > cursor):
        control.set_cursor(session, name=NOTIFY_CURSOR, polled_until=newest)
        cursor = newest
    return Enqueued(len(found), added, cursor)


def _add_new(session: Session, outgoing: list[Outgoing]) -> int:
    """The rows whose dedupe the record lacks."""
    keys = [row.dedupe for row in outgoing]
    known: set[str] = set()
    for start in range(0, len(keys), KEYS_PER_QUERY):
        chunk = keys[start : start + KEYS_PER_QUERY]
        known.update(
            session.scalars(select(Notification.dedupe).where(Notification.dedupe.in_(chunk)))
        )
    new = {row.dedupe: row for row in outgoing if row.dedupe not in known}
    return insert_rows(session, list(new.values()))


def insert_rows(session: Session, new: list[Outgoing]) -> int:
    """Add rows in one savepoint; if another daemon added one of them meanwhile (the unique
    key refuses the batch), one savepoint each, skipping those. How many were added."""
    try:
        with session.begin_nested():
            session.add_all(_row(item) for item in new)
        return len(new)
    except IntegrityError:
        pass
    added = 0
    for item in new:
        try:
            with session.begin_nested():
                session.add(_row(item))
        except IntegrityError:
            continue
        added += 1
    return added


def _row(item: Outgoing) -> Notification:
    return Notification(
        event=item.event.value,
        subject=item.subject,
        channel=item.channel.value,
        recipient=item.recipient,
        dedupe=item.dedupe,
        title=item.title,
        body=item.body,
        state=NotificationState.PENDING.value,
        attempts=0,
    )


def find_facts(
    session: Session, *, since: datetime, events: frozenset[NotificationEvent]
) -> list[tuple[datetime, Fact]]:
    """Every fact to tell recorded after `since`, oldest first, with when it was recorded."""
    found: list[tuple[datetime, Fact]] = []
    audits = session.scalars(
        select(AuditEvent)
        .where(AuditEvent.at > since, AuditEvent.verb.in_(_VERBS))
        .order_by(AuditEvent.at, AuditEvent.id)
        .limit(MAX_EVENTS_PER_LOOK)
    )
    for audit in audits:
        fact = _audit_fact(session, audit, events)
        if fact is not None:
            found.append((audit.at, fact))
    if NotificationEvent.NODE_DRAINED in events:
        drains = session.scalars(
            select(NodeEvent)
            .where(
                NodeEvent.occurred_at > since,
                NodeEvent.kind == NodeEventKind.DRAIN.value,
                NodeEvent.by_medic.is_(True),
                or_(NodeEvent.finding.is_(None), NodeEvent.finding != CORDON_FINDING),
            )
            .order_by(NodeEvent.occurred_at, NodeEvent.id)
            .limit(MAX_EVENTS_PER_LOOK)
        )
        for drain in drains:
            found.append((drain.occurred_at, _drained(session, drain)))
    found.sort(key=lambda pair: pair[0])
    return found


def _audit_fact(
    session: Session, audit: AuditEvent, events: frozenset[NotificationEvent]
) -> Fact | None:
    if audit.subject_type == "proposal" and audit.verb == "awaiting_approval":
        if NotificationEvent.APPROVAL_WAITING not in events:
            return None
        return _waiting(session, int(audit.subject_id))
    if audit.subject_type == "proposal" and audit.verb == "proposal_failed":
        if NotificationEvent.RUN_ESCALATED not in events:
            return None
        return _escalated(session, int(audit.subject_id), _reason(audit))
    if audit.subject_type == "lineage" and audit.verb == "lineage_status":
        if NotificationEvent.RUN_GIVEN_UP not in events:
            return None
        if audit.details.get("to") not in _GIVEN_UP:
            return None
        return _given_up(session, int(audit.subject_id), str(audit.details["to"]), _reason(audit))
    return None


def _reason(audit: AuditEvent) -> str:
    reason = audit.details.get("reason")
    return reason if isinstance(reason, str) else ""


def _job_facts(session: Session, incident: Incident) -> JobFacts:
    job = session.get(Job, incident.job_id)
    return JobFacts(
        slurm_job_id=incident.slurm_job_id,
        name=job.name if job is not None else "",
        user=incident.user_name,
        kind=incident.kind,
        lineage_id=incident.lineage_id,
    )


def _waiting(session: Session, proposal_id: int) -> WaitingApproval | None:
    """Only while it still waits: one decided before the look is nobody's to approve."""
    proposal = session.get(Proposal, proposal_id)
    if proposal is None or proposal.state != ProposalState.PROPOSED.value:
        return None
    incident = session.get(Incident, proposal.incident_id)
    if incident is None:
        return None
    return WaitingApproval(
        proposal_id=proposal.id,
        job=_job_facts(session, incident),
        remediator=proposal.remediator,
        rung=proposal.rung,
        rationale=proposal.rationale,
        changes_science=proposal.changes_science,
    )


def _escalated(session: Session, proposal_id: int, reason: str) -> RunEscalated | None:
    proposal = session.get(Proposal, proposal_id)
    if proposal is None or proposal.outcome not in _ESCALATED:
        return None  # failed before any relaunch ran (a refused submission): not an escalation
    incident = session.get(Incident, proposal.incident_id)
    if incident is None:
        return None
    relaunch_kind: str | None = None
    if proposal.relaunch_job_id is not None:
        relaunch_kind = session.scalars(
            select(Incident.kind)
            .where(Incident.slurm_job_id == proposal.relaunch_job_id)
            .order_by(Incident.id.desc())
            .limit(1)
        ).first()
    return RunEscalated(
        proposal_id=proposal.id,
        job=_job_facts(session, incident),
        relaunch_job_id=proposal.relaunch_job_id,
        relaunch_kind=relaunch_kind,
        outcome=proposal.outcome,
        failing_step=proposal.failing_step,
        step_reached=proposal.step_reached,
        reason=reason,
    )


def _given_up(session: Session, lineage_id: int, status: str, reason: str) -> RunGivenUp | None:
    lineage = session.get(Lineage, lineage_id)
    if lineage is None:
        return None
    last = session.scalars(
        select(Incident)
        .where(Incident.lineage_id == lineage_id)
        .order_by(Incident.id.desc())
        .limit(1)
    ).first()
    return RunGivenUp(
        lineage_id=lineage.id,
        lineage_name=lineage.name,
        owner=lineage.owner,
        status=status,
        reason=reason,
        last_job=_job_facts(session, last) if last is not None else None,
    )


def _drained(session: Session, drain: NodeEvent) -> NodeDrained:
    incident = session.get(Incident, drain.incident_id) if drain.incident_id else None
    return NodeDrained(
        node_event_id=drain.id,
        node=drain.node,
        reason=drain.reason,
        finding=drain.finding,
        slurm_job_id=incident.slurm_job_id if incident is not None else None,
    )
