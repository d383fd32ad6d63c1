"""`parse_oom_block`: a message read from its first line and the lines a terminal wrapped it onto.

The wrapping shapes are those of tests/data/real/oom (README: "Wrapped messages"); the texts
here cut the same PyTorch 1.x message at other places, to hold the rule rather than the sample.
"""

from __future__ import annotations

import pytest

from daemon.evidence.oom import parse_oom_block
from daemon.evidence.oom_message import MAX_BLOCK_LINES, MAX_MESSAGE_CHARS
from daemon.evidence.records import OomFamily

GIB = 1024**3
MIB = 1024**2
MESSAGE = (
    "RuntimeError: CUDA out of memory. Tried to allocate 198.00 MiB (GPU 0; 31.75 GiB total"
    " capacity; 28.05 GiB already allocated; 137.69 MiB free; 28.08 GiB reserved in total by"
    " PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid"
    " fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
FIGURES = (198 * MIB, round(3175 * GIB / 100), round(13769 * MIB / 100), round(2805 * GIB / 100))


def figures(lines: list[str]) -> tuple[int | None, ...]:
    report = parse_oom_block(lines)
    assert report is not None
    return (
        report.requested_bytes,
        report.total_bytes,
        report.free_bytes,
        report.allocated_bytes,
    )


def hard_wrapped(text: str, width: int) -> list[str]:
    """A console that breaks lines at its width, anywhere (Windows, real/oom/093)."""
    return [text[i : i + width] for i in range(0, len(text), width)]


def word_wrapped(text: str, width: int) -> list[str]:
    """A viewer or rich breaking at spaces and dropping them (real/oom/025, 098)."""
    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line]


@pytest.mark.parametrize("width", [40, 57, 61, 64, 73, 80, 97, 120])
def test_a_message_hard_wrapped_at_any_width_keeps_its_figures(width: int) -> None:
    assert figures(hard_wrapped(MESSAGE, width)) == FIGURES


@pytest.mark.parametrize("width", [40, 57, 61, 64, 73, 80, 97, 120])
def test_a_message_word_wrapped_at_any_width_keeps_its_figures(width: int) -> None:
    assert figures(word_wrapped(MESSAGE, width)) == FIGURES


def test_a_number_split_between_lines_is_glued_back() -> None:
    lines = [
        "CUDA out of memory. Tried to allocate 198.00 MiB (GPU 0; 31.7",
        "5 GiB total capacity",
    ]
    report = parse_oom_block(lines)
    assert report is not None
    assert report.total_bytes == round(3175 * GIB / 100)


def test_a_unit_split_between_lines_is_read_from_the_glued_reading() -> None:
    lines = [
        "CUDA out of memory. Tried to allocate 198.00 MiB (GPU 0; 31.75 Gi",
        "B total capacity;",
    ]
    report = parse_oom_block(lines)
    assert report is not None
    assert report.total_bytes == round(3175 * GIB / 100)


def test_the_exception_type_alone_on_its_line_starts_the_block() -> None:
    assert figures(["torch.cuda.OutOfMemoryError:", MESSAGE.removeprefix("RuntimeError: ")]) == (
        FIGURES
    )


@pytest.mark.parametrize(
    "follower",
    [
        "Traceback (most recent call last):",
        '  File "train.py", line 10, in <module>',
        "",
        "[rank1]: Process 4242 has 30.00 GiB memory in use.",
        "2024-05-11 02:24:26,980 - Process 4242 has 30.00 GiB memory in use.",
        "E1120 14:37:16.123000 1 api.py:869] Process 4242 has 30.00 GiB memory in use.",
        "(RayWorkerWrapper pid=1054, ip=10.0.0.1) Process 4242 has 30.00 GiB memory in use.",
    ],
)
def test_a_following_record_is_not_read_into_a_cut_message(follower: str) -> None:
    cut = MESSAGE[: MESSAGE.index("28.08 GiB")]  # truncated: no end of message in view
    report = parse_oom_block([cut, follower])
    assert report is not None
    assert report.other_processes == ()
    assert report.message == " ".join(cut.split())


