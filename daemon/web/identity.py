"""Who is asking: the kernel's word on the unix socket, the proxy's over TCP, else nobody.

On the unix socket the peer's uid comes from `SO_PEERCRED`, which the connecting process
cannot forge. uvicorn does not put it in the ASGI scope, so `PeerCredentialsProtocol` (its
h11 protocol, passed as `http=`) reads it once per connection in `connection_made`, the one
moment the protocol holds the socket before any request, and hands it to every request of
that connection through the per-connection copy of `app_state` that uvicorn copies into each
request's `scope["state"]`. Nothing a client sends can reach that dict: headers and paths go
elsewhere in the scope. (uvicorn's httptools protocol would need the same; the server always
runs this one.)

Over TCP, a user name is believed only from an authenticating reverse proxy: the peer
address is one of `web.trusted_proxies` AND the request carries `web.secret_header` equal to
the secret in `web.proxy_secret_file`. A local user who connects to the port directly has
neither. uvicorn's own proxy-header handling must stay off (`proxy_headers=False`): it would
let any client from 127.0.0.1 rewrite the peer address with `X-Forwarded-For`. A proxied name
never carries root's authority (`is_root=False`); admins come from `policy.admin_groups`.
Anything else is answered 401 before any page runs.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import ipaddress
import os
import pwd
import re
import socket
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from daemon.commands.people import Person, groups_of
from daemon.web.settings import WebSettings

# Where a unix-socket connection's credentials travel in scope["state"].
PEER_STATE_KEY = "slurm_medic_peer"
# Paths that answer without an identity: the probes of a supervisor and of Prometheus.
OPEN_PATHS = frozenset({"/healthz", "/metrics"})
# A POSIX user name as useradd takes it (and sssd/LDAP names with a dot or an @domain).
_USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.@-]{0,63}\Z")
MIN_SECRET_BYTES = 16


class SecretFileError(ValueError):
    """The proxy's secret file cannot be used: the server refuses to start."""


@dataclass(frozen=True)
class PeerCredentials:
    """The kernel's account of the process at the other end of a unix socket."""

    pid: int
    uid: int
    gid: int


def peer_credentials(connection: socket.socket) -> PeerCredentials:
    """`SO_PEERCRED` of a connected unix socket (Linux)."""
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


@dataclass(frozen=True)
class Peer:
    """The other end of a connection as its socket says: on the unix socket the kernel's
    credentials (None if they could not be read), over TCP the address."""

    unix: bool
    credentials: PeerCredentials | None = None
    address: str | None = None


def peer_of(transport: asyncio.BaseTransport) -> Peer:
    """Read once, when the connection is accepted, before anything the client sends."""
    connection = transport.get_extra_info("socket")
    if connection is not None and connection.family == socket.AF_UNIX:
        try:
            return Peer(unix=True, credentials=peer_credentials(connection))
        except OSError:
            return Peer(unix=True)
    peername = transport.get_extra_info("peername")
    if isinstance(peername, tuple) and peername and isinstance(peername[0], str):
        return Peer(unix=False, address=peername[0])
    return Peer(unix=False)


class PeerCredentialsProtocol(H11Protocol):
    """uvicorn's h11 protocol that records a unix-socket peer's credentials for its requests."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.open_for(transport, peer_of(transport))

    def open_for(self, transport: asyncio.Transport, peer: Peer) -> None:
        """uvicorn's own start of a connection, then the peer's credentials for its requests
        (a subclass that reads the peer first calls this, not `connection_made`)."""
        super().connection_made(transport)
        if peer.unix:
            # A new dict for this connection: the shared app_state stays as it was.
            self.app_state = {**self.app_state, PEER_STATE_KEY: peer.credentials}


class Unidentified(Exception):
    """No identity this server believes: 401, with a reason safe to show."""


def person_of_uid(uid: int) -> Person:
    """The person the kernel named: root's authority only for uid 0 itself."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError as error:
        raise Unidentified(f"uid {uid} has no passwd entry") from error
    return Person(name=entry.pw_name, uid=uid, groups=groups_of(entry), is_root=uid == 0)


