"""The diagnosis on realistic evidence: each kind, its reasons and the numbers they quote."""

from __future__ import annotations

import ast
import io
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, History, MidRunCause, Onset
from daemon.evidence.joblog import scan_log
from daemon.evidence.oom import parse_oom
from daemon.evidence.records import (
    ComputeApp,
    Evidence,
    GpuFault,
    GpuHealth,
    LogFindings,
    NodeProbe,
    OomFamily,
    OomReport,
    Phase,
    ProbeVerdict,
    RootCause,
    XidEvent,
    XidPolicy,
)
from daemon.rules.dispatch import diagnose
from daemon.slurm.records import JobState, SlurmJob
from daemon.slurm.sacct_json import parse_sacct_json

OOM = Path(__file__).parent / "data" / "oom"
NOW = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)


def sample(name: str) -> OomReport:
    report = parse_oom((OOM / name).read_text())
    assert report is not None
    return report


def message(requested: str, total: str, free: str, allocated: str, unallocated: str) -> OomReport:
    report = parse_oom(
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {requested}. GPU 0 has a"
        f" total capacity of {total} of which {free} is free. Including non-PyTorch memory, this"
        f" process has {total} memory in use. Of the allocated memory {allocated} is allocated"
        f" by PyTorch, and {unallocated} is reserved by PyTorch but unallocated."
    )
    assert report is not None
    return report


def job(state: JobState = JobState.FAILED, exit_code: int = 1, signal: int = 0) -> SlurmJob:
    return SlurmJob(
        job_id=42,
        name="train",
        user="alice",
        uid=1001,
        group="alice",
        account=None,
        partition="gpu",
        state=state,
        state_raw=state.value,
        exit_code=exit_code,
        exit_signal=signal,
        derived_exit_code=None,
        derived_exit_signal=None,
        nodes=("gpu-02",),
        batch_host="gpu-02",
        submit_time=NOW,
        start_time=NOW,
        end_time=NOW,
        stdout_path="/home/alice/slurm-42.out",
        stderr_path=None,
        work_dir="/home/alice",
        comment=None,
    )


def probe(**kwargs: object) -> NodeProbe:
    base = NodeProbe(node="gpu-02", probed_at=NOW, verdict=ProbeVerdict.HEALTHY, reasons=())
    return replace(base, **kwargs)  # type: ignore[arg-type]


def run(log: LogFindings, **kwargs: object) -> Diagnosis:
    return diagnose(Evidence(log=log, **kwargs), History())  # type: ignore[arg-type]


# A message the fragmentation rule reads as a true OOM: F + U = 61.44 MiB < X = 64 MiB.
TRUE_OOM_SAMPLE = "torch1x_max_split_zero_free.txt"


def test_fragmentation_quotes_the_margin_and_its_share_of_the_card() -> None:
    oom = message("2.00 GiB", "79.15 GiB", "1.50 GiB", "70.00 GiB", "6.50 GiB")
    verdict = run(LogFindings(oom=oom, step=300, phase=Phase.FORWARD, node="gpu-02", rank=5))
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert verdict.confidence is Confidence.HIGH
    assert any(
        "6.50 GiB reserved but unallocated alone covers the 2.00 GiB request with 6.00 GiB to"
        " spare, 7.6% of the card" in reason
        for reason in verdict.reasons
    )
    assert (verdict.rank, verdict.node, verdict.step) == (5, "gpu-02", 300)


def test_real_2_1_message_with_a_margin_beyond_the_request_is_confident_fragmentation() -> None:
    verdict = run(LogFindings(oom=sample("torch21_capacty.txt")))
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert verdict.confidence is Confidence.HIGH


def test_more_free_than_asked_is_not_pretended_away() -> None:
    verdict = run(LogFindings(oom=sample("torch21_free_exceeds_request.txt")))
    assert verdict.kind is FailureKind.UNKNOWN
    text = " ".join(verdict.reasons)
    assert "2.80 GiB free, more than the 2.00 GiB asked for" in text
    assert "neither capacity nor fragmentation explains it" in text
    assert "MIG" in text


def test_a_small_share_of_the_card_stranded_is_still_fragmentation() -> None:
    # 194.87 MiB reserved but unallocated (0.8% of the card) covers the 22.00 MiB request.
    verdict = run(LogFindings(oom=sample("torch22_expandable.txt"), step=0))
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert verdict.confidence is Confidence.HIGH


