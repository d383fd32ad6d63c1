"""The out-of-memory message parser: every number a message printed.

Which software ran out (its family) is `oom_family`'s; cutting the message out of its lines and
joining a wrapped one is `oom_message`'s.

Pure: text in, `OomReport` out. Each figure is read by its own pattern, so a message cut in
the middle (a truncated log) keeps the numbers it still holds and loses only the rest.
Sizes are exact to what was printed (see `units`): PyTorch rounds to 0.01 of the unit.
Every pattern runs in linear time on any text, and a figure beyond its plausible range (a size
beyond 1 EiB, a pid beyond Linux's limit) is dropped with a note on the report, never stored.

PyTorch wordings covered, oldest first (c10/cuda/CUDACachingAllocator.cpp):
- 1.0-1.3: `(GPU 0; X total capacity; Y already allocated; Z free; W cached)`; a vendor
  build adds `; V inactive` after `cached` (tests/data/real/oom/078)
- 1.4-2.0: `...; W reserved in total by PyTorch)`, later with the `max_split_size_mb` hint
- 2.1: `GPU 0 has a total capacty of X of which Y is free. [Process N has X memory in use.]
  [Including non-PyTorch memory, this process has X memory in use.] Of the allocated memory
  A is allocated by PyTorch, and B is reserved by PyTorch but unallocated.` (sic: capacty)
- 2.2+: `capacity`, `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, then private pools
  (`with P allocated in private pools (e.g., CUDA Graphs)`) and `PYTORCH_ALLOC_CONF`.
- every era: `N allowed; ` before the allocated figures when a per-process memory fraction is
  set (`allowed_info`), and `Tried to allocate more than 1EB memory.` for a request past 1 EiB.
- the same allocator on ROCm (`HIP out of memory`) and Intel GPUs (`XPU out of memory`; IPEX's
  old wording and the new one print no free figure), and Apple's `MPS backend out of memory
  (MPS allocated: A, other allocations: O, max allowed: M). Tried to allocate X on private
  pool.` with binary `KB`/`MB`/`GB` (aten/src/ATen/mps/MPSAllocator.mm).
- the cudaMallocAsync backend (`PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`,
  c10/cuda/CUDAMallocAsyncAllocator.cpp): `Allocation on device N would exceed allowed memory.
  (out of memory)` then `Currently allocated : A`, `Requested : X`, `Device limit : T`,
  `Free (according to CUDA): F` and `PyTorch limit (set by user-supplied memory fraction) : V`,
  one per line with the keys padded to 24 columns; real posts collapse the padding or join
  the lines into one (tests/data/real/oom/138-141). It has no reserved-unallocated figure.

Real logs and posts carry the message in other shapes (tests/data/real/oom/README.md): its
first words lost (it starts at `Tried to allocate 20.00 MiB (GPU 0; ...`, or is only the
parenthetical), glued to other text (`whyCUDA out of memory`, `RuntimeError:CUDA`), inside a
repr or a JSON string, in markdown bold, followed by other text on its line, and wrapped over
lines. `parse_oom_block` reads a message from its first line and the lines after it.

The families that print no device figure (a host's RAM, an engine's KV cache, a library's failed
handle) give only the message; a failed handle followed by a device OOM message
(real/oom/062) is read as that message.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from daemon.evidence.oom_family import NO_DEVICE_FIGURES, detect_family
from daemon.evidence.oom_message import (
    MAX_BLOCK_LINES,
    MAX_MESSAGE_CHARS,
    around_message,
    from_trigger,
    joined_message,
    message_lines,
)
from daemon.evidence.records import MAX_GPU_INDEX, MAX_PID, OomFamily, OomReport, OtherProcess
from daemon.evidence.units import (
    MAX_BYTES,
    SIZE_PATTERN,
    SizeBeyondRange,
    SizeParseError,
    bounded_int,
    size_from_parts,
)


def _size(name: str) -> str:
    """SIZE_PATTERN with its groups renamed, so several sizes can live in one pattern."""
    return SIZE_PATTERN.replace("?P<number>", f"?P<{name}_n>").replace("?P<unit>", f"?P<{name}_u>")


def _mps_size(name: str) -> str:
    """A size as the MPS allocator prints it: `KB`/`MB`/`GB` (binary) besides bytes and `GiB`
    (its newer builds print c10's units)."""
    return (
        rf"(?<![0-9.\-])(?P<{name}_n>[0-9]{{1,30}}(?:\.[0-9]{{1,30}})?)\s?"
        rf"(?P<{name}_u>bytes|[KMGTPE]i?B)\b"
    )


_REQUESTED = re.compile(r"Tried to allocate " + _size("v"))
_REQUEST_BEYOND = re.compile(r"Tried to allocate more than 1EB")
_GPU_INDEX = re.compile(r"\(GPU ([0-9]{1,30});|GPU ([0-9]{1,30}) has a total capac")
_TOTAL_OLD = re.compile(_size("v") + r" total capac(?:ity|ty)\b")
_TOTAL_NEW = re.compile(r"total capac(?:ity|ty) of " + _size("v"))
_ALLOCATED_OLD = re.compile(_size("v") + r" already allocated")
_FREE_OLD = re.compile(_size("v") + r" free[;)]")
_FREE_NEW = re.compile(r"of which " + _size("v") + r" is free")
_RESERVED_OLD = re.compile(_size("v") + r" reserved in total by PyTorch", re.IGNORECASE)
# 1.0-1.3 printed `cached` as the cached-but-unallocated part (it can be below `allocated`);
# a vendor build prints `; N inactive` after it (real/oom/078).
_CACHED_OLD = re.compile(_size("v") + r" cached[;)]")
_ALLOWED = re.compile(_size("v") + r" allowed;")  # the per-process memory fraction's cap
_ALLOCATED_NEW = re.compile(r"Of the allocated memory " + _size("v") + r" is allocated by PyTorch")
_PRIVATE_POOL = re.compile(r"with " + _size("v") + r" allocated in private pools")
_UNALLOCATED_NEW = re.compile(_size("v") + r" is reserved by PyTorch but unallocated")
_THIS_PROCESS = re.compile(r"this process has " + _size("v") + r" memory in use")
_OTHER_PROCESS = re.compile(r"Process (?P<pid>[0-9]{1,30}) has " + _size("v") + r" memory in use")
_ALLOC_CONF = re.compile(r"\b(PYTORCH_(?:CUDA_|HIP_)?ALLOC_CONF)\b(?:=([\w:,.]*\w))?")
_MAX_SPLIT_HINT = re.compile(r"max_split_size_mb")
_MPS = re.compile(r"MPS backend out of memory|MPS allocated: ")
_MPS_ALLOCATED = re.compile(r"MPS allocated: " + _mps_size("v"))
_MPS_OTHER = re.compile(r"other allocations: " + _mps_size("v"))
_MPS_ALLOWED = re.compile(r"max allowed: " + _mps_size("v"))
_MPS_REQUESTED = re.compile(r"Tried to allocate " + _mps_size("v") + r" on (?:private|shared) pool")
# The cudaMallocAsync backend's message (c10/cuda/CUDAMallocAsyncAllocator.cpp): each figure
# after its key, padded with spaces to one column (collapsed to one space in real posts).
_ASYNC = re.compile(r"would exceed allowed memory")
_ASYNC_DEVICE = re.compile(r"Allocation on device ([0-9]{1,30}) would exceed")
_ASYNC_ALLOCATED = re.compile(r"Currently allocated\s{0,40}: ?" + _size("v"))
_ASYNC_REQUESTED = re.compile(r"Requested\s{0,40}: ?" + _size("v"))
_ASYNC_LIMIT = re.compile(r"Device limit\s{0,40}: ?" + _size("v"))
_ASYNC_FREE = re.compile(r"Free \(according to CUDA\)\s{0,40}: ?" + _size("v"))
# The memory-fraction cap; 17179869184.00 GiB (2^64 bytes) is "no cap" and beyond MAX_BYTES.
_ASYNC_CAP = re.compile(r"memory fraction\)\s{0,40}: ?" + _size("v"))

_XLA_REQUEST = re.compile(
    r"(?:trying to allocate|allocating) ([0-9]{1,30}) bytes|\(([0-9]{1,30})B\)"
)
_XLA_REQUEST_SIZE = re.compile(
    r"(?:trying to allocate|allocate request for|allocating) " + _size("v")
)
# TF's stream executor: `failed to allocate 32.00M (33554432 bytes) from device` (062, 063, 097)
_BYTES_IN_PARENS = re.compile(r"\(([0-9]{1,30}) bytes\)")
_NCCL_REQUEST = re.compile(r"Failed to CUDA calloc (?:async )?([0-9]{1,30}) bytes")
_ONNX_REQUEST = re.compile(r"requested buffer of size ([0-9]{1,30})")
# Figures the block's second reading (wrapped lines glued without a space) may fill in.
_FIGURES = (
    "requested_bytes",
    "total_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "reserved_unallocated_bytes",
    "process_in_use_bytes",
    "private_pool_bytes",
    "gpu_index",
    "allowed_bytes",
    "other_allocations_bytes",
)


def parse_oom(text: str) -> OomReport | None:
    """The OOM report in `text` (one message, possibly with lines that follow it), or None."""
    family = detect_family(text)
    return None if family is None else parse_oom_as(text, family)


def parse_oom_as(text: str, family: OomFamily) -> OomReport:
    """`parse_oom` of a text whose family `detect_family` gave already (a scan asks once)."""
    lines = around_message(text).splitlines() or [""]
    start = next((i for i, line in enumerate(lines) if detect_family(line) is family), 0)
    return _parse_block(lines[start : start + MAX_BLOCK_LINES], family)


def parse_oom_block(lines: Sequence[str]) -> OomReport | None:
    """The OOM message that starts on `lines[0]`, read with the lines that follow it.

    `lines` are one process's output with any log prefix removed: the line that reports the
    out-of-memory and up to `MAX_BLOCK_LINES - 1` after it. Lines that continue a wrapped
    message (hard-wrapped at a terminal's width, word-wrapped by a viewer or by rich, the
    exception type alone on its line) are joined to it; a blank line, a traceback, a new log
    record or the message's own last words end it. None when `lines[0]` reports no OOM.
    """
    if not lines:
        return None
    head = from_trigger(lines[0])
    family = detect_family(head)
    return None if family is None else _parse_block([head, *lines[1:MAX_BLOCK_LINES]], family)


def _parse_block(lines: list[str], family: OomFamily) -> OomReport:
    # a failed handle is weaker evidence than a device OOM message after it: read that one
    if family is OomFamily.LIBRARY_HANDLE and (later := _device_oom_after(lines[1:])):
        return later
    notes: list[str] = []
    pieces = message_lines(lines, family)
    message = joined_message(pieces, hard_wrapped=False)
    if family is OomFamily.TORCH_ALLOCATOR:
        report = _torch_report(message, notes)
        if len(pieces) > 1:
            # A terminal that wraps at its width splits words and numbers anywhere
            # (`Memory Mana` / `gement`, `12.0` / `0 GiB`): read it again glued without a
            # space, and take from that reading only the figures the first one lacks.
            report = _fill_missing(
                report, _torch_report(joined_message(pieces, hard_wrapped=True), [])
            )
        return report
    if family is OomFamily.HOST_RAM:
        return OomReport(family=family, message=message)
    following = "\n".join(line[:MAX_MESSAGE_CHARS] for line in lines[len(pieces) :])
    requested, beyond = None, False
    for text in (message, following):
        requested, beyond = _request_of(family, text, notes)
        if requested is not None or beyond:
            break
    return OomReport(
        family=family,
        message=message,
        requested_bytes=requested,
        request_beyond_any_device=beyond,
        notes=tuple(notes),
    )


def _device_oom_after(lines: list[str]) -> OomReport | None:
    """The device OOM message a failed handle was the first symptom of, in the lines after it
    (real/oom/062: TF's `failed to create cublas handle` twice, then the driver's
    `CUDA_ERROR_OUT_OF_MEMORY` with the bytes it could not get)."""
    for index, line in enumerate(lines):
        family = detect_family(from_trigger(line))
        if family is not None and family not in NO_DEVICE_FIGURES:
            return parse_oom_block(lines[index:])
    return None


def _request_of(family: OomFamily, text: str, notes: list[str]) -> tuple[int | None, bool]:
    """A non-PyTorch message's request in bytes, and whether it was beyond any device."""
    patterns: tuple[re.Pattern[str], ...] = (_BYTES_IN_PARENS,)
    if family in NO_DEVICE_FIGURES:
        patterns = ()
    elif family is OomFamily.XLA:
        patterns = (_XLA_REQUEST, _BYTES_IN_PARENS)
    elif family is OomFamily.NCCL:
        patterns = (_NCCL_REQUEST,)
    elif family is OomFamily.ONNX_RUNTIME:
        patterns = (_ONNX_REQUEST,)
    for pattern in patterns:
        match = pattern.search(text)
        if match is None:
            continue
        digits = next(group for group in match.groups() if group is not None)
        value = bounded_int(digits, MAX_BYTES)
        if value is None:
            notes.append(f"requested bytes {digits[:40]} beyond {MAX_BYTES}: dropped")
            return None, True
        return value, False
    if family is OomFamily.XLA and (match := _XLA_REQUEST_SIZE.search(text)):
        return _size_of(match, "requested size", notes), _beyond(match)
    return None, False


def _fill_missing(report: OomReport, other: OomReport) -> OomReport:
    changes: dict[str, Any] = {
        name: getattr(other, name)
        for name in _FIGURES
        if getattr(report, name) is None and getattr(other, name) is not None
    }
    if not report.other_processes and other.other_processes:
        changes["other_processes"] = other.other_processes
    if not changes:
        return report
    notes = report.notes + tuple(note for note in other.notes if note not in report.notes)
    return dataclasses.replace(report, notes=notes, **changes)


def _torch_report(message: str, notes: list[str]) -> OomReport:
    def size(pattern: re.Pattern[str], what: str) -> int | None:
        return _bytes(pattern, message, what, notes)

    if _MPS.search(message):
        return _mps_report(message, notes)
    if _ASYNC.search(message):
        return _async_report(message, notes)
    requested_match = _REQUESTED.search(message)
    requested = (
        None if requested_match is None else _size_of(requested_match, "requested size", notes)
    )
    beyond = _REQUEST_BEYOND.search(message) is not None or (
        requested_match is not None and _beyond(requested_match)
    )
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
        requested_bytes=requested,
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
        allowed_bytes=size(_ALLOWED, "allowed"),
        request_beyond_any_device=beyond,
    )


