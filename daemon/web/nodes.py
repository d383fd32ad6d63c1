"""The nodes pages: every node slurm-medic knows with its last check and the drain in force,
a node's story, and the admin's resume (the path `slurm-medic nodes resume` takes: the admin
check on the record, the probe, scontrol through the Slurm backend); `/api/nodes` is
`nodes --json`.

Nodes are the cluster's, not a user's: their checks, drains and resumes are shown to everyone
signed in, as `sinfo` shows drain reasons to every user. A node's story leaves out the
incidents of runs the person may not see. Only an admin (root, `policy.admin_groups`) may
resume; anyone else's attempt is refused and on the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from daemon.commands import node_views
from daemon.commands.context import CommandFailed
from daemon.commands.nodes import nodes_document, resume_nodes
from daemon.commands.people import NotAllowed, Person, authority
from daemon.slurm.scontrol import validate_node_name
from daemon.store import control, node_records
from daemon.web.context import (
    guarded_post,
    person_of,
    record_session,
    render,
    settings_of,
    web_state,
)
from daemon.web.runs import visible_node_story

RESUME_TARGET = "nodes/resume"
MAX_WHY = 500  # the form's maxlength; the reason goes on the record


def is_admin(request: Request) -> bool:
    return authority(person_of(request), owner=None, settings=settings_of(request)) is not None


def _node_name(request: Request) -> str | None:
    try:
        return validate_node_name(request.path_params["node"])
    except ValueError:
        return None


def nodes_page(request: Request) -> Response:
    return _nodes_response(request, flash=None, flash_error=False, status_code=200)


def _nodes_response(
    request: Request, *, flash: str | None, flash_error: bool, status_code: int
) -> Response:
    with record_session(request) as session:
        document = nodes_document(session)
    values = {
        "nodes": document["nodes"],
        "admin": is_admin(request),
        "flash": flash,
        "flash_error": flash_error,
        "decision_text": node_views.decision_text,
        "max_why": MAX_WHY,
    }
    return render(request, "nodes.html.j2", values, status_code)


def node_page(request: Request) -> Response:
    """A node's checks, drains, resumes and the incidents the person may see, oldest first."""
    node = _node_name(request)
    with record_session(request) as session:
        story = None if node is None else node_records.node_story(session, node)
        if story is None or node_views.is_empty(story):
            missing = f"node {request.path_params['node']} is not in the record"
            gone: dict[str, Any] = {"missing": missing, "flash": None, "flash_error": False}
            return render(request, "node.html.j2", gone, 404)
        drained = any(event.node == node for event in control.drains_in_force(session))
        document = visible_node_story(node_views.story_document(story), request)
    values: dict[str, Any] = {
        "missing": None,
        "story": document,
        "admin": is_admin(request),
        "drained": drained,
        "flash": None,
        "flash_error": False,
        "decision_text": node_views.decision_text,
        "max_why": MAX_WHY,
    }
    return render(request, "node.html.j2", values)


async def resume(request: Request) -> Response:
    """POST: resume one node slurm-medic drained (admins only; `why` for the record)."""
    node = _node_name(request)
    if node is None:
        return JSONResponse({"error": "not a node name"}, status_code=400)
    context = web_state(request).context

    def act(
        session: Session, person: Person, form: Mapping[str, str]
    ) -> tuple[int, dict[str, Any]]:
        why = form.get("why", "").strip()
        if len(why) > MAX_WHY:
            return 400, {"error": f"say why in at most {MAX_WHY} characters"}
        try:
            document = resume_nodes(session, context, person, nodeset=node, nodes=(node,), why=why)
        except NotAllowed as refusal:
            return 403, {"error": refusal.format_message()}
        except CommandFailed as failure:
            return 502, {"error": failure.format_message()}
        resumed = all(row["done"] == "resumed" for row in document["nodes"])
        return (200 if resumed else 409), document

    status, document = await guarded_post(request, f"{RESUME_TARGET}/{node}", act)
    if "application/json" in request.headers.get("accept", ""):
        return JSONResponse(document, status_code=status)
    flash = document.get("error") or "; ".join(
        f"{row['node']} {row['done']}" for row in document.get("nodes", [])
    )
    return _nodes_response(request, flash=flash, flash_error=status != 200, status_code=status)


def api_nodes(request: Request) -> Response:
    """`nodes --json`: every node on the record, its last check and the drain in force."""
    with record_session(request) as session:
        return JSONResponse(nodes_document(session))


routes: list[BaseRoute] = [
    Route("/nodes", nodes_page, methods=["GET"]),
    Route("/nodes/{node}", node_page, methods=["GET"]),
    Route("/nodes/{node}/resume", resume, methods=["POST"]),
    Route("/api/nodes", api_nodes, methods=["GET"]),
]
