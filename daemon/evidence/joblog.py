"""The job-log scanner: who failed first, where, at which step, in which phase, and how.

A dead job's log can be many gigabytes; the failure is nearly always near its end, but the
cascade after it (watchdog dumps, flight-recorder lines, SIGTERM tables of thousands of ranks)
can fill hundreds of megabytes. The scanner reads backwards from the end in windows of
`DEFAULT_BLOCK_SIZE` (one `pread` each) and never holds the whole file:

1. The last `TAIL_FULL_BYTES` are read line by line (the ChildFailedError table, srun's
   `srun: error:` lines, the cascade of collective timeouts and the last progress line live
   there).
2. Further back it searches each window for three literal byte strings (`Error`, `emory`,
   `xception`) in C: a memchr for each one's rarest byte, an `rfind` pass where that byte is
   there (3 to 10 GiB/s on training logs, about the rate of `grep -F` for one string). Only
   the lines around a hit are cut out, decoded and matched; a cascade's repeated line shapes
   are judged once each, and of its lines only the `MAX_FAR_LINES` nearest the root are kept.
3. Once a root failure is found it reads every line again for up to `LOOKBEHIND_BYTES` before
   the earliest one: the traceback frames and the step marker come before the error line.

It stops at the start of the file, at the byte budget (how far back it may look), or when the
root failure, its traceback and a step before it are all in hand: a failure at the end costs
its tail only, whatever the log's size. Then it reads the kept lines forward,
tracking each rank's traceback separately (lines of different ranks interleave), and takes
the earliest root failure: an OOM, a GPU fault or another exception, or a worker's death as its
launcher reported it (`launchers.DEATH_LINES`, torchrun's Root Cause table, srun's task lines).
The cascade it sets off (collective timeouts, broken communicators, the launcher's SIGTERMs;
`failures.CASCADES`) is the root only when nothing else failed, and after a cancel of the whole
job (a time limit) nothing is.

Its work is bounded whatever the log holds (a user writes it, and the daemon may scan it as
root): every pattern runs in linear time and sees at most twice `MATCH_CHARS` of a line; at most
`MAX_KEPT_LINES` lines and `MAX_KEPT_BYTES` bytes are kept for the forward pass; task lists stay
ranges, never expanded; a number beyond its plausible range is dropped with a note; and each
scan has a time limit, past which it returns what it found with a note that it was cut short.

Input it treats as normal: ANSI colour codes, tqdm's `\\r` redraws, every launcher's and log
viewer's line prefixes (`launchers.PREFIXES`: timestamps, srun's `3: `, torchrun's `[rank3]:`
and `[default3]:`, pdsh's `host: `, Ray's `(pid=N, ip=IP)`, glog heads...), partial last
lines, invalid UTF-8 (replaced), lines of many megabytes (cut to their first and last
`LINE_KEEP_BYTES`), binary garbage (noted). Only regular files are read: a FIFO or a device
is refused with `LogReadError` before any read, so nothing can block. Symlinks are refused
unless `follow_symlinks=True`: the daemon reads a job's log with rights that may exceed the
job owner's, and a link planted in an output directory must not make it read another file.
"""

from __future__ import annotations

import bisect
import errno
import json
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import BinaryIO, NamedTuple

from daemon.evidence.failures import (
    CANCEL,
    CASCADES,
    HOST_RAM_KILLS,
    CascadeKind,
    cascade_kind,
    gpu_fault,
)
from daemon.evidence.launchers import (
    C10_MESSAGE_RANK,
    DEATH_DETAILS,
    DEATH_LINES,
    DEFAULT_GROUP,
    DETAIL_WITHIN_LINES,
    MAX_PREFIXES,
    PREFIXES,
    RANK_BLOCK_END,
    RANK_BLOCK_START,
    SHELL_PROMPT,
    SIGKILL,
    SIGNALS,
    SRUN_ERROR,
    SRUN_EXIT,
    WRAPPED_CHARS,
    WRAPPED_HEADS,
    WRAPPED_WITHIN_LINES,
    RankKind,
    death_cause,
    signal_of,
)
from daemon.evidence.oom import (
    detect_family,
    host_ram_is_certain,
    nccl_request_bytes,
    parse_oom_as,
    parse_oom_block,
)
from daemon.evidence.phases import decide_phase, phase_of_frames
from daemon.evidence.records import (
    MAX_PID,
    MAX_RANK,
    GpuFault,
    LogFindings,
    OomFamily,
    OomReport,
    RootCause,
)
from daemon.evidence.steps import DEFAULT_STEP_PATTERNS, ProgressTracker, StepMark, find_step
from daemon.evidence.units import bounded_int
from daemon.slurm.records import MAX_EXIT_CODE

MIB = 1024 * 1024
DEFAULT_BLOCK_SIZE = 4 * MIB  # a window read with one pread and searched at once
# How far back from the end a scan may look. The failure of a dead job is nearly always in its
# last few MB, but the cascade after it (watchdog dumps, flight-recorder lines, SIGTERM tables
# of thousands of ranks) can be hundreds of MB; the time limit bounds the work anyway.
DEFAULT_BYTE_BUDGET = 4 * 1024 * MIB
TAIL_FULL_BYTES = MIB  # summaries (tables, srun errors, cascades) are printed last
LOOKBEHIND_BYTES = 4 * MIB  # how far before the earliest root failure to look for frames and steps
MIN_LOOKBEHIND_BYTES = 256 * 1024  # at least this much, to catch another rank failing a bit earlier
LINE_KEEP_BYTES = 64 * 1024  # of a longer line, keep this much of its head and of its tail
MAX_JSON_CHARS = MIB  # an elastic error file is small; a bigger "JSON" line is not one
FOLLOWER_LINES = 16  # kept after a failure line found far from the end (its continuation)
FOLLOWER_BYTES = 32 * 1024  # within this many bytes after it
HEAVY_KERNEL_FRAMES = 6  # the allocation happened in the innermost frames, not in the caller chain
BINARY_SHARE = 0.3  # above this share of control characters the log is noted as binary
# Of a longer line (of its last `\r` redraw), only the first and the last 8 KB are matched
# against the per-line patterns: every failure line we read fits, and no line costs more.
MATCH_CHARS = 8 * 1024
# What the forward pass holds: a real tail (1 MB) and look-behind (4 MB) of short lines stays
# well within both; a log of millions of tiny or trigger-holding lines stops here.
MAX_KEPT_LINES = 100_000
MAX_KEPT_BYTES = 16 * MIB
# Trigger lines between the tail and the root failure's look-behind (a cascade): the earliest
# this many are kept for the forward pass (and as many lines after them), the rest counted.
MAX_FAR_LINES = 2000
MAX_FAR_BYTES = MIB  # of the lines after them
# Far from the end each trigger line is classified once per shape (`_CandidateMemo`): keys of
# lines up to this long, up to about this many bytes of memo before it starts again.
MEMO_LINE_BYTES = 4096
MEMO_BYTES = 4 * MIB
MEMO_ENTRY_BYTES = 160  # a dict slot, a bytes object and a tuple, besides the key's own bytes
MAX_TRACEBACK_FRAMES = 1000  # a runaway traceback keeps its outer and inner ends
MAX_TASK_RANGES = 64  # srun prints a node's tasks as a few ranges (`0-3,5`)
MAX_SRUN_ERRORS = 4096  # one `srun: error:` line per node and failure
MAX_TABLE_ENTRIES = 4096  # one entry per failed worker of a node's agent
MAX_NOTES = 32
MAX_REPORT_CHARS = 2000  # of a launcher's line quoted as a host-RAM report
DEFAULT_TIME_LIMIT = 20.0  # seconds; a real log of gigabytes is scanned in a few
READ_SHARE = 0.5  # of the time limit, for reading backwards; the rest is the analysis's

# Literal byte strings that a root failure line far from the end holds one of, searched for
# per window at C speed: `Error` (every exception line but a bare `Exception:`, and cuBLAS,
# cuDNN, XLA wrapped in them), `emory` (every "out of memory", "Out Of Memory",
# OutOfMemoryError, NCCL's "Cuda failure 'out of memory'"), `xception`. Each literal costs a
# memchr for its rarest byte per window and, where that byte is there, one `rfind` pass, so
# keep them few; Slurm's and the shell's own lines (`srun: error:`, `Killed`) are printed when
# the job ends, inside the tail that is read line by line anyway.
# Bytes every root failure's line holds, searched for far from the end: exceptions and OOM
# messages, and the GPU faults and lost-first-words OOM lines that hold none of the first three
# (`Xid 79`, `unspecified launch failure`, `uncorrectable ECC error`, `Tried to allocate`).
_ROOT_TRIGGERS = (
    b"Error",
    b"emory",
    b"xception",
    b"Xid",
    b"launch failure",
    b"fallen off",
    b"ECC error",
    b"Tried to allocate",
)
# Bytes from the most to the least common in training logs (blanks, digits, punctuation, then
# letters by English frequency, lower case first): a trigger's anchor is its byte that comes
# last here (or is not here at all), the one that most windows of ordinary lines lack.
_BYTE_COMMONNESS = (
    b" 0123456789.:,;/-_|'\"=[](){}%#<>etaoinsrhldcumfpgwybvkxjqzETAOINSRHLDCUMFPGWYBVKXJQZ"
)


def _anchor(trigger: bytes) -> bytes:
    def commonness(byte: int) -> int:
        index = _BYTE_COMMONNESS.find(byte)
        return len(_BYTE_COMMONNESS) if index < 0 else index

    return bytes([max(trigger, key=commonness)])


