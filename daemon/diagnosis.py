"""The diagnosis: evidence in, a verdict out, with the numbers and rules that decided it.

Pure: imports no subprocess, SSH or SQL. `diagnose` is implemented below the types. It gives
a verdict for any well-typed evidence: a figure beyond its plausible range is set aside with a
reason before any arithmetic, so no input ends in an exception or an unstorable record.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from daemon.evidence.findings import OUTSIDE_ALLOCATION
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
    RootCause,
    XidPolicy,
)
from daemon.evidence.units import GIB, MAX_BYTES, format_size, rounding_error
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
    # The node probe itself showed the fault (XID, remap, ECC). Only then is a node drained: a
    # job's log is the job's own text, and anyone can print an Xid line.
    probe_confirmed: bool = False
    cotenant_pids: tuple[int, ...] = ()
    root_cause: RootCause | None = None  # the log's earliest root failure; None: none shown
    root_cause_line: str | None = None  # the log line that shows it

    @property
    def is_oom(self) -> bool:
        return self.kind not in (FailureKind.NOT_OOM, FailureKind.UNKNOWN)


@dataclass(frozen=True)
class History:
    """Earlier diagnoses of the same lineage, oldest first: tells repeat failures and growth."""

    earlier: tuple[Diagnosis, ...] = ()


# Thresholds. Each says why it has the value it has.
# The fragmentation rule (the runbooks', and the allocator's own hint) has no thresholds: with X
# the request, F the driver-free and U the reserved-but-unallocated bytes, F + U >= X means the
# bytes existed. Its margin F + U - X only sets the confidence: within the printed figures'
# rounding it may be rounding alone (low); below the request again it is thin (medium).
# Beyond any device: twice the largest accelerator memory sold today (288 GB, B300 / MI355X).
# One allocation lives on one device, so a request beyond this is a size bug in the program
# (an overflowed or mis-multiplied shape), not memory pressure (tests/data/real/oom/146:
# 573.65 GiB asked of a 40 GB card).
BEYOND_ANY_DEVICE_BYTES = 512 * GIB
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
    """Decide what killed the job, following the runbooks, and say which numbers decided it.

    The node probe's findings come first, then what the job's log shows as its earliest root
    failure (a GPU fault, the host's RAM, a collective timeout alone, the device's memory by
    the fragmentation rule, another error), then Slurm's own record.
    """
    history = history or History()
    evidence, set_aside = _within_ranges(evidence)
    log = evidence.log
    context = _Context(evidence, history, tuple(set_aside), _root_cause(log))
    for rule in (
        _hardware,
        _probe_cotenant,
        _host_ram,
        _collective_timeout,
        _gpu_oom,
        _not_oom,
    ):
        verdict = rule(context)
        if verdict is not None:
            return verdict
    reasons = ["no out-of-memory message, traceback or Slurm record explains the failure"]
    reasons.extend(log.notes)
    return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)


def _root_cause(log: LogFindings) -> RootCause | None:
    """The log's root cause: the scanner's, or for findings without one (stored before it
    had the field, or built by hand) what their failure line and OOM report show."""
    if log.root_cause is not None:
        return log.root_cause
    if log.gpu_fault is not None:
        return RootCause.GPU_FAULT
    if log.oom is not None:
        host = log.oom.family is OomFamily.HOST_RAM
        return RootCause.HOST_RAM if host else RootCause.ACCELERATOR_OOM
    if log.root_failure_line is None:
        return None
    if any(note.startswith("only collective") for note in log.notes):
        return RootCause.COLLECTIVE_TIMEOUT
    return RootCause.OTHER_ERROR


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
            allowed_bytes=size(oom.allowed_bytes, "allowed"),
            other_allocations_bytes=size(oom.other_allocations_bytes, "other allocations"),
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
    root_cause: RootCause | None = None  # the log's, see `_root_cause`

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
            root_cause=self.root_cause,
            root_cause_line=self.root_cause_line,
            **extra,
        )

    @property
    def root_cause_line(self) -> str | None:
        """The line that shows the log's root cause, as the scanner kept it."""
        if self.root_cause is None:
            return None
        log = self.log
        if self.root_cause is RootCause.GPU_FAULT and log.gpu_fault is not None:
            return log.gpu_fault.line
        if log.root_failure_line is not None:
            return log.root_failure_line
        return None if log.oom is None else log.oom.message


