"""What one line of a job log says: its launcher prefixes (rank, node, process), the traceback
frames and exception lines, and whether it can be a root failure.

The backward reader (`log_reader`), the collector in `joblog` and the forward pass
(`log_analysis`) all read lines through these: one vocabulary, so the reading side's test of a
root failure far from the end agrees with what the analysis later makes of the same line.
Every pattern runs in linear time and sees at most twice `MATCH_CHARS` of a line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from daemon.evidence.failures import CASCADES, gpu_fault
from daemon.evidence.launchers import MAX_PREFIXES, PREFIXES, RankKind
from daemon.evidence.oom_family import detect_family
from daemon.evidence.records import MAX_PID, MAX_RANK, OomFamily
from daemon.evidence.units import bounded_int

# Of a longer line (of its last `\r` redraw), only the first and the last 8 KB are matched
# against the per-line patterns: every failure line we read fits, and no line costs more.
MATCH_CHARS = 8 * 1024
TRACEBACK_START = "Traceback (most recent call last):"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# Any of the launchers' prefixes in one pattern, one group per prefix: a line is tested once at
# C speed, and the group that matched says which prefix to read the rank and host from.
_ANY_PREFIX = re.compile(
    "|".join(f"({re.sub(r'[(][?]P<[a-z]+>', '(?:', p.pattern.pattern)})" for p in PREFIXES)
)
_NCCL_HOST = re.compile(r"^(?P<host>[\w.\-]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\]")
FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+, in (?P<func>[\w<>.]+)')
# The lookbehind starts a path only where a run of path characters starts: linear time.
RICH_FRAME = re.compile(r"(?<![\w./\\\-])(?P<path>[\w./\\\-]+\.py):\d+\s+in\s+(?P<func>[\w<>]+)")
EXCEPTION = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Exhausted))"
    r"(?::\s?(?P<message>.*))?\Z"
)
# Cascade lines (any kind), for the reading side's test of a root failure far from the end.
_CASCADE = re.compile("|".join(f"(?:{pattern.pattern})" for _, pattern in CASCADES))


def is_root_candidate(text: str) -> bool:
    """Whether a line can be a root failure: a device OOM, a GPU fault, or an exception that is
    no cascade. The backward reader asks it of the lines far from the end that hold a trigger."""
    body = matchable(strip_line(text)[3])
    family = detect_family(body)
    if family is not None and family is not OomFamily.HOST_RAM:
        return True
    match = EXCEPTION.match(body)
    if match is not None and _CASCADE.search(body) is None:
        return True
    return gpu_fault(body) is not None


@dataclass(frozen=True)
class LinePrefixes:
    """What the prefixes stripped from a line named: its rank (and what that rank counts)."""

    rank: int | None = None
    kind: RankKind | None = None
    host: str | None = None
    pid: int | None = None


def strip_line(text: str) -> tuple[int | None, str | None, str | None, str]:
    """Remove colour codes, prefixes and tqdm redraws: (rank, what the rank counts, node, body).

    The prefixes are the launchers' (`launchers.PREFIXES`): timestamps, `[rankN]:`, srun's
    `N: `, pdsh's `host: `, Ray's `(pid=N, ip=IP)`, glog heads... The body is whole (a JSON
    error line is parsed whole); patterns see `matchable(body)`.
    """
    found, body = split_prefixes(text)
    return found.rank, found.kind, node_of(found, body), body


def node_of(found: LinePrefixes, body: str) -> str | None:
    """The node a line's prefixes name, or NCCL's `host:pid:tid [dev]` head of its body."""
    if found.host is None and (match := _NCCL_HOST.match(body)):
        return match.group("host")
    return found.host


def split_prefixes(text: str) -> tuple[LinePrefixes, str]:
    """What `strip_line` reads, with the process id a prefix names (Ray's `(Actor pid=N)`)."""
    body = _ANSI.sub("", text)
    found, body = _strip_prefixes(body, LinePrefixes())
    if "\r" in body:
        segments = [segment for segment in body.split("\r") if segment.strip()]
        body = segments[-1] if segments else ""
        found, body = _strip_prefixes(body, found)
    return found, body


def _strip_prefixes(body: str, found: LinePrefixes) -> tuple[LinePrefixes, str]:
    """Strip the prefixes at the start of `body`. The innermost global rank wins; a local rank
    replaces only an srun task id (srun's label on a node running torchrun is the node's task)."""
    rank, kind, host, pid = found.rank, found.kind, found.host, found.pid
    for _ in range(MAX_PREFIXES):
        which = _ANY_PREFIX.match(body)
        if which is None or which.lastindex is None:
            break
        prefix = PREFIXES[which.lastindex - 1]
        match = prefix.pattern.match(body)
        if match is None:  # the same pattern, named: cannot differ
            break
        groups = match.groupdict()
        host = groups.get("host") or host
        if groups.get("pid") is not None:
            pid = bounded_int(groups["pid"], MAX_PID)
        named = prefix.rank_kind
        if named is not None and groups.get("rank") is not None and _takes_over(kind, named):
            rank, kind = bounded_int(groups["rank"], MAX_RANK), named
        body = body[match.end() :]
    if (rank, kind, host, pid) == (found.rank, found.kind, found.host, found.pid):
        return found, body
    return LinePrefixes(rank, kind, host, pid), body


def _takes_over(current: RankKind | None, new: RankKind) -> bool:
    if current is None or new is RankKind.GLOBAL:
        return True
    return current is not RankKind.GLOBAL and new is not RankKind.TASK


def matchable(text: str) -> str:
    """What the per-line patterns see of a line: all of it, or its two ends if it is long."""
    if len(text) <= 2 * MATCH_CHARS:
        return text
    return f"{text[:MATCH_CHARS]} [...] {text[-MATCH_CHARS:]}"
