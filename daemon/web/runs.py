"""The runs pages: the failures slurm-medic analysed, filtered and paged, and a run's whole
story (the document `show --json` prints, drawn for people, with each OOM as a bar); and
their JSON: `/api/history` and `/api/show/{ref}`, the CLI's `--json` documents.

A person sees their own runs only, unless they are an admin or root or the site lets everyone
see everything (`context.may_see`); another's run is answered 404 as if it did not exist, and
never counted. Every list is bounded: a page holds at most `MAX_PAGE` rows, the API at most
the CLI's `--limit`, and the next page starts below the last row shown (a keyset, never an
offset scan).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlencode

import click
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from daemon.commands import record_views, story
from daemon.commands.record_views import (
    history_document,
    history_row,
    parse_since,
    show_document,
)
from daemon.diagnosis import FailureKind
from daemon.store import queries
from daemon.store import repository as repo
from daemon.store.models import Incident, Lineage, LineageStatus, Proposal
from daemon.web.context import may_see, person_of, record_session, render, root_path
from daemon.web.oom_bar import OomBar, OomFigures, oom_bar

DEFAULT_PAGE = 50
MAX_PAGE = 200
DEFAULT_SINCE = "7d"  # as `history --since`
API_DEFAULT_LIMIT = 200  # as `history --limit`
API_MAX_LIMIT = 10_000
MAX_LINEAGE_ID = 2**31 - 1  # the record's integer ids
MAX_JOB_ID = 2**63 - 1
_NUMBER = re.compile(r"[0-9]{1,19}\Z")
_NOT_FOUND = "not in the record"

NO_FLASH: dict[str, Any] = {"flash": None, "flash_error": False}  # base.html.j2's message

Choice = TypeVar("Choice", FailureKind, LineageStatus)
Default = TypeVar("Default", int, None)


class BadFilter(ValueError):
    """A query parameter that cannot be read: the page says which and why (400)."""


@dataclass(frozen=True)
class RunFilters:
    """What the runs page was asked for; `older_than` is the last incident of the page before."""

    since: datetime
    until: datetime
    user: str | None = None
    kind: FailureKind | None = None
    state: LineageStatus | None = None
    limit: int = DEFAULT_PAGE
    older_than: int | None = None


@dataclass(frozen=True)
class RunRow:
    """One failure on the runs page: the incident, its lineage's state, what was proposed."""

    incident: Incident
    lineage_status: str | None
    proposals: tuple[Proposal, ...]


@dataclass(frozen=True)
class RunsPage:
    rows: tuple[RunRow, ...]
    older_than: int | None  # the cursor of the next page; None on the last page


def parse_filters(params: Mapping[str, str], now: datetime) -> RunFilters:
    """The page's filters from its query string; BadFilter names the parameter at fault."""
    since, until = time_window(params, now, default_since=DEFAULT_SINCE)
    return RunFilters(
        since=since,
        until=until,
        user=params.get("user") or None,
        kind=_choice(FailureKind, params.get("kind"), "kind"),
        state=_choice(LineageStatus, params.get("state"), "state"),
        limit=bounded(params.get("limit"), "limit", DEFAULT_PAGE, MAX_PAGE),
        older_than=bounded(params.get("older_than"), "older_than", None, MAX_LINEAGE_ID),
    )


def time_window(
    params: Mapping[str, str], now: datetime, *, default_since: str
) -> tuple[datetime, datetime]:
    """[since, until) from `since` and `until` (7d, 12h, or an ISO date, as `history --since`);
    until defaults to now, and is taken to the end of its second."""
    since = _moment(params.get("since") or default_since, now, "since")
    until = _moment(params["until"], now, "until") if params.get("until") else now
    if since >= until:
        raise BadFilter("since: must be before until")
    return since, until + timedelta(seconds=1)


def _moment(text: str, now: datetime, name: str) -> datetime:
    try:
        return parse_since(text, now)
    except click.BadParameter as error:
        raise BadFilter(f"{name}: {error.message}") from error


def _choice(enum: type[Choice], text: str | None, name: str) -> Choice | None:
    if not text:
        return None
    try:
        return enum(text)
    except ValueError as error:
        raise BadFilter(f"{name}: {text!r} is none of {', '.join(enum)}") from error