def _hardware(context: _Context) -> Diagnosis | None:
    """The probe's faults on the failing node first; then a GPU fault the job's log shows."""
    probe = context.evidence.probe
    probe_reasons = _probe_faults(context)
    fault = _log_fault(context)
    if not probe_reasons and fault is None:
        return None
    reasons = list(probe_reasons)
    if fault is not None:
        reasons.append(fault)
    if probe is not None and probe_reasons:
        node: str | None = probe.node
        confidence = Confidence.HIGH
    elif probe is not None and (context.node is None or probe.node == context.node):
        # The node was probed and showed nothing: an illegal memory access is as often a bug
        # in a kernel as a failing GPU, so nothing is drained on the log's word alone.
        reasons.append(
            f"the probe of {probe.node} found no XID, row remap or ECC fault: the fault may be"
            " the program's (a bad kernel, an out-of-bounds index), not the GPU's"
        )
        reasons.append("relaunch with CUDA_LAUNCH_BLOCKING=1 to see where; drain nothing yet")
        return context.verdict(FailureKind.HARDWARE, Confidence.LOW, reasons)
    else:
        node = context.node
        confidence = Confidence.MEDIUM
        reasons.append("no node probe confirmed it")
    if node is None:
        reasons.append(
            "the log does not say which node: probe the job's nodes before draining any;"
            " the job's memory was not the cause"
        )
        return context.verdict(FailureKind.HARDWARE, confidence, reasons)
    confirmed = probe is not None and bool(probe_reasons)
    if confirmed:
        reasons.append(f"drain {node} and relaunch without it; the job's memory was not the cause")
    else:
        reasons.append(
            f"relaunch without {node}; it is drained only if a probe of the node confirms the"
            " fault (the log alone is the job's own text)"
        )
    return context.verdict(
        FailureKind.HARDWARE, confidence, reasons, bad_nodes=(node,), probe_confirmed=confirmed
    )


def _probe_faults(context: _Context) -> list[str]:
    probe = context.evidence.probe
    if probe is None or (context.node is not None and probe.node != context.node):
        return []
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
    return reasons


def _log_fault(context: _Context) -> str | None:
    """A GPU fault as the log's root failure, in the XID catalog's words where it printed one."""
    if context.root_cause is not RootCause.GPU_FAULT:
        return None
    fault = context.log.gpu_fault
    line = context.root_cause_line
    if fault is None:
        return None if line is None else f"the job's log shows a GPU fault: {_quote(line)}"
    reason = f"the job's log shows a GPU fault: {_quote(fault.line)}"
    if fault.xid is not None:
        return f"{reason} (XID {fault.xid}: {fault.words})"
    return f"{reason} ({fault.words})" if fault.words else reason


def _probe_cotenant(context: _Context) -> Diagnosis | None:
    """Processes still holding memory on the job's GPUs after it died, as the probe saw them;
    the message's own list of processes joins them."""
    own = set(context.log.job_pids)
    probe_reasons, probe_pids, scoped = _probe_cotenants(context, own)
    if not probe_reasons:
        return None
    listed = _listed_cotenants(context)
    reasons = [_holder_words(process) for process in listed] + probe_reasons
    pids = [process.pid for process in listed]
    pids.extend(pid for pid in probe_pids if pid not in pids)
    confidence = Confidence.MEDIUM if scoped or listed else Confidence.LOW
    if not scoped:
        reasons.append("the job's GPUs are not known: every GPU of the node was counted")
    return _cotenant_verdict(context, confidence, reasons, pids)


def _message_cotenant(context: _Context, oom: OomReport, reasons: list[str]) -> Diagnosis | None:
    """Other processes the OOM message lists on the GPU, when the rule says it was full."""
    listed = _listed_cotenants(context)
    if not listed:
        return None
    reasons = [*reasons, *(_holder_words(process) for process in listed)]
    confidence = Confidence.MEDIUM
    held = sum(process.bytes for process in listed)
    if len(listed) >= STRAY_CONTEXT_MIN_COUNT and all(
        p.bytes < STRAY_CONTEXT_MAX_BYTES for p in listed
    ):
        reasons.append(
            f"{len(listed)} processes hold under {format_size(STRAY_CONTEXT_MAX_BYTES)} each:"
            " if they are this job's other ranks, they opened a CUDA context on this GPU"
            " (set the device before any CUDA call)"
        )
    elif (
        oom.requested_bytes is not None
        and held + (oom.free_bytes or 0) + (oom.reserved_unallocated_bytes or 0)
        >= oom.requested_bytes
    ):
        confidence = Confidence.HIGH
        reasons.append(
            f"without them the {format_size(oom.requested_bytes)} request would have fit"
        )
    return _cotenant_verdict(context, confidence, reasons, [p.pid for p in listed])


