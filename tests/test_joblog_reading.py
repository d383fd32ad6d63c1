"""The job-log scanner's reading side: windows, lines across them, the search far from the end,
logs that change while read, and the daemon's reader scanning as the CLI does.

Small windows (4 KiB) keep these fast; the figures on gigabyte logs are `make bench
BENCH=diagnose`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.evidence import joblog
from daemon.evidence.joblog import LogReadError, scan_log
from daemon.evidence.log_lines import is_root_candidate
from daemon.evidence.log_reader import (
    LINE_KEEP_BYTES,
    MAX_FAR_LINES,
    ROOT_TRIGGERS,
    CandidateMemo,
    Cursor,
    FarLines,
    Line,
    StreamReader,
    lines_backward,
)
from daemon.evidence.records import LogFindings, OomFamily, RootCause
from daemon.owner_files import OwnerFiles
from tests.bench.bench_diagnose import _watchdog_dump
from tests.test_owner_files import alice_owner, owned_dir

DATA = Path(__file__).parent / "data"
MULTIRANK = (DATA / "logs" / "torchrun_multirank_backward_oom.log").read_bytes()
OOM_LINE = (
    b"[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 226.00 MiB. GPU 0"
    b" has a total capacity of 15.70 GiB of which 210.38 MiB is free.\n"
)
QUIET = b"[rank0]: {'loss': 1.2345, 'learning_rate': 1.9e-05, 'epoch': 0.42} step 7\n"
WINDOW = 4096
SMALL_TAIL = 64 * 1024


@pytest.fixture
def small_tail(monkeypatch: pytest.MonkeyPatch) -> int:
    """A 64 KiB tail read whole (1 MiB in production): far from the end starts sooner, and
    the analysis of the tail's lines, which these tests are not about, costs less."""
    monkeypatch.setattr(joblog, "TAIL_FULL_BYTES", SMALL_TAIL)
    return SMALL_TAIL


