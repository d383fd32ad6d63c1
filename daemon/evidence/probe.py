"""The node probe's JSON document -> a typed `NodeProbe` with a verdict and its reasons.

Pure. The probe program on the node (`daemon/installable/node_probe.py`) only runs the
tools and prints their raw output; every reading and every judgement happens here, so
it is tested on literal outputs and changes without touching the nodes.

Verdicts: `faulty` (drain it: hardware XID at or over its threshold in the job's window,
pending row remap, remapping failure, uncorrectable ECC since the driver loaded),
`degraded` (correctable ECC since load, retired pages pending, repeated driver XIDs,
another process holding VRAM), `healthy`, and `unreachable` for a node whose state could
not be read at all: never healthy by default.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from daemon.evidence.kernel_log import KernelLogFindings, TimeWindow, parse_kernel_log
from daemon.evidence.nvidia_smi import (
    MIB,
    ComputeAppRow,
    GpuMemoryHealth,
    GpuQueryRow,
    NvidiaSmiParseError,
    find_unreachable_gpus,
    normalise_bus_id,
    parse_compute_apps,
    parse_gpu_rows,
    parse_query,
)
from daemon.evidence.records import (
    ComputeApp,
    FindingKind,
    GpuHealth,
    NodeProbe,
    ProbeVerdict,
    XidEvent,
    XidPolicy,
)
from daemon.evidence.xid import XidCatalog, XidCatalogEntry

DOCUMENT_FORMAT = "medic-node-probe/1"
# An exit status as subprocess reports one: a negative signal number or a byte.
MIN_EXIT_STATUS = -255
MAX_EXIT_STATUS = 255
_HOSTNAME_CHARS = 253
_ERROR_CHARS = 400
TOOL_NAMES = ("kernel_log", "gpu_health", "gpus", "compute_apps")
DEFAULT_COTENANT_MIN_BYTES = 1024 * MIB
GIB = 1024 * MIB
XID_CLEANUP_CODE = 45


class ProbeDocumentError(ValueError):
    """The probe printed something that is not its JSON document (the only error
    `parse_document` raises; `interpret_probe` raises none: garbage is a verdict)."""


@dataclass(frozen=True)
class ToolOutput:
    """One tool's run on the node, as the probe program reported it."""

    name: str
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    error: str | None
    truncated: bool = False

    def failure(self) -> str | None:
        """Why this output cannot be trusted, or None when it can."""
        if self.error:
            return f"{self.name}: {self.error}"
        if self.timed_out:
            return f"{self.name}: timed out on the node"
        if self.exit_code != 0:
            last = self.stderr.strip().splitlines()[-1:] or self.stdout.strip().splitlines()[-1:]
            detail = f" ({last[0][:160]})" if last else ""
            return f"{self.name}: exit {self.exit_code}{detail}"
        return None


@dataclass(frozen=True)
class ProbeDocument:
    """The parsed envelope: which host answered, when, and each tool's raw output."""

    hostname: str
    collected_at: datetime | None
    tools: Mapping[str, ToolOutput]