_TRIGGER_ANCHORS = tuple((trigger, _anchor(trigger)) for trigger in _ROOT_TRIGGERS)
# What tells a cascade's lines of one shape apart (ranks, sequence numbers, process ids,
# timestamps, hex addresses): all 0 in `_CandidateMemo`'s keys, which keep the lengths.
_SHAPE = bytes.maketrans(b"0123456789abcdef", b"0" * 16)
_UNIFORM_DIGITS = tuple(
    bytes.maketrans(b"0123456789", bytes([digit]) * 10) for digit in b"0123456789"
)
_CUT = b" [...] "  # where the middle of a long line was cut out
_TRACEBACK_START = "Traceback (most recent call last):"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# Any of the launchers' prefixes in one pattern, one group per prefix: a line is tested once at
# C speed, and the group that matched says which prefix to read the rank and host from.
_ANY_PREFIX = re.compile(
    "|".join(f"({re.sub(r'[(][?]P<[a-z]+>', '(?:', p.pattern.pattern)})" for p in PREFIXES)
)
_NCCL_HOST = re.compile(r"^(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\]")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+, in (?P<func>[\w<>.]+)')
# The lookbehind starts a path only where a run of path characters starts: linear time.
_RICH_FRAME = re.compile(r"(?<![\w./\\\-])(?P<path>[\w./\\\-]+\.py):\d+\s+in\s+(?P<func>[\w<>]+)")
_EXCEPTION = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Exhausted))"
    r"(?::\s?(?P<message>.*))?\Z"
)
_ROOT_SECTION = re.compile(r"Root Cause(?: \(first observed failure\))?:\s{0,8}\Z")
_TABLE_ENTRY = re.compile(r"^\s*\[(\d+)\]:\s*\Z")
# torchrun's ChildFailedError table, every era: 1.9's `  rank: 0 (local_rank: 0)` and `  msg:`
# with the error file's JSON below it (sample 043), 1.10+'s aligned `  rank      : 0` (001, 044;
# torch/distributed/elastic/multiprocessing/errors/__init__.py `_FAILURE_FORMAT_TEMPLATE`).
_TABLE_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback|msg)\s*:\s?(.*)\Z")
# An entry's first field, which starts an entry where the excerpt lost its `[i]:` line.
_TABLE_TIME = re.compile(r"^\s{0,8}time\s{0,8}:\s?[0-9]{4}-[0-9]{2}-[0-9]{2}_[0-9]{2}:[0-9]{2}")
_TABLE_RANK = re.compile(r"(-?[0-9]+)(?: \(local_rank: ([0-9]+)\))?")
_TABLE_EXIT = re.compile(r"(-?[0-9]+)(?: \(pid: ([0-9]+)\))?")
_TABLE_SIGNAL = re.compile(r"^Signal ([0-9]{1,3}) \(SIG[A-Z0-9]{1,10}\) received by PID")
# The `"message": "RuntimeError: ..."` line of the error file's JSON under `msg:`: a JSON string,
# read whole (its escapes are undone by the JSON parser).
_TABLE_MESSAGE = re.compile(r'^\s{0,64}"message":\s?(?P<string>"(?:[^"\\]|\\.){0,8192}")')
_CLOSING_SIGNAL = re.compile(r"Sending process ([0-9]+) closing signal")
_ELASTIC_PID = re.compile(r"local_rank: [0-9]{1,7} \(pid: ([0-9]{1,10})\)")
# Cascade lines (any kind), for the reading side's test of a root failure far from the end.
_CASCADE = re.compile("|".join(f"(?:{pattern.pattern})" for _, pattern in CASCADES))
_TABLE = "torchrun's failure table"
_EXPLAINED = frozenset({"oom", "fault", "exception"})  # failures that say what went wrong
# TorchScript re-raises an error inside a scripted function under this sentence, then prints
# its own traceback (`~~~~ <--- HERE` markers) and the original error last
# (torch/csrc/jit/runtime/interpreter.cpp, handleError; tests/data/real/oom/144): the wrapper
# says no why, the error after it does.
_WRAPPER_EXCEPTION = re.compile(r"The following operation failed in the TorchScript interpreter")
OOM_BLOCK_LINES = 8  # lines after an OOM line of the same rank that may continue its message
MAX_PROMPT_HOSTS = 8
_CONTROL_CHARS = dict.fromkeys(code for code in range(32) if chr(code) not in "\t\r\x1b")

_HEAVY_KERNELS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"attn|attention|sdpa|scaled_dot_product|flash_", re.IGNORECASE)),
    (
        "moe_dispatch",
        re.compile(r"moe|experts?\b|dispatch|all_?to_?all|permut|grouped_gemm|router", re.I),
    ),
    (
        "cublas_matmul",
        re.compile(
            r"\blinear\b|matmul|\bbmm\b|baddbmm|addmm|cublas|\bmm\(|(?<!grouped_)gemm", re.I
        ),
    ),
    ("cudnn_conv", re.compile(r"conv[123]d|_conv_forward|convolution|cudnn", re.IGNORECASE)),
)


class LogReadError(Exception):
    """The log cannot be read as a regular file (missing, a FIFO, a symlink, no permission)."""


@dataclass(frozen=True)
class _Frame:
    path: str
    func: str
    code: str = ""


@dataclass
class _Event:
    """One failure line: an OOM, a GPU fault, another exception, a worker's death as its
    launcher reported it, a line of the cascade (timeouts, aborts, SIGTERMs), or a cancel of the
    whole job from outside (a time limit)."""

    offset: int
    kind: str  # "oom", "fault", "exception", "death", "cascade", "cancel"
    rank: int | None
    node: str | None
    text: str
    frames: tuple[_Frame, ...] = ()
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
    tasks: _Tasks | None = None  # srun's task list of a death (`tasks 8-15: Exited ...`)
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
class _RankState:
    frames: list[_Frame] = field(default_factory=list)
    in_traceback: bool = False

    def add_frame(self, frame: _Frame) -> None:
        _add_frame(self.frames, frame)


