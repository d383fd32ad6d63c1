"""Text that remembers where each character was written.

A `Text` is what a shell word or a config value expands to, as segments: literal characters
with the file and offset they were read from (and how they were quoted there), characters with
no single place (decoded escapes), and opaque runs: expressions whose value is only known at run
time (`$1`, `$(hostname)`, a variable from the environment), kept as written. Following a value
through `X=2` ... `--micro-batch-size $X` then needs no bookkeeping of its own: the characters
of `2` still point at the assignment.

Each segment also carries the `$X` references it was expanded through (`Frame`s, outermost
first), which is how the analysis finds the lines a value passed through and where a new flag
can be appended to a command built from variables.

Costs: building a text is linear in its segments and characters, and so is `concat` of many;
finding a position (`slice`, `origin_at`...) is a binary search over the segments' ends, kept
once computed. Repeated `a + b` onto a growing text is quadratic; callers that join many pieces
use `concat`, and the walk bounds how much references copy in all (`expansion.Work`).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from daemon.importer.records import Form

MAX_VALUE_CHARS = 262_144  # one expanded value; a real command line is a few KB
MAX_FRAMES = 16  # references one character is followed through
MAX_SEGMENTS = 4096  # places one value is assembled from (a real one has a handful)
_BLANKS = " \t\n"
_BLANK_RUN = re.compile(r"[ \t\n]+")
WHOLE_NUMBER = re.compile(r"[0-9][0-9_]*\Z")
MAX_NUMBER_DIGITS = 64  # Python converts at most 4,300 digits (ValueError past it)


def whole_number(text: str) -> int | None:
    """`text` as a whole number (`1_000` too), or None: not one, or longer than
    MAX_NUMBER_DIGITS (a batch size of 5,000 digits raised from `int()`, a traceback)."""
    if len(text) > MAX_NUMBER_DIGITS or not WHOLE_NUMBER.match(text):
        return None
    try:
        return int(text)
    except ValueError:  # `1__0`, `1_`: underscores `int()` refuses
        return None


@dataclass(frozen=True, slots=True)
class Frame:
    """A `$X` a character was expanded through: written at file[start:end] in `form`."""

    file: str
    start: int
    end: int
    form: Form
    offset: int  # where the segment's first character sits in that expansion's value
    last: int  # index of the expansion's last non-blank character, -1 if it had none
    tail_newline: bool = False  # a newline follows that character: read as code, it ends a line


@dataclass(frozen=True, slots=True)
class Seg:
    text: str
    file: str | None = None  # None: a character with no single place (a decoded escape)
    start: int = 0  # the file offset of text[0]
    form: Form | None = None
    opaque: bool = False  # text is an expression only known at run time, as written
    why: str = ""  # for opaque text: what it depends on
    span: int = -1  # for opaque text: the length written at `start` when it is not `text`
    frames: tuple[Frame, ...] = ()

    def cut(self, begin: int, end: int) -> Seg:
        """The segment's characters [begin, end): origin and frames follow the cut."""
        if self.opaque or (begin == 0 and end == len(self.text)):
            return self
        frames = tuple(_shifted(frame, begin) for frame in self.frames)
        return Seg(
            self.text[begin:end],
            self.file,
            self.start + begin,
            self.form,
            self.opaque,
            self.why,
            self.span,
            frames,
        )

    def framed(self, frames: tuple[Frame, ...]) -> Seg:
        return Seg(
            self.text, self.file, self.start, self.form, self.opaque, self.why, self.span, frames
        )


def _shifted(frame: Frame, step: int) -> Frame:
    """`frame` for a character `step` further into its expansion's value (no `replace`: this
    runs for every segment a reference copies)."""
    if not step:
        return frame
    return Frame(
        frame.file,
        frame.start,
        frame.end,
        frame.form,
        frame.offset + step,
        frame.last,
        frame.tail_newline,
    )


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive characters written in one place."""

    file: str
    start: int
    end: int
    form: Form | None


def _joinable(first: Seg, second: Seg, length: int) -> bool:
    """Whether `second` continues `first` (whose text is `length` characters long so far)."""
    if first.opaque or second.opaque or first.form is not second.form:
        return False
    if first.file != second.file or len(first.frames) != len(second.frames):
        return False
    if first.file is not None and first.start + length != second.start:
        return False
    return all(
        one == _shifted(two, -length) for one, two in zip(first.frames, second.frames, strict=True)
    )


def _merged(segs: Iterable[Seg], limit: int | None = None) -> list[Seg] | None:
    """The segments with each run that continues one place joined into one, empty ones
    dropped; None past `limit` segments. Linear: a run's texts are joined once at its end."""
    merged: list[Seg] = []
    pending: list[str] = []  # texts that continue merged[-1]
    length = 0  # merged[-1]'s length with them
    for seg in segs:
        if not seg.text and not seg.opaque:
            continue
        if merged and _joinable(merged[-1], seg, length):
            pending.append(seg.text)
            length += len(seg.text)
            continue
        if pending:
            last = merged[-1]
            merged[-1] = replace(last, text=last.text + "".join(pending))
            pending = []
        merged.append(seg)
        length = len(seg.text)
        if limit is not None and len(merged) > limit:
            return None
    if pending:
        last = merged[-1]
        merged[-1] = replace(last, text=last.text + "".join(pending))
    return merged


