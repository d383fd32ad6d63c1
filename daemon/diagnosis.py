"""The diagnosis: evidence in, a verdict out, with the numbers and rules that decided it.

Pure: imports no subprocess, SSH or SQL. `diagnose` is implemented below the types. It gives
a verdict for any well-typed evidence: a figure beyond its plausible range is set aside with a
reason before any arithmetic, so no input ends in an exception or an unstorable record.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from daemon.evidence.oom import host_ram_is_certain
from daemon.evidence.records import (
    MAX_GPU_INDEX,
    MAX_PID,
    MAX_RANK,
    MAX_STEP,
    Evidence,
    LogFindings,
    OomFamily,
    OomReport,
    OtherProcess,
    Phase,
    ProbeVerdict,
    XidPolicy,
)
from daemon.evidence.units import MAX_BYTES, format_size
from daemon.slurm.records import JobState


class FailureKind(StrEnum):
    """What killed the job; each kind has its own remediation ladder."""

    HARDWARE = "hardware"
    COTENANT = "cotenant"
    HOST_RAM = "host_ram"
    FRAGMENTATION = "fragmentation"
    TRUE_OOM = "true_oom"
    WORKSPACE_SPIKE = "workspace_spike"
    OPTIMIZER_BURST = "optimizer_burst"
    EVAL_GROWTH = "eval_growth"
    NOT_OOM = "not_oom"
    UNKNOWN = "unknown"


class Onset(StrEnum):
    """Step 0 means static sizing is wrong; mid-run means something grew or a batch was longer."""

    STEP0 = "step0"
    MID_RUN = "mid_run"


class MidRunCause(StrEnum):
    """Why a run that had been stepping ran out later."""

    LONGEST_BATCH = "longest_batch"
    GROWTH = "growth"
    OPTIMIZER_STATE = "optimizer_state"


class Confidence(StrEnum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


@dataclass(frozen=True)
class Diagnosis:
    """The verdict on one failure: kind, where and when, and reasons a person can check."""

    kind: FailureKind
    confidence: Confidence
    reasons: tuple[str, ...]
    onset: Onset | None = None
    mid_run_cause: MidRunCause | None = None
    rank: int | None = None
    node: str | None = None
    step: int | None = None
    phase: Phase = Phase.UNKNOWN
    oom: OomReport | None = None
    bad_nodes: tuple[str, ...] = ()  # nodes to exclude (hardware, co-tenant)
    cotenant_pids: tuple[int, ...] = ()

    @property
    def is_oom(self) -> bool:
        return self.kind not in (FailureKind.NOT_OOM, FailureKind.UNKNOWN)


@dataclass(frozen=True)
class History:
    """Earlier diagnoses of the same lineage, oldest first: tells repeat failures and growth."""

    earlier: tuple[Diagnosis, ...] = ()


# Thresholds. Each says why it has the value it has.
# The allocator frees its unsplit cached blocks and retries before raising, so an OOM with more
# reserved-but-unallocated bytes than the request means the cache was split into pieces too
# small for it: fragmentation. At twice the request there is no doubt left.
FRAGMENTATION_RATIO = 1.0
FRAGMENTATION_HIGH_RATIO = 2.0
# ...but a few hundred MiB unallocated on a full 80 GiB card is not what killed it: require the
# unallocated part to be a noticeable share of the card before blaming fragmentation.
FRAGMENTATION_MIN_SHARE = 0.05
# Printed sizes are rounded to 0.01 of their unit (up to 5 MiB each for GiB figures) and the
# allocator rounds requests up to 2 MiB; free memory beyond request + this margin is real.
FREE_EXCESS_MARGIN_BYTES = 32 * 1024 * 1024
# A CUDA context alone holds ~300-500 MiB; other processes holding more than this on our GPU
# are doing real work there (a co-tenant), not leftovers.
COTENANT_MIN_BYTES = 512 * 1024 * 1024
# Several small holders look like a job's own ranks each opening a context on one GPU.
STRAY_CONTEXT_MIN_COUNT = 3
STRAY_CONTEXT_MAX_BYTES = 1024 * 1024 * 1024
# A single request of this share of the card inside attention/matmul/conv/MoE frames is a
# workspace spike rather than the model's steady state.
WORKSPACE_SPIKE_SHARE = 0.10
WORKSPACE_SPIKE_MIN_BYTES = 1024 * 1024 * 1024  # when the card's capacity is unknown
# Adam-style optimizers allocate their state at the first optimizer.step: an OOM at step 1-2
# is that state arriving, not data or growth.
OPTIMIZER_STATE_MAX_STEP = 2
# A failed request this small, on a full card, late in the run: memory crept up (growth); a
# large one is a batch bigger than any before (longest batch).
GROWTH_MAX_REQUEST_SHARE = 0.02
# Memory neither free nor in PyTorch's cache beyond this share of the card is worth naming.
OUTSIDE_CACHE_SHARE = 0.25


def diagnose(evidence: Evidence, history: History | None = None) -> Diagnosis:
    """Decide what killed the job, following the runbooks, and say which numbers decided it."""
    history = history or History()
    evidence, set_aside = _within_ranges(evidence)
    log = evidence.log
    context = _Context(evidence, history, tuple(set_aside))
    for rule in (_hardware, _cotenant, _host_ram, _gpu_oom, _not_oom):
        verdict = rule(context)
        if verdict is not None:
            return verdict
    reasons = ["no out-of-memory message, traceback or Slurm record explains the failure"]
    reasons.extend(log.notes)
    return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)


def _within_ranges(evidence: Evidence) -> tuple[Evidence, list[str]]:
    """The evidence with each figure beyond its plausible range dropped, and a reason for each.

    The parsers drop such figures already; evidence read back from the store or built by other
    code is held to the same ranges here, so the verdict's record fits the store's columns.
    """
    reasons: list[str] = []

    def keep(value: int | None, low: int, high: int, what: str) -> int | None:
        if value is None or low <= value <= high:
            return value
        reasons.append(f"{what} {_short(value)} is outside {low}..{high}: set aside")
        return None

    def size(value: int | None, what: str) -> int | None:
        return keep(value, 0, MAX_BYTES, f"{what} bytes")

    log = evidence.log
    oom = log.oom
    if oom is not None:
        reasons.extend(oom.notes)
        others = tuple(
            process
            for process in oom.other_processes
            if 0 <= process.pid <= MAX_PID and 0 <= process.bytes <= MAX_BYTES
        )
        if len(others) < len(oom.other_processes):
            reasons.append("other processes with an impossible pid or size: set aside")
        oom = replace(
            oom,
            requested_bytes=size(oom.requested_bytes, "requested"),
            total_bytes=size(oom.total_bytes, "total"),
            free_bytes=size(oom.free_bytes, "free"),
            allocated_bytes=size(oom.allocated_bytes, "allocated"),
            reserved_bytes=size(oom.reserved_bytes, "reserved"),
            reserved_unallocated_bytes=size(oom.reserved_unallocated_bytes, "unallocated"),
            process_in_use_bytes=size(oom.process_in_use_bytes, "process in use"),
            private_pool_bytes=size(oom.private_pool_bytes, "private pool"),
            gpu_index=keep(oom.gpu_index, 0, MAX_GPU_INDEX, "GPU index"),
            other_processes=others,
        )
    log = replace(
        log,
        rank=keep(log.rank, -MAX_RANK, MAX_RANK, "rank"),
        step=keep(log.step, 0, MAX_STEP, "step"),
        max_step_seen=keep(log.max_step_seen, 0, MAX_STEP, "highest step"),
        oom=oom,
    )
    return replace(evidence, log=log), reasons


def _short(value: int) -> str:
    """A number as a reason can quote it: one of thousands of digits is only described."""
    return str(value) if value.bit_length() <= 128 else f"(a {value.bit_length()}-bit number)"


@dataclass(frozen=True)
class _Context:
    evidence: Evidence
    history: History
    set_aside: tuple[str, ...] = ()  # figures out of range, said in every verdict

    @property
    def log(self) -> LogFindings:
        return self.evidence.log

    @property
    def node(self) -> str | None:
        if self.log.node is not None:
            return self.log.node
        job = self.evidence.job
        if job is not None and len(job.nodes) == 1:
            return job.nodes[0]
        return None

    def verdict(
        self,
        kind: FailureKind,
        confidence: Confidence,
        reasons: list[str],
        **extra: Any,
    ) -> Diagnosis:
        log = self.log
        return Diagnosis(
            kind=kind,
            confidence=confidence,
            reasons=(*reasons, *self.set_aside),
            rank=log.rank,
            node=self.node,
            step=log.step,
            phase=log.phase,
            oom=log.oom,
            **extra,
        )


def _hardware(context: _Context) -> Diagnosis | None:
    probe = context.evidence.probe
    if probe is None or (context.node is not None and probe.node != context.node):
        return None
    reasons: list[str] = []
    for event in probe.xid_events:
        if event.policy is XidPolicy.HARDWARE:  # the operator-editable XID catalog decides
            reasons.append(f"XID {event.code} on {probe.node}: {event.meaning}")
    for gpu in probe.gpus:
        if gpu.remap_pending:
            reasons.append(f"GPU {gpu.index} on {probe.node} has a row remap pending")
        if gpu.remap_failure_occurred:
            reasons.append(f"GPU {gpu.index} on {probe.node} failed to remap a row")
        if gpu.ecc_volatile_uncorrectable:
            reasons.append(
                f"GPU {gpu.index} on {probe.node} has {gpu.ecc_volatile_uncorrectable}"
                " uncorrectable ECC errors since boot"
            )
    if not reasons and probe.verdict is ProbeVerdict.FAULTY:
        reasons.extend(probe.reasons or (f"the probe found {probe.node} faulty",))
    if not reasons:
        return None
    reasons.append(
        f"drain {probe.node} and relaunch without it; the job's memory was not the cause"
    )
    return context.verdict(FailureKind.HARDWARE, Confidence.HIGH, reasons, bad_nodes=(probe.node,))


def _cotenant(context: _Context) -> Diagnosis | None:
    """Other processes on the job's GPU: from the OOM message (as it failed) or the probe."""
    oom = context.log.oom
    own = set(context.log.job_pids)
    reasons: list[str] = []
    listed: list[OtherProcess] = []
    if oom is not None and oom.family is OomFamily.TORCH_ALLOCATOR:
        for process in oom.other_processes:
            if process.pid in own or _is_self_in_container(oom, process.bytes):
                continue
            if process.bytes >= COTENANT_MIN_BYTES:
                listed.append(process)
                reasons.append(
                    f"process {process.pid} held {format_size(process.bytes)} on the same GPU"
                )
    pids = [process.pid for process in listed]
    probe_reasons, probe_pids, scoped = _probe_cotenants(context, own | set(pids))
    reasons.extend(probe_reasons)
    pids.extend(probe_pids)
    if not reasons:
        return None
    confidence = Confidence.MEDIUM if listed or scoped else Confidence.LOW
    if not scoped and probe_pids:
        reasons.append("the job's GPUs are not known: every GPU of the node was counted")
    if len(listed) >= STRAY_CONTEXT_MIN_COUNT and all(
        p.bytes < STRAY_CONTEXT_MAX_BYTES for p in listed
    ):
        reasons.append(
            f"{len(listed)} processes hold under {format_size(STRAY_CONTEXT_MAX_BYTES)} each:"
            " if they are this job's other ranks, they opened a CUDA context on this GPU"
            " (set the device before any CUDA call)"
        )
    elif (
        oom is not None
        and oom.requested_bytes is not None
        and listed
        and sum(p.bytes for p in listed) >= oom.requested_bytes
    ):
        confidence = Confidence.HIGH
        reasons.append(
            f"without them the {format_size(oom.requested_bytes)} request would have fit"
        )
    node = context.node
    reasons.append("exclude the node and report the process; do not cut the batch")
    return context.verdict(
        FailureKind.COTENANT,
        confidence,
        reasons,
        bad_nodes=(node,) if node else (),
        cotenant_pids=tuple(pid for pid in pids if pid >= 0),
    )


