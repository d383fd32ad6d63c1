"""The hardware and co-tenant rules: a fault on the node or the card (the probe's, or a GPU
fault the log shows) and another process holding memory on the job's GPU.

Apart from the device-OOM rules because they read the node probe and the processes on the
card, not the allocator's figures; `device_oom` asks `message_cotenant` when an OOM message
itself lists other processes.
"""

from __future__ import annotations

from daemon.diagnosis import Confidence, Diagnosis, FailureKind
from daemon.evidence.records import (
    OomFamily,
    OomReport,
    OtherProcess,
    ProbeVerdict,
    RootCause,
    XidPolicy,
)
from daemon.evidence.units import MAX_BYTES, format_size
from daemon.rules.context import RuleContext, quote

# A CUDA context alone holds ~300-500 MiB; other processes holding more than this on our GPU
# are doing real work there (a co-tenant), not leftovers.
COTENANT_MIN_BYTES = 512 * 1024 * 1024
# Several small holders look like a job's own ranks each opening a context on one GPU.
STRAY_CONTEXT_MIN_COUNT = 3
STRAY_CONTEXT_MAX_BYTES = 1024 * 1024 * 1024


def hardware_fault(context: RuleContext) -> Diagnosis | None:
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


def _probe_faults(context: RuleContext) -> list[str]:
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


def _log_fault(context: RuleContext) -> str | None:
    """A GPU fault as the log's root failure, in the XID catalog's words where it printed one."""
    if context.root_cause is not RootCause.GPU_FAULT:
        return None
    fault = context.log.gpu_fault
    line = context.root_cause_line
    if fault is None:
        return None if line is None else f"the job's log shows a GPU fault: {quote(line)}"
    reason = f"the job's log shows a GPU fault: {quote(fault.line)}"
    if fault.xid is not None:
        return f"{reason} (XID {fault.xid}: {fault.words})"
    return f"{reason} ({fault.words})" if fault.words else reason


def probe_cotenant(context: RuleContext) -> Diagnosis | None:
    """Processes still holding memory on the job's GPUs after it died, as the probe saw them;
    the message's own list of processes joins them."""
    own = set(context.log.job_pids)
    probe_reasons, probe_pids, scoped = _probe_cotenants(context, own)
    if not probe_reasons:
        return None
    listed = listed_cotenants(context)
    reasons = [holder_words(process) for process in listed] + probe_reasons
    pids = [process.pid for process in listed]
    pids.extend(pid for pid in probe_pids if pid not in pids)
    confidence = Confidence.MEDIUM if scoped or listed else Confidence.LOW
    if not scoped:
        reasons.append("the job's GPUs are not known: every GPU of the node was counted")
    return _cotenant_verdict(context, confidence, reasons, pids)


def message_cotenant(context: RuleContext, oom: OomReport, reasons: list[str]) -> Diagnosis | None:
    """Other processes the OOM message lists on the GPU, when the rule says it was full."""
    listed = listed_cotenants(context)
    if not listed:
        return None
    reasons = [*reasons, *(holder_words(process) for process in listed)]
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
    context: RuleContext, confidence: Confidence, reasons: list[str], pids: list[int]
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


def listed_cotenants(context: RuleContext) -> list[OtherProcess]:
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


def holder_words(process: OtherProcess) -> str:
    return f"process {process.pid} held {format_size(process.bytes)} on the same GPU"


def _probe_cotenants(context: RuleContext, known: set[int]) -> tuple[list[str], list[int], bool]:
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
