"""Byte units as PyTorch and friends print them."""

from __future__ import annotations

import pytest

from daemon.evidence.units import (
    SizeBeyondRange,
    SizeParseError,
    format_size,
    parse_size,
    rounding_error,
    size_from_parts,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("20.00 MiB", 20 * 1024**2),
        ("0 bytes", 0),
        ("1024 bytes", 1024),
        ("1024.00 KiB", 1024**2),
        ("8.13 GiB", 8729521029),  # 8.13 x 2**30 = 8729521029.12 bytes, to the nearest byte
        ("1.5TiB", 3 * 1024**4 // 2),
        ("9.64GiB", 10350871183),  # XLA writes no space before the unit
        ("2 PiB", 2 * 1024**5),
        ("1 EiB", 1024**6),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text", ["", "MiB", "2.0", "2.0 MB", "-1 GiB", "1e3 GiB", "½ GiB", "2.00 Mi"]
)
def test_parse_size_refuses_what_is_not_a_binary_size(text: str) -> None:
    with pytest.raises(SizeParseError):
        parse_size(text)


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 bytes"),
        (1024, "1024 bytes"),
        (1025, "1.00 KiB"),
        (1024**2, "1024.00 KiB"),
        (20 * 1024**2, "20.00 MiB"),
        (1024**3, "1024.00 MiB"),
        (3 * 1024**4, "3072.00 GiB"),  # PyTorch never prints TiB
    ],
)
def test_format_size_like_pytorch(size: int, text: str) -> None:
    assert format_size(size) == text


@pytest.mark.parametrize(
    ("number", "unit", "size"),
    [
        ("5.56", "GB", 5970004541),  # MPS's format_size: GB is 2**30 (real/oom/021)
        ("768.00", "MB", 768 * 1024**2),
        ("384.00", "KB", 384 * 1024),
    ],
)
def test_mps_decimal_looking_units_are_binary(number: str, unit: str, size: int) -> None:
    assert size_from_parts(number, unit) == size


def test_a_size_past_one_eib_is_its_own_error() -> None:
    with pytest.raises(SizeBeyondRange):
        parse_size("17179869184.00 GiB")  # 2**64 bytes: a broken NVML reading
    with pytest.raises(SizeParseError) as malformed:
        parse_size("-1 GiB")
    assert not isinstance(malformed.value, SizeBeyondRange)


@pytest.mark.parametrize(
    ("size", "error"),
    [
        (1024, 0),  # bytes are printed whole
        (20 * 1024**2, 1024**2 // 200 + 1),  # 20.00 MiB: up to 0.005 MiB either way
        (3 * 1024**3, 1024**3 // 200 + 1),
    ],
)
def test_rounding_error_is_half_a_printed_hundredth(size: int, error: int) -> None:
    assert rounding_error(size) == error
    assert abs(parse_size(format_size(size + error - 1)) - (size + error - 1)) <= error