def test_with_expandable_segments_already_on_stranded_bytes_are_a_true_oom() -> None:
    findings = LogFindings(oom=sample("torch22_expandable.txt"), step=0)
    verdict = diagnose(Evidence(log=findings, expandable_segments=True), History())
    assert verdict.kind is FailureKind.TRUE_OOM
    assert verdict.onset is Onset.STEP0
    assert any("already had expandable_segments:True" in reason for reason in verdict.reasons)
    assert any("22.90 GiB of the 23.65 GiB card (97%)" in reason for reason in verdict.reasons)


def test_own_process_seen_from_a_container_is_not_a_cotenant() -> None:
    verdict = run(LogFindings(oom=sample("torch21_container_pid.txt")))
    assert verdict.kind is FailureKind.FRAGMENTATION  # F + U = 565.84 MiB >= X = 496 MiB
    assert verdict.cotenant_pids == ()


FULL_CARD_WITH_OTHERS = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"
    " capacity of 79.15 GiB of which 100.00 MiB is free. Process 3893521 has 618.00 MiB memory"
    " in use. Process 1493972 has 1.28 GiB memory in use. Including non-PyTorch memory, this"
    " process has 77.00 GiB memory in use. Of the allocated memory 76.00 GiB is allocated by"
    " PyTorch, and 200.00 MiB is reserved by PyTorch but unallocated."
)


def test_other_processes_on_a_full_card_are_cotenants() -> None:
    oom = parse_oom(FULL_CARD_WITH_OTHERS)
    verdict = run(LogFindings(oom=oom, node="gpu-02"))
    assert verdict.kind is FailureKind.COTENANT
    assert verdict.confidence is Confidence.HIGH
    assert "without them the 2.00 GiB request would have fit" in verdict.reasons
    assert verdict.cotenant_pids == (3893521, 1493972)
    assert verdict.bad_nodes == ("gpu-02",)


def test_other_processes_do_not_hide_fragmentation() -> None:
    # 163.19 MiB reserved but unallocated covers the 26.00 MiB request: the allocator's own
    # bytes would have served it, whoever else holds memory on the card.
    verdict = run(LogFindings(oom=sample("torch_other_processes.txt"), node="gpu-02"))
    assert verdict.kind is FailureKind.FRAGMENTATION
    assert "process 1493972 held 1.28 GiB on the same GPU" in verdict.reasons
    assert verdict.cotenant_pids == ()


def test_job_pids_are_not_cotenants() -> None:
    findings = LogFindings(oom=parse_oom(FULL_CARD_WITH_OTHERS), job_pids=(3893521, 1493972))
    assert run(findings).kind is FailureKind.TRUE_OOM


def test_probe_compute_app_is_a_cotenant() -> None:
    app = ComputeApp(gpu_uuid="GPU-1", pid=777, process_name="python", used_bytes=30 * 1024**3)
    gpu = GpuHealth(
        index=0,
        uuid="GPU-1",
        pci_bus_id=None,
        memory_total_bytes=80 * 1024**3,
        memory_used_bytes=30 * 1024**3,
        compute_apps=(app,),
    )
    findings = LogFindings(oom=sample("torch22_expandable.txt"), node="gpu-02")
    verdict = run(findings, probe=probe(gpus=(gpu,)), job_gpu_uuids=("GPU-1",))
    assert verdict.kind is FailureKind.COTENANT
    assert verdict.confidence is Confidence.MEDIUM
    assert verdict.cotenant_pids == (777,)
    assert any("30.00 GiB on GPU 0 of gpu-02" in reason for reason in verdict.reasons)
    unscoped = run(findings, probe=probe(gpus=(gpu,)))
    assert unscoped.confidence is Confidence.LOW
    other_gpu = run(findings, probe=probe(gpus=(gpu,)), job_gpu_uuids=("GPU-2",))
    assert other_gpu.kind is FailureKind.FRAGMENTATION


def test_xid_79_on_the_oom_node_is_hardware() -> None:
    xid = XidEvent(
        code=79,
        pci_bus_id="0000:3B:00.0",
        pid=None,
        process_name=None,
        time=NOW,
        text="NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        policy=XidPolicy.HARDWARE,
        meaning="GPU has fallen off the bus",
    )
    findings = LogFindings(oom=sample("cuda_runtime.txt"), node="gpu-02")
    verdict = run(findings, probe=probe(xid_events=(xid,), verdict=ProbeVerdict.FAULTY))
    assert verdict.kind is FailureKind.HARDWARE
    assert verdict.bad_nodes == ("gpu-02",)
    assert "XID 79 on gpu-02: GPU has fallen off the bus" in verdict.reasons


