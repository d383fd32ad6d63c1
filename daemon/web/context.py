"""What every page of the web app runs with: the person asking, the record, the templates,
and the one guarded way to change anything.

The app keeps a `WebState` in `app.state.web`; the identity middleware (identity.py) puts the
`Person` in `request.state.person` before any page runs. Pages read the record through
`record_session` (read-only unless they change something) and change it only through
`guarded_post`, which checks the CSRF token and the request's origin, and answers a form sent
twice (a double click, a browser's retry) from the answer stored under its idempotency key
instead of acting twice.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from daemon.commands.context import CommandContext
from daemon.commands.people import Person
from daemon.commands.people import may_see as people_may_see
from daemon.config import Settings
from daemon.store.models import WebRequest

# A key the browser sends back as it was given (`new_idempotency_key`), or a script's own.
_IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9_-]{16,64}\Z")
# The Fetch Metadata a browser sends; a request from another site (or a sibling subdomain)
# may not change anything, whatever cookies the proxy in front holds for it.
_ALLOWED_FETCH_SITES = frozenset({"same-origin", "none"})

Act = Callable[[Session, Person, Mapping[str, str]], tuple[int, dict[str, Any]]]


class Refusal(Exception):
    """A request refused before anything was done: its status and a short reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class WebState:
    """The app's settings and record (a command's context) and its templates.

    `csrf_key` is made afresh for each server process: a token binds a form to the person it
    was rendered for, and a restart only asks for a reload of a page left open.
    """

    context: CommandContext
    templates: Jinja2Templates
    csrf_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))


def web_state(request: Request) -> WebState:
    state: WebState = request.app.state.web
    return state


def person_of(request: Request) -> Person:
    """The person the identity middleware found (every page but /healthz and /metrics)."""
    person: Person = request.state.person
    return person


def settings_of(request: Request) -> Settings:
    return web_state(request).context.settings


def record_session(request: Request, *, read_only: bool = True) -> AbstractContextManager[Session]:
    """A session on the record: read-only (SQLite opened read-only, no flush) unless the page
    changes something. A record that cannot be used raises the command's `RecordUnusable`,
    which the app answers with 503."""
    return web_state(request).context.session(read_only=read_only)


def root_path(request: Request) -> str:
    """The prefix the page is served under ('' at the site's root; OnDemand's, through its
    forwarder): every link and redirect starts with it."""
    return str(request.scope.get("root_path", ""))


def may_see(request: Request, owner: str | None) -> bool:
    """Whether the person may see a run of `owner`: theirs, or they are an admin or root, or
    the site lets everyone see everything (`web.everyone_sees_all`): who may decide on a run
    may see it (`people.may_see`, the CLI's rule too)."""
    return people_may_see(person_of(request), owner=owner, settings=settings_of(request))


def csrf_token(request: Request) -> str:
    """The token a form of this person carries in its hidden field `csrf`."""
    person = person_of(request)
    message = f"csrf\0{person.name}\0{person.uid}".encode()
    return hmac.new(web_state(request).csrf_key, message, hashlib.sha256).hexdigest()


def new_idempotency_key() -> str:
    """A fresh key for a form's hidden field `idempotency_key` (one per rendered form)."""
    return secrets.token_urlsafe(24)


def render(
    request: Request, template: str, values: Mapping[str, Any], status_code: int = 200
) -> HTMLResponse:
    """A page from its template, with what every page shows (the person, the CSRF token)."""
    person: Person | None = getattr(request.state, "person", None)
    context: dict[str, Any] = {
        "person": person,
        "root": root_path(request),
        "csrf": csrf_token(request) if person is not None else "",
        "new_idempotency_key": new_idempotency_key,
        "flash": None,
        "flash_error": False,
        **values,
    }
    return web_state(request).templates.TemplateResponse(
        request, template, context, status_code=status_code
    )


