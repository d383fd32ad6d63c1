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
launcher reported it (`death_lines.DEATH_LINES`, torchrun's Root Cause table, srun's task lines).
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

The scan is cut at its seams: `log_reader` reads back (windows, lines across them, the search
far from the end), `log_lines` says what one line is (prefixes, frames, exceptions, a root
candidate), `log_analysis` and `log_tables` read the kept lines forward into `log_events`'
records, and `root_failure` chooses the root and writes the findings. This module opens the
log, holds the budgets and the time limit, and steers the reading by what it finds.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from daemon.evidence.log_analysis import analyse_line
from daemon.evidence.log_events import ScanState
from daemon.evidence.log_lines import TRACEBACK_START, is_root_candidate
from daemon.evidence.log_reader import (
    Cursor,
    FarLines,
    FdReader,
    StreamReader,
    TextStats,
    add_followers,
    decode,
    lines_backward,
)
from daemon.evidence.log_tables import MAX_JSON_CHARS, elastic_json
from daemon.evidence.records import LogFindings
from daemon.evidence.root_failure import log_findings
from daemon.evidence.steps import DEFAULT_STEP_PATTERNS, find_step
from daemon.evidence.units import MIB

DEFAULT_BLOCK_SIZE = 4 * MIB  # a window read with one pread and searched at once
# How far back from the end a scan may look. The failure of a dead job is nearly always in its
# last few MB, but the cascade after it (watchdog dumps, flight-recorder lines, SIGTERM tables
# of thousands of ranks) can be hundreds of MB; the time limit bounds the work anyway.
DEFAULT_BYTE_BUDGET = 4 * 1024 * MIB
TAIL_FULL_BYTES = MIB  # summaries (tables, srun errors, cascades) are printed last
LOOKBEHIND_BYTES = 4 * MIB  # how far before the earliest root failure to look for frames and steps
MIN_LOOKBEHIND_BYTES = 256 * 1024  # at least this much, to catch another rank failing a bit earlier
# What the forward pass holds: a real tail (1 MB) and look-behind (4 MB) of short lines stays
# well within both; a log of millions of tiny or trigger-holding lines stops here.
MAX_KEPT_LINES = 100_000
MAX_KEPT_BYTES = 16 * MIB
DEFAULT_TIME_LIMIT = 20.0  # seconds; a real log of gigabytes is scanned in a few
READ_SHARE = 0.5  # of the time limit, for reading backwards; the rest is the analysis's


class LogReadError(Exception):
    """The log cannot be read as a regular file (missing, a FIFO, a symlink, no permission)."""


@dataclass(frozen=True)
class _Deadline:
    """The scan's time limit: reading back may use `READ_SHARE` of it, the analysis the rest."""

    clock: Callable[[], float]
    start: float
    limit: float

    def passed(self, share: float = 1.0) -> bool:
        return self.clock() - self.start >= self.limit * share


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
        return _scan(FdReader(source), patterns, block_size, byte_budget, deadline)
    if isinstance(source, (str, os.PathLike)):
        fd = _open_regular(os.fspath(source), follow_symlinks=follow_symlinks)
        try:
            return _scan(FdReader(fd), patterns, block_size, byte_budget, deadline)
        finally:
            os.close(fd)
    if not source.seekable():
        raise LogReadError("the log stream is not seekable: pass a regular file")
    return _scan(StreamReader(source), patterns, block_size, byte_budget, deadline)


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


def _scan(
    reader: FdReader | StreamReader,
    step_patterns: tuple[re.Pattern[str], ...],
    block_size: int,
    byte_budget: int,
    deadline: _Deadline,
) -> LogFindings:
    size = reader.size
    if size == 0:
        return LogFindings(notes=("the log is empty",))
    if size <= MAX_JSON_CHARS:
        whole = decode(reader.read_at(0, size)).strip()
        if whole.startswith("{") and '"message"' in whole:
            state = ScanState(step_patterns=step_patterns)
            elastic_json(state, 0, None, None, whole)
            if state.events:
                return log_findings(state, size)
    kept, scanned, notes = _collect_backward(
        reader, size, block_size, byte_budget, step_patterns, deadline=deadline
    )
    state = ScanState(step_patterns=step_patterns, notes=notes)
    for index, (offset, text) in enumerate(kept):
        if deadline.passed():
            state.notes.append(  # not `note`: this one must be said even past MAX_NOTES
                f"the scan was cut short at its {deadline.limit:g} s time limit: only the first"
                f" {index} of the {len(kept)} lines kept were analysed"
            )
            break
        analyse_line(state, offset, text)
    return log_findings(state, scanned)


def _collect_backward(
    reader: FdReader | StreamReader,
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
    of ranks can fill hundreds of megabytes: `FarLines` keeps its start); then the few lines
    after each trigger line kept (`add_followers`).
    """
    kept: list[tuple[int, str]] = []
    roots: list[tuple[int, int]] = []  # (offset, end) of root lines found by a trigger
    far = FarLines()
    text_stats = TextStats()
    cursor = Cursor(full_from=size - TAIL_FULL_BYTES, lowest=0, position=size)
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

    lines = lines_backward(
        reader,
        size,
        block_size,
        byte_budget,
        cursor,
        far=far,
        is_root=is_root_candidate,
        out_of_time=out_of_time,
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
        if line.found_by_trigger or is_root_candidate(text):
            earliest_root = line.offset
            traceback_before_root = False
            step_before_root = False
            cursor.full_from = min(cursor.full_from, earliest_root - LOOKBEHIND_BYTES)
            cursor.lowest = earliest_root - LOOKBEHIND_BYTES
        elif earliest_root is not None and line.offset < earliest_root:
            traceback_before_root = traceback_before_root or TRACEBACK_START in text
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
    kept.extend(add_followers(reader, triggered, {offset for offset, _ in kept}, text_stats))
    kept.sort(key=lambda item: item[0])
    notes.extend(text_stats.notes())
    return kept, scanned, notes
