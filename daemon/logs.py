"""The daemon's log: one JSON object per line on stderr, which journald keeps and people and
tools read (`extra={"fields": {...}}` adds keys to the line).

At INFO the log carries the daemon's decisions, one line each (`log_decisions`): a diagnosis,
a proposal and whether it waits for a person or policy approved it, a relaunch submitted, a
drain, a verification's result, an escalation. Every decision is an audit event, so the lines
are made from the audit events a daemon session commits: nothing decided is left out, and
nothing rolled back is said. The scheduler's own lines ("Running job ...", "... executed
successfully" every cycle) are kept to WARNING and above.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from daemon.store.models import ActorKind, AuditEvent, NodeEvent

# Libraries whose INFO lines are their own housekeeping, not the daemon's decisions: the
# scheduler's every run, and Alembic's two lines at each schema check (every web request's).
QUIET_LOGGERS = ("apscheduler", "alembic")
decisions_log = logging.getLogger("slurm_medic.decisions")
_PENDING = "slurm_medic_decisions"  # the session.info key of the events not yet committed
# Keys of a line the formatter writes itself: an audit event's details never overwrite them.
_RESERVED = frozenset({"at", "level", "logger", "msg", "traceback", "event"})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "at": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))


# ------------------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Decision:
    """How one kind of audit event reads as a log line: its `event` field and its message,
    a template over the event's details and `id` (the subject), `actor`, `reasons`."""

    event: str
    message: str


# The audit verbs that are decisions, in the order a failed job meets them. Housekeeping
# (job_handled, submit_intent, lineage_submit, revision) has its own lines or none; so do the
# intents of a drain, resume or scancel: a drain is said once done, from its node event.
DECISIONS: Mapping[str, Decision] = {
    "diagnosed": Decision("diagnosis", "diagnosis: job {job} {kind} ({confidence} confidence)"),
    "refused": Decision("no_proposal", "no fix proposed for incident {id}: {reason}"),
    "propose": Decision("proposal", "proposal {id}: {remediator} for incident {incident}"),
    "awaiting_approval": Decision(
        "awaiting_approval", "proposal {id} waits for a person: {reasons}"
    ),
    "dry_run_would_approve": Decision(
        "dry_run_would_approve", "proposal {id}: policy would approve it, but dry_run is on"
    ),
    "proposal_approved": Decision("approved", "proposal {id} approved by {actor}: {reason}"),
    "proposal_rejected": Decision("rejected", "proposal {id} rejected by {actor}: {reason}"),
    "proposal_expired": Decision("expired", "proposal {id} expired: {reason}"),
    "proposal_superseded": Decision("superseded", "proposal {id} superseded: {reason}"),
    "act_refused": Decision("act_refused", "proposal {id} not acted on: {reason}"),
    "submitted": Decision(
        "relaunch_submitted", "relaunch submitted: job {job} (proposal {proposal})"
    ),
    "reconciled_found": Decision(
        "relaunch_submitted", "relaunch found after a restart: job {job} (proposal {proposal})"
    ),
    "reconciled_not_found": Decision(
        "relaunch_not_found", "relaunch never reached Slurm (proposal {proposal}): tried again"
    ),
    "submit_failed": Decision(
        "relaunch_failed", "relaunch not submitted (proposal {proposal}): exit {exit_code}"
    ),
    "wedged_cancelled": Decision("wedged_cancelled", "wedged run cancelled: job {id}"),
    "proposal_verified": Decision("verified", "verification: proposal {id} verified: {reason}"),
    "proposal_failed": Decision("failed", "proposal {id} failed: {reason}"),
    "lineage_status": Decision("lineage_status", "lineage {id} {from} -> {to}: {reason}"),
}
# Policy's own approval, said as such (the audit names the daemon as the actor).
AUTO_APPROVED = Decision("auto_approved", "proposal {id} auto-approved, {reason}")
# A lineage that stops being followed on its own needs a person: that is the escalation.
ESCALATED = "exhausted"
ESCALATION = Decision("escalation", "escalation: lineage {id} needs a person: {reason}")


class _Blank(dict[str, Any]):
    """Details for a template: a key an event lacks reads `?`, never a KeyError."""

    def __missing__(self, key: str) -> str:
        return "?"


def decision_line(audit: AuditEvent) -> tuple[str, dict[str, Any]] | None:
    """The message and fields of the log line an audit event makes; None: not a decision."""
    decision = DECISIONS.get(audit.verb)
    if decision is None:
        return None
    details = dict(audit.details or {})
    if audit.verb == "proposal_approved" and audit.actor_kind == ActorKind.DAEMON.value:
        decision = AUTO_APPROVED
    if audit.verb == "lineage_status" and details.get("to") == ESCALATED:
        decision = ESCALATION
    reasons = details.get("reasons")
    values = _Blank(details)
    values.update(
        id=audit.subject_id,
        actor=audit.actor_name,
        reasons="; ".join(map(str, reasons)) if isinstance(reasons, list) else "?",
    )
    fields = {key: value for key, value in details.items() if key not in _RESERVED}
    fields.update({"event": decision.event, audit.subject_type: _number(audit.subject_id)})
    if audit.actor_kind != ActorKind.DAEMON.value:
        fields["actor"] = audit.actor_name
    return decision.message.format_map(values), fields


def node_line(node_event: NodeEvent) -> tuple[str, dict[str, Any]] | None:
    """A drain or resume slurm-medic made, once made; None: someone else's, only seen."""
    if not node_event.by_medic:
        return None
    fields: dict[str, Any] = {
        "event": node_event.kind,
        "node": node_event.node,
        "reason": node_event.reason,
        "incident": node_event.incident_id,
        "finding": node_event.finding,
    }
    if node_event.actor_name is not None:
        fields["by"] = node_event.actor_name
    return f"{node_event.kind} {node_event.node}: {node_event.reason}", fields


def _number(subject_id: str) -> int | str:
    return int(subject_id) if subject_id.isdigit() else subject_id


def log_decisions(sessions: sessionmaker[Session]) -> None:
    """Log each decision the sessions of `sessions` commit, once it is committed."""
    event.listen(sessions, "after_flush", _collect)
    event.listen(sessions, "after_commit", _emit)
    event.listen(sessions, "after_rollback", _forget)


def _collect(session: Session, _context: object) -> None:
    # `new` still lists what this flush inserted, in the order it was added (SQLAlchemy's
    # after_flush contract); the lines are made now, while the rows are loaded, and said at
    # the commit.
    lines = [line for line in map(_line_of, session.new) if line is not None]
    if lines:
        session.info.setdefault(_PENDING, []).extend(lines)


def _line_of(row: object) -> tuple[str, dict[str, Any]] | None:
    if isinstance(row, AuditEvent):
        return decision_line(row)
    if isinstance(row, NodeEvent):
        return node_line(row)
    return None


def _emit(session: Session) -> None:
    for message, fields in session.info.pop(_PENDING, []):
        decisions_log.info(message, extra={"fields": fields})


def _forget(session: Session) -> None:
    session.info.pop(_PENDING, None)