def test_fault_on_another_node_does_not_blame_this_one() -> None:
    gpu = GpuHealth(
        index=0,
        uuid=None,
        pci_bus_id=None,
        memory_total_bytes=None,
        memory_used_bytes=None,
        remap_pending=True,
    )
    findings = LogFindings(oom=sample(TRUE_OOM_SAMPLE), node="gpu-03", step=0)
    verdict = run(findings, probe=probe(gpus=(gpu,)))
    assert verdict.kind is FailureKind.TRUE_OOM
    assert verdict.bad_nodes == ()


def test_pending_row_remap_is_hardware() -> None:
    gpu = GpuHealth(
        index=3,
        uuid=None,
        pci_bus_id=None,
        memory_total_bytes=None,
        memory_used_bytes=None,
        remap_pending=True,
    )
    verdict = run(LogFindings(node="gpu-02"), probe=probe(gpus=(gpu,)))
    assert verdict.kind is FailureKind.HARDWARE
    assert "GPU 3 on gpu-02 has a row remap pending" in verdict.reasons


def test_slurm_out_of_memory_state_is_host_ram() -> None:
    verdict = run(LogFindings(), job=job(JobState.OUT_OF_MEMORY, exit_code=0, signal=9))
    assert verdict.kind is FailureKind.HOST_RAM
    assert verdict.confidence is Confidence.HIGH
    assert verdict.node == "gpu-02"


def test_a_step_the_memory_cgroup_killed_is_host_ram_though_the_job_failed() -> None:
    # Real 22.05 accounting of a cgroup kill (tests/data/slurm/README.md, `cgroup-oom`): the
    # job FAILED, its srun step OUT_OF_MEMORY; the log alone says nothing here.
    sample = Path(__file__).parent / "data" / "slurm" / "dbv0.0.38" / "cgroup-oom.json"
    killed = parse_sacct_json(sample.read_text(encoding="utf-8")).jobs[0]
    assert killed.state is JobState.FAILED
    verdict = run(LogFindings(), job=killed)
    assert verdict.kind is FailureKind.HOST_RAM
    assert verdict.confidence is Confidence.HIGH
    assert f"Slurm ended step {killed.job_id}.0 as OUT_OF_MEMORY (its memory cgroup)" in (
        verdict.reasons
    )


def test_sigkill_without_traceback_is_host_ram_with_less_certainty() -> None:
    verdict = run(LogFindings(exit_code=137, killed_by_signal=9))
    assert verdict.kind is FailureKind.HOST_RAM
    assert verdict.confidence is Confidence.MEDIUM
    assert any("no Python traceback" in reason for reason in verdict.reasons)


def test_gpu_oom_beats_a_sigkill_that_followed_it() -> None:
    findings = LogFindings(oom=sample(TRUE_OOM_SAMPLE), step=0, killed_by_signal=9)
    assert run(findings).kind is FailureKind.TRUE_OOM


def test_large_request_in_attention_frames_is_a_workspace_spike() -> None:
    oom = message("12.00 GiB", "79.15 GiB", "3.00 GiB", "60.00 GiB", "1.00 GiB")
    findings = LogFindings(oom=oom, step=800, phase=Phase.FORWARD, heavy_kernels=("attention",))
    verdict = run(findings)
    assert verdict.kind is FailureKind.WORKSPACE_SPIKE
    assert any("12.00 GiB request (15% of the card) inside attention" in r for r in verdict.reasons)


def test_oom_in_optimizer_step_is_a_burst() -> None:
    findings = LogFindings(
        oom=sample("torch1x_max_split_zero_free.txt"), phase=Phase.OPTIMIZER_STEP
    )
    assert run(findings).kind is FailureKind.OPTIMIZER_BURST


def test_oom_in_eval_is_eval_growth() -> None:
    findings = LogFindings(oom=sample(TRUE_OOM_SAMPLE), phase=Phase.EVAL, step=1000)
    assert run(findings).kind is FailureKind.EVAL_GROWTH
    generate = LogFindings(oom=sample(TRUE_OOM_SAMPLE), phase=Phase.GENERATE, step=1000)
    assert run(generate).kind is FailureKind.EVAL_GROWTH


