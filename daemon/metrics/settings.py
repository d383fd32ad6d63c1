"""The `[metrics]` section: where the daemon serves its metrics (off unless `listen` is set)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, field_validator

# HOST:PORT, an IPv6 host in brackets; the host a name or an address, never a path or a URL.
_LISTEN = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(?P<port>[0-9]{1,5})\Z")


def split_listen(value: str) -> tuple[str, int]:
    """HOST:PORT as a socket binds it (port 0: any free port); ValueError names what is wrong."""
    match = _LISTEN.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not HOST:PORT")
    port = int(match["port"])
    if port > 65535:
        raise ValueError(f"port {port} is above 65535")
    return match["host"].strip("[]"), port


class MetricsSettings(BaseModel):
    """The daemon's /metrics: the record's numbers and its own (probes, Slurm command errors,
    cycles, leadership). Off by default: a port is the site's to choose and to firewall."""

    model_config = ConfigDict(frozen=True, extra="forbid", regex_engine="python-re")

    listen: str | None = None

    @field_validator("listen")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is not None and split_listen(value)[1] == 0:
            raise ValueError("port 0 is a different port at each start: Prometheus needs one")
        return value