def check_same_origin(request: Request) -> None:
    """Refuse (403) a state change a browser says comes from another site."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in _ALLOWED_FETCH_SITES:
        raise Refusal(403, f"a request from {site} pages may not change anything")
    origin = request.headers.get("origin")
    if origin is not None and not _same_host(origin, request.headers.get("host", "")):
        raise Refusal(403, "a request from another origin may not change anything")


def _same_host(origin: str, host: str) -> bool:
    """The Origin names this Host. A proxy that sends `Host: $host` (nginx) drops the port,
    so a port is compared only when the Host has one."""
    if origin == "null":
        return False
    try:
        sent, here = urlsplit(origin), urlsplit(f"//{host}")
        sent_port, here_port = sent.port, here.port
    except ValueError:
        return False
    if sent.hostname is None or sent.hostname != here.hostname:
        return False
    return here_port is None or sent_port == here_port


def check_csrf(request: Request, form: Mapping[str, str]) -> None:
    check_same_origin(request)
    sent = form.get("csrf", "")
    if not hmac.compare_digest(sent.encode(), csrf_token(request).encode()):
        raise Refusal(403, "the form's token is missing or stale: reload the page and retry")


def checked_key(key: str | None) -> str:
    if key is None or not _IDEMPOTENCY_KEY.match(key):
        raise Refusal(400, "an idempotency key (16 to 64 of A-Z a-z 0-9 _ -) is required")
    return key


async def guarded_post(request: Request, target: str, act: Act) -> tuple[int, dict[str, Any]]:
    """A form's state change, at most once per idempotency key: CSRF and origin checked, a
    known key's stored answer replayed (another person's key, or one made for another
    target: 409), else `act` run in a thread on a writable session and its answer stored
    under the key in the same transaction."""
    form = {key: value for key, value in (await request.form()).items() if isinstance(value, str)}
    try:
        check_csrf(request, form)
        key = checked_key(form.get("idempotency_key"))
    except Refusal as refusal:
        return refusal.status, {"error": refusal.reason}
    return await run_in_threadpool(
        once_by_key, request, key=key, target=target, act=act, fields=form
    )


def once_by_key(
    request: Request, *, key: str, target: str, act: Act, fields: Mapping[str, str]
) -> tuple[int, dict[str, Any]]:
    """Run `act` unless the key was seen: the answer stored with the key, or a 409 when the
    key was used by someone else or for something else. Two racing requests with one key
    meet at the key's primary key: the loser's work is rolled back and the winner's answer
    replayed."""
    person = person_of(request)
    with record_session(request, read_only=False) as session:
        stored = _stored(session, key, person, target)
        if stored is not None:
            return stored
        status, document = act(session, person, fields)
        session.add(
            WebRequest(
                idempotency_key=key,
                actor_name=person.name,
                target=target,
                status=status,
                response=document,
            )
        )
        try:
            session.commit()
        except IntegrityError:
            session.rollback()
            stored = _stored(session, key, person, target)
            if stored is None:
                raise
            return stored
    return status, document


def _stored(
    session: Session, key: str, person: Person, target: str
) -> tuple[int, dict[str, Any]] | None:
    row = session.get(WebRequest, key)
    if row is None:
        return None
    if row.actor_name != person.name or row.target != target:
        return 409, {"error": "this idempotency key was used for another request"}
    return row.status, dict(row.response)


async def answer_form(request: Request, page: str, answer: tuple[int, dict[str, Any]]) -> Response:
    """After a form's POST: done, a 303 to `page` whose flash says what happened (its
    `?done=KEY` names the stored answer, which only its own person is shown); refused, the
    refusal with its status."""
    status, document = answer
    if status < 400:
        key = str((await request.form()).get("idempotency_key", ""))
        return RedirectResponse(f"{root_path(request)}{page}?done={quote(key)}", status_code=303)
    message = str(document.get("error") or document.get("message") or "refused")
    return render(
        request, "refused.html.j2", {"status": status, "message": message}, status_code=status
    )


def flash_of(request: Request, session: Session) -> str | None:
    """The message of the state change named by `?done=KEY`, if it was this person's."""
    key = request.query_params.get("done")
    if key is None or not _IDEMPOTENCY_KEY.match(key):
        return None
    row = session.get(WebRequest, key)
    if row is None or row.actor_name != person_of(request).name:
        return None
    message = row.response.get("message")
    return message if isinstance(message, str) else None
