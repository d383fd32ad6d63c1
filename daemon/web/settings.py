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
    def _proxies_need_the_secret(self) -> WebSettings:
        """A trusted proxy without a secret would let anyone on its host name any user."""
        if self.trusted_proxies and self.proxy_secret_file is None:
            raise ValueError("web.trusted_proxies needs web.proxy_secret_file")
        return self