def _probe_cotenants(context: _Context, known: set[int]) -> tuple[list[str], list[int], bool]:
    """Compute apps still holding memory on the failing node's GPUs after the job died."""
    probe = context.evidence.probe
    if probe is None or (context.node is not None and probe.node != context.node):
        return [], [], False
    wanted = set(context.evidence.job_gpu_uuids)
    reasons: list[str] = []
    pids: list[int] = []
    for gpu in probe.gpus:
        for app in gpu.compute_apps:
            if wanted and app.gpu_uuid not in wanted:
                continue
            used = app.used_bytes
            if app.pid in known or used is None or not COTENANT_MIN_BYTES <= used <= MAX_BYTES:
                continue
            pids.append(app.pid if app.pid is not None else -1)
            reasons.append(
                f"after the job died, {app.process_name or 'an unnamed process'}"
                f" (pid {app.pid}) still held {format_size(used)}"
                f" on GPU {gpu.index} of {probe.node}"
            )
    return reasons, pids, bool(wanted)


def _is_self_in_container(oom: OomReport, process_bytes: int) -> bool:
    """In a container torch cannot match its own pid, and lists itself as `Process N`."""
    if oom.process_in_use_bytes is not None or oom.reserved_bytes is None:
        return False
    return process_bytes >= oom.reserved_bytes


