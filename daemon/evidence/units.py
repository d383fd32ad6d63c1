"""Memory sizes as software prints them, to exact bytes and back.

PyTorch's allocator prints sizes with two decimals in the largest binary unit that keeps the
number at or below 1024 (`20.00 MiB`, `1024.00 KiB`, `8.13 GiB`), so a printed figure is the
true size rounded to 0.01 of its unit. We cannot recover the bytes that rounding threw away:
`parse_size` returns the byte count of exactly what was printed (`8.13 GiB` is
8.13 x 2**30 = 8729521029.12, rounded (half to even) to 8729521029 bytes), and `format_size`
prints the way PyTorch does, so `parse_size(format_size(n))` is within half a printed
hundredth of the unit of `n`.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB
PIB = 1024 * TIB
EIB = 1024 * PIB

UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
    "pib": PIB,
    "eib": EIB,
}

# A number followed by a unit, as embedded in longer messages; the unit is required so that a
# message cut in the middle of a number ("Tried to allocate 2.0") does not match at all.
SIZE_PATTERN = r"(?P<number>\d+(?:\.\d+)?)\s?(?P<unit>bytes|byte|[KMGTPE]iB|B)\b"
_SIZE_RE = re.compile(rf"^\s*{SIZE_PATTERN}\s*$", re.IGNORECASE)


class SizeParseError(ValueError):
    """A size string that is not a number with a known binary unit."""


def parse_size(text: str) -> int:
    """Exact bytes of a printed size such as `20.00 MiB`, `0 bytes`, `1.5TiB`."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise SizeParseError(f"not a size with a binary unit: {text[:80]!r}")
    return size_from_parts(match.group("number"), match.group("unit"))


def size_from_parts(number: str, unit: str) -> int:
    """Bytes of a number and unit already split by `SIZE_PATTERN`."""
    multiplier = UNIT_BYTES.get(unit.lower())
    if multiplier is None:
        raise SizeParseError(f"unknown unit {unit!r}")
    try:
        value = Decimal(number)
    except InvalidOperation as error:
        raise SizeParseError(f"not a number: {number!r}") from error
    return int((value * multiplier).to_integral_value(rounding=ROUND_HALF_EVEN))


def format_size(size: int) -> str:
    """Print bytes the way PyTorch's allocator does (bytes, KiB, MiB, then GiB for all larger)."""
    if size < 0:
        raise ValueError(f"negative size: {size}")
    if size <= KIB:
        return f"{size} bytes"
    if size <= MIB:
        return f"{size / KIB:.2f} KiB"
    if size <= GIB:
        return f"{size / MIB:.2f} MiB"
    return f"{size / GIB:.2f} GiB"
