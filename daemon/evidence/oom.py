"""The out-of-memory message parser: which software ran out, and every number it printed.

Pure: text in, `OomReport` out. Each figure is read by its own pattern, so a message cut in
the middle (a truncated log) keeps the numbers it still holds and loses only the rest.
Sizes are exact to what was printed (see `units`): PyTorch rounds to 0.01 of the unit.
Every pattern runs in linear time on any text, and a figure beyond its plausible range (a size
beyond 1 EiB, a pid beyond Linux's limit) is dropped with a note on the report, never stored.

PyTorch wordings covered, oldest first:
- 1.0-1.3: `(GPU 0; X total capacity; Y already allocated; Z free; W cached)`
- 1.4-2.0: `...; W reserved in total by PyTorch)`, later with the `max_split_size_mb` hint
- 2.1: `GPU 0 has a total capacty of X of which Y is free. [Process N has X memory in use.]
  [Including non-PyTorch memory, this process has X memory in use.] Of the allocated memory
  A is allocated by PyTorch, and B is reserved by PyTorch but unallocated.` (sic: capacty)
- 2.2+: `capacity`, `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, then private pools
  (`with P allocated in private pools (e.g., CUDA Graphs)`) and `PYTORCH_ALLOC_CONF`.
"""

from __future__ import annotations

import re

from daemon.evidence.records import MAX_GPU_INDEX, MAX_PID, OomFamily, OomReport, OtherProcess
from daemon.evidence.units import (
    MAX_BYTES,
    SIZE_PATTERN,
    SizeParseError,
    bounded_int,
    size_from_parts,
)

MAX_MESSAGE_CHARS = 4096  # an OOM message is one long line; anything beyond is not its text
MESSAGE_LEAD_CHARS = 200  # kept before the first trigger: the exception type and prefixes


def _size(name: str) -> str:
    """SIZE_PATTERN with its groups renamed, so several sizes can live in one pattern."""
    return SIZE_PATTERN.replace("?P<number>", f"?P<{name}_n>").replace("?P<unit>", f"?P<{name}_u>")


_TORCH_OOM = re.compile(
    r"(?:CUDA|HIP|XPU) out of memory\.|OutOfMemoryError|MPS backend out of memory", re.IGNORECASE
)
_REQUESTED = re.compile(r"Tried to allocate " + _size("v"))
_GPU_INDEX = re.compile(r"\(GPU ([0-9]{1,30});|GPU ([0-9]{1,30}) has a total capac")
_TOTAL_OLD = re.compile(_size("v") + r" total capac(?:ity|ty)\b")
_TOTAL_NEW = re.compile(r"total capac(?:ity|ty) of " + _size("v"))
_ALLOCATED_OLD = re.compile(_size("v") + r" already allocated")
_FREE_OLD = re.compile(_size("v") + r" free[;)]")
_FREE_NEW = re.compile(r"of which " + _size("v") + r" is free")
_RESERVED_OLD = re.compile(_size("v") + r" reserved in total by PyTorch", re.IGNORECASE)
# 1.0-1.3 printed `cached` as the cached-but-unallocated part (it can be below `allocated`).
_CACHED_OLD = re.compile(_size("v") + r" cached\)")
_ALLOCATED_NEW = re.compile(r"Of the allocated memory " + _size("v") + r" is allocated by PyTorch")
_PRIVATE_POOL = re.compile(r"with " + _size("v") + r" allocated in private pools")
_UNALLOCATED_NEW = re.compile(_size("v") + r" is reserved by PyTorch but unallocated")
_THIS_PROCESS = re.compile(r"this process has " + _size("v") + r" memory in use")
_OTHER_PROCESS = re.compile(r"Process (?P<pid>[0-9]{1,30}) has " + _size("v") + r" memory in use")
_ALLOC_CONF = re.compile(r"\b(PYTORCH_(?:CUDA_|HIP_)?ALLOC_CONF)\b(?:=([\w:,.]*\w))?")
_MAX_SPLIT_HINT = re.compile(r"max_split_size_mb")

