"""Kernel log lines that matter for a GPU job's death, limited to the job's time window.

Reads `dmesg --time-format iso` (or `journalctl -k -o short-iso`) text: NVIDIA XID lines,
"fallen off the bus" lines that some drivers print without an XID, `RmInitAdapter failed!`
lines of a GPU the driver could not bring up (nvidia-smi then does not list it at all), and
host OOM-killer lines (global and memory cgroup). Pure: text in, typed records out. Lines
without a usable timestamp are kept only when the whole log has none, and the findings say so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from daemon.evidence.records import MAX_PID, HostOomKill, XidEvent
from daemon.evidence.xid import XidCatalog

FALLEN_OFF_THE_BUS_XID = 79
# Bounds on what one probe's kernel log may cost: every pattern below runs on lines of at
# most MAX_LINE_CHARS, and only the newest MAX_LINES lines (a busy node's week) are read.
MAX_LINE_CHARS = 4096
MAX_LINES = 100_000
# Times a record can hold whatever zone it is converted to.
_YEARS = range(1970, 9999)

# Every pattern is linear: no quantifier over an unbounded run is nested or followed by a
# choice that sends it back over the same run; digits are ASCII. A process name as the kernel
# prints it is at most 15 bytes (TASK_COMM_LEN): 64 leaves room to spare.
_ISO_PREFIX = re.compile(
    r"^(?P<stamp>[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:[,.][0-9]{1,9})?"
    r"(?:Z|[+-][0-9]{2}:?[0-9]{2})?)\s+"
)
_ISO_PARTS = re.compile(
    r"(?P<base>[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2})"
    r"(?P<fraction>\.[0-9]{1,9})?(?P<zone>Z|[+-][0-9]{2}:?[0-9]{2})?"
)
_JOURNAL_HOST = re.compile(r"^\S+\s+kernel:\s+")
_MONOTONIC_PREFIX = re.compile(r"^\[\s*[0-9]+\.[0-9]+\]\s+")
_SYSLOG_PREFIX = re.compile(
    r"^[A-Z][a-z]{2}\s+[0-9]{1,2}\s+[0-9]{2}:[0-9]{2}:[0-9]{2}\s+\S+\s+kernel:\s+"
)
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})[^)]{0,32}\):"
    r"\s*(?P<code>[0-9]{1,4})\b"
)
_XID_PID = re.compile(r"\bpid=(?P<pid>[0-9]{1,7}\b|'<unknown>')")
_XID_NAME = re.compile(r"\bname=(?P<name>[^,]{0,64})")
# The driver's words for "no process": `pid='<unknown>', name=<unknown>`.
_NO_PROCESS_NAMES = {"<unknown>", "'<unknown>'"}
_BUS_ADDRESS = re.compile(
    r"\b(?:PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\b"
)
_FALLEN_OFF = re.compile(r"fallen off the bus", re.IGNORECASE)
_INIT_FAILED = re.compile(
    r"NVRM: GPU (?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]): RmInitAdapter failed!"
)
_KILLED = re.compile(
    r"(?P<cgroup>Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?):"
    r"\s+Kill(?:ed)? process (?P<pid>[0-9]{1,7}) \((?P<name>[^)]{0,64})\)"
)
_OOM_KILL_CONTEXT = re.compile(r"oom-kill:(?P<fields>constraint=\S+)")
_PID = re.compile(r"[0-9]{1,7}")


@dataclass(frozen=True)
class TimeWindow:
    """The job's run, widened on both sides by `slack` for clock skew between hosts."""

    start: datetime
    end: datetime
    slack: timedelta = timedelta(minutes=2)

    def contains(self, moment: datetime) -> bool:
        return self.start - self.slack <= moment <= self.end + self.slack


@dataclass(frozen=True)
class GpuInitFailure:
    """A GPU the driver tried and failed to bring up: no XID, and no nvidia-smi entry either."""

    pci_bus_id: str
    attempts: int
    first_time: datetime | None
    text: str


@dataclass(frozen=True)
class KernelLogFindings:
    """What the kernel said in the window: XID events, host OOM kills, GPUs that failed to
    initialise, and notes (on the reading, and one per GPU that failed to initialise)."""

    xid_events: tuple[XidEvent, ...]
    host_oom_kills: tuple[HostOomKill, ...]
    lines_read: int
    lines_in_window: int
    notes: tuple[str, ...] = ()
    gpu_init_failures: tuple[GpuInitFailure, ...] = ()


