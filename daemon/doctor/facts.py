"""What `doctor` found on this host, one record per item, before anything is judged.

Plain data: the gathering fills it through the seams, the judging reads it, and the tests
build it from real outputs. An item whose gathering ran past its time, or broke, is a
`NoAnswer` instead; an item that needs the config is None when the config does not load.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from daemon.evidence.prober import ProbeSettings


@dataclass(frozen=True)
class NoAnswer:
    """The gathering of an item did not finish within its time, or failed in itself."""

    waiting_on: str  # what it was waiting for, in words
    seconds: float
    error: str | None = None  # the gathering's own fault; None: it ran out of time


@dataclass(frozen=True)
class CommandAnswer:
    """How one command ended: its exit and output, or why it never got to an exit."""

    argv: tuple[str, ...]
    returncode: int | None  # None: it could not start, or ran past its time
    stdout: str = ""
    stderr: str = ""
    failure: str | None = None  # could not start, timed out (the seam's words)
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.failure is None

    def said(self) -> str:
        """The last thing it said: stderr's last line, else stdout's, else why it stopped."""
        for stream in (self.stderr, self.stdout):
            lines = [line.strip() for line in stream.splitlines() if line.strip()]
            if lines:
                return lines[-1]
        return self.failure or f"exit {self.returncode}"


@dataclass(frozen=True)
class ConfigFact:
    path: Path
    exists: bool
    error: str | None = None  # why it does not load; None when it does


@dataclass(frozen=True)
class RecordFact:
    location: str  # the SQLite file, or the URL without its password
    head: str  # this code's schema revision
    revision: str | None = None  # the record's; None: no schema
    known: bool = True  # the revision is one of this code's migrations
    missing: bool = False  # no SQLite file there
    error: str | None = None  # the record cannot be opened or read


@dataclass(frozen=True)
class SlurmFacts:
    """`scontrol --version` (the client) and `scontrol show config` (slurmctld)."""

    version: CommandAnswer
    show_config: CommandAnswer
    timeout_s: float


class AccountingError(StrEnum):
    UNAVAILABLE = "unavailable"  # slurmdbd (or slurmctld) did not answer, or refused
    FAILED = "failed"  # sacct ran and failed for another reason
    UNREADABLE = "unreadable"  # sacct answered with something this code cannot read


@dataclass(frozen=True)
class AccountingFact:
    """The daemon's own poll of finished jobs (sacct), over the last `window_s`."""

    window_s: float
    jobs: int | None = None  # jobs that ended in the window, when sacct answered
    error: AccountingError | None = None
    said: str = ""  # what sacct said last, when it failed


class ProbeOutcome(StrEnum):
    ANSWERED = "answered"  # the node's forced command ran and exited 0
    NO_NODE = "no_node"  # no node to probe (slurmctld lists none, or cannot be asked)
    KEY_UNSAFE = "key_unsafe"  # others may read or replace the key: refused before use
    KEY_UNREADABLE = "key_unreadable"  # the key or known_hosts cannot be read
    UNKNOWN_HOST = "unknown_host"  # the node is not in known_hosts
    HOST_KEY_CHANGED = "host_key_changed"
    KEY_REFUSED = "key_refused"  # the node's sshd refused the key
    UNREACHABLE = "unreachable"  # no SSH session: refused, no route, handshake failed
    TIMED_OUT = "timed_out"  # the probe ran past command_timeout_s
    TOO_MUCH_OUTPUT = "too_much_output"
    PROBE_EXIT = "probe_exit"  # the probe program ran and exited non-zero


@dataclass(frozen=True)
class ProbeFact:
    """One real probe of one node, as the daemon would run it; `settings` None: no [probe]."""

    settings: ProbeSettings | None
    node: str | None = None
    chosen_by: str = ""  # how the node was picked, in words
    outcome: ProbeOutcome | None = None
    detail: str = ""  # the SSH layer's words, or the probe program's stderr
    document: str | None = None  # what the probe printed, when it answered
    probed_at: datetime | None = None
    duration_s: float = 0.0


@dataclass(frozen=True)
class ProgramFile:
    """One program EpilogSlurmctld names, as this host has it."""

    path: str
    exists: bool
    regular: bool = False
    mode: int = 0
    uid: int = -1
    gid: int = -1
    text: str = ""  # its first bytes: is it, or does it call, slurm-medic's hook?
    error: str | None = None  # it is there but cannot be read


@dataclass(frozen=True)
class EpilogFact:
    programs: tuple[ProgramFile, ...]  # in EpilogSlurmctld's order
    slurm_user_groups: tuple[int, ...]  # the SlurmUser's group ids (who may execute)
    hook_default: Path  # where the hook sends unless SLURM_MEDIC_HOOK_SOCKET says otherwise
    hook_socket: Path | None = None  # where the config says the daemon listens (None: no config)
    poll_interval_s: float | None = None  # how late the daemon learns of a job's end without it


class SocketState(StrEnum):
    ANSWERS = "answers"  # something listens (and, for the web, answered HTTP)
    MISSING = "missing"
    NOT_A_SOCKET = "not_a_socket"
    REFUSED = "refused"  # a socket file nobody listens on
    NO_ANSWER = "no_answer"  # connected, or tried to, and heard nothing in time
    FAILED = "failed"  # anything else (permissions, a bad address), in `detail`


@dataclass(frozen=True)
class HookFact:
    path: Path
    state: SocketState
    detail: str = ""


@dataclass(frozen=True)
class WebFact:
    """`slurm-medic web` where the config says it listens; `configured` False: no [web]."""

    configured: bool
    where: str = ""  # the socket's path, or http://HOST:PORT
    state: SocketState | None = None
    status: int | None = None  # the HTTP status of /healthz, when it answered
    detail: str = ""


@dataclass(frozen=True)
class Facts:
    """Everything gathered; an item that needs the config is None when the config failed."""

    config: ConfigFact
    record: RecordFact | NoAnswer | None
    slurm: SlurmFacts | NoAnswer
    accounting: AccountingFact | NoAnswer
    probe: ProbeFact | NoAnswer | None
    epilog: EpilogFact | NoAnswer
    hook: HookFact | NoAnswer | None
    web: WebFact | NoAnswer | None
