"""Fuzzing every evidence parser and the diagnosis: in-range figures or a documented error, always.

Inputs are random and adversarial (digit runs, minus signs, task lists, rank prefixes, message
fragments), with the hostile reproducers of issue 10 as explicit examples. Each test is bounded
(`max_examples`) so that the whole file runs in seconds; time is measured in the benchmark
(`make bench BENCH=hostile`), never asserted here.
"""

from __future__ import annotations

import io
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from daemon.diagnosis import Diagnosis, History
from daemon.evidence.joblog import scan_log
from daemon.evidence.log_events import MAX_NOTES
from daemon.evidence.oom import parse_oom, parse_oom_block
from daemon.evidence.oom_message import MAX_MESSAGE_CHARS
from daemon.evidence.records import (
    MAX_GPU_INDEX,
    MAX_PID,
    MAX_RANK,
    MAX_STEP,
    ComputeApp,
    Evidence,
    GpuFault,
    GpuHealth,
    LogFindings,
    NodeProbe,
    OomFamily,
    OomReport,
    OtherProcess,
    Phase,
    ProbeVerdict,
    RootCause,
)
from daemon.evidence.units import (
    KIB,
    MAX_BYTES,
    SizeParseError,
    bounded_int,
    format_size,
    parse_size,
)
from daemon.rules.dispatch import diagnose
from daemon.slurm.records import MAX_EXIT_CODE, JobState
from tests.bench.bench_hostile import (
    DIGIT_RUNS_LOG,
    HOOK_MESSAGE,
    HUGE_NUMBERS_LOG,
    HUGE_STEP_LOG,
    TASK_LIST_LOG,
    ZERO_REQUEST_LOG,
)
from tests.test_diagnosis import job

REAL_OOM = Path(__file__).parent / "data" / "real" / "oom"
BOUNDED = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NUMBERS = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.integers(min_value=1, max_value=6000).map(lambda digits: "9" * digits),
    st.tuples(st.integers(0, 10**25), st.integers(0, 10**4)).map(lambda p: f"{p[0]}.{p[1]:02d}"),
    st.sampled_from(["0", "-0", "-9.50", "²", "٣", "1e3", "4611686018427387905", "2" * 30]),
)
FRAGMENTS = st.sampled_from(
    [
        "CUDA out of memory. ",
        "torch.OutOfMemoryError: ",
        "Tried to allocate ",
        " GiB",
        " MiB",
        " bytes",
        "B",
        "GiB. GPU ",
        " has a total capacity of ",
        " of which ",
        " is free. ",
        "(GPU ",
        "; ",
        " total capacity; ",
        " already allocated; ",
        " free; ",
        " reserved in total by PyTorch)",
        " cached)",
        "Process ",
        " has ",
        " memory in use. ",
        "Including non-PyTorch memory, this process has ",
        "Of the allocated memory ",
        " is allocated by PyTorch, and ",
        " is reserved by PyTorch but unallocated.",
        " allocated in private pools",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "NCCL WARN Cuda failure 'out of memory'",
        "Failed to CUDA calloc ",
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate ",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "srun: error: gpu-01: tasks ",
        "srun: error: gpu-02: task ",
        "0-4095,",
        ",",
        "-",
        ": Exited with exit code ",
        ": Killed",
        "[rank",
        "[default",
        "]: ",
        ": ",
        "step=",
        "step ",
        "global_step: ",
        " iteration ",
        "| ",
        "/1000 [",
        # the step and phase vocabulary (daemon/evidence/steps.py, phases.py)
        "Epoch: [0][",
        "it [",
        "[batch=",
        "[Eval batch=",
        "global_step=3.2e+",
        "Overall training speed: ",
        " iterations",
        "Loading checkpoint shards: ",
        "***** Running Evaluation *****",
        "***** Running training *****",
        "Saving model checkpoint to ",
        " NCCL INFO ",
        "{'loss': ",
        "[2023-07-10 04:09:42,841] ",
        "Traceback (most recent call last):",
        '  File "model.py", line 1, in forward',
        "    return self.attn(x)",
        "Root Cause (first observed failure):",
        # issue 11's launcher formats (daemon/evidence/launchers.py)
        "2024-11-20 14:37:16 ",
        "[gpu187:",
        "(RayTrainWorker pid=",
        ", ip=10.0.0.7) ",
        "failed (exitcode: ",
        ") local_rank: ",
        "exits with return code = ",
        "'--local_rank=",
        "  Process name: [[29973,1],",
        "  Exit code:    ",
        "Fatal Python error: Aborted",
        "[E ProcessGroupNCCL.cpp:737] [Rank ",
        "[PG ID 5 PG GUID 83(X) Rank ",
        "CUDA error: an illegal memory access was encountered",
        "NVRM: Xid (PCI:0000:02:00): ",
        "CANCELLED AT 2024-03-01T10:00:00 DUE TO TIME LIMIT",
        "  time      : 2024-01-01_00:00:00",
        "[0]:",
        "  rank      : ",
        "  exitcode  : ",
        " (pid: ",
        ")",
        "Sending process ",
        " closing signal SIGTERM",
        '{"message": ',
        "Killed",
        "\r",
        "\x1b[31m",
        "│",
        "\ufffd",
        "\x00",
        " " * 50,
        # issue 11's formats: lost first words, glued text, MPS, caps, TF/XLA, host allocators
        "whyCUDA out of memory. ",
        "OutOfMemoryError('",
        "**",
        "MPS backend out of memory (MPS allocated: ",
        ", other allocations: ",
        ", max allowed: ",
        " on private pool. ",
        " GB",
        " MB",
        " allowed; ",
        " cached; ",
        " inactive)",
        "more than 1EB",
        "ResourceExhaustedError: ",
        "Resource exhausted: Out ",
        "HIP_ERROR_OutOfMemory",
        " bytes) from device: CUDA_ERROR_OUT_OF_MEMORY",
        "Failed to allocate memory for requested buffer of size ",
        "DefaultCPUAllocator: can't allocate memory",
        "std::bad_alloc",
        "error == cudaSuccess. 2 vs 0",
    ]
)
LINES = st.lists(
    st.lists(st.one_of(FRAGMENTS, NUMBERS, st.text(max_size=8)), max_size=24).map("".join),
    max_size=30,
).map("\n".join)
WIDE = st.one_of(st.none(), st.integers(min_value=-(2**80), max_value=2**80))


