"""Memory sizes as software prints them, to exact bytes and back.

PyTorch's allocator prints sizes with two decimals in the largest binary unit that keeps the
number at or below 1024 (`20.00 MiB`, `1024.00 KiB`, `8.13 GiB`), so a printed figure is the
true size rounded to 0.01 of its unit. We cannot recover the bytes that rounding threw away:
`parse_size` returns the byte count of exactly what was printed (`8.13 GiB` is
8.13 x 2**30 = 8729521029.12, rounded (half to even) to 8729521029 bytes), and `format_size`
prints the way PyTorch does, so `parse_size(format_size(n))` is within half a printed
hundredth of the unit of `n`.

Logs are written by users and can hold anything: a printed number is read only when it has at
most `MAX_NUMBER_DIGITS` ASCII digits and lies within its plausible range (`MAX_BYTES` for a
size), so no figure can cost quadratic time, overflow a float or a 64-bit column downstream.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, Decimal, localcontext

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
    # Binary too, whatever the names suggest: PyTorch's MPS allocator prints `KB`/`MB`/`GB` for
    # 2**10/2**20/2**30 (`format_size` in aten/src/ATen/mps/MPSAllocator.h), as TF's stream
    # executor prints `M`/`G`. Only a pattern that names them reads them: `SIZE_PATTERN` does not.
    "kb": KIB,
    "mb": MIB,
    "gb": GIB,
    "tb": TIB,
    "pb": PIB,
    "eb": EIB,
}

# No honest figure in a log has more digits (2**64 has 20); a longer run of digits is not a number.
MAX_NUMBER_DIGITS = 30
# No device or host holds more than 1 EiB (2**60): a bigger "size" is garbage, not a size, and
# keeps every sum of sizes within a signed 64-bit column.
MAX_BYTES = EIB

# A number followed by a unit, as embedded in longer messages; the unit is required so that a
# message cut in the middle of a number ("Tried to allocate 2.0") does not match at all. The
# number starts where a run of digits starts (the lookbehind), so a long run is tried once, not
# from each of its digits (linear time), and a minus sign before it means it is not a size.
SIZE_PATTERN = (
    r"(?<![0-9.\-])(?P<number>[0-9]{1,30}(?:\.[0-9]{1,30})?)\s?(?P<unit>bytes|byte|[KMGTPE]iB|B)\b"
)
_SIZE_RE = re.compile(rf"\s*{SIZE_PATTERN}\s*", re.IGNORECASE)


class SizeParseError(ValueError):
    """A size string that is not a number with a known binary unit."""


class SizeBeyondRange(SizeParseError):
    """A well-formed size beyond `MAX_BYTES`: no device holds it (a size bug, or garbage)."""


def parse_size(text: str) -> int:
    """Exact bytes of a printed size such as `20.00 MiB`, `0 bytes`, `1.5TiB`."""
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise SizeParseError(f"not a size with a binary unit: {text[:80]!r}")
    return size_from_parts(match.group("number"), match.group("unit"))


def size_from_parts(number: str, unit: str) -> int:
    """Bytes of a number and unit already split by `SIZE_PATTERN`; beyond `MAX_BYTES` is refused."""
    multiplier = UNIT_BYTES.get(unit.lower())
    if multiplier is None:
        raise SizeParseError(f"unknown unit {unit!r}")
    if not _is_decimal(number):
        raise SizeParseError(f"not a number: {number[:40]!r}")
    with localcontext(prec=2 * MAX_NUMBER_DIGITS + 20):  # exact: no rounding before ours
        value = Decimal(number) * multiplier
    if value > MAX_BYTES:
        raise SizeBeyondRange(f"{number[:40]} {unit} is beyond {MAX_BYTES} bytes (1 EiB)")
    return int(value.to_integral_value(rounding=ROUND_HALF_EVEN))


def _is_decimal(number: str) -> bool:
    whole, point, fraction = number.partition(".")
    return _is_digits(whole) and (not point or _is_digits(fraction))


def _is_digits(text: str) -> bool:
    return 0 < len(text) <= MAX_NUMBER_DIGITS and text.isascii() and text.isdigit()


def bounded_int(text: str, limit: int) -> int | None:
    """A printed decimal integer (sign allowed), or None if it is not one or |value| > `limit`.

    The length is checked before `int()`: thousands of digits cost quadratic time (or raise
    past Python's 4300-digit limit) for a number that no log prints honestly.
    """
    if not _is_digits(text.removeprefix("-")):
        return None
    value = int(text)
    return value if abs(value) <= limit else None


def rounding_error(size: int) -> int:
    """The most a size printed by PyTorch (`format_size`) can differ from the true size: half a
    hundredth of the unit it is printed in (bytes are printed whole)."""
    if size <= KIB:
        return 0
    if size <= MIB:
        return KIB // 200 + 1
    if size <= GIB:
        return MIB // 200 + 1
    return GIB // 200 + 1


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
