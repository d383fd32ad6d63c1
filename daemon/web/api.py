"""The JSON API: the CLI's `--json` documents for scripts, under the same identity.

`GET /api/status` is `status --json` cut to what the person may see; `POST
/api/proposals/{id}/approve` (body `{"comment": ...}`) and `/reject` (`{"why": ...}`) answer
`approve --json` / `reject --json`'s document.

CSRF: a state change must come as `Content-Type: application/json`, which an HTML form on
another site cannot send (it can only send form encodings and text/plain) and a script on
another site can send only after a CORS preflight this server never grants; a request whose
Fetch Metadata or Origin says another site is refused as well. The `Idempotency-Key` header
is required: a retried request is answered from the record, never acted on twice.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from daemon.commands.record_views import status_document
from daemon.web.approvals import DECISIONS, decision
from daemon.web.context import (
    Refusal,
    check_same_origin,
    checked_key,
    once_by_key,
    record_session,
    settings_of,
)
from daemon.web.overview import visible_status

MAX_BODY_BYTES = 16 * 1024
# What each decision's body calls its reason, as the CLI's options do.
REASON_FIELD = {"approve": "comment", "reject": "why"}


def api_status(request: Request) -> Response:
    with record_session(request) as session:
        document = status_document(session, settings_of(request))
    return JSONResponse(visible_status(request, document))


async def api_decide(request: Request) -> Response:
    proposal_id: int = request.path_params["proposal_id"]
    verb: str = request.path_params["verb"]
    to = DECISIONS.get(verb)
    if to is None:
        return JSONResponse({"error": "approve or reject"}, status_code=404)
    try:
        check_same_origin(request)
        key = checked_key(request.headers.get("idempotency-key"))
        reason = await _reason(request, REASON_FIELD[verb])
    except Refusal as refusal:
        return JSONResponse({"error": refusal.reason}, status_code=refusal.status)
    status, document = await run_in_threadpool(
        once_by_key,
        request,
        key=key,
        target=f"POST /api/proposals/{proposal_id}/{verb}",
        act=decision(settings_of(request), proposal_id, to),
        fields={"comment": reason},
    )
    return JSONResponse({k: v for k, v in document.items() if k != "message"}, status_code=status)


async def _reason(request: Request, field: str) -> str:
    """The body's reason field: a JSON object, sent as JSON (the API's CSRF defence)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise Refusal(415, "send the body as Content-Type: application/json")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise Refusal(413, f"a body holds at most {MAX_BODY_BYTES} bytes")
    try:
        parsed: Any = json.loads(body or b"{}")
    except ValueError as error:
        raise Refusal(400, "the body is not JSON") from error
    except RecursionError as error:  # `[[[[...]]]]`: deeper than the parser's recursion limit
        raise Refusal(400, "the body's JSON nests too deeply") from error
    if not isinstance(parsed, dict):
        raise Refusal(400, "the body is a JSON object")
    value = parsed.get(field, "")
    if not isinstance(value, str):
        raise Refusal(400, f"{field} is a string")
    return value


routes: list[BaseRoute] = [
    Route("/api/status", api_status, methods=["GET"]),
    Route("/api/proposals/{proposal_id:int}/{verb:str}", api_decide, methods=["POST"]),
]