def _cotenant_verdict(
    context: _Context, confidence: Confidence, reasons: list[str], pids: list[int]
) -> Diagnosis:
    node = context.node
    reasons.append("exclude the node and report the process; do not cut the batch")
    return context.verdict(
        FailureKind.COTENANT,
        confidence,
        reasons,
        bad_nodes=(node,) if node else (),
        cotenant_pids=tuple(pid for pid in pids if pid >= 0),
    )


def _listed_cotenants(context: _Context) -> list[OtherProcess]:
    """The `Process N has X memory in use` entries that are neither the job nor leftovers."""
    oom = context.log.oom
    if oom is None or oom.family is not OomFamily.TORCH_ALLOCATOR:
        return []
    own = set(context.log.job_pids)
    return [
        process
        for process in oom.other_processes
        if process.pid not in own
        and not _is_self_in_container(oom, process.bytes)
        and process.bytes >= COTENANT_MIN_BYTES
    ]


def _holder_words(process: OtherProcess) -> str:
    return f"process {process.pid} held {format_size(process.bytes)} on the same GPU"


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
    root = context.root_cause
    if root in (RootCause.ACCELERATOR_OOM, RootCause.GPU_FAULT):
        return None
    reasons: list[str] = []
    certain = False
    if root is RootCause.HOST_RAM:
        line = context.root_cause_line or ""
        certain = host_ram_is_certain(line)
        reasons.append(f"the log's first failure is the host's RAM: {_quote(line)}")
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
    if killed and not log.traceback_seen and not reasons and root is None:
        reasons.append("killed by SIGKILL (exit 137 / signal 9) with no Python traceback")
    if not reasons:
        return None
    reasons.append("lower the data loader workers or host-side buffers; do not touch the model")
    return context.verdict(
        FailureKind.HOST_RAM, Confidence.HIGH if certain else Confidence.MEDIUM, reasons
    )


def _collective_timeout(context: _Context) -> Diagnosis | None:
    if context.root_cause is not RootCause.COLLECTIVE_TIMEOUT:
        return None
    reasons = [
        "only a collective timeout is in view: the root failure is elsewhere (another rank's"
        " log, or earlier than the part read)",
    ]
    if (line := context.root_cause_line) is not None:
        reasons.append(f"the first one: {_quote(line)}")
    if context.log.cascade_ranks:
        ranks = ", ".join(str(rank) for rank in context.log.cascade_ranks)
        reasons.append(f"ranks {ranks} timed out too")
    return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)


def _gpu_oom(context: _Context) -> Diagnosis | None:
    oom = context.log.oom
    if oom is None or oom.family is OomFamily.HOST_RAM:
        line = context.root_cause_line
        if context.root_cause is RootCause.ACCELERATOR_OOM and line:
            reasons = [
                f"the log's first failure is out of device memory: {_quote(line)}",
                "but no figures were read from it: nothing to weigh",
            ]
            return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
        return None
    reasons = [f"{_family_words(oom)}: {_quote(oom.message)}"]
    if oom.family in _SIZING_WORDS:
        # no allocator figures: nothing the training loop's batch levers can be weighed on
        reasons.extend(_SIZING_WORDS[oom.family])
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if oom.family is OomFamily.TORCH_ALLOCATOR:
        verdict = _fragmentation_rule(context, oom, reasons)
        if verdict is not None:
            return verdict
    elif oom.request_beyond_any_device:
        return _size_bug(context, oom, reasons)
    verdict = _message_cotenant(context, oom, reasons)
    if verdict is not None:
        return verdict
    reasons.extend(_capacity_reasons(oom))
    phase = context.log.phase
    if phase is Phase.OPTIMIZER_STEP:
        reasons.append("it ran out inside optimizer.step: optimizer state or its update burst")
        return context.verdict(FailureKind.OPTIMIZER_BURST, _numbers_confidence(oom), reasons)
    if phase in (Phase.EVAL, Phase.GENERATE):
        reasons.append("it ran out in evaluation or generation: eval batch or KV cache growth")
        return context.verdict(FailureKind.EVAL_GROWTH, _numbers_confidence(oom), reasons)
    spike = _workspace_spike(context, oom)
    if spike is not None:
        reasons.append(spike)
        return context.verdict(FailureKind.WORKSPACE_SPIKE, _numbers_confidence(oom), reasons)
    return _true_oom(context, oom, reasons)


