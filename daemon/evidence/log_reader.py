"""Reading a job log back from its end, in windows, without ever holding the whole file.

The reader knows bytes and lines, not failures: which lines far from the end are worth cutting
out is asked of a judge it is given (`log_lines.is_root_candidate` in the scan), and the
collector in `joblog` steers it through a shared `Cursor`. Each window is one `pread`; far from
the end only the lines around a trigger's hit reach Python code (`lines_backward`), and a
cascade's repeated line shapes are judged once each (`CandidateMemo`).
"""

from __future__ import annotations

import bisect
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

from daemon.evidence.log_lines import MATCH_CHARS
from daemon.evidence.units import MIB

LINE_KEEP_BYTES = 64 * 1024  # of a longer line, keep this much of its head and of its tail
FOLLOWER_LINES = 16  # kept after a failure line found far from the end (its continuation)
FOLLOWER_BYTES = 32 * 1024  # within this many bytes after it
BINARY_SHARE = 0.3  # above this share of control characters the log is noted as binary
# Trigger lines between the tail and the root failure's look-behind (a cascade): the earliest
# this many are kept for the forward pass (and as many lines after them), the rest counted.
MAX_FAR_LINES = 2000
MAX_FAR_BYTES = MIB  # of the lines after them
# Far from the end each trigger line is classified once per shape (`CandidateMemo`): keys of
# lines up to this long, up to about this many bytes of memo before it starts again.
MEMO_LINE_BYTES = 4096
MEMO_BYTES = 4 * MIB
MEMO_ENTRY_BYTES = 160  # a dict slot, a bytes object and a tuple, besides the key's own bytes
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
ROOT_TRIGGERS = (
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


_TRIGGER_ANCHORS = tuple((trigger, _anchor(trigger)) for trigger in ROOT_TRIGGERS)
# What tells a cascade's lines of one shape apart (ranks, sequence numbers, process ids,
# timestamps, hex addresses): all 0 in `CandidateMemo`'s keys, which keep the lengths.
_SHAPE = bytes.maketrans(b"0123456789abcdef", b"0" * 16)
_UNIFORM_DIGITS = tuple(
    bytes.maketrans(b"0123456789", bytes([digit]) * 10) for digit in b"0123456789"
)
_CUT = b" [...] "  # where the middle of a long line was cut out
_CONTROL_CHARS = dict.fromkeys(code for code in range(32) if chr(code) not in "\t\r\x1b")


class FdReader:
    """`pread` on a descriptor: no shared offset, and a file cut short under it gives a short
    read (a memory map of it would give SIGBUS, and count against the reader's address-space
    limit); the copy costs less than a tenth of the search."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.size = os.fstat(fd).st_size

    def read_at(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)


class StreamReader:
    """A seekable binary stream read as `FdReader` reads a descriptor."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.size = stream.seek(0, os.SEEK_END)

    def read_at(self, offset: int, length: int) -> bytes:
        self._stream.seek(offset)
        return self._stream.read(length)


class Line(NamedTuple):
    """A line as read back: its offset, its end (its newline, or the end of the file), its
    bytes (cut to their two ends when long), and whether it was found by a root trigger outside
    the parts read whole (such a line reaches the collector only when it is a root failure)."""

    offset: int
    end: int
    raw: bytes
    cut: bool
    found_by_trigger: bool


@dataclass
class Cursor:
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


def lines_backward(
    reader: FdReader | StreamReader,
    size: int,
    block_size: int,
    byte_budget: int,
    cursor: Cursor,
    *,
    far: FarLines,
    is_root: Callable[[str], bool],
    out_of_time: Callable[[], bool],
) -> Iterator[Line]:
    """Yield lines from the last to the first, within the byte budget: every line that ends at
    or after `cursor.full_from`; before that, of the lines holding a root trigger, those that
    are root failures by `is_root` (the others go to `far`).

    Each window of `block_size` bytes is read with one `pread`. A window without a trigger's
    rarest byte costs one memchr for that trigger, one with it one `rfind` pass, all in C; only
    the lines around a hit reach Python code, and a cascade's repeated line shapes are judged
    once each (`CandidateMemo`).
    """
    horizon = max(0, size - byte_budget)  # no byte before it is read
    memo = CandidateMemo(is_root)
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
    cursor: Cursor,
    far: FarLines,
    memo: CandidateMemo,
) -> Iterator[Line]:
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
            yield Line(offset, carry.end, raw, cut, False)
        elif any(trigger in raw for trigger, _ in _TRIGGER_ANCHORS):
            if memo.is_root(raw):
                yield Line(offset, carry.end, raw, cut, True)
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
            yield Line(start + line_start, start + newline, raw, cut, False)
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
            yield Line(start + line_start, start + line_end, raw, cut, True)
        else:
            far.add(start + line_start, start + line_end, raw)
        bottom = line_start


class FarLines:
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


def add_followers(
    reader: FdReader | StreamReader,
    triggered: list[tuple[int, int]],
    known: set[int],
    text_stats: TextStats,
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


class CandidateMemo:
    """A judge's verdict on trigger lines far from the end, remembered by the line's shape.

    A cascade repeats a few line shapes for every rank, which differ in ranks, sequence
    numbers, process ids, timestamps and addresses: the key is the line with its digits and
    lower-case hex letters made 0. A shape met a second time is judged again, as read and with
    all its digits made 0, then 1, ... then 9; only a shape whose verdict did not move is
    remembered, so a pattern that holds a number (`received signal 15`, `Cuda failure 2`) has
    its shapes judged line by line. (A pattern for one number of unlike digits, such as 700,
    would pass this check; the patterns for lines that hold a trigger name no such number.)
    The lines read whole, where the root failure nearly always is, are judged one by one.
    """

    def __init__(self, judge: Callable[[str], bool]) -> None:
        self._judge = judge
        # key -> (verdict, or None when it moves with the digits; whether it is settled)
        self._known: dict[bytes, tuple[bool | None, bool]] = {}
        self._size = 0

    def is_root(self, raw: bytes) -> bool:
        if len(raw) > MEMO_LINE_BYTES:  # judged alone, by the ends the patterns see anyway
            if len(raw) > 2 * MATCH_CHARS:
                raw = raw[:MATCH_CHARS] + _CUT + raw[-MATCH_CHARS:]
            return self._judge(decode(raw))
        key = raw.translate(_SHAPE)
        known, settled = self._known.get(key, (None, False))
        if settled and known is not None:
            return known
        verdict = self._judge(decode(raw))
        if settled:
            return verdict
        if key not in self._known:
            self._remember(key, (verdict, False))
            return verdict
        stable = known is verdict and all(
            self._judge(decode(raw.translate(digits))) is verdict for digits in _UNIFORM_DIGITS
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
class TextStats:
    """What the kept lines were like, for the notes: cut, invalid UTF-8, control characters."""

    cut: int = 0
    replaced: int = 0
    control: int = 0
    decoded: int = 0

    def decode(self, raw: bytes, cut: bool) -> str:
        text = decode(raw)
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


def decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\r\n")
