"""Pure parsers for the three nvidia-smi outputs the node probe collects.

- `nvidia-smi -q -d ROW_REMAPPER,ECC[,PAGE_RETIREMENT]`: one indented block per GPU. The
  field names changed across drivers (470: "Single Bit"/"Double Bit" per memory; 510+:
  SRAM/DRAM; 550+: "SRAM Uncorrectable Parity"/"SEC-DED"); all of them are read.
- `--query-gpu=index,uuid,pci.bus_id,memory.total,memory.used --format=csv,noheader`
- `--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader`

"N/A", "[Not Supported]" and friends are normal values and read as None, never as errors.
A GPU the driver holds but cannot reach (`Unable to determine the device handle for GPU ...`,
printed where its block or row would be) is named in the error, wherever it appears.
Anything else the parsers cannot read raises `NvidiaSmiParseError` naming the line, the only
error they raise: a node's GPU state read in part is not read, so one bad line fails the
whole output (the probe then calls the node unreadable, never healthy). Numbers are ASCII
digits within range; lines and line counts are bounded before anything is matched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from daemon.evidence.records import MAX_GPU_INDEX, MAX_PID

MIB = 1024 * 1024
MAX_GPUS = 64
# A driver 550 `-q` block of one GPU is about 300 lines with every section; `-d` fewer.
MAX_QUERY_LINES = MAX_GPUS * 1000
MAX_LINE_CHARS = 4096
# A process name nvidia-smi prints is a path; longer ones are cut, not refused, so that a
# co-tenant cannot make the output unreadable by its own name.
MAX_PROCESS_NAME_CHARS = 1024
# A counter (ECC errors, remapped rows, retired pages): 15 digits is beyond any GPU's life
# and leaves the sums of several counters far inside a signed 64-bit column.
_COUNTER = re.compile(r"[0-9]{1,15}")
_LONG_NUMBER = re.compile(r"[0-9]{16,}")
_UNAVAILABLE = {
    "n/a",
    "[n/a]",
    "[not supported]",
    "not supported",
    "[unknown error]",
    "unknown error",
    "[insufficient permissions]",
    "[gpu requires reset]",
    "[not found]",
    "[no data]",
    "none",
    "",
}
_GPU_HEADER = re.compile(r"GPU (?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*")
# 2**30 MiB is an exbibyte: no GPU's memory, and its bytes fit in 64 bits.
_MEMORY = re.compile(r"(?P<n>[0-9]{1,10})\s*MiB")
_MAX_MIB = 2**30
# What nvidia-smi prints in place of a GPU it cannot query (fallen off the bus, lost, needing a
# reset). Drivers name the GPU by bus id (`GPU 0000:0B:00.0`, `GPU0000:20:00.0`), by index and
# bus id (`GPU1: 0000:34:00.0`) or by index alone (`GPU1`); the reason follows the last colon.
_UNREACHABLE_GPU = re.compile(
    r"Unable to determine the device handle for GPU ?(?:(?P<index>[0-9]{1,3}): ?)?"
    r"(?:(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]): ?)?(?P<reason>.{0,200})",
    re.IGNORECASE,
)


class NvidiaSmiParseError(ValueError):
    """nvidia-smi printed something that is not the format we know; the message shows it."""


@dataclass(frozen=True)
class GpuMemoryHealth:
    """One GPU's block of `nvidia-smi -q -d ROW_REMAPPER,ECC`; None where not reported."""

    pci_bus_id: str
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure_occurred: bool | None = None
    ecc_volatile_correctable: int | None = None
    ecc_volatile_uncorrectable: int | None = None
    ecc_aggregate_correctable: int | None = None
    ecc_aggregate_uncorrectable: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None


@dataclass(frozen=True)
class GpuQueryRow:
    """One line of `--query-gpu=index,uuid,pci.bus_id,memory.total,memory.used`."""

    index: int
    uuid: str | None
    pci_bus_id: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None


@dataclass(frozen=True)
class ComputeAppRow:
    """One line of `--query-compute-apps=gpu_uuid,pid,process_name,used_memory`."""

    gpu_uuid: str
    pid: int | None
    process_name: str | None
    used_bytes: int | None


@dataclass(frozen=True)
class UnreachableGpu:
    """A GPU nvidia-smi knows of but cannot query; its state is unknown, never healthy."""

    index: int | None
    pci_bus_id: str | None
    reason: str

    def describe(self) -> str:
        """`GPU 1 (0000:34:00.0)`, or whichever of the two the driver printed."""
        if self.index is not None and self.pci_bus_id is not None:
            return f"GPU {self.index} ({self.pci_bus_id})"
        if self.index is not None:
            return f"GPU {self.index}"
        return f"GPU {self.pci_bus_id or '?'}"


@dataclass
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    value: str | None = None


def normalise_bus_id(bus_id: str) -> str:
    """`00000000:3B:00.0` and `0000:3b:00.0` name the same GPU: compare as 4-digit lower case."""
    domain, _, rest = bus_id.strip().partition(":")
    return f"{domain[-4:].rjust(4, '0')}:{rest}".lower()