def person_named(name: str) -> Person:
    """The person a trusted proxy named: an OS user, never with root's authority."""
    if not _USER_NAME.match(name):
        raise Unidentified("the proxy's user name is not a user name")
    try:
        entry = pwd.getpwnam(name)
    except KeyError as error:
        raise Unidentified(f"no user {name} on this system") from error
    return Person(name=entry.pw_name, uid=entry.pw_uid, groups=groups_of(entry), is_root=False)


def read_proxy_secret(path: Path) -> bytes:
    """The shared secret, from a file only its owner (root, or the server's user) can read."""
    try:
        with path.open("rb") as handle:
            info = os.fstat(handle.fileno())
            secret = handle.read(4096).strip()
    except OSError as error:
        raise SecretFileError(f"web.proxy_secret_file {path}: {error.strerror}") from error
    if not stat.S_ISREG(info.st_mode):
        raise SecretFileError(f"web.proxy_secret_file {path} is not a regular file")
    if info.st_mode & 0o077:
        raise SecretFileError(
            f"web.proxy_secret_file {path} is readable or writable by others"
            f" (mode {stat.S_IMODE(info.st_mode):o}): chmod 600 it"
        )
    if info.st_uid not in {0, os.geteuid()}:
        raise SecretFileError(f"web.proxy_secret_file {path} belongs to uid {info.st_uid}")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretFileError(
            f"web.proxy_secret_file {path} holds fewer than {MIN_SECRET_BYTES} bytes"
        )
    return secret


def identify(
    scope: Scope, headers: Mapping[str, str], web: WebSettings, secret: bytes | None
) -> Person:
    """The person behind a request, or `Unidentified`."""
    state: dict[str, Any] = scope.get("state") or {}
    if PEER_STATE_KEY in state:
        credentials: PeerCredentials | None = state[PEER_STATE_KEY]
        if credentials is None:
            raise Unidentified("the socket's peer could not be identified")
        return person_of_uid(credentials.uid)
    if not _from_trusted_proxy(scope, web) or secret is None:
        raise Unidentified("sign in through the site's proxy")
    sent = headers.get(web.secret_header)
    if sent is None or not hmac.compare_digest(sent.encode("latin-1"), secret):
        raise Unidentified("sign in through the site's proxy")
    name = headers.get(web.user_header)
    if not name:
        raise Unidentified("the proxy named no user")
    return person_named(name)


def _from_trusted_proxy(scope: Scope, web: WebSettings) -> bool:
    client = scope.get("client")
    if not client:
        return False
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    return any(address in network for network in web.trusted_proxies)


class IdentityMiddleware:
    """Puts the `Person` in `request.state.person`, or answers 401 (every path but
    `OPEN_PATHS`)."""

    def __init__(self, app: ASGIApp, *, web: WebSettings, secret: bytes | None) -> None:
        self.app = app
        self.web = web
        self.secret = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # no page speaks it: refused before anyone is asked
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {
            key.decode("latin-1").lower(): value.decode("latin-1")
            for key, value in scope["headers"]
        }
        try:
            person = identify(scope, _Caseless(headers), self.web, self.secret)
        except Unidentified as refusal:
            await _unauthorised(scope["path"], str(refusal))(scope, receive, send)
            return
        scope.setdefault("state", {})["person"] = person
        await self.app(scope, receive, send)


class _Caseless(dict[str, str]):
    """Header lookup whatever the case the settings spell the name in."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


def _unauthorised(path: str, reason: str) -> Response:
    if path.startswith("/api/"):
        return JSONResponse({"error": reason}, status_code=401)
    page = (
        "<!doctype html><html lang=en><meta charset=utf-8><title>Who are you?</title>"
        "<h1>401: who are you?</h1><p>slurm-medic did not recognise you. Open it through the"
        " site's sign-in, or on the cluster through its socket.</p>"
        f"<p>{html.escape(reason)}</p>"
    )
    return HTMLResponse(page, status_code=401)