def test_a_loggers_copy_after_a_complete_message_is_not_joined() -> None:
    copy = MESSAGE.replace("198.00 MiB", "2.00 GiB").removeprefix("RuntimeError: ")
    report = parse_oom_block([MESSAGE, copy])
    assert report is not None
    assert report.requested_bytes == 198 * MIB
    assert "2.00 GiB" not in report.message


def test_a_second_message_after_a_cut_one_is_not_joined() -> None:
    cut = MESSAGE[: MESSAGE.index("(GPU")]
    report = parse_oom_block([cut, MESSAGE])
    assert report is not None
    assert (report.requested_bytes, report.total_bytes) == (198 * MIB, None)


def test_the_block_reads_at_most_its_lines_and_characters() -> None:
    lines = ["CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0;", *["x" * 3000] * 30]
    report = parse_oom_block(lines)
    assert report is not None
    assert len(report.message) <= MAX_MESSAGE_CHARS
    many = ["CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0;", *["word"] * 40]
    report = parse_oom_block(many)
    assert report is not None
    assert report.message.count("word") == MAX_BLOCK_LINES - 1


def test_no_oom_on_the_first_line_is_no_report() -> None:
    assert parse_oom_block(["Epoch 3: 45%", MESSAGE]) is None
    assert parse_oom_block([]) is None


def test_other_families_read_their_request_from_the_lines_after() -> None:
    nccl = parse_oom_block(
        [
            "n1:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
            "",
            "n1:3063028:3066152 [3] include/alloc.h:185 NCCL WARN Failed to CUDA calloc"
            " 6291456 bytes",
        ]
    )
    assert nccl is not None
    assert (nccl.family, nccl.requested_bytes) == (OomFamily.NCCL, 6291456)
    assert nccl.message.endswith("'out of memory'")


def test_a_request_beyond_one_eib_is_flagged_not_stored() -> None:
    torch = parse_oom_block(
        ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB memory."]
    )
    assert torch is not None
    assert (torch.requested_bytes, torch.request_beyond_any_device) == (None, True)
    huge = parse_oom_block(
        ["CUDA out of memory. Tried to allocate 17179869184.00 GiB (GPU 0; 8.00 GiB total capacity"]
    )
    assert huge is not None
    assert (huge.requested_bytes, huge.request_beyond_any_device) == (None, True)
    xla = parse_oom_block(
        ["RESOURCE_EXHAUSTED: Out of memory while trying to allocate 18446744073709551615 bytes."]
    )
    assert xla is not None
    assert (xla.requested_bytes, xla.request_beyond_any_device) == (None, True)


def test_a_per_process_fraction_cap_is_read_in_both_wordings() -> None:
    # c10/cuda/CUDACachingAllocator.cpp prints `format_size(allowed_memory_maximum) + " allowed; "`
    old = parse_oom_block(
        [
            "RuntimeError: CUDA out of memory. Tried to allocate 6.00 GiB (GPU 0; 12.00 GiB total"
            " capacity; 0 bytes already allocated; 11.50 GiB free; 6.00 GiB allowed; 0 bytes"
            " reserved in total by PyTorch)"
        ]
    )
    new = parse_oom_block(
        [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a"
            " total capacity of 79.15 GiB of which 40.00 GiB is free. Including non-PyTorch memory,"
            " this process has 38.50 GiB memory in use. 38.00 GiB allowed; Of the allocated memory"
            " 37.25 GiB is allocated by PyTorch, and 48.00 MiB is reserved by PyTorch but"
            " unallocated."
        ]
    )
    assert old is not None
    assert new is not None
    assert (old.allowed_bytes, old.free_bytes) == (6 * GIB, round(1150 * GIB / 100))
    assert (new.allowed_bytes, new.reserved_unallocated_bytes) == (38 * GIB, 48 * MIB)
