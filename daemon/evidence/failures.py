"""Failure signatures of a job's own log that are not out-of-memory messages: GPU faults, the
cascade a failure sets off (collective timeouts, communicator errors, stop signals), and the
cancels that are no failure of any rank.

Data with its provenance, like the launchers' vocabulary (`launchers.py`) and the XID catalog:
the scanner tests a line in a fixed order (a cancel of the whole job, a launcher's report of a
death, an out-of-memory message, a GPU fault, then the cascade, then any other exception; an
exception whose words are a timeout's or a broken communicator's is the cascade). Every pattern
is linear in the line's length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

from daemon.evidence.records import GpuFault
from daemon.evidence.units import bounded_int


@dataclass(frozen=True)
class FaultSignature:
    """A GPU fault as the CUDA runtime, the driver or a tool prints it."""

    name: str
    pattern: re.Pattern[str]
    words: str  # what it means, for a person reading the verdict
    source: str


# The CUDA runtime's `cudaGetErrorString` texts (what torch prints after `CUDA error: `; HIP
# prints the same words), their enum names, and the driver's and nvidia-smi's own lines.
GPU_FAULTS: tuple[FaultSignature, ...] = (
    FaultSignature(
        "illegal address",
        re.compile(
            r"an illegal memory access was encountered|cudaErrorIllegalAddress"
            r"|CUDA_ERROR_ILLEGAL_ADDRESS|Memory access fault by GPU node"
        ),
        "the GPU faulted on a memory access (cudaErrorIllegalAddress, CUDA error 700;"
        " ROCm: memory access fault)",
        "CUDA runtime API, cudaError; samples 012, 013, 014",
    ),
    FaultSignature(
        "launch failure",
        re.compile(r"unspecified launch failure|cudaErrorLaunchFailure|CUDA_ERROR_LAUNCH_FAILED"),
        "a kernel failed on the GPU (cudaErrorLaunchFailure, CUDA error 719)",
        "CUDA runtime API, cudaError; samples 035-039",
    ),
    FaultSignature(
        "uncorrectable ecc",
        re.compile(
            r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable"
            r"|CUDA_ERROR_ECC_UNCORRECTABLE"
        ),
        "the GPU's memory reported an uncorrectable ECC error (cudaErrorECCUncorrectable,"
        " CUDA error 214)",
        "CUDA runtime API, cudaError; sample 021",
    ),
    FaultSignature(
        "uncorrectable nvlink",
        re.compile(
            r"uncorrectable NVLink error|cudaErrorNvlinkUncorrectable"
            r"|CUDA_ERROR_NVLINK_UNCORRECTABLE"
        ),
        "an uncorrectable NVLink error (cudaErrorNvlinkUncorrectable, CUDA error 220)",
        "CUDA runtime API, cudaError",
    ),
    FaultSignature(
        "fallen off the bus",
        re.compile(r"[Ff]allen off the bus"),
        "the GPU fell off the bus: the driver lost the device",
        "the NVIDIA driver's `GPU has fallen off the bus` (Xid 79)",
    ),
    FaultSignature(
        "device handle",
        re.compile(
            r"Unable to determine the device handle for [^\n]{0,64}?: (?:Unknown Error|GPU is lost)"
        ),
        "nvidia-smi could not reach the GPU (no device handle: the device is lost or faulted)",
        "nvidia-smi; sample 022",
    ),
)

MAX_XID = 9999  # four digits: the catalog names unknown codes as such
# An XID number printed in the job's log: the kernel's `NVRM: Xid (PCI:0000:3b:00): 79, ...`
# (as `kernel_log` reads it) or a tool's `Xid 79` / `XID: 79`.
XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?[0-9A-Fa-f:.]{4,16}\):\s{0,4}(?P<xid>[0-9]{1,4})\b"
    r"|\b(?:Xid|XID|xid)(?: error)?(?: |: )(?P<xid2>[0-9]{1,4})\b"
)


# Host-RAM kills no OOM message reports: Ray's memory monitor (`ray.exceptions.OutOfMemoryError:
# Task was killed due to the node running low on memory.`, python/ray/_private/memory_monitor),
# whose exception name reads like torch's device OOM.
HOST_RAM_KILLS = re.compile(r"killed due to the node running low on memory")


class CascadeKind(StrEnum):
    """How a rank that did not fail first reports another's failure."""

    TIMEOUT = "timeout"  # it waited for a peer that never came (a collective, the store)
    COMM = "comm"  # its communicator or connection to a peer broke
    STOP = "stop"  # it was told to stop (the launcher's SIGTERM, Slurm's kill)
    OTHER = "other"  # the watchdog's and the launcher's follow-up lines


