"""Hostile logs (issue 10) through the pure scanner and diagnosis: a bounded verdict, no crash.

The before-stop hook's four reproducers, byte for byte, and the other shapes the scanner bounds.
Seconds and peak RSS of each, in a child process and through the CLI: `make bench BENCH=hostile`.
"""

from __future__ import annotations

import io
import itertools
import tracemalloc

import pytest

from daemon.diagnosis import Confidence, FailureKind, History
from daemon.evidence.joblog import MAX_KEPT_LINES, scan_log
from daemon.evidence.log_analysis import MAX_TASK_RANGES
from daemon.evidence.log_events import MAX_TRACEBACK_FRAMES
from daemon.evidence.oom import parse_oom
from daemon.evidence.records import (
    MAX_RANK,
    MAX_STEP,
    Evidence,
    LogFindings,
    OomFamily,
    OomReport,
)
from daemon.evidence.units import GIB, MAX_BYTES
from daemon.rules.dispatch import diagnose
from tests.bench.bench_hostile import (
    DIGIT_RUNS_LOG,
    HOOK_MESSAGE,
    HUGE_NUMBERS_LOG,
    HUGE_STEP_LOG,
    TASK_LIST_LOG,
    TASK_LISTS_LOG,
    ZERO_REQUEST_LOG,
)

MIB = 1024 * 1024


def scan(text: str, **options: object) -> LogFindings:
    return scan_log(io.BytesIO(text.encode()), **options)  # type: ignore[arg-type]


def test_task_list_of_12000_ranges_costs_no_memory_and_keeps_the_verdict() -> None:
    tracemalloc.start()
    try:
        found = scan(TASK_LIST_LOG)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB  # each of the 12,000 ranges expanded to 4,096 ints: 9.5 GB of RSS
    verdict = diagnose(Evidence(log=found), History())
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert found.oom is not None
    assert found.oom.requested_bytes == 2 * GIB


def test_task_lists_that_fit_the_match_window_stay_ranges() -> None:
    # Four 85 KB lines raised MemoryError; the fifth line is short enough to be matched whole:
    # 1,100 ranges of 4,096 tasks, 4.5 million ranks once expanded, are one range here.
    tracemalloc.start()
    try:
        found = scan(TASK_LISTS_LOG)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MIB
    # a list of many tasks names the node, not which task failed (held-out sample 101)
    assert (found.rank, found.node, found.exit_code) == (None, "gpu-01", 1)


def test_a_rank_is_looked_up_in_task_ranges_not_in_an_expanded_list() -> None:
    log = (
        "srun: error: gpu-02: tasks 0-7: Terminated\n"
        f"srun: error: gpu-03: tasks 8-11,12-15: Exited with exit code 1\n"
        f"[rank13]: {HOOK_MESSAGE}\n"
    )
    found = scan(log)
    assert (found.rank, found.node, found.exit_code) == (13, "gpu-03", 1)


def test_more_task_ranges_than_the_cap_are_cut_with_a_note() -> None:
    tasks = ",".join(str(2 * task) for task in range(MAX_TASK_RANGES + 10))
    found = scan(f"{HOOK_MESSAGE}\nsrun: error: gpu-05: tasks {tasks}: Exited with exit code 3\n")
    assert (found.rank, found.node, found.exit_code) == (None, "gpu-05", 3)
    assert any(f"more than {MAX_TASK_RANGES} ranges" in note for note in found.notes)


def test_a_long_task_line_is_matched_by_its_two_ends_only() -> None:
    tasks = "0-4095," * 4000  # 28 KB: the srun pattern sees its first and last 8 KB only
    found = scan(f"{HOOK_MESSAGE}\nsrun: error: gpu-01: tasks {tasks}0: Exited with exit code 1\n")
    assert (found.rank, found.node, found.exit_code) == (None, None, None)
    assert found.oom is not None


def test_digit_runs_are_a_verdict_not_minutes_of_backtracking() -> None:
    found = scan(DIGIT_RUNS_LOG)
    assert found.oom is not None
    assert found.oom.family is OomFamily.TORCH_ALLOCATOR
    assert found.oom.requested_bytes is None
    verdict = diagnose(Evidence(log=found), History())
    assert verdict.kind is FailureKind.UNKNOWN  # no request: the fragmentation rule cannot apply
    assert verdict.confidence is Confidence.LOW