def _add_frame(frames: list[_Frame], frame: _Frame) -> None:
    """Keep the outer and inner ends of a runaway traceback: phase and kernel are read there."""
    if len(frames) >= MAX_TRACEBACK_FRAMES:
        del frames[MAX_TRACEBACK_FRAMES // 2]
    frames.append(frame)


@dataclass(frozen=True)
class _Tasks:
    """An srun task list as the ranges it printed, never expanded: `0-4095,0-4095` is one range."""

    ranges: tuple[tuple[int, int], ...]

    @property
    def first(self) -> int | None:
        return self.ranges[0][0] if self.ranges else None

    def __contains__(self, task: int) -> bool:
        return any(low <= task <= high for low, high in self.ranges)


@dataclass(frozen=True)
class _Deadline:
    """The scan's time limit: reading back may use `READ_SHARE` of it, the analysis the rest."""

    clock: Callable[[], float]
    start: float
    limit: float

    def passed(self, share: float = 1.0) -> bool:
        return self.clock() - self.start >= self.limit * share


@dataclass
class _TableEntry:
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
class _Wrapped:
    """The pieces of a launcher's hard-wrapped death line so far (`launchers.WRAPPED_HEADS`)."""

    name: str
    offset: int
    line_index: int
    pieces: list[str]


@dataclass
class _Analysis:
    """State of the forward pass over the kept lines."""

    step_patterns: tuple[re.Pattern[str], ...]
    events: list[_Event] = field(default_factory=list)
    progress: ProgressTracker = field(init=False)  # steps and the phase the log lines show
    ranks: dict[int | None, _RankState] = field(default_factory=dict)
    srun_errors: list[tuple[str, _Tasks, str]] = field(default_factory=list)
    table: list[_TableEntry] = field(default_factory=list)
    in_root_section: bool = False
    job_pids: set[int] = field(default_factory=set)
    rank_from_local_prefix: bool = False
    notes: list[str] = field(default_factory=list)
    line_index: int = 0  # of the line being analysed, counted from the first kept line
    block_rank: int | None = None  # inside Composer's `Begin global rank N STDERR` block
    prompt_hosts: list[str] = field(default_factory=list)  # hosts shell prompts named
    open_blocks: dict[int | None, list[_Event]] = field(default_factory=dict)  # OOMs taking lines
    wrapped: _Wrapped | None = None  # a launcher's death line whose end has not come yet

    def __post_init__(self) -> None:
        self.progress = ProgressTracker(self.step_patterns)

    def note(self, text: str) -> None:
        _note(self.notes, text)


def _note(notes: list[str], text: str) -> None:
    """Each note once, and a bounded number of them: a hostile log repeats its oddities."""
    if text not in notes and len(notes) < MAX_NOTES:
        notes.append(text)


def scan_log(
    source: str | os.PathLike[str] | int | BinaryIO,
    *,
    step_pattern: str | re.Pattern[str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    byte_budget: int = DEFAULT_BYTE_BUDGET,
    follow_symlinks: bool = False,
    time_limit: float = DEFAULT_TIME_LIMIT,
    clock: Callable[[], float] = time.monotonic,
) -> LogFindings:
    """Scan a job log from its end; raise `LogReadError` if it is not a readable regular file.

    `source` is a path, an open descriptor (the caller's to close; the owner's reader opens the
    log itself and hands its descriptor over) or a seekable binary stream. The scan looks back
    at most `byte_budget` bytes from the end, reading `block_size` bytes at a time. Past
    `time_limit` seconds (by `clock`) it stops and returns what it found, noted.
    """
    if block_size < 4096:
        raise ValueError(f"block_size must be at least 4096 bytes, got {block_size}")
    if byte_budget < 1:
        raise ValueError(f"byte_budget must be at least 1 byte, got {byte_budget}")
    patterns = _step_patterns(step_pattern)
    deadline = _Deadline(clock, clock(), time_limit)
    if isinstance(source, int):
        mode = os.fstat(source).st_mode
        if not stat.S_ISREG(mode):
            raise LogReadError(f"the log is not a regular file ({_file_kind(mode)})")
        return _scan(_FdReader(source), patterns, block_size, byte_budget, deadline)
    if isinstance(source, (str, os.PathLike)):
        fd = _open_regular(os.fspath(source), follow_symlinks=follow_symlinks)
        try:
            return _scan(_FdReader(fd), patterns, block_size, byte_budget, deadline)
        finally:
            os.close(fd)
    if not source.seekable():
        raise LogReadError("the log stream is not seekable: pass a regular file")
    return _scan(_StreamReader(source), patterns, block_size, byte_budget, deadline)


def _step_patterns(step_pattern: str | re.Pattern[str] | None) -> tuple[re.Pattern[str], ...]:
    if step_pattern is None:
        return DEFAULT_STEP_PATTERNS
    compiled = re.compile(step_pattern) if isinstance(step_pattern, str) else step_pattern
    if compiled.groups < 1:
        raise ValueError("step_pattern needs a group that captures the step number")
    return (compiled,)


def _open_regular(path: str, *, follow_symlinks: bool) -> int:
    """Open without blocking (a FIFO would) and without following a final symlink."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP and not follow_symlinks:
            raise LogReadError(
                f"{path} is a symlink; it is read only when following is asked for"
            ) from error
        raise LogReadError(f"cannot open {path}: {error.strerror}") from error
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LogReadError(
            f"{path} is not a regular file ({_file_kind(mode)}); refusing to read it"
        )
    return fd


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


class _FdReader:
    """`pread` on a descriptor: no shared offset, and a file cut short under it gives a short
    read (a memory map of it would give SIGBUS, and count against the reader's address-space
    limit); the copy costs less than a tenth of the search."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.size = os.fstat(fd).st_size

    def read_at(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)


class _StreamReader:
    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.size = stream.seek(0, os.SEEK_END)

    def read_at(self, offset: int, length: int) -> bytes:
        self._stream.seek(offset)
        return self._stream.read(length)


def _scan(
    reader: _FdReader | _StreamReader,
    step_patterns: tuple[re.Pattern[str], ...],
    block_size: int,
    byte_budget: int,
    deadline: _Deadline,
) -> LogFindings:
    size = reader.size
    if size == 0:
        return LogFindings(notes=("the log is empty",))
    if size <= MAX_JSON_CHARS:
        whole = _decode(reader.read_at(0, size)).strip()
        if whole.startswith("{") and '"message"' in whole:
            analysis = _Analysis(step_patterns=step_patterns)
            _elastic_json(analysis, 0, None, None, whole)
            if analysis.events:
                return _findings(analysis, size)
    kept, scanned, notes = _collect_backward(
        reader, size, block_size, byte_budget, step_patterns, deadline=deadline
    )
    analysis = _Analysis(step_patterns=step_patterns, notes=notes)
    for index, (offset, text) in enumerate(kept):
        if deadline.passed():
            analysis.notes.append(  # not `note`: this one must be said even past MAX_NOTES
                f"the scan was cut short at its {deadline.limit:g} s time limit: only the first"
                f" {index} of the {len(kept)} lines kept were analysed"
            )
            break
        _analyse_line(analysis, offset, text)
    return _findings(analysis, scanned)


def _collect_backward(
    reader: _FdReader | _StreamReader,
    size: int,
    block_size: int,
    byte_budget: int,
    step_patterns: tuple[re.Pattern[str], ...],
    *,
    deadline: _Deadline,
) -> tuple[list[tuple[int, str]], int, list[str]]:
    """Walk back from the end; return the lines worth analysing (file order) and what was read.

    Kept: every line of the tail and of the look-behind before a root failure, the root failure
    lines, and, between them, the other trigger lines nearest the root (a cascade of thousands
    of ranks can fill hundreds of megabytes: `_FarLines` keeps its start); then the few lines
    after each trigger line kept (`_add_followers`).
    """
    kept: list[tuple[int, str]] = []
    roots: list[tuple[int, int]] = []  # (offset, end) of root lines found by a trigger
    far = _FarLines()
    text_stats = _TextStats()
    cursor = _Cursor(full_from=size - TAIL_FULL_BYTES, lowest=0, position=size)
    earliest_root: int | None = None
    traceback_before_root = False
    step_before_root = False
    kept_bytes = 0
    timed_out = False
    kept_full = False
    stopped = False

    def out_of_time() -> bool:
        nonlocal timed_out
        timed_out = timed_out or deadline.passed(READ_SHARE)
        return timed_out

    lines = _lines_backward(
        reader, size, block_size, byte_budget, cursor, far=far, out_of_time=out_of_time
    )
    for line in lines:
        kept_full = len(kept) >= MAX_KEPT_LINES or kept_bytes >= MAX_KEPT_BYTES
        if out_of_time() or kept_full:
            stopped = True
            break
        if earliest_root is not None and (
            line.end < earliest_root - LOOKBEHIND_BYTES
            or (
                traceback_before_root
                and step_before_root
                and line.end < earliest_root - MIN_LOOKBEHIND_BYTES
            )
        ):
            stopped = True
            break
        text = text_stats.decode(line.raw, line.cut)
        kept.append((line.offset, text))
        kept_bytes += len(line.raw)
        if line.found_by_trigger:
            roots.append((line.offset, line.end))
        if line.found_by_trigger or _is_root_candidate(text):
            earliest_root = line.offset
            traceback_before_root = False
            step_before_root = False
            cursor.full_from = min(cursor.full_from, earliest_root - LOOKBEHIND_BYTES)
            cursor.lowest = earliest_root - LOOKBEHIND_BYTES
        elif earliest_root is not None and line.offset < earliest_root:
            traceback_before_root = traceback_before_root or _TRACEBACK_START in text
            step_before_root = step_before_root or find_step(text, step_patterns) is not None
    scanned = size - cursor.position
    notes: list[str] = []
    if timed_out:
        notes.append(
            f"the scan was cut short at its {deadline.limit:g} s time limit: read back"
            f" {scanned} of {size} bytes"
        )
    elif kept_full:
        notes.append(
            f"stopped reading back after {len(kept)} lines ({kept_bytes} bytes) worth reading:"
            f" read {scanned} of {size} bytes"
        )
    elif cursor.shrank:
        notes.append(f"the log shrank while it was read: read back {scanned} of {size} bytes")
    elif not stopped and 0 < cursor.position == size - byte_budget:
        notes.append(f"read only the last {scanned} of {size} bytes (byte budget {byte_budget})")
    for offset, _, raw in far.lines:
        kept.append((offset, text_stats.decode(raw, False)))
    if far.dropped:
        notes.append(
            f"{far.dropped} trigger line(s) between the end and the root failure were not kept:"
            f" the {len(far.lines)} nearest the root were"
        )
    triggered = roots + [(offset, end) for offset, end, _ in far.lines]
    kept.extend(_add_followers(reader, triggered, {offset for offset, _ in kept}, text_stats))
    kept.sort(key=lambda item: item[0])
    notes.extend(text_stats.notes())
    return kept, scanned, notes


class _Line(NamedTuple):
    """A line as read back: its offset, its end (its newline, or the end of the file), its
    bytes (cut to their two ends when long), and whether it was found by a root trigger outside
    the parts read whole (such a line reaches the collector only when it is a root failure)."""

    offset: int
    end: int
    raw: bytes
    cut: bool
    found_by_trigger: bool


@dataclass
class _Cursor:
    """The backward read's state, shared with the collector that steers it."""

    full_from: int  # every line that ends at or after this offset is read; before it, hits only
    lowest: int  # nothing that ends before this offset is wanted (the root's look-behind ends)
    position: int  # the start of the earliest window read
    shrank: bool = False  # the file got shorter while it was read


@dataclass
class _Carry:
    """The end of a line that began before the window being read, bounded like every line to
    its first and last `LINE_KEEP_BYTES` (the first known once the window with its start is)."""

    end: int  # the line's newline, or the end of the file
    head: bytes = b""  # its earliest bytes read so far
    tail: bytes | None = None  # its last bytes, once it is too long to keep whole
    present: bool = False  # false only past the end of the file: there is no line there

    def prepend(self, data: bytes) -> None:
        self.present = True
        self.head = data + self.head
        if len(self.head) > 2 * LINE_KEEP_BYTES:
            if self.tail is None:
                self.tail = self.head[-LINE_KEEP_BYTES:]
            self.head = self.head[:LINE_KEEP_BYTES]

    def line(self, start: bytes) -> tuple[bytes, bool]:
        """The whole line, given its bytes from its start up to this carry."""
        if self.tail is None:
            return _cut_long(start + self.head)
        return (start[:LINE_KEEP_BYTES] + self.head)[:LINE_KEEP_BYTES] + _CUT + self.tail, True


def _cut_long(raw: bytes) -> tuple[bytes, bool]:
    if len(raw) <= 2 * LINE_KEEP_BYTES:
        return raw, False
    return raw[:LINE_KEEP_BYTES] + _CUT + raw[-LINE_KEEP_BYTES:], True


def _lines_backward(
    reader: _FdReader | _StreamReader,
    size: int,
    block_size: int,
    byte_budget: int,
    cursor: _Cursor,
    *,
    far: _FarLines,
    out_of_time: Callable[[], bool],
) -> Iterator[_Line]:
    """Yield lines from the last to the first, within the byte budget: every line that ends at
    or after `cursor.full_from`; before that, of the lines holding a root trigger, those that
    are root failures (the others go to `far`).

    Each window of `block_size` bytes is read with one `pread`. A window without a trigger's
    rarest byte costs one memchr for that trigger, one with it one `rfind` pass, all in C; only
    the lines around a hit reach Python code, and a cascade's repeated line shapes are judged
    once each (`_CandidateMemo`).
    """
    horizon = max(0, size - byte_budget)  # no byte before it is read
    memo = _CandidateMemo()
    end = size
    carry = _Carry(end=size)
    while end > horizon and not out_of_time():
        if end <= cursor.lowest and not (carry.present and carry.end >= cursor.lowest):
            return  # all that is wanted is read (a line that ends after `lowest` is wanted)
        start = max(horizon, end - block_size)
        window = reader.read_at(start, end - start)
        if len(window) != end - start:
            cursor.shrank = True  # stop rather than misplace offsets
            return
        cursor.position = start
        first_newline = window.find(b"\n") if start > 0 else -1
        if start > 0 and first_newline == -1:
            carry.prepend(window)  # the whole window lies inside one line
        else:
            yield from _window_lines(
                window, start, low=first_newline + 1, carry=carry, cursor=cursor, far=far, memo=memo
            )
            carry = _Carry(end=start + first_newline)
            if start > horizon:
                carry.prepend(window[:first_newline])
        end = start


def _window_lines(
    window: bytes,
    start: int,
    *,
    low: int,
    carry: _Carry,
    cursor: _Cursor,
    far: _FarLines,
    memo: _CandidateMemo,
) -> Iterator[_Line]:
    """The lines that start in `window` at or after index `low`, last first: the one that
    continues into `carry`, then those that end inside the window.

    Below `cursor.full_from` it jumps from trigger hit to trigger hit: each trigger's `rfind`
    resumes below its previous hit, so a window costs at most one pass per trigger, and none
    for a trigger whose rarest byte the window lacks (one memchr says so)."""
    top = window.rfind(b"\n") + 1
    if top < len(window) or carry.present:
        raw, cut = carry.line(window[top:])
        offset = start + top
        if carry.end >= cursor.full_from:
            yield _Line(offset, carry.end, raw, cut, False)
        elif any(trigger in raw for trigger, _ in _TRIGGER_ANCHORS):
            if memo.is_root(raw):
                yield _Line(offset, carry.end, raw, cut, True)
            else:
                far.add(offset, carry.end, raw)
    triggers = [trigger for trigger, anchor in _TRIGGER_ANCHORS if anchor in window]
    hits = [len(window)] * len(triggers)  # each trigger's highest hit below the last bound
    count = range(len(triggers))
    bottom = top  # index of the start of the earliest line handled so far
    while bottom > low:
        newline = bottom - 1  # the newline that ends the next line down
        if start + newline >= cursor.full_from:
            line_start = window.rfind(b"\n", 0, newline) + 1
            raw, cut = _cut_long(window[line_start:newline])
            yield _Line(start + line_start, start + newline, raw, cut, False)
            bottom = line_start
            continue
        for index in count:  # the hot loop of a cascade: once per line with a hit, kept plain
            if hits[index] >= newline:  # a hit at or after a newline is in a line handled already
                hits[index] = window.rfind(triggers[index], low, newline)
        hit = max(hits, default=-1)
        if hit < 0:
            return
        line_start = window.rfind(b"\n", 0, hit) + 1
        line_end = window.find(b"\n", hit)
        raw, cut = _cut_long(window[line_start:line_end])
        if memo.is_root(raw):
            yield _Line(start + line_start, start + line_end, raw, cut, True)
        else:
            far.add(start + line_start, start + line_end, raw)
        bottom = line_start


class _FarLines:
    """Trigger lines that are no root failure, between the tail and the root's look-behind.

    The collector meets them last to first; what it keeps for the analysis are the ones nearest
    the root, the last met: at most `MAX_FAR_LINES`, each cut to the first and last
    `MATCH_CHARS` bytes that the analysis's patterns see anyway; the rest are counted.
    """

    def __init__(self) -> None:
        self.lines: deque[tuple[int, int, bytes]] = deque(maxlen=MAX_FAR_LINES)
        self.met = 0

    def add(self, offset: int, end: int, raw: bytes) -> None:
        self.met += 1
        if len(raw) > 2 * MATCH_CHARS:
            raw = raw[:MATCH_CHARS] + _CUT + raw[-MATCH_CHARS:]
        self.lines.append((offset, end, raw))

    @property
    def dropped(self) -> int:
        return self.met - len(self.lines)


def _add_followers(
    reader: _FdReader | _StreamReader,
    triggered: list[tuple[int, int]],
    known: set[int],
    text_stats: _TextStats,
) -> list[tuple[int, str]]:
    """The whole lines after each trigger line kept (offset, end), up to the next line kept:
    at most `FOLLOWER_LINES` within `FOLLOWER_BYTES` each, `MAX_FAR_LINES` and `MAX_FAR_BYTES`
    in all, the earliest first. A failure line far from the end is followed by lines that hold
    no trigger (NCCL's calloc size, XLA's buffer statistics), read again here."""
    starts = sorted(known)
    followers: list[tuple[int, str]] = []
    total = 0
    for offset, end in sorted(triggered):
        after = end + 1
        following = bisect.bisect_right(starts, offset)
        until = starts[following] if following < len(starts) else after + FOLLOWER_BYTES
        limit = min(until, after + FOLLOWER_BYTES)
        if limit <= after:
            continue
        chunk = reader.read_at(after, limit - after)
        pieces = chunk.split(b"\n", FOLLOWER_LINES)
        for piece in pieces[:FOLLOWER_LINES] if len(pieces) > FOLLOWER_LINES else pieces[:-1]:
            if len(followers) >= MAX_FAR_LINES or total >= MAX_FAR_BYTES:
                return followers
            followers.append((after, text_stats.decode(piece, False)))
            total += len(piece)
            after += len(piece) + 1
    return followers


class _CandidateMemo:
    """`_is_root_candidate` of trigger lines far from the end, remembered by the line's shape.

    A cascade repeats a few line shapes for every rank, which differ in ranks, sequence
    numbers, process ids, timestamps and addresses: the key is the line with its digits and
    lower-case hex letters made 0. A shape met a second time is judged again, as read and with
    all its digits made 0, then 1, ... then 9; only a shape whose verdict did not move is
    remembered, so a pattern that holds a number (`received signal 15`, `Cuda failure 2`) has
    its shapes judged line by line. (A pattern for one number of unlike digits, such as 700,
    would pass this check; the patterns for lines that hold a trigger name no such number.)
    The lines read whole, where the root failure nearly always is, are judged one by one.
    """

    def __init__(self) -> None:
        # key -> (verdict, or None when it moves with the digits; whether it is settled)
        self._known: dict[bytes, tuple[bool | None, bool]] = {}
        self._size = 0

    def is_root(self, raw: bytes) -> bool:
        if len(raw) > MEMO_LINE_BYTES:  # judged alone, by the ends the patterns see anyway
            if len(raw) > 2 * MATCH_CHARS:
                raw = raw[:MATCH_CHARS] + _CUT + raw[-MATCH_CHARS:]
            return _is_root_candidate(_decode(raw))
        key = raw.translate(_SHAPE)
        known, settled = self._known.get(key, (None, False))
        if settled and known is not None:
            return known
        verdict = _is_root_candidate(_decode(raw))
        if settled:
            return verdict
        if key not in self._known:
            self._remember(key, (verdict, False))
            return verdict
        stable = known is verdict and all(
            _is_root_candidate(_decode(raw.translate(digits))) is verdict
            for digits in _UNIFORM_DIGITS
        )
        self._remember(key, (verdict if stable else None, True))
        return verdict

    def _remember(self, key: bytes, entry: tuple[bool | None, bool]) -> None:
        if key not in self._known:
            if self._size + len(key) + MEMO_ENTRY_BYTES > MEMO_BYTES:
                self._known.clear()
                self._size = 0
            self._size += len(key) + MEMO_ENTRY_BYTES
        self._known[key] = entry


@dataclass
class _TextStats:
    """What the kept lines were like, for the notes: cut, invalid UTF-8, control characters."""

    cut: int = 0
    replaced: int = 0
    control: int = 0
    decoded: int = 0

    def decode(self, raw: bytes, cut: bool) -> str:
        text = _decode(raw)
        self.cut += cut
        self.replaced += text.count("\ufffd")
        self.control += len(text) - len(text.translate(_CONTROL_CHARS))
        self.decoded += len(text)
        return text

    def notes(self) -> list[str]:
        notes = []
        if self.cut:
            notes.append(f"{self.cut} line(s) longer than {2 * LINE_KEEP_BYTES} bytes were cut")
        if self.replaced:
            notes.append(f"{self.replaced} invalid UTF-8 sequence(s) replaced")
        if self.decoded and self.control / self.decoded > BINARY_SHARE:
            notes.append("the log looks binary (many control characters)")
        return notes


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\r\n")


def _is_root_candidate(text: str) -> bool:
    body = _matchable(_strip(text)[3])
    family = detect_family(body)
    if family is not None and family is not OomFamily.HOST_RAM:
        return True
    match = _EXCEPTION.match(body)
    if match is not None and _CASCADE.search(body) is None:
        return True
    return gpu_fault(body) is not None


@dataclass(frozen=True)
class _Prefixes:
    """What the prefixes stripped from a line named: its rank (and what that rank counts)."""

    rank: int | None = None
    kind: RankKind | None = None
    host: str | None = None
    pid: int | None = None


def _strip(text: str) -> tuple[int | None, str | None, str | None, str]:
    """Remove colour codes, prefixes and tqdm redraws: (rank, what the rank counts, node, body).

    The prefixes are the launchers' (`launchers.PREFIXES`): timestamps, `[rankN]:`, srun's
    `N: `, pdsh's `host: `, Ray's `(pid=N, ip=IP)`, glog heads... The body is whole (a JSON
    error line is parsed whole); patterns see `_matchable(body)`.
    """
    found, body = _strip_all(text)
    return found.rank, found.kind, _node_of(found, body), body


def _node_of(found: _Prefixes, body: str) -> str | None:
    """The node a line's prefixes name, or NCCL's `host:pid:tid [dev]` head of its body."""
    if found.host is None and (match := _NCCL_HOST.match(body)):
        return match.group("host")
    return found.host


def _strip_all(text: str) -> tuple[_Prefixes, str]:
    """What `_strip` reads, with the process id a prefix names (Ray's `(Actor pid=N)`)."""
    body = _ANSI.sub("", text)
    found, body = _strip_prefixes(body, _Prefixes())
    if "\r" in body:
        segments = [segment for segment in body.split("\r") if segment.strip()]
        body = segments[-1] if segments else ""
        found, body = _strip_prefixes(body, found)
    return found, body


def _strip_prefixes(body: str, found: _Prefixes) -> tuple[_Prefixes, str]:
    """Strip the prefixes at the start of `body`. The innermost global rank wins; a local rank
    replaces only an srun task id (srun's label on a node running torchrun is the node's task)."""
    rank, kind, host, pid = found.rank, found.kind, found.host, found.pid
    for _ in range(MAX_PREFIXES):
        which = _ANY_PREFIX.match(body)
        if which is None or which.lastindex is None:
            break
        prefix = PREFIXES[which.lastindex - 1]
        match = prefix.pattern.match(body)
        if match is None:  # the same pattern, named: cannot differ
            break
        groups = match.groupdict()
        host = groups.get("host") or host
        if groups.get("pid") is not None:
            pid = bounded_int(groups["pid"], MAX_PID)
        named = prefix.rank_kind
        if named is not None and groups.get("rank") is not None and _takes_over(kind, named):
            rank, kind = bounded_int(groups["rank"], MAX_RANK), named
        body = body[match.end() :]
    if (rank, kind, host, pid) == (found.rank, found.kind, found.host, found.pid):
        return found, body
    return _Prefixes(rank, kind, host, pid), body


def _takes_over(current: RankKind | None, new: RankKind) -> bool:
    if current is None or new is RankKind.GLOBAL:
        return True
    return current is not RankKind.GLOBAL and new is not RankKind.TASK


def _matchable(text: str) -> str:
    """What the per-line patterns see of a line: all of it, or its two ends if it is long."""
    if len(text) <= 2 * MATCH_CHARS:
        return text
    return f"{text[:MATCH_CHARS]} [...] {text[-MATCH_CHARS:]}"


def _segments(text: str) -> list[str]:
    """A tqdm line redrawn with `\\r` holds several states; each is read in order."""
    return [segment for segment in _ANSI.sub("", text).split("\r") if segment.strip()]


def _analyse_line(state: _Analysis, offset: int, text: str) -> None:
    state.line_index += 1
    found, whole = _strip_all(text)
    rank, source, node = found.rank, found.kind, _node_of(found, whole)
    if source == "local":
        state.rank_from_local_prefix = True
    if source is not None and rank is None:
        state.note(f"a {source} rank prefix beyond {MAX_RANK} was dropped")
    state.progress.read(offset, rank, text, state.note)
    body = _matchable(whole)
    if source is None:
        rank = _rank_from_block(state, body)
    _continue_oom_block(state, rank, body)
    rank_state = state.ranks.setdefault(rank, _RankState())
    if _TRACEBACK_START in body:
        rank_state.frames = []
        rank_state.in_traceback = True
        return
    if _table_line(state, offset, body):
        return
    if match := _FRAME.match(body):
        rank_state.add_frame(_Frame(match.group("path"), match.group("func")))
        rank_state.in_traceback = True
        return
    if rank_state.in_traceback and "│" in body and (match := _RICH_FRAME.search(body)):
        rank_state.add_frame(_Frame(match.group("path"), match.group("func")))
        return
    if rank_state.in_traceback and body.startswith(" ") and rank_state.frames:
        last = rank_state.frames[-1]
        if not last.code:
            rank_state.frames[-1] = _Frame(last.path, last.func, body.strip())
        return
    _summary_line(state, body)
    if _attach_nccl_size(state, body):
        return
    if whole.lstrip().startswith("{") and '"message"' in whole:
        _elastic_json(state, offset, rank, node, whole)
        return
    if "@" in body and (prompt := SHELL_PROMPT.match(body)):
        _remember_prompt(state, prompt.group("host"))
        return
    _wrapped_piece(state, offset, text, body)
    who = _Who(rank, source == RankKind.LOCAL, node, found.pid)
    event = _failure_event(state, offset, body, rank_state, who)
    if event is not None:
        _add_event(state, event)
        rank_state.in_traceback = False


def _rank_from_block(state: _Analysis, body: str) -> int | None:
    """The rank of an unprefixed line inside a launcher's per-rank block (Composer's dump of a
    crashed rank's stderr between `Begin global rank N STDERR` and its `End`)."""
    if "global rank" in body:
        if start := RANK_BLOCK_START.search(body):
            state.block_rank = _bounded_rank(state, start.group("rank"))
            return None
        if RANK_BLOCK_END.search(body):
            state.block_rank = None
            return None
    return state.block_rank


def _bounded_rank(state: _Analysis, digits: str) -> int | None:
    rank = bounded_int(digits, MAX_RANK)
    if rank is None:
        state.note(f"a rank beyond {MAX_RANK} was dropped")
    return rank


def _continue_oom_block(state: _Analysis, rank: int | None, body: str) -> None:
    """Keep the lines after an OOM line of the same rank: a message wrapped over lines, or split
    by a prefix on every line, continues there (up to `OOM_BLOCK_LINES`). A wrapped line that
    reads like an OOM itself (`Process 1246069 has 577.00 MiB memory in use.`) opens a block of
    its own and still continues the one before it."""
    events = state.open_blocks.get(rank)
    if not events:
        return
    for event in events:
        event.block.append(body)
    state.open_blocks[rank] = [event for event in events if len(event.block) < OOM_BLOCK_LINES]


def _remember_prompt(state: _Analysis, host: str) -> None:
    if host not in state.prompt_hosts and len(state.prompt_hosts) < MAX_PROMPT_HOSTS:
        state.prompt_hosts.append(host)


def _add_event(state: _Analysis, event: _Event) -> None:
    event.line_index = state.line_index
    state.events.append(event)
    if event.kind == "oom" and event.family is not OomFamily.HOST_RAM:
        state.open_blocks.setdefault(event.rank, []).append(event)


@dataclass(frozen=True)
class _Who:
    """Which process a line speaks for, as far as the line says."""

    rank: int | None = None
    local: bool = False  # `rank` counts on its node
    node: str | None = None
    pid: int | None = None


def _failure_event(
    state: _Analysis, offset: int, body: str, rank_state: _RankState, who: _Who
) -> _Event | None:
    """What failure a line that is no traceback frame reports, tested in order: a cancel of the
    whole job, a launcher's report of a worker's death, an OOM, a GPU fault, the cascade, any
    other exception. None when it reports none."""
    stripped = body.strip()
    if who.rank is None and "Rank " in body and (named := C10_MESSAGE_RANK.search(body)):
        group = named.group("group")
        if group is None or DEFAULT_GROUP.search(group):  # a subgroup's rank is not the job's
            who = replace(who, rank=_bounded_rank(state, named.group("rank")), local=False)
    if CANCEL.search(body):
        return _Event(offset, "cancel", who.rank, who.node, stripped)
    death = _death_event(state, offset, body, who)
    if death is not None:
        return death
    if _complete_death(state, body):
        return None
    event = _explained_event(offset, stripped, _frames(rank_state), who)
    if event is not None:
        return event
    kind = cascade_kind(body)
    if kind is None:
        return None
    exception = _EXCEPTION.match(stripped)  # `DistBackendError: NCCL error ...`, with its stack
    return _Event(
        offset,
        "cascade",
        who.rank,
        who.node,
        stripped,
        _frames(rank_state) if exception else (),
        exception.group("type") if exception else None,
        cascade=kind,
        local_rank=who.local,
    )


def _explained_event(
    offset: int, text: str, frames: tuple[_Frame, ...], who: _Who, source: str = ""
) -> _Event | None:
    """An OOM, a GPU fault or another exception: a failure that says what went wrong."""
    message = source or text
    family = OomFamily.HOST_RAM if HOST_RAM_KILLS.search(text) else detect_family(message)
    first_line = _matchable(message.strip().split("\n", 1)[0])
    exception = _EXCEPTION.match(first_line.strip())
    event = _Event(
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


def _death_event(state: _Analysis, offset: int, body: str, who: _Who) -> _Event | None:
    """A launcher's line saying a worker died (`launchers.DEATH_LINES`, srun's task lines)."""
    for line in DEATH_LINES:
        if line.literal is not None and line.literal not in body:
            continue
        match = line.pattern.search(body)
        if match is None:
            continue
        offset, body = _unwrapped(state, line.name, offset, body)
        groups = _groups(line.pattern.search(body) or match)
        for detail in line.details:
            if more := detail.search(body):
                groups.update(_groups(more))
        if "rank" in groups:
            who = replace(who, rank=_bounded_rank(state, groups["rank"]), local=False)
        elif "local_rank" in groups:
            who = replace(who, rank=_bounded_rank(state, groups["local_rank"]), local=True)
        if "host" in groups:
            who = replace(who, node=groups["host"])
        if "pid" in groups:
            who = replace(who, pid=bounded_int(groups["pid"], MAX_PID))
        signal = _bounded(state, groups.get("signal"), MAX_EXIT_CODE, "signal")
        return _death(
            offset,
            body.strip(),
            line.name,
            who,
            exit_code=_bounded(state, groups.get("exit"), MAX_EXIT_CODE, "exit code"),
            signal=signal if signal is not None else SIGNALS.get(groups.get("signame", "")),
        )
    if "srun: error:" in body and (match := SRUN_ERROR.search(body)):
        return _srun_death(state, offset, body.strip(), match)
    return None


def _wrapped_piece(state: _Analysis, offset: int, text: str, body: str) -> None:
    """Collect the pieces of a launcher's death line hard-wrapped over lines: a head (as
    printed, prefixes included) opens it, each next line is a piece, for a few lines."""
    head_text = _matchable(text)
    for head in WRAPPED_HEADS:
        if head.literal in head_text and head.pattern.search(head_text):
            state.wrapped = _Wrapped(head.name, offset, state.line_index, [body])
            return
    wrapped = state.wrapped
    if wrapped is None:
        return
    if state.line_index - wrapped.line_index > WRAPPED_WITHIN_LINES:
        state.wrapped = None
    elif sum(len(piece) for piece in wrapped.pieces) < WRAPPED_CHARS:
        wrapped.pieces.append(body)


def _unwrapped(state: _Analysis, name: str, offset: int, body: str) -> tuple[int, str]:
    """The whole of a death line whose end `body` is, where its head and pieces came before
    (joined as printed: a terminal wraps mid-word), at the head's offset; else `body`."""
    wrapped = state.wrapped
    if wrapped is None or wrapped.name != name:
        return offset, body
    state.wrapped = None
    if len(wrapped.pieces) < 2:
        return offset, body  # the head held the end too: a whole line
    return wrapped.offset, _matchable("".join(wrapped.pieces))


def _groups(match: re.Match[str]) -> dict[str, str]:
    """A launcher pattern's groups that matched; `signame2` is another spelling of `signame`."""
    return {
        key.rstrip("0123456789"): value
        for key, value in match.groupdict().items()
        if value is not None
    }


def _srun_death(state: _Analysis, offset: int, text: str, match: re.Match[str]) -> _Event | None:
    """srun's `task N: Exited with exit code 1` / `Killed` / `Out Of Memory` (cgroup OOM kill)."""
    what = match.group("what").strip()
    tasks = _task_ids(match.group("tasks"), state.notes)
    # a task list names the failing task only when it is one task (`tasks 1-3` does not say
    # which of them failed first: held-out sample 023)
    single = len(tasks.ranges) == 1 and tasks.ranges[0][0] == tasks.ranges[0][1]
    who = _Who(rank=tasks.first if single else None, node=match.group("host"))
    if "Out Of Memory" in what:
        event = _death(offset, text, "srun", who, exit_code=None, signal=None, out_of_memory=True)
    elif code := SRUN_EXIT.search(what):
        exit_code = _bounded(state, code.group("exit"), MAX_EXIT_CODE, "exit code")
        event = _death(offset, text, "srun", who, exit_code=exit_code, signal=None)
    elif (signal := SIGNALS.get(what.removesuffix("(core dumped)").strip())) is not None:
        event = _death(offset, text, "srun", who, exit_code=None, signal=signal)
    else:
        return None
    event.tasks = tasks
    return event


def _death(
    offset: int,
    text: str,
    launcher: str,
    who: _Who,
    *,
    exit_code: int | None,
    signal: int | None,
    out_of_memory: bool = False,
) -> _Event:
    """A worker's death; a stop signal (SIGTERM from the launcher or Slurm) is the cascade."""
    signal = signal_of(exit_code, signal)
    cause = RootCause.HOST_RAM if out_of_memory else death_cause(exit_code, signal)
    return _Event(
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


def _complete_death(state: _Analysis, body: str) -> bool:
    """A line that completes the death its launcher reported just before (Open MPI's `Exit
    code:` after `Process name:`)."""
    for detail in DEATH_DETAILS:
        if detail.literal not in body or (match := detail.pattern.search(body)) is None:
            continue
        recent = reversed(state.events[-DETAIL_WITHIN_LINES:])
        event = next((e for e in recent if e.launcher == detail.name), None)
        if event is None or state.line_index - event.line_index > DETAIL_WITHIN_LINES:
            continue
        exit_code = _bounded(state, match.groupdict().get("exit"), MAX_EXIT_CODE, "exit code")
        signal = _bounded(state, match.groupdict().get("signal"), MAX_EXIT_CODE, "signal")
        node = match.groupdict().get("host") or event.node
        completed = _death(
            event.offset,
            event.text,
            detail.name,
            _Who(event.rank, event.local_rank, node, event.pid),
            exit_code=exit_code if exit_code is not None else event.exit_code,
            signal=signal if signal is not None else event.signal,
        )
        completed.line_index = event.line_index
        state.events[state.events.index(event)] = completed
        return True
    return False


def _frames(rank_state: _RankState) -> tuple[_Frame, ...]:
    return tuple(rank_state.frames) if rank_state.in_traceback else ()


def _attach_nccl_size(state: _Analysis, body: str) -> bool:
    """NCCL names the size it failed to allocate on the WARN line after its OOM line."""
    size = nccl_request_bytes(body)
    if size is None:
        return False
    for event in reversed(state.events[-4:]):
        oom = event.oom() if event.family is OomFamily.NCCL else None
        if oom is not None and oom.requested_bytes is None:
            event.parsed = replace(oom, requested_bytes=size)
            return True
    return False


def _summary_line(state: _Analysis, body: str) -> None:
    """srun's per-task errors and torchrun's agent lines: who died, where, the job's pids."""
    srun = SRUN_ERROR.search(body) if "srun: error:" in body else None
    if srun is not None and len(state.srun_errors) < MAX_SRUN_ERRORS:
        tasks = _task_ids(srun.group("tasks"), state.notes)
        state.srun_errors.append((srun.group("host"), tasks, srun.group("what").strip()))
    for pattern in (_ELASTIC_PID, _CLOSING_SIGNAL):
        if match := pattern.search(body):
            _add_pid(state, match.group(1))


def _add_pid(state: _Analysis, digits: str) -> None:
    pid = bounded_int(digits, MAX_PID)
    if pid is None:
        state.note(f"a process id beyond {MAX_PID} was dropped")
    else:
        state.job_pids.add(pid)


def _task_ids(text: str, notes: list[str]) -> _Tasks:
    """srun's `0-3,5` as ranges, in the order printed; ranks beyond `MAX_RANK` are dropped."""
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        low_text, _, high_text = part.partition("-")
        if not (low_text.isdigit() and (high_text or low_text).isdigit()):
            continue  # not a task id (`,,`, `1-2-3`)
        low = bounded_int(low_text, MAX_RANK)
        high = bounded_int(high_text or low_text, MAX_RANK)
        if low is None or high is None:
            _note(notes, f"srun task ids beyond {MAX_RANK} were dropped")
            continue
        if low <= high and (low, high) not in ranges:
            if len(ranges) == MAX_TASK_RANGES:
                _note(notes, f"an srun task list of more than {MAX_TASK_RANGES} ranges was cut")
                break
            ranges.append((low, high))
    return _Tasks(tuple(ranges))


def _table_line(state: _Analysis, offset: int, body: str) -> bool:
    """torchrun's ChildFailedError table: `Root Cause (first observed failure):` (1.9: `Root
    Cause:`), then `[i]:` entries of fields; `i` is an index, not a rank."""
    stripped = body.strip()
    if _ROOT_SECTION.match(stripped):
        state.in_root_section = True
        return True
    if stripped.startswith(("Failures:", "Other Failures:")):
        state.in_root_section = False
        return True
    if _TABLE_ENTRY.match(body):
        if len(state.table) < MAX_TABLE_ENTRIES:
            state.table.append(_TableEntry(root_cause=state.in_root_section, offset=offset))
        return True
    if not state.table or state.table[-1].complete:
        if not (_TABLE_TIME.match(body) and len(state.table) < MAX_TABLE_ENTRIES):
            return False
        state.table.append(_TableEntry(root_cause=state.in_root_section, offset=offset))
    entry = state.table[-1]
    if entry.in_message and (message := _TABLE_MESSAGE.match(body)):
        _table_message(state, offset, entry, message.group("string"))
        entry.in_message, entry.complete = False, True
        return True
    match = _TABLE_FIELD.match(body)
    if match is None:
        return False
    key, value = match.group(1), match.group(2).strip()
    entry.in_message = key == "msg" and (not value or value.startswith("{"))
    if key == "time":
        entry.time = value[:40] or None
    elif key == "host":
        entry.host = value or None
    elif key == "rank" and (rank := _TABLE_RANK.match(value)):
        entry.rank = _bounded(state, rank.group(1), MAX_RANK, "rank", _TABLE)
        entry.local_rank = _bounded(state, rank.group(2), MAX_RANK, "local rank", _TABLE)
    elif key == "exitcode" and (code := _TABLE_EXIT.match(value)):
        entry.exitcode = _bounded(state, code.group(1), MAX_EXIT_CODE, "exit code", _TABLE)
        entry.pid = _bounded(state, code.group(2), MAX_PID, "process id", _TABLE)
        if entry.pid is not None:
            state.job_pids.add(entry.pid)
    elif key in ("traceback", "msg") and not entry.in_message:
        entry.traceback = value
    entry.complete = key in ("traceback", "msg") and not entry.in_message
    return True


def _table_message(state: _Analysis, offset: int, entry: _TableEntry, literal: str) -> None:
    """1.9's error file under `msg:`: its `"message"` is the worker's exception, of that rank."""
    try:
        message = json.loads(literal)
    except ValueError:
        return
    if not isinstance(message, str) or not message.strip():
        return
    text = message.strip()[:MAX_REPORT_CHARS]
    event = _explained_event(offset, text, (), _Who(entry.rank, node=entry.host), message)
    if event is not None:
        _add_event(state, event)


def _bounded(
    state: _Analysis, digits: str | None, limit: int, what: str, where: str = "a launcher's line"
) -> int | None:
    """A number a launcher printed, or None (noted) when it is beyond its plausible range."""
    if digits is None:
        return None
    value = bounded_int(digits, limit)
    if value is None:
        state.note(f"a {what} beyond {limit} in {where} was dropped")
    return value


def _elastic_json(
    state: _Analysis, offset: int, rank: int | None, node: str | None, body: str
) -> None:
    """torchrun's error file: {"message": {"message", "extraInfo": {"py_callstack"}}}."""
    if len(body) > MAX_JSON_CHARS:
        return
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the C stack allows
        return
    message = document.get("message") if isinstance(document, dict) else None
    callstack = ""
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        if isinstance(stack, list):
            stack = "".join(part for part in stack if isinstance(part, str))
        if isinstance(stack, str):
            callstack = stack
        message = message.get("message")
    if not isinstance(message, str):
        return
    frames: list[_Frame] = []
    for line in callstack.splitlines():
        if match := _FRAME.match(_matchable(line)):
            _add_frame(frames, _Frame(match.group("path"), match.group("func")))
    text = message.strip()[:MAX_REPORT_CHARS]
    event = _explained_event(offset, text, tuple(frames), _Who(rank, node=node), message)
    if event is None:  # an error file records a failure, whatever its words
        event = _Event(offset, "exception", rank, node, text, tuple(frames))
        event.cause = RootCause.OTHER_ERROR
    _add_event(state, event)


def _findings(state: _Analysis, scanned: int) -> LogFindings:
    table_death = _table_death(state)
    root, explanation = _choose_root(state, table_death)
    notes = list(state.notes)
    job_pids = tuple(sorted(state.job_pids))
    max_step = state.progress.max_step()
    if root is None:
        # Every death in view was the cascade or Slurm's kill after a cancel: its exit code or
        # signal (`tasks 0-3: Killed` after scancel) says nothing of the job's own failure.
        cancel = next((event for event in state.events if event.kind == "cancel"), None)
        if cancel is not None:
            notes.append(
                f"the job was stopped from outside before any rank failed: {cancel.text[:200]}"
            )
        else:
            notes.append(f"no failure message found in the last {scanned} bytes read")
        return LogFindings(
            max_step_seen=max_step,
            notes=tuple(notes),
            job_pids=job_pids,
            bytes_scanned=scanned,
        )
    evidence = explanation or root  # what the failure was; `root` says who failed first
    rank, node = _root_rank_and_node(state, root, table_death, notes)
    if explanation is not None and _other_processes(root, explanation):
        # Ray's raylet reports `Worker PID: 93658` dead, the error is `(WorkerDict pid=93663)`'s:
        # the dead worker's IP is not the failing worker's node (held-out sample 051)
        rank, node = explanation.rank, explanation.node
        notes.append(
            f"the death names process {root.pid}, the failure after it is process"
            f" {explanation.pid}'s: the death's rank and node are not the failing worker's"
        )
    elif (
        explanation is not None
        and explanation.rank is not None
        and (rank is not None or root.tasks is not None)  # srun's task list holds its rank
    ):
        rank, node = explanation.rank, explanation.node or node  # the dead worker's own words
    exit_code, signal = root.exit_code, root.signal
    if exit_code is None and signal is None:
        exit_code, signal = _exit_from_summaries(state, rank)
    cause = _root_cause(root, evidence)
    if cause is RootCause.HOST_RAM and signal is None:
        signal = 9
    if explanation is not None:
        notes.append(f"the first failure ({root.text[:120]}) is explained by a line after it")
    cascade_ranks = sorted(_cascade_ranks(state, root, table_death) - {rank})
    step = _step_at_failure(state, evidence)
    frames = _failing_frames(state, evidence)
    phase, phase_line = decide_phase(
        phase_of_frames(frames), state.progress.timeline.at(evidence.offset)
    )
    if root.kind == "cascade":
        notes.append(
            "only collective timeouts or errors were found: the rank that stalled first"
            " left no error in this log"
        )
    if state.rank_from_local_prefix:
        notes.append("ranks from torchrun's [defaultN] prefix are local ranks on their node")
    return LogFindings(
        rank=rank,
        node=node,
        step=None if step is None else step.step,
        max_step_seen=max_step,
        phase=phase,
        frames=tuple(frame.func for frame in frames),
        heavy_kernels=_heavy_kernels(frames),
        oom=_root_oom_report(evidence),
        root_failure_line=evidence.text[:MAX_REPORT_CHARS],
        cascade_ranks=tuple(cascade_ranks),
        exit_code=exit_code,
        killed_by_signal=signal,
        notes=tuple(notes),
        error_type=evidence.error_type,
        job_pids=job_pids,
        traceback_seen=bool(evidence.frames),
        bytes_scanned=scanned,
        root_cause=cause,
        gpu_fault=_gpu_fault(cause, evidence),
        step_line=None if step is None else step.line,
        phase_line=phase_line,
    )


def _root_oom_report(event: _Event) -> OomReport | None:
    """The OOM report of the root failure: the single place its numbers are read.

    A device OOM is read with the lines its rank printed after it (`event.block`, prefixes
    stripped): a message wrapped over lines, or split by a prefix on every line, continues
    there. An error file's message (`event.source`) and a host-RAM line are read whole.
    """
    if event.family is None or event.family is OomFamily.HOST_RAM or event.source:
        return event.oom()
    report = parse_oom_block((event.text, *event.block))
    return report if report is not None else event.oom()


def _root_cause(root: _Event, evidence: _Event) -> RootCause | None:
    if root.kind == "cascade":
        timeout = root.cascade is CascadeKind.TIMEOUT
        return RootCause.COLLECTIVE_TIMEOUT if timeout else RootCause.OTHER_ERROR
    return evidence.cause


def _gpu_fault(cause: RootCause | None, evidence: _Event) -> GpuFault | None:
    if cause is not RootCause.GPU_FAULT or evidence.fault is None:
        return None
    return replace(evidence.fault, line=evidence.text[:MAX_REPORT_CHARS])


def _cascade_ranks(state: _Analysis, root: _Event, table_death: _Event | None) -> set[int]:
    """Ranks that failed after the root: collective timeouts, SIGTERMs, the table's others."""
    ranks = {
        event.rank
        for event in state.events
        if event.rank is not None and event.kind in {"cascade", "death"} and event is not root
    }
    if table_death is not None:
        ranks.update(
            entry.rank
            for entry in state.table
            if entry.rank is not None and entry.rank != table_death.rank
        )
    return ranks


def _step_at_failure(state: _Analysis, failure: _Event) -> StepMark | None:
    """The step the failing rank reached (`ProgressTracker.step_at_failure`): its own lines count
    where its rank is known, up to the collective timeouts its failure caused."""
    cascade_at = min(
        (e.offset for e in state.events if e.kind == "cascade" and e.offset > failure.offset),
        default=None,
    )
    own_lines = failure.rank is not None and failure.kind != "cascade"
    return state.progress.step_at_failure(
        failure.offset, failure.rank, own_lines=own_lines, cascade_at=cascade_at
    )


def _failing_frames(state: _Analysis, failure: _Event) -> tuple[_Frame, ...]:
    """The failing stack: the failure's own traceback, or the one its rank printed after the
    message (stderr printed the message first: samples 030, 049, 050), either ending in the
    same message again or cut off by the excerpt's end."""
    if failure.frames:
        return failure.frames
    key = _failure_key(failure)
    for event in state.events:
        later = event.offset > failure.offset and event.rank == failure.rank
        if later and event.frames and key is not None and _failure_key(event) == key:
            return event.frames
    open_tracebacks = [
        rank_state.frames
        for rank, rank_state in state.ranks.items()
        if rank_state.in_traceback
        and rank_state.frames
        and (rank == failure.rank or failure.rank is None)
    ]
    return tuple(open_tracebacks[0]) if len(open_tracebacks) == 1 else ()


def _choose_root(
    state: _Analysis, table_death: _Event | None
) -> tuple[_Event | None, _Event | None]:
    """The earliest root failure, and the later line that explains it when it says no why.

    Failures are what says what went wrong (an OOM, a GPU fault, another exception) and the
    deaths launchers report (`failed (exitcode: -9) local_rank: 3`, `Rank 1 crashed`, srun's
    `task 0: Exited with exit code 1`); the earliest is the root. A certain host-RAM kill (the
    OOM killer's or Slurm's own line, printed when the step ends) explains an earlier exception
    or death, not an earlier GPU OOM or fault. A death that says only its exit code or signal is
    explained by the first failure after it that could be the same process's. The cascade
    (timeouts, aborted communicators, SIGTERMs) is the root only when nothing else failed, and
    nothing after a cancel of the whole job (a time limit) is.
    """
    events = sorted([*state.events, *([table_death] if table_death else [])], key=_by_offset)
    cancel = next((event.offset for event in events if event.kind == "cancel"), None)
    live = [event for event in events if cancel is None or event.offset < cancel]
    failures = _failures(live)
    if failures:
        first = failures[0]
        certain = next((e for e in failures if _certain_host_ram(e)), None)
        if certain is not None and first.cause not in _DEVICE_CAUSES:
            return certain, None
        if first.cause is RootCause.OTHER_ERROR and (
            first.kind == "death" or _WRAPPER_EXCEPTION.search(_matchable(first.text))
        ):
            later = (e for e in failures if e.offset > first.offset and e.kind in _EXPLAINED)
            explanation = next(later, None)
            if explanation is not None and _same_process(first, explanation):
                return first, explanation
        return first, _completed_name(first, failures)
    for kind in (CascadeKind.TIMEOUT, CascadeKind.COMM):
        cascade = next((e for e in live if e.kind == "cascade" and e.cascade is kind), None)
        if cascade is not None:
            return cascade, None
    return None, None


def _completed_name(first: _Event, failures: list[_Event]) -> _Event | None:
    """The later line of the same exception with its message, when the root's line is only the
    exception's name (`jaxlib.xla_extension.XlaRuntimeError` as an issue's title, a post's first
    line: tests/data/real/oom/166); a bare `AssertionError` with no such line is its own why."""
    name = first.error_type
    if first.cause is not RootCause.OTHER_ERROR or name is None:
        return None
    if _matchable(first.text).strip() != name:
        return None
    short = name.rsplit(".", 1)[-1]
    return next(
        (
            event
            for event in failures
            if event.offset > first.offset
            and event.error_type is not None
            and event.error_type.rsplit(".", 1)[-1] == short
            and _same_process(first, event)
        ),
        None,
    )


_DEVICE_CAUSES = frozenset({RootCause.ACCELERATOR_OOM, RootCause.GPU_FAULT})


def _by_offset(event: _Event) -> int:
    return event.offset


def _failures(events: list[_Event]) -> list[_Event]:
    """Events that can be the root, in file order. A rank that reported a collective timeout
    or a broken communicator and then died of a signal or an exit code died of the cascade
    (the watchdog aborts the process: srun's `task 2: Aborted`). Once Slurm cancelled the step
    (`*** STEP 43575862.0 ON node CANCELLED AT ... ***`, after a task failed or by scancel), the
    tasks srun reports `Killed` were killed by Slurm (facebookresearch/deit#102)."""
    waited: set[int] = set()
    step_cancelled = False
    failures = []
    for event in events:
        if event.kind == "cascade":
            if event.rank is not None and event.cascade in _WAITING:
                waited.add(event.rank)
            step_cancelled = step_cancelled or _STEP_CANCELLED in event.text
        elif event.kind in _EXPLAINED:
            failures.append(event)
        elif event.kind == "death" and not _died_waiting(event, waited):
            slurm_killed = step_cancelled and event.launcher == "srun" and event.signal == SIGKILL
            if not slurm_killed:
                failures.append(event)
    return failures


_WAITING = frozenset({CascadeKind.TIMEOUT, CascadeKind.COMM})
_STEP_CANCELLED = "CANCELLED AT"


def _died_waiting(death: _Event, waited: set[int]) -> bool:
    return death.cause is RootCause.OTHER_ERROR and not death.local_rank and death.rank in waited


def _other_processes(first: _Event, second: _Event) -> bool:
    """Whether two events name their processes, and not the same one."""
    return first.pid is not None and second.pid is not None and first.pid != second.pid


def _certain_host_ram(event: _Event) -> bool:
    return event.cause is RootCause.HOST_RAM and host_ram_is_certain(event.source or event.text)


def _same_process(death: _Event, failure: _Event) -> bool:
    """Whether a failure could be the dead worker's own: one of them names no rank, or the
    death's rank (srun: its task list) holds the failure's, or they count ranks differently."""
    if death.rank is None or failure.rank is None:
        return True
    if death.tasks is not None:
        return failure.rank in death.tasks
    return death.local_rank != failure.local_rank or death.rank == failure.rank


def _table_death(state: _Analysis) -> _Event | None:
    """The Root Cause entry of torchrun's table as a death; of two agents' tables (two nodes'
    output in one log) the one with the earlier `time`. Where the excerpt lost the Root Cause
    section, the earliest failure it still lists."""
    roots = [(index, entry) for index, entry in enumerate(state.table) if entry.root_cause]
    if not roots:
        roots = list(enumerate(state.table))
    if not roots:
        return None
    _, entry = min(roots, key=lambda pair: (pair[1].time is None, pair[1].time or "", pair[0]))
    signal = None
    if entry.traceback and (match := _TABLE_SIGNAL.match(entry.traceback)):
        signal = bounded_int(match.group(1), MAX_EXIT_CODE)
    text = f"torchrun's Root Cause table: rank {entry.rank} exitcode {entry.exitcode}"
    if entry.traceback:
        text += f" ({entry.traceback[:MAX_REPORT_CHARS]})"
    who = _Who(entry.rank, node=entry.host)
    return _death(
        entry.offset, text, "torchrun table", who, exit_code=entry.exitcode, signal=signal
    )


def _root_rank_and_node(
    state: _Analysis, root: _Event, table_death: _Event | None, notes: list[str]
) -> tuple[int | None, str | None]:
    """Who failed first and where. A root that names no rank takes it from the same failure
    printed again with a prefix, from torchrun's Root Cause table, or from the first death a
    launcher reported; its node from the line that gave the rank, the table, srun's lines, or
    the one host the log's shell prompts name."""
    if root.kind == "cascade":
        return None, None  # every rank timed out: the one that stalled is not in view
    rank, node, local = root.rank, root.node, root.local_rank
    if rank is None and (same := _same_failure(state, root)) is not None:
        rank, node, local = same.rank, node or same.node, same.local_rank
        notes.append(f"rank {rank} printed the same failure with its prefix")
    if rank is None and table_death is not None and table_death.rank is not None:
        rank, node = table_death.rank, node or table_death.node
        notes.append(f"rank {rank} taken from torchrun's Root Cause table")
    if rank is None and root.tasks is None:  # srun's `tasks 2-7` said who: none of them alone
        deaths = sorted((e for e in state.events if e.kind == "death"), key=_by_offset)
        death = next((e for e in deaths if e.rank is not None and e is not root), None)
        if death is not None:
            rank, node, local = death.rank, node or death.node, death.local_rank
            notes.append(f"rank {rank} taken from the launcher's line: {death.text[:160]}")
    if local and rank is not None:
        notes.append(f"rank {rank} is the rank on its node the launcher named (local rank)")
    listed = [(host, tasks) for host, tasks, _ in state.srun_errors if tasks.first is not None]
    failed = [
        (host, tasks)
        for host, tasks, what in state.srun_errors
        if tasks.first is not None and "Terminated" not in what and "Killed" not in what
    ] or listed
    if node is None and rank is not None:
        node = next((e.host for e in state.table if e.rank == rank and e.host), None)
    if node is None and rank is not None:
        node = next((host for host, tasks in failed + listed if rank in tasks), None)
    if node is None and len({host for host, _ in failed}) == 1:
        node = failed[0][0]
    if node is None and len(state.prompt_hosts) == 1:
        node = state.prompt_hosts[0]
        notes.append(f"node {node} taken from the shell prompt in the log")
    return rank, node


def _same_failure(state: _Analysis, root: _Event) -> _Event | None:
    """The root's failure printed again later by a line that names its rank: an unprefixed
    `CUDA error: uncorrectable ECC error` and then rank 1's watchdog reporting the same error."""
    key = _failure_key(root)
    if key is None:
        return None
    return next(
        (
            event
            for event in state.events
            if event.offset > root.offset and event.rank is not None and _failure_key(event) == key
        ),
        None,
    )


def _failure_key(event: _Event) -> str | None:
    if event.kind == "fault" and event.fault is not None:
        return event.fault.words
    if event.kind in ("oom", "exception"):
        exception = _EXCEPTION.match(_matchable(event.text))
        message = exception.group("message") if exception else None
        return (message or event.text).strip() or None
    return None


def _exit_from_summaries(state: _Analysis, rank: int | None) -> tuple[int | None, int | None]:
    """The exit code and signal the launchers reported for `rank` (any rank when unknown)."""
    for _, tasks, what in state.srun_errors:
        if rank is not None and rank not in tasks:
            continue
        if match := SRUN_EXIT.search(what):
            code = bounded_int(match.group("exit"), MAX_EXIT_CODE)
            if code is not None:
                return code, signal_of(code, None)
        if what.startswith("Killed"):
            return None, 9
    for entry in state.table:
        if entry.exitcode is not None and (rank is None or entry.rank == rank):
            return entry.exitcode, signal_of(entry.exitcode, None)
    for event in state.events:
        named = event.exit_code is not None or event.signal is not None
        if event.kind == "death" and named and (rank is None or event.rank == rank):
            return event.exit_code, event.signal
    return None, None


def _heavy_kernels(frames: tuple[_Frame, ...]) -> tuple[str, ...]:
    """Heavy kernels among the innermost frames: where the failed allocation was made."""
    found: list[str] = []
    innermost = frames[-HEAVY_KERNEL_FRAMES:]
    for label, pattern in _HEAVY_KERNELS:
        for frame in innermost:
            if pattern.search(f"{frame.func} {frame.path.rsplit('/', 1)[-1]} {frame.code}"):
                found.append(label)
                break
    return tuple(found)