def _in(value: int | None, low: int, high: int) -> bool:
    return value is None or low <= value <= high


def _report_in_range(report: OomReport) -> bool:
    sizes = (
        report.requested_bytes,
        report.total_bytes,
        report.free_bytes,
        report.allocated_bytes,
        report.reserved_bytes,
        report.reserved_unallocated_bytes,
        report.process_in_use_bytes,
        report.private_pool_bytes,
        report.allowed_bytes,
        report.other_allocations_bytes,
    )
    return (
        all(_in(size, 0, MAX_BYTES) for size in sizes)
        and _in(report.gpu_index, 0, MAX_GPU_INDEX)
        and all(
            _in(other.pid, 0, MAX_PID) and _in(other.bytes, 0, MAX_BYTES)
            for other in report.other_processes
        )
    )


@given(LINES)
@BOUNDED
@example(DIGIT_RUNS_LOG.splitlines()[0])
@example(ZERO_REQUEST_LOG)
@example(HUGE_NUMBERS_LOG)
@example(HOOK_MESSAGE.replace("2.00 GiB", f"{'9' * 4000}.00 GiB"))
@example(HOOK_MESSAGE.replace("7.50 GiB", "-9.50 GiB"))
def test_oom_parser_figures_are_always_in_range(text: str) -> None:
    report = parse_oom(text)
    if report is not None:
        assert _report_in_range(report)
        assert len(report.message) <= MAX_MESSAGE_CHARS


@given(LINES)
@BOUNDED
@example("CUDA out of memory. Tried to allocate 2.0\n0 GiB (GPU 0; 9" + "9" * 5000 + "\n.00 GiB")
@example("MPS backend out of memory (MPS allocated: 2.25 GiB, other allocations: 67108863.99 GiB")
@example("this process has **17179869184.00 GiB** memory in use.\nCUDA out of memory.")
@example("Resource exhausted: Out \nof memory while trying to allocate " + "9" * 40 + " bytes.")
def test_oom_block_figures_are_always_in_range(text: str) -> None:
    lines = text.split("\n")
    report = parse_oom_block(lines)
    if report is not None:
        assert _report_in_range(report)
        assert len(report.message) <= MAX_MESSAGE_CHARS