def bounded(text: str | None, name: str, default: Default, most: int) -> int | Default:
    """A count or an id from 1 to `most`, else BadFilter; `default` when not given."""
    if not text:
        return default
    if not _NUMBER.match(text) or not 1 <= int(text) <= most:
        raise BadFilter(f"{name}: {text!r} is not a number from 1 to {most}")
    return int(text)


def find_runs(session: Session, filters: RunFilters, *, owner: str | None) -> RunsPage:
    """One page of failures, newest first; only `owner`'s when one is given (a person who may
    see only their own runs), so another's are neither shown nor counted."""
    query = (
        select(Incident, Lineage.status)
        .outerjoin(Lineage, Lineage.id == Incident.lineage_id)
        .where(Incident.occurred_at >= filters.since, Incident.occurred_at < filters.until)
    )
    for user in (filters.user, owner):
        if user is not None:
            query = query.where(Incident.user_name == user)
    if filters.kind is not None:
        query = query.where(Incident.kind == filters.kind.value)
    if filters.state is not None:
        query = query.where(Lineage.status == filters.state.value)
    if filters.older_than is not None:
        last = session.get(Incident, filters.older_than)
        if last is None:
            return RunsPage((), None)
        query = query.where(
            or_(
                Incident.occurred_at < last.occurred_at,
                and_(Incident.occurred_at == last.occurred_at, Incident.id < last.id),
            )
        )
    query = query.order_by(Incident.occurred_at.desc(), Incident.id.desc()).limit(filters.limit + 1)
    found = list(session.execute(query).tuples())
    shown = found[: filters.limit]
    proposals: dict[int, list[Proposal]] = {}
    for proposal in queries.proposals_for_incidents(
        session, incident_ids=[incident.id for incident, _ in shown]
    ):
        proposals.setdefault(proposal.incident_id, []).append(proposal)
    rows = tuple(
        RunRow(incident, status, tuple(proposals.get(incident.id, ())))
        for incident, status in shown
    )
    more = len(found) > filters.limit
    return RunsPage(rows, shown[-1][0].id if more and shown else None)


def visible_owner(request: Request) -> str | None:
    """None when the person may see every run (admin, root, or a site that lets everyone);
    else the only owner whose runs they may see: themselves."""
    return None if may_see(request, None) else person_of(request).name


def visible_node_story(document: Mapping[str, Any], request: Request) -> dict[str, Any]:
    """A node's story as the person may see it (the CLI's `record_views.visible_node_story`)."""
    return record_views.visible_node_story(document, lambda owner: may_see(request, owner))


# ---------------------------------------------------------------- pages


def runs_page(request: Request) -> Response:
    try:
        filters = parse_filters(request.query_params, datetime.now(UTC))
    except BadFilter as error:
        return render(request, "runs.html.j2", _runs_values(request, None, str(error)), 400)
    with record_session(request) as session:
        page = find_runs(session, filters, owner=visible_owner(request))
        values = _runs_values(request, page, None)
    return render(request, "runs.html.j2", values)


def _runs_values(request: Request, page: RunsPage | None, error: str | None) -> dict[str, Any]:
    params = dict(request.query_params)
    older = None
    if page is not None and page.older_than is not None:
        older = "/runs?" + urlencode({**params, "older_than": str(page.older_than)})
    return {
        "rows": [] if page is None else [_row_values(row) for row in page.rows],
        "params": params,
        "kinds": [kind.value for kind in FailureKind],
        "states": [state.value for state in LineageStatus],
        "older": older,
        "error": error,
        "own_only": visible_owner(request) is not None,
        **NO_FLASH,
    }


def _row_values(row: RunRow) -> dict[str, Any]:
    values = history_row(row.incident, row.proposals)
    return {**values, "at": story.short(values["at"]), "state": row.lineage_status}


def run_page(request: Request) -> Response:
    lineage_id: int = request.path_params["lineage"]
    if lineage_id > MAX_LINEAGE_ID:
        return _not_found(request, f"lineage {lineage_id}")
    with record_session(request) as session:
        try:
            document = story.lineage_document(session, lineage_id=lineage_id)
        except repo.NotFound:
            return _not_found(request, f"lineage {lineage_id}")
        if not may_see(request, record_views.document_owner(document)):
            return _not_found(request, f"lineage {lineage_id}")
        grounds = _grounds(session, document)
    return render(request, "run.html.j2", _story_values(document, grounds))