def _host_ram(context: _Context) -> Diagnosis | None:
    log = context.log
    job = context.evidence.job
    reasons: list[str] = []
    certain = False
    if log.oom is not None and log.oom.family is OomFamily.HOST_RAM:
        certain = host_ram_is_certain(log.oom.message)
        reasons.append(f"the log says: {_quote(log.oom.message)}")
    gpu_oom = log.oom is not None and log.oom.family is not OomFamily.HOST_RAM
    if gpu_oom:
        return None
    if job is not None and job.state is JobState.OUT_OF_MEMORY:
        certain = True
        reasons.append(f"Slurm ended job {job.display_id} as OUT_OF_MEMORY (its memory cgroup)")
    probe = context.evidence.probe
    if probe is not None and probe.host_oom_kills:
        certain = True
        kill = probe.host_oom_kills[0]
        reasons.append(
            f"the kernel on {probe.node} OOM-killed {kill.process_name} (pid {kill.pid})"
        )
    killed = log.killed_by_signal == 9 or log.exit_code in (137, -9)
    if job is not None and (job.exit_signal == 9 or job.exit_code == 137):
        killed = True
    if killed and not log.traceback_seen and not reasons:
        reasons.append("killed by SIGKILL (exit 137 / signal 9) with no Python traceback")
    if not reasons:
        return None
    reasons.append("lower the data loader workers or host-side buffers; do not touch the model")
    return context.verdict(
        FailureKind.HOST_RAM, Confidence.HIGH if certain else Confidence.MEDIUM, reasons
    )