# Out-of-memory families that print no allocator figures and whose cause is not the training
# loop's memory: what they mean and where to look, since nothing is proposed for them.
_SIZING_WORDS: dict[OomFamily, tuple[str, ...]] = {
    OomFamily.KV_CACHE: (
        "the engine sizes its KV cache from the GPU memory left after the model's weights, and"
        " none (or too little for one request) was left: its memory share, max model length,"
        " the model's size or another process on the GPU decides it, not a training batch",
        "raise the engine's share (vLLM `gpu_memory_utilization`, SGLang"
        " `--mem-fraction-static`) or lower its `max_model_len`; nothing is proposed",
    ),
    OomFamily.LIBRARY_HANDLE: (
        "cublasCreate and cudnnCreate allocate on the device, so a failed handle is most often a"
        " device out of memory; a CUDA or cuDNN build that does not fit the card reads the same:"
        " weak evidence, with no figures to weigh",
        "check the card's memory at that point (another process, the run's own peak) and the"
        " CUDA/cuDNN install; nothing is proposed",
    ),
}


def _fragmentation_rule(context: _Context, oom: OomReport, reasons: list[str]) -> Diagnosis | None:
    """The runbooks' rule on PyTorch's figures; None where it says true OOM (the caller goes on).

    With X the request, F the driver-free and U the reserved-but-unallocated bytes: X beyond
    any device is a size bug; X larger than the card a single tensor the device cannot hold;
    F >= X leaves nothing to explain it; U >= X or F + U >= X is fragmentation (unless the run
    already had expandable segments); a figure missing leaves the rule undecided.
    """
    requested, total = oom.requested_bytes, oom.total_bytes
    free, unallocated = oom.free_bytes, oom.reserved_unallocated_bytes
    if oom.request_beyond_any_device or (
        requested is not None and requested > BEYOND_ANY_DEVICE_BYTES
    ):
        return _size_bug(context, oom, reasons)
    if oom.other_allocations_bytes is not None:
        return _mps_watermark(context, oom, reasons)
    if not requested:
        reasons.append(
            "the message gives no request (or 0 bytes) to weigh the other figures against:"
            " the rule cannot tell fragmentation from a full card"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if total is not None and requested > total:
        reasons.append(
            f"the {format_size(requested)} request alone is larger than the whole"
            f" {format_size(total)} card: a single tensor bigger than the device; batch levers"
            " at the same geometry may not help (split, shard or shorten what makes it)"
        )
        return _true_oom(context, oom, reasons)
    if free is not None and free >= requested:
        more = "more than" if free > requested else "as much as"
        reasons.append(
            f"the driver still had {format_size(free)} free, {more} the"
            f" {format_size(requested)} asked for: neither capacity nor fragmentation explains it"
        )
        if oom.allowed_bytes is not None:
            reasons.append(
                f"the message prints {format_size(oom.allowed_bytes)} allowed: a per-process"
                " memory fraction cap (torch.cuda.set_per_process_memory_fraction) refused it"
                " below the card's capacity"
            )
        else:
            reasons.append(
                "look for a per-process memory fraction cap, a MIG slice smaller than the card,"
                " or another process that raced for the memory"
            )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if unallocated is not None and (unallocated + (free or 0)) >= requested:
        return _fragmentation(context, oom, requested, unallocated, reasons)
    if free is None or unallocated is None:
        missing = "driver-free" if free is None else "reserved-but-unallocated"
        reasons.append(
            f"the message prints no {missing} figure: the rule cannot tell fragmentation"
            " from a full card"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    reasons.append(
        f"{format_size(free)} free and {format_size(unallocated)} reserved but unallocated"
        f" fall {format_size(requested - free - unallocated)} short of the"
        f" {format_size(requested)} request: not fragmentation"
    )
    return None


def _fragmentation(
    context: _Context, oom: OomReport, requested: int, unallocated: int, reasons: list[str]
) -> Diagnosis | None:
    free = oom.free_bytes or 0
    margin = free + unallocated - requested
    if unallocated >= requested:
        held = f"{format_size(unallocated)} reserved but unallocated alone covers"
    else:
        held = (
            f"{format_size(free)} free and {format_size(unallocated)} reserved but unallocated"
            f" ({format_size(free + unallocated)}) cover"
        )
    share = f", {margin / oom.total_bytes:.1%} of the card" if oom.total_bytes else ""
    reasons.append(
        f"{held} the {format_size(requested)} request with {format_size(margin)} to spare"
        f"{share}: the bytes existed but not in one piece"
    )
    if context.evidence.expandable_segments:
        reasons.append(
            "the run already had expandable_segments:True, which lets a segment grow in place:"
            " stranded bytes are not the story, the card was full; taken as a true OOM"
        )
        return None
    reasons.extend(_holder_words(process) for process in _listed_cotenants(context))
    slack = rounding_error(requested) + rounding_error(free) + rounding_error(unallocated)
    if margin <= slack:
        confidence = Confidence.LOW
        reasons.append("the margin is within the rounding of the printed figures")
    elif margin < requested:
        confidence = Confidence.MEDIUM
        reasons.append("a thin margin: less than the request again")
    else:
        confidence = Confidence.HIGH
    reasons.append("fragmentation: set expandable_segments:True before any batch change")
    return context.verdict(FailureKind.FRAGMENTATION, confidence, reasons)


def _size_bug(context: _Context, oom: OomReport, reasons: list[str]) -> Diagnosis:
    requested, total = oom.requested_bytes, oom.total_bytes
    if requested is None:
        asked = "a request beyond 1 EiB"
    else:
        asked = f"the {format_size(requested)} request"
        if total:
            asked += f" alone is larger than the whole {format_size(total)} card and"
    reasons.append(
        f"{asked} beyond any device: a size bug in the program (an overflowed or mis-multiplied"
        " shape), not memory pressure"
    )
    return context.verdict(FailureKind.NOT_OOM, Confidence.HIGH, reasons)


def _mps_watermark(context: _Context, oom: OomReport, reasons: list[str]) -> Diagnosis | None:
    """Apple's allocator refuses past its high watermark (`max allowed`)."""
    requested, allocated = oom.requested_bytes, oom.allocated_bytes
    other, allowed = oom.other_allocations_bytes or 0, oom.allowed_bytes
    if other > BEYOND_ANY_DEVICE_BYTES:
        reasons.append(
            f"MPS counts {format_size(other)} of other allocations, beyond any machine: its"
            " accounting is broken, not the memory"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    if requested is None or allocated is None or allowed is None:
        reasons.append("the MPS message lacks a figure: nothing to weigh")
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    wanted = allocated + other + requested
    if wanted <= allowed:
        reasons.append(
            f"MPS allocated {format_size(allocated)} and other allocations"
            f" {format_size(other)} with the {format_size(requested)} request stay under its"
            f" {format_size(allowed)} max allowed: the device itself could not serve it"
        )
        return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)
    reasons.append(
        f"MPS allocated {format_size(allocated)} + other allocations {format_size(other)} +"
        f" the {format_size(requested)} request = {format_size(wanted)}, over its"
        f" {format_size(allowed)} max allowed (the high watermark)"
    )
    return None


def _capacity_reasons(oom: OomReport) -> list[str]:
    reasons: list[str] = []
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
    line = context.root_cause_line
    if context.root_cause is not RootCause.OTHER_ERROR or line is None:
        job = context.evidence.job
        if job is not None and job.state in (JobState.NODE_FAIL, JobState.TIMEOUT):
            return context.verdict(
                FailureKind.NOT_OOM,
                Confidence.HIGH,
                [f"Slurm ended job {job.display_id} as {job.state.value}, not out of memory"],
            )
        return None
    reasons = [f"the first failure was not out of memory: {_quote(line)}"]
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
        OomFamily.ONNX_RUNTIME: "ONNX Runtime's arena could not allocate device memory",
        OomFamily.KV_CACHE: "the inference engine found no GPU memory left for its KV cache",
        OomFamily.LIBRARY_HANDLE: (
            f"{'cuBLAS' if 'CUBLAS' in oom.message else 'cuDNN'} could not create its handle"
        ),
        OomFamily.HOST_RAM: "the host ran out of RAM",
    }[oom.family]


def _quote(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return f'"{text[: limit - 3]}..."' if len(text) > limit else f'"{text}"'


def with_suspicious_text(verdict: Diagnosis, findings: LogFindings) -> Diagnosis:
    """The verdict with the findings' notes about nodes outside the allocation as reasons,
    so a person reading it sees that the log named one."""
    extra = tuple(
        note
        for note in findings.notes
        if note.startswith(OUTSIDE_ALLOCATION) and note not in verdict.reasons
    )
    return replace(verdict, reasons=verdict.reasons + extra) if extra else verdict
