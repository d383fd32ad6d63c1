"""Typed evidence shared by the parsers, the node probe, the diagnosis and the record.

These are the contract between the parts: parsers produce them, `rules.dispatch.diagnose`
consumes them, the store serialises them. Every memory figure is in exact bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from daemon.slurm.records import SlurmJob

# Plausible ranges. A parser drops a number beyond its range with a note before it enters a
# record: the store keeps steps in signed 64-bit columns and ranks in 32-bit ones, and a figure
# no job can reach is garbage in a log, not evidence. Sizes are bounded by `units.MAX_BYTES`.
MAX_RANK = 2**20  # a million ranks: beyond any job, well within a 32-bit column
MAX_STEP = 2**62  # within a signed 64-bit column with room to add to it
MAX_PID = 2**22  # Linux's PID_MAX_LIMIT
MAX_GPU_INDEX = 2**10


class OomFamily(StrEnum):
    """Which software reported running out of memory."""

    TORCH_ALLOCATOR = "torch_allocator"  # torch.[cuda.]OutOfMemoryError, any version's wording
    CUDA_RUNTIME = "cuda_runtime"  # "CUDA error: out of memory"
    CUBLAS = "cublas"  # CUBLAS_STATUS_ALLOC_FAILED
    CUDNN = "cudnn"  # CUDNN_STATUS_ALLOC_FAILED / NOT_ENOUGH_WORKSPACE
    NCCL = "nccl"  # NCCL "Cuda failure 'out of memory'"
    XLA = "xla"  # JAX/XLA RESOURCE_EXHAUSTED
    ONNX_RUNTIME = "onnxruntime"  # its BFC arena: "Failed to allocate memory for requested buffer"
    # An inference engine found no room for its KV cache in the GPU memory left to it after the
    # weights (vLLM "No available memory for the cache blocks", SGLang "Not enough memory.
    # Please try to increase --mem-fraction-static"): its sizing, with no allocator figures.
    KV_CACHE = "kv_cache"
    # cuBLAS/cuDNN could not create its handle (`*_STATUS_NOT_INITIALIZED`): most often out of
    # device memory, but a broken install reads the same, so it is weak evidence of an OOM.
    LIBRARY_HANDLE = "library_handle"
    HOST_RAM = "host_ram"  # kernel / cgroup / slurmstepd OOM kill, bare "Killed", exit 137


class Phase(StrEnum):
    """Where in the training loop the failure happened, read from the traceback frames."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer_step"
    EVAL = "eval"
    GENERATE = "generate"  # sampling / decoding (model.generate, an inference engine's step)
    CHECKPOINT_SAVE = "checkpoint_save"
    DATA_LOADING = "data_loading"
    SETUP = "setup"  # before training: model placement, loading weights, wrapping (DDP, FSDP)
    UNKNOWN = "unknown"


class RootCause(StrEnum):
    """What the earliest root failure in the log was, before any diagnosis of why.

    The cascade it sets off (collective timeouts on the other ranks, the agent's SIGTERMs,
    "process group destroyed") is never the root cause; a collective timeout is the root cause
    only when no earlier failure is in view.
    """

    ACCELERATOR_OOM = "cuda_oom"  # device memory: CUDA, HIP, XPU, MPS, XLA, cuBLAS/cuDNN/NCCL
    HOST_RAM = "host_ram"  # killed for host memory: SIGKILL with no traceback, cgroup oom-kill
    GPU_FAULT = "gpu_fault"  # the device failed: illegal access, ECC, fallen off the bus, XID
    COLLECTIVE_TIMEOUT = "nccl_timeout"
    OTHER_ERROR = "other_error"  # any other exception or non-zero exit


@dataclass(frozen=True)
class GpuFault:
    """A GPU fault the job's own log shows (`CUDA error: an illegal memory access ...`)."""

    line: str  # the line that shows it, as printed
    words: str  # what it means, in the XID catalog's words where an XID number is printed
    xid: int | None = None


@dataclass(frozen=True)
class OtherProcess:
    """A `Process N has X memory in use` line of the OOM message."""

    pid: int
    bytes: int


@dataclass(frozen=True)
class OomReport:
    """One out-of-memory message with every number it printed; None where it printed none."""

    family: OomFamily
    message: str
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_in_use_bytes: int | None = None
    private_pool_bytes: int | None = None
    gpu_index: int | None = None
    other_processes: tuple[OtherProcess, ...] = ()
    alloc_conf: str | None = None  # PYTORCH_[CUDA_]ALLOC_CONF value, if the message named one
    suggests_max_split: bool = False  # the message carried the max_split_size_mb hint
    alloc_conf_var: str | None = None  # which spelling it named: PYTORCH_ALLOC_CONF or ..._CUDA_...
    notes: tuple[str, ...] = ()  # figures the message printed that were dropped, and why
    allowed_bytes: int | None = None  # a cap it printed: `N allowed` (per-process memory
    # fraction) or MPS's `max allowed` (its high watermark)
    other_allocations_bytes: int | None = None  # MPS's `other allocations` (outside its heaps)
    request_beyond_any_device: bool = False  # `more than 1EB`, or a request past the size range


