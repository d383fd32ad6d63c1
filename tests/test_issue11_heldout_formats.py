"""Formats the held-out check found (issue 11): PyTorch's cudaMallocAsync message, an OOM under
TorchScript's wrapper, a request beyond any device, torch 1.9's no-error-file banner and srun's
failed task launch. Real samples from tests/data/real/, plus variations of each format."""

from __future__ import annotations

import io

import pytest

from daemon.diagnosis import FailureKind
from daemon.evidence.joblog import scan_log
from daemon.evidence.oom import parse_oom
from daemon.evidence.records import LogFindings, OomFamily, Phase, RootCause
from daemon.rules.device_oom import BEYOND_ANY_DEVICE_BYTES
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


# --- the second held-out set (samples 079-129): formats it showed the scanner missed ----------


@pytest.mark.parametrize(
    "number",
    [
        "100",  # Open MPI `mpirun noticed that process rank 1 with PID xxxxxx on node ...`
        "088",  # Horovod's `Horovod has been shut down` on rank 1, mpirun names rank 0 first
        "094",  # `slurmstepd-gpu20-15: error: Detected 1 oom-kill event(s)`: the node's prefix
        "101",  # srun's `tasks 1-3: Out Of Memory`: a node, but no one rank
        "123",  # DeepSpeed's sigkill_handler line hard-wrapped over four lines
        "105",  # Ray's raylet names a dead worker's IP, another worker's error explains it
    ],
)
def test_second_held_out_formats_give_the_labelled_rank_host_and_cause(number: str) -> None:
    found, label = _log(number), LOGS[number]
    cause = None if found.root_cause is None else found.root_cause.value
    assert (found.rank, found.node, cause) == (label.rank, label.host, label.root_cause)


@pytest.mark.parametrize(
    ("line", "rank", "node", "cause"),
    [
        (  # Open MPI 4 with its strsignal text
            "mpirun noticed that process rank 3 with PID 4242 on node gpu-07 exited on signal 9"
            " (Killed).",
            3,
            "gpu-07",
            RootCause.HOST_RAM,
        ),
        (  # PRRTE / Open MPI 5, no strsignal ([prun:proc-aborted])
            "prterun noticed that process rank 12 with PID 0 on node nid0042 exited on signal 11.",
            12,
            "nid0042",
            RootCause.OTHER_ERROR,
        ),
        (  # a PID masked by the poster: the rank and node still count
            "mpiexec noticed that process rank 0 with PID <pid> on node a100-3 exited on signal 9"
            " (Killed).",
            0,
            "a100-3",
            RootCause.HOST_RAM,
        ),
    ],
)
def test_open_mpi_noticed_line_names_rank_node_and_signal(
    line: str, rank: int, node: str, cause: RootCause
) -> None:
    found = scan_log(io.BytesIO(f"Primary job  terminated normally\n{line}\n".encode()))
    assert (found.rank, found.node, found.root_cause) == (rank, node, cause)


def test_open_mpi_exited_due_to_rank_reads_the_node_from_the_wrapped_line() -> None:
    # [prun:proc-ordered-abort]: the help text wraps before `node %s`
    found = scan_log(
        io.BytesIO(
            b"mpirun has exited due to process rank 2 with PID 31337 on\n"
            b'node gpu-11 calling "abort". This may have caused other processes\n'
            b"in the application to be terminated by signals sent by mpirun\n"
        )
    )
    assert (found.rank, found.node, found.root_cause) == (2, "gpu-11", RootCause.OTHER_ERROR)


def test_horovod_shutdown_is_the_cascade_of_another_ranks_error() -> None:
    found = scan_log(
        io.BytesIO(
            b"[1,2]<stderr>:torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate"
            b" 2.00 GiB\n"
            b"[1,0]<stderr>:RuntimeError: Horovod has been shut down. This was caused by an"
            b" exception on one of the ranks\n"
            b"[1,1]<stderr>:RuntimeError: Horovod has been shut down. This was caused by an"
            b" exception on one of the ranks\n"
        )
    )
    assert (found.rank, found.root_cause) == (2, RootCause.ACCELERATOR_OOM)
    assert set(found.cascade_ranks) == {0, 1}