_XLA = re.compile(r"RESOURCE_EXHAUSTED|Resource exhausted|OOM when allocating tensor", re.I)
_XLA_REQUEST = re.compile(
    r"(?:trying to allocate|allocating) ([0-9]{1,30}) bytes|\(([0-9]{1,30})B\)"
)
_XLA_REQUEST_SIZE = re.compile(
    r"(?:trying to allocate|allocate request for|allocating) " + _size("v")
)
_NCCL = re.compile(r"NCCL WARN Cuda failure (?:\d+ )?'out of memory'")
_NCCL_REQUEST = re.compile(r"Failed to CUDA calloc (?:async )?([0-9]{1,30}) bytes")
_CUBLAS = re.compile(r"CUBLAS_STATUS_ALLOC_FAILED")
_CUDNN = re.compile(r"CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_WORKSPACE)", re.IGNORECASE)
_CUDA_RUNTIME = re.compile(
    r"CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"
    r"|cuda runtime error \(2\) : out of memory"
)
_HOST_RAM = re.compile(
    r"Detected \d+ oom[-_]kill event"
    r"|oom[-_]kill event"
    r"|: tasks? [\d\-,]+: Out Of Memory"
    r"|Out of memory: Kill(?:ed)? process \d+"
    r"|Memory cgroup out of memory"
    r"|DataLoader worker \(pids?(?:\(s\))? [\d, ]+\) is killed by signal: Killed"
    r"|\bKilled process \d+ \("
    r"|[Ee]xceeded (?:job|step) memory limit"
    r"|exceeded memory limit \(\d+ > \d+\), being killed"
    r"|(?P<sigkill>"
    r"^[^\S\n]*Killed[^\S\n]*$"  # a line of its own (not \s*, which would run across lines)
    r"|line \d+:\s+\d+ Killed\b"
    r"|: tasks? [\d\-,]+: Killed\b"
    r"|exitcode\s*:\s*-9\b"
    r"|failed \(exitcode: -9\)"
    r"|Signal 9 \(SIGKILL\) received"
    r")",
    re.MULTILINE,
)


def detect_family(text: str) -> OomFamily | None:
    """Which OOM family a line belongs to, or None if it reports no out-of-memory."""
    if _HOST_RAM.search(text):
        return OomFamily.HOST_RAM
    if _NCCL.search(text):
        return OomFamily.NCCL
    if _CUBLAS.search(text):
        return OomFamily.CUBLAS
    if _CUDNN.search(text):
        return OomFamily.CUDNN
    if _TORCH_OOM.search(text):
        return OomFamily.TORCH_ALLOCATOR
    if _XLA.search(text) and re.search(r"memory|allocat", text, re.IGNORECASE):
        return OomFamily.XLA
    if _CUDA_RUNTIME.search(text):
        return OomFamily.CUDA_RUNTIME
    return None


def parse_oom(text: str) -> OomReport | None:
    """The OOM report in `text` (one message, possibly with lines that follow it), or None."""
    family = detect_family(text)
    return None if family is None else parse_oom_as(text, family)


def parse_oom_as(text: str, family: OomFamily) -> OomReport:
    """`parse_oom` of a text whose family `detect_family` gave already (a scan asks once)."""
    text = _around_message(text)
    message = _first_matching_line(text, family)
    notes: list[str] = []
    if family is OomFamily.TORCH_ALLOCATOR:
        return _torch_report(message, notes)
    requested = None
    if family is OomFamily.XLA:
        requested = _int(_XLA_REQUEST, text, MAX_BYTES, "requested bytes", notes)
        if requested is None:
            requested = _bytes(_XLA_REQUEST_SIZE, text, "requested size", notes)
    elif family is OomFamily.NCCL:
        requested = _int(_NCCL_REQUEST, text, MAX_BYTES, "requested bytes", notes)
    return OomReport(family=family, message=message, requested_bytes=requested, notes=tuple(notes))


def _around_message(text: str) -> str:
    """The message and what follows it, bounded: a huge line must not hide or slow the parse."""
    starts = [
        match.start()
        for pattern in (_HOST_RAM, _NCCL, _CUBLAS, _CUDNN, _TORCH_OOM, _XLA, _CUDA_RUNTIME)
        if (match := pattern.search(text)) is not None
    ]
    start = max(0, min(starts) - MESSAGE_LEAD_CHARS)
    return text[start : start + MAX_MESSAGE_CHARS]