# In order: a line is the first kind whose pattern it holds. The watchdog's own timeout words
# in every torch era (`Watchdog caught collective operation timeout`, 2.2+ `Timeout at NCCL
# work`); samples 006, 007, 008, 053. Horovod's stall warning ("... are waiting for remainder of
# ranks for more than 60 seconds", horovod/common/stall_inspector.cc) is a timeout too.
CASCADES: tuple[tuple[CascadeKind, re.Pattern[str]], ...] = (
    (
        CascadeKind.TIMEOUT,
        re.compile(
            r"collective operation timeout|milliseconds before timing out|Timeout at NCCL work"
            r"|Timed out waiting|Socket Timeout|RendezvousTimeoutError|DistStoreError: Timed out"
            r"|watchdog hang|watchdog got stuck|waiting for remainder of ranks"
        ),
    ),
    (
        CascadeKind.COMM,
        re.compile(
            r"NCCL error|ncclRemoteError|ncclSystemError|ncclInternalError|ncclUnhandledCudaError"
            r"|remote process exited|Connection closed by remote peer|Connection reset by peer"
            r"|Broken pipe|RendezvousClosedError|communicator was aborted|NCCL communicator"
            r"|Connection refused|got completion with error"
            # Horovod's SHUT_DOWN_ERROR (horovod/common/operations.cc): every rank but the
            # one that raised says this once the job shuts down (held-out sample 010)
            r"|Horovod has been shut down"
        ),
    ),
    (
        CascadeKind.STOP,
        re.compile(
            r"closing signal SIG|received signal 15|SignalException|got signal: [0-9]"
            r"|KeyboardInterrupt|Terminating (?:StepId|job step)|\bTerminated\b|Killing subprocess"
            r"|Force Terminated|Job step aborted|CANCELLED AT"
        ),
    ),
    (
        CascadeKind.OTHER,
        re.compile(
            r"ProcessGroupNCCL|DistBackendError|ChildFailedError|TCPStore"
            r"|detected by watchdog|watchdog thread terminated|Some NCCL operations have failed"
            r"|Worker group failed"
        ),
    ),
)

# A stop from outside the job, after which nothing is a rank's own failure: Slurm's time limit
# or preemption (sample 051), torchrun's agent receiving SIGTERM (sample 034: `Received 15 death
# signal, shutting down workers`).
CANCEL = re.compile(
    r"CANCELLED AT \S{1,40} DUE TO (?:TIME LIMIT|PREEMPTION)|Received [0-9]{1,3} death signal"
)


def cascade_kind(text: str) -> CascadeKind | None:
    """The cascade kind of a line, or None if it is not part of a cascade."""
    for kind, pattern in CASCADES:
        if pattern.search(text):
            return kind
    return None


# Words every signature above holds one of: most lines hold none, and a substring test is the
# cheapest way to say so (a line is tested before any of the patterns runs).
_FAULT_WORDS = (
    "illegal memory access",
    "IllegalAddress",
    "ILLEGAL_ADDRESS",
    "Memory access fault",
    "launch failure",
    "LaunchFailure",
    "LAUNCH_FAILED",
    "ECC",
    "NVLink",
    "Nvlink",
    "NVLINK",
    "off the bus",
    "device handle",
    "Xid",
    "XID",
    "xid",
)


def gpu_fault(text: str) -> GpuFault | None:
    """The GPU fault a line shows, with the XID catalog's words where it prints an XID."""
    if not any(word in text for word in _FAULT_WORDS):
        return None
    xid_match = XID.search(text)
    if xid_match is not None:
        code = bounded_int(xid_match.group("xid") or xid_match.group("xid2"), MAX_XID)
        if code is not None and code >= 1:
            return GpuFault(line=text, words=f"XID {code}: {_xid_meaning(code)}", xid=code)
    for signature in GPU_FAULTS:
        if signature.pattern.search(text):
            return GpuFault(line=text, words=signature.words)
    return None


@cache
def _xid_meaning(code: int) -> str:
    """NVIDIA's words for an XID, from the catalog as shipped (the operator's overrides change
    policies, not meanings). Imported here: the catalog's loader brings pydantic, which a scan
    of a log that prints no XID should not pay for."""
    from daemon.evidence.xid import load_catalog  # noqa: PLC0415

    return load_catalog().entry(code).meaning