@pytest.mark.parametrize(
    ("requested", "step", "cause"),
    [
        ("3.00 GiB", 2, MidRunCause.OPTIMIZER_STATE),
        ("3.00 GiB", 900, MidRunCause.LONGEST_BATCH),
        ("20.00 MiB", 900, MidRunCause.GROWTH),
    ],
)
def test_mid_run_causes(requested: str, step: int, cause: MidRunCause) -> None:
    oom = message(requested, "79.15 GiB", "10.00 MiB", "78.00 GiB", "5.00 MiB")
    verdict = run(LogFindings(oom=oom, step=step, phase=Phase.BACKWARD))
    assert verdict.kind is FailureKind.TRUE_OOM
    assert verdict.onset is Onset.MID_RUN
    assert verdict.mid_run_cause is cause
    assert any(f"step {step}" in reason for reason in verdict.reasons)


def test_history_is_quoted_for_a_repeat_failure() -> None:
    earlier = Diagnosis(kind=FailureKind.TRUE_OOM, confidence=Confidence.HIGH, reasons=(), step=700)
    oom = message("3.00 GiB", "79.15 GiB", "10.00 MiB", "78.00 GiB", "100.00 MiB")
    verdict = diagnose(Evidence(log=LogFindings(oom=oom, step=900)), History(earlier=(earlier,)))
    assert "this lineage failed before at step 700 (true_oom)" in verdict.reasons


def test_other_exception_is_not_oom() -> None:
    findings = LogFindings(
        root_failure_line="ValueError: Expected input batch_size (8) to match target (16).",
        cascade_ranks=(0, 1),
    )
    verdict = run(findings)
    assert verdict.kind is FailureKind.NOT_OOM
    assert not verdict.is_oom
    assert "ranks 0, 1 failed after it, as a cascade" in verdict.reasons


def test_nothing_at_all_is_unknown_with_a_reason() -> None:
    verdict = run(LogFindings(notes=("the log is empty",)))
    assert verdict.kind is FailureKind.UNKNOWN
    assert "the log is empty" in verdict.reasons