def _gpu_oom(context: _Context) -> Diagnosis | None:
    oom = context.log.oom
    if oom is None or oom.family is OomFamily.HOST_RAM:
        return None
    reasons = [f"{_family_words(oom)}: {_quote(oom.message)}"]
    requested, free = oom.requested_bytes, oom.free_bytes
    if requested is not None and free is not None and free > requested + FREE_EXCESS_MARGIN_BYTES:
        reasons.append(
            f"the driver still had {format_size(free)} free, more than the"
            f" {format_size(requested)} asked for: neither capacity nor fragmentation explains it"
        )
        reasons.append(
            "look for a per-process memory fraction cap, a MIG slice smaller than the card,"
            " or another process that raced for the memory"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    fragmentation = _fragmentation(oom)
    if fragmentation is not None:
        ratio, share_text = fragmentation
        reasons.append(
            f"{format_size(oom.reserved_unallocated_bytes or 0)} reserved but unallocated is"
            f" {ratio:.1f}x the {format_size(requested or 0)} request{share_text}: fragmentation"
        )
        reasons.append("set expandable_segments:True before any batch change")
        return context.verdict(
            FailureKind.FRAGMENTATION,
            Confidence.HIGH if ratio >= FRAGMENTATION_HIGH_RATIO else Confidence.MEDIUM,
            reasons,
        )
    reasons.extend(_capacity_reasons(oom))
    phase = context.log.phase
    if phase is Phase.OPTIMIZER_STEP:
        reasons.append("it ran out inside optimizer.step: optimizer state or its update burst")
        return context.verdict(FailureKind.OPTIMIZER_BURST, _numbers_confidence(oom), reasons)
    if phase is Phase.EVAL:
        reasons.append("it ran out in evaluation or generation: eval batch or KV cache growth")
        return context.verdict(FailureKind.EVAL_GROWTH, _numbers_confidence(oom), reasons)
    spike = _workspace_spike(context, oom)
    if spike is not None:
        reasons.append(spike)
        return context.verdict(FailureKind.WORKSPACE_SPIKE, _numbers_confidence(oom), reasons)
    return _true_oom(context, oom, reasons)


def _fragmentation(oom: OomReport) -> tuple[float, str] | None:
    unallocated, requested = oom.reserved_unallocated_bytes, oom.requested_bytes
    if unallocated is None or not requested:
        return None
    ratio = unallocated / requested
    if ratio < FRAGMENTATION_RATIO:
        return None
    base = oom.total_bytes or oom.reserved_bytes
    if base:
        share = unallocated / base
        if share < FRAGMENTATION_MIN_SHARE:
            return None
        return ratio, f" and {share:.0%} of the {format_size(base)} card"
    return ratio, ""


def _capacity_reasons(oom: OomReport) -> list[str]:
    reasons: list[str] = []
    unallocated, requested = oom.reserved_unallocated_bytes, oom.requested_bytes
    if requested is not None and oom.total_bytes and requested > oom.total_bytes:
        reasons.append(
            f"the {format_size(requested)} request alone is larger than the whole"
            f" {format_size(oom.total_bytes)} card: one tensor of an impossible size"
        )
    if requested is not None and unallocated is not None:
        if unallocated < requested:
            reasons.append(
                f"only {format_size(unallocated)} reserved but unallocated against the"
                f" {format_size(requested)} request: not fragmentation"
            )
        elif requested == 0:
            reasons.append(
                f"the failed request was for 0 bytes, with {format_size(unallocated)} reserved"
                " but unallocated: the figures cannot tell fragmentation from a full card"
            )
        else:
            reasons.append(
                f"{format_size(unallocated)} reserved but unallocated is"
                f" {unallocated / requested:.1f}x the {format_size(requested)} request, but too"
                " small a share of the card to be what filled it: not fragmentation"
            )
    if oom.total_bytes and oom.free_bytes is not None and oom.reserved_bytes is not None:
        elsewhere = oom.total_bytes - oom.free_bytes - oom.reserved_bytes
        if elsewhere >= oom.total_bytes * OUTSIDE_CACHE_SHARE:
            reasons.append(
                f"{format_size(elsewhere)} of the card was neither free nor in PyTorch's cache:"
                " another process or non-PyTorch memory held it"
            )
    if oom.private_pool_bytes:
        reasons.append(
            f"{format_size(oom.private_pool_bytes)} of it sat in private pools (CUDA graphs)"
        )
    if oom.total_bytes and oom.allocated_bytes is not None:
        reasons.append(
            f"PyTorch held {format_size(oom.allocated_bytes)} of the"
            f" {format_size(oom.total_bytes)} card ({oom.allocated_bytes / oom.total_bytes:.0%})"
        )
    return reasons


def _numbers_confidence(oom: OomReport) -> Confidence:
    if not oom.requested_bytes:  # none printed, or 0 bytes: no size to weigh the others against
        return Confidence.LOW
    return Confidence.HIGH if oom.reserved_unallocated_bytes is not None else Confidence.MEDIUM


def _workspace_spike(context: _Context, oom: OomReport) -> str | None:
    kernels = context.log.heavy_kernels
    if oom.family in (OomFamily.CUBLAS, OomFamily.CUDNN) and not kernels:
        kernels = ("cublas_matmul",) if oom.family is OomFamily.CUBLAS else ("cudnn_conv",)
    if not kernels:
        return None
    requested = oom.requested_bytes
    if requested is None:
        if oom.family in (OomFamily.CUBLAS, OomFamily.CUDNN):
            return f"{oom.family.value} could not allocate its workspace"
        return None
    threshold = (
        oom.total_bytes * WORKSPACE_SPIKE_SHARE if oom.total_bytes else WORKSPACE_SPIKE_MIN_BYTES
    )
    if requested < threshold:
        return None
    where = ", ".join(kernels)
    share = f" ({requested / oom.total_bytes:.0%} of the card)" if oom.total_bytes else ""
    return (
        f"a single {format_size(requested)} request{share} inside {where} frames: workspace spike"
    )


def _true_oom(context: _Context, oom: OomReport, reasons: list[str]) -> Diagnosis:
    step = context.log.step
    confidence = _numbers_confidence(oom)
    if step is None or step <= 0:
        if step is None:
            reasons.append(
                "no training step was logged before it: taken as the first step, where the"
                " static sizing does not fit"
            )
        else:
            reasons.append("it failed at the first step: the static sizing does not fit")
        return context.verdict(FailureKind.TRUE_OOM, confidence, reasons, onset=Onset.STEP0)
    cause = _mid_run_cause(oom, step)
    reasons.append(_CAUSE_WORDS[cause].format(step=step))
    earlier = [d for d in context.history.earlier if d.is_oom and d.step is not None]
    if earlier:
        previous = earlier[-1]
        reasons.append(
            f"this lineage failed before at step {previous.step} ({previous.kind.value})"
        )
    return context.verdict(
        FailureKind.TRUE_OOM, confidence, reasons, onset=Onset.MID_RUN, mid_run_cause=cause
    )


_CAUSE_WORDS = {
    MidRunCause.OPTIMIZER_STATE: (
        "it failed at step {step}, right after the first optimizer step allocated its state"
    ),
    MidRunCause.GROWTH: (
        "it failed at step {step} on a small request with the card full: memory grew over the run"
    ),
    MidRunCause.LONGEST_BATCH: (
        "it failed at step {step} on a large request: a batch longer than any before it"
    ),
}


def _mid_run_cause(oom: OomReport, step: int) -> MidRunCause:
    if step <= OPTIMIZER_STATE_MAX_STEP:
        return MidRunCause.OPTIMIZER_STATE
    small_request = (
        oom.requested_bytes is not None
        and bool(oom.total_bytes)
        and oom.requested_bytes <= (oom.total_bytes or 0) * GROWTH_MAX_REQUEST_SHARE
    )
    return MidRunCause.GROWTH if small_request else MidRunCause.LONGEST_BATCH


def _not_oom(context: _Context) -> Diagnosis | None:
    log = context.log
    if log.root_failure_line is None:
        job = context.evidence.job
        if job is not None and job.state in (JobState.NODE_FAIL, JobState.TIMEOUT):
            return context.verdict(
                FailureKind.NOT_OOM,
                Confidence.HIGH,
                [f"Slurm ended job {job.display_id} as {job.state.value}, not out of memory"],
            )
        return None
    reasons = [f"the first failure was not out of memory: {_quote(log.root_failure_line)}"]
    reasons.extend(note for note in log.notes if note.startswith("only collective"))
    if log.cascade_ranks:
        ranks = ", ".join(str(rank) for rank in log.cascade_ranks)
        reasons.append(f"ranks {ranks} failed after it, as a cascade")
    return context.verdict(FailureKind.NOT_OOM, Confidence.MEDIUM, reasons)


def _family_words(oom: OomReport) -> str:
    return {
        OomFamily.TORCH_ALLOCATOR: "PyTorch's allocator ran out of GPU memory",
        OomFamily.CUDA_RUNTIME: "the CUDA runtime ran out of GPU memory",
        OomFamily.CUBLAS: "cuBLAS could not allocate GPU memory",
        OomFamily.CUDNN: "cuDNN could not allocate GPU memory",
        OomFamily.NCCL: "NCCL could not allocate GPU memory",
        OomFamily.XLA: "XLA ran out of device memory",
        OomFamily.HOST_RAM: "the host ran out of RAM",
    }[oom.family]


def _quote(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return f'"{text[: limit - 3]}..."' if len(text) > limit else f'"{text}"'