@given(
    st.integers(0, MAX_BYTES),
    st.integers(0, 2**40),
    st.integers(0, MAX_BYTES),
    st.integers(0, MAX_BYTES),
    st.integers(0, 2**37),
    st.integers(0, MAX_GPU_INDEX),
    st.integers(0, MAX_PID),
)
@BOUNDED
def test_the_real_pytorch_formats_round_trip(
    requested: int,
    total: int,
    allocated: int,
    unallocated: int,
    other: int,
    gpu: int,
    pid: int,
) -> None:
    # The 2.2+ wording (tests/data/oom/torch22_expandable.txt, with a co-tenant line) and the
    # 1.x one (torch1x_reserved.txt): what PyTorch prints parses back to what it meant.
    new = parse_oom(
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {format_size(requested)}."
        f" GPU {gpu} has a total capacity of {format_size(total)} of which"
        f" {format_size(total // 3)} is free. Process {pid} has {format_size(other)} memory in"
        f" use. Including non-PyTorch memory, this process has {format_size(total // 2)} memory"
        f" in use. Of the allocated memory {format_size(allocated)} is allocated by PyTorch, and"
        f" {format_size(unallocated)} is reserved by PyTorch but unallocated. If reserved but"
        " unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        " to avoid fragmentation."
    )
    assert new is not None
    assert _close(new.requested_bytes, requested)
    assert _close(new.total_bytes, total)
    assert _close(new.free_bytes, total // 3)
    assert _close(new.process_in_use_bytes, total // 2)
    assert _close(new.allocated_bytes, allocated)
    assert _close(new.reserved_unallocated_bytes, unallocated)
    assert new.gpu_index == gpu
    assert [process.pid for process in new.other_processes] == [pid]
    assert _close(new.other_processes[0].bytes, other)
    old = parse_oom(
        f"RuntimeError: CUDA out of memory. Tried to allocate {format_size(requested)} (GPU {gpu};"
        f" {format_size(total)} total capacity; {format_size(allocated)} already allocated;"
        f" {format_size(total // 3)} free; {format_size(allocated + unallocated)} reserved in"
        " total by PyTorch)"
    )
    assert old is not None
    assert _close(old.requested_bytes, requested)
    assert _close(old.total_bytes, total)
    assert _close(old.allocated_bytes, allocated)
    assert _close(old.free_bytes, total // 3)
    assert old.gpu_index == gpu


def _close(parsed: int | None, size: int) -> bool:
    """Within half a printed hundredth of the unit `format_size` chose (PyTorch's rounding)."""
    unit = {"bytes": 1, "KiB": KIB, "MiB": KIB**2, "GiB": KIB**3}[format_size(size).split()[-1]]
    return parsed is not None and abs(parsed - size) <= unit // 200 + 1


def test_every_real_sample_parses_to_figures_in_range() -> None:
    samples = sorted(REAL_OOM.glob("*.txt"))
    assert samples
    for sample in samples:
        report = parse_oom(sample.read_text(errors="replace"))
        assert report is None or _report_in_range(report), sample.name


@given(st.one_of(st.lists(st.one_of(NUMBERS, FRAGMENTS), max_size=4).map("".join), st.text()))
@BOUNDED
@example("9" * 5000 + " GiB")
@example("-9.50 GiB")
@example("1024 EiB")
@example("1073741824.00 GiB")
@example("٣ GiB")
def test_parse_size_is_in_range_or_its_own_error(text: str) -> None:
    try:
        size = parse_size(text)
    except SizeParseError:
        return
    assert 0 <= size <= MAX_BYTES


@given(NUMBERS, st.sampled_from([MAX_RANK, MAX_STEP, MAX_PID, MAX_EXIT_CODE]))
@BOUNDED
@example("7" * 5000, MAX_STEP)
@example("9223372036854775808", MAX_STEP)
def test_bounded_int_is_the_number_or_none(text: str, limit: int) -> None:
    value = bounded_int(text, limit)
    if value is not None:
        assert abs(value) <= limit
        assert value == int(text)


@given(LINES, st.sampled_from(["", "[rank3]: ", "3: ", "[default1]: ", "[rank99999999]: "]))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(TASK_LIST_LOG, "")
@example(DIGIT_RUNS_LOG[:40_000], "")
@example(ZERO_REQUEST_LOG, "")
@example(HUGE_STEP_LOG, "")
@example(HUGE_NUMBERS_LOG, "")
def test_log_scan_findings_are_always_in_range(text: str, prefix: str) -> None:
    log = "\n".join(prefix + line for line in text.split("\n"))
    found = scan_log(io.BytesIO(log.encode("utf-8", errors="surrogatepass")), block_size=4096)
    assert _in(found.rank, -MAX_RANK, MAX_RANK)
    assert _in(found.step, 0, MAX_STEP)
    assert _in(found.max_step_seen, 0, MAX_STEP)
    assert _in(found.exit_code, -MAX_EXIT_CODE, MAX_EXIT_CODE)
    assert all(_in(rank, -MAX_RANK, MAX_RANK) for rank in found.cascade_ranks)
    assert all(_in(pid, 0, MAX_PID) for pid in found.job_pids)
    assert found.oom is None or _report_in_range(found.oom)
    assert len(found.notes) <= MAX_NOTES + 4  # the scan's own, then the findings' few
    assert found.bytes_scanned <= len(log.encode("utf-8", errors="surrogatepass"))


NOW = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)
SIZES = st.one_of(st.none(), st.integers(0, 2 * MAX_BYTES), st.integers(-(2**70), 2**70))
REPORTS = st.builds(
    OomReport,
    family=st.sampled_from(OomFamily),
    message=st.text(max_size=80),
    requested_bytes=SIZES,
    total_bytes=SIZES,
    free_bytes=SIZES,
    allocated_bytes=SIZES,
    reserved_bytes=SIZES,
    reserved_unallocated_bytes=SIZES,
    process_in_use_bytes=SIZES,
    private_pool_bytes=SIZES,
    gpu_index=WIDE,
    other_processes=st.lists(
        st.builds(
            OtherProcess, pid=st.integers(-(2**40), 2**40), bytes=st.integers(-(2**70), 2**70)
        ),
        max_size=4,
    ).map(tuple),
    alloc_conf=st.none() | st.just("expandable_segments:True"),
    suggests_max_split=st.booleans(),
    notes=st.lists(st.text(max_size=20), max_size=2).map(tuple),
    allowed_bytes=SIZES,
    other_allocations_bytes=SIZES,
    request_beyond_any_device=st.booleans(),
)
FINDINGS = st.builds(
    LogFindings,
    rank=WIDE,
    node=st.none() | st.sampled_from(["gpu-01", "gpu-02"]),
    step=WIDE,
    max_step_seen=WIDE,
    phase=st.sampled_from(Phase),
    frames=st.lists(st.sampled_from(["forward", "step", "attn"]), max_size=3).map(tuple),
    heavy_kernels=st.lists(st.sampled_from(["attention", "cublas_matmul"]), max_size=2).map(tuple),
    oom=st.none() | REPORTS,
    root_failure_line=st.none() | st.text(max_size=40),
    cascade_ranks=st.lists(st.integers(-(2**40), 2**40), max_size=3).map(tuple),
    exit_code=WIDE,
    killed_by_signal=WIDE,
    notes=st.lists(st.text(max_size=20), max_size=3).map(tuple),
    job_pids=st.lists(st.integers(-(2**40), 2**40), max_size=3).map(tuple),
    traceback_seen=st.booleans(),
    root_cause=st.none() | st.sampled_from(RootCause),
    gpu_fault=st.none()
    | st.builds(GpuFault, line=st.text(max_size=40), words=st.text(max_size=20), xid=WIDE),
)
PROBES = st.builds(
    NodeProbe,
    node=st.sampled_from(["gpu-01", "gpu-02"]),
    probed_at=st.just(NOW),
    verdict=st.sampled_from(ProbeVerdict),
    reasons=st.lists(st.text(max_size=20), max_size=2).map(tuple),
    gpus=st.lists(
        st.builds(
            GpuHealth,
            index=st.integers(-5, 2**20),
            uuid=st.none() | st.just("GPU-1"),
            pci_bus_id=st.none(),
            memory_total_bytes=SIZES,
            memory_used_bytes=SIZES,
            remap_pending=st.none() | st.booleans(),
            ecc_volatile_uncorrectable=WIDE,
            compute_apps=st.lists(
                st.builds(
                    ComputeApp,
                    gpu_uuid=st.just("GPU-1"),
                    pid=WIDE,
                    process_name=st.none() | st.just("python"),
                    used_bytes=SIZES,
                ),
                max_size=3,
            ).map(tuple),
        ),
        max_size=2,
    ).map(tuple),
)
JOBS = st.builds(
    lambda state, code, signal, nodes: replace(
        job(state), exit_code=code, exit_signal=signal, nodes=nodes
    ),
    st.sampled_from(JobState),
    WIDE,
    WIDE,
    st.sampled_from([(), ("gpu-01",), ("gpu-01", "gpu-02")]),
)


@given(
    st.builds(
        Evidence,
        log=FINDINGS,
        job=st.none() | JOBS,
        probe=st.none() | PROBES,
        job_gpu_uuids=st.sampled_from([(), ("GPU-1",)]),
        expandable_segments=st.none() | st.booleans(),
    )
)
@BOUNDED
@example(Evidence(log=LogFindings(oom=parse_oom(ZERO_REQUEST_LOG))))
@example(Evidence(log=LogFindings(step=2**63, rank=2**31, oom=OomReport(OomFamily.XLA, "x", -1))))
def test_diagnosis_of_any_evidence_is_a_verdict_a_record_can_hold(evidence: Evidence) -> None:
    verdict = diagnose(evidence, History())
    assert isinstance(verdict, Diagnosis)
    assert verdict.reasons
    assert _in(verdict.rank, -MAX_RANK, MAX_RANK)
    assert _in(verdict.step, 0, MAX_STEP)
    assert verdict.oom is None or _report_in_range(verdict.oom)