def find_unreachable_gpus(text: str) -> tuple[UnreachableGpu, ...]:
    """The GPUs any nvidia-smi output says it cannot reach, in order; total, never raises."""
    found = []
    for line in text.split("\n")[:MAX_QUERY_LINES]:
        gpu = _unreachable(line[:MAX_LINE_CHARS])
        if gpu is not None:
            found.append(gpu)
    return tuple(found)


def parse_query(text: str) -> tuple[GpuMemoryHealth, ...]:
    """Read the per-GPU blocks of `nvidia-smi -q -d ...`; a GPU header starts each block."""
    blocks: list[tuple[str, list[str]]] = []
    for number, raw in enumerate(_lines(text, MAX_QUERY_LINES), start=1):
        line = raw.rstrip()
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARS:
            raise NvidiaSmiParseError(f"line {number} is longer than {MAX_LINE_CHARS} characters")
        _refuse_unreachable(line, number)
        header = _GPU_HEADER.fullmatch(line)
        if header is not None:
            if len(blocks) >= MAX_GPUS:
                raise NvidiaSmiParseError(f"more than {MAX_GPUS} GPU blocks")
            blocks.append((header.group("bus"), []))
        elif blocks and line.startswith(" "):
            blocks[-1][1].append(line)
        elif not blocks and (":" in line or line.startswith("=")):
            continue  # the preamble: banner, timestamp, driver version, GPU count
        else:
            raise NvidiaSmiParseError(f"line {number} is not nvidia-smi -q output: {line[:120]!a}")
    return tuple(_memory_health(bus, _tree(lines)) for bus, lines in blocks)


def parse_gpu_rows(text: str) -> tuple[GpuQueryRow, ...]:
    """Read `index, uuid, pci.bus_id, memory.total, memory.used` CSV without a header."""
    rows: list[GpuQueryRow] = []
    for number, line in _csv_lines(text):
        if len(line) > MAX_LINE_CHARS:
            raise NvidiaSmiParseError(
                f"query-gpu line {number} is longer than {MAX_LINE_CHARS} characters"
            )
        _refuse_unreachable(line, number)
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 5:
            raise NvidiaSmiParseError(f"query-gpu line {number} has {len(cells)} fields, not 5")
        index = _int(cells[0])
        if index is None or index > MAX_GPU_INDEX:
            raise NvidiaSmiParseError(f"query-gpu line {number} has no GPU index: {line[:120]!a}")
        rows.append(
            GpuQueryRow(
                index=index,
                uuid=_text(cells[1]),
                pci_bus_id=_text(cells[2]),
                memory_total_bytes=_mib(cells[3], number),
                memory_used_bytes=_mib(cells[4], number),
            )
        )
    return tuple(rows)


def parse_compute_apps(text: str) -> tuple[ComputeAppRow, ...]:
    """Read `gpu_uuid, pid, process_name, used_memory` CSV; a name may itself hold commas."""
    rows: list[ComputeAppRow] = []
    for number, line in _csv_lines(text):
        if line.strip().lower().startswith("no running"):
            continue
        _refuse_unreachable(line[:MAX_LINE_CHARS], number)
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) < 4:
            raise NvidiaSmiParseError(f"compute-apps line {number} has {len(cells)} fields, not 4")
        uuid = _text(cells[0])
        if uuid is None or len(uuid) > MAX_LINE_CHARS:
            raise NvidiaSmiParseError(f"compute-apps line {number} names no GPU: {line[:120]!a}")
        pid = _int(cells[1])
        if pid is not None and pid > MAX_PID:
            raise NvidiaSmiParseError(f"compute-apps line {number}: pid {pid} is beyond Linux's")
        name = _text(", ".join(cells[2:-1]))
        rows.append(
            ComputeAppRow(
                gpu_uuid=uuid,
                pid=pid,
                process_name=name[:MAX_PROCESS_NAME_CHARS] if name is not None else None,
                used_bytes=_mib(cells[-1], number),
            )
        )
    return tuple(rows)


def _unreachable(line: str) -> UnreachableGpu | None:
    match = _UNREACHABLE_GPU.match(line.strip())
    if match is None:
        return None
    index = match.group("index")
    return UnreachableGpu(
        index=int(index) if index is not None else None,
        pci_bus_id=match.group("bus"),
        reason=match.group("reason").strip() or "no reason given",
    )


def _refuse_unreachable(line: str, number: int) -> None:
    """A GPU nvidia-smi cannot reach leaves the node's GPU state unread, whatever else printed."""
    gpu = _unreachable(line)
    if gpu is not None:
        raise NvidiaSmiParseError(
            f"line {number}: nvidia-smi cannot reach {gpu.describe()}: {gpu.reason}"
        )


def _csv_lines(text: str) -> list[tuple[int, str]]:
    lines = [(n, line) for n, line in enumerate(_lines(text, MAX_QUERY_LINES), start=1)]
    lines = [(n, line) for n, line in lines if line.strip()]
    if len(lines) > MAX_GPUS * 64:
        raise NvidiaSmiParseError(f"{len(lines)} CSV lines is more than any node prints")
    return lines


