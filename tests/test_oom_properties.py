"""Property tests over the parsers: they never crash, and sizes survive a round trip."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.evidence import oom_family
from daemon.evidence.oom import parse_oom
from daemon.evidence.units import KIB, MAX_BYTES, SizeParseError, format_size, parse_size

UNIT_OF = {"bytes": 1, "KiB": KIB, "MiB": KIB**2, "GiB": KIB**3}


@given(st.integers(min_value=0, max_value=MAX_BYTES))
def test_format_then_parse_is_within_half_a_printed_hundredth(size: int) -> None:
    printed = format_size(size)
    unit = UNIT_OF[printed.split()[-1]]
    assert abs(parse_size(printed) - size) <= unit // 200 + 1


@given(st.text(max_size=300))
def test_parse_size_accepts_or_raises_its_own_error(text: str) -> None:
    try:
        value = parse_size(text)
    except SizeParseError:
        return
    assert value >= 0


@given(st.text(max_size=2000))
@settings(max_examples=300)
def test_parse_oom_never_crashes_on_any_text(text: str) -> None:
    report = parse_oom(text)
    assert report is None or report.message is not None


FRAGMENTS = st.sampled_from(
    [
        "CUDA out of memory. ",
        "Tried to allocate ",
        "GPU 0 has a total capacty of ",
        "(GPU 1; ",
        " total capacity; ",
        " already allocated; ",
        " free; ",
        " reserved in total by PyTorch)",
        " cached)",
        "Process 12 has ",
        " memory in use. ",
        "Of the allocated memory ",
        " is allocated by PyTorch, and ",
        " is reserved by PyTorch but unallocated.",
        "PYTORCH_ALLOC_CONF=",
        "1.5 GiB",
        "0 bytes",
        "99999999999999999999.99 EiB",
        "2.0",
        "\x00\ufffd",
    ]
)


@given(st.lists(FRAGMENTS, max_size=25))
def test_parse_oom_on_shuffled_message_fragments(parts: list[str]) -> None:
    report = parse_oom("".join(parts))
    if report is not None:
        for value in (report.requested_bytes, report.total_bytes, report.free_bytes):
            assert value is None or value >= 0


FAMILY_WORDS = st.sampled_from(
    [
        "Killed",
        "**Killed**",
        "killed by signal: Killed",
        "oom-kill event",
        ": tasks 0-3: Out Of Memory",
        "Out of memory: Killed process 12 (python)",
        "Memory cgroup out of memory",
        "Exceeded job memory limit",
        "exitcode  : -9",
        "Signal 9 (SIGKILL) received",
        "DefaultCPUAllocator: can't allocate memory",
        "not enough memory: you tried to allocate",
        "std::bad_alloc",
        "cuda OUT OF MEMORY.",
        "OUTOFMEMORYERROR",
        "MPS backend out of memory",
        "TRIED TO ALLOCATE 2.00 GIB (GPU ",
        "(GPU 0; 1.00 GiB TOTAL CAPACITY",
        "GPU 1 HAS A TOTAL CAPACTY OF 9",
        "more than 1EB",
        "Resource Exhausted: Out of memory",
        "RESOURCE_EXHAUSTED:",
        "oom when allocating tensor",
        "ResourceExhaustedError",
        "[Errno 12] Cannot allocate memory",
        "error='Cannot allocate memory' (errno=12)",
        "insufficient memory for the Java Runtime Environment",
        "No available memory for the cache blocks",
        "stored in KV cache",
        "KV cache is needed, which is larger than the available KV cache memory",
        "Not enough memory. Please try to increase --mem-fraction-static",
        "CUBLAS_STATUS_NOT_INITIALIZED",
        "CUDNN_STATUS_NOT_INITIALIZED",
        "\n",
        "x",
    ]
)


@given(st.lists(FAMILY_WORDS, max_size=6).map("".join))
@settings(max_examples=300, deadline=None)
def test_the_literal_prefilter_never_hides_a_match(text: str) -> None:
    # detect_family runs a family's patterns only where one of its words is in the line
    for pattern, words in (
        (oom_family._HOST_RAM, oom_family._HOST_RAM_WORDS),
        (oom_family._TORCH_OOM, oom_family._TORCH_WORDS),
        (oom_family._XLA, oom_family._XLA_WORDS),
        (oom_family._XLA_CERTAIN, oom_family._XLA_WORDS),
        (oom_family._KV_CACHE, oom_family._KV_CACHE_WORDS),
        (oom_family._LIBRARY_HANDLE, oom_family._LIBRARY_HANDLE_WORDS),
    ):
        if pattern.search(text):
            assert any(word in text for word in words), (pattern.pattern[:40], text)
