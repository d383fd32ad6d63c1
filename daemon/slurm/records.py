"""Typed records of what Slurm says about jobs and nodes, independent of release and backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from daemon.slurm.errors import SlurmParseError

MEDIC_REASON_PREFIX = "medic:"

# What a number may be before a parser puts it in a record; anything beyond makes the record
# unreadable, never a wrong value. Slurm keeps job ids, array task ids and het offsets in
# 32 unsigned bits; the store keeps uids and exit codes in signed 32-bit columns.
MAX_JOB_ID = 2**32 - 1
MAX_UID = 2**31 - 1
MAX_COUNT = 2**31 - 1
MIN_EXIT_CODE = -(2**31)
MAX_EXIT_CODE = 2**31 - 1
MAX_SIGNAL = 255
# Epoch seconds a record may hold: after 1970 (Slurm's 0 means "not yet") and a day short of
# datetime's year 9999, so that any time zone's conversion of it stays in range.
MAX_EPOCH_SECONDS = 253_402_128_000  # 9999-12-30T00:00:00Z
# How much of an unreadable record's own text is kept: enough to see what Slurm printed, and a
# hostile record of megabytes still becomes a few kilobytes on the record.
RAW_CHARS = 4096


class JobState(StrEnum):
    """A job's base state as Slurm names it; `UNKNOWN` stands for a state newer than this code."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    RESIZING = "RESIZING"
    REVOKED = "REVOKED"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    UNKNOWN = "UNKNOWN"

    def is_terminal(self) -> bool:
        """True once the job can no longer run (an unknown state is not assumed to be final)."""
        return self not in _ACTIVE_STATES and self is not JobState.UNKNOWN

    @classmethod
    def parse(cls, text: str) -> JobState:
        """`CANCELLED by 0` and `FAILED+` style spellings map to their base state."""
        base = text.strip().split(" ", 1)[0].rstrip("+").upper()
        try:
            return cls(base)
        except ValueError:
            return cls.UNKNOWN


_ACTIVE_STATES = frozenset(
    {
        JobState.PENDING,
        JobState.RUNNING,
        JobState.SUSPENDED,
        JobState.COMPLETING,
        JobState.REQUEUED,
        JobState.RESIZING,
    }
)


class PathSource(StrEnum):
    """Where a job's stdout/stderr paths came from, so a reader knows how far to trust them."""

    ACCOUNTING = "accounting"
    # accounting kept only the pattern (23.11); slurm-medic expanded it (%N as the batch host)
    ACCOUNTING_PATTERN = "accounting-pattern"
    CONTROLLER = "controller"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class SlurmStep:
    """One step of a job (batch, extern, or an srun), as accounting recorded it."""

    step_id: str
    name: str
    state: JobState
    state_raw: str
    exit_code: int | None
    exit_signal: int | None
    nodes: tuple[str, ...]
    start_time: datetime | None
    end_time: datetime | None


@dataclass(frozen=True)
class SlurmJob:
    """A job as slurm-medic sees it. Times are timezone-aware UTC; names and comments untrusted."""

    job_id: int
    name: str
    user: str
    uid: int | None
    group: str | None
    account: str | None
    partition: str | None
    state: JobState
    state_raw: str
    exit_code: int | None
    exit_signal: int | None
    derived_exit_code: int | None
    derived_exit_signal: int | None
    nodes: tuple[str, ...]
    batch_host: str | None
    submit_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    stdout_path: str | None
    stderr_path: str | None
    work_dir: str | None
    comment: str | None
    restart_count: int = 0
    array_job_id: int | None = None
    array_task_id: int | None = None
    het_job_id: int | None = None
    het_job_offset: int | None = None
    steps: tuple[SlurmStep, ...] = field(default=())
    std_paths_source: PathSource = PathSource.UNKNOWN
    cluster: str | None = None
    killed_by: str | None = None
    # False for slurmdbd's placeholder record (name "allocation", group root, no partition,
    # the batch host as node list), made when a step's message beats the job's start record:
    # a job that ends within moments of starting reads that way for a while. Read it again.
    accounting_complete: bool = True

    @property
    def display_id(self) -> str:
        """The id a person types: `123_4` for an array task, `123+1` for a het component."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        if self.het_job_id is not None and self.het_job_offset is not None:
            return f"{self.het_job_id}+{self.het_job_offset}"
        return str(self.job_id)


@dataclass(frozen=True)
class RejectedRecord:
    """A record a parser could not read, kept beside the ones it could: one bad record
    never stops the rest, and it is never silently gone either."""

    source: str  # the command or format: "sacct --json (dbv0.0.38)", "scontrol show node"
    reason: str
    excerpt: str  # the record's raw text, cut as SlurmParseError cuts it
    record_id: str | None = None  # the job id or node name, when that much could be read
    raw: str = ""  # the record's whole text as `printable` keeps it (at most RAW_CHARS)
    raw_chars: int = 0  # the length of that text before it was cut

    @classmethod
    def of(
        cls, error: SlurmParseError, record_id: str | None = None, raw: str = ""
    ) -> RejectedRecord:
        return cls(error.source, error.reason, error.excerpt, record_id, printable(raw), len(raw))


def printable(text: str, limit: int = RAW_CHARS) -> str:
    """`text` as printable ASCII, at most `limit` characters: Python's unicode_escape writes a
    newline as `\\n`, a delimiter as `\\x1f`, a backslash as `\\\\`, so nothing Slurm printed
    (or a user put in a name) can break a log line or a terminal, and the text can be restored."""
    return text[:limit].encode("unicode_escape")[:limit].decode("ascii")


@dataclass(frozen=True)
class JobWindow:
    """The jobs one accounting query returned, and the records in it that could not be read:
    a caller that moves a cursor past the window knows (and can record) what it skips."""

    jobs: tuple[SlurmJob, ...]
    rejected: tuple[RejectedRecord, ...] = ()


@dataclass(frozen=True)
class QueuedJob:
    """A job slurmctld holds (live, or ended less than MinJobAge ago), with its owner."""

    job_id: int
    user: str
    comment: str
    # UNKNOWN where squeue named no state this code reads: never taken to have ended.
    state: JobState = JobState.UNKNOWN


class NodeBaseState(StrEnum):
    """A node's base state; flags such as DRAIN live beside it in `SlurmNode.flags`."""

    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    DOWN = "DOWN"
    ERROR = "ERROR"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class SlurmNode:
    """A node's state, flags and reason, with who set the reason and when."""

    name: str
    address: str | None
    state: NodeBaseState
    flags: frozenset[str]
    reason: str | None
    reason_user: str | None
    reason_time: datetime | None
    gres: str | None = None

    @property
    def is_drained(self) -> bool:
        return "DRAIN" in self.flags or "DRAINED" in self.flags or "DRAINING" in self.flags

    @property
    def drained_by_medic(self) -> bool:
        """Only drains whose reason slurm-medic wrote may be cleared by it."""
        return self.is_drained and (self.reason or "").startswith(MEDIC_REASON_PREFIX)