@dataclass(frozen=True)
class LogFindings:
    """What the job's log says about the failure: who failed first, where, when, and how."""

    rank: int | None = None
    node: str | None = None
    step: int | None = None
    max_step_seen: int | None = None
    phase: Phase = Phase.UNKNOWN
    frames: tuple[str, ...] = ()  # function names on the failing stack, innermost last
    heavy_kernels: tuple[str, ...] = ()  # attention / cuBLAS / cuDNN / MoE frames seen
    oom: OomReport | None = None
    root_failure_line: str | None = None
    cascade_ranks: tuple[int, ...] = ()  # ranks that died of the root failure (NCCL timeouts...)
    exit_code: int | None = None
    killed_by_signal: int | None = None
    notes: tuple[str, ...] = ()  # what the scan could not read, and why
    error_type: str | None = None  # exception class of the root failure, when it was one
    job_pids: tuple[int, ...] = ()  # pids the log names as the job's own ranks (torchrun)
    traceback_seen: bool = False  # the root failure came with a Python traceback
    bytes_scanned: int = 0  # how much of the log's end the scan read
    root_cause: RootCause | None = None  # None: the log shows no failure at all
    gpu_fault: GpuFault | None = None
    step_line: str | None = None  # the progress line the step was read from
    phase_line: str | None = None  # the frame or log line that decided the phase


class ProbeVerdict(StrEnum):
    """The node's health as the probe saw it."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAULTY = "faulty"
    UNREACHABLE = "unreachable"


class FindingKind(StrEnum):
    """What is wrong with a node, one kind per fact; the fleet sweep's policy names these in
    `sweep.drain_now` / `drain_after_job`. Listed from the most to the least decisive."""

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


class XidPolicy(StrEnum):
    """What an XID code means for the node (drain it, blame the job, or nothing)."""

    HARDWARE = "hardware"
    APPLICATION = "application"
    DRIVER = "driver"
    IGNORE = "ignore"


@dataclass(frozen=True)
class XidEvent:
    """One `NVRM: Xid` kernel line, with its catalog entry."""

    code: int
    pci_bus_id: str | None
    pid: int | None
    process_name: str | None
    time: datetime | None
    text: str
    policy: XidPolicy
    meaning: str


@dataclass(frozen=True)
class ComputeApp:
    """A process holding memory on a GPU (`nvidia-smi --query-compute-apps`)."""

    gpu_uuid: str
    pid: int | None
    process_name: str | None  # None where nvidia-smi cannot name it (a zombie, another namespace)
    used_bytes: int | None


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's memory health: row remaps, ECC counts, retired pages, and who uses it."""

    index: int
    uuid: str | None
    pci_bus_id: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure_occurred: bool | None = None
    ecc_volatile_uncorrectable: int | None = None
    ecc_aggregate_uncorrectable: int | None = None
    ecc_volatile_correctable: int | None = None
    ecc_aggregate_correctable: int | None = None
    retired_pages_pending: bool | None = None
    compute_apps: tuple[ComputeApp, ...] = ()


@dataclass(frozen=True)
class HostOomKill:
    """A host OOM-killer line from the kernel log (global or memory cgroup)."""

    time: datetime | None
    pid: int | None
    process_name: str | None
    cgroup: bool
    text: str


@dataclass(frozen=True)
class NodeProbe:
    """One node's state as the probe over SSH found it, with a verdict and its reasons."""

    node: str
    probed_at: datetime
    verdict: ProbeVerdict
    reasons: tuple[str, ...]
    gpus: tuple[GpuHealth, ...] = ()
    xid_events: tuple[XidEvent, ...] = ()
    host_oom_kills: tuple[HostOomKill, ...] = ()
    error: str | None = None  # why it is unreachable or unreadable
    # GPUs nvidia-smi named but could not reach (`Unable to determine the device handle`), each
    # as `GPU 1 (0000:34:00.0): Unknown Error`: lost to the driver, whatever else was read.
    lost_gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Evidence:
    """Everything gathered about one failed job; any part may be missing."""

    log: LogFindings = field(default_factory=LogFindings)
    job: SlurmJob | None = None
    probe: NodeProbe | None = None
    job_gpu_uuids: tuple[str, ...] = ()  # the GPUs the failing rank's job held, when known
    # Whether the run already had `expandable_segments:True` in PYTORCH_[CUDA_]ALLOC_CONF (its
    # lineage template's env, or `diagnose --alloc-conf`); None when not known.
    expandable_segments: bool | None = None
