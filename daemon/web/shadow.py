"""The shadow-mode report: what policy decided while `policy.dry_run` was on, and what
happened to each of those jobs and nodes afterwards.

The record marks two dry-run decisions, and this page reads those:
- a relaunch policy would have approved (the audit event `dry_run_would_approve` on the
  proposal, with policy's reasons); afterwards: the proposal's later state (a person may still
  have approved or rejected it) and the same run's later failures (the owner's jobs of the
  same name that died after it, as the record saw them);
- a drain the fleet's policy would have made (a node check `held` with the reason
  `dry-run mode: would ...`, fleet/node_policy.py); afterwards: the node's later drains and
  resumes and the jobs that died on it.

What it cannot say, because the record does not keep it: which waiting proposals were made
under dry run (they are recorded as any other `awaiting_approval`), an approved proposal held
back by dry run (the act gate's holds are not recorded), the wedged jobs it would have
cancelled, and a job that ended well afterwards (only failures are watched).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import String, cast, select
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from daemon.commands import story
from daemon.store.models import AuditEvent, Incident, Job, NodeCheck, NodeEvent, Proposal
from daemon.web.context import record_session, render
from daemon.web.runs import NO_FLASH, BadFilter, bounded, time_window, visible_owner

WOULD_APPROVE = "dry_run_would_approve"  # pipeline.py's audit verb
HELD = "held"  # NodeDecisionKind.HELD
DRY_RUN_HOLD = "dry-run mode: would "  # how fleet/node_policy.py words a dry run's hold
DEFAULT_SINCE = "30d"
DEFAULT_LIMIT = 50
MAX_LIMIT = 200
AFTERWARDS = 5  # later events shown per decision; one more says "and more"


@dataclass(frozen=True)
class WouldRelaunch:
    """A relaunch policy would have approved, and what became of the run."""

    decided_at: datetime
    reasons: tuple[str, ...]
    proposal: Proposal
    incident: Incident
    job_name: str
    later_failures: tuple[Incident, ...]


@dataclass(frozen=True)
class WouldDrain:
    """A drain policy would have made, and what became of the node."""

    check: NodeCheck
    later_events: tuple[NodeEvent, ...]
    later_failures: tuple[Incident, ...]


def would_relaunch(
    session: Session, *, since: datetime, until: datetime, owner: str | None, limit: int
) -> list[WouldRelaunch]:
    """The dry run's would-be approvals in [since, until), newest first; only `owner`'s runs
    when one is given."""
    query = (
        select(AuditEvent, Proposal, Incident, Job.name)
        .join(Proposal, AuditEvent.subject_id == cast(Proposal.id, String))
        .join(Incident, Incident.id == Proposal.incident_id)
        .join(Job, Job.id == Incident.job_id)
        .where(
            AuditEvent.verb == WOULD_APPROVE,
            AuditEvent.subject_type == "proposal",
            AuditEvent.at >= since,
            AuditEvent.at < until,
        )
    )
    if owner is not None:
        query = query.where(Incident.user_name == owner)
    query = query.order_by(AuditEvent.at.desc(), AuditEvent.id.desc()).limit(limit)
    return [
        WouldRelaunch(
            decided_at=event.at,
            reasons=tuple(str(reason) for reason in event.details.get("reasons", ())),
            proposal=proposal,
            incident=incident,
            job_name=job_name,
            later_failures=_later_failures_of_run(session, incident, job_name),
        )
        for event, proposal, incident, job_name in session.execute(query).tuples()
    ]


def _later_failures_of_run(
    session: Session, incident: Incident, job_name: str
) -> tuple[Incident, ...]:
    """The owner's jobs of the same name that died after this one (the run resubmitted by
    hand, or its lineage's next attempt), oldest first."""
    query = (
        select(Incident)
        .join(Job, Job.id == Incident.job_id)
        .where(
            Incident.user_name == incident.user_name,
            Job.name == job_name,
            Incident.occurred_at > incident.occurred_at,
        )
        .order_by(Incident.occurred_at, Incident.id)
        .limit(AFTERWARDS + 1)
    )
    return tuple(session.scalars(query))


def would_drain(
    session: Session, *, since: datetime, until: datetime, owner: str | None, limit: int
) -> list[WouldDrain]:
    """The dry run's would-be drains in [since, until), newest first, each with the node's
    later drains and resumes and the jobs (of `owner` when one is given) that died on it."""
    query = (
        select(NodeCheck)
        .where(
            NodeCheck.decision == HELD,
            NodeCheck.decision_reason.startswith(DRY_RUN_HOLD, autoescape=True),
            NodeCheck.checked_at >= since,
            NodeCheck.checked_at < until,
        )
        .order_by(NodeCheck.checked_at.desc(), NodeCheck.id.desc())
        .limit(limit)
    )
    rows: list[WouldDrain] = []
    for check in session.scalars(query):
        events = select(NodeEvent).where(
            NodeEvent.node == check.node, NodeEvent.occurred_at > check.checked_at
        )
        failures = select(Incident).where(
            Incident.node == check.node, Incident.occurred_at > check.checked_at
        )
        if owner is not None:
            failures = failures.where(Incident.user_name == owner)
        rows.append(
            WouldDrain(
                check=check,
                later_events=tuple(
                    session.scalars(
                        events.order_by(NodeEvent.occurred_at, NodeEvent.id).limit(AFTERWARDS + 1)
                    )
                ),
                later_failures=tuple(
                    session.scalars(
                        failures.order_by(Incident.occurred_at, Incident.id).limit(AFTERWARDS + 1)
                    )
                ),
            )
        )
    return rows


def shadow_page(request: Request) -> Response:
    params = request.query_params
    try:
        since, until = time_window(params, datetime.now(UTC), default_since=DEFAULT_SINCE)
        limit = bounded(params.get("limit"), "limit", DEFAULT_LIMIT, MAX_LIMIT)
    except BadFilter as error:
        values = _values(params, [], [], error=str(error))
        return render(request, "shadow.html.j2", values, 400)
    owner = visible_owner(request)
    with record_session(request) as session:
        relaunches = would_relaunch(session, since=since, until=until, owner=owner, limit=limit)
        drains = would_drain(session, since=since, until=until, owner=owner, limit=limit)
        values = _values(params, relaunches, drains, error=None)
    return render(request, "shadow.html.j2", values)


def _values(
    params: Any, relaunches: list[WouldRelaunch], drains: list[WouldDrain], *, error: str | None
) -> dict[str, Any]:
    return {
        "params": dict(params),
        "relaunches": relaunches,
        "drains": drains,
        "afterwards": AFTERWARDS,
        "error": error,
        **NO_FLASH,
        "when": lambda moment: story.short(story.when(moment)),
    }


routes: list[BaseRoute] = [Route("/shadow", shadow_page, methods=["GET"])]
