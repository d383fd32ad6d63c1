"""A node probe judged for the fleet: what is wrong with the node, however busy it is.

Pure. An incident's probe asks "did this node kill this job?"; a sweep asks "should any job
land here?". The facts are the same (`daemon.evidence.probe` reads them), the reading is not:
a process holding VRAM is the node's own business while a job runs there and a co-tenant only
when none does, and Slurm's gres count says how many GPUs the node should show, so a GPU that
fell off the bus or never came up is missing even when the driver no longer lists it.

Each finding has a kind (what policy decides on), a severity and one line with the numbers;
the node's health is its worst finding's, and the deciding fact is the first of the worst.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from daemon.evidence.records import GpuHealth, NodeProbe, ProbeVerdict, XidEvent, XidPolicy
from daemon.evidence.units import format_size
from daemon.evidence.xid import XidCatalog

XID_FALLEN_OFF_BUS = 79
# The `finding` a person's drain (`nodes drain`) is recorded with, beside the sweep's kinds.
CORDON_FINDING = "cordon"
# One gres entry of `scontrol show node`, its socket list left out: `gpu:8`, `gpu:a100:8`.
_GRES_ENTRY = re.compile(r"gpu(?::[^:,()]+)?:([0-9]{1,6})\Z")
# A socket list (`gpu:a100:8(S:0-1)`) says where the GPUs are, not how many, and its commas
# (`(S:0,1)`) do not separate entries.
_GRES_SOCKETS = re.compile(r"\([^()]*\)")


class Health(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAULTY = "faulty"
    UNREACHABLE = "unreachable"


class FindingKind(StrEnum):
    """What a sweep can find; policy names these in `sweep.drain_now` / `drain_after_job`."""

    REMAP_FAILURE = "remap_failure"
    ECC_UNCORRECTABLE_VOLATILE = "ecc_uncorrectable_volatile"
    FALLEN_OFF_BUS = "fallen_off_bus"
    GPU_MISSING = "gpu_missing"
    XID_HARDWARE = "xid_hardware"
    REMAP_PENDING = "remap_pending"
    ECC_UNCORRECTABLE_AGGREGATE = "ecc_uncorrectable_aggregate"
    RETIRED_PAGES_PENDING = "retired_pages_pending"
    ECC_CORRECTABLE = "ecc_correctable"
    XID_DRIVER = "xid_driver"
    COTENANT = "cotenant"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    health: Health  # FAULTY, DEGRADED or UNREACHABLE
    text: str  # one line, with the GPU and the numbers
    gpu: int | None = None


@dataclass(frozen=True)
class NodeJudgement:
    """One node at one moment: its health, every finding, and the one that decides."""

    node: str
    probed_at: datetime
    health: Health
    findings: tuple[Finding, ...]
    deciding: str
    gpus_seen: int
    gpus_expected: int | None
    running_jobs: tuple[int, ...]
    notes: tuple[str, ...] = ()

    def kinds(self) -> tuple[FindingKind, ...]:
        return tuple(dict.fromkeys(finding.kind for finding in self.findings))


_SEVERITY = {Health.FAULTY: 0, Health.UNREACHABLE: 1, Health.DEGRADED: 2}


def gres_gpu_count(gres: str | None) -> int | None:
    """GPUs a node's gres promises (`gpu:a100:4,gpu:v100:2` is 6); None when it names none or
    cannot be read, so a missing GPU is never claimed on a gres nobody understood."""
    if not gres or gres.strip().lower() in {"(null)", "none", ""}:
        return None
    total = 0
    seen = False
    for entry in (part.strip() for part in _GRES_SOCKETS.sub("", gres).split(",")):
        if entry.partition(":")[0] != "gpu":  # `mps:100`, `shard:8`, a site's `gpumem:...`
            continue
        match = _GRES_ENTRY.match(entry)
        if match is None:
            return None
        total += int(match.group(1))
        seen = True
    return total if seen else None


def judge_node(
    probe: NodeProbe,
    *,
    catalog: XidCatalog,
    gpus_expected: int | None,
    running_jobs: Sequence[int],
    cotenant_min_bytes: int,
) -> NodeJudgement:
    """The probe's facts read for the fleet (see the module's docstring)."""
    jobs = tuple(running_jobs)
    if probe.verdict is ProbeVerdict.UNREACHABLE and not probe.gpus and not probe.lost_gpus:
        why = probe.error or "; ".join(probe.reasons) or "no answer"
        finding = Finding(FindingKind.UNREACHABLE, Health.UNREACHABLE, f"not probed: {why}")
        return NodeJudgement(
            node=probe.node,
            probed_at=probe.probed_at,
            health=Health.UNREACHABLE,
            findings=(finding,),
            deciding=finding.text,
            gpus_seen=0,
            gpus_expected=gpus_expected,
            running_jobs=jobs,
        )
    # The cards' own state first: at equal severity it names the GPU and what is wrong with it,
    # where an XID names only the bus it was logged on.
    findings: list[Finding] = []
    for gpu in probe.gpus:
        findings.extend(_gpu_findings(gpu, cotenant_min_bytes, busy=bool(jobs)))
    findings.extend(_xid_findings(probe.xid_events, catalog))
    findings.extend(
        Finding(
            FindingKind.GPU_MISSING,
            Health.FAULTY,
            f"nvidia-smi cannot reach {gpu}: lost to the driver (fallen off the bus or needing"
            " a reset)",
        )
        for gpu in probe.lost_gpus
    )
    seen = len(probe.gpus)
    if gpus_expected is not None and probe.gpus and seen < gpus_expected:
        findings.append(
            Finding(
                FindingKind.GPU_MISSING,
                Health.FAULTY,
                f"Slurm's gres promises {gpus_expected} GPUs, nvidia-smi lists {seen}: "
                f"{gpus_expected - seen} missing (fallen off the bus or failed to initialise)",
            )
        )
    notes: list[str] = []
    if probe.verdict is ProbeVerdict.UNREACHABLE:
        why = probe.error or "part of the GPU state could not be read"
        findings.append(Finding(FindingKind.UNREACHABLE, Health.UNREACHABLE, f"partly read: {why}"))
    if jobs and any(gpu.compute_apps for gpu in probe.gpus):
        notes.append(
            f"processes hold GPU memory while job(s) {', '.join(map(str, jobs))} run here:"
            " not judged as co-tenants"
        )
    ordered = tuple(sorted(findings, key=lambda finding: _SEVERITY[finding.health]))
    if not ordered:
        words = f"{seen} GPUs" + (f" of {gpus_expected}" if gpus_expected is not None else "")
        return NodeJudgement(
            node=probe.node,
            probed_at=probe.probed_at,
            health=Health.HEALTHY,
            findings=(),
            deciding=f"{words}: no remap pending or failed, no uncorrectable ECC, no hardware XID",
            gpus_seen=seen,
            gpus_expected=gpus_expected,
            running_jobs=jobs,
            notes=tuple(notes),
        )
    return NodeJudgement(
        node=probe.node,
        probed_at=probe.probed_at,
        health=ordered[0].health,
        findings=ordered,
        deciding=ordered[0].text,
        gpus_seen=seen,
        gpus_expected=gpus_expected,
        running_jobs=jobs,
        notes=tuple(notes),
    )


def _xid_findings(events: Sequence[XidEvent], catalog: XidCatalog) -> list[Finding]:
    """XIDs in the window by the catalog's class, each code once with its count and buses."""
    findings: list[Finding] = []
    counts = Counter(event.code for event in events)
    for code, count in sorted(counts.items()):
        entry = catalog.entry(code)
        if count < entry.count_threshold:
            continue
        buses = ", ".join(
            sorted({event.pci_bus_id or "?" for event in events if event.code == code})
        )
        text = f"XID {code} ({entry.meaning}) x{count} on {buses}"
        if code == XID_FALLEN_OFF_BUS and entry.policy is XidPolicy.HARDWARE:
            findings.append(Finding(FindingKind.FALLEN_OFF_BUS, Health.FAULTY, text))
        elif entry.policy is XidPolicy.HARDWARE:
            findings.append(Finding(FindingKind.XID_HARDWARE, Health.FAULTY, text))
        elif entry.policy is XidPolicy.DRIVER:
            findings.append(Finding(FindingKind.XID_DRIVER, Health.DEGRADED, text))
    return findings


