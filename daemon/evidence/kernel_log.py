"""Kernel log lines that matter for a GPU job's death, limited to the job's time window.

Reads `dmesg --time-format iso` (or `journalctl -k -o short-iso`) text: NVIDIA XID lines,
"fallen off the bus" lines that some drivers print without an XID, and host OOM-killer
lines (global and memory cgroup). Pure: text in, typed records out. Lines without a
usable timestamp are kept only when the whole log has none, and the findings say so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from daemon.evidence.records import HostOomKill, XidEvent
from daemon.evidence.xid import XidCatalog

FALLEN_OFF_THE_BUS_XID = 79
MAX_LINE_CHARS = 4096

_ISO_PREFIX = re.compile(
    r"^(?P<stamp>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[,.]\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})?)\s+"
)
_JOURNAL_HOST = re.compile(r"^\S+\s+kernel:\s+")
_MONOTONIC_PREFIX = re.compile(r"^\[\s*\d+\.\d+\]\s+")
_SYSLOG_PREFIX = re.compile(r"^[A-Z][a-z]{2}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2}\s+\S+\s+kernel:\s+")
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})[^)]*\):\s*"
    r"(?P<code>\d{1,4})\b(?P<rest>.*)$"
)
_XID_PID = re.compile(r"\bpid=(?P<pid>\d+|'<unknown>')")
_XID_NAME = re.compile(r"\bname=(?P<name>[^,]*)")
_BUS_ADDRESS = re.compile(
    r"\b(?:PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\b"
)
_FALLEN_OFF = re.compile(r"fallen off the bus", re.IGNORECASE)
_KILLED = re.compile(
    r"(?P<cgroup>Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?):"
    r"\s+Kill(?:ed)? process (?P<pid>\d+) \((?P<name>[^)]*)\)"
)
_OOM_KILL_CONTEXT = re.compile(r"oom-kill:(?P<fields>constraint=\S+)")


@dataclass(frozen=True)
class TimeWindow:
    """The job's run, widened on both sides by `slack` for clock skew between hosts."""

    start: datetime
    end: datetime
    slack: timedelta = timedelta(minutes=2)

    def contains(self, moment: datetime) -> bool:
        return self.start - self.slack <= moment <= self.end + self.slack


@dataclass(frozen=True)
class KernelLogFindings:
    """What the kernel said in the window: XID events, host OOM kills, and reading notes."""

    xid_events: tuple[XidEvent, ...]
    host_oom_kills: tuple[HostOomKill, ...]
    lines_read: int
    lines_in_window: int
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Line:
    time: datetime | None
    text: str


def parse_kernel_log(
    text: str, *, catalog: XidCatalog, window: TimeWindow | None = None
) -> KernelLogFindings:
    """Find XID, bus-loss and OOM-kill lines; with a window, only those inside it."""
    lines = [_split_line(raw) for raw in text.split("\n") if raw.strip()]
    notes: list[str] = []
    if any("\x00" in line.text for line in lines):
        notes.append("kernel log held NUL bytes; they were ignored")
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
    return KernelLogFindings(
        xid_events=xids,
        host_oom_kills=kills,
        lines_read=len(lines),
        lines_in_window=len(selected),
        notes=tuple(notes),
    )


def _split_line(raw: str) -> _Line:
    line = raw.replace("\x00", "")[:MAX_LINE_CHARS].rstrip()
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
    """dmesg writes `2026-11-22T03:09:34,846095+00:00`; journalctl writes `+0000`."""
    normalised = stamp.replace(",", ".").replace("Z", "+00:00")
    match = re.match(r"^(.*T\d{2}:\d{2}:\d{2})(\.\d+)?(.*)$", normalised)
    if match is None:
        return None
    base, fraction, zone = match.groups()
    fraction = (fraction or "")[:7]
    if zone and re.fullmatch(r"[+-]\d{4}", zone):
        zone = f"{zone[:3]}:{zone[3:]}"
    try:
        return datetime.fromisoformat(f"{base}{fraction}{zone}")
    except ValueError:
        return None


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
            events.append(_event(catalog, code, pci, line, match.group("rest")))
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


def _event(catalog: XidCatalog, code: int, pci: str | None, line: _Line, rest: str) -> XidEvent:
    entry = catalog.entry(code)
    pid_match = _XID_PID.search(rest)
    pid = int(pid_match.group("pid")) if pid_match and pid_match.group("pid").isdigit() else None
    name_match = _XID_NAME.search(rest)
    name = name_match.group("name").strip() if name_match else None
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
            if fields.get("constraint") == "CONSTRAINT_MEMCG" and fields.get("pid", "").isdigit():
                memcg_pids.add(int(fields["pid"]))
            continue
        killed = _KILLED.search(line.text)
        if killed is None:
            continue
        pid = int(killed.group("pid"))
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
