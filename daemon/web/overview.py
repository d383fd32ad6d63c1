"""The overview (`/`): the pause switch, the last polls, what waits for a decision, the
drains in force, and the incidents of the last 30 days by kind, one bar a day.

The page starts from `status --json`'s document (`record_views.status_document`), cut to what
the person may see; the chart is drawn on the server as SVG (no script on any page). The
pause switch is admins' (root, `policy.admin_groups`), as `slurm-medic pause` is; each flip
and each refused attempt is an audit event naming the web user, `via: "web"`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from daemon.commands import record_views
from daemon.commands.people import Person, authority
from daemon.commands.record_views import status_document
from daemon.config import Settings
from daemon.diagnosis import FailureKind
from daemon.store import control
from daemon.store import repository as repo
from daemon.store.models import Incident
from daemon.web.context import (
    answer_form,
    flash_of,
    guarded_post,
    may_see,
    person_of,
    record_session,
    render,
    settings_of,
)

CHART_DAYS = 30
MAX_PAUSE_REASON = 500
# One colour a kind, fixed, so a kind keeps its colour from day to day and page to page.
KIND_COLOURS: Mapping[FailureKind, str] = {
    FailureKind.TRUE_OOM: "#b3261e",
    FailureKind.FRAGMENTATION: "#e07b00",
    FailureKind.WORKSPACE_SPIKE: "#c9a400",
    FailureKind.OPTIMIZER_BURST: "#7a4fb5",
    FailureKind.EVAL_GROWTH: "#2d7fb8",
    FailureKind.COTENANT: "#0f8b8d",
    FailureKind.HOST_RAM: "#6d8c00",
    FailureKind.HARDWARE: "#444b52",
    FailureKind.NOT_OOM: "#9aa5ad",
    FailureKind.UNKNOWN: "#c7ced3",
}


@dataclass(frozen=True)
class Segment:
    kind: str
    count: int
    colour: str
    y: float
    height: float


@dataclass(frozen=True)
class DayBar:
    day: date
    total: int
    x: float
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Chart:
    """Stacked bars, one a day, in the SVG's own units (`width` x `height`)."""

    days: tuple[DayBar, ...]
    kinds: tuple[tuple[str, str, int], ...]  # kind, colour, count over the window
    peak: int
    width: float
    height: float
    bar_width: float


def incident_chart(
    occurrences: list[tuple[datetime, str]], *, today: date, days: int = CHART_DAYS
) -> Chart:
    """Incidents per day and kind over the `days` ending `today` (UTC), as stacked bars."""
    first = today - timedelta(days=days - 1)
    counts: Counter[tuple[date, str]] = Counter()
    for occurred_at, kind in occurrences:
        day = _utc(occurred_at).date()
        if first <= day <= today:
            counts[day, kind] += 1
    per_day = Counter[date]()
    per_kind = Counter[str]()
    for (day, kind), count in counts.items():
        per_day[day] += count
        per_kind[kind] += count
    peak = max(per_day.values(), default=0)
    width, height, slot = 600.0, 120.0, 600.0 / days
    order = [kind.value for kind in KIND_COLOURS] + sorted(set(per_kind) - set(KIND_COLOURS))
    bars = []
    for index in range(days):
        day = first + timedelta(days=index)
        top = height
        segments = []
        for kind in order:
            count = counts.get((day, kind), 0)
            if not count:
                continue
            size = height * count / peak
            top -= size
            segments.append(Segment(kind, count, _colour(kind), round(top, 2), round(size, 2)))
        bars.append(DayBar(day, per_day.get(day, 0), round(index * slot, 2), tuple(segments)))
    kinds = tuple((kind, _colour(kind), per_kind[kind]) for kind in order if per_kind[kind])
    return Chart(tuple(bars), kinds, peak, width, height, round(slot * 0.8, 2))


def _colour(kind: str) -> str:
    try:
        return KIND_COLOURS[FailureKind(kind)]
    except ValueError:
        return "#c7ced3"


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def visible_status(request: Request, document: Mapping[str, Any]) -> dict[str, Any]:
    """`status_document` cut to the runs and approvals the person may see (the CLI's cut,
    with the web's rule of who sees what)."""
    return record_views.visible_status(document, partial(may_see, request))


def _occurrences(
    session: Session, *, since: datetime, user: str | None
) -> list[tuple[datetime, str]]:
    query = select(Incident.occurred_at, Incident.kind).where(Incident.occurred_at >= since)
    if user is not None:
        query = query.where(Incident.user_name == user)
    return [(occurred_at, kind) for occurred_at, kind in session.execute(query)]


def overview_page(request: Request) -> Response:
    person = person_of(request)
    settings = settings_of(request)
    now = datetime.now(UTC)
    everything = may_see(request, None)
    with record_session(request) as session:
        document = visible_status(request, status_document(session, settings))
        since = (now - timedelta(days=CHART_DAYS - 1)).replace(
            hour=0, minute=0, second=0, microsecond=0
        )
        occurrences = _occurrences(session, since=since, user=None if everything else person.name)
        flash = flash_of(request, session)
    values = {
        "status": document,
        "chart": incident_chart(occurrences, today=now.date()),
        "chart_is_everyones": everything,
        "is_admin": authority(person, owner=None, settings=settings) is not None,
        "flash": flash,
        "max_pause_reason": MAX_PAUSE_REASON,
    }
    return render(request, "overview.html.j2", values)


async def pause_post(request: Request) -> Response:
    """Flip the pause switch (admins), from the overview's form."""
    settings = settings_of(request)

    def act(
        session: Session, person: Person, fields: Mapping[str, str]
    ) -> tuple[int, dict[str, Any]]:
        return set_pause(session, settings, person, fields)

    answer = await guarded_post(request, "POST /pause", act)
    return await answer_form(request, "/", answer)


def set_pause(
    session: Session, settings: Settings, person: Person, fields: Mapping[str, str]
) -> tuple[int, dict[str, Any]]:
    """As `slurm-medic pause`/`resume`, with the grounds and `via: "web"` on the record."""
    wanted = fields.get("paused")
    if wanted not in {"true", "false"}:
        return 400, {"error": "paused must be true or false"}
    paused = wanted == "true"
    reason = fields.get("why", "").strip()[:MAX_PAUSE_REASON]
    verb = "pause" if paused else "unpause"
    grounds = authority(person, owner=None, settings=settings)
    if grounds is None:
        repo.append_audit(
            session,
            actor=person.actor,
            verb=f"{verb}_refused",
            subject_type="daemon",
            subject_id=control.PAUSE_FLAG,
            details={"reason": "neither root nor in policy.admin_groups", "via": "web"},
        )
        session.commit()
        return 403, {"error": f"{person.name} may not pause or resume slurm-medic: admins only"}
    control.set_paused(session, paused=paused, actor=person.actor, reason=reason)
    repo.append_audit(
        session,
        actor=person.actor,
        verb=f"{verb}_authority",
        subject_type="daemon",
        subject_id=control.PAUSE_FLAG,
        details={"grounds": grounds, "via": "web"},
    )
    word = "paused: proposals are recorded, nothing is acted on" if paused else "resumed"
    return 200, {
        "paused": paused,
        "by": person.name,
        "reason": reason,
        "message": f"slurm-medic {word}",
    }


routes: list[BaseRoute] = [
    Route("/", overview_page, methods=["GET"]),
    Route("/pause", pause_post, methods=["POST"]),
]