def parse_document(text: str) -> ProbeDocument:
    """Check the envelope; the tools' outputs stay raw strings for the parsers."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProbeDocumentError(
            f"probe output is not JSON ({error.msg} at char {error.pos}): {text[:80]!r}"
        ) from None
    except (ValueError, RecursionError) as error:
        # An integer of more than 4300 digits, or nesting deeper than the interpreter's stack.
        raise ProbeDocumentError(f"probe output is not readable JSON: {str(error)[:80]}") from None
    if not isinstance(document, dict) or document.get("format") != DOCUMENT_FORMAT:
        raise ProbeDocumentError(f"probe output is not a {DOCUMENT_FORMAT} document")
    raw_tools = document.get("tools")
    if not isinstance(raw_tools, dict):
        raise ProbeDocumentError("probe document has no 'tools' object")
    tools = {name: _tool(name, raw_tools.get(name)) for name in TOOL_NAMES}
    hostname = document.get("hostname")
    return ProbeDocument(
        hostname=hostname[:_HOSTNAME_CHARS] if isinstance(hostname, str) else "",
        collected_at=_time(document.get("collected_at")),
        tools=tools,
    )


def interpret_probe(
    node: str,
    text: str,
    *,
    probed_at: datetime,
    catalog: XidCatalog,
    window: TimeWindow | None = None,
    cotenant_min_bytes: int = DEFAULT_COTENANT_MIN_BYTES,
) -> NodeProbe:
    """Everything the probe printed, judged: the verdict and short reasons with numbers."""
    try:
        document = parse_document(text)
    except ProbeDocumentError as error:
        return unreachable(node, probed_at, f"unreadable probe output: {error}")
    problems: list[str] = []
    kernel = _kernel(document.tools["kernel_log"], catalog, window, problems)
    gpus = _gpus(document.tools, problems)
    return _judge(
        node,
        probed_at=probed_at,
        gpus=gpus,
        lost=_lost_gpus(document.tools),
        kernel=kernel,
        catalog=catalog,
        problems=problems,
        cotenant_min_bytes=cotenant_min_bytes,
        kernel_truncated=document.tools["kernel_log"].truncated,
    )


def unreachable(node: str, probed_at: datetime, error: str) -> NodeProbe:
    """A node we could not read: recorded with why, never mistaken for a healthy one."""
    return NodeProbe(
        node=node,
        probed_at=probed_at,
        verdict=ProbeVerdict.UNREACHABLE,
        reasons=(f"{node} could not be probed: {error}",),
        error=error,
    )


def _tool(name: str, raw: object) -> ToolOutput:
    """One tool's entry; a shape the probe never prints is that tool's error, not a crash."""
    if not isinstance(raw, dict):
        return ToolOutput(name, None, "", "", False, "missing from the probe document")
    stdout, stderr = raw.get("stdout") or "", raw.get("stderr") or ""
    if not isinstance(stdout, str) or not isinstance(stderr, str):
        return ToolOutput(name, None, "", "", False, "its output is not text")
    exit_code = raw.get("exit_code")
    plausible = (
        isinstance(exit_code, int)
        and not isinstance(exit_code, bool)
        and MIN_EXIT_STATUS <= exit_code <= MAX_EXIT_STATUS
    )
    return ToolOutput(
        name=name,
        exit_code=exit_code if plausible else None,
        stdout=stdout,
        stderr=stderr,
        timed_out=bool(raw.get("timed_out")),
        error=str(raw["error"])[:_ERROR_CHARS] if raw.get("error") else None,
        truncated=bool(raw.get("truncated")),
    )


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _kernel(
    tool: ToolOutput, catalog: XidCatalog, window: TimeWindow | None, problems: list[str]
) -> KernelLogFindings | None:
    failure = tool.failure()
    if failure is not None:
        problems.append(failure)
        return None
    return parse_kernel_log(tool.stdout, catalog=catalog, window=window)


def _parsed(tool: ToolOutput, parse: Any, problems: list[str]) -> Any:
    failure = tool.failure()
    if failure is not None:
        problems.append(failure)
        return None
    try:
        return parse(tool.stdout)
    except NvidiaSmiParseError as error:
        problems.append(f"{tool.name}: {error}")
        return None


def _gpus(tools: Mapping[str, ToolOutput], problems: list[str]) -> tuple[GpuHealth, ...] | None:
    health: tuple[GpuMemoryHealth, ...] | None = _parsed(tools["gpu_health"], parse_query, problems)
    rows: tuple[GpuQueryRow, ...] | None = _parsed(tools["gpus"], parse_gpu_rows, problems)
    apps: tuple[ComputeAppRow, ...] | None = _parsed(
        tools["compute_apps"], parse_compute_apps, problems
    )
    if health is not None and rows is not None and len(health) != len(rows):
        problems.append(
            f"nvidia-smi -q printed {len(health)} GPU blocks but --query-gpu listed {len(rows)}"
        )
    if rows is None and health is None:
        return None
    if not rows and not health:
        problems.append("nvidia-smi listed no GPUs")
        return None
    by_bus = {normalise_bus_id(item.pci_bus_id): item for item in health or ()}
    apps_by_uuid: dict[str, list[ComputeApp]] = {}
    for app in apps or ():
        apps_by_uuid.setdefault(app.gpu_uuid, []).append(
            ComputeApp(app.gpu_uuid, app.pid, app.process_name, app.used_bytes)
        )
    if rows is None:
        assert health is not None
        return tuple(_merge(index, None, item, ()) for index, item in enumerate(health))
    merged = []
    for row in rows:
        item = by_bus.get(normalise_bus_id(row.pci_bus_id)) if row.pci_bus_id else None
        merged.append(_merge(row.index, row, item, tuple(apps_by_uuid.get(row.uuid or "", ()))))
    return tuple(merged)


def _lost_gpus(tools: Mapping[str, ToolOutput]) -> tuple[str, ...]:
    """GPUs any nvidia-smi run said it cannot reach, whatever its exit status (it fails then)."""
    lost: dict[str, None] = {}
    for name in ("gpu_health", "gpus", "compute_apps"):
        tool = tools[name]
        for gpu in find_unreachable_gpus(f"{tool.stdout}\n{tool.stderr}"):
            lost[f"{gpu.describe()}: {gpu.reason}"] = None
    return tuple(lost)


def _merge(
    index: int,
    row: GpuQueryRow | None,
    health: GpuMemoryHealth | None,
    apps: tuple[ComputeApp, ...],
) -> GpuHealth:
    h = health or GpuMemoryHealth(pci_bus_id="")
    return GpuHealth(
        index=index,
        uuid=row.uuid if row else None,
        pci_bus_id=(row.pci_bus_id if row else None) or (health.pci_bus_id if health else None),
        memory_total_bytes=row.memory_total_bytes if row else None,
        memory_used_bytes=row.memory_used_bytes if row else None,
        remapped_rows_correctable=h.remapped_rows_correctable,
        remapped_rows_uncorrectable=h.remapped_rows_uncorrectable,
        remap_pending=h.remap_pending,
        remap_failure_occurred=h.remap_failure_occurred,
        ecc_volatile_uncorrectable=h.ecc_volatile_uncorrectable,
        ecc_aggregate_uncorrectable=h.ecc_aggregate_uncorrectable,
        ecc_volatile_correctable=h.ecc_volatile_correctable,
        ecc_aggregate_correctable=h.ecc_aggregate_correctable,
        retired_pages_pending=h.retired_pages_pending,
        compute_apps=apps,
    )


def _judge(
    node: str,
    *,
    probed_at: datetime,
    gpus: tuple[GpuHealth, ...] | None,
    lost: tuple[str, ...],
    kernel: KernelLogFindings | None,
    catalog: XidCatalog,
    problems: list[str],
    cotenant_min_bytes: int,
    kernel_truncated: bool,
) -> NodeProbe:
    faulty: list[str] = []
    degraded: list[str] = []
    notes: list[str] = []
    xids = kernel.xid_events if kernel else ()
    _judge_xids(xids, catalog, faulty, degraded, notes)
    faulty.extend(f"nvidia-smi cannot reach {gpu}: lost to the driver" for gpu in lost)
    for gpu in gpus or ():
        _judge_gpu(gpu, cotenant_min_bytes, faulty, degraded)
    for kill in kernel.host_oom_kills if kernel else ():
        scope = "a memory cgroup's limit" if kill.cgroup else "host RAM exhaustion"
        notes.append(
            f"host OOM killer killed pid {kill.pid} ({kill.process_name}) in the window: {scope}"
        )
    if kernel is not None:
        notes.extend(kernel.notes)
    if kernel_truncated:
        notes.append("the kernel log was cut to its newest part on the node")
    unread = [f"could not read {problem}" for problem in problems]
    if faulty:
        verdict, reasons = ProbeVerdict.FAULTY, faulty + degraded + unread + notes
    elif problems:
        error = "; ".join(problems)
        return NodeProbe(
            node=node,
            probed_at=probed_at,
            verdict=ProbeVerdict.UNREACHABLE,
            reasons=(
                f"{node}'s GPU state could not be read, so it is not called healthy",
                *unread,
                *degraded,
                *notes,
            ),
            gpus=gpus or (),
            xid_events=xids,
            host_oom_kills=kernel.host_oom_kills if kernel else (),
            error=error,
            lost_gpus=lost,
        )
    elif degraded:
        verdict, reasons = ProbeVerdict.DEGRADED, degraded + notes
    else:
        count = len(gpus or ())
        verdict = ProbeVerdict.HEALTHY
        reasons = [
            f"{count} GPUs: no pending or failed row remap, no uncorrectable ECC, "
            "no hardware XID in the window, no other process holding VRAM",
            *notes,
        ]
    return NodeProbe(
        node=node,
        probed_at=probed_at,
        verdict=verdict,
        reasons=tuple(reasons),
        gpus=gpus or (),
        xid_events=xids,
        host_oom_kills=kernel.host_oom_kills if kernel else (),
        lost_gpus=lost,
    )


@dataclass(frozen=True)
class XidCount:
    """One XID code in the window: how often, on which buses, and whether it reached the
    catalog's threshold for its policy."""

    code: int
    count: int
    entry: XidCatalogEntry
    summary: str  # `XID 79 (GPU has fallen off the bus) x1 on 0000:47:00`

    @property
    def over(self) -> bool:
        return self.count >= self.entry.count_threshold


