"""What the forward pass over a job log's kept lines gathers: failure events, per-rank
tracebacks, srun's and torchrun's summaries, and the state they are read into.

Records only, with the constructors of the events that both the per-line analysis
(`log_analysis`, `log_tables`) and the choice of the root (`root_failure`) make: the analysis
fills a `ScanState`, the choice reads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from daemon.evidence.death_lines import death_cause, signal_of
from daemon.evidence.failures import HOST_RAM_KILLS, CascadeKind, cascade_kind, gpu_fault
from daemon.evidence.log_lines import EXCEPTION, matchable
from daemon.evidence.oom import parse_oom_as
from daemon.evidence.oom_family import detect_family
from daemon.evidence.records import GpuFault, OomFamily, OomReport, RootCause
from daemon.evidence.steps import ProgressTracker
from daemon.evidence.units import bounded_int

MAX_TRACEBACK_FRAMES = 1000  # a runaway traceback keeps its outer and inner ends
MAX_NOTES = 32
MAX_REPORT_CHARS = 2000  # of a launcher's line quoted as a host-RAM report


@dataclass(frozen=True)
class Frame:
    """A traceback frame: where the phase and the heavy kernel of a failure are read."""

    path: str
    func: str
    code: str = ""


@dataclass
class Event:
    """One failure line: an OOM, a GPU fault, another exception, a worker's death as its
    launcher reported it, a line of the cascade (timeouts, aborts, SIGTERMs), or a cancel of the
    whole job from outside (a time limit)."""

    offset: int
    kind: str  # "oom", "fault", "exception", "death", "cascade", "cancel"
    rank: int | None
    node: str | None
    text: str
    frames: tuple[Frame, ...] = ()
    error_type: str | None = None
    family: OomFamily | None = None  # of an "oom" event: which software ran out
    source: str = ""  # what its OOM report is read from, when it is wanted
    parsed: OomReport | None = None
    cause: RootCause | None = None  # what the failure was; None: no failure of its own
    local_rank: bool = False  # `rank` counts on its node (torchrun's agent, `--local_rank=N`)
    pid: int | None = None  # the process, where a prefix or the launcher's line names it
    exit_code: int | None = None
    signal: int | None = None
    fault: GpuFault | None = None
    cascade: CascadeKind | None = None
    launcher: str | None = None  # the launcher line that reported a death
    tasks: Tasks | None = None  # srun's task list of a death (`tasks 8-15: Exited ...`)
    line_index: int = 0  # the kept line it is on, counted from the first
    block: list[str] = field(default_factory=list)  # an OOM's next lines of the same rank

    def oom(self) -> OomReport | None:
        """The OOM report, parsed when first asked for: a log of thousands of OOM lines (every
        rank's, or a hostile one) needs the numbers of its root failure only."""
        if self.parsed is None and self.family is not None:
            text = self.source or self.text
            if self.family is OomFamily.HOST_RAM and detect_family(text) is not OomFamily.HOST_RAM:
                # a launcher's `return code = -9` names no OOM killer: the line is the message
                self.parsed = OomReport(family=self.family, message=text[:MAX_REPORT_CHARS])
            else:
                self.parsed = parse_oom_as(text, self.family)
        return self.parsed


@dataclass
class RankState:
    frames: list[Frame] = field(default_factory=list)
    in_traceback: bool = False

    def add_frame(self, frame: Frame) -> None:
        add_frame(self.frames, frame)


def add_frame(frames: list[Frame], frame: Frame) -> None:
    """Keep the outer and inner ends of a runaway traceback: phase and kernel are read there."""
    if len(frames) >= MAX_TRACEBACK_FRAMES:
        del frames[MAX_TRACEBACK_FRAMES // 2]
    frames.append(frame)


@dataclass(frozen=True)
class Tasks:
    """An srun task list as the ranges it printed, never expanded: `0-4095,0-4095` is one range."""

    ranges: tuple[tuple[int, int], ...]

    @property
    def first(self) -> int | None:
        return self.ranges[0][0] if self.ranges else None

    def __contains__(self, task: int) -> bool:
        return any(low <= task <= high for low, high in self.ranges)


@dataclass
class TableEntry:
    root_cause: bool
    offset: int = 0
    time: str | None = None  # `2023-06-03_22:45:01`: of two agents' tables, the earlier wins
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    exitcode: int | None = None
    pid: int | None = None
    traceback: str | None = None
    in_message: bool = False  # inside 1.9's `msg:` (the error file's JSON)
    complete: bool = False  # its last field (`traceback`, 1.9's `msg`) was read


@dataclass
class Wrapped:
    """The pieces of a launcher's hard-wrapped death line so far (`death_lines.WRAPPED_HEADS`)."""

    name: str
    offset: int
    line_index: int
    pieces: list[str]


@dataclass
class ScanState:
    """State of the forward pass over the kept lines."""

    step_patterns: tuple[re.Pattern[str], ...]
    events: list[Event] = field(default_factory=list)
    progress: ProgressTracker = field(init=False)  # steps and the phase the log lines show
    ranks: dict[int | None, RankState] = field(default_factory=dict)
    srun_errors: list[tuple[str, Tasks, str]] = field(default_factory=list)
    table: list[TableEntry] = field(default_factory=list)
    in_root_section: bool = False
    job_pids: set[int] = field(default_factory=set)
    rank_from_local_prefix: bool = False
    notes: list[str] = field(default_factory=list)
    line_index: int = 0  # of the line being analysed, counted from the first kept line
    block_rank: int | None = None  # inside Composer's `Begin global rank N STDERR` block
    prompt_hosts: list[str] = field(default_factory=list)  # hosts shell prompts named
    open_blocks: dict[int | None, list[Event]] = field(default_factory=dict)  # OOMs taking lines
    wrapped: Wrapped | None = None  # a launcher's death line whose end has not come yet

    def __post_init__(self) -> None:
        self.progress = ProgressTracker(self.step_patterns)

    def note(self, text: str) -> None:
        add_note(self.notes, text)

    def add_event(self, event: Event) -> None:
        """Record a failure line; a device OOM takes its rank's next lines (`event.block`)."""
        event.line_index = self.line_index
        self.events.append(event)
        if event.kind == "oom" and event.family is not OomFamily.HOST_RAM:
            self.open_blocks.setdefault(event.rank, []).append(event)

    def bounded(
        self, digits: str | None, limit: int, what: str, where: str = "a launcher's line"
    ) -> int | None:
        """A number a launcher printed, or None (noted) when it is beyond its plausible range."""
        if digits is None:
            return None
        value = bounded_int(digits, limit)
        if value is None:
            self.note(f"a {what} beyond {limit} in {where} was dropped")
        return value


def add_note(notes: list[str], text: str) -> None:
    """Each note once, and a bounded number of them: a hostile log repeats its oddities."""
    if text not in notes and len(notes) < MAX_NOTES:
        notes.append(text)


@dataclass(frozen=True)
class Who:
    """Which process a line speaks for, as far as the line says."""

    rank: int | None = None
    local: bool = False  # `rank` counts on its node
    node: str | None = None
    pid: int | None = None


def worker_death(
    offset: int,
    text: str,
    launcher: str,
    who: Who,
    *,
    exit_code: int | None,
    signal: int | None,
    out_of_memory: bool = False,
) -> Event:
    """A worker's death; a stop signal (SIGTERM from the launcher or Slurm) is the cascade."""
    signal = signal_of(exit_code, signal)
    cause = RootCause.HOST_RAM if out_of_memory else death_cause(exit_code, signal)
    return Event(
        offset,
        "death" if cause is not None else "cascade",
        who.rank,
        who.node,
        text,
        family=OomFamily.HOST_RAM if cause is RootCause.HOST_RAM else None,
        cause=cause,
        local_rank=who.local,
        pid=who.pid,
        exit_code=exit_code,
        signal=signal,
        cascade=None if cause is not None else CascadeKind.STOP,
        launcher=launcher,
    )


def explained_event(
    offset: int, text: str, frames: tuple[Frame, ...], who: Who, source: str = ""
) -> Event | None:
    """An OOM, a GPU fault or another exception: a failure that says what went wrong."""
    message = source or text
    family = OomFamily.HOST_RAM if HOST_RAM_KILLS.search(text) else detect_family(message)
    first_line = matchable(message.strip().split("\n", 1)[0])
    exception = EXCEPTION.match(first_line.strip())
    event = Event(
        offset,
        "exception",
        who.rank,
        who.node,
        text,
        frames,
        exception.group("type") if exception else None,
        local_rank=who.local,
        pid=who.pid,
    )
    if family is not None:
        event.kind, event.family, event.source = "oom", family, source
        host = family is OomFamily.HOST_RAM
        event.cause = RootCause.HOST_RAM if host else RootCause.ACCELERATOR_OOM
    elif (fault := gpu_fault(first_line)) is not None:
        event.kind, event.fault, event.cause = "fault", fault, RootCause.GPU_FAULT
    elif exception is not None and not _cascade_exception(exception, first_line):
        event.cause = RootCause.OTHER_ERROR
    else:
        return None
    return event


def _cascade_exception(exception: re.Match[str], line: str) -> bool:
    """An exception that reports another rank's failure: a timeout, a broken communicator, a
    stop signal in its words, or a cascade type (`ChildFailedError`, `DistBackendError`). A
    path in its message (`.../ProcessGroupNCCL.cpp:4043`) does not make an assert a cascade."""
    kind = cascade_kind(line)
    if kind is None:
        return False
    return kind is not CascadeKind.OTHER or cascade_kind(exception.group("type")) is not None