@pytest.mark.parametrize(
    ("tasks", "rank"), [("task 5", 5), ("tasks 4-5", None), ("tasks 0,3", None)]
)
def test_an_srun_task_list_names_a_rank_only_when_it_is_one_task(
    tasks: str, rank: int | None
) -> None:
    found = scan_log(io.BytesIO(f"srun: error: gpu-03: {tasks}: Out Of Memory\n".encode()))
    assert (found.rank, found.node, found.root_cause) == (rank, "gpu-03", RootCause.HOST_RAM)


@pytest.mark.parametrize("prefix", ["slurmstepd-gpu20-15: ", "slurmstepd: "])
def test_slurmstepd_prefix_names_its_node_where_printed(prefix: str) -> None:
    found = scan_log(
        io.BytesIO(
            f"{prefix}error: Detected 1 oom-kill event(s) in StepId=9411285.0. Some of your"
            " processes may have been killed by the cgroup out-of-memory handler.\n"
            "srun: error: gpu20-15: task 0: Out Of Memory\n".encode()
        )
    )
    assert (found.rank, found.node, found.root_cause) == (0, "gpu20-15", RootCause.HOST_RAM)


DEEPSPEED_HEAD = (
    "[2024-01-02 03:04:05,678] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python', '-u',"
    " 'train.py', '--local_rank=3', '--deepspeed', 'ds.json', '--model_name_or_p"
)


def test_a_wrapped_deepspeed_line_is_joined_to_its_head() -> None:
    found = scan_log(
        io.BytesIO(f"{DEEPSPEED_HEAD}\nath', 'llama'\n] exits with return code = -9\n".encode())
    )
    assert (found.rank, found.root_cause, found.killed_by_signal) == (3, RootCause.HOST_RAM, 9)


def test_a_deepspeed_line_printed_whole_is_not_joined_to_the_next() -> None:
    whole = f"{DEEPSPEED_HEAD}ath'] exits with return code = 1"
    other = whole.replace("--local_rank=3", "--local_rank=5").replace("= 1", "= -9")
    found = scan_log(io.BytesIO(f"{whole}\n{other}\n".encode()))
    assert (found.rank, found.exit_code, found.root_cause) == (3, 1, RootCause.OTHER_ERROR)


def test_a_wrapped_head_whose_end_never_comes_names_no_rank() -> None:
    filler = "".join(f"line {index}\n" for index in range(12))
    found = scan_log(
        io.BytesIO(f"{DEEPSPEED_HEAD}\n{filler}] exits with return code = -9\n".encode())
    )
    assert (found.rank, found.root_cause) == (None, RootCause.HOST_RAM)


def test_megatron_validation_line_gives_the_step_of_a_failure_after_it() -> None:
    found, label = _log("107"), LOGS["107"]
    assert (found.step, found.step_line) == (label.step, label.step_line)


@pytest.mark.parametrize(
    "line",
    [
        " validation loss at iteration 300 | lm loss value: 2.1E+00 |",
        "saving checkpoint at iteration     300 to /ckpt in torch_dist format",
        "  successfully saved checkpoint from iteration     300 to /ckpt",
    ],
)
def test_megatron_iteration_wordings_name_the_step(line: str) -> None:
    found = scan_log(
        io.BytesIO(
            f"{line}\n[rank0]: RuntimeError: CUDA error: unspecified launch failure\n".encode()
        )
    )
    assert found.step == 300


def test_ncclcheck_unwinding_lines_are_no_set_up() -> None:
    found, label = _log("102"), LOGS["102"]
    assert label.phase is None
    assert (found.phase, found.root_cause) == (Phase.UNKNOWN, RootCause.ACCELERATOR_OOM)
    set_up = scan_log(
        io.BytesIO(
            b"node1:42:42 [0] NCCL INFO Channel 00/02 :    0   1\n"
            b"node1:42:42 [0] include/alloc.h:103 NCCL WARN Cuda failure 'out of memory'\n"
        )
    )
    assert set_up.phase is Phase.SETUP


@pytest.mark.parametrize(("worker", "node"), [("93663", None), ("93658", "10.49.144.10")])
def test_a_ray_death_names_its_node_only_for_its_own_worker(worker: str, node: str | None) -> None:
    found = scan_log(
        io.BytesIO(
            b"(raylet) A worker died or was killed while executing a task by an unexpected system"
            b" error. Worker IP address: 10.49.144.10 Worker port: 3282 Worker PID: 93658\n"
            b"(WorkerDict pid=" + worker.encode() + b") RuntimeError: CUDA error: an illegal"
            b" memory access was encountered\n"
        )
    )
    assert (found.node, found.root_cause) == (node, RootCause.GPU_FAULT)