def xid_counts(xids: Sequence[XidEvent], catalog: XidCatalog) -> list[XidCount]:
    """Each code once, in code order, with its count and the buses it was logged on."""
    counted = []
    for code, count in sorted(Counter(event.code for event in xids).items()):
        entry = catalog.entry(code)
        where = ", ".join(sorted({event.pci_bus_id or "?" for event in xids if event.code == code}))
        counted.append(
            XidCount(code, count, entry, f"XID {code} ({entry.meaning}) x{count} on {where}")
        )
    return counted


@dataclass(frozen=True)
class GpuFault:
    """One thing wrong with a card's memory, named for the card: the same rules and words for
    an incident's probe and for the fleet's sweep."""

    kind: FindingKind
    faulty: bool  # else degraded
    text: str


def gpu_name(gpu: GpuHealth) -> str:
    return f"GPU {gpu.index} ({gpu.pci_bus_id or gpu.uuid or '?'})"


def gpu_faults(gpu: GpuHealth) -> list[GpuFault]:
    """Row remaps, ECC and retired pages as the probe reads them (processes aside)."""
    name = gpu_name(gpu)
    faults: list[GpuFault] = []

    def add(kind: FindingKind, faulty: bool, text: str) -> None:
        faults.append(GpuFault(kind, faulty, f"{name}: {text}"))

    if gpu.remap_failure_occurred:
        add(FindingKind.REMAP_FAILURE, True, "row remapping failure occurred")
    if gpu.remap_pending:
        add(
            FindingKind.REMAP_PENDING,
            True,
            f"row remap pending ({gpu.remapped_rows_correctable or 0} correctable, "
            f"{gpu.remapped_rows_uncorrectable or 0} uncorrectable rows): needs a GPU reset",
        )
    if gpu.ecc_volatile_uncorrectable:
        add(
            FindingKind.ECC_UNCORRECTABLE_VOLATILE,
            True,
            f"{gpu.ecc_volatile_uncorrectable} uncorrectable ECC errors since the driver loaded",
        )
    if gpu.retired_pages_pending:
        add(FindingKind.RETIRED_PAGES_PENDING, False, "retired pages pending a reset")
    if gpu.ecc_volatile_correctable:
        add(
            FindingKind.ECC_CORRECTABLE,
            False,
            f"{gpu.ecc_volatile_correctable} correctable ECC errors since the driver loaded",
        )
    if gpu.ecc_aggregate_uncorrectable and not gpu.ecc_volatile_uncorrectable:
        add(
            FindingKind.ECC_UNCORRECTABLE_AGGREGATE,
            False,
            f"{gpu.ecc_aggregate_uncorrectable} uncorrectable ECC errors in its lifetime",
        )
    return faults