@dataclass(frozen=True)
class _Line:
    time: datetime | None
    text: str


def parse_kernel_log(
    text: str, *, catalog: XidCatalog, window: TimeWindow | None = None
) -> KernelLogFindings:
    """Find XID, bus-loss and OOM-kill lines; with a window, only those inside it.

    Total: any text gives findings (lines it cannot read are not evidence), never an error.
    """
    raw_lines = [raw for raw in text.split("\n") if raw.strip()]
    notes: list[str] = []
    if len(raw_lines) > MAX_LINES:
        notes.append(
            f"kernel log had {len(raw_lines)} lines: only the newest {MAX_LINES} were read"
        )
        raw_lines = raw_lines[-MAX_LINES:]
    if "\x00" in text:
        notes.append("kernel log held NUL bytes; they were ignored")
    if any(len(raw) > MAX_LINE_CHARS for raw in raw_lines):
        notes.append(f"kernel log lines longer than {MAX_LINE_CHARS} characters were cut")
    lines = [_split_line(raw) for raw in raw_lines]
    timed = [line for line in lines if line.time is not None]
    if window is None:
        selected = lines
    elif timed:
        selected = [line for line in timed if window.contains(_as_aware(line.time, window))]
    else:
        selected = lines
        if lines:
            notes.append("kernel log lines carry no wall-clock time: the window was not applied")
    xids = _xid_events(selected, catalog)
    kills = _oom_kills(selected)
    init_failures = _init_failures(selected)
    notes.extend(
        f"GPU {failure.pci_bus_id} failed to initialise (RmInitAdapter failed "
        f"x{failure.attempts}): the driver does not list it"
        for failure in init_failures
    )
    return KernelLogFindings(
        xid_events=xids,
        host_oom_kills=kills,
        lines_read=len(lines),
        lines_in_window=len(selected),
        notes=tuple(notes),
        gpu_init_failures=init_failures,
    )


def _split_line(raw: str) -> _Line:
    line = raw[:MAX_LINE_CHARS].replace("\x00", "").rstrip()
    match = _ISO_PREFIX.match(line)
    if match:
        rest = _JOURNAL_HOST.sub("", line[match.end() :], count=1)
        return _Line(time=_parse_iso(match.group("stamp")), text=rest)
    for prefix in (_SYSLOG_PREFIX, _MONOTONIC_PREFIX):
        stripped = prefix.sub("", line, count=1)
        if stripped != line:
            return _Line(time=None, text=stripped)
    return _Line(time=None, text=line.strip())


def _parse_iso(stamp: str) -> datetime | None:
    """dmesg writes `2026-11-22T03:09:34,846095+00:00`; journalctl writes `+0000`.

    None for a time no record can hold (a year out of 1970..9998, after its zone's offset).
    """
    match = _ISO_PARTS.fullmatch(stamp.replace(",", "."))
    if match is None:
        return None
    fraction = (match.group("fraction") or "")[:7]
    zone = (match.group("zone") or "").replace("Z", "+00:00")
    if len(zone) == 5:
        zone = f"{zone[:3]}:{zone[3:]}"
    try:
        moment = datetime.fromisoformat(f"{match.group('base')}{fraction}{zone}")
        in_utc = moment.astimezone(UTC) if moment.tzinfo is not None else moment
    except (ValueError, OverflowError):
        return None
    return moment if in_utc.year in _YEARS else None


def _as_aware(moment: datetime | None, window: TimeWindow) -> datetime:
    """Compare naive kernel times in the window's zone (dmesg iso always names a zone)."""
    assert moment is not None
    if moment.tzinfo is None and window.start.tzinfo is not None:
        return moment.replace(tzinfo=window.start.tzinfo)
    if moment.tzinfo is not None and window.start.tzinfo is None:
        return moment.replace(tzinfo=None)
    return moment