def test_diagnosis_modules_import_no_io() -> None:
    daemon_dir = Path(__file__).parents[1] / "daemon"
    sources = [daemon_dir / "diagnosis.py", *sorted((daemon_dir / "rules").glob("*.py"))]
    assert len(sources) > 2
    imported: set[str] = set()
    for node in (node for path in sources for node in ast.walk(ast.parse(path.read_text()))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    forbidden = {"subprocess", "socket", "paramiko", "sqlalchemy", "daemon.process", "os"}
    assert not {name for name in imported if name.split(".")[0] in forbidden or name in forbidden}


def test_request_larger_than_the_card_is_said_plainly() -> None:
    oom = message("37252902.99 GiB", "14.74 GiB", "14.64 GiB", "0 bytes", "0 bytes")
    verdict = run(LogFindings(oom=oom))
    assert any("larger than the whole 14.74 GiB card" in reason for reason in verdict.reasons)


def test_many_small_holders_are_named_as_possible_stray_contexts() -> None:
    oom = parse_oom(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a"
        " total capacity of 79.15 GiB of which 200.00 MiB is free. Process 11 has 600.00 MiB"
        " memory in use. Process 12 has 600.00 MiB memory in use. Process 13 has 600.00 MiB"
        " memory in use. Including non-PyTorch memory, this process has 77.00 GiB memory in"
        " use. Of the allocated memory 75.00 GiB is allocated by PyTorch, and 100.00 MiB is"
        " reserved by PyTorch but unallocated."
    )
    assert oom is not None
    verdict = run(LogFindings(oom=oom))
    assert verdict.kind is FailureKind.COTENANT
    assert any("opened a CUDA context on this GPU" in reason for reason in verdict.reasons)


LOGS = Path(__file__).parent / "data" / "logs"


@pytest.mark.parametrize(
    "name", ["devcluster_true_oom_midrun_4rank.log", "devcluster_true_oom_midrun_resumed.log"]
)
def test_four_rank_midrun_oom_is_at_step_6_not_the_optimizer_state(name: str) -> None:
    verdict = run(scan_log(LOGS / name))
    assert verdict.kind is FailureKind.TRUE_OOM
    assert verdict.onset is Onset.MID_RUN
    assert verdict.mid_run_cause is MidRunCause.LONGEST_BATCH
    assert verdict.step == 6


# --- the log's root cause (issue 11 section 2): evidence without a node probe ---------------

ILLEGAL_ACCESS = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


def fault(line: str = ILLEGAL_ACCESS, **kwargs: object) -> LogFindings:
    values: dict[str, object] = {
        "root_cause": RootCause.GPU_FAULT,
        "gpu_fault": GpuFault(line=line, words="an illegal memory access"),
        "root_failure_line": line,
        "node": "gpu-02",
        "rank": 1,
    }
    values.update(kwargs)
    return LogFindings(**values)  # type: ignore[arg-type]


def test_a_gpu_fault_in_the_log_is_hardware_without_a_probe() -> None:
    verdict = run(fault())
    assert verdict.kind is FailureKind.HARDWARE
    assert verdict.confidence is Confidence.MEDIUM
    assert verdict.bad_nodes == ("gpu-02",)
    assert (verdict.root_cause, verdict.root_cause_line) == (RootCause.GPU_FAULT, ILLEGAL_ACCESS)
    assert any(ILLEGAL_ACCESS in reason for reason in verdict.reasons)
    assert "no node probe confirmed it" in verdict.reasons


def test_a_printed_xid_is_said_in_the_catalogs_words() -> None:
    findings = fault(XID_LINE, gpu_fault=GpuFault(XID_LINE, "GPU has fallen off the bus", 79))
    verdict = run(findings)
    assert verdict.kind is FailureKind.HARDWARE
    assert any("(XID 79: GPU has fallen off the bus)" in reason for reason in verdict.reasons)


def test_a_gpu_fault_on_no_known_node_blames_no_node() -> None:
    verdict = run(fault(node=None))
    assert verdict.kind is FailureKind.HARDWARE
    assert verdict.bad_nodes == ()
    assert any("does not say which node" in reason for reason in verdict.reasons)


def test_a_healthy_probe_of_the_node_keeps_it_out_of_the_drain() -> None:
    verdict = run(fault(), probe=probe())
    assert verdict.kind is FailureKind.HARDWARE
    assert verdict.confidence is Confidence.LOW
    assert verdict.bad_nodes == ()
    assert any("found no XID, row remap or ECC fault" in reason for reason in verdict.reasons)


def test_the_probes_evidence_comes_first() -> None:
    xid = XidEvent(
        code=79,
        pci_bus_id=None,
        pid=None,
        process_name=None,
        time=NOW,
        text=XID_LINE,
        policy=XidPolicy.HARDWARE,
        meaning="GPU has fallen off the bus",
    )
    verdict = run(fault(), probe=probe(xid_events=(xid,)))
    assert verdict.confidence is Confidence.HIGH
    assert verdict.reasons[0] == "XID 79 on gpu-02: GPU has fallen off the bus"
    assert ILLEGAL_ACCESS in verdict.reasons[1]
    assert verdict.bad_nodes == ("gpu-02",)


@pytest.mark.parametrize(
    ("line", "confidence"),
    [
        ("torchrun: rank 0 exitcode -9 (Signal 9 (SIGKILL) received by PID 14750)", "medium"),
        ("slurmstepd: error: Detected 1 oom-kill event(s) in StepId=42.0.", "high"),
    ],
)
def test_a_host_ram_root_cause_is_host_ram(line: str, confidence: str) -> None:
    findings = LogFindings(root_cause=RootCause.HOST_RAM, root_failure_line=line, rank=0)
    verdict = run(findings)
    assert verdict.kind is FailureKind.HOST_RAM
    assert verdict.confidence.value == confidence
    assert any(line in reason for reason in verdict.reasons)


def test_a_collective_timeout_alone_is_not_called_an_oom() -> None:
    line = (
        "[rank2]:[E ProcessGroupNCCL.cpp:563] [Rank 2] Watchdog caught collective operation timeout"
    )
    findings = LogFindings(
        root_cause=RootCause.COLLECTIVE_TIMEOUT, root_failure_line=line, cascade_ranks=(0, 1)
    )
    verdict = run(findings)
    assert verdict.kind is FailureKind.UNKNOWN
    assert not verdict.is_oom
    assert verdict.reasons[0].startswith(
        "only a collective timeout is in view: the root failure is elsewhere"
    )
    assert verdict.root_cause is RootCause.COLLECTIVE_TIMEOUT


def test_another_error_is_not_oom_even_with_a_sigkill_after_it() -> None:
    line = "ValueError: Expected input batch_size (8) to match target (16)."
    findings = LogFindings(
        root_cause=RootCause.OTHER_ERROR, root_failure_line=line, killed_by_signal=9
    )
    verdict = run(findings)
    assert verdict.kind is FailureKind.NOT_OOM
    assert verdict.root_cause is RootCause.OTHER_ERROR


def test_findings_without_a_root_cause_get_one_from_what_they_hold() -> None:
    oom = sample(TRUE_OOM_SAMPLE)
    assert run(LogFindings(oom=oom)).root_cause is RootCause.ACCELERATOR_OOM
    line = "ValueError: bad shape"
    assert run(LogFindings(root_failure_line=line)).root_cause is RootCause.OTHER_ERROR
    assert run(LogFindings()).root_cause is None


# --- out-of-memory families with no allocator figures (issue 11, second held-out set) --------

REAL_OOM = Path(__file__).parent / "data" / "real" / "oom"


def real(prefix: str) -> Path:
    (path,) = REAL_OOM.glob(f"{prefix}-*.txt")
    return path


def test_an_engines_kv_cache_sizing_is_read_as_oom_but_proposes_no_batch_cut() -> None:
    # real/oom/156: vLLM's `No available memory for the cache blocks`, a torch.distributed
    # shutdown warning of rank 0 after it
    verdict = run(scan_log(real("156")))
    assert verdict.root_cause is RootCause.ACCELERATOR_OOM
    assert verdict.oom is not None
    assert verdict.oom.family is OomFamily.KV_CACHE
    assert (verdict.kind, verdict.confidence) == (FailureKind.UNKNOWN, Confidence.LOW)
    assert any("`gpu_memory_utilization`" in reason for reason in verdict.reasons)
    assert any("not a training batch" in reason for reason in verdict.reasons)


@pytest.mark.parametrize("prefix", ["177", "180", "181"])
def test_a_failed_library_handle_is_weak_evidence_of_a_device_oom(prefix: str) -> None:
    verdict = run(scan_log(real(prefix)))
    assert verdict.root_cause is RootCause.ACCELERATOR_OOM
    assert verdict.oom is not None
    assert verdict.oom.family is OomFamily.LIBRARY_HANDLE
    assert verdict.kind is FailureKind.UNKNOWN
    library = "cuBLAS" if prefix == "177" else "cuDNN"
    assert verdict.reasons[0].startswith(f"{library} could not create its handle: ")
    assert any("weak evidence" in reason for reason in verdict.reasons)


def test_a_failed_handle_before_the_drivers_oom_is_judged_on_the_drivers_figures() -> None:
    # real/oom/062: two `failed to create cublas handle` lines, then CUDA_ERROR_OUT_OF_MEMORY
    found = scan_log(real("062"))
    assert found.root_failure_line is not None
    assert "CUBLAS_STATUS_NOT_INITIALIZED" in found.root_failure_line
    assert found.oom is not None
    assert (found.oom.family, found.oom.requested_bytes) == (OomFamily.CUDA_RUNTIME, 33554432)
    assert run(found).kind is FailureKind.TRUE_OOM


def test_a_jvm_out_of_host_memory_is_host_ram_like_the_cpu_allocators() -> None:
    # real/oom/195 (a JVM in a 128 MB pod) reads as 084 (PyTorch's DefaultCPUAllocator) does
    for prefix in ("195", "084"):
        verdict = run(scan_log(real(prefix)))
        assert (verdict.kind, verdict.confidence) == (FailureKind.HOST_RAM, Confidence.MEDIUM)
        assert verdict.root_cause is RootCause.HOST_RAM


def test_a_bare_exception_name_is_explained_by_the_same_exception_with_its_message() -> None:
    # real/oom/166: the post's first line is `jaxlib.xla_extension.XlaRuntimeError` alone
    found = scan_log(real("166"))
    assert found.root_cause is RootCause.ACCELERATOR_OOM
    assert found.oom is not None
    assert found.oom.requested_bytes == 3743729664
    short = scan_log(io.BytesIO(b"RuntimeError\n\nRuntimeError: CUDA error: out of memory\n"))
    assert short.root_cause is RootCause.ACCELERATOR_OOM


def test_a_bare_exception_name_with_no_later_message_of_its_own_is_the_root() -> None:
    # an `assert` without a message prints its type alone: a later, different exception (here
    # raised while handling it) does not explain it
    found = scan_log(
        io.BytesIO(b"AssertionError\n\nXlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n")
    )
    assert found.root_cause is RootCause.OTHER_ERROR
    assert found.root_failure_line == "AssertionError"
