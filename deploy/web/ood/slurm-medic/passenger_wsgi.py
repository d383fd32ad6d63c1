"""Open OnDemand's entry to slurm-medic's web page: a Passenger app that hands each request to
slurm-medic's unix socket.

OnDemand runs this app in the signed-in person's own nginx (the PUN), as that person. The
socket connection therefore comes from the person's uid, which slurm-medic reads with
SO_PEERCRED: no header, secret or proxy address to trust, and nothing the person can forge.
The app passes the request through unchanged (the browser's Host included, which a form's
Origin is checked against) but for the hop-by-hop headers, and tells slurm-medic the prefix
OnDemand serves it under (X-Forwarded-Prefix) so the page's links stay inside OnDemand.

Standard library only: OnDemand's Passenger runs it with the system's python3.
"""

from __future__ import annotations

import http.client
import os
import socket
from collections.abc import Callable, Iterable
from typing import Any

SOCKET_PATH = os.environ.get("SLURM_MEDIC_SOCKET", "/run/slurm-medic-web/web.sock")
TIMEOUT_S = 30.0
MAX_BODY_BYTES = 1024 * 1024  # the page's forms are small; nothing bigger is passed on
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class UnixConnection(http.client.HTTPConnection):
    """HTTP over slurm-medic's unix socket."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT_S)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        sock.connect(self.socket_path)
        self.sock = sock


def _request_headers(environ: dict[str, Any]) -> dict[str, str]:
    headers = {
        key[5:].replace("_", "-").title(): str(value)
        for key, value in environ.items()
        if key.startswith("HTTP_") and key[5:].replace("_", "-").lower() not in HOP_BY_HOP
    }
    if environ.get("CONTENT_TYPE"):
        headers["Content-Type"] = environ["CONTENT_TYPE"]
    # The browser's own Host stays: slurm-medic checks a form's Origin against it.
    headers["X-Forwarded-Prefix"] = environ.get("SCRIPT_NAME", "")
    return headers


def application(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    """Forward one request; a slurm-medic that does not answer is a 502 page, not a traceback."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    if length > MAX_BODY_BYTES:
        start_response("413 Payload Too Large", [("Content-Type", "text/plain")])
        return [b"request too large\n"]
    body = environ["wsgi.input"].read(length) if length else None
    path = environ.get("PATH_INFO", "") or "/"
    query = environ.get("QUERY_STRING", "")
    target = path + (f"?{query}" if query else "")
    connection = UnixConnection(SOCKET_PATH)
    try:
        connection.request(environ["REQUEST_METHOD"], target, body, _request_headers(environ))
        response = connection.getresponse()
        content = response.read()
    except OSError as error:
        start_response("502 Bad Gateway", [("Content-Type", "text/plain")])
        return [f"slurm-medic is not answering on {SOCKET_PATH}: {error}\n".encode()]
    finally:
        connection.close()
    headers = [
        (name, value)
        for name, value in response.getheaders()
        if name.lower() not in HOP_BY_HOP and name.lower() != "content-length"
    ]
    headers.append(("Content-Length", str(len(content))))
    start_response(f"{response.status} {response.reason}", headers)
    return [content]