def test_a_size_of_thousands_of_digits_is_no_size() -> None:
    report = parse_oom(f"CUDA out of memory. Tried to allocate {'9' * 4000}.00 GiB.")
    assert report is not None
    assert report.requested_bytes is None


def test_zero_byte_request_with_nothing_stranded_is_a_low_confidence_verdict() -> None:
    found = scan(ZERO_REQUEST_LOG)
    assert found.oom is not None
    assert (found.oom.requested_bytes, found.oom.reserved_unallocated_bytes) == (0, 0)
    verdict = diagnose(Evidence(log=found), History())  # was ZeroDivisionError
    assert verdict.kind is FailureKind.UNKNOWN
    assert verdict.confidence is Confidence.LOW
    assert any("0 bytes" in reason for reason in verdict.reasons)


def test_zero_byte_request_with_bytes_stranded_is_not_called_fragmentation() -> None:
    report = parse_oom(
        "CUDA out of memory. Tried to allocate 0 bytes. GPU 0 has a total capacity of 79.19 GiB"
        " of which 0 bytes is free. Of the allocated memory 60.00 GiB is allocated by PyTorch,"
        " and 19.00 GiB is reserved by PyTorch but unallocated."
    )
    verdict = diagnose(Evidence(log=LogFindings(oom=report)), History())
    assert verdict.kind is FailureKind.UNKNOWN
    assert any("cannot tell fragmentation" in reason for reason in verdict.reasons)


def test_a_step_of_5000_digits_is_dropped_with_a_note() -> None:
    found = scan(HUGE_STEP_LOG)  # was "Exceeds the limit (4300 digits)"
    assert found.step is None
    assert any("step" in note and "dropped" in note for note in found.notes)
    assert diagnose(Evidence(log=found), History()).kind is FailureKind.FRAGMENTATION


@pytest.mark.parametrize(
    ("step", "kept"),
    [(MAX_STEP, True), (MAX_STEP + 1, False), (2**63, False), (2**64 + 5, False)],
)
def test_steps_beyond_a_signed_64_bit_column_are_dropped(step: int, kept: bool) -> None:
    found = scan(f"step={step}\n{HOOK_MESSAGE}\n")
    assert found.step == (step if kept else None)
    assert kept or any("step" in note for note in found.notes)


@pytest.mark.parametrize(("rank", "kept"), [(MAX_RANK, True), (MAX_RANK + 1, False)])
def test_ranks_beyond_two_to_the_twenty_are_dropped(rank: int, kept: bool) -> None:
    found = scan(f"[rank{rank}]: {HOOK_MESSAGE}\n")
    assert found.rank == (rank if kept else None)
    assert kept or any("rank prefix" in note for note in found.notes)


def test_huge_numbers_everywhere_are_dropped_and_said() -> None:
    found = scan(HUGE_NUMBERS_LOG)
    assert (found.rank, found.step, found.exit_code) == (None, None, None)
    oom = found.oom
    assert oom is not None
    assert oom.requested_bytes is None  # 2,000,000,000 GiB is beyond 1 EiB
    assert oom.total_bytes is None  # -9.50 GiB is not a size
    assert oom.free_bytes == GIB
    assert oom.other_processes == ()  # pid 99999999999 is beyond Linux's limit
    assert any("beyond" in note for note in oom.notes)
    verdict = diagnose(Evidence(log=found), History())
    assert verdict.kind is FailureKind.NOT_OOM  # a request beyond any device: a size bug
    assert any("requested size" in reason for reason in verdict.reasons)


@pytest.mark.parametrize(
    "text",
    [
        "Tried to allocate 2.00 GiB (GPU 0; -9.50 GiB total capacity; 1.00 GiB already allocated",
        "Tried to allocate 2.00 GiB (GPU 0; 79.19 GiB total capacity; -9.50 GiB free; 3 GiB",
        "Of the allocated memory 70.00 GiB is allocated by PyTorch, and -9.50 GiB is reserved by"
        " PyTorch but unallocated",
    ],
)
def test_a_negative_size_is_not_read_as_positive(text: str) -> None:
    report = parse_oom(f"torch.OutOfMemoryError: CUDA out of memory. {text}.")
    assert report is not None
    figures = (report.total_bytes, report.free_bytes, report.reserved_unallocated_bytes)
    assert int(9.5 * GIB) not in figures