def _xid_events(lines: list[_Line], catalog: XidCatalog) -> tuple[XidEvent, ...]:
    events: list[XidEvent] = []
    buses_with_79: set[str] = set()
    for index, line in enumerate(lines):
        match = _XID.search(line.text)
        if match is not None:
            code = int(match.group("code"))
            pci = match.group("pci").lower()
            if code == FALLEN_OFF_THE_BUS_XID:
                buses_with_79.add(pci)
            events.append(_event(catalog, code, pci, line, line.text[match.end() :]))
            continue
        if _FALLEN_OFF.search(line.text):
            pci = _bus_near(lines, index)
            if pci is not None and pci in buses_with_79:
                continue
            if pci is not None:
                buses_with_79.add(pci)
            events.append(_event(catalog, FALLEN_OFF_THE_BUS_XID, pci, line, ""))
    return tuple(events)


def _bus_near(lines: list[_Line], index: int) -> str | None:
    """Multi-line NVRM messages name the GPU one or two lines before "fallen off the bus"."""
    for back in range(0, 3):
        if index - back < 0:
            break
        found = _BUS_ADDRESS.search(lines[index - back].text)
        if found:
            return found.group("pci").lower()
    return None


def _init_failures(lines: Iterable[_Line]) -> tuple[GpuInitFailure, ...]:
    """One record per GPU: the driver retries the same GPU on every open of the device."""
    failures: dict[str, GpuInitFailure] = {}
    for line in lines:
        match = _INIT_FAILED.search(line.text)
        if match is None:
            continue
        pci = match.group("pci").lower()
        first = failures.get(pci)
        failures[pci] = GpuInitFailure(
            pci_bus_id=pci,
            attempts=(first.attempts if first else 0) + 1,
            first_time=first.first_time if first else line.time,
            text=first.text if first else line.text,
        )
    return tuple(failures.values())


def _event(catalog: XidCatalog, code: int, pci: str | None, line: _Line, rest: str) -> XidEvent:
    entry = catalog.entry(code)
    pid_match = _XID_PID.search(rest)
    pid = _pid(pid_match.group("pid")) if pid_match else None
    name_match = _XID_NAME.search(rest)
    name = name_match.group("name").strip() if name_match else None
    if name in _NO_PROCESS_NAMES:
        name = None
    return XidEvent(
        code=code,
        pci_bus_id=pci,
        pid=pid,
        process_name=name or None,
        time=line.time,
        text=line.text,
        policy=entry.policy,
        meaning=entry.meaning,
    )


def _oom_kills(lines: Iterable[_Line]) -> tuple[HostOomKill, ...]:
    """One record per killed pid: the `oom-kill:` context line and the `Killed process` line
    describe the same kill, and the context line is the one that says it was a cgroup's limit."""
    kills: dict[int, HostOomKill] = {}
    memcg_pids: set[int] = set()
    for line in lines:
        context = _OOM_KILL_CONTEXT.search(line.text)
        if context is not None:
            fields = _context_fields(context.group("fields"))
            pid = _pid(fields.get("pid", ""))
            if fields.get("constraint") == "CONSTRAINT_MEMCG" and pid is not None:
                memcg_pids.add(pid)
            continue
        killed = _KILLED.search(line.text)
        pid = _pid(killed.group("pid")) if killed is not None else None
        if killed is None or pid is None:
            continue
        kills.setdefault(
            pid,
            HostOomKill(
                time=line.time,
                pid=pid,
                process_name=killed.group("name"),
                cgroup=killed.group("cgroup").startswith("Memory cgroup"),
                text=line.text,
            ),
        )
    return tuple(
        kill if kill.cgroup or kill.pid not in memcg_pids else _with_cgroup(kill)
        for kill in kills.values()
    )


def _pid(text: str) -> int | None:
    """A pid as Linux can have one (ASCII digits, at most PID_MAX_LIMIT), else None."""
    if not _PID.fullmatch(text):
        return None
    pid = int(text)
    return pid if pid <= MAX_PID else None


def _with_cgroup(kill: HostOomKill) -> HostOomKill:
    return HostOomKill(
        time=kill.time, pid=kill.pid, process_name=kill.process_name, cgroup=True, text=kill.text
    )


def _context_fields(text: str) -> dict[str, str]:
    """`constraint=...,nodemask=0-2,4,...,pid=10,uid=0`: commas also split NUMA lists, so
    only `key=value` pieces count."""
    fields: dict[str, str] = {}
    for piece in text.split(","):
        key, sep, value = piece.partition("=")
        if sep:
            fields[key] = value
    return fields
