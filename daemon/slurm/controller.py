"""What Slurm says about itself: the client's release and slurmctld's running configuration.

Argv builders and parsers only; the caller runs them through the subprocess seam.
`scontrol --version` needs no daemon; `scontrol show config` is slurmctld's own view of its
configuration (what it runs with now, not what a slurm.conf on this host may say), printed as
`Key = Value` lines on every release, 22.05 to 26.05.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from daemon.slurm.errors import SlurmParseError

VERSION_ARGV = ("scontrol", "--version")
SHOW_CONFIG_ARGV = ("scontrol", "show", "config")
# Far above the ~220 lines 22.05 prints; a bound before anything is read.
MAX_CONFIG_TEXT = 4 * 1024 * 1024
NULL = "(null)"
# `slurm-wlm 22.05.8` (Debian), `slurm 23.11.4` (SchedMD's packages).
_RELEASE = re.compile(r"\bslurm(?:-wlm)?\s+(?P<release>[0-9]{2}\.[0-9]{2}\.[0-9]+[0-9A-Za-z.-]*)")
_NUMBERS = re.compile(r"(?P<major>[0-9]{2})\.(?P<minor>[0-9]{2})")
# `SlurmctldHost[0]        = vm(10.77.0.1)`: the key is padded to a column, the value runs on.
_LINE = re.compile(r"(?P<key>[A-Za-z][A-Za-z0-9_\[\]/.-]*)\s+=(?: (?P<value>.*))?\Z")
_USER = re.compile(r"(?P<name>[^\s(]+)\((?P<uid>[0-9]{1,10})\)\Z")


def parse_release(text: str) -> str | None:
    """The release `scontrol --version` names, or None when it names none."""
    match = _RELEASE.search(text)
    return match.group("release") if match else None


def release_number(release: str) -> tuple[int, int] | None:
    """`22.05.8` -> (22, 5): the part that says which release line it is."""
    match = _NUMBERS.match(release)
    return (int(match.group("major")), int(match.group("minor"))) if match else None


@dataclass(frozen=True)
class ControllerConfig:
    """slurmctld's configuration as `scontrol show config` printed it; `(null)` reads as None."""

    values: Mapping[str, str]

    def get(self, key: str) -> str | None:
        value = self.values.get(key)
        return None if value in (None, "", NULL) else value

    @property
    def release(self) -> str | None:
        return self.get("SLURM_VERSION")

    @property
    def controller_host(self) -> str | None:
        return self.get("SlurmctldHost[0]")

    @property
    def accounting_address(self) -> str | None:
        """`host:port` of slurmdbd, as slurmctld and sacct reach it."""
        host = self.get("AccountingStorageHost")
        port = self.get("AccountingStoragePort")
        if host is None:
            return None
        return f"{host}:{port}" if port else host

    @property
    def store_flags(self) -> tuple[str, ...]:
        return _listed(self.get("AccountingStoreFlags"))

    @property
    def epilog_slurmctld(self) -> tuple[str, ...]:
        """The programs slurmctld runs when a job ends (newer releases take a list)."""
        return _listed(self.get("EpilogSlurmctld"))

    @property
    def slurm_user(self) -> tuple[str, int] | None:
        """The SlurmUser (name, uid): slurmctld runs EpilogSlurmctld as it."""
        value = self.get("SlurmUser")
        match = _USER.match(value) if value else None
        return (match.group("name"), int(match.group("uid"))) if match else None


def parse_show_config(text: str) -> ControllerConfig:
    """Every `Key = Value` line; the first of a key wins (slurm.conf's own section comes
    before the cgroup and plugin sections, whose keys could repeat one of it)."""
    source = "scontrol show config"
    if len(text) > MAX_CONFIG_TEXT:
        raise SlurmParseError(
            f"{len(text)} characters is more than {MAX_CONFIG_TEXT}", source=source
        )
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match is not None:
            values.setdefault(match.group("key"), (match.group("value") or "").strip())
    if not values:
        raise SlurmParseError("no `Key = Value` line", source=source, excerpt=text)
    return ControllerConfig(values)


def _listed(value: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())