def _mps_report(message: str, notes: list[str]) -> OomReport:
    """Apple's allocator prints its heap, what else the process holds, and its watermark."""
    requested_match = _MPS_REQUESTED.search(message)
    requested = (
        None if requested_match is None else _size_of(requested_match, "requested size", notes)
    )
    return OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message=message,
        requested_bytes=requested,
        allocated_bytes=_bytes(_MPS_ALLOCATED, message, "MPS allocated", notes),
        other_allocations_bytes=_bytes(_MPS_OTHER, message, "other allocations", notes),
        allowed_bytes=_bytes(_MPS_ALLOWED, message, "max allowed", notes),
        request_beyond_any_device=requested_match is not None and _beyond(requested_match),
        notes=tuple(notes),
    )


def _async_report(message: str, notes: list[str]) -> OomReport:
    """The cudaMallocAsync backend: the driver's pool serves requests, so no reserved figure."""
    requested_match = _ASYNC_REQUESTED.search(message)
    requested = (
        None if requested_match is None else _size_of(requested_match, "requested size", notes)
    )
    cap_match = _ASYNC_CAP.search(message)
    cap = None
    if cap_match is not None and not _beyond(cap_match):  # beyond: the no-cap sentinel
        cap = _size_of(cap_match, "memory fraction limit", notes)
    return OomReport(
        family=OomFamily.TORCH_ALLOCATOR,
        message=message,
        requested_bytes=requested,
        total_bytes=_bytes(_ASYNC_LIMIT, message, "device limit", notes),
        free_bytes=_bytes(_ASYNC_FREE, message, "free", notes),
        allocated_bytes=_bytes(_ASYNC_ALLOCATED, message, "currently allocated", notes),
        gpu_index=_int(_ASYNC_DEVICE, message, MAX_GPU_INDEX, "GPU index", notes),
        allowed_bytes=cap,
        request_beyond_any_device=requested_match is not None and _beyond(requested_match),
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


def _beyond(match: re.Match[str]) -> bool:
    """A printed size past any device's memory (not merely malformed)."""
    try:
        size_from_parts(match["v_n"], match["v_u"])
    except SizeBeyondRange:
        return True
    except SizeParseError:
        return False
    return False


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
