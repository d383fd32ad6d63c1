"""The job-log scanner: who failed first, where, at which step, in which phase, and how.

A dead job's log can be many gigabytes; the failure is nearly always near its end. The
scanner reads backwards from the end in blocks and never holds the whole file:

1. The last `TAIL_FULL_BYTES` are read line by line (the ChildFailedError table, srun's
   `srun: error:` lines, the cascade of collective timeouts and the last progress line live
   there).
2. Further back it only tests each block for three literal byte strings (`Error`, `emory`,
   `xception`) at C speed and splits only the blocks that hold one.
3. Once a root failure is found it reads every line again for up to `LOOKBEHIND_BYTES` before
   the earliest one: the traceback frames and the step marker come before the error line.

It stops at the start of the file, at the byte budget, or when the root failure, its
traceback and a step before it are all in hand. Then it reads the kept lines forward,
tracking each rank's traceback separately (lines of different ranks interleave).

Its work is bounded whatever the log holds (a user writes it, and the daemon may scan it as
root): every pattern runs in linear time and sees at most twice `MATCH_CHARS` of a line; at most
`MAX_KEPT_LINES` lines and `MAX_KEPT_BYTES` bytes are kept for the forward pass; task lists stay
ranges, never expanded; a number beyond its plausible range is dropped with a note; and each
scan has a time limit, past which it returns what it found with a note that it was cut short.

Input it treats as normal: ANSI colour codes, tqdm's `\\r` redraws, srun `--label` prefixes
(`3: `), torchrun's `[rank3]:` (global rank) and `[default3]:` (local rank) prefixes, partial
last lines, invalid UTF-8 (replaced), lines of many megabytes (cut to their first and last
`LINE_KEEP_BYTES`), binary garbage (noted). Only regular files are read: a FIFO or a device
is refused with `LogReadError` before any read, so nothing can block. Symlinks are refused
unless `follow_symlinks=True`: the daemon reads a job's log with rights that may exceed the
job owner's, and a link planted in an output directory must not make it read another file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import BinaryIO

from daemon.evidence.oom import (
    detect_family,
    host_ram_is_certain,
    nccl_request_bytes,
    parse_oom_as,
)
from daemon.evidence.records import (
    MAX_EXIT_CODE,
    MAX_PID,
    MAX_RANK,
    MAX_STEP,
    LogFindings,
    OomFamily,
    OomReport,
    Phase,
)
from daemon.evidence.units import bounded_int

MIB = 1024 * 1024
DEFAULT_BLOCK_SIZE = MIB
DEFAULT_BYTE_BUDGET = (
    2 * 1024 * MIB
)  # the failure of a dead job is in its last few MB; 2 GiB is ample
TAIL_FULL_BYTES = MIB  # summaries (tables, srun errors, cascades) are printed last
LOOKBEHIND_BYTES = 4 * MIB  # how far before the earliest root failure to look for frames and steps
MIN_LOOKBEHIND_BYTES = 256 * 1024  # at least this much, to catch another rank failing a bit earlier
LINE_KEEP_BYTES = 64 * 1024  # of a longer line, keep this much of its head and of its tail
MAX_JSON_CHARS = MIB  # an elastic error file is small; a bigger "JSON" line is not one
FOLLOWER_LINES = 16  # kept after a failure line found far from the end (its continuation)
HEAVY_KERNEL_FRAMES = 6  # the allocation happened in the innermost frames, not in the caller chain
BINARY_SHARE = 0.3  # above this share of control characters the log is noted as binary
# Of a longer line (of its last `\r` redraw), only the first and the last 8 KB are matched
# against the per-line patterns: every failure line we read fits, and no line costs more.
MATCH_CHARS = 8 * 1024
# What the forward pass holds: a real tail (1 MB) and look-behind (4 MB) of short lines stays
# well within both; a log of millions of tiny or trigger-holding lines stops here.
MAX_KEPT_LINES = 100_000
MAX_KEPT_BYTES = 16 * MIB
MAX_TRACEBACK_FRAMES = 1000  # a runaway traceback keeps its outer and inner ends
MAX_TASK_RANGES = 64  # srun prints a node's tasks as a few ranges (`0-3,5`)
MAX_SRUN_ERRORS = 4096  # one `srun: error:` line per node and failure
MAX_NOTES = 32
DEFAULT_TIME_LIMIT = 20.0  # seconds; a real log of gigabytes is scanned in a few
READ_SHARE = 0.5  # of the time limit, for reading backwards; the rest is the analysis's

# Literal byte strings that a root failure line far from the end holds one of, tested per
# block at C speed: `Error` (every exception line but a bare `Exception:`, and cuBLAS, cuDNN,
# XLA wrapped in them), `emory` (every "out of memory", "Out Of Memory", OutOfMemoryError,
# NCCL's "Cuda failure 'out of memory'"), `xception`. Each literal costs one pass over the block,
# so there are three; Slurm's and the shell's own lines (`srun: error:`, `Killed`) are printed
# when the job ends, inside the tail that is read line by line anyway.
_ROOT_TRIGGERS = (b"Error", b"emory", b"xception")
_TRACEBACK_START = "Traceback (most recent call last):"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
_SRUN_LABEL = re.compile(r"^\s*([0-9]+): ")
_TORCHRUN_RANK = re.compile(r"^\[rank([0-9]+)\]:\s?")
_TORCHRUN_LOCAL = re.compile(r"^\[default([0-9]+)\]:\s?")
_NCCL_HOST = re.compile(r"^(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\]")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+, in (?P<func>[\w<>.]+)')
# The lookbehind starts a path only where a run of path characters starts: linear time.
_RICH_FRAME = re.compile(r"(?<![\w./\\\-])(?P<path>[\w./\\\-]+\.py):\d+\s+in\s+(?P<func>[\w<>]+)")
_EXCEPTION = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Exhausted))"
    r"(?::\s?(?P<message>.*))?\Z"
)
_CASCADE = re.compile(
    r"Watchdog caught collective operation timeout|ProcessGroupNCCL|DistBackendError"
    r"|NCCL communicator|NCCL error|ncclRemoteError|ncclSystemError|ncclInternalError"
    r"|Connection closed by remote peer|Connection reset by peer|Broken pipe"
    r"|RendezvousClosedError|SignalException|closing signal SIG|ChildFailedError"
    r"|received signal 15|Terminated|Terminating (?:StepId|job step)|CANCELLED AT|TCPStore"
    r"|Socket Timeout|collective operation timeout|Timed out waiting|KeyboardInterrupt"
)
_SRUN_ERROR = re.compile(
    r"srun: error: (?P<node>[\w.\-]+): tasks? (?P<tasks>[0-9,\-]+): (?P<what>.+)"
)
_EXIT_CODE = re.compile(r"[Ee]xit(?:ed with exit)? code:?\s*(-?[0-9]+)")
_TABLE_ENTRY = re.compile(r"^\s*\[(\d+)\]:\s*\Z")
_TABLE_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)\Z")
_TABLE_RANK = re.compile(r"(-?[0-9]+)(?: \(local_rank: ([0-9]+)\))?")
_TABLE_EXIT = re.compile(r"(-?[0-9]+)(?: \(pid: ([0-9]+)\))?")
_ELASTIC_FAILED = re.compile(r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: ([0-9]+)\)")
_CLOSING_SIGNAL = re.compile(r"Sending process ([0-9]+) closing signal")
_CONTROL_CHARS = dict.fromkeys(code for code in range(32) if chr(code) not in "\t\r\x1b")

DEFAULT_STEP_PATTERNS = (
    re.compile(r"\biteration\s+([0-9]+)\s*/\s*\d+"),  # Megatron: ` iteration   182/  250000 |`
    re.compile(r"\|\s*([0-9]+)/\d+\s*\["),  # tqdm bars (HF Trainer, Lightning): `| 450/1000 [`
    re.compile(r"\bstep=([0-9]+)"),  # DeepSpeed: `[Rank 0] step=1249, skipped=0`
    re.compile(  # `step 95,`; one run of spaces either side of the `:`, never two in a row
        r"\b(?:global[_ ])?step\s*(?:[:=]\s*)?([0-9]+)\b(?![.\d])", re.IGNORECASE
    ),
)

_PHASE_FUNCS: tuple[tuple[Phase, re.Pattern[str]], ...] = (
    (
        Phase.CHECKPOINT_SAVE,
        re.compile(r"^(_?save|_?save_\w+|consolidate_state_dict|full_optim_state_dict)\Z"),
    ),
    (
        Phase.DATA_LOADING,
        re.compile(
            r"^(__getitem__|default_collate|collate\w*|_next_data|_try_get_data|_get_data)\Z"
        ),
    ),
    (
        Phase.EVAL,
        re.compile(
            r"^_?(evaluat\w*|eval_step|evaluation_loop|prediction_\w+|predict\w*|generate\w*"
            r"|_sample|greedy_search|_?beam_search|validation_step|test_step|validate\w*"
            r"|run_validation|_run_validation)\Z"
        ),
    ),
    (
        Phase.OPTIMIZER_STEP,
        re.compile(
            r"^(optimizer_step|_optimizer_step|_single_tensor_\w+|_multi_tensor_\w+|_fused_\w+"
            r"|_init_group|_take_model_step|initialize_optimizer_states|_update_state"
            r"|step_with_ready_grads)\Z"
        ),
    ),
    (Phase.BACKWARD, re.compile(r"^(backward|run_backward|_engine_run_backward)\Z")),
    (Phase.FORWARD, re.compile(r"^(forward|_call_impl|_wrapped_call_impl|_forward\w*)\Z")),
)
_PHASE_PATHS: tuple[tuple[Phase, re.Pattern[str]], ...] = (
    (Phase.DATA_LOADING, re.compile(r"torch/utils/data/")),
    (Phase.OPTIMIZER_STEP, re.compile(r"/optim/|optimizer\w*\.py")),
    (Phase.BACKWARD, re.compile(r"torch/autograd/")),
)
_PHASE_CODE: tuple[tuple[Phase, re.Pattern[str]], ...] = (
    (Phase.CHECKPOINT_SAVE, re.compile(r"\b(torch\.save|save_checkpoint|save_pretrained)\(")),
    (Phase.EVAL, re.compile(r"\.(generate|evaluate)\(")),
    (Phase.OPTIMIZER_STEP, re.compile(r"\b(optimizer|opt|model_engine|engine)\.step\(")),
    (Phase.BACKWARD, re.compile(r"\.backward\(")),
)
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
    """One failure line: an OOM, another exception, or a cascade (timeouts, aborts, SIGTERMs)."""

    offset: int
    kind: str  # "oom", "exception", "cascade"
    rank: int | None
    node: str | None
    text: str
    frames: tuple[_Frame, ...] = ()
    error_type: str | None = None
    family: OomFamily | None = None  # of an "oom" event: which software ran out
    source: str = ""  # what its OOM report is read from, when it is wanted
    parsed: OomReport | None = None

    def oom(self) -> OomReport | None:
        """The OOM report, parsed when first asked for: a log of thousands of OOM lines (every
        rank's, or a hostile one) needs the numbers of its root failure only."""
        if self.parsed is None and self.family is not None:
            self.parsed = parse_oom_as(self.source or self.text, self.family)
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
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    exitcode: int | None = None
    pid: int | None = None
    traceback: str | None = None


@dataclass
class _Analysis:
    """State of the forward pass over the kept lines."""

    step_patterns: tuple[re.Pattern[str], ...]
    events: list[_Event] = field(default_factory=list)
    steps: list[tuple[int, int, int | None]] = field(default_factory=list)  # offset, step, rank
    ranks: dict[int | None, _RankState] = field(default_factory=dict)
    srun_errors: list[tuple[str, _Tasks, str]] = field(default_factory=list)
    table: list[_TableEntry] = field(default_factory=list)
    in_root_section: bool = False
    job_pids: set[int] = field(default_factory=set)
    rank_from_local_prefix: bool = False
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        _note(self.notes, text)


def _note(notes: list[str], text: str) -> None:
    """Each note once, and a bounded number of them: a hostile log repeats its oddities."""
    if text not in notes and len(notes) < MAX_NOTES:
        notes.append(text)


def scan_log(
    source: str | os.PathLike[str] | BinaryIO,
    *,
    step_pattern: str | re.Pattern[str] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    byte_budget: int = DEFAULT_BYTE_BUDGET,
    follow_symlinks: bool = False,
    time_limit: float = DEFAULT_TIME_LIMIT,
    clock: Callable[[], float] = time.monotonic,
) -> LogFindings:
    """Scan a job log from its end; raise `LogReadError` if it is not a readable regular file.

    Past `time_limit` seconds (by `clock`) the scan stops and returns what it found, noted.
    """
    if block_size < 4096:
        raise ValueError(f"block_size must be at least 4096 bytes, got {block_size}")
    patterns = _step_patterns(step_pattern)
    deadline = _Deadline(clock, clock(), time_limit)
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
    """Walk back from the end; return the lines worth analysing (file order) and what was read."""
    kept: list[tuple[int, str]] = []
    notes: list[str] = []
    # Lines just after a failure line (NCCL's calloc size, XLA's buffer stats) hold no trigger:
    # the last few skipped lines are kept with the next trigger line found before them.
    followers: deque[tuple[int, bytes, bool]] = deque(maxlen=FOLLOWER_LINES)
    earliest_root: int | None = None
    traceback_before_root = False
    step_before_root = False
    long_lines = 0
    replaced = 0
    control = 0
    decoded = 0
    kept_bytes = 0

    def wants_block(block_end: int, data: bytes) -> bool:
        if block_end > size - TAIL_FULL_BYTES:
            return True
        if earliest_root is not None and block_end >= earliest_root - LOOKBEHIND_BYTES:
            return True
        return any(trigger in data for trigger in _ROOT_TRIGGERS)

    timed_out = False
    kept_full = False

    def out_of_time() -> bool:
        nonlocal timed_out
        timed_out = timed_out or deadline.passed(READ_SHARE)
        return timed_out

    progress = [size]
    stopped = False
    lines = _lines_backward(
        reader,
        size,
        block_size,
        byte_budget,
        wants_block=wants_block,
        progress=progress,
        out_of_time=out_of_time,
    )
    for offset, line_end, line, cut in lines:
        kept_full = len(kept) >= MAX_KEPT_LINES or kept_bytes >= MAX_KEPT_BYTES
        if out_of_time() or kept_full:
            stopped = True
            break
        full = line_end >= size - TAIL_FULL_BYTES or (
            earliest_root is not None and line_end >= earliest_root - LOOKBEHIND_BYTES
        )
        if earliest_root is not None and line_end < earliest_root - LOOKBEHIND_BYTES:
            stopped = True
            break
        if (
            earliest_root is not None
            and traceback_before_root
            and step_before_root
            and line_end < earliest_root - MIN_LOOKBEHIND_BYTES
        ):
            stopped = True
            break
        if not full and not any(trigger in line for trigger in _ROOT_TRIGGERS):
            followers.append((offset, line, cut))
            continue
        batch = [*followers, (offset, line, cut)]
        followers.clear()
        for line_offset, raw, was_cut in batch:
            long_lines += was_cut
            text = _decode(raw)
            replaced += text.count("\ufffd")
            control += len(text) - len(text.translate(_CONTROL_CHARS))
            decoded += len(text)
            kept_bytes += len(raw)
            kept.append((line_offset, text))
        if _is_root_candidate(text):
            earliest_root = offset
            traceback_before_root = False
            step_before_root = False
        elif earliest_root is not None and offset < earliest_root:
            traceback_before_root = traceback_before_root or _TRACEBACK_START in text
            step_before_root = step_before_root or _find_step(text, step_patterns) is not None
    scanned = size - progress[0]
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
    elif progress[0] > 0 and not stopped:
        notes.append(f"read only the last {scanned} of {size} bytes (byte budget {byte_budget})")
    if long_lines:
        notes.append(f"{long_lines} line(s) longer than {2 * LINE_KEEP_BYTES} bytes were cut")
    if replaced:
        notes.append(f"{replaced} invalid UTF-8 sequence(s) replaced")
    if decoded and control / decoded > BINARY_SHARE:
        notes.append("the log looks binary (many control characters)")
    kept.reverse()
    return kept, scanned, notes


def _lines_backward(
    reader: _FdReader | _StreamReader,
    size: int,
    block_size: int,
    byte_budget: int,
    *,
    wants_block: Callable[[int, bytes], bool],
    progress: list[int],
    out_of_time: Callable[[], bool],
) -> Iterator[tuple[int, int, bytes, bool]]:
    """Yield (start, end, line, was_cut) from the last line to the first, within the budget.

    `wants_block(end_offset, data)` says whether a block's lines are needed at all; a block it
    declines is never split, so the bytes far from the failure cost one C-speed test each.
    """
    position = size
    pending = b""  # the start of a line that began in an earlier block (grows backwards)
    pending_tail: bytes | None = None  # last bytes of an over-long pending line
    while position > 0 and size - position < byte_budget and not out_of_time():
        start = max(0, position - block_size)
        block = reader.read_at(start, position - start)
        if len(block) != position - start:
            break  # the file shrank under us: stop rather than misplace offsets
        data = block + pending
        first_newline = data.find(b"\n") if start > 0 else -1
        position = start
        progress[0] = start
        if start > 0 and first_newline == -1:
            pending, pending_tail = _bound_pending(data, pending_tail)
            continue
        pending = data[: first_newline + 1]
        if pending_tail is None and not wants_block(start + len(data), data):
            pending_tail = None
            continue
        end = start + len(data)
        pieces = data[first_newline + 1 :].split(b"\n")
        next_offset = end + 1  # where a line after the last piece would start
        if end == size and pieces[-1] == b"":
            pieces.pop()  # the file ends with a newline
            next_offset = end
        line_end = end
        for index in range(len(pieces) - 1, -1, -1):  # offsets from the end: no list of them
            piece = pieces[index]
            offset = next_offset - 1 - len(piece)
            was_cut = False
            if index == len(pieces) - 1 and pending_tail is not None:
                piece = piece + b" [...] " + pending_tail
                was_cut = True
            if len(piece) > 2 * LINE_KEEP_BYTES:
                piece = piece[:LINE_KEEP_BYTES] + b" [...] " + piece[-LINE_KEEP_BYTES:]
                was_cut = True
            yield offset, line_end, piece, was_cut
            line_end = offset - 1
            next_offset = offset
        pending_tail = None


def _bound_pending(data: bytes, tail: bytes | None) -> tuple[bytes, bytes | None]:
    """Keep a line without newline bounded: its last bytes once, and its earliest bytes."""
    if len(data) <= 2 * LINE_KEEP_BYTES:
        return data, tail
    if tail is None:
        tail = data[-LINE_KEEP_BYTES:]
    return data[:LINE_KEEP_BYTES], tail


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\r\n")


def _is_root_candidate(text: str) -> bool:
    body = _matchable(_strip(text)[3])
    family = detect_family(body)
    if family is not None and family is not OomFamily.HOST_RAM:
        return True
    match = _EXCEPTION.match(body)
    return match is not None and _CASCADE.search(body) is None


def _strip(text: str) -> tuple[int | None, str | None, str | None, str]:
    """Remove colour codes, rank prefixes and tqdm redraws: (rank, rank source, node, body).

    The body is whole (a JSON error line is parsed whole); patterns see `_matchable(body)`.
    """
    body = _ANSI.sub("", text)
    rank, source, body = _strip_prefixes(body, None, None)
    if "\r" in body:
        segments = [segment for segment in body.split("\r") if segment.strip()]
        body = segments[-1] if segments else ""
        rank, source, body = _strip_prefixes(body, rank, source)
    node = None
    if match := _NCCL_HOST.match(body):
        node = match.group("host")
    return rank, source, node, body


def _strip_prefixes(
    body: str, rank: int | None, source: str | None
) -> tuple[int | None, str | None, str]:
    for _ in range(3):
        if match := _TORCHRUN_RANK.match(body):
            rank, source = bounded_int(match.group(1), MAX_RANK), "torchrun"
        elif match := _TORCHRUN_LOCAL.match(body):
            if source != "torchrun":
                rank, source = bounded_int(match.group(1), MAX_RANK), "local"
        elif match := _SRUN_LABEL.match(body):
            if source is None:
                rank, source = bounded_int(match.group(1), MAX_RANK), "srun"
        else:
            break
        body = body[match.end() :]
    return rank, source, body


def _matchable(text: str) -> str:
    """What the per-line patterns see of a line: all of it, or its two ends if it is long."""
    if len(text) <= 2 * MATCH_CHARS:
        return text
    return f"{text[:MATCH_CHARS]} [...] {text[-MATCH_CHARS:]}"


def _segments(text: str) -> list[str]:
    """A tqdm line redrawn with `\\r` holds several states; each is read in order."""
    return [segment for segment in _ANSI.sub("", text).split("\r") if segment.strip()]


def _find_step(
    text: str, patterns: tuple[re.Pattern[str], ...], notes: list[str] | None = None
) -> int | None:
    """The step of the line's last redraw that names one; an implausible step is noted."""
    if "slurmstepd:" in text or "srun:" in text:
        return None  # Slurm's own "step 123.0" is a job step, not a training step
    for segment in reversed(_segments(text)):
        for pattern in patterns:
            match = pattern.search(_matchable(segment))
            if match is not None:
                digits = match.group("step" if "step" in pattern.groupindex else 1) or ""
                step = bounded_int(digits, MAX_STEP)
                if step is None or step < 0:
                    if notes is not None:
                        _note(notes, f"a step beyond 0..{MAX_STEP} was dropped")
                    return None
                return step
    return None


def _analyse_line(state: _Analysis, offset: int, text: str) -> None:
    rank, source, node, whole = _strip(text)
    if source == "local":
        state.rank_from_local_prefix = True
    if source is not None and rank is None:
        state.note(f"a {source} rank prefix beyond {MAX_RANK} was dropped")
    step = _find_step(text, state.step_patterns, state.notes)
    if step is not None:
        state.steps.append((offset, step, rank))
    body = _matchable(whole)
    rank_state = state.ranks.setdefault(rank, _RankState())
    if _TRACEBACK_START in body:
        rank_state.frames = []
        rank_state.in_traceback = True
        return
    if _table_line(state, body):
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
    family = detect_family(body)
    exception = _EXCEPTION.match(body.strip())
    error_type = exception.group("type") if exception else None
    if family is not None:
        state.events.append(
            _Event(offset, "oom", rank, node, body.strip(), _frames(rank_state), error_type, family)
        )
        rank_state.in_traceback = False
        return
    if _CASCADE.search(body):
        state.events.append(_Event(offset, "cascade", rank, node, body.strip()))
        rank_state.in_traceback = False
        return
    if exception is not None:
        state.events.append(
            _Event(offset, "exception", rank, node, body.strip(), _frames(rank_state), error_type)
        )
        rank_state.in_traceback = False


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
    """srun's per-task errors and torchrun's agent lines: who died, where, with which code."""
    if (match := _SRUN_ERROR.search(body)) and len(state.srun_errors) < MAX_SRUN_ERRORS:
        tasks = _task_ids(match.group("tasks"), state.notes)
        state.srun_errors.append((match.group("node"), tasks, match.group("what").strip()))
    for pattern in (_ELASTIC_FAILED, _CLOSING_SIGNAL):
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


def _table_line(state: _Analysis, body: str) -> bool:
    """torchrun's ChildFailedError table: `Root Cause (first observed failure):` then fields."""
    stripped = body.strip()
    if stripped.startswith("Root Cause (first observed failure)"):
        state.in_root_section = True
        return True
    if stripped.startswith(("Failures:", "Other Failures:")):
        state.in_root_section = False
        return True
    if _TABLE_ENTRY.match(body):
        state.table.append(_TableEntry(root_cause=state.in_root_section))
        return True
    match = _TABLE_FIELD.match(body)
    if match is None or not state.table:
        return False
    entry = state.table[-1]
    key, value = match.group(1), match.group(2).strip()
    if key == "host":
        entry.host = value or None
    elif key == "rank" and (rank := _TABLE_RANK.match(value)):
        entry.rank = _bounded(state, rank.group(1), MAX_RANK, "rank")
        entry.local_rank = _bounded(state, rank.group(2), MAX_RANK, "local rank")
    elif key == "exitcode" and (code := _TABLE_EXIT.match(value)):
        entry.exitcode = _bounded(state, code.group(1), MAX_EXIT_CODE, "exit code")
        entry.pid = _bounded(state, code.group(2), MAX_PID, "process id")
        if entry.pid is not None:
            state.job_pids.add(entry.pid)
    elif key == "traceback":
        entry.traceback = value
    return True


def _bounded(state: _Analysis, digits: str | None, limit: int, what: str) -> int | None:
    """A number of the torchrun table, or None (noted) when it is beyond its plausible range."""
    if digits is None:
        return None
    value = bounded_int(digits, limit)
    if value is None:
        state.note(f"a {what} beyond {limit} in torchrun's failure table was dropped")
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
    family = detect_family(message)
    lines = message.strip().splitlines()
    exception = _EXCEPTION.match(_matchable(lines[0]) if lines else "")
    kind = "oom" if family is not None else "exception"
    error_type = exception.group("type") if exception else None
    text = message.strip()[:2000]
    state.events.append(
        _Event(offset, kind, rank, node, text, tuple(frames), error_type, family, message)
    )


def _findings(state: _Analysis, scanned: int) -> LogFindings:
    root = _choose_root(state)
    notes = list(state.notes)
    job_pids = tuple(sorted(state.job_pids))
    max_step = max((step for _, step, _ in state.steps), default=None)
    if root is None:
        exit_code, signal = _exit_from_summaries(state, None)
        notes.append(f"no failure message found in the last {scanned} bytes read")
        return LogFindings(
            max_step_seen=max_step,
            exit_code=exit_code,
            killed_by_signal=signal,
            notes=tuple(notes),
            job_pids=job_pids,
            bytes_scanned=scanned,
        )
    rank, node = _root_rank_and_node(state, root, notes)
    exit_code, signal = _exit_from_summaries(state, rank)
    if root.family is OomFamily.HOST_RAM and signal is None:
        signal = 9
    cascade_ranks = sorted(
        {event.rank for event in state.events if event.kind == "cascade" and event.rank is not None}
        - {rank}
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
        step=_step_at_failure(state, root),
        max_step_seen=max_step,
        phase=_phase(root.frames),
        frames=tuple(frame.func for frame in root.frames),
        heavy_kernels=_heavy_kernels(root.frames),
        oom=root.oom(),
        root_failure_line=root.text[:2000],
        cascade_ranks=tuple(cascade_ranks),
        exit_code=exit_code,
        killed_by_signal=signal,
        notes=tuple(notes),
        error_type=root.error_type,
        job_pids=job_pids,
        traceback_seen=bool(root.frames),
        bytes_scanned=scanned,
    )


def _step_at_failure(state: _Analysis, root: _Event) -> int | None:
    """The last training step logged before the failure.

    In an srun log the ranks' stdout (buffered: the step lines) and the failing rank's stderr
    (its traceback) arrive in no set order, so rank 0's steps 3-6 can land after rank 3's
    traceback. When the failing rank logged no step of its own, the steps the other ranks
    logged up to the collective timeouts the failure caused count too: the ranks step
    together, so none gets past the step the failing rank died in. A resumed run's "resumed
    ... at step N" line is one of those steps.
    """
    before = [step for offset, step, _ in state.steps if offset <= root.offset]
    own_steps = any(rank == root.rank for _, _, rank in state.steps)
    if root.rank is None or root.kind == "cascade" or own_steps:
        return before[-1] if before else None
    limit = min(
        (e.offset for e in state.events if e.kind == "cascade" and e.offset > root.offset),
        default=None,
    )
    reached = [
        step
        for offset, step, rank in state.steps
        if (offset <= root.offset or rank != root.rank) and (limit is None or offset <= limit)
    ]
    return reached[-1] if reached else None


def _choose_root(state: _Analysis) -> _Event | None:
    """Earliest root failure; cascades only when nothing else failed; SIGKILLs from summaries."""
    gpu_ooms = [
        e
        for e in state.events
        if e.kind == "oom" and e.family is not None and e.family is not OomFamily.HOST_RAM
    ]
    host_ram = [e for e in state.events if e.kind == "oom" and e.family is OomFamily.HOST_RAM]
    exceptions = [e for e in state.events if e.kind == "exception"]
    if gpu_ooms and (not exceptions or gpu_ooms[0].offset <= exceptions[0].offset):
        return gpu_ooms[0]
    certain_host = [e for e in host_ram if host_ram_is_certain(e.text)]
    if certain_host:
        return certain_host[0]
    if exceptions:
        return exceptions[0]
    if gpu_ooms:
        return gpu_ooms[0]
    if host_ram:
        return host_ram[0]
    table_root = next((entry for entry in state.table if entry.root_cause), None)
    if table_root is not None and table_root.exitcode == -9:
        text = f"torchrun: rank {table_root.rank} exitcode -9 ({table_root.traceback or 'SIGKILL'})"
        return _Event(-1, "oom", table_root.rank, table_root.host, text, family=detect_family(text))
    cascades = [e for e in state.events if e.kind == "cascade"]
    return cascades[0] if cascades else None


def _root_rank_and_node(
    state: _Analysis, root: _Event, notes: list[str]
) -> tuple[int | None, str | None]:
    rank = root.rank
    killed = _SRUN_ERROR.search(root.text) if root.rank is None else None
    if killed is not None and (first := _task_ids(killed.group("tasks"), notes).first) is not None:
        # the root failure is srun's own line (`srun: error: gpu-04: task 3: Killed`)
        notes.append(f"rank {first} and node taken from srun's line for the root failure")
        return first, root.node or killed.group("node")
    table_root = next((entry for entry in state.table if entry.root_cause), None)
    if rank is None and table_root is not None:
        rank = table_root.rank
    listed = [(node, tasks) for node, tasks, _ in state.srun_errors if tasks.first is not None]
    failed = [
        (node, tasks)
        for node, tasks, what in state.srun_errors
        if tasks.first is not None and "Terminated" not in what and "Killed" not in what
    ] or listed
    if rank is None and failed:
        rank = failed[0][1].first
        notes.append(f"rank taken from srun's first failed task {rank}")
    node = root.node
    if node is None:
        for entry in state.table:
            if entry.rank is not None and entry.rank == rank and entry.host:
                node = entry.host
                break
    if node is None and rank is not None:
        node = next((task_node for task_node, tasks in failed + listed if rank in tasks), None)
    if node is None and len({task_node for task_node, _ in failed}) == 1:
        node = failed[0][0]
    return rank, node


def _exit_from_summaries(state: _Analysis, rank: int | None) -> tuple[int | None, int | None]:
    for _, tasks, what in state.srun_errors:
        if rank is not None and rank not in tasks:
            continue
        if match := _EXIT_CODE.search(what):
            code = bounded_int(match.group(1), MAX_EXIT_CODE)
            if code is not None:
                return code, (code - 128 if code > 128 else None)
        if what.startswith("Killed"):
            return None, 9
    for entry in state.table:
        if entry.exitcode is not None and (rank is None or entry.rank == rank):
            return entry.exitcode, (-entry.exitcode if entry.exitcode < 0 else None)
    return None, None


def _phase(frames: tuple[_Frame, ...]) -> Phase:
    for phase, func_pattern in _PHASE_FUNCS:
        path_pattern = next((p for ph, p in _PHASE_PATHS if ph is phase), None)
        code_pattern = next((p for ph, p in _PHASE_CODE if ph is phase), None)
        for frame in frames:
            path = frame.path.replace("\\", "/")
            if (
                func_pattern.match(frame.func)
                or (path_pattern is not None and path_pattern.search(path))
                or (code_pattern is not None and code_pattern.search(frame.code))
            ):
                return phase
    return Phase.UNKNOWN


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