def _first_matching_line(text: str, family: OomFamily) -> str:
    lines = text.splitlines()
    if len(lines) == 1:
        return lines[0].strip()  # the message itself: no need to detect its family again
    for line in lines:
        if detect_family(line) is family:
            return line.strip()
    return text.strip()


def _torch_report(message: str, notes: list[str]) -> OomReport:
    def size(pattern: re.Pattern[str], what: str) -> int | None:
        return _bytes(pattern, message, what, notes)

    allocated_old = size(_ALLOCATED_OLD, "already allocated")
    reserved_old = size(_RESERVED_OLD, "reserved in total")
    allocated_new = size(_ALLOCATED_NEW, "allocated by PyTorch")
    unallocated_new = size(_UNALLOCATED_NEW, "reserved but unallocated")
    allocated = allocated_new if allocated_new is not None else allocated_old
    cached_unallocated = size(_CACHED_OLD, "cached")
    if unallocated_new is None:
        unallocated_new = cached_unallocated
    if unallocated_new is not None:
        unallocated: int | None = unallocated_new
        reserved = None if allocated is None else allocated + unallocated_new
    else:
        reserved = reserved_old
        unallocated = (
            None if reserved_old is None or allocated is None else max(0, reserved_old - allocated)
        )
    if reserved is not None and reserved > MAX_BYTES:
        notes.append(f"reserved bytes {reserved} (allocated + unallocated) beyond 1 EiB: dropped")
        reserved = None
    conf = _ALLOC_CONF.search(message)
    free_new = size(_FREE_NEW, "free")
    total_new = size(_TOTAL_NEW, "total capacity")
    return OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message=message,
        requested_bytes=size(_REQUESTED, "requested size"),
        total_bytes=total_new if total_new is not None else size(_TOTAL_OLD, "total capacity"),
        free_bytes=free_new if free_new is not None else size(_FREE_OLD, "free"),
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        reserved_unallocated_bytes=unallocated,
        process_in_use_bytes=size(_THIS_PROCESS, "this process's memory in use"),
        private_pool_bytes=size(_PRIVATE_POOL, "private pools"),
        gpu_index=_int(_GPU_INDEX, message, MAX_GPU_INDEX, "GPU index", notes),
        other_processes=_other_processes(message, notes),
        alloc_conf=None if conf is None else conf.group(2),
        alloc_conf_var=None if conf is None else conf.group(1),
        suggests_max_split=_MAX_SPLIT_HINT.search(message) is not None,
        notes=tuple(notes),
    )


def _other_processes(message: str, notes: list[str]) -> tuple[OtherProcess, ...]:
    processes = []
    for match in _OTHER_PROCESS.finditer(message):
        pid = bounded_int(match["pid"], MAX_PID)
        used = _size_of(match, "memory of another process", notes)
        if pid is None:
            notes.append(f"process id {match['pid']} beyond {MAX_PID}: dropped")
        elif used is not None:
            processes.append(OtherProcess(pid=pid, bytes=used))
    return tuple(processes)


def host_ram_is_certain(text: str) -> bool:
    """True when a host-RAM line names the OOM killer; False for a bare SIGKILL."""
    return any(match.group("sigkill") is None for match in _HOST_RAM.finditer(text))


def nccl_request_bytes(text: str) -> int | None:
    """The N of NCCL's `Failed to CUDA calloc N bytes`, printed on the line after its OOM."""
    return _int(_NCCL_REQUEST, text, MAX_BYTES, "requested bytes", [])


def _bytes(pattern: re.Pattern[str], text: str, what: str, notes: list[str]) -> int | None:
    match = pattern.search(text)
    return None if match is None else _size_of(match, what, notes)


def _size_of(match: re.Match[str], what: str, notes: list[str]) -> int | None:
    try:
        return size_from_parts(match["v_n"], match["v_u"])
    except SizeParseError as error:
        notes.append(f"{what}: {error}; dropped")
        return None


def _int(
    pattern: re.Pattern[str], text: str, limit: int, what: str, notes: list[str]
) -> int | None:
    match = pattern.search(text)
    if match is None:
        return None
    digits = next(group for group in match.groups() if group is not None)
    value = bounded_int(digits, limit)
    if value is None:
        notes.append(f"{what} {digits} beyond {limit}: dropped")
    return value