class Text:
    """An immutable string of segments; `plain` is the string with opaque runs as written."""

    __slots__ = ("_ends", "plain", "segs")

    segs: tuple[Seg, ...]
    plain: str
    _ends: list[int] | None  # where each segment ends in `plain`, computed when first needed

    def __init__(self, segs: Iterable[Seg] = ()) -> None:
        if type(segs) is tuple and len(segs) == 1 and (segs[0].text or segs[0].opaque):
            self._set(list(segs))  # `written`, `derived`, `unknown`: nothing to merge
        else:
            self._set(_merged(segs) or [])

    def _set(self, merged: list[Seg]) -> None:
        self.segs = tuple(merged)
        self.plain = "".join(seg.text for seg in merged)
        self._ends = None

    @classmethod
    def _of_merged(cls, merged: list[Seg]) -> Text:
        """A text of segments already merged (by `_merged`), without merging them again."""
        text = cls.__new__(cls)
        text._set(merged)
        return text

    @classmethod
    def written(cls, file: str, start: int, text: str, form: Form) -> Text:
        """Characters read as they are from `file` at `start`."""
        return cls((Seg(text, file, start, form),))

    @classmethod
    def derived(cls, text: str) -> Text:
        """Characters with no single place in any file."""
        return cls((Seg(text),))

    @classmethod
    def unknown(
        cls,
        expression: str,
        why: str,
        place: tuple[str, int, Form | None] | None = None,
        span: int = -1,
    ) -> Text:
        """An expression only known at run time, optionally with where it is written (`span`
        characters there, when that is not the expression itself)."""
        file, start, form = place if place is not None else (None, 0, None)
        return cls((Seg(expression, file, start, form, opaque=True, why=why, span=span),))

    def __len__(self) -> int:
        return len(self.plain)

    def __bool__(self) -> bool:
        return bool(self.segs)

    def __add__(self, other: Text) -> Text:
        if len(self.segs) + len(other.segs) > MAX_SEGMENTS:
            return too_long()
        if len(self.plain) + len(other.plain) > MAX_VALUE_CHARS or any(
            seg.opaque and seg.why == _TOO_LONG.why for seg in (*self.segs, *other.segs)
        ):
            return too_long()
        return Text(self.segs + other.segs)

    def __repr__(self) -> str:
        return f"Text({self.plain!r})"

    @property
    def opaque(self) -> bool:
        return any(seg.opaque for seg in self.segs)

    def unknowns(self) -> list[Seg]:
        return [seg for seg in self.segs if seg.opaque]

    def _located(self, at: int = 0) -> Iterator[tuple[int, Seg]]:
        """The segments from the one holding character `at` (or an empty one starting there)
        on, each with its position: a binary search, then a walk."""
        ends = self._ends
        if ends is None:
            ends = self._ends = []
            position = 0
            for seg in self.segs:
                position += len(seg.text)
                ends.append(position)
        index = bisect.bisect_left(ends, at)  # the first segment that ends at `at` or later
        position = ends[index - 1] if index else 0
        segs = self.segs
        for at_index in range(index, len(segs)):  # not `segs[index:]`: a copy per call
            seg = segs[at_index]
            yield position, seg
            position += len(seg.text)

    def slice(self, begin: int, end: int) -> Text:
        """Characters [begin, end); an opaque run partly inside is kept whole."""
        end = min(end, len(self.plain))
        if begin <= 0 and end >= len(self.plain):
            return self
        kept: list[Seg] = []
        for position, seg in self._located(max(begin, 0)):
            if position > end:
                break
            seg_end = position + len(seg.text)
            outside = seg_end <= begin or position >= end
            if outside and not (seg.opaque and position == begin == end):
                continue
            kept.append(seg.cut(max(begin - position, 0), min(end, seg_end) - position))
        return Text(kept)

    def strip(self) -> Text:
        stripped = self.plain.strip(_BLANKS)
        if len(stripped) == len(self.plain):
            return self
        begin = len(self.plain) - len(self.plain.lstrip(_BLANKS))
        return self.slice(begin, begin + len(stripped))

    def split_blanks(self) -> tuple[list[Text], bool, bool]:
        """Field splitting: the fields, and whether blanks came first and last.

        Only known characters split; an opaque run stays inside its field whole.
        """
        fields: list[Text] = []
        current: list[Seg] = []
        leading = trailing = False
        for seg in self.segs:
            if seg.opaque:
                current.append(seg)
                trailing = False
                continue
            cursor = 0
            for blank in _BLANK_RUN.finditer(seg.text):
                if blank.start() > cursor:
                    current.append(seg.cut(cursor, blank.start()))
                if current:
                    fields.append(Text(current))
                    current = []
                elif not fields:
                    leading = True
                cursor = blank.end()
            if cursor < len(seg.text):
                current.append(seg.cut(cursor, len(seg.text)))
                trailing = False
            elif seg.text:
                trailing = True
        if current:
            fields.append(Text(current))
        return fields, leading, trailing

    def through(self, file: str, start: int, end: int, form: Form) -> Text:
        """This value as expanded from a `$X` written at file[start:end]."""
        stripped = self.plain.rstrip(_BLANKS)
        last = len(stripped) - 1
        newline = "\n" in self.plain[len(stripped) :]
        segs = []
        deep = False
        for position, seg in self._located():
            frame = Frame(file, start, end, form, position, last, newline)
            deep = deep or len(seg.frames) >= MAX_FRAMES
            segs.append(seg.framed((frame, *seg.frames)[:MAX_FRAMES]))
        # One more outer frame, shifted along with the characters, joins no two segments that
        # did not join before, unless the cut at MAX_FRAMES dropped the frames that differed.
        return Text(segs) if deep else Text._of_merged(segs)

    def runs(self) -> list[Run] | None:
        """The places the characters were written, merged when consecutive; None when a
        character has no place or is only known at run time."""
        result: list[Run] = []
        for seg in self.segs:
            if seg.opaque or seg.file is None:
                return None
            end = seg.start + len(seg.text)
            previous = result[-1] if result else None
            if previous is not None and (previous.file, previous.end, previous.form) == (
                seg.file,
                seg.start,
                seg.form,
            ):
                result[-1] = replace(previous, end=end)
                continue
            result.append(Run(seg.file, seg.start, end, seg.form))
        return result

    def located_runs(self) -> list[Run]:
        """The places of the characters that have one (opaque runs and derived characters
        left out), merged when consecutive."""
        result: list[Run] = []
        for seg in self.segs:
            if seg.opaque or seg.file is None:
                continue
            end = seg.start + len(seg.text)
            previous = result[-1] if result else None
            if previous is not None and (previous.file, previous.end, previous.form) == (
                seg.file,
                seg.start,
                seg.form,
            ):
                result[-1] = replace(previous, end=end)
            else:
                result.append(Run(seg.file, seg.start, end, seg.form))
        return result

    def frames_at(self, index: int) -> tuple[Frame, ...]:
        """The references the character at `index` came through, with offsets made exact."""
        for position, seg in self._located(index):
            if position > index:
                break
            if position <= index < position + len(seg.text):
                step = index - position
                return tuple(_shifted(frame, step) for frame in seg.frames)
        return ()

    def end_at(self, index: int) -> tuple[str, int, Form | None] | None:
        """Where text written right after the character at `index` would go: after it in its
        file, or after the whole expression for an opaque run."""
        for position, seg in self._located(index):
            if position > index:
                break
            if position <= index < position + len(seg.text):
                if seg.file is None:
                    return None
                if seg.opaque:
                    return seg.file, seg.start + written_length(seg), seg.form
                return seg.file, seg.start + index - position + 1, seg.form
        return None

    def origin_at(self, index: int) -> tuple[str, int, Form | None] | None:
        """Where the character at `index` is written (file, offset, form), when it is."""
        for position, seg in self._located(index):
            if position > index:
                break
            if position <= index < position + len(seg.text):
                if seg.file is None:
                    return None
                return seg.file, seg.start + (0 if seg.opaque else index - position), seg.form
        return None


