"""The `[web]` section: where `slurm-medic web` listens and whom it believes.

Over TCP the server believes a user name only from an authenticating reverse proxy: one of
`trusted_proxies` that also presents the shared secret read from `proxy_secret_file` (a
root-owned file, so the secret is never in a config that others may read). With no proxy
configured nobody is believed over TCP, and the unix socket (`socket`), where the kernel
names the peer, is the way in.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_LISTEN = "127.0.0.1:8765"
# An HTTP header name (RFC 9110 token), as the proxy sends it.
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}\Z")
_LISTEN = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(?P<port>[0-9]{1,5})\Z")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def split_listen(value: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as uvicorn takes it; ValueError names what is wrong."""
    match = _LISTEN.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not HOST:PORT")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not between 1 and 65535")
    return match["host"].strip("[]"), port


class WebSettings(BaseModel):
    """`slurm-medic web`: its address, its reverse proxy, and who may see whose runs."""

    model_config = ConfigDict(frozen=True, extra="forbid", regex_engine="python-re")

    listen: str = DEFAULT_LISTEN
    socket: Path | None = None
    trusted_proxies: tuple[Network, ...] = ()
    proxy_secret_file: Path | None = None
    # The header the proxy names the authenticated user in (X-Forwarded-User, or the header a
    # site maps REMOTE_USER to, e.g. X-Remote-User).
    user_header: str = Field(default="X-Forwarded-User")
    secret_header: str = Field(default="X-Slurm-Medic-Proxy-Secret")
    everyone_sees_all: bool = False
    # Connections (daemon/web/connections.py): at most this many open at once, and at most
    # max_connections_per_peer of them from one peer (a uid on the socket or over loopback,
    # an address over TCP), so that no one person can hold every slot. A proxy is one peer:
    # its concurrent requests are bounded by the cap too (the app runs 40 at a time anyway).
    max_connections: int = Field(default=1024, ge=1, le=65536)
    max_connections_per_peer: int = Field(default=64, ge=1)
    # Seconds a connection has to deliver a whole request once opened or answered (a client
    # that trickles its head or body is closed: slowloris), and to start its next request.
    read_timeout_s: float = Field(default=5.0, gt=0, le=300)
    keep_alive_s: int = Field(default=5, ge=1, le=300)
    # Answers on one connection before it is closed (`Connection: close`), so a keep-alive
    # connection cannot be held forever by asking again and again.
    max_requests_per_connection: int = Field(default=100, ge=1, le=100_000)

    @field_validator("listen")
    @classmethod
    def _listen_is_host_port(cls, value: str) -> str:
        split_listen(value)
        return value

    @field_validator("user_header", "secret_header")
    @classmethod
    def _is_header_name(cls, value: str) -> str:
        if not _HEADER.match(value):
            raise ValueError(f"{value!r} is not an HTTP header name")
        return value

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _networks(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            return tuple(ipaddress.ip_network(str(item), strict=False) for item in value)
        return value

    @field_validator("proxy_secret_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("must be an absolute path")
        return value

    @model_validator(mode="after")
    def _peer_cap_within_total(self) -> WebSettings:
        """One peer allowed the whole total could again keep everyone else out."""
        if self.max_connections_per_peer > self.max_connections:
            raise ValueError(
                "web.max_connections_per_peer is more than web.max_connections"
                f" ({self.max_connections_per_peer} > {self.max_connections})"
            )
        return self

    @model_validator(mode="after")
    def _proxies_need_the_secret(self) -> WebSettings:
        """A trusted proxy without a secret would let anyone on its host name any user."""
        if self.trusted_proxies and self.proxy_secret_file is None:
            raise ValueError("web.trusted_proxies needs web.proxy_secret_file")
        return self
