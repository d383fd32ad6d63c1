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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from daemon.evidence.probe import gpu_faults, gpu_name, memory_holders, xid_counts
from daemon.evidence.records import (
    FindingKind,
    GpuHealth,
    NodeProbe,
    ProbeVerdict,
    XidEvent,
    XidPolicy,
)
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


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    health: ProbeVerdict  # FAULTY, DEGRADED or UNREACHABLE
    text: str  # one line, with the GPU and the numbers
    gpu: int | None = None


@dataclass(frozen=True)
class NodeJudgement:
    """One node at one moment: its health, every finding, and the one that decides."""

    node: str
    probed_at: datetime
    health: ProbeVerdict
    findings: tuple[Finding, ...]
    deciding: str
    gpus_seen: int
    gpus_expected: int | None
    running_jobs: tuple[int, ...]
    notes: tuple[str, ...] = ()

    def kinds(self) -> tuple[FindingKind, ...]:
        return tuple(dict.fromkeys(finding.kind for finding in self.findings))


_SEVERITY = {ProbeVerdict.FAULTY: 0, ProbeVerdict.UNREACHABLE: 1, ProbeVerdict.DEGRADED: 2}


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
        finding = Finding(FindingKind.UNREACHABLE, ProbeVerdict.UNREACHABLE, f"not probed: {why}")
        return NodeJudgement(
            node=probe.node,
            probed_at=probe.probed_at,
            health=ProbeVerdict.UNREACHABLE,
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
            ProbeVerdict.FAULTY,
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
                ProbeVerdict.FAULTY,
                f"Slurm's gres promises {gpus_expected} GPUs, nvidia-smi lists {seen}: "
                f"{gpus_expected - seen} missing (fallen off the bus or failed to initialise)",
            )
        )
    notes: list[str] = []
    if probe.verdict is ProbeVerdict.UNREACHABLE:
        why = probe.error or "part of the GPU state could not be read"
        findings.append(
            Finding(FindingKind.UNREACHABLE, ProbeVerdict.UNREACHABLE, f"partly read: {why}")
        )
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
            health=ProbeVerdict.HEALTHY,
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
    """XIDs in the window at their catalog threshold, by the catalog's class."""
    findings: list[Finding] = []
    for xid in xid_counts(events, catalog):
        if not xid.over:
            continue
        if xid.code == XID_FALLEN_OFF_BUS and xid.entry.policy is XidPolicy.HARDWARE:
            findings.append(Finding(FindingKind.FALLEN_OFF_BUS, ProbeVerdict.FAULTY, xid.summary))
        elif xid.entry.policy is XidPolicy.HARDWARE:
            findings.append(Finding(FindingKind.XID_HARDWARE, ProbeVerdict.FAULTY, xid.summary))
        elif xid.entry.policy is XidPolicy.DRIVER:
            findings.append(Finding(FindingKind.XID_DRIVER, ProbeVerdict.DEGRADED, xid.summary))
    return findings


_DECISIVE = {kind: rank for rank, kind in enumerate(FindingKind)}


def _gpu_findings(gpu: GpuHealth, cotenant_min_bytes: int, *, busy: bool) -> list[Finding]:
    """The probe's faults of the card, most decisive first; a process holding memory is a
    co-tenant only where no job runs."""
    found = [
        Finding(
            fault.kind,
            ProbeVerdict.FAULTY if fault.faulty else ProbeVerdict.DEGRADED,
            fault.text,
            gpu.index,
        )
        for fault in sorted(gpu_faults(gpu), key=lambda fault: _DECISIVE[fault.kind])
    ]
    if busy:
        return found
    for app, words in memory_holders(gpu, cotenant_min_bytes):
        held = format_size(app.used_bytes) if app.used_bytes is not None else "memory"
        found.append(
            Finding(
                FindingKind.COTENANT,
                ProbeVerdict.DEGRADED,
                f"{gpu_name(gpu)}: {words} holds {held} outside any job",
                gpu.index,
            )
        )
    return found