def _quiet(size: int) -> bytes:
    """Progress lines without a trigger, `size` bytes or a line more."""
    return QUIET * (size // len(QUIET) + 1)


def _lines(data: bytes) -> list[tuple[int, bytes]]:
    """The lines of `data` with their offsets, as a reader must find them."""
    found = []
    offset = 0
    pieces = data.split(b"\n")
    if data.endswith(b"\n"):
        pieces.pop()
    for piece in pieces:
        found.append((offset, piece))
        offset += len(piece) + 1
    return found if data else []


def _read_back(
    data: bytes,
    *,
    full_from: int,
    block_size: int,
    is_root: Callable[[str], bool] = is_root_candidate,
) -> tuple[list[Line], FarLines]:
    reader = StreamReader(io.BytesIO(data))
    cursor = Cursor(full_from=full_from, lowest=0, position=len(data))
    far = FarLines()
    lines = lines_backward(
        reader,
        len(data),
        block_size,
        len(data) + 1,
        cursor,
        far=far,
        is_root=is_root,
        out_of_time=lambda: False,
    )
    return list(lines), far


LINE_BYTES = st.binary(max_size=300).map(lambda raw: raw.replace(b"\n", b" "))


@given(st.lists(LINE_BYTES, max_size=120), st.booleans(), st.integers(WINDOW, 3 * WINDOW))
@settings(max_examples=80, deadline=None)
def test_every_line_is_read_back_whole_across_window_boundaries(
    pieces: list[bytes], newline_at_end: bool, block_size: int
) -> None:
    data = b"\n".join(pieces) + (b"\n" if newline_at_end and pieces else b"")
    lines, _ = _read_back(data, full_from=0, block_size=block_size)
    assert [(line.offset, line.raw) for line in reversed(lines)] == _lines(data)
    assert all(data[line.end : line.end + 1] in (b"\n", b"") for line in lines)


TRIGGERS = st.sampled_from([b"RuntimeError: boom", b"out of memory", b"an Exception", b""])


@given(
    st.lists(st.tuples(LINE_BYTES, TRIGGERS, LINE_BYTES), max_size=80),
    st.integers(WINDOW, 3 * WINDOW),
)
@settings(max_examples=80, deadline=None)
def test_far_from_the_end_exactly_the_lines_holding_a_trigger_are_read(
    parts: list[tuple[bytes, bytes, bytes]], block_size: int
) -> None:
    pieces = [head + trigger + tail for head, trigger, tail in parts]
    data = b"\n".join(pieces)
    roots, far = _read_back(
        data, full_from=len(data) + 1, block_size=block_size, is_root=lambda text: "ROOT" in text
    )
    found = sorted([(line.offset, line.raw) for line in roots] + [(o, r) for o, _, r in far.lines])
    wanted = [
        (offset, raw)
        for offset, raw in _lines(data)
        if any(trigger in raw for trigger in ROOT_TRIGGERS)
    ]
    assert found == wanted
    assert all(b"ROOT" in line.raw for line in roots)


def test_a_trigger_line_longer_than_many_windows_is_found_by_its_last_bytes(
    small_tail: int,
) -> None:
    line = b"x" * (3 * LINE_KEEP_BYTES) + b" RuntimeError: CUDA error: out of memory\n"
    data = QUIET * 10 + line + _quiet(small_tail + 16 * 1024)
    found = scan_log(io.BytesIO(data), block_size=WINDOW)
    assert found.oom is not None
    assert found.oom.family is OomFamily.CUDA_RUNTIME
    assert any("were cut" in note for note in found.notes)


def test_a_root_failure_behind_a_cascade_of_more_lines_than_are_kept_is_found(
    small_tail: int,
) -> None:
    """Thousands of watchdog dumps after the OOM: more trigger lines than the scan keeps, and
    over a MiB of them, so the root is met only by the search far from the end."""
    root_end = MULTIRANK.index(b"\n", MULTIRANK.index(b"torch.OutOfMemoryError")) + 1
    cascade = b"".join(
        _watchdog_dump(rank, 0, rank % 60).encode() for rank in range(4, 1100) if rank != 3
    )
    data = _quiet(64 * 1024) + MULTIRANK[:root_end] + cascade + _quiet(64 * 1024)
    found = scan_log(io.BytesIO(data), block_size=WINDOW)
    assert len(cascade) > small_tail
    assert found.rank == 3
    assert found.oom is not None
    assert found.oom.requested_bytes == 226 * 1024**2
    assert found.step == 120
    assert any(f"the {MAX_FAR_LINES} nearest the root were" in note for note in found.notes)


def test_crlf_lines_far_from_the_end_are_read_without_their_carriage_returns(
    small_tail: int,
) -> None:
    data = (_quiet(8 * 1024) + OOM_LINE + _quiet(small_tail + 16 * 1024)).replace(b"\n", b"\r\n")
    found = scan_log(io.BytesIO(data), block_size=WINDOW)
    assert found.rank == 3
    assert found.oom is not None
    assert found.oom.requested_bytes == 226 * 1024**2
    assert found.root_failure_line is not None
    assert "\r" not in found.root_failure_line
    assert found.step == 7


def test_a_progress_line_of_redraws_across_windows_gives_its_last_step() -> None:
    redraws = b"".join(b"\r %3d%%|##  | %d/900 [00:01<00:02]" % (n // 9, n) for n in range(850))
    data = _quiet(4096) + redraws + b"\n" + OOM_LINE
    assert len(redraws) > 5 * WINDOW
    found = scan_log(io.BytesIO(data), block_size=WINDOW)
    assert found.step == 849
    assert found.oom is not None


def test_a_log_smaller_than_a_window_reads_as_with_small_windows() -> None:
    data = _quiet(2 * WINDOW) + MULTIRANK
    whole = scan_log(io.BytesIO(data))
    small = scan_log(io.BytesIO(data), block_size=WINDOW)
    assert len(data) < joblog.DEFAULT_BLOCK_SIZE
    assert whole == small
    assert (whole.rank, whole.step) == (3, 120)


def test_the_byte_budget_is_how_far_back_the_scan_looks_and_a_line_across_it_is_not_read() -> None:
    data = _quiet(16 * 1024) + OOM_LINE + _quiet(200 * 1024)
    cut_inside_the_oom_line = len(data) - data.index(OOM_LINE) - 10
    found = scan_log(io.BytesIO(data), block_size=WINDOW, byte_budget=cut_inside_the_oom_line)
    assert found.oom is None
    assert found.bytes_scanned == cut_inside_the_oom_line
    assert any("byte budget" in note for note in found.notes)
    found = scan_log(io.BytesIO(data), block_size=WINDOW, byte_budget=cut_inside_the_oom_line + 20)
    assert found.oom is not None


class _ChangingLog(io.BytesIO):
    """A log its writer changes after the scan's first read: `change(self)` runs once."""

    def __init__(self, data: bytes, change: Callable[[_ChangingLog], None]) -> None:
        super().__init__(data)
        self._change: Callable[[_ChangingLog], None] | None = change

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        if self._change is not None:
            change, self._change = self._change, None
            position = self.tell()
            change(self)
            self.seek(position)
        return data


def _far_failure(small_tail: int) -> bytes:
    return _quiet(16 * 1024) + MULTIRANK + _quiet(small_tail + 64 * 1024)


def test_a_log_that_grows_while_read_is_read_as_it_was_when_the_scan_began(
    small_tail: int,
) -> None:
    data = _far_failure(small_tail)

    def append(log: _ChangingLog) -> None:
        log.seek(0, os.SEEK_END)
        log.write(OOM_LINE.replace(b"rank3", b"rank9") * 1000)

    growing = scan_log(_ChangingLog(data, append), block_size=WINDOW)
    assert growing == scan_log(io.BytesIO(data), block_size=WINDOW)
    assert growing.rank == 3


def test_a_log_truncated_while_read_stops_there_with_a_note(small_tail: int) -> None:
    data = _far_failure(small_tail)

    def cut(log: _ChangingLog) -> None:
        log.truncate(1000)

    truncated = scan_log(_ChangingLog(data, cut), block_size=WINDOW)
    assert truncated.oom is None
    assert truncated.bytes_scanned < len(data) - 1000
    assert any("shrank while it was read" in note for note in truncated.notes)


def test_a_log_file_truncated_under_a_descriptor_stops_with_a_note(
    tmp_path: Path, small_tail: int
) -> None:
    """The same through `pread` on a real file: a short read, never a crash."""
    path = tmp_path / "job.log"
    path.write_bytes(_far_failure(small_tail))
    readings = iter(range(1_000_000))

    def clock() -> float:  # the scan asks the time once per window: truncate on the 10th
        if next(readings) == 10:
            os.truncate(path, 1000)
        return 0.0

    found = scan_log(path, block_size=WINDOW, clock=clock)
    assert found.oom is None
    assert any("shrank while it was read" in note for note in found.notes)


def test_an_open_descriptor_is_scanned_and_left_open(tmp_path: Path, small_tail: int) -> None:
    path = tmp_path / "job.log"
    path.write_bytes(_far_failure(small_tail))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert scan_log(fd, block_size=WINDOW) == scan_log(path, block_size=WINDOW)
        assert os.fstat(fd).st_size == path.stat().st_size  # still open
    finally:
        os.close(fd)


def test_a_descriptor_of_a_pipe_is_refused() -> None:
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(LogReadError, match="not a regular file"):
            scan_log(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


def _counting_judge(rule: Callable[[str], bool]) -> tuple[list[str], Callable[[str], bool]]:
    """A judge of root candidates by `rule` that keeps each line it was asked about."""
    judged: list[str] = []

    def judge(text: str) -> bool:
        judged.append(text)
        return rule(text)

    return judged, judge


def test_a_cascade_shape_is_judged_once_its_verdict_holds_for_any_digits() -> None:
    judged, judge = _counting_judge(lambda text: "boom" in text)
    memo = CandidateMemo(judge)
    verdicts = [
        memo.is_root(b"[rank%d]:[E1120 ...] Watchdog Exception 0x%08x" % (rank, 7 * rank))
        for rank in range(1000, 1500)
    ]
    assert not any(verdicts)
    assert len(judged) == 2 + 10  # met once, met again with its digits made 0 to 9


@pytest.mark.parametrize(
    ("usual", "decisive", "rule"),
    [
        (b"1", b"2", lambda text: text.endswith(" 2")),  # `Cuda failure 2` is an OOM
        (b"15", b"11", lambda text: not text.endswith(" 15")),  # `received signal 15`: cascade
        (b"15", b"7", lambda text: not text.endswith(" 15")),  # and a number of another length
    ],
)
def test_a_shape_whose_verdict_moves_with_its_digits_is_judged_line_by_line(
    usual: bytes, decisive: bytes, rule: Callable[[str], bool]
) -> None:
    _, judge = _counting_judge(rule)
    memo = CandidateMemo(judge)
    for rank in range(100, 120):
        assert not memo.is_root(b"[rank%d] RuntimeError: got signal %s" % (rank, usual))
    assert memo.is_root(b"[rank121] RuntimeError: got signal " + decisive)


def test_a_cascade_read_back_judges_each_shape_a_few_times() -> None:
    cascade = b"".join(_watchdog_dump(rank, 0, 0).encode() for rank in range(2000, 2400))
    judged, judge = _counting_judge(lambda text: False)
    _read_back(cascade, full_from=len(cascade) + 1, block_size=WINDOW, is_root=judge)
    trigger_lines = sum(
        any(trigger in raw for trigger in ROOT_TRIGGERS) for _, raw in _lines(cascade)
    )
    assert trigger_lines > 3000
    assert len(judged) < 200


# ------------------------------------------------------- the daemon reads as the CLI does


def _beyond_the_old_tail(directory: Path) -> Path:
    """A root OOM followed by 20 MiB of lines: the daemon once copied only the last 16 MiB."""
    path = directory / "job.out"
    path.write_bytes(_quiet(64 * 1024) + MULTIRANK + _quiet(20 * 1024 * 1024))
    return path


def _same_scan(found: LogFindings, path: Path) -> None:
    expected = scan_log(path)
    assert found == expected
    assert (found.rank, found.node, found.step) == (3, "gpu-02", 120)
    assert found.bytes_scanned > 20 * 1024 * 1024


def test_the_callers_reader_scans_the_whole_log_as_the_cli_does(tmp_path: Path) -> None:
    path = _beyond_the_old_tail(tmp_path)
    _same_scan(OwnerFiles.as_caller().scan_log(str(path)), path)


@pytest.fixture
def alice_log() -> Iterator[tuple[OwnerFiles, Path]]:
    alice = alice_owner()
    with owned_dir(alice) as home:
        path = _beyond_the_old_tail(home)
        os.chown(path, alice.uid, alice.gid)
        yield OwnerFiles(alice, drop_privileges=True), path


@pytest.mark.users
def test_the_owners_child_scans_the_whole_log_as_the_cli_does(
    alice_log: tuple[OwnerFiles, Path],
) -> None:
    """The child opens the log itself, under its 1 GiB address-space limit."""
    files, path = alice_log
    _same_scan(files.scan_log(str(path)), path)


@pytest.mark.users
def test_the_owners_child_looks_back_no_further_than_asked(
    alice_log: tuple[OwnerFiles, Path],
) -> None:
    files, path = alice_log
    found = files.scan_log(str(path), max_bytes=1024 * 1024)
    assert found.oom is None
    assert found.bytes_scanned == 1024 * 1024
    with pytest.raises(ValueError, match="max_bytes"):
        files.scan_log(str(path), max_bytes=0)


@pytest.mark.parametrize(
    ("line", "root_cause"),
    [
        # Real formats (tests/data/real/logs: 012, 037): GPU faults hold no "Error"/"emory".
        (b"[rank2]: RuntimeError: CUDA error: unspecified launch failure\n", RootCause.GPU_FAULT),
        (
            b"[rank2]: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n",
            RootCause.GPU_FAULT,
        ),
    ],
)
def test_a_gpu_fault_far_from_the_end_is_found_by_its_own_words(
    small_tail: int, line: bytes, root_cause: RootCause
) -> None:
    data = _quiet(16 * 1024) + line + _quiet(small_tail + 64 * 1024)
    found = scan_log(io.BytesIO(data), block_size=WINDOW)
    assert found.root_cause is root_cause
    assert found.root_failure_line is not None
    assert found.root_failure_line.endswith(line.decode().strip()[-20:])