def written_length(seg: Seg) -> int:
    """How many characters of its file an opaque segment stands for."""
    return seg.span if seg.span >= 0 else len(seg.text)


_TOO_LONG = Seg("(value too long)", opaque=True, why=f"longer than {MAX_VALUE_CHARS} characters")


def too_long() -> Text:
    """What a value becomes past MAX_VALUE_CHARS; it stays so whatever is added to it."""
    return Text((_TOO_LONG,))


def concat(texts: Iterable[Text]) -> Text:
    """The texts one after the other, built once: what `a + b + c...` gives (too long past the
    same limits, counted on the merged segments), in time linear in the pieces where the
    repeated `+` was quadratic."""
    pieces = list(texts)
    if sum(len(text.plain) for text in pieces) > MAX_VALUE_CHARS or any(
        seg.opaque and seg.why == _TOO_LONG.why for text in pieces for seg in text.segs
    ):
        return too_long()
    if len(pieces) == 1 and len(pieces[0].segs) <= MAX_SEGMENTS:
        return pieces[0]  # a word of one piece, the common case
    merged = _merged((seg for text in pieces for seg in text.segs), MAX_SEGMENTS)
    return too_long() if merged is None else Text._of_merged(merged)


def join(texts: Iterable[Text], separator: str = " ") -> Text:
    gap = Text.derived(separator) if separator else Text()

    def pieces() -> Iterator[Text]:
        for index, text in enumerate(texts):
            if index:
                yield gap
            yield text

    return concat(pieces())
