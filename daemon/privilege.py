"""Whether this process runs as root for someone else (under sudo, or set-user/group-id), and
for whom.

Read from the kernel's ids and sudo's `SUDO_UID` alone, with no settings, so that the commands
that open no record (`diagnose --log`, `template`) can ask it without paying for pydantic; the
settings (`config.load_settings`) and the people's commands ask the same functions.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

# sudo's record of who ran it; believed only in a process whose real uid is root, which no
# one but root (or sudo acting for someone) can start.
SUDO_UID_ENV = "SUDO_UID"
_UID = re.compile(r"[0-9]{1,10}\Z")


@dataclass(frozen=True)
class ProcessIds:
    """The process's real and effective ids, as the kernel reports them."""

    uid: int
    euid: int
    gid: int
    egid: int

    @classmethod
    def current(cls) -> ProcessIds:
        return cls(uid=os.getuid(), euid=os.geteuid(), gid=os.getgid(), egid=os.getegid())


def sudo_caller(environ: Mapping[str, str], real_uid: int) -> int | None:
    """The uid that ran sudo when this root process runs for them; None for anyone else.

    Believed only when the real uid is root: a user may set SUDO_UID in their own
    environment, but only sudo starts a root process for them. A SUDO_UID that is not
    ASCII digits was not written by sudo, so it is ignored.
    """
    raw = environ.get(SUDO_UID_ENV, "")
    if real_uid != 0 or not _UID.match(raw) or int(raw) == 0:
        return None
    return int(raw)


def confinement(environ: Mapping[str, str], ids: ProcessIds | None = None) -> str | None:
    """Why this process runs as root for someone else (and so must take policy and record
    from the system config alone, and read nobody's files as root for them).

    None when it runs as itself: really root, or a user with only their own rights.
    """
    ids = ProcessIds.current() if ids is None else ids
    if ids.uid != ids.euid or ids.gid != ids.egid:
        return (
            f"slurm-medic runs set-user/group-id (real uid {ids.uid}, effective uid {ids.euid},"
            f" real gid {ids.gid}, effective gid {ids.egid})"
        )
    caller = sudo_caller(environ, ids.uid)
    if caller is not None:
        return f"slurm-medic runs as root under sudo for uid {caller}"
    return None
