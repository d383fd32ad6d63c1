"""Pending approvals (`/approvals`): each proposal the person may decide, with approve and
reject forms.

A decision goes through `people.decide`, the CLI's own path: the same authority (the job's
owner, `policy.admin_groups`, root), the same audit events naming the person, plus
`via: "web"`. A rejection needs a reason, as `reject --why` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from daemon.commands.people import (
    NotAllowed,
    NotWaiting,
    Person,
    ProposalMissing,
    authority,
    decide,
)
from daemon.commands.record_views import pending_document
from daemon.config import Settings
from daemon.store import queries
from daemon.store.states import ProposalState
from daemon.web.context import (
    answer_form,
    flash_of,
    guarded_post,
    person_of,
    record_session,
    render,
    settings_of,
)

MAX_REASON = 2000  # a comment is for the record, not a document
MAX_PROPOSAL_ID = 2**31 - 1  # the record's integer ids
DECISIONS: Mapping[str, ProposalState] = {
    "approve": ProposalState.APPROVED,
    "reject": ProposalState.REJECTED,
}


def decision(
    settings: Settings, proposal_id: int, to: ProposalState
) -> Callable[[Session, Person, Mapping[str, str]], tuple[int, dict[str, Any]]]:
    """The act of deciding one proposal, its answer a status and the CLI's `--json` document
    (plus `message`, the flash)."""

    def act(
        session: Session, person: Person, fields: Mapping[str, str]
    ) -> tuple[int, dict[str, Any]]:
        if proposal_id > MAX_PROPOSAL_ID:
            return 404, {"error": f"no proposal {proposal_id} in the record"}
        reason = fields.get("comment", "").strip()
        if len(reason) > MAX_REASON:
            return 400, {"error": f"a comment holds at most {MAX_REASON} characters"}
        if to is ProposalState.REJECTED and not reason:
            return 400, {"error": "say why: a rejection needs a reason"}
        try:
            document = decide(
                session,
                settings,
                person,
                proposal_id=proposal_id,
                to=to,
                reason=reason,
                via="web",
            )
        except ProposalMissing:
            return 404, {"error": f"no proposal {proposal_id} in the record"}
        except NotWaiting as error:
            return 409, {"error": error.format_message()}
        except NotAllowed as error:
            return 403, {"error": error.format_message()}
        message = f"proposal {proposal_id} {to.value} by {person.name} ({document['grounds']})"
        return 200, {**document, "message": message}

    return act


def approvals_page(request: Request) -> Response:
    person = person_of(request)
    settings = settings_of(request)
    with record_session(request) as session:
        rows = [
            pending_document(session, proposal) for proposal in queries.pending_approvals(session)
        ]
        flash = flash_of(request, session)
    mine = [
        {**row, "grounds": grounds}
        for row in rows
        if (grounds := authority(person, owner=row["owner"], settings=settings)) is not None
    ]
    return render(
        request,
        "approvals.html.j2",
        {"proposals": mine, "flash": flash, "max_reason": MAX_REASON},
    )


async def decide_post(request: Request) -> Response:
    proposal_id: int = request.path_params["proposal_id"]
    verb: str = request.path_params["verb"]
    to = DECISIONS.get(verb)
    if to is None:
        return render(
            request,
            "refused.html.j2",
            {"status": 404, "message": "approve or reject"},
            status_code=404,
        )
    act = decision(settings_of(request), proposal_id, to)
    answer = await guarded_post(request, f"POST /approvals/{proposal_id}/{verb}", act)
    return await answer_form(request, "/approvals", answer)


routes: list[BaseRoute] = [
    Route("/approvals", approvals_page, methods=["GET"]),
    Route("/approvals/{proposal_id:int}/{verb:str}", decide_post, methods=["POST"]),
]