def _gpu_findings(gpu: GpuHealth, cotenant_min_bytes: int, *, busy: bool) -> list[Finding]:
    name = f"GPU {gpu.index} ({gpu.pci_bus_id or gpu.uuid or '?'})"
    found: list[Finding] = []

    def add(kind: FindingKind, health: Health, text: str) -> None:
        found.append(Finding(kind, health, f"{name}: {text}", gpu.index))

    if gpu.remap_failure_occurred:
        add(FindingKind.REMAP_FAILURE, Health.FAULTY, "row remapping failure occurred")
    if gpu.ecc_volatile_uncorrectable:
        add(
            FindingKind.ECC_UNCORRECTABLE_VOLATILE,
            Health.FAULTY,
            f"{gpu.ecc_volatile_uncorrectable} uncorrectable ECC errors since the driver loaded",
        )
    if gpu.remap_pending:
        add(
            FindingKind.REMAP_PENDING,
            Health.FAULTY,
            f"row remap pending ({gpu.remapped_rows_correctable or 0} correctable, "
            f"{gpu.remapped_rows_uncorrectable or 0} uncorrectable rows): needs a GPU reset",
        )
    if gpu.ecc_aggregate_uncorrectable and not gpu.ecc_volatile_uncorrectable:
        add(
            FindingKind.ECC_UNCORRECTABLE_AGGREGATE,
            Health.DEGRADED,
            f"{gpu.ecc_aggregate_uncorrectable} uncorrectable ECC errors in its lifetime",
        )
    if gpu.retired_pages_pending:
        add(FindingKind.RETIRED_PAGES_PENDING, Health.DEGRADED, "retired pages pending a reset")
    if gpu.ecc_volatile_correctable:
        add(
            FindingKind.ECC_CORRECTABLE,
            Health.DEGRADED,
            f"{gpu.ecc_volatile_correctable} correctable ECC errors since the driver loaded",
        )
    if busy:
        return found
    for app in gpu.compute_apps:
        if app.used_bytes is not None and app.used_bytes < cotenant_min_bytes:
            continue
        held = format_size(app.used_bytes) if app.used_bytes is not None else "memory"
        who = f"pid {app.pid}" if app.pid is not None else "an unnamed process"
        label = app.process_name or "no name: a zombie or another namespace"
        add(FindingKind.COTENANT, Health.DEGRADED, f"{who} ({label}) holds {held} outside any job")
    return found
