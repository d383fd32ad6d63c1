"""The diagnosis: evidence in, a verdict out, with the numbers and rules that decided it.

Pure: imports no subprocess, SSH or SQL. `diagnose` dispatches to the rules in the runbooks'
order; the host-RAM, collective-timeout and not-OOM rules are short and live here, the
hardware and co-tenant rules in `hardware`, the device-OOM rules in `device_oom`. It gives a
verdict for any well-typed evidence: a figure beyond its plausible range is set aside with a
reason before any arithmetic, so no input ends in an exception or an unstorable record.
"""

from __future__ import annotations

from dataclasses import replace

from daemon.diagnosis import Confidence, Diagnosis, FailureKind, History
from daemon.evidence.findings import OUTSIDE_ALLOCATION
from daemon.evidence.oom_family import host_ram_is_certain
from daemon.evidence.records import (
    MAX_GPU_INDEX,
    MAX_PID,
    MAX_RANK,
    MAX_STEP,
    Evidence,
    LogFindings,
    OomFamily,
    RootCause,
)
from daemon.evidence.units import MAX_BYTES
from daemon.rules.context import RuleContext, quote
from daemon.rules.device_oom import gpu_oom
from daemon.rules.hardware import (
    hardware_fault,
    probe_cotenant,
)
from daemon.slurm.records import JobState


def diagnose(evidence: Evidence, history: History | None = None) -> Diagnosis:
    """Decide what killed the job, following the runbooks, and say which numbers decided it.

    The node probe's findings come first, then what the job's log shows as its earliest root
    failure (a GPU fault, the host's RAM, a collective timeout alone, the device's memory by
    the fragmentation rule, another error), then Slurm's own record.
    """
    history = history or History()
    evidence, set_aside = _within_ranges(evidence)
    log = evidence.log
    context = RuleContext(evidence, history, tuple(set_aside), _root_cause(log))
    for rule in (
        hardware_fault,
        probe_cotenant,
        _host_ram,
        _collective_timeout,
        gpu_oom,
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


def _host_ram(context: RuleContext) -> Diagnosis | None:
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
        reasons.append(f"the log's first failure is the host's RAM: {quote(line)}")
    if job is not None and job.state is JobState.OUT_OF_MEMORY:
        certain = True
        reasons.append(f"Slurm ended job {job.display_id} as OUT_OF_MEMORY (its memory cgroup)")
    elif job is not None:
        # Slurm marks the srun step the cgroup killed in, while the job itself ends FAILED
        # (the batch script's exit) or CANCELLED (a wedge cancelled): the step is the record.
        killed_steps = [step for step in job.steps if step.state is JobState.OUT_OF_MEMORY]
        if killed_steps:
            certain = True
            step = killed_steps[0]
            reasons.append(
                f"Slurm ended step {job.display_id}.{step.step_id} as OUT_OF_MEMORY "
                "(its memory cgroup)"
            )
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


def _collective_timeout(context: RuleContext) -> Diagnosis | None:
    if context.root_cause is not RootCause.COLLECTIVE_TIMEOUT:
        return None
    reasons = [
        "only a collective timeout is in view: the root failure is elsewhere (another rank's"
        " log, or earlier than the part read)",
    ]
    if (line := context.root_cause_line) is not None:
        reasons.append(f"the first one: {quote(line)}")
    if context.log.cascade_ranks:
        ranks = ", ".join(str(rank) for rank in context.log.cascade_ranks)
        reasons.append(f"ranks {ranks} timed out too")
    return context.verdict(FailureKind.UNKNOWN, Confidence.LOW, reasons)


def _not_oom(context: RuleContext) -> Diagnosis | None:
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
    reasons = [f"the first failure was not out of memory: {quote(line)}"]
    if log.cascade_ranks:
        ranks = ", ".join(str(rank) for rank in log.cascade_ranks)
        reasons.append(f"ranks {ranks} failed after it, as a cascade")
    return context.verdict(FailureKind.NOT_OOM, Confidence.MEDIUM, reasons)


def with_suspicious_text(verdict: Diagnosis, findings: LogFindings) -> Diagnosis:
    """The verdict with the findings' notes about nodes outside the allocation as reasons,
    so a person reading it sees that the log named one."""
    extra = tuple(
        note
        for note in findings.notes
        if note.startswith(OUTSIDE_ALLOCATION) and note not in verdict.reasons
    )
    return replace(verdict, reasons=verdict.reasons + extra) if extra else verdict