def test_the_scan_past_its_time_limit_returns_a_verdict_with_a_note() -> None:
    found = scan(f"step 3\n{HOOK_MESSAGE}\n", time_limit=0)
    assert any("cut short" in note for note in found.notes)
    verdict = diagnose(Evidence(log=found), History())
    assert verdict.kind is FailureKind.UNKNOWN
    assert any("cut short" in reason for reason in verdict.reasons)


def test_a_clock_that_never_moves_never_cuts_the_scan() -> None:
    found = scan(f"step 3\n{HOOK_MESSAGE}\n", time_limit=0.5, clock=lambda: 0.0)
    assert found.step == 3
    assert found.oom is not None
    assert not any("cut short" in note for note in found.notes)


def test_a_scan_cut_during_the_analysis_keeps_what_it_read() -> None:
    # A clock that speeds up: reading the 201 lines back takes about 200 readings (about 40,000
    # "seconds", within the half of the limit reading back may use); the analysis's readings
    # then pass the limit part-way through the lines, and what it analysed by then stays.
    readings = itertools.count()
    log = f"{HOOK_MESSAGE}\n" + "".join(f"step {n}\n" for n in range(200))
    found = scan(log, time_limit=100_000, clock=lambda: float(next(readings)) ** 2)
    assert found.oom is not None
    assert found.step is None  # the OOM came before any step
    assert found.max_step_seen is not None
    assert 0 < found.max_step_seen < 199
    assert any("cut short" in note and "analysed" in note for note in found.notes)


def test_a_log_of_millions_of_short_lines_stops_at_the_kept_line_cap() -> None:
    found = scan(f"{HOOK_MESSAGE}\n" + "ab\n" * (MAX_KEPT_LINES + 1000))
    assert found.oom is None  # beyond the cap: the note says where the scan stopped
    assert any(f"after {MAX_KEPT_LINES} lines" in note for note in found.notes)


def test_a_runaway_traceback_keeps_its_outer_and_inner_frames() -> None:
    frames = "".join(f'  File "m.py", line 1, in f{n}\n    g()\n' for n in range(5000))
    found = scan(
        'Traceback (most recent call last):\n  File "train.py", line 9, in evaluate\n'
        f"    run()\n{frames}{HOOK_MESSAGE}\n"
    )
    assert len(found.frames) == MAX_TRACEBACK_FRAMES
    assert found.frames[0] == "evaluate"
    assert found.frames[-1] == "f4999"


def test_json_nested_deeper_than_the_stack_is_no_error_file() -> None:
    found = scan('{"message": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert found.root_failure_line is None


def test_torchrun_table_numbers_beyond_range_are_dropped() -> None:
    log = (
        "Root Cause (first observed failure):\n[0]:\n"
        "  time      : 2024-01-01_00:00:00\n  host      : gpu-01\n"
        f"  rank      : {'9' * 5000} (local_rank: 0)\n"
        f"  exitcode  : -9 (pid: {'9' * 40})\n"
    )
    found = scan(log)
    assert found.rank is None
    assert found.exit_code == -9
    assert found.job_pids == ()
    assert any("torchrun's failure table" in note for note in found.notes)


def test_diagnosis_sets_aside_figures_no_record_can_hold() -> None:
    log = LogFindings(
        rank=2**40,
        step=2**63,
        oom=OomReport(
            family=OomFamily.TORCH_ALLOCATOR,
            message="CUDA out of memory.",
            requested_bytes=-1,
            total_bytes=2**70,
            reserved_unallocated_bytes=10**5000,
        ),
    )
    verdict = diagnose(Evidence(log=log), History())
    assert (verdict.rank, verdict.step) == (None, None)
    assert verdict.oom is not None
    assert verdict.oom.requested_bytes is None
    assert verdict.oom.total_bytes is None
    assert verdict.oom.reserved_unallocated_bytes is None
    assert sum("set aside" in reason for reason in verdict.reasons) == 5
    assert any("-bit number" in reason for reason in verdict.reasons)


def test_sizes_up_to_one_exbibyte_are_kept() -> None:
    report = parse_oom("CUDA out of memory. Tried to allocate 1073741824.00 GiB.")
    assert report is not None
    assert report.requested_bytes == MAX_BYTES