def job_page(request: Request) -> Response:
    """A job's lineage page (a redirect), or the job's own story when it has no lineage."""
    job_id: int = request.path_params["job"]
    if job_id > MAX_JOB_ID:
        return _not_found(request, f"job {job_id}")
    with record_session(request) as session:
        document = story.job_document(session, slurm_job_id=job_id)
        if document is None or not may_see(request, _job_user(document, job_id)):
            return _not_found(request, f"job {job_id}")
        if document["lineage"] is not None:
            return RedirectResponse(
                f"{root_path(request)}/runs/{document['lineage']['id']}", status_code=303
            )
        grounds = _grounds(session, document)
    return render(request, "run.html.j2", _story_values(document, grounds))


def _job_user(document: Mapping[str, Any], job_id: int) -> str | None:
    """The user of the job asked for: a job of someone else's lineage is not theirs to see."""
    if document["lineage"] is not None:
        owner: str | None = document["lineage"]["owner"]
        return owner
    return next((a["job"]["user"] for a in document["attempts"] if a["job"]["id"] == job_id), None)


def _not_found(request: Request, what: str) -> Response:
    return render(request, "run.html.j2", {"missing": f"{what} is {_NOT_FOUND}", **NO_FLASH}, 404)


def _grounds(session: Session, document: Mapping[str, Any]) -> dict[int, str]:
    """On what authority each decided proposal was decided (the `decision_authority` event);
    the story's trail keeps only each event's reason."""
    grounds: dict[int, str] = {}
    for attempt in document["attempts"]:
        for proposal in attempt["proposals"]:
            for event in queries.proposal_audit_trail(session, proposal_id=proposal["id"]):
                if event.verb == "decision_authority":
                    grounds[proposal["id"]] = str(event.details.get("grounds", ""))
    return grounds


def _story_values(document: Mapping[str, Any], grounds: Mapping[int, str]) -> dict[str, Any]:
    bars: dict[int, OomBar | None] = {}
    for attempt in document["attempts"]:
        for incident in attempt["incidents"]:
            oom = incident.get("oom")
            if oom is not None:
                bars[incident["id"]] = oom_bar(OomFigures.from_document(oom["bytes"]))
    return {"missing": None, "story": document, "bars": bars, "grounds": grounds, **NO_FLASH}


# ---------------------------------------------------------------- JSON


def api_history(request: Request) -> Response:
    """`history --json` with the CLI's options as query parameters (`since`, `user`, `kind`,
    `limit`), holding only the runs the person may see."""
    params = request.query_params
    now = datetime.now(UTC)
    try:
        since = _moment(params.get("since") or DEFAULT_SINCE, now, "since")
        kind = _choice(FailureKind, params.get("kind"), "kind")
        limit = bounded(params.get("limit"), "limit", API_DEFAULT_LIMIT, API_MAX_LIMIT)
    except BadFilter as error:
        return JSONResponse({"error": str(error)}, status_code=400)
    user = params.get("user") or None
    owner = visible_owner(request)
    if owner is not None and user not in (None, owner):
        return JSONResponse({"since": story.when(since), "incidents": []})
    with record_session(request) as session:
        document = history_document(
            session,
            since=since,
            until=now + timedelta(seconds=1),
            kind=kind,
            user=owner or user,
            limit=limit,
        )
    return JSONResponse(document)


def api_show(request: Request) -> Response:
    """`show REF --json`: a lineage (`L12`), a job id or a node; another's run is 404."""
    reference: str = request.path_params["ref"]
    with record_session(request) as session:
        try:
            shown = show_document(session, reference)
        except click.BadParameter as error:
            return JSONResponse({"error": error.message}, status_code=400)
        except click.ClickException:
            return JSONResponse({"error": f"{reference} is {_NOT_FOUND}"}, status_code=404)
    if shown.is_node:
        return JSONResponse(visible_node_story(shown.document, request))
    if not may_see(request, record_views.document_owner(shown.document)):
        return JSONResponse({"error": f"{reference} is {_NOT_FOUND}"}, status_code=404)
    return JSONResponse(shown.document)


routes: list[BaseRoute] = [
    Route("/runs", runs_page, methods=["GET"]),
    Route("/runs/{lineage:int}", run_page, methods=["GET"]),
    Route("/jobs/{job:int}", job_page, methods=["GET"]),
    Route("/api/history", api_history, methods=["GET"]),
    Route("/api/show/{ref}", api_show, methods=["GET"]),
]