def _lines(text: str, limit: int) -> list[str]:
    """Only newlines end lines: str.splitlines() would also split on \x1e or U+2028 in a name.

    Counted before they are split: a million empty lines is no output of nvidia-smi.
    """
    if text.count("\n") >= limit:
        raise NvidiaSmiParseError(f"more than {limit} lines is more than any node prints")
    return [line.removesuffix("\r") for line in text.split("\n")]


def _tree(lines: list[str]) -> _Node:
    """Indentation is the structure: `Key : value` leaves under `Section` headers."""
    root = _Node()
    stack: list[tuple[int, _Node]] = [(-1, root)]
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        key, sep, value = line.strip().partition(":")
        key = key.strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else root
        node = parent.children.setdefault(key, _Node())
        if sep and value.strip():
            node.value = value.strip()
        else:
            stack.append((indent, node))
    return root


def _get(node: _Node, *path: str) -> _Node | None:
    current: _Node | None = node
    for key in path:
        if current is None:
            return None
        current = current.children.get(key)
    return current


def _count(node: _Node | None) -> int | None:
    return None if node is None else _int(node.value or "")


def _flag(node: _Node | None) -> bool | None:
    if node is None or node.value is None:
        return None
    value = node.value.strip().lower()
    if value in ("yes", "true"):
        return True
    if value in ("no", "false"):
        return False
    return None


def _sum(*counts: int | None) -> int | None:
    present = [count for count in counts if count is not None]
    return sum(present) if present else None


def _ecc(errors: _Node | None, span: str, kind: str) -> int | None:
    """Errors of one span (Volatile/Aggregate) and kind (Correctable/Uncorrectable)."""
    section = _get(errors, span) if errors is not None else None
    if section is None:
        return None
    if kind == "Correctable":
        return _sum(
            _count(_get(section, "SRAM Correctable")),
            _count(_get(section, "DRAM Correctable")),
            _count(_get(section, "Single Bit", "Total")),
        )
    return _sum(
        _count(_get(section, "SRAM Uncorrectable")),
        _count(_get(section, "SRAM Uncorrectable Parity")),
        _count(_get(section, "SRAM Uncorrectable SEC-DED")),
        _count(_get(section, "DRAM Uncorrectable")),
        _count(_get(section, "Double Bit", "Total")),
    )


def _memory_health(bus: str, root: _Node) -> GpuMemoryHealth:
    errors = _get(root, "ECC Errors")
    rows = _get(root, "Remapped Rows")
    pages = _get(root, "Retired Pages")
    pending_pages = _get(pages, "Pending Page Blacklist") if pages else None
    if pages is not None and pending_pages is None:
        pending_pages = _get(pages, "Pending")
    return GpuMemoryHealth(
        pci_bus_id=bus,
        remapped_rows_correctable=_count(_get(rows, "Correctable Error")) if rows else None,
        remapped_rows_uncorrectable=_count(_get(rows, "Uncorrectable Error")) if rows else None,
        remap_pending=_flag(_get(rows, "Pending")) if rows else None,
        remap_failure_occurred=_flag(_get(rows, "Remapping Failure Occurred")) if rows else None,
        ecc_volatile_correctable=_ecc(errors, "Volatile", "Correctable"),
        ecc_volatile_uncorrectable=_ecc(errors, "Volatile", "Uncorrectable"),
        ecc_aggregate_correctable=_ecc(errors, "Aggregate", "Correctable"),
        ecc_aggregate_uncorrectable=_ecc(errors, "Aggregate", "Uncorrectable"),
        retired_pages_single_bit=_retired(pages, "Single Bit ECC"),
        retired_pages_double_bit=_retired(pages, "Double Bit ECC"),
        retired_pages_pending=_flag(pending_pages),
    )


def _retired(pages: _Node | None, name: str) -> int | None:
    """Drivers print the count on the line itself, or under it as `Retired Count`."""
    node = _get(pages, name) if pages is not None else None
    if node is None:
        return None
    if node.value is not None:
        return _count(node)
    return _count(_get(node, "Retired Count"))


def _int(value: str) -> int | None:
    """A counter in ASCII digits; None for "N/A" and other words nvidia-smi prints instead."""
    cleaned = value.strip()
    if _COUNTER.fullmatch(cleaned):
        return int(cleaned)
    if _LONG_NUMBER.fullmatch(cleaned):
        raise NvidiaSmiParseError(f"{cleaned[:40]}... is more digits than any counter holds")
    return None


def _text(value: str) -> str | None:
    cleaned = value.strip()
    return None if cleaned.lower() in _UNAVAILABLE else cleaned


def _mib(value: str, number: int) -> int | None:
    cleaned = value.strip()
    if cleaned.lower() in _UNAVAILABLE:
        return None
    match = _MEMORY.fullmatch(cleaned)
    if match is None or int(match.group("n")) > _MAX_MIB:
        raise NvidiaSmiParseError(f"line {number}: {cleaned[:40]!a} is not a MiB amount")
    return int(match.group("n")) * MIB