def memory_holders(gpu: GpuHealth, min_bytes: int) -> list[tuple[ComputeApp, str]]:
    """The processes holding at least `min_bytes` on the card (or an unknown amount), each
    with the words that name it: `pid 31337 (python3)`."""
    holders = []
    for app in gpu.compute_apps:
        if app.used_bytes is not None and app.used_bytes < min_bytes:
            continue
        who = f"pid {app.pid}" if app.pid is not None else "an unnamed process"
        label = app.process_name or "no name: a zombie or another namespace"
        holders.append((app, f"{who} ({label})"))
    return holders


def _judge_xids(
    xids: Sequence[XidEvent],
    catalog: XidCatalog,
    faulty: list[str],
    degraded: list[str],
    notes: list[str],
) -> None:
    for xid in xid_counts(xids, catalog):
        entry, summary = xid.entry, xid.summary
        if entry.policy is XidPolicy.HARDWARE and xid.over:
            faulty.append(f"{summary}, threshold {entry.count_threshold}: hardware")
        elif entry.policy is XidPolicy.DRIVER and xid.over:
            degraded.append(f"{summary}, threshold {entry.count_threshold}: driver")
        elif entry.policy is XidPolicy.APPLICATION and xid.code == XID_CLEANUP_CODE:
            notes.append(f"{summary}: cleanup after a process died, not a cause")
        elif entry.policy is XidPolicy.APPLICATION:
            notes.append(f"{summary}: the job's own fault, not the node's")
        elif entry.policy is not XidPolicy.IGNORE:
            notes.append(f"{summary}, below threshold {entry.count_threshold}")


def _judge_gpu(
    gpu: GpuHealth, cotenant_min_bytes: int, faulty: list[str], degraded: list[str]
) -> None:
    for fault in gpu_faults(gpu):
        (faulty if fault.faulty else degraded).append(fault.text)
    for app, words in memory_holders(gpu, cotenant_min_bytes):
        held = f"{app.used_bytes / GIB:.1f} GiB" if app.used_bytes is not None else "memory"
        degraded.append(f"{gpu_name(gpu)}: {words} holds {held}")
