"""Formats the held-out check found (issue 11): PyTorch's cudaMallocAsync message, an OOM under
TorchScript's wrapper, a request beyond any device, torch 1.9's no-error-file banner and srun's
failed task launch. Real samples from tests/data/real/, plus variations of each format."""

from __future__ import annotations

import io

import pytest

from daemon.diagnosis import BEYOND_ANY_DEVICE_BYTES, FailureKind
from daemon.evidence.joblog import scan_log
from daemon.evidence.oom import parse_oom
from daemon.evidence.records import LogFindings, OomFamily, RootCause
from tests.corpus import LOGS_DIR, MESSAGES_DIR, load_log_labels, load_message_labels
from tests.test_fragmentation_rule import verdict_of

MESSAGES = {label.file[:3]: label for label in load_message_labels()}
LOGS = {label.file[:3]: label for label in load_log_labels()}
GIB = 1024**3

# c10/cuda/CUDAMallocAsyncAllocator.cpp's own layout: keys padded to 24 columns.
ASYNC_PADDED = (
    "torch.OutOfMemoryError: Allocation on device 3 would exceed allowed memory. (out of memory)\n"
    "Currently allocated     : 30.00 GiB\n"
    "Requested               : 4.00 GiB\n"
    "Device limit            : 79.15 GiB\n"
    "Free (according to CUDA): 40.00 GiB\n"
    "PyTorch limit (set by user-supplied memory fraction)\n"
    "                        : 32.00 GiB\n"
)


@pytest.mark.parametrize("number", ["138", "139", "140", "141"])
def test_async_allocator_message_gives_its_labelled_figures_and_kind(number: str) -> None:
    label = MESSAGES[number]
    report = parse_oom((MESSAGES_DIR / label.file).read_text())
    assert report is not None
    assert report.family is OomFamily.TORCH_ALLOCATOR
    figures = (report.requested_bytes, report.total_bytes, report.free_bytes)
    assert figures == (
        label.numbers.requested_bytes,
        label.numbers.total_bytes,
        label.numbers.free_bytes,
    )
    assert report.allocated_bytes == label.numbers.allocated_bytes
    assert report.reserved_unallocated_bytes is None  # the async pool prints none
    assert report.allowed_bytes is None  # 17179869184.00 GiB: no cap was set
    assert verdict_of((MESSAGES_DIR / label.file).read_text()).kind.value == label.kind.value


def test_async_allocator_cap_is_read_as_allowed_and_free_covering_the_request_is_unknown() -> None:
    report = parse_oom(ASYNC_PADDED)
    assert report is not None
    assert (report.gpu_index, report.allowed_bytes, report.requested_bytes) == (
        3,
        32 * GIB,
        4 * GIB,
    )
    verdict = verdict_of(ASYNC_PADDED)
    assert verdict.kind is FailureKind.UNKNOWN
    assert any("memory fraction" in reason for reason in verdict.reasons)


def test_an_oom_under_torchscripts_wrapper_is_read_as_the_oom() -> None:
    label = MESSAGES["144"]
    found = scan_log(MESSAGES_DIR / label.file)
    assert found.root_cause is RootCause.ACCELERATOR_OOM
    assert found.oom is not None
    assert found.oom.requested_bytes == label.numbers.requested_bytes


def test_a_torchscript_wrapped_non_oom_error_stays_an_other_error() -> None:
    found = scan_log(
        io.BytesIO(
            b"RuntimeError: The following operation failed in the TorchScript interpreter.\n"
            b"Traceback of TorchScript (most recent call last):\n"
            b"    return torch.ops.my.op(x)\n"
            b"           ~~~~~~~~~~~~~~~ <--- HERE\n"
            b"RuntimeError: shape mismatch: [4, 8] vs [4, 9]\n"
        )
    )
    assert found.root_cause is RootCause.OTHER_ERROR
    assert found.root_failure_line is not None
    assert "shape mismatch" in found.root_failure_line


def test_a_request_beyond_any_device_is_a_size_bug() -> None:
    label = MESSAGES["146"]
    assert label.numbers.requested_bytes is not None
    assert label.numbers.requested_bytes > BEYOND_ANY_DEVICE_BYTES
    assert verdict_of((MESSAGES_DIR / label.file).read_text()).kind is FailureKind.NOT_OOM
    # the largest card sold (288 GB) asked for whole is memory pressure, not a size bug
    whole_card = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 270.00 GiB. GPU 0 has a"
        " total capacity of 268.00 GiB of which 1.00 GiB is free."
    )
    assert verdict_of(whole_card).kind is FailureKind.TRUE_OOM


def _log(number: str) -> LogFindings:
    return scan_log(LOGS_DIR / LOGS[number].file)


@pytest.mark.parametrize("number", ["072", "074"])
def test_no_error_file_banner_and_srun_task_launch_name_the_failure(number: str) -> None:
    found, label = _log(number), LOGS[number]
    cause = None if found.root_cause is None else found.root_cause.value
    assert (found.rank, found.node, cause) == (label.rank, label.host, label.root_cause)


def test_the_no_error_file_banner_names_its_local_rank_and_exit_code() -> None:
    found = scan_log(
        io.BytesIO(
            b"CHILD PROCESS FAILED WITH NO ERROR_FILE\n"
            b"Child process 4242 (local_rank 3) FAILED (exitcode -11)\n"
            b"Error msg: Process failed with exitcode -11\n"
        )
    )
    assert (found.rank, found.root_cause) == (3, RootCause.OTHER_ERROR)
