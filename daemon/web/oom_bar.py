"""An OOM message's numbers as one bar a person reads at a glance, and in words beside it.

The card's memory, left to right: what PyTorch had allocated, what it held reserved but
unallocated (stranded: the allocator's fix would free it for the request), what was in use
outside PyTorch's reserve (other processes, the CUDA context), and what the driver called
free; under it the failed request on the same scale. Messages print different subsets of
these numbers (XLA and NCCL print no card, old PyTorch no split of the reserve), so a
figure that is missing is said to be missing and never drawn as zero; one derivable from the
others (reserved = allocated + stranded) is derived. Pure: the page draws the segments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

GIB = 2**30
PERCENT = 100.0
NOT_PRINTED = "not printed"
DERIVED = "derived: reserved = allocated + stranded"


class Part(StrEnum):
    """A segment of the bar; the page colours each."""

    ALLOCATED = "allocated"
    STRANDED = "stranded"
    RESERVED = "reserved"  # PyTorch's reserve when the message does not split it
    OTHER = "other"
    UNACCOUNTED = "unaccounted"
    FREE = "free"
    REQUEST = "request"


_LABELS = {
    Part.ALLOCATED: "allocated by PyTorch",
    Part.STRANDED: "stranded (reserved but unallocated)",
    Part.RESERVED: "reserved by PyTorch (split not printed)",
    Part.OTHER: "in use outside PyTorch's reserve",
    Part.UNACCOUNTED: "not accounted for by the message",
    Part.FREE: "free",
    Part.REQUEST: "requested",
}


@dataclass(frozen=True)
class OomFigures:
    """The numbers an OOM message printed, in bytes; None where it printed none."""

    requested: int | None = None
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    stranded: int | None = None

    @classmethod
    def from_document(cls, figures: Mapping[str, int | None]) -> OomFigures:
        """From the `bytes` of an incident's `oom` in `show --json` (story._oom_document)."""
        return cls(
            requested=figures.get("requested"),
            total=figures.get("total"),
            free=figures.get("free"),
            allocated=figures.get("allocated"),
            reserved=figures.get("reserved"),
            stranded=figures.get("reserved but unallocated"),
        )


@dataclass(frozen=True)
class Segment:
    """One stretch of the bar: its part, words, bytes, and where it lies in percent."""

    part: Part
    label: str
    size: int
    start: float
    width: float

    @property
    def gib(self) -> str:
        return gib_text(self.size)


@dataclass(frozen=True)
class OomBar:
    """The card's segments and the request's, on one scale, and every figure in words."""

    card: tuple[Segment, ...]
    request: Segment | None
    scale: int
    figures: tuple[tuple[str, str], ...]
    summary: str


def gib_text(size: int) -> str:
    """GiB to two decimals; a small figure keeps three significant digits (12.5 MiB is
    0.0122 GiB, not 0.01)."""
    value = size / GIB
    if size == 0 or value >= 0.1:
        return f"{value:.2f} GiB"
    return f"{value:.3g} GiB"


def oom_bar(figures: OomFigures) -> OomBar | None:
    """The bar for these numbers; None when there is neither a card nor a request to draw."""
    complete = _derived(figures)
    parts = _card_parts(complete)
    # The reserve too: figures that disagree (reserved above allocated + stranded, as a
    # message's rounding can make them) still give a bar to hold them.
    scale = max(
        complete.total or 0,
        sum(size for _, size in parts),
        complete.requested or 0,
        complete.reserved or 0,
    )
    if scale == 0:
        return None
    card: list[Segment] = []
    start = 0.0
    for part, size in parts:
        width = size / scale * PERCENT
        card.append(Segment(part, _LABELS[part], size, start, width))
        start += width
    request = (
        None
        if complete.requested is None
        else Segment(
            Part.REQUEST,
            _LABELS[Part.REQUEST],
            complete.requested,
            0.0,
            complete.requested / scale * PERCENT,
        )
    )
    words = _figure_words(figures, complete)
    return OomBar(tuple(card), request, scale, words, _summary(complete))


def _derived(figures: OomFigures) -> OomFigures:
    """Each of reserved = allocated + stranded filled in from the other two when missing."""
    allocated, reserved, stranded = figures.allocated, figures.reserved, figures.stranded
    if reserved is None and allocated is not None and stranded is not None:
        reserved = allocated + stranded
    if stranded is None and reserved is not None and allocated is not None:
        stranded = max(0, reserved - allocated)
    if allocated is None and reserved is not None and stranded is not None:
        allocated = max(0, reserved - stranded)
    return OomFigures(figures.requested, figures.total, figures.free, allocated, reserved, stranded)


def _card_parts(figures: OomFigures) -> list[tuple[Part, int]]:
    """The card left to right; what the total holds beyond the printed parts is `other` when
    every part was printed, else `unaccounted`."""
    parts: list[tuple[Part, int]] = []
    if figures.reserved is not None and (figures.allocated is None or figures.stranded is None):
        parts.append((Part.RESERVED, figures.reserved))
    else:
        parts += [
            (part, size)
            for part, size in (
                (Part.ALLOCATED, figures.allocated),
                (Part.STRANDED, figures.stranded),
            )
            if size is not None
        ]
    known = sum(size for _, size in parts) + (figures.free or 0)
    if figures.total is not None and figures.total > known:
        every_part = figures.reserved is not None and figures.free is not None
        parts.append((Part.OTHER if every_part else Part.UNACCOUNTED, figures.total - known))
    if figures.free is not None:
        parts.append((Part.FREE, figures.free))
    return [(part, size) for part, size in parts if size > 0]


def _figure_words(printed: OomFigures, complete: OomFigures) -> tuple[tuple[str, str], ...]:
    """Each figure in GiB, `not printed`, or derived from the others and said to be."""
    rows = (
        ("requested", printed.requested, complete.requested),
        ("free on the card", printed.free, complete.free),
        ("stranded (reserved but unallocated)", printed.stranded, complete.stranded),
        ("allocated by PyTorch", printed.allocated, complete.allocated),
        ("reserved by PyTorch", printed.reserved, complete.reserved),
        ("the card's total", printed.total, complete.total),
    )
    return tuple((label, _words(was, now)) for label, was, now in rows)


def _words(printed: int | None, complete: int | None) -> str:
    if complete is None:
        return NOT_PRINTED
    return gib_text(complete) + ("" if printed is not None else f" ({DERIVED})")


def _summary(figures: OomFigures) -> str:
    """The bar's arithmetic in one sentence: could free plus stranded memory have served it."""
    card = "no card total printed" if figures.total is None else f"a {gib_text(figures.total)} card"
    if figures.requested is None:
        return f"{card}; the message printed no request"
    asked = f"{gib_text(figures.requested)} requested on {card}"
    if figures.free is None:
        return f"{asked}; the message printed no free memory"
    room = figures.free + (figures.stranded or 0)
    terms = f"free {gib_text(figures.free)}"
    if figures.stranded is not None:
        terms += f" + stranded {gib_text(figures.stranded)} = {gib_text(room)}"
    if room >= figures.requested:
        return f"{asked}; {terms}, enough for the request"
    return f"{asked}; {terms}, short of the request by {gib_text(figures.requested - room)}"
